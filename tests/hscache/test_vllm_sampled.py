"""``hscache extract --engine vllm`` at a sampled setting: vLLM's sampler draws, its processed distribution
is stored (issue 34).

ONE subprocess in vLLM's environment (``.vllm``) for the whole file (tests/hscache/vllm_sampled_run.py):
the extraction through the worker's own entry point, then the same job again, stopped after 3 sequences
and resumed. Everything compared runs here. Without that environment these tests skip with the reason;
the refusals that need no engine always run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.capture.extract import extract, worker_job
from hscache.cli import main as hscache_main
from hscache.engines.vllm.extract_worker import config_of
from hscache.engines.vllm.requests import SEED_RULE, request_seed, sequence_seed
from hscache.errors import InputError
from hscache.store.layout import SAMPLED_ARRAYS
from scorer.cli import main as scorer_main
from tests.hscache.test_sampling_processor import dense, vllm_processed
from tests.hscache.vllm_jobs import PROMPTS, SETTING, VLLM_PYTHON, sampled_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_sampled(vllm_extractions) -> dict:
    """Two sampled caches of the same job from the one vLLM process of tests/hscache/conftest.py: ``a`` in
    one run, ``b`` stopped after 3 sequences and resumed; and what the runs returned."""
    return vllm_extractions


def _prompt_len(cache, row: int) -> int:
    return int(cache.index["prompt_len"][row].as_py())


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no vLLM environment at .vllm (build it: bash .ci/vllm-env.sh)"
)
def test_the_same_seed_gives_the_same_cache_and_a_resume_continues_it(vllm_sampled):
    assert vllm_sampled["first_status"] == 0 and vllm_sampled["stopped"]
    assert vllm_sampled["resumed_from"] == 3 and vllm_sampled["sequences"] == 6
    a, b = hscache.open_cache(vllm_sampled["a"]), hscache.open_cache(vllm_sampled["b"])
    assert a.index.to_pylist() == b.index.to_pylist()  # ids, samples, lengths, stop reasons, token hashes
    for row in range(len(a)):
        assert torch.equal(a.token_ids(row), b.token_ids(row))
        for x, y in zip(
            (*a.sampled_support(row), a.realised_prob(row)), (*b.sampled_support(row), b.realised_prob(row))
        ):
            assert torch.equal(x.nan_to_num(-5), y.nan_to_num(-5))
        assert torch.equal(a.hidden_states(row), b.hidden_states(row))
    # two samples of one prompt are two requests with their own seeds: not the same text
    assert any(not torch.equal(a.token_ids(r), a.token_ids(r + 1)) for r in range(0, len(a), 2))
    for name in SAMPLED_ARRAYS:
        assert a.manifest["arrays"][name]["chunk_sha256"] == b.manifest["arrays"][name]["chunk_sha256"]


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no vLLM environment at .vllm (build it: bash .ci/vllm-env.sh)"
)
def test_the_stored_support_is_vllms_processed_distribution_of_the_cached_top_k(vllm_sampled):
    """Recomputed here from the cache's raw top-64 log-probabilities (vLLM's capture pass) with this
    project's independent transcription of vLLM's Sampler, wherever the top-64 holds the top-20 after
    the presence penalty (penalties only lower a logit: an uncached token cannot overtake)."""
    cache = hscache.open_cache(vllm_sampled["a"])
    s, vocab = cache.sampling, cache.vocab_size
    assert s.drawn_by == "vllm" and s.min_p == 0 and (s.temperature, s.top_k, s.seed) == (0.8, 20, 7)
    checked = positions = 0
    worst = 0.0
    for row in range(len(cache)):
        tokens, plen = cache.token_ids(row), _prompt_len(cache, row)
        values, ids = cache.target_topk(row)
        support_ids, support_probs = cache.sampled_support(row)
        realised = cache.realised_prob(row)
        for t in range(plen - 1, len(tokens) - 1):
            positions += 1
            out = tokens[plen : t + 1]
            # every drawn token lies in the stored support, with its own probability
            got = dense(support_ids[t].long(), support_probs[t], vocab)
            assert realised[t] > 0 and realised[t] == got[tokens[t + 1]], (row, t)
            adjusted = values[t] - s.presence_penalty * torch.isin(ids[t], out.to(ids.dtype))
            if adjusted.sort(descending=True).values[s.top_k - 1] < values[t].min():
                continue
            logits = torch.full((vocab,), -float("inf"))
            logits[ids[t]] = values[t]
            want = vllm_processed(logits, tokens[:plen].tolist(), out.tolist(), s)
            assert torch.equal(got > 0, want > 0), (row, t)
            worst = max(worst, float((got - want).abs().max()))
            checked += 1
        assert realised[: plen - 1].isnan().all() and realised[-1].isnan()
    # 48 of 48 on this target (measured: the generation and capture passes agree within 9e-8)
    assert checked >= positions - 2 and positions == 48
    assert worst < 1e-6
    counts = cache.provenance["sampling"]
    assert (counts["sampled_positions"], counts["realised_outside_support"]) == (positions, 0)


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no vLLM environment at .vllm (build it: bash .ci/vllm-env.sh)"
)
def test_provenance_names_vllms_sampler_and_its_seed_rule_and_verify_passes(vllm_sampled):
    cache = hscache.open_cache(vllm_sampled["a"])
    sampler = cache.provenance["sampling"]["sampler"]
    assert (
        sampler["engine"] == "vllm"
        and sampler["version"].startswith("0.32")
        and sampler["seed_rule"] == SEED_RULE
    )
    assert any("_expand_kernel_impl" in p for p in sampler["patches"])  # T > 0 crashes vLLM CPU without it
    assert cache.provenance["capture"]["engine"]["patches"] == sampler["patches"]
    assert "drawn by vLLM's sampler" in cache.sampling.describe()
    result = CliRunner().invoke(hscache_main, ["verify", str(vllm_sampled["a"]), "--deep"])
    assert result.exit_code == 0 and "sampling=ok" in result.output, result.output


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no vLLM environment at .vllm (build it: bash .ci/vllm-env.sh)"
)
def test_scorer_eval_scores_the_sampled_vllm_cache(vllm_sampled, tmp_path):
    out = tmp_path / "eval.json"
    args = [
        "eval",
        "ngram",
        "--cache",
        str(vllm_sampled["a"]),
        "--num-speculative-tokens",
        "3",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(scorer_main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["tokens"] > 0 and report["rounds"] > 0


def test_the_seed_rule_is_the_judges_and_a_shard_keeps_each_records_seed():
    # sample n of prompt i: seed + i * samples + n (the judge numbers the cache's prompts the same way)
    assert [request_seed(7, i, n, 2) for i in range(3) for n in range(2)] == [7, 8, 9, 10, 11, 12]
    assert request_seed(None, 1, 0, 2) is None
    # shard 1 of 3 holds records 1, 4, ...: its second record (n = 2, 3) is record 4 of the whole run
    assert [sequence_seed(SETTING, n, (1, 3)) for n in range(4)] == [9, 10, 15, 16]
    assert [sequence_seed(SETTING, n) for n in range(4)] == [7, 8, 9, 10]


def test_the_worker_job_carries_the_sampling_setting(tmp_path):
    config = sampled_config(tmp_path / "p.jsonl", tmp_path / "o")
    job = json.loads(json.dumps(worker_job(config)))
    assert job["out"] == str((tmp_path / "o").absolute()) and "vllm_python" not in job
    assert config_of(job) == config


def test_sampled_vllm_refusals_are_one_line_before_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("HSCACHE_VLLM_PYTHON", str(VLLM_PYTHON))  # refused before it is ever started
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    base = ["extract", "--engine", "vllm", "--model", "builtin:tiny-qwen3", "--prompts", str(prompts)]
    base += ["--out", str(tmp_path / "c"), "--quiet", "--temperature", "0.7"]
    cases = [
        (["--top-k", "20", "--min-p", "0.05"], "--engine vllm with --min-p 0.05: vLLM"),
        ([], "sampling with top-k disabled"),  # the support would be the whole vocabulary
    ]
    for extra, message in cases:
        result = CliRunner().invoke(hscache_main, [*base, *extra])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: {message}") and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "c").exists()
    with pytest.raises(InputError, match="drawn by vLLM's sampler needs --engine vllm"):
        extract(
            sampled_config(
                prompts, tmp_path / "c", engine="transformers", sampling=replace(SETTING, drawn_by="vllm")
            )
        )
    assert not (tmp_path / "c").exists()
