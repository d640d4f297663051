"""``scorer online --tree`` at temperature > 0 (scorer/online/sampled.py): SGLang's EAGLE tree drafted
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
from scorer.offline.scoring import EvalConfig, load_drafter
from scorer.offline.sequences import sequence_features
from scorer.online.greedy import open_online

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
    args = ["online", str(trained_drafter), "--temperature", "0.7", "--top-k", "5", "--ddtree", "3"]
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
    """With a presence penalty (SGLang's relaxed rule): the report records the rule, the penalty rule
    and the penalty."""
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "online.json"
    args = ["online", "target:mtp", "--temperature", "0.7", "--top-k", "5", "--tree", "2,2,4"]
    args += ["--presence-penalty", "1.5"]
    result = CliRunner().invoke(
        main, [*args, "--runs", "2", "--limit", "1", "--max-new-tokens", "4", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    rule = document["sampled"]["rule"]
    assert rule["name"] == "sglang-target-only" and rule["tree"] == [2, 2, 4]
    assert (
        rule["penalties"] == "sglang-relaxed" and document["sampled"]["sampling"]["presence_penalty"] == 1.5
    )
    assert "TreeSpeculativeSamplingTargetOnly" in rule["description"] in result.output
    assert "penalties SGLang's relaxed way (presence 1.5, frequency 0)" in rule["description"]
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
    from scorer.online.greedy import OnlineConfig
    from scorer.online.sampled import SampledOnlineConfig, run_online_sampled

    if checkpoint == "dflash":
        checkpoint = str(trained_drafter)
    elif checkpoint == "dflash2":
        from scorer.families.dflash2.init import init_from_dflash

        checkpoint = str(init_from_dflash(trained_drafter, tmp_path / "dflash2", selector_rank=8))
    setting = SamplingSetting.from_flags(temperature=0.7, top_k=5, seed=1)
    config = SampledOnlineConfig(checkpoint, setting, runs=1, online=OnlineConfig(limit=1), **shape)
    with pytest.raises(ScorerError, match=re.escape(message)):
        run_online_sampled(config)


def _sglang_processed(logits: torch.Tensor, fed: list[int], s) -> torch.Tensor:
    """SGLang's tree verification of one row, written here from its source (scorer.online.sampled.SGLANG_PENALTY):
    linear_penalty = zeros; the presence penalizer subtracts its value at every fed token (scatter), the
    frequency one its value times the count (scatter_add); logits + linear_penalty; softmax(/T);
    top_k_renorm_prob; top_p_renorm_prob (the smallest top prefix reaching p, renormalised)."""
    fed_ids = torch.tensor(fed, dtype=torch.long)
    presence = torch.zeros(len(logits), dtype=torch.float64).scatter_(0, fed_ids, s.presence_penalty)
    frequency = torch.zeros(len(logits), dtype=torch.float64).index_add_(
        0, fed_ids, torch.full((len(fed),), s.frequency_penalty, dtype=torch.float64)
    )
    linear_penalty = torch.zeros(len(logits), dtype=torch.float64) - presence - frequency
    probs = torch.softmax((logits.double() + linear_penalty) / s.temperature, -1)
    probs = torch.where(probs >= torch.sort(probs, descending=True).values[s.top_k - 1], probs, 0.0)
    probs = probs / probs.sum()
    ordered, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ordered, -1) - ordered  # the mass above each token
    probs[order[before >= s.top_p]] = 0.0
    return probs / probs.sum()


def test_sglang_relaxed_penalty_is_one_pre_round_vector_for_every_node():
    """A tree round's rows under SGLang's rule: every row gets the penalty of the tokens SGLang's penalizers
    were fed before the round (every round's anchor: not the accepted draft), whatever the path; vLLM's
    rule instead penalises a draft again at the rows after it, so a candidate repeating an in-round draft
    keeps more probability under SGLang's."""
    from hscache.store.sampling import SamplingSetting
    from scorer.online.sampled import RowBlock, processed_rows, sglang_penalty_history

    vocab = 12
    s = SamplingSetting(
        temperature=0.7, top_k=6, top_p=0.9, presence_penalty=1.5, frequency_penalty=0.4, seed=0
    )
    prompt = [3, 4, 11]
    # generated: 7 (the prefill's token), round 1 committed [2, 9] (2 an accepted draft), round 2 [9]
    ids = [*prompt, 7, 2, 9, 9]
    fed = sglang_penalty_history(ids, len(prompt), [2, 1])
    assert fed == [7, 9, 9]  # the anchors of rounds 1-3; the accepted draft 2 is never fed
    path = [5, 5, 8]  # a root-to-leaf path whose second node repeats the first
    logits = torch.randn((len(path) + 1, vocab), generator=torch.Generator().manual_seed(3))
    logits[:, 5] += 2.0  # 5 stays in the top-k at every row
    sglang = processed_rows(logits, [RowBlock(fed, prompt, path, in_round=False)], s, vocab)
    expected = torch.stack([_sglang_processed(row, fed, s) for row in logits])
    torch.testing.assert_close(sglang.double(), expected, atol=1e-6, rtol=0)
    vllm = processed_rows(logits, [RowBlock(fed, prompt, path, in_round=True)], s, vocab)
    torch.testing.assert_close(vllm[0], sglang[0])  # the root row: the same history under both rules
    assert float(sglang[1, 5]) > float(vllm[1, 5]) > 0  # node 1 repeats draft 5: penalised only by vLLM
    assert not torch.allclose(sglang[2], vllm[2])


def test_tree_rounds_process_every_node_with_the_pre_round_penalty():
    """Every tree round of the loop: the root's and every node's target row equal SGLang's processing
    (written here) of a plain transformers forward over the committed tokens and the node's path, with
    the penalty of the tokens SGLang feeds its penalizers: each round's anchor (its last committed token
    before it), never an accepted draft. The drafts are an oracle's: the root's children are the whole
    support of the root row, so every round accepts one and the two histories part from round 2 on;
    top-k 20 keeps the accepted drafts inside later rows' support, where counting them would show."""
    from types import SimpleNamespace

    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
    from hscache.store.sampling import SamplingSetting
    from scorer.online.sampled import DecodeSettings, decode_runs

    session = open_online("target:mtp", MODEL, "fp32", OnlineOptions(overrides={}))
    target = session.target
    record = next(iter(iter_records(resolve_prompts("builtin:default"))))
    prompts = [(record.record_id, prompt_token_ids(record, target.tokenizer))]
    # seed 1: on the trained built-in target seed 3 samples EOS (id 0) as round 1's bonus token, a one-round
    # decode; seed 1 runs four rounds (2, 2, 2, 1) (measured 2026-12-03; seeds 2 and 4-7 alike)
    s = SamplingSetting(temperature=1.0, top_k=20, presence_penalty=0.8, frequency_penalty=0.3, seed=1)
    fed: list[int] = []

    def oracle(hidden, ids, p, tree):
        fed.append(int(ids[-1]))  # SGLang feeds the round's anchor before drafting
        with torch.no_grad():
            logits = target.model(torch.tensor([list(ids)])).logits[0, -1].float()
        support = torch.nonzero(_sglang_processed(logits, fed, s) > 0).flatten().numpy()
        return SimpleNamespace(tokens=support, parents=np.full(len(support), -1))

    records = []
    settings = DecodeSettings(s, max_new_tokens=8, tree=TREE)
    (run,) = decode_runs(target, session.layer_ids, oracle, prompts, settings, [0], records.append)
    assert len(records) == len(run.requests[0].tokens_per_round) > 2
    parted = 0
    for n, rec in enumerate(records):
        ids, p = list(rec.token_ids), len(rec.token_ids) - 1
        anchors = [int(r.token_ids[-1]) for r in records[: n + 1]]
        # one plain forward of every root-to-node path (committed tokens + the node), batched: row
        # node's logits at p + 1 are that node's, any row's at p the root's (causal: the node is
        # not seen there)
        with torch.no_grad():
            paths = torch.tensor([ids + [int(t)] for t in rec.tree.tokens])
            logits = target.model(paths).logits[:, p : p + 2].float()
        for node in range(-1, len(rec.tree.tokens)):
            row = logits[0, 0] if node < 0 else logits[node, 1]
            # fp32 logits of two forwards agree to ~1e-6
            torch.testing.assert_close(
                rec.target_probs[node + 1].double(), _sglang_processed(row, anchors, s), atol=1e-4, rtol=0
            )
        assert int(rec.verified.accepted[0]) == 1  # the sampled token is always one of the children
        parted += sorted(anchors) != sorted(ids[len(prompts[0][1]) :])
    assert parted  # some round's generated tokens held an accepted draft that SGLang never fed
