"""The vLLM extraction jobs of tests/hscache/test_vllm_engine.py and test_vllm_sampled.py, which ONE process
of vLLM's interpreter runs for both (the ``vllm_extractions`` fixture, tests/hscache/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from hscache.capture.extract import ExtractConfig
from hscache.store.sampling import SamplingSetting

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".vllm" / "bin" / "python"
PROMPTS = [
    {"id": "code", "prompt": "def add(a, b):"},
    {"id": "fact", "prompt": "The capital of France is"},
    {"id": "count", "prompt": "1, 2, 3, 4,"},
]
LAYERS = "1,3,7"  # hscache ids; 7 is tiny-qwen3's last layer (vLLM id 8)
# Qwen-like: temperature, top-k, top-p and a presence penalty (vLLM refuses min_p with this method).
SETTING = SamplingSetting(
    temperature=0.8, top_p=0.9, top_k=20, presence_penalty=0.5, seed=7, samples_per_prompt=2
)


def greedy_config(prompts: Path, out: Path, **changes) -> ExtractConfig:
    """tests/hscache/test_vllm_engine.py's extraction: fp32 tiny-qwen3, 8 greedy tokens."""
    values = dict(
        out=str(out), model="builtin:tiny-qwen3", prompts=str(prompts), layers=LAYERS, max_new_tokens=8,
        dtype="fp32", engine="vllm",
    )  # fmt: skip
    return ExtractConfig(**{**values, **changes})


def sampled_config(prompts: Path, out: Path, **changes) -> ExtractConfig:
    """tests/hscache/test_vllm_sampled.py's: the same at SETTING."""
    return greedy_config(prompts, out, **{"sampling": SETTING, "commit_every_s": 0.0, **changes})
