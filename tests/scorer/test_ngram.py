"""The n-gram (prompt lookup) proposer equals vLLM's, and its replay equals an online loop.

The oracle ``vllm_find_longest_matched_ngram`` is a literal transcription of vLLM's
``_find_longest_matched_ngram_and_propose_tokens`` (vllm/v1/spec_decode/ngram_proposer.py,
lines 198-285 at commit adce4e9a528d7f79328075e195c855d28732ef13; identical body at 016e8ede),
Apache-2.0, statement for statement (each line cites its source line); vLLM's comments are left
out and its ``@jit(nopython=True)`` is dropped (numba is not a dependency here; it changes
speed, not results). Everything else in this file checks the production code
(scorer.families.ngram) against it, on hand-made, random and repetitive sequences.
"""

from __future__ import annotations

import numpy as np
import pytest

from scorer.families.ngram.propose import NgramConfig, NgramConfigError, NgramIndex, propose, propose_at
from scorer.families.ngram.replay import NgramRounds, mean_acceptance_length, replay_ngram

NO_CAP = 2**62  # vLLM always has a max_model_len; "no cap" is one no context reaches


def vllm_find_longest_matched_ngram(
    origin_tokens: np.ndarray, min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> np.ndarray:
    """vLLM ngram_proposer.py L199-205 (signature), transcribed literally below."""
    total_token = origin_tokens.shape[0]  # L213
    if total_token < min_ngram:  # L214
        return np.empty((0,), dtype=origin_tokens.dtype)  # L215
    k = min(k, max_model_len - total_token)  # L218
    if k <= 0:  # L219
        return np.empty((0,), dtype=origin_tokens.dtype)  # L220
    tokens = origin_tokens[::-1]  # L225
    lps = np.zeros(max_ngram, dtype=np.int32)  # L233
    longest_ngram = 0  # L235
    position = 0  # L236
    prev_lps = 0  # L239
    i = 1  # L240
    while i < total_token:  # L241
        if tokens[prev_lps] == tokens[i]:  # L243
            prev_lps += 1  # L246
            if prev_lps >= longest_ngram:  # L253
                longest_ngram = prev_lps  # L254
                position = i  # L255
            if i < max_ngram:  # L256
                lps[i] = prev_lps  # L258
            if prev_lps == max_ngram:  # L259
                prev_lps = lps[max_ngram - 1]  # L263
            i += 1  # L264
        elif prev_lps != 0:  # L265
            prev_lps = lps[prev_lps - 1]  # L269
        else:  # L270
            i += 1  # L273
    if longest_ngram < min_ngram:  # L275
        return np.empty((0,), dtype=origin_tokens.dtype)  # L277
    start_position = total_token - 1 - position + longest_ngram  # L283
    k = min(k, total_token - start_position)  # L284
    return origin_tokens[start_position : start_position + k]  # L285


def oracle(context, min_n: int, max_n: int, k: int, max_model_len: int | None = None) -> list[int]:
    cap = NO_CAP if max_model_len is None else max_model_len
    return vllm_find_longest_matched_ngram(np.asarray(context, dtype=np.int64), min_n, max_n, cap, k).tolist()


# (context, min_n, max_n, k, max_model_len, expected), each worked out by hand from the rule.
HAND_CASES = [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, None, [4, 2, 3]),  # vLLM's docstring example (propose(), 016e8ede)
    ([1, 2, 3, 1, 2, 3, 1, 2], 1, 3, 4, None, [3, 1, 2]),  # periodic: [3,1,2] at s=2, 3 tokens left
    ([7, 8, 9, 5, 7, 8], 2, 2, 2, None, [9, 5]),  # the match at the very beginning (s=0)
    ([5, 5, 5, 5], 1, 3, 4, None, [5]),  # overlapping match: [5,5,5] at s=0, 1 token follows
    ([1, 2, 3, 4], 1, 3, 4, None, []),  # no n-gram repeats
    ([1, 1], 3, 4, 2, None, []),  # min_n longer than the context
    ([1, 2, 1, 2], 1, 2, 5, 5, [1]),  # max_model_len 5 caps k to 5 - 4 = 1
    ([1, 2, 1, 2], 1, 2, 5, 4, []),  # context already at max_model_len
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 3, None, [9, 1, 2]),  # tie: the EARLIEST occurrence wins
    ([4, 2, 9, 1, 2, 7, 1, 2], 1, 3, 3, None, [7, 1, 2]),  # longest n beats an earlier shorter match
    ([3, 1, 2, 3, 1, 2, 3], 3, 3, 8, None, [1, 2, 3]),  # min_n == max_n; K larger than what remains
    ([6], 1, 1, 1, None, []),  # a single token has nothing earlier
]


@pytest.mark.parametrize("context, min_n, max_n, k, cap, expected", HAND_CASES)
def test_hand_cases(context, min_n, max_n, k, cap, expected):
    assert oracle(context, min_n, max_n, k, cap) == expected
    assert propose(context, min_n, max_n, k, cap) == expected
    drafts, lengths = propose_at(context, [len(context) - 1], min_n, max_n, k, cap)
    assert lengths.tolist() == [len(expected)]
    assert drafts[0].tolist() == expected + [-1] * (k - len(expected))


def _sequences(rng: np.random.Generator):
    """Random over small vocabularies (many matches), periodic with noise, long copied runs."""
    for _ in range(90):
        yield rng.integers(0, rng.choice([2, 3, 5, 50]), rng.integers(1, 70))
    for _ in range(50):
        period = rng.integers(1, 7)
        x = np.tile(rng.integers(0, 9, period), 80 // period + 1)[: rng.integers(2, 80)]
        noise = rng.random(len(x)) < 0.1
        x[noise] = rng.integers(0, 9, noise.sum())
        yield x
    for _ in range(40):
        chunk = rng.integers(0, 1000, rng.integers(3, 20))
        yield np.concatenate(
            [rng.integers(0, 1000, rng.integers(0, 10)), chunk, rng.integers(0, 4, 5), chunk]
        )


def test_random_and_repetitive_sequences_equal_vllm_at_every_anchor():
    rng = np.random.default_rng(24)
    contexts = matched = short = 0
    for x in _sequences(rng):
        min_n = int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 5))
        k = int(rng.integers(1, 7))
        cap = None if rng.random() < 0.7 else max(1, len(x) + int(rng.integers(-3, 4)))
        anchors = np.arange(len(x))
        drafts, lengths = propose_at(x, anchors, min_n, max_n, k, cap)
        index = NgramIndex(x, min_n, max_n)
        for p in anchors:
            want = oracle(x[: p + 1], min_n, max_n, k, cap)
            assert propose(x[: p + 1], min_n, max_n, k, cap) == want, (x.tolist(), p, min_n, max_n, k, cap)
            assert index.draft(int(p), k, cap) == want
            assert drafts[p, : lengths[p]].tolist() == want and (drafts[p, lengths[p] :] == -1).all()
            contexts += 1
            matched += bool(want)
            short += 0 < len(want) < k
    # The draw covers what it is meant to: thousands of contexts, most matching, many cut short.
    assert contexts > 5000 and matched > contexts // 3 and short > 300, (contexts, matched, short)


def test_propose_at_subset_of_anchors_and_long_sequence():
    """Anchors in any order and repeated; a 3,000-token sequence against the oracle at 60 anchors."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.integers(0, 40, 1000), np.tile(rng.integers(0, 40, 37), 54)])
    anchors = rng.integers(0, len(x), 60)
    anchors[:2] = [0, len(x) - 1]
    drafts, lengths = propose_at(x, np.concatenate([anchors, anchors[::-1]]), 2, 6, 5)
    for r, p in enumerate(anchors):
        want = oracle(x[: p + 1], 2, 6, 5)
        assert drafts[r, : lengths[r]].tolist() == want == drafts[-1 - r, : lengths[-1 - r]].tolist()
    assert NgramIndex(x, 2, 6).draft(int(anchors[5]), 5) == oracle(x[: anchors[5] + 1], 2, 6, 5)


def test_settings_refused_like_vllm():
    with pytest.raises(NgramConfigError, match=r"^--prompt-lookup-min 0 must be >= 1 \(vLLM's rule\)"):
        propose([1, 2], 0, 2, 3)
    with pytest.raises(
        NgramConfigError,
        match=r"^--prompt-lookup-min 4 must be <= --prompt-lookup-max 3 \(vLLM's rule\); "
        r"raise --prompt-lookup-max or lower --prompt-lookup-min$",
    ):
        NgramConfig(num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(NgramConfigError, match=r"^--num-speculative-tokens 0 must be >= 1 \(vLLM's rule\)$"):
        propose_at([1, 2], [1], 1, 2, 0)
    with pytest.raises(
        NgramConfigError, match=r"^anchors must lie in \[0, 2\] for a sequence of 3 tokens, got 0\.\.3$"
    ):
        propose_at([1, 2, 3], [0, 3], 1, 2, 2)
    with pytest.raises(NgramConfigError, match=r"^token_ids must be a 1-D integer array of token ids"):
        propose_at([[1, 2]], [0], 1, 2, 2)
    # vLLM's defaults (vllm/config/speculative.py): none given -> 5/5, one given -> both equal.
    assert NgramConfig.resolve(4) == NgramConfig(4, 5, 5)
    assert NgramConfig.resolve(4, prompt_lookup_max=3) == NgramConfig(4, 3, 3)
    assert NgramConfig.resolve(4, prompt_lookup_min=2) == NgramConfig(4, 2, 2)


# ----------------------------------------------------------------------------- replay


def test_replay_hand_made_rounds():
    """Two sequences worked out by hand (the module docstring of scorer.offline.replay gives the rules)."""
    # Greedy data; anchors 3 and 4 find no earlier [7,8] / [8,5]: plain decode steps of 1 token.
    x = np.array([5, 6, 7, 8, 5, 6, 7, 8])
    a = np.append(x[1:], 0)  # a[t] = x[t+1]: every generated token is the target's greedy one
    first = replay_ngram(x, a, 3, NgramConfig(2, 2, 2))
    assert (first.log.anchors, first.log.accepted, first.log.tokens) == ((3, 4, 5), (0, 0, 2), (1, 1, 2))
    assert first.draft_lengths == (0, 0, 2) and first.drafted == (False, False, True)
    assert first.log.tau == pytest.approx(4 / 3) and first.mean_acceptance_length == pytest.approx(3.0)
    # Off-greedy at position 7 (the target wanted 9): the round at anchor 4 drafts [3,1,2] and
    # matches 2 before the data leaves the greedy path there.
    x = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    a = np.append(x[1:], 0)
    a[6] = 9
    second = replay_ngram(x, a, 4, NgramConfig(3, 2, 2))
    assert (second.log.anchors, second.log.accepted, second.log.tokens) == ((4, 7), (2, 2), (3, 2))
    assert second.draft_lengths == (3, 3) and second.log.hit_end == (False, True)
    assert second.num_draft_tokens == 6 and second.num_accepted_tokens == 4
    assert second.draft_acceptance_rate == pytest.approx(4 / 6) and second.accepted_per_position(3) == [
        2,
        2,
        0,
    ]
    assert first.draft_acceptance_rate == pytest.approx(1.0) and first.accepted_per_position(2) == [1, 1]
    assert mean_acceptance_length([first, second]) == pytest.approx(1 + 6 / 3)
    assert (
        mean_acceptance_length([replay_ngram(np.arange(6), np.arange(1, 7), 2, NgramConfig(3, 1, 1))]) is None
    )


def _greedy_target(context: list[int]) -> int:
    """A deterministic 'target': mostly repeats the token 5 back, sometimes breaks the pattern."""
    if len(context) % 11 == 0:
        return (context[-1] * 7 + 3) % 13
    return context[-5] if len(context) >= 5 else (len(context) * 3) % 13


def _online(
    prompt: list[int], total: int, config: NgramConfig
) -> tuple[list[int], list[tuple[int, int, int, bool]]]:
    """vLLM's loop run for real: draft with the transcription, verify against the target, commit."""
    ctx = [*prompt, _greedy_target(prompt)]  # the prefill samples x_P; its anchor is the first round
    rounds = []
    while len(ctx) < total:
        draft = oracle(ctx, config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == _greedy_target(ctx + draft[:accepted]):
            accepted += 1
        left = total - len(ctx)  # the sequence ends at `total` tokens (max_tokens)
        accepted = min(accepted, left)
        tokens = min(accepted + 1, left)
        rounds.append((len(ctx) - 1, accepted, tokens, bool(draft)))
        for _ in range(tokens):
            ctx.append(_greedy_target(ctx))
    return ctx, rounds


@pytest.mark.parametrize("k, min_n, max_n", [(3, 1, 3), (5, 2, 4), (2, 3, 3)])
def test_replay_equals_online_loop(k, min_n, max_n):
    rng = np.random.default_rng(k)
    config = NgramConfig(k, min_n, max_n)
    results, online_rounds = [], []
    for length in (40, 75, 120):
        prompt = rng.integers(0, 13, 9).tolist()
        out, rounds = _online(prompt, length, config)
        x = np.asarray(out)
        a = np.array([_greedy_target(out[: t + 1]) for t in range(length)])
        assert (x[9:] == a[8:-1]).all()  # speculative decoding reproduced greedy decoding
        got = replay_ngram(x, a, len(prompt), config)
        assert list(zip(got.log.anchors, got.log.accepted, got.log.tokens, got.drafted)) == rounds
        results.append(got)
        online_rounds += rounds
    drafted = [r for r in online_rounds if r[3]]
    assert 0 < len(drafted) < len(online_rounds)  # both kinds of round occur
    assert mean_acceptance_length(results) == pytest.approx(1 + sum(r[1] for r in drafted) / len(drafted))
    tau = sum(r[2] for r in online_rounds) / len(online_rounds)
    assert sum(r.log.n_tokens for r in results) / sum(r.log.n_rounds for r in results) == pytest.approx(tau)
    assert isinstance(results[0], NgramRounds) and results[0].to_dict()["num_drafts"] == results[0].num_drafts
