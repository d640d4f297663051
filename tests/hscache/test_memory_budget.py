"""``--memory-gb``: the vocabulary projection runs in row chunks, with identical numbers."""

from __future__ import annotations

import pytest
import torch

from hscache.capture.forward import capture_batch
from hscache.capture.logit_rows import head_rows, row_chunks
from hscache.capture.target import load_target


def test_rows_per_chunk_follow_vocabulary_and_budget():
    assert 2_000_000_000 // (248_320 * 12) == 671
    assert head_rows(248_320, 2.0) == 624  # whole multiples of 48 rows
    assert head_rows(512, 2.0) > 100_000
    assert head_rows(248_320, 1e-9) == 48  # never fewer
    assert list(row_chunks(100, 48)) == [(0, 48, 0), (48, 96, 48), (52, 100, 96)]
    assert list(row_chunks(30, 48)) == [(0, 30, 0)]
    with pytest.raises(ValueError, match="positive"):
        head_rows(512, 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_budgets_give_bit_identical_capture(dtype):
    target = load_target("builtin:tiny-qwen3.5", dtype)
    seq = target.tokenizer("def fizzbuzz(n):\n    for i in range(n): print(i)\n" * 6)["input_ids"][:-7]
    ref = capture_batch(target, [seq], [1, 3], top_k=8, full_logits=True)[0]
    budget = 1e-9  # 48 rows per chunk: several chunks, the last one overlapping
    assert len(seq) > 2 * 48 and len(seq) % 48
    got = capture_batch(target, [seq], [1, 3], top_k=8, full_logits=True, memory_gb=budget)[0]
    for name in ("argmax", "topk_values", "topk_ids", "logsumexp", "logits", "hidden_states"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
