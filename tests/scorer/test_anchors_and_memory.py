"""``scorer eval --anchors chain`` equals ``all``; ``--memory-gb`` changes no number."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.families.dflash.features import feature_index
from scorer.families.dflash.score import draft_all_anchors
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, evaluate, load_drafter

_SAME = ("tau", "rounds", "tokens", "requests", "tokens_per_round_histogram", "ddtree", "ddtree_detail")


@pytest.mark.parametrize("dtype", ["fp32"])
def test_chain_anchors_give_the_same_tau_ddtree_and_requests_as_all(scorer_cache, trained_drafter, dtype):
    base = EvalConfig(ddtree=(2, 16), n_boot=20, dtype=dtype)
    full = evaluate(trained_drafter, scorer_cache, base)
    chain = evaluate(trained_drafter, scorer_cache, EvalConfig(**{**base.__dict__, "anchors": "chain"}))
    for key in _SAME:
        assert chain[key] == full[key], key
    # The lockstep forwards batch other blocks together than "all" does, so log-probs may differ
    # in the last float bits (drafted tokens and trees above did not): the surrogate, a sum of
    # exp(log-prob), agrees to float32 rounding, not bit for bit.
    for budget, value in full["ddtree_surrogate"].items():
        assert chain["ddtree_surrogate"][budget] == pytest.approx(value, rel=1e-5)
    drop = ("row",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in chain["per_request"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in full["per_request"]
    ]
    assert full["anchors"]["mode"] == "all" and chain["anchors"]["mode"] == "chain"
    assert full["anchors"]["drafted"] == sum(r["tokens"] for r in full["per_request"])  # T-1-P each
    assert 0 < chain["anchors"]["drafted"] < full["anchors"]["drafted"]
    # What needs every anchor is reported only for "all", and the chain report says why.
    assert full["train_accept_len"] is not None and full["acceptance"]["conditional"][0] is not None
    assert chain["train_accept_len"] is None and chain["acceptance"]["conditional"] == [None] * 5
    assert any("--anchors chain" in w for w in chain["warnings"])


def test_tiny_memory_budgets_give_bit_identical_drafts(scorer_cache, trained_drafter):
    cache = hscache.open_cache(scorer_cache)
    drafter, _ = load_drafter(trained_drafter, cache, EvalConfig())
    index = feature_index(drafter.config, cache.layer_ids)
    P = cache.index.column("prompt_len")[0].as_py()
    ids = cache.token_ids(0)
    feats = sequence_features(cache.hidden_states(0), index, torch.float32, "cpu")
    # Independent reference: one block_hidden call over every anchor, one head call over every row.
    anchors = torch.arange(P, len(ids) - 1)
    blocks = torch.full((len(anchors), drafter.config.block_size), drafter.config.mask_token_id)
    blocks[:, 0] = ids[anchors]
    logits = drafter.head(drafter.block_hidden(feats, anchors, blocks, max_blocks_per_forward=4)).float()
    top = torch.topk(torch.log_softmax(logits, -1), 16, dim=-1)
    for memory_gb in (2.0, 1e-9):  # 1e-9: 48 head rows per chunk, groups of 8 blocks
        draft, vals, lp_ids = draft_all_anchors(drafter, feats, ids, P, 16, 4, memory_gb=memory_gb)
        assert len(anchors) * (drafter.config.block_size - 1) > 2 * 48
        np.testing.assert_array_equal(draft, logits.argmax(-1).numpy())
        np.testing.assert_array_equal(vals, top.values.numpy())
        np.testing.assert_array_equal(lp_ids, top.indices.numpy())


def test_bad_anchor_mode_and_budget_are_one_line_errors(scorer_cache, trained_drafter):
    cache = hscache.open_cache(scorer_cache)
    with pytest.raises(ScorerError, match="--anchors 'every'; choose all or chain"):
        load_drafter(trained_drafter, cache, EvalConfig(anchors="every"))
    with pytest.raises(ScorerError, match="--memory-gb 0"):
        load_drafter(trained_drafter, cache, EvalConfig(memory_gb=0))
    for flag in (["--anchors", "every"], ["--memory-gb", "0"]):
        result = CliRunner().invoke(main, ["eval", str(trained_drafter), "--cache", str(scorer_cache), *flag])
        assert result.exit_code == 2, result.output
        assert flag[0] in result.output


def test_chain_anchors_equal_all_for_a_sliding_window_drafter(scorer_cache, trained_drafter, tmp_path):
    """The chain path reuses precomputed context keys: the window must still mask them by position."""
    import json
    import shutil

    drafter = tmp_path / "sliding"
    shutil.copytree(trained_drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config.update(
        layer_types=["sliding_attention"] * config["num_hidden_layers"],
        sliding_window=4,
        use_sliding_window=True,
    )
    (drafter / "config.json").write_text(json.dumps(config))
    base = EvalConfig(ddtree=(4,), n_boot=20, limit=3)
    full = evaluate(drafter, scorer_cache, base)
    chain = evaluate(drafter, scorer_cache, EvalConfig(**{**base.__dict__, "anchors": "chain"}))
    assert [r["accepted"] for r in chain["per_request"]] == [r["accepted"] for r in full["per_request"]]
    assert chain["ddtree"] == full["ddtree"]
    unwindowed = evaluate(trained_drafter, scorer_cache, base)  # the window mattered on this data
    assert [r["accepted"] for r in unwindowed["per_request"]] != [r["accepted"] for r in full["per_request"]]
