"""``scorer online --tree`` at temperature > 0 (scorer/online_sampled.py): SGLang's EAGLE tree drafted
online is the tree the offline replay builds, and the loop reports it as SGLang's rule.

The offline-equals-online comparison of tree tau is in tests/scorer/test_served_vs_online.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import hscache
from hscache import schemas
from scorer.families.autoregressive import candidate_trees
from scorer.families.base import OnlineOptions
from scorer.online import open_online
from scorer.scoring import EvalConfig, load_drafter
from scorer.sequences import sequence_features

MODEL = "builtin:tiny-qwen3.5"
TREE = (3, 2, 6)  # two children per node, a depth-3 frontier: siblings, depths and the N-1 cut all matter


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more torch threads spin against each other
    yield
    torch.set_num_threads(before)


def _offline_trees(family: str, checkpoint: str, view, row: int, prompt_len: int):
    """Every anchor's kept candidates built the offline replay's way: step 0 over the WHOLE cached
    sequence once, then ``candidate_trees`` at rows P-1..T-2 (scorer eval --tree)."""
    drafter, _ = load_drafter(checkpoint, view, EvalConfig(ddtree=(), tree=TREE))
    tokens = view.token_ids(row)
    if family == "eagle3":
        index = [view.layer_ids.index(i) for i in drafter.config.target_layer_ids]
        steps = drafter
        inputs = sequence_features(view.hidden_states(row), index, torch.float32, "cpu", None)
    else:
        from scorer.families.mtp.draft import TreeSteps
        from scorer.families.mtp.seam import mtp_hidden

        steps = TreeSteps(drafter)
        inputs = mtp_hidden(drafter, view.hidden_states(row), view.layer_ids, torch.float32, "cpu")
    with torch.no_grad():
        normed0, fed0, kv0 = steps.step0(inputs, tokens, len(tokens) - 2)
        rows = torch.arange(prompt_len - 1, len(tokens) - 2)
        return candidate_trees(steps, normed0, fed0, kv0, rows, TREE)


@pytest.mark.parametrize("family", ["eagle3", "mtp"])
def test_online_tree_is_the_offline_replays_tree_at_every_anchor(family, eagle3_drafter, scorer_cache):
    """The online proposer, given the verified prefix only (as in a round), drafts at anchor p exactly
    the kept candidates the offline replay built from the whole sequence at row p - 1: same tokens,
    same parents, in candidate order (the order SGLang tries siblings in)."""
    checkpoint = str(eagle3_drafter) if family == "eagle3" else "target:mtp"
    view = hscache.open_cache(scorer_cache)
    row = 0
    prompt_len = int(view.index.column("prompt_len")[row].as_py())
    session = open_online(checkpoint, MODEL, "fp32", OnlineOptions(overrides={}))
    hidden = view.hidden_states(row)[:, [view.layer_ids.index(i) for i in session.layer_ids]]
    ids = view.token_ids(row).tolist()
    all_tokens, all_parents, keep = _offline_trees(family, checkpoint, view, row, prompt_len)
    siblings = 0
    for r, p in enumerate(range(prompt_len, len(ids) - 1)):
        online = session.propose(hidden[:p], ids[: p + 1], p, tree=TREE)
        kept = sorted(keep[r].tolist())
        assert online.tokens.tolist() == [int(all_tokens[r, c]) for c in kept], p
        position = {c: n for n, c in enumerate(kept)} | {-1: -1}
        assert online.parents.tolist() == [position[int(all_parents[r, c])] for c in kept], p
        siblings += int((online.parents == -1).sum() > 1)
    assert siblings > 0  # the root's second child was kept somewhere: a tree, not a chain


def test_online_ddtree_is_the_offline_replays_ddtree_at_every_anchor(trained_drafter, scorer_cache):
    """``scorer online --ddtree N``: DFlash's proposer, given the verified prefix only, builds at anchor p
    exactly the DDTree the offline replay builds from the whole cached sequence (``draft_all_anchors``'
    per-slot top-K, then ``build_tree``): same tokens, same parents, in the heap's order."""
    from scorer.families.dflash.ddtree import build_tree
    from scorer.families.dflash.features import feature_index
    from scorer.families.dflash.score import draft_all_anchors

    budget = 8
    view = hscache.open_cache(scorer_cache)
    row = 0
    prompt_len = int(view.index.column("prompt_len")[row].as_py())
    drafter, _ = load_drafter(str(trained_drafter), view, EvalConfig(ddtree=(budget,)))
    index = feature_index(drafter.config, view.layer_ids)
    features = sequence_features(view.hidden_states(row), index, torch.float32, "cpu", drafter.context_norm)
    tokens = view.token_ids(row)
    with torch.no_grad():
        _, lp_vals, lp_ids = draft_all_anchors(drafter, features, tokens, prompt_len, tree_k=budget)
    session = open_online(str(trained_drafter), MODEL, "fp32", OnlineOptions(overrides={}))
    hidden = view.hidden_states(row)[:, [view.layer_ids.index(i) for i in session.layer_ids]]
    ids = tokens.tolist()
    branched = 0
    for r, p in enumerate(range(prompt_len, len(ids) - 1)):
        online = session.propose(hidden[:p], ids[: p + 1], p, ddtree=budget)
        offline = build_tree(lp_vals[r], lp_ids[r], budget)
        assert online.tokens.tolist() == list(offline.token_ids), p
        assert online.parents.tolist() == list(offline.parents), p
        branched += int(len(set(offline.parents)) < budget)  # a node with two children: a tree
    assert branched > 0


def test_cli_ddtree_run_writes_the_tree_rule_and_budget_into_a_valid_report(trained_drafter, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "online.json"
    args = ["online", str(trained_drafter), "--temperature", "0.7", "--sample-top-k", "5", "--ddtree", "3"]
    result = CliRunner().invoke(
        main, [*args, "--runs", "2", "--limit", "1", "--max-new-tokens", "4", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    rule = document["sampled"]["rule"]
    assert rule["name"] == "sglang-target-only" and rule["ddtree"] == 3 and "tree" not in rule
    assert "DFlash DDTree of 3 nodes" in rule["description"] in result.output
    rounds = [r["tokens_per_round"] for r in document["per_request"]]
    assert len(rounds) == 2 and all(1 <= t <= 4 for run in rounds for t in run)  # 3 nodes: <= 4 a round
    assert sum(np.concatenate(rounds)) == sum(r["generated"] - 1 for r in document["per_request"])


def test_cli_tree_run_writes_sglangs_rule_into_a_valid_report(tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "online.json"
    args = ["online", "target:mtp", "--temperature", "0.7", "--sample-top-k", "5", "--tree", "2,2,4"]
    result = CliRunner().invoke(
        main, [*args, "--runs", "2", "--limit", "1", "--max-new-tokens", "4", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    rule = document["sampled"]["rule"]
    assert rule["name"] == "sglang-target-only" and rule["tree"] == [2, 2, 4]
    assert "TreeSpeculativeSamplingTargetOnly" in rule["description"] in result.output
    rounds = [r["tokens_per_round"] for r in document["per_request"]]
    assert len(rounds) == 2 and all(1 <= t <= 3 for run in rounds for t in run)  # depth 2: <= 3 a round
    assert sum(np.concatenate(rounds)) == sum(r["generated"] - 1 for r in document["per_request"])


@pytest.mark.parametrize(
    "checkpoint,shape,message",
    [
        ("dflash", {"tree": (2, 2, 4)}, "the dflash family's online proposer drafts none: drop --tree"),
        (
            "target:mtp",
            {"ddtree": 4},
            "--ddtree is DFlash's DDTree, drafted online by the DFlash family; the mtp",
        ),
        ("dflash2", {"ddtree": 4}, "the dflash2 family's online proposer drafts none: drop --ddtree"),
    ],
)
def test_a_family_without_an_online_tree_is_refused_by_name(
    checkpoint, shape, message, trained_drafter, tmp_path
):
    """--tree is EAGLE-3's and MTP's, --ddtree DFlash's; DFlash2 drafts its selector's walk (a chain), and
    its per-slot top-K DDTree would be another drafter than the one it serves (no engine runs it)."""
    from hscache.store.sampling import SamplingSetting
    from scorer.errors import ScorerError
    from scorer.online import OnlineConfig
    from scorer.online_sampled import SampledOnlineConfig, run_online_sampled

    if checkpoint == "dflash":
        checkpoint = str(trained_drafter)
    elif checkpoint == "dflash2":
        from scorer.families.dflash2.init import init_from_dflash

        checkpoint = str(init_from_dflash(trained_drafter, tmp_path / "dflash2", selector_rank=8))
    setting = SamplingSetting.from_flags(temperature=0.7, top_k=5, seed=1)
    config = SampledOnlineConfig(checkpoint, setting, runs=1, online=OnlineConfig(limit=1), **shape)
    with pytest.raises(ScorerError, match=re.escape(message)):
        run_online_sampled(config)
