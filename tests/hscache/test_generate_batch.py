"""Batched greedy generation (``extract --generate-batch``) against one-at-a-time generation."""

from __future__ import annotations

import sys

import pytest

import hscache
from hscache.capture.forward import greedy_continuation, greedy_continuations
from hscache.capture.target import load_target

_PROMPTS = ["def fizzbuzz(n):", "Explain binary search in one line.", "x", "for i in range(10): print(i)"]


@pytest.mark.parametrize("name", ["builtin:tiny-qwen3.5", "builtin:tiny-qwen3"])
def test_batched_greedy_equals_one_at_a_time_in_fp32(name):
    """Left padding must not leak: full attention masks pads, Gated DeltaNet zeroes them."""
    target = load_target(name, "fp32")
    prompts = [target.tokenizer(p)["input_ids"] for p in _PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # real padding
    one = [greedy_continuation(target, p, 12, 4096) for p in prompts]
    assert greedy_continuations(target, prompts, 12, 4096) == one


def test_each_sequence_stops_on_its_own_eos_and_length():
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    prompts = [target.tokenizer(p)["input_ids"] for p in _PROMPTS[:3]]
    free = greedy_continuations(target, prompts, 12, 4096)
    # Make the 4th token generated after prompt 0 the EOS id: row 0 stops there, others run on
    # unless they hit that token too (then they must stop at its first occurrence).
    eos = free[0][0][len(prompts[0]) + 3]
    target.model.generation_config.eos_token_id = eos
    short = len(prompts[2]) + 5  # prompt 2 may only grow by 5 tokens
    got = greedy_continuations(target, prompts, 12, max(short, len(prompts[0]) + 12, len(prompts[1]) + 12))
    for (ids, stop), (ref, _), prompt in zip(got, free, prompts):
        new = ref[len(prompt) :]
        cut = new.index(eos) + 1 if eos in new else len(new)
        assert ids == ref[: len(prompt) + cut]
        assert stop == ("eos" if eos in new else "max_new_tokens")
    target.model.generation_config.eos_token_id = target.tokenizer.eos_token_id
    ids, stop = greedy_continuations(target, [prompts[0], prompts[2]], 12, short)[1]
    assert (ids, stop) == (free[2][0][:short], "max_length")
    assert greedy_continuations(target, [prompts[0]], 0, 4096) == [(prompts[0], "none")]


def test_resume_regenerates_the_group_it_restarts_inside(monkeypatch):
    """Generation groups are records kN..kN+N-1 whatever record a run starts at."""
    extract_module = sys.modules["hscache.capture.extract"]
    calls: list[int] = []

    def fake(target, prompts, max_new_tokens, max_length):
        calls.append(len(prompts))
        return [(list(p) + [7], "max_new_tokens") for p in prompts]

    monkeypatch.setattr(extract_module, "greedy_continuations", fake)
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    config = hscache.ExtractConfig(out="unused", limit=7, generate_batch=3)
    full = list(extract_module._sequences(config, target, 3, skip=0))
    assert calls == [3, 3, 1]
    calls.clear()
    resumed = list(extract_module._sequences(config, target, 3, skip=4))
    assert calls == [3, 1]  # group 3..5 regenerated whole, group 0..2 not at all
    assert [r[0].record_id for r in resumed] == [r[0].record_id for r in full[4:]]
    assert [r[1] for r in resumed] == [r[1] for r in full[4:]]


def test_generate_batch_is_a_resume_setting(tmp_path):
    out = tmp_path / "c"
    base = hscache.ExtractConfig(out=str(out), max_new_tokens=2, limit=2, dtype="fp32", generate_batch=2)
    hscache.extract(base)
    with pytest.raises(
        hscache.errors.ResumeMismatchError,
        match="built with --generate-batch 2 but this run has --generate-batch 1",
    ):
        hscache.extract(hscache.ExtractConfig(**{**base.__dict__, "generate_batch": 1}))
