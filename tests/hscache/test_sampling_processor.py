"""The processor against vLLM's, transcribed here independently (dense over the vocabulary, the sort
path of ``apply_top_k_top_p``), and the seeded draw: an exact sample from p, keyed, not global."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hscache.capture.sampling import (
    SupportBuilder,
    SupportOverflowError,
    draw_key,
    gumbel_choice,
    penalise_dense,
    processed_support,
)
from hscache.store.sampling import SamplingSetting


def vllm_processed(
    logits: torch.Tensor, prompt: list[int], output: list[int], s: SamplingSetting
) -> torch.Tensor:
    """[V] probabilities as vLLM's Sampler computes them for one request (penalties, /T, min_p, top-k, top-p)."""
    v = logits.shape[-1]
    x = logits.clone().float()[None]
    prompt_mask = torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=v)[None] > 0
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v)[None]
    output_mask = counts > 0
    # vllm/model_executor/layers/utils.py apply_penalties, with apply_repetition_penalties_torch
    rep = torch.tensor([s.repetition_penalty], dtype=torch.float32).unsqueeze(1).repeat(1, v)
    penalties = torch.where(prompt_mask | output_mask, rep, 1.0)
    x *= torch.where(x > 0, 1.0 / penalties, penalties)
    x -= torch.tensor([s.frequency_penalty], dtype=torch.float32).unsqueeze(1) * counts
    x -= torch.tensor([s.presence_penalty], dtype=torch.float32).unsqueeze(1) * output_mask
    x.div_(torch.tensor([s.temperature], dtype=torch.float32).unsqueeze(1))
    if s.min_p > 0:  # MinPLogitsProcessor.apply
        probs = torch.softmax(x, dim=-1)
        x[probs < probs.amax(dim=-1, keepdim=True) * s.min_p] = -float("inf")
    # apply_top_k_top_p (sort path). stable=True: vLLM's sort is not, so which of several equal values a
    # top-p cut keeps is unspecified there; hscache fixes it as a stable sort would (docs/extract.md).
    x_sort, x_idx = x.sort(dim=-1, descending=False, stable=True)
    k = torch.tensor([s.top_k])
    threshold = x_sort.gather(1, (x_sort.size(1) - k).unsqueeze(1))
    x_sort.masked_fill_(x_sort < threshold, -float("inf"))
    cumulative = torch.cumsum(x_sort.softmax(dim=-1), dim=-1)
    top_p_mask = cumulative <= 1 - torch.tensor([s.top_p]).unsqueeze(1)
    top_p_mask[:, -1] = False
    x_sort.masked_fill_(top_p_mask, -float("inf"))
    x = x_sort.scatter(dim=-1, index=x_idx, src=x_sort)
    return x.softmax(dim=-1)[0]


def dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(vocab)
    keep = ids >= 0
    out[ids[keep]] = probs[keep]
    return out


SETTINGS = [
    SamplingSetting.from_flags("qwen-thinking", seed=1),
    SamplingSetting.from_flags("qwen-instruct", seed=1),
    SamplingSetting(
        temperature=0.8,
        top_p=0.9,
        top_k=12,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        seed=1,
    ),  # fmt: skip
]


@pytest.mark.parametrize("setting", SETTINGS, ids=["qwen-thinking", "qwen-instruct", "all-penalties-min-p"])
def test_teacher_forced_support_equals_vllm_at_every_position(setting):
    # A 40-token sequence (prompt of 15) over a vocabulary of 300 with repeats, so every penalty bites;
    # logits with exact ties at the 20th value in some rows (bf16-like coarse values).
    gen = torch.Generator().manual_seed(0)
    vocab, length, prompt_len = 300, 40, 15
    tokens = torch.randint(0, 60, (length,), generator=gen)
    logits = (torch.randn(length, vocab, generator=gen) * 3).round(decimals=1)
    builder = SupportBuilder(setting, tokens, prompt_len, "r")
    for first in range(0, length, 7):  # row chunks, as the capture forward feeds them
        builder(first, logits[first : first + 7])
    for t in range(length):
        if not prompt_len - 1 <= t < length - 1:
            assert (
                (builder.ids[t] == -1).all()
                and (builder.probs[t] == 0).all()
                and builder.token_prob[t].isnan()
            )
            continue
        want = vllm_processed(
            logits[t], tokens[:prompt_len].tolist(), tokens[prompt_len : t + 1].tolist(), setting
        )
        got = dense(builder.ids[t].long(), builder.probs[t], vocab)
        assert torch.equal(got > 0, want > 0), t  # the same support
        torch.testing.assert_close(got, want, rtol=0, atol=2e-7)  # fp32 rounding of probabilities <= 1
        assert builder.token_prob[t] == got[tokens[t + 1]]
        assert (builder.probs[t][:-1] >= builder.probs[t][1:]).all()  # sorted, the support first


def test_ties_at_the_kth_value_are_kept_and_an_overflow_is_refused():
    setting = SamplingSetting(temperature=1.0, top_k=3, seed=0)  # support width 6
    ties = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, 0.0]])
    ids, probs, overflow = processed_support(ties, setting)
    assert sorted(ids[0][ids[0] >= 0].tolist()) == [0, 1, 2, 3, 4] and not overflow.any()
    torch.testing.assert_close(
        dense(ids[0], probs[0], 8), vllm_processed(ties[0], [], [], setting), rtol=0, atol=1e-7
    )
    _, _, overflow = processed_support(torch.tensor([[5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]]), setting)
    assert overflow.all()
    builder = SupportBuilder(setting, torch.tensor([1, 2, 3]), 1, "rec")
    with pytest.raises(
        SupportOverflowError, match="^record 'rec', generated position 0: more than 6 tokens tie"
    ):
        builder(0, torch.tensor([[5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]] * 3))


def test_dense_penalties_equal_the_sequence_history_bit_for_bit():
    setting = SETTINGS[2]
    gen = torch.Generator().manual_seed(1)
    tokens, logits = torch.randint(0, 30, (20,), generator=gen), torch.randn(20, 64, generator=gen)
    builder = SupportBuilder(setting, tokens, 5, "r")
    builder(0, logits)
    counts = torch.zeros(64, dtype=torch.long)
    mask = torch.zeros(64, dtype=torch.bool)
    mask[tokens[:5]] = True
    for t in range(4, 19):
        ids, probs, _ = processed_support(
            penalise_dense(logits[t : t + 1], counts[None], mask[None], setting), setting
        )
        assert torch.equal(ids[0].int(), builder.ids[t]) and torch.equal(probs[0], builder.probs[t]), t
        counts[tokens[t + 1]] += 1


def test_gumbel_max_draws_exactly_from_p_and_only_from_its_support():
    ids = np.array([[4, 9, 2, 7, -1, -1]] * 40000)
    probs = np.array([[0.5, 0.25, 0.15, 0.1, 0.0, 0.0]] * 40000, dtype=np.float32)
    keys = [draw_key(3, "prompt", 0, position) for position in range(len(ids))]
    drawn = gumbel_choice(ids, probs, keys)
    freq = np.array([(drawn == t).mean() for t in (4, 9, 2, 7)])
    # 40000 draws: the standard error of a frequency is <= 0.0025; 5 of them.
    assert set(np.unique(drawn)) <= {4, 9, 2, 7} and np.abs(freq - [0.5, 0.25, 0.15, 0.1]).max() < 0.0125


def test_draws_are_keyed_by_seed_record_sample_and_position_only():
    ids = np.array([list(range(20))] * 64)
    probs = np.full((64, 20), 0.05, dtype=np.float32)
    base = [draw_key(7, "a", 0, p) for p in range(64)]
    first = gumbel_choice(ids, probs, base)
    assert np.array_equal(first, gumbel_choice(ids, probs, base))  # no hidden state, no global RNG
    assert np.array_equal(first[10:20], gumbel_choice(ids[10:20], probs[10:20], base[10:20]))  # batch-free
    for other in ([draw_key(8, "a", 0, p) for p in range(64)], [draw_key(7, "b", 0, p) for p in range(64)],
                  [draw_key(7, "a", 1, p) for p in range(64)]):  # fmt: skip
        assert (gumbel_choice(ids, probs, other) != first).mean() > 0.8  # 19/20 expected to differ
    assert draw_key(7, "a", 0, 5) == draw_key(7, "a", 0, 5) != draw_key(7, "a", 0, 6)
