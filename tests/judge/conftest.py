"""The judge tests' one vLLM process (session scope): vLLM CPU 0.32.0 in its own venv (`.vllm`, built by
.ci/vllm-env.sh), driven as a subprocess that imports vLLM once and serves two targets:

- the built-in plain Qwen3 (fp32, head_dim 32): every drafter this project writes (DFlash at its K, and
  at K 3 under vLLM's probabilistic rule; EAGLE-3 in each layout written; n-gram; a drafter vLLM
  refuses; DFlash2, which vLLM CPU refuses) and the target alone, on a greedy cache and a seeded
  T 0.7 / top-p 0.9 / top-k 20 one;
- the built-in hybrid Qwen3.5 (bf16: vLLM CPU's Gated DeltaNet kernel) with its own MTP head, on the
  same two settings.

One engine per target and drafter (vllm.LLM), every run of it in that engine; tests read
``served[name][setting]`` (scorer.studies.vllm_judge.Served) and ``plans`` (the raw engines)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from method_families import METHOD_ENGINES, method_drafters
from vllm_env import NGRAM

import hscache

SETTINGS = ("t0", "t0.7")


def _extract(out: Path, target: str, dtype: str, layers: str, sampling=None) -> Path:
    from hscache.store.sampling import GREEDY

    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), model=target, layers=layers, max_new_tokens=16, dtype=dtype, limit=4,
            sampling=sampling or GREEDY, mtp=target == "builtin:tiny-qwen3.5",
        )
    )  # fmt: skip
    return out


def _caches(root: Path, target: str, dtype: str, layers: str) -> dict[str, Path]:
    from hscache.store.sampling import SamplingSetting

    sampled = SamplingSetting.from_flags(temperature=0.7, top_p=0.9, top_k=20, seed=5, samples_per_prompt=2)
    return {
        "t0": _extract(root / "greedy", target, dtype, layers),
        "t0.7": _extract(root / "sampled", target, dtype, layers, sampled),
    }


@pytest.fixture(scope="session")
def judge_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny-qwen3 fp32, layers 0-4, 6, 7 (1,3,4: the engines' default EAGLE-3 layers, which the original
    release layout reads; 0,2,6: where vLLM serves a SpecForge export trained on 1,3,7 that names its
    layers only in eagle_config), 4 prompts x 16 tokens: greedy, and seeded T 0.7 / top-p 0.9 / top-k 20
    with 2 samples per prompt."""
    return _caches(tmp_path_factory.mktemp("judge"), "builtin:tiny-qwen3", "fp32", "0,1,2,3,4,6,7")


@pytest.fixture(scope="session")
def mtp_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny-qwen3.5 (hybrid) in bf16 with its MTP head, the same two settings."""
    return _caches(tmp_path_factory.mktemp("judge-mtp"), "builtin:tiny-qwen3.5", "bf16", "1,3,7")


@pytest.fixture(scope="session")
def judge_drafters(judge_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Drafters of the greedy tiny-qwen3 cache, as this project writes them: DFlash (block 6: vLLM's K 5),
    EAGLE-3 in the speculators layout (K 3, trained briefly), SpecForge's with a reduced draft vocabulary
    (its d2t/t2d shipped; trained briefly, so its drafts depend on the layers it is fed) and the original
    release's pytorch_model.bin (random: enough to load and verify losslessly), DFlash2 (from the DFlash
    drafter), n-gram; ``eagle3-specforge-as-specforge-writes``: that SpecForge drafter without the
    top-level ``eagle_aux_hidden_state_layer_ids`` this project adds (SpecForge names layers only in
    eagle_config, which vLLM reads one layer lower than SGLang; docs/families.md); ``refused``: the EAGLE-3
    drafter as its export wrote it before vLLM could load it (no ``max_position_embeddings`` in its layer
    config: vLLM 0.32.0 fails at models/qwen3.py:205), which the offline scorer still reads."""
    from scorer import train_drafter
    from scorer.families.dflash2.init import init_from_dflash
    from scorer.families.dspark.init import init_dspark
    from scorer.families.eagle3.init import init_eagle3
    from scorer.families.eagle3.train import train_eagle3

    root = tmp_path_factory.mktemp("judge")
    # Layer 7 is the target's last: vLLM feeds it raw (no final norm, vllm 0.32.0 models/qwen2.py:420-434),
    # so the drafter is trained on it raw, as it is served (EvalConfig.raw_last_layer).
    train_drafter(
        judge_caches["t0"], root / "dflash", steps=400, block_size=6, log_every=0, last_layer_normed=False
    )
    train_eagle3(judge_caches["t0"], root / "eagle3", steps=25, layer_ids=[1, 3, 7])
    train_eagle3(
        judge_caches["t0"],
        root / "eagle3-specforge",
        steps=25,
        layout="specforge",
        draft_vocab_size=256,
        layer_ids=[1, 3, 7],
    )
    specforge = shutil.copytree(root / "eagle3-specforge", root / "eagle3-specforge-as-specforge-writes")
    config = json.loads((specforge / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (specforge / "config.json").write_text(json.dumps(config))
    init_eagle3(judge_caches["t0"], root / "eagle3-release", layout="eagle_release", layer_ids=[1, 3, 7])
    init_from_dflash(root / "dflash", root / "dflash2", cache=hscache.open_cache(judge_caches["t0"]))
    init_dspark(
        judge_caches["t0"], root / "dspark", block_size=5
    )  # vLLM CPU refuses it (test_dspark_judged.py)
    shutil.copytree(root / "eagle3", root / "refused")
    config = json.loads((root / "refused" / "config.json").read_text())
    del config["transformer_layer_config"]["max_position_embeddings"]
    (root / "refused" / "config.json").write_text(json.dumps(config))
    names = ("dflash", "eagle3", "eagle3-specforge", "eagle3-specforge-as-specforge-writes")
    names += ("eagle3-release", "dflash2", "refused", "dspark")
    extra = method_drafters(judge_caches["t0"], root)  # tests/judge/method_families.py
    return {**{name: str(root / name) for name in names}, "ngram": "ngram", **extra}


# name -> (drafter, ServedConfig fields). The worker builds n-gram engines last (after one, vLLM 0.32.0
# builds no other engine in that process: scorer/families/ngram/served.py, the engine entry's start_rank),
# so the raw engines appended after it below are built before it.
QWEN3_ENGINES = {
    "refused": ("refused", {}),
    "dflash": ("dflash", {}),
    # vLLM's K is not the block's (issue 35 item 3) and vLLM's probabilistic rule, in one engine: at T 0
    # vLLM verifies greedily whatever the rule (the K check), at T 0.7 it draws (the rule's check).
    "dflash-k3-probabilistic": ("dflash", {"num_speculative_tokens": 3, "draft_sampling": "probabilistic"}),
    "eagle3": ("eagle3", {}),
    "eagle3-specforge": ("eagle3-specforge", {}),
    "eagle3-specforge-as-specforge-writes": ("eagle3-specforge-as-specforge-writes", {}),
    "eagle3-release": ("eagle3-release", {}),
    **METHOD_ENGINES,
    # vLLM's block verification (test_block_verification_judged.py)
    "dflash-block": ("dflash", {"rejection_sample_method": "block"}),
    "ngram": ("ngram", NGRAM),
}


@pytest.fixture(scope="session")
def judged(vllm_python, judge_caches, mtp_caches, judge_drafters, tmp_path_factory) -> dict:
    """ONE vLLM process: ``{"served": {name: {setting: Served}}, "raw": {engine name: worker result}}``.

    ``raw`` holds the engines the scorer does not judge but the tests check: each target alone
    (``target``, ``mtp-target``: the drafters must not change its greedy text) and DFlash2 (vLLM CPU
    refuses it by its candidate head)."""
    from scorer.families.dspark import DSPARK
    from scorer.studies.vllm_judge import ServedConfig, plan_served, serve_plans

    root = tmp_path_factory.mktemp("judged")
    python = vllm_python  # vLLM imported once (tests/vllm_zygote.py)
    qwen3 = plan_served(
        [judge_drafters[drafter] for drafter, _ in QWEN3_ENGINES.values()],
        [judge_caches[s] for s in SETTINGS],
        root / "qwen3",
        [ServedConfig(vllm_python=python, **fields) for _, fields in QWEN3_ENGINES.values()],
    )
    runs = qwen3.job["engines"][0]["runs"]
    dflash2 = {"method": "dflash", "model": judge_drafters["dflash2"], "num_speculative_tokens": 5}
    qwen3.job["engines"] += [
        {"name": "target", "speculative_config": None, "runs": runs},
        {"name": "dflash2", "speculative_config": dflash2, "runs": runs[:1]},
    ]
    # DSpark as its row says vLLM serves it, without and with adaptive verification: vLLM CPU refuses both
    # (test_dspark_judged.py)
    dspark = {"method": DSPARK.vllm.method, "model": judge_drafters["dspark"], "num_speculative_tokens": 4}
    qwen3.job["engines"] += [
        {"name": "dspark", "speculative_config": dspark, "runs": runs[:1]},
        {"name": "dspark-adaptive", "speculative_config": {**dspark, "enable_adaptive_verification": True},
         "runs": runs[:1]},
    ]  # fmt: skip
    # The MTP head also under vLLM's probabilistic rule: it accepts often at T 0.7, where the DFlash
    # drafter (trained on 4 greedy sequences) hardly does, so a swapped offline rule shows there.
    mtp = plan_served(
        ["target:mtp", "target:mtp"],
        [mtp_caches[s] for s in SETTINGS],
        root / "mtp",
        [ServedConfig(vllm_python=python), ServedConfig(vllm_python=python, draft_sampling="probabilistic")],
    )
    mtp.job["engines"].append(
        {"name": "target", "speculative_config": None, "runs": mtp.job["engines"][0]["runs"]}
    )
    rows = serve_plans([qwen3, mtp], root)
    served = {name: dict(zip(SETTINGS, row)) for name, row in zip(QWEN3_ENGINES, rows[0])}
    served["mtp"] = dict(zip(SETTINGS, rows[1][0]))
    served["mtp-probabilistic"] = dict(zip(SETTINGS, rows[1][1]))
    raw = {engine["name"]: engine for engine in qwen3.engines}
    raw["mtp-target"] = next(engine for engine in mtp.engines if engine["name"] == "target")
    return {"served": served, "raw": raw}


@pytest.fixture(scope="session")
def served(judged: dict) -> dict:
    return judged["served"]
