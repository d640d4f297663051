"""Where the judge tests find vLLM (`.vllm`, built by `bash .ci/vllm-env.sh`) and the skip without it.

A module of its own (not conftest): a test file imports it by name, which works in any selection of test
directories (``from conftest import ...`` picks whichever conftest was imported first)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm" / "bin" / "python"
REASON = f"no vLLM environment at {VLLM_PYTHON}: `bash .ci/vllm-env.sh` builds it (CI always does)"
NEEDS_VLLM = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=REASON)
# n-gram as the judge serves it: K 3, matches of 2-3 tokens (vLLM's prompt_lookup_min / _max).
NGRAM = {"num_speculative_tokens": 3, "overrides": {"prompt_lookup_min": 2, "prompt_lookup_max": 3}}
