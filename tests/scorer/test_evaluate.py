"""Stage two end to end on the cache: stand-in drafters with known answers, an independent
slow replay loop, checks before scoring, and the JSON report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import hscache
from hscache import schemas
from hscache.capture.target import load_target
from scorer.errors import IncompatibleCacheError
from scorer.families.dflash.checkpoint import load_checkpoint, save_hf_checkpoint
from scorer.families.dflash.model import DFlashDrafter
from scorer.families.dflash.score import score_dflash_sequence
from scorer.studies.evaluate import EvalConfig, evaluate, load_drafter


class _StandIn:
    """The drafter interface (config, block_hidden, head) with answers fixed in advance.

    block_hidden returns one-hot rows over the vocabulary, head is the identity: the draft of
    slot j at anchor p is whatever ``choose(p, j)`` says.
    """

    # DFlash's drafting from the head: the per-slot argmax.
    slot_candidates = DFlashDrafter.slot_candidates
    path = DFlashDrafter.path

    def __init__(self, block_size: int, vocab: int, choose):
        self.config = SimpleNamespace(block_size=block_size, mask_token_id=0, vocab_size=vocab)
        self.vocab, self.choose = vocab, choose

    def context_kv(self, features):
        return None

    def block_hidden(self, features, anchors, blocks, **_):
        out = torch.zeros(len(anchors), self.config.block_size - 1, self.vocab)
        for n, p in enumerate(anchors.tolist()):
            for j in range(1, self.config.block_size):
                out[n, j - 1, self.choose(p, j)] = 1.0
        return out

    def head(self, hidden):
        return hidden


def _sequence(cache, i):
    row = cache.index.to_pylist()[i]
    return cache.token_ids(i), cache.target_argmax(i), row["prompt_len"]


def test_oracle_gets_the_maximum_tau_and_an_always_wrong_drafter_gets_one(scorer_cache):
    cache = hscache.open_cache(scorer_cache)
    B, V = 5, 512
    for i in range(len(cache)):
        ids, argmax, P = _sequence(cache, i)
        T = len(ids)
        g = lambda p, j, argmax=argmax, T=T: int(argmax[min(p + j - 1, T - 1)])
        feats = torch.zeros(T, 1)  # the stand-ins ignore features
        oracle = score_dflash_sequence(_StandIn(B, V, g), feats, ids, argmax, P)
        generated = T - 1 - P  # tokens after the first bonus token
        full, rest = divmod(generated, B)
        assert oracle.chain.tokens == tuple([B] * full + ([rest] if rest else []))
        wrong = score_dflash_sequence(
            _StandIn(B, V, lambda p, j, g=g: (g(p, j) + 1) % V), feats, ids, argmax, P
        )
        assert wrong.chain.tau == 1.0 and wrong.chain.n_rounds == generated


def _reference_tau(
    drafter: DFlashDrafter, cache, i: int, features_index: list[int], final_norm=None
) -> list[int]:
    """Obviously correct: one reference forward per round, compare, advance."""
    ids, argmax, P = _sequence(cache, i)
    hidden = cache.hidden_states(i)[:, features_index].clone()
    if final_norm is not None:  # layer L-1 is read as transformers' hidden_states[L]: after the norm
        slot, norm = final_norm
        with torch.no_grad():
            hidden[:, slot] = norm(hidden[:, slot])
    feats = hidden.reshape(len(ids), -1).float()
    B, T, p, tokens = drafter.config.block_size, len(ids), P, []
    while p < T - 1:
        block = torch.tensor([int(ids[p])] + [drafter.config.mask_token_id] * (B - 1))
        draft = drafter.forward_one_block(feats, block, p).argmax(-1).tolist()
        acc = 0
        while (
            acc < B - 1
            and p + acc + 1 <= T - 1
            and draft[acc] == int(ids[p + acc + 1])
            and int(argmax[p + acc]) == int(ids[p + acc + 1])
        ):
            acc += 1
        step = min(acc + 1, T - 1 - p)
        tokens.append(step)
        p += step
    return tokens


def test_replay_equals_a_slow_reference_loop(scorer_cache, trained_drafter):
    cache = hscache.open_cache(scorer_cache)
    report = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=50))
    drafter, _ = load_drafter(trained_drafter, cache, EvalConfig())
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    target = load_target("builtin:tiny-qwen3.5", "fp32")  # its own final norm module, not scorer's
    last = target.num_layers - 1
    final_norm = None
    if last in drafter.config.target_layer_ids:
        final_norm = (drafter.config.target_layer_ids.index(last), target.model.model.norm)
    for i, row in enumerate(report["per_request"]):
        expected = _reference_tau(drafter, cache, i, index, final_norm)
        tokens = [
            min(a + 1, len(cache.token_ids(i)) - 1 - p) for a, p in zip(row["accepted"], row["anchors"])
        ]
        assert tokens == expected, row["record_id"]
    assert report["tau"]["per_request"] > 1.2  # the trained drafter is clearly better than nothing


def test_report_has_every_documented_key_and_validates(scorer_cache, trained_drafter):
    report = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(4, 16), samples=2, n_boot=50))
    schemas.validate(report, "eval_report")
    assert isinstance(report["tau"]["per_request"], float) and isinstance(report["tau"]["pooled"], float)
    assert len(report["acceptance"]["conditional"]) == 5 == len(report["acceptance"]["unconditional"])
    assert set(report["ddtree"]) == {"4", "16"} and report["rounds"] > 0
    assert isinstance(report["train_accept_len"], float)
    assert report["checkpoint"]["sha256"] and report["cache"]["provenance"]["capture"]["backend"] == "torch"
    assert len(report["samples"]) == 2 and report["per_category"]["code"]["n_requests"] == 6
    # the conventions differ by definition, and both are reported
    chain = [(r["tokens"], r["rounds"]) for r in report["per_request"] if r["rounds"]]
    assert report["tau"]["pooled"] == pytest.approx(sum(t for t, _ in chain) / sum(n for _, n in chain))
    assert report["tau"]["per_request"] == pytest.approx(sum(t / n for t, n in chain) / len(chain))


def test_ddtree_with_budget_one_equals_the_chain_on_slot_one(scorer_cache, trained_drafter):
    report = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(1,), n_boot=20))
    # a budget-1 tree is the top-1 token of slot 1 only: at most 2 tokens per round
    assert 1.0 <= report["ddtree"]["1"] <= 2.0


def test_missing_layers_are_refused_before_scoring(scorer_cache, trained_drafter, tmp_path):
    loaded = load_checkpoint(trained_drafter)
    config = loaded.config.__class__(**{**loaded.config.__dict__, "target_layer_ids": (1, 3, 6)})
    save_hf_checkpoint(tmp_path / "d", config, loaded.state_dict)
    with pytest.raises(IncompatibleCacheError, match=r"need layers \[6\] that .* lacks .* --layers 1,3,6"):
        evaluate(tmp_path / "d", scorer_cache)


def test_hidden_size_and_vocab_mismatch_are_refused(scorer_cache, trained_drafter, tmp_path):
    loaded = load_checkpoint(trained_drafter)
    c = loaded.config
    config = c.__class__(**{**c.__dict__, "hidden_size": 64, "vocab_size": 1000, "head_dim": 16})
    drafter = DFlashDrafter(config)
    save_hf_checkpoint(tmp_path / "d", config, drafter.state_dict())
    with pytest.raises(
        IncompatibleCacheError, match="hidden_size 64 != target hidden size 128.*vocab_size 1000"
    ):
        evaluate(tmp_path / "d", scorer_cache)


def test_config_less_safetensors_takes_missing_fields_from_the_cache(scorer_cache, trained_drafter, tmp_path):
    from safetensors.torch import save_file

    loaded = load_checkpoint(trained_drafter)
    save_file(loaded.state_dict, str(tmp_path / "bare.safetensors"))
    report = evaluate(
        tmp_path / "bare.safetensors", scorer_cache, EvalConfig(ddtree=(), n_boot=20, block_size=6)
    )
    sources = report["checkpoint"]["field_sources"]
    assert sources["target_layer_ids"] == "cache" and sources["mask_token_id"] == "cache"
    assert sources["block_size"] == "override" and sources["hidden_size"] == "shapes"
    reference = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20))
    assert report["tau"] == reference["tau"]


def test_cli_eval_writes_json_and_compares_caches(scorer_cache, trained_drafter, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        main,
        [
            "eval",
            str(trained_drafter),
            "--cache",
            str(scorer_cache),
            "--cache",
            str(scorer_cache),
            "--ddtree",
            "4",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["reports"]) == 2
    comparison = doc["comparisons"][0]
    assert comparison["delta"]["pooled"]["delta"] == 0.0 and comparison["rounds_with_changed_acceptance"] == 0
    assert "tau, per request then mean (DFlash)" in result.output


def test_cli_refuses_a_malicious_pickle_without_trust(scorer_cache, tmp_path):
    import os

    from click.testing import CliRunner

    from scorer.cli import main

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": {"fc.weight": torch.zeros(2, 2)}, "evil": Evil()}, tmp_path / "evil.pt")
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "evil.pt"), "--cache", str(scorer_cache)])
    assert result.exit_code == 2 and "--trust-checkpoint" in result.output
    assert result.output.strip().startswith("error: ") and "\n" not in result.output.strip()
    assert not marker.exists()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: CPU and GPU paths are compared there"
)
def test_cpu_and_gpu_paths_agree(scorer_cache, trained_drafter):
    cpu = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(8,), n_boot=20))
    gpu = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(8,), n_boot=20, device="cuda"))
    assert gpu["drafter"]["attention_backend"] in ("flex", "sdpa", "flex+sdpa")
    # fp32 on both; a near-tie argmax may flip, so compare the rounds, allowing rare differences
    same = sum(a["accepted"] == b["accepted"] for a, b in zip(cpu["per_request"], gpu["per_request"]))
    assert same >= len(cpu["per_request"]) - 1
    assert gpu["tau"]["pooled"] == pytest.approx(cpu["tau"]["pooled"], rel=0.02)


def test_records_without_a_category_are_reported_under_none(tmp_path):
    from scorer import init_drafter
    from tests.conftest import write_jsonl

    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [{"id": "a", "prompt": "def f(x):", "category": "code"}, {"id": "b", "prompt": "Two plus two is"}],
    )
    hscache.extract(
        hscache.ExtractConfig(
            out=str(tmp_path / "c"), prompts=str(prompts), layers="1,3", max_new_tokens=6, dtype="fp32"
        )
    )
    init_drafter(tmp_path / "c", tmp_path / "d", block_size=4)
    report = evaluate(tmp_path / "d", tmp_path / "c", EvalConfig(ddtree=(), n_boot=10))
    assert set(report["per_category"]) == {"code", "(none)"}


def test_cli_rejects_ddtree_budgets_below_one(scorer_cache, trained_drafter):
    from click.testing import CliRunner

    from scorer.cli import main

    result = CliRunner().invoke(
        main, ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--ddtree", "0"]
    )
    assert result.exit_code == 2 and "every value must be at least 1" in result.output
