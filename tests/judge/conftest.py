"""The judge tests: a tiny plain Qwen3 target (head_dim 32, fp32: vLLM CPU runs it) served by vLLM CPU
0.32.0 in its own venv (`.vllm`, built by .ci/vllm-env.sh), driven as a subprocess. One vLLM process
serves every drafter on every cache (one engine per drafter), shared by the tests (session scope)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hscache

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm" / "bin" / "python"
NEEDS_VLLM = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON}: `bash .ci/vllm-env.sh` builds it (CI always does)",
)
TARGET = "builtin:tiny-qwen3"
NGRAM = {"num_speculative_tokens": 3, "overrides": {"prompt_lookup_min": 2, "prompt_lookup_max": 3}}


def _extract(out: Path, sampling=None) -> Path:
    from hscache.store.sampling import GREEDY

    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), model=TARGET, layers="1,3,7", max_new_tokens=16, dtype="fp32", limit=4,
            sampling=sampling or GREEDY, mtp=False,
        )
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def judge_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target's greedy cache and a seeded T 0.7 / top-p 0.9 / top-k 20 one (2 samples per prompt)."""
    from hscache.store.sampling import SamplingSetting

    root = tmp_path_factory.mktemp("judge")
    sampled = SamplingSetting.from_flags(temperature=0.7, top_p=0.9, top_k=20, seed=5, samples_per_prompt=2)
    return {"t0": _extract(root / "greedy"), "t0.7": _extract(root / "sampled", sampled)}


@pytest.fixture(scope="session")
def judge_drafters(judge_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Drafters trained briefly on the greedy cache: DFlash (block 6: vLLM's K 5), EAGLE-3 (K 3), and
    n-gram; ``refused``: the EAGLE-3 drafter as its export wrote it before vLLM could load it (no
    ``max_position_embeddings`` in its layer config: vLLM 0.32.0 fails at models/qwen3.py:205), which
    the offline scorer still reads."""
    import json
    import shutil

    from scorer.families.eagle3.train import train_eagle3
    from scorer.train import train_drafter

    root = tmp_path_factory.mktemp("judge")
    # Layer 7 is the target's last: vLLM feeds it raw (no final norm, vllm 0.32.0 models/qwen2.py:420-434),
    # so the drafter is trained on it raw, as it is served (EvalConfig.raw_last_layer).
    train_drafter(
        judge_caches["t0"], root / "dflash", steps=400, block_size=6, log_every=0, last_layer_normed=False
    )
    train_eagle3(judge_caches["t0"], root / "eagle3", steps=25, layer_ids=[1, 3, 7])
    shutil.copytree(root / "eagle3", root / "refused")
    config = json.loads((root / "refused" / "config.json").read_text())
    del config["transformer_layer_config"]["max_position_embeddings"]
    (root / "refused" / "config.json").write_text(json.dumps(config))
    return {"dflash": str(root / "dflash"), "eagle3": str(root / "eagle3"), "ngram": "ngram",
            "refused": str(root / "refused")}  # fmt: skip


@pytest.fixture(scope="session")
def served(judge_caches, judge_drafters, tmp_path_factory):
    """Every drafter on every cache, served in ONE vLLM process: ``served[family][setting]``."""
    if not VLLM_PYTHON.exists():
        pytest.skip(
            f"no vLLM environment at {VLLM_PYTHON}: `bash .ci/vllm-env.sh` builds it (CI always does)"
        )
    from scorer.studies.vllm_judge import ServedConfig, serve

    # The drafter vLLM refuses first: vLLM 0.32.0 cannot build an EAGLE-3 engine after another in one
    # process ("'_lib_fn_wrapper' object has no attribute 'get'"), and a refused one then reads so too.
    # vLLM 0.32.0 also fails to build a second engine of a drafter type already built in the process
    # (same error): vLLM's probabilistic rule (a second DFlash engine) is judged by hand, docs/scoring.md.
    families = ["refused", "dflash", "eagle3", "ngram"]
    plain = ServedConfig(vllm_python=str(VLLM_PYTHON))
    configs = [plain, plain, plain, ServedConfig(vllm_python=str(VLLM_PYTHON), **NGRAM)]
    settings = list(judge_caches)
    rows = serve(
        [judge_drafters[f] for f in families],
        [judge_caches[s] for s in settings],
        tmp_path_factory.mktemp("judge") / "served",
        configs,
    )
    return {f: dict(zip(settings, row)) for f, row in zip(families, rows)}
