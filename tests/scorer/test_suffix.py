"""Suffix decoding (vLLM ``method="suffix"``): the pure-Python suffix tree and cache against Arctic Inference's
own (the C++ vLLM 0.32.0 imports, built by `bash .ci/arctic-suffix.sh` and linked as .arctic), hand-worked
drafts of the C++ rules (no build needed), and the family on the seam (``scorer eval suffix``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import hscache
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.families import family_for, probe_checkpoint
from scorer.families.suffix.cache import SuffixCache
from scorer.families.suffix.propose import ServedProposer, SuffixConfig
from scorer.families.suffix.tree import SuffixTree

ARCTIC = Path(__file__).resolve().parents[2] / ".arctic"
NEEDS_ARCTIC = pytest.mark.skipif(
    not (ARCTIC / "arctic_inference").is_dir(),
    reason=f"no Arctic suffix tree at {ARCTIC}: `bash .ci/arctic-suffix.sh` builds it (after .ci/vllm-env.sh)",
)


@pytest.fixture(scope="module")
def arctic():
    """Arctic Inference's own ``SuffixDecodingCache`` (its C++ tree through nanobind)."""
    sys.path.insert(0, str(ARCTIC))
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    finally:
        sys.path.remove(str(ARCTIC))
    return SuffixDecodingCache


def _stream(rng: random.Random, vocab: int, n: int, repeat: float) -> list[int]:
    """Tokens from ``vocab``, each one a copy from 1-4 tokens back with probability ``repeat``."""
    out: list[int] = []
    for _ in range(n):
        back = rng.randint(1, 4)
        out.append(out[-back] if out and len(out) >= back and rng.random() < repeat else rng.randrange(vocab))
    return out


@NEEDS_ARCTIC
@pytest.mark.parametrize("repeat", [0.0, 0.8])
def test_the_transcription_drafts_what_arctic_drafts(arctic, repeat):
    """Random and repetitive streams; requests that share the global tree, ids reused (evicted and started
    again) and FIFO eviction (max_cached_requests 0, 1, 3 and unbounded); every setting vLLM passes varied.
    Every draft equal: tokens, float32 probabilities, score and match length."""
    drafts = 0
    for seed in range(40):
        rng = random.Random(seed)
        depth, cached = rng.choice([2, 5, 24]), rng.choice([-1, 0, 1, 3])
        theirs, ours = arctic(depth, cached), SuffixCache(depth, cached)
        for request in range(rng.randint(2, 7)):
            rid = f"r{request % 3}"  # ids come back: a cached response is evicted before it restarts
            if rid in theirs.cached_requests:
                theirs.evict_cached_response(rid)
                ours.evict_cached_response(rid)
            prompt = _stream(rng, rng.choice([2, 4, 30]), rng.randint(1, 12), repeat)
            theirs.start_request(rid, prompt)
            ours.start_request(rid, prompt)
            context = list(prompt)
            for _ in range(rng.randint(1, 12)):
                step = _stream(rng, 4, rng.randint(1, 4), repeat)
                theirs.add_active_response(rid, step)
                ours.add_active_response(rid, step)
                context += step
                k, factor = rng.randint(1, 30), rng.choice([0.5, 1.0, 2.5])
                offset, floor = rng.choice([0.0, 1.0]), rng.choice([0.0, 0.1, 0.5])
                want = theirs.speculate(rid, context, k, factor, offset, floor)
                got = ours.speculate(rid, context, k, factor, offset, floor)
                assert (got.token_ids, got.probs, float(got.score), got.match_len) == (
                    want.token_ids, want.probs, want.score, want.match_len,
                ), (seed, request)  # fmt: skip
                drafts += bool(want.token_ids)
            theirs.stop_request(rid)
            ours.stop_request(rid)
        assert set(ours.cached_requests) == set(theirs.cached_requests)
    assert drafts > 200  # not vacuous: most steps drafted something


@NEEDS_ARCTIC
def test_the_served_proposer_feeds_the_trees_as_vllm_does(arctic):
    """ServedProposer's drafts at every anchor of rows scored in order equal arctic's cache driven as vLLM's
    SuffixDecodingProposer drives it (vllm/v1/spec_decode/suffix_decoding.py:50-99: start with the prompt,
    add the step's tokens, speculate on the last max_tree_depth tokens, stop), with 2 cached responses (the
    oldest evicted) and a row scored again (the state rewound to before it)."""
    rng = random.Random(7)
    rows = [(rng.randint(2, 9), _stream(rng, 6, 30, 0.7)) for _ in range(5)]
    config = SuffixConfig(5, suffix_decoding_max_tree_depth=8, suffix_decoding_max_cached_requests=2)
    theirs, ours = arctic(8, 2), ServedProposer(config)

    def vllm_drafts(row: int, prompt_len: int, x: list[int]) -> list[list[int]]:
        theirs.start_request(str(row), np.asarray(x[:prompt_len], dtype=np.int32))
        out = []
        for p in range(prompt_len, len(x) - 1):
            theirs.add_active_response(str(row), np.asarray(x[p : p + 1], dtype=np.int32))
            context = np.asarray(x[max(0, p + 1 - 8) : p + 1], dtype=np.int32)
            out.append(theirs.speculate(str(row), context, 5, 1.0, 0.0, 0.1).token_ids)
        theirs.add_active_response(str(row), x[-1:])
        theirs.stop_request(str(row))
        return out

    for row, (prompt_len, x) in enumerate(rows):
        want = vllm_drafts(row, prompt_len, x)
        drafts, lengths = ours.drafts(row, x, prompt_len)
        assert [list(d[:n]) for d, n in zip(drafts, lengths)] == want, row
        assert (drafts[np.arange(5)[None, :] >= lengths[:, None]] == -1).all()
    assert len(theirs.cached_requests) == 2
    again, lengths = ours.drafts(3, rows[3][1], rows[3][0])  # rows 0..2 fed again, then row 3
    assert [list(d[:n]) for d, n in zip(again, lengths)] == vllm_drafts_fresh(arctic, rows[:4])
    with pytest.raises(ScorerError, match="score the cache's rows in order from row 0"):
        ServedProposer(config).drafts(1, rows[1][1], rows[1][0])


def vllm_drafts_fresh(arctic, rows) -> list[list[int]]:
    """The drafts of the last of ``rows`` with a fresh arctic cache fed the earlier rows first."""
    cache = arctic(8, 2)
    for row, (prompt_len, x) in enumerate(rows):
        cache.start_request(row, x[:prompt_len])
        out = []
        for p in range(prompt_len, len(x) - 1):
            cache.add_active_response(row, x[p : p + 1])
            out.append(cache.speculate(row, x[max(0, p + 1 - 8) : p + 1], 5, 1.0, 0.0, 0.1).token_ids)
        cache.add_active_response(row, x[-1:])
        cache.stop_request(row)
    return out


def _draft(tree: SuffixTree, context: list[int], k: int = 10, factor: float = 10.0) -> tuple[list[int], int]:
    draft = tree.speculate(context, k, factor, 0.0, 0.1)
    return draft.token_ids, draft.match_len


def test_hand_worked_drafts_of_the_cpp_rules():
    """Drafts worked by hand from suffix_tree.cc (no build needed)."""
    tree = SuffixTree(24)
    tree.extend(0, [5, 6, 5, 7])
    # After "5" come 6 and 7 once each: equal counts keep insertion order (a new child goes last,
    # suffix_tree.cc:369-372), so the head child is 6; the whole context is never matched (:600), so
    # [9, 5] matches "5" only, and the path reads 6 then the rest of that leaf, "5 7".
    assert _draft(tree, [9, 5]) == ([6, 5, 7], 1)
    tree.extend(0, [5, 7])  # now 7 follows 5 twice: it moves ahead of 6 (_increment_count, :221-226)
    assert _draft(tree, [9, 5]) == ([7, 5, 7], 1)
    # "5" ends 3 suffixes; 2 go on to 7 (p 2/3), 1 of those 2 on to "5 7" (p 2/3 * 1/2), in float32
    probs = tree.speculate([9, 5], 10, 10.0, 0.0, 0.1).probs
    assert probs == [float(np.float32(2) / np.float32(3))] + [float(np.float32(2 / 3) * np.float32(0.5))] * 2
    # max_spec_factor 1: at most match_len tokens (:606-608); match_len 1 drafts one token
    assert _draft(tree, [9, 5], factor=1.0) == ([7], 1)
    # min_token_prob: the path stops where its probability falls below it (:831)
    assert tree.speculate([9, 5], 10, 10.0, 0.0, 0.5).token_ids == [7]
    assert tree.speculate([9, 5], 10, 10.0, 0.0, 0.7).token_ids == []
    # the higher score wins (:616): "6 5" continues "7 5 7" with p 1 (score 3 > 4/3 after "5" alone)
    assert _draft(tree, [0, 6, 5]) == ([7, 5, 7], 2)
    assert float(tree.speculate([0, 6, 5], 10, 10.0, 0.0, 0.1).score) == 3.0


def test_the_prompt_tree_wins_a_tie_and_responses_cross_requests():
    """cache.py:308: the prompt tree's draft unless the global tree's scores strictly higher; a finished
    request's response drafts for the next request until it is evicted (FIFO, cache.py:335-347)."""
    cache = SuffixCache(24, 2)
    cache.start_request("a", [0])
    cache.add_active_response("a", [1, 2, 3, 4])  # a's response is cached in the global tree
    cache.stop_request("a")
    cache.start_request("b", [8, 9])
    cache.add_active_response("b", [1, 2])
    # b's prompt tree has nothing after "1 2"; the global tree has "3 4" after it in a's response (p 1/2:
    # "1 2" also ends b's own response so far), "1 2" and "2" score alike and the longer match is kept
    draft = cache.speculate("b", [8, 9, 1, 2], 10, 10.0, 0.0, 0.1)
    assert (draft.token_ids, draft.probs, draft.match_len) == ([3, 4], [0.5, 0.5], 2)
    cache.stop_request("b")
    cache.start_request("c", [5])  # a third response: a's, the oldest, is evicted
    assert list(cache.cached_requests) == ["b", "c"]
    cache.add_active_response("c", [1, 2])
    assert cache.speculate("c", [5, 1, 2], 10, 10.0, 0.0, 0.1).token_ids == []
    # a tie: the prompt tree drafts 6 after "5", the global tree (z's response) 7, both with score 1
    tie = SuffixCache(24, 10)
    tie.start_request("z", [0])
    tie.add_active_response("z", [5, 7])
    tie.stop_request("z")
    tie.start_request("x", [5, 6])
    assert tie.speculate("x", [0, 5], 10, 10.0, 0.0, 0.1).token_ids == [6]


def test_the_word_suffix_names_the_family():
    assert family_for(probe_checkpoint("suffix")).name == "suffix"


def test_scorer_eval_suffix_scores_the_rows_in_order(scorer_cache, tmp_path):
    """The report's rounds are the replay of ServedProposer's drafts over the rows in order (the global tree
    carries the earlier rows), vLLM's counters beside tau, its settings in the drafter block."""
    out = tmp_path / "suffix.json"
    args = ["eval", "suffix", "--cache", str(scorer_cache), "--ddtree", "", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, "--suffix-decoding-max-cached-requests", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    drafter = report["drafter"]
    assert drafter["family"] == "suffix" and drafter["method"] == "suffix"
    assert (
        drafter["num_speculative_tokens"] == 24 == drafter["suffix_decoding_max_tree_depth"]
    )  # vLLM's default
    assert drafter["suffix_decoding_max_cached_requests"] == 2
    from scorer.offline.drafted_rounds import replay_drafted

    cache = hscache.open_cache(scorer_cache)
    proposer = ServedProposer(SuffixConfig(24, suffix_decoding_max_cached_requests=2))
    accepted = []
    for row in range(len(cache)):
        x, a = np.asarray(cache.token_ids(row)), np.asarray(cache.target_argmax(row))
        prompt_len = int(cache.index.column("prompt_len")[row].as_py())
        drafts, lengths = proposer.drafts(row, x, prompt_len)
        draft_at = lambda p, d=drafts, n=lengths, q=prompt_len: d[p - q, : n[p - q]]
        rounds = replay_drafted(draft_at, x, a, prompt_len)
        accepted.append(list(rounds.log.accepted))
    assert [r["accepted"] for r in report["per_request"]] == accepted
    assert sum(map(sum, accepted)) > 0  # not vacuous
    metrics = report["family_metrics"]
    assert metrics["mean_acceptance_length"]["value"] >= report["tau"]["pooled"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--block-size", "4"], "--block-size do not apply to suffix decoding"),
        (["--prompt-lookup-min", "2"], "--prompt-lookup-min does not apply to suffix"),
        (
            ["--suffix-decoding-min-token-prob", "1.5"],
            "--suffix-decoding-min-token-prob 1.5 must be in [0, 1]",
        ),
    ],
)
def test_settings_it_cannot_use_are_refused_in_one_line(scorer_cache, extra, message):
    result = CliRunner().invoke(
        main, ["eval", "suffix", "--cache", str(scorer_cache), "--ddtree", "", *extra]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_scorer_compare_takes_it_beside_ngram(scorer_cache):
    """`scorer compare` pairs suffix decoding with another proposer on the same rounds' requests."""
    args = ["compare", "ngram", "suffix", "--cache", str(scorer_cache), "--num-speculative-tokens", "3"]
    result = CliRunner().invoke(main, [*args, "--ddtree", "", "--format", "plain"])
    assert result.exit_code == 0, result.output
    assert "suffix (suffix)" in result.output and "ngram (ngram)" in result.output
