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
            out=str(out), model=TARGET, layers="1,3,7", max_new_tokens=20, dtype="fp32", limit=4,
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
    """A DFlash drafter trained briefly on the greedy cache (block 6: vLLM's K 5), and n-gram."""
    from scorer.train import train_drafter

    out = tmp_path_factory.mktemp("judge") / "dflash"
    train_drafter(judge_caches["t0"], out, steps=150, block_size=6, log_every=0)
    return {"dflash": str(out), "ngram": "ngram"}


@pytest.fixture(scope="session")
def served(judge_caches, judge_drafters, tmp_path_factory):
    """Every drafter on every cache, served in ONE vLLM process: ``served[family][setting]``."""
    if not VLLM_PYTHON.exists():
        pytest.skip(
            f"no vLLM environment at {VLLM_PYTHON}: `bash .ci/vllm-env.sh` builds it (CI always does)"
        )
    from scorer.studies.vllm_judge import ServedConfig, serve

    families = ["dflash", "ngram"]
    configs = [
        ServedConfig(vllm_python=str(VLLM_PYTHON)),
        ServedConfig(vllm_python=str(VLLM_PYTHON), **NGRAM),
    ]
    settings = list(judge_caches)
    rows = serve(
        [judge_drafters[f] for f in families],
        [judge_caches[s] for s in settings],
        tmp_path_factory.mktemp("judge") / "served",
        configs,
    )
    return {f: dict(zip(settings, row)) for f, row in zip(families, rows)}
