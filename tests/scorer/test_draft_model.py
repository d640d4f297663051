"""The standalone draft model (scorer/families/draft_model/): its replay's drafts are vLLM's autoregressive
chain (an independent greedy loop on the LM's own KV cache, as draft_model.py drafts) wherever the replay
can count them; the built-in tiny-qwen3 drafts for a tiny-qwen3.5 cache (they share the tokenizer); a draft
LM of another tokenizer, or one without K, is refused by name. vLLM's own judgement:
tests/judge/test_draft_model_judged.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from scorer.cli import main
from scorer.families.draft_model.drafter import draft_positions, load, sequence_drafts
from scorer.families.draft_model.init import init_draft_model
from scorer.offline.scoring import EvalConfig

K = 3


@pytest.fixture(scope="module")
def draft_lm(qwen3_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft_model") / "lm"
    init_draft_model(qwen3_cache, out, num_layers=2)
    return out


def _greedy_chain(model, prefix: torch.Tensor, k: int) -> list[int]:
    """vLLM's draft_model proposer for one request: the verified tokens through the LM (its KV cache), then
    K argmax tokens, each fed back (transformers' own cache: an independent computation)."""
    out = model(input_ids=prefix[None], use_cache=True)
    drafted, past = [int(out.logits[0, -1].argmax())], out.past_key_values
    for _ in range(k - 1):
        out = model(input_ids=torch.tensor([[drafted[-1]]]), past_key_values=past, use_cache=True)
        drafted.append(int(out.logits[0, -1].argmax()))
        past = out.past_key_values
    return drafted


def test_replay_drafts_are_vllms_chain_where_they_count(draft_lm, qwen3_cache):
    cache = hscache.open_cache(qwen3_cache)
    drafter, loaded = load(str(draft_lm), cache, EvalConfig(num_speculative_tokens=K))
    assert loaded.report.format == "hf_dir" and drafter.config.to_hf_config()["num_hidden_layers"] == 2
    ids, prompt_len = cache.token_ids(0), int(cache.index.column("prompt_len")[0].as_py())
    replay = sequence_drafts(drafter, ids, prompt_len, memory_gb=1.0)
    assert replay.shape == (len(ids) - 1 - prompt_len, K)
    counted = 0
    with torch.no_grad():
        for r, p in enumerate(range(prompt_len, len(ids) - 1)):
            chain = _greedy_chain(drafter.model, ids[: p + 1], K)
            for j in range(K):
                if p + j + 1 > len(ids) - 1:
                    assert replay[r, j] == -1  # past the sequence: never matches
                    continue
                assert replay[r, j] == chain[j], (p, j)
                counted += 1
                if chain[j] != int(ids[p + j + 1]):
                    break  # later slots are drafted after a miss: the replay never counts them
    assert counted > len(replay)  # later slots were compared too, not only slot 1
    pos = draft_positions(prompt_len, len(ids), K)
    assert pos[0].tolist() == [prompt_len, prompt_len + 1, prompt_len + 2]


def test_builtin_lm_drafts_for_a_target_of_its_tokenizer(scorer_cache, tmp_path):
    """``scorer eval builtin:tiny-qwen3`` on a tiny-qwen3.5 cache, and the same LM named as a draft model."""
    reports = []
    for name in ("builtin:tiny-qwen3", "draft:builtin:tiny-qwen3"):
        out = tmp_path / f"{name.count(':')}.json"
        args = [
            "eval",
            name,
            "--cache",
            str(scorer_cache),
            "--num-speculative-tokens",
            str(K),
            "--json",
            str(out),
        ]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        reports.append(json.loads(out.read_text()))
    assert (
        reports[0]["drafter"]["family"] == "draft_model" and reports[0]["drafter"]["method"] == "draft_model"
    )
    assert reports[0]["per_request"] == reports[1]["per_request"]
    assert 1.0 < reports[0]["tau"]["pooled"] <= K + 1


def test_another_tokenizer_or_no_k_is_refused_by_name(draft_lm, qwen3_cache, tmp_path):
    from transformers import AutoTokenizer

    result = CliRunner().invoke(main, ["eval", str(draft_lm), "--cache", str(qwen3_cache)])
    assert result.exit_code == 2 and "pass --num-speculative-tokens K" in result.output
    other = tmp_path / "other"
    other.mkdir()
    for f in draft_lm.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<not-the-target's>"])
    tokenizer.save_pretrained(str(other))
    args = ["eval", str(other), "--cache", str(qwen3_cache), "--num-speculative-tokens", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "its tokenizer is not the target's" in result.output and "<not-the-target's>" in result.output


def test_probabilistic_proposals_are_the_lms_temperature_softmax(draft_lm, qwen3_cache):
    """q_{a,j}(y_{a+j}) = softmax(LM logits at a+j-1 / T), computed here from the full logits."""
    from scorer.families.draft_model.drafter import proposals

    cache = hscache.open_cache(qwen3_cache)
    drafter, _ = load(str(draft_lm), cache, EvalConfig(num_speculative_tokens=K))
    draft, log_q = proposals(drafter, cache, 0, EvalConfig(num_speculative_tokens=K), 0.7)
    ids, prompt_len = cache.token_ids(0), int(cache.index.column("prompt_len")[0].as_py())
    with torch.no_grad():
        logits = drafter.model(input_ids=ids[None]).logits[0].double()
    want = torch.log_softmax(logits / 0.7, dim=-1)
    for r, a in enumerate(range(prompt_len, len(ids) - 1)):
        for j in range(K):
            if a + j + 1 <= len(ids) - 1:
                assert log_q[r, j] == pytest.approx(float(want[a + j, ids[a + j + 1]]), abs=1e-5)
                assert draft[r, j] == int(logits[a + j].argmax())
            else:
                assert log_q[r, j] == -np.inf


def test_online_decoding_drafts_what_the_replay_drafted(scorer_cache):
    """``scorer online builtin:tiny-qwen3`` against the live tiny-qwen3.5: vLLM's loop (the LM over the
    verified tokens, then over its own drafts) commits the cached text in the replay's rounds, and drafts
    what the replay drafted in every slot that decides a round (the accepted ones and the first rejected;
    the replay's later slots are the LM on the cached tokens, which no round reads)."""
    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
    from hscache.capture.target import load_target
    from scorer.families import family_named
    from scorer.families.base import OnlineOptions
    from scorer.online.greedy import speculative_decode

    family, name = family_named("draft_model"), "builtin:tiny-qwen3"
    cache = hscache.open_cache(scorer_cache)
    config = EvalConfig(num_speculative_tokens=K, ddtree=())
    drafter, _ = family.load(name, cache, config)
    offline = family.score_rows(drafter, cache, [0], family.effective_config(config))[0]
    target = load_target("builtin:tiny-qwen3.5", "fp32")  # the cache's target, fp32 as the cache
    layer_ids, propose, _ = family.online(name, target, OnlineOptions(overrides={}, num_speculative_tokens=K))
    drafts = []

    def recording(hidden, ids, p):
        drafts.append(propose(hidden, ids, p))
        return drafts[-1]

    prompt = prompt_token_ids(next(iter_records(resolve_prompts("builtin:default"))), target.tokenizer)
    ids, rounds = speculative_decode(target, layer_ids, recording, prompt, 24, 4096)
    assert ids == cache.token_ids(0).tolist() and rounds == list(offline.chain.tokens)
    decisive = [min(n, K) for n in rounds]  # n = accepted + 1 (fewer at the sequence's end)
    for drafted, replayed, n in zip(drafts, offline.chain_drafts, decisive, strict=True):
        assert drafted[:n] == replayed[:n].tolist()
    assert max(rounds) > 1 and sum(decisive) > len(rounds)  # later slots were compared too


def test_the_hybrid_target_drafting_for_itself_in_bf16_accepts_what_it_verifies(bf16_cache):
    """``draft:builtin:tiny-qwen3.5`` on its own bf16 cache, drafting in bf16 as vLLM serves a draft model
    (in the target's dtype, config/speculative.py:1301): a hybrid (Gated DeltaNet) draft LM whose every
    draft is the cached argmax, so every round accepts all K slots the sequence has room for, except the
    rounds the replay cuts where the bf16 text leaves the argmax (counted, and named as a bf16 effect)."""
    from scorer.studies.evaluate import evaluate

    config = EvalConfig(num_speculative_tokens=K, dtype="bf16", ddtree=(), n_boot=10)
    report = evaluate("draft:builtin:tiny-qwen3.5", bf16_cache, config)
    assert report["config"]["dtype"] == "bf16" and report["drafter"]["layer_types"][0] == "linear_attention"
    for request in report["per_request"]:
        last = request["anchors"][0] + request["tokens"]  # T - 1
        short = [a < min(K, last - p) for a, p in zip(request["accepted"], request["anchors"], strict=True)]
        assert sum(short) == request["rounds_cut_off_greedy"], request["record_id"]
    assert report["tau"]["pooled"] > K  # nearly every round yields K + 1 tokens


def test_the_off_greedy_warning_names_the_cause_the_cache_points_to(bf16_cache):
    """A bf16 cache's cuts come from its greedy generation at near-ties (re-extracting with
    --max-new-tokens, the advice for a text the target did not write, would change nothing)."""
    from scorer.report.build import off_greedy_warning

    settings = hscache.open_cache(bf16_cache).settings
    bf16 = off_greedy_warning(2, settings)
    assert (
        bf16.startswith("2 rounds were cut short")
        and "a bf16 cache" in bf16
        and "--max-new-tokens" not in bf16
    )
    fp32 = {**settings, "dtype": "fp32"}
    assert "build the cache with --max-new-tokens N" in off_greedy_warning(1, {**fp32, "max_new_tokens": 0})
    assert "not the teacher-forced argmax path" in off_greedy_warning(1, fp32)
