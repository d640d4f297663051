"""Offline tau as served (scorer/studies/tau_as_served.py) equals ``scorer online``'s pooled tau at T > 0, and the
comparison tells the two verification rules apart (issue 25, first "Done when"; the every-family table
is bench/sampled_agreement.py's, in docs/sampling.md "Offline equals online").

Both sides estimate E over trajectories of the same prompt: offline on a cache SAMPLED at the setting
(RUNS trajectories of the prompt, SE by the delta method over them), online over RUNS fresh seeded runs
(``summarise_runs``' pooled tau and SE). z = (offline - online) / sqrt(SE_off^2 + SE_on^2).

The prompt is the built-in record PROMPT (45 tokens), one the session's drafters were trained on: the
target forwards of RUNS lanes scale with its length (the first record, 83 tokens, cost twice the CPU;
2026-12-03, budget-online). At these settings (top-k 1, or top-k 2 at T 0.01) the trajectories of one
prompt coincide, so several SEs are 0 and the comparison is exact (``_z``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hscache
from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
from hscache.capture.target import Target
from hscache.store.sampling import SamplingSetting
from scorer.families.base import OnlineOptions
from scorer.offline.scoring import EvalConfig
from scorer.online.greedy import open_online
from scorer.online.sampled import DecodeSettings, decode_runs, summarise_runs
from scorer.studies.tau_as_served import tau_as_served

# The setting: top-k 1 at T 2 keeps every sampled trajectory of PROMPT on the target's greedy path
# (p is one-hot on the argmax: SE 0 on the offline side), while the session's DFlash drafter, as
# trained, drafts from q = softmax(its logits / T), which at T 2 is not one-hot: the one-hot rule
# accepts its argmax whenever that is the target's token, the probabilistic rule draws x ~ q and
# accepts it with probability p(x) = [x is the target's token], q(target's token) on average. The rules
# then part without tempering the drafter (until 2026-12-07 the test divided its logits by 100 at
# T 0.03, top-k 2: a drafter no trainer writes). At T 1 they part too little (measured on a drafter
# trained with prompt anchors: probabilistic offline 2.108, online 2.175 +- 0.079 against one-hot 2.333,
# swapped z 2.0). One prompt x 8 tokens, 32 runs and 32 trajectories.
SETTING = dict(temperature=2.0, top_k=1, top_p=1.0)
PROMPT, NEW, RUNS = 5, 8, 32  # PROMPT: the built-in record "valid_parentheses"
ONLINE = {"one-hot": "greedy", "probabilistic": "probabilistic"}


def _pooled_with_se(tokens, rounds) -> tuple[float, float]:
    tokens, rounds = np.asarray(tokens, np.float64), np.asarray(rounds, np.float64)
    n, tau = len(tokens), float(tokens.sum() / rounds.sum())
    residual = tokens - tau * rounds
    return tau, float(np.sqrt((residual**2).sum() / (n * (n - 1))) / rounds.mean())


def _prompt_file(out):
    """A prompts file holding the built-in record PROMPT alone (the sampled caches' prompts)."""
    import json

    lines = [line for line in resolve_prompts("builtin:default").read_text().splitlines() if line.strip()]
    record = list(iter_records(resolve_prompts("builtin:default")))[PROMPT]
    assert json.loads(lines[PROMPT])["id"] == record.record_id  # the record online decoding takes
    out.write_text(lines[PROMPT] + "\n")
    return out


def _prompts(target: Target) -> list[tuple[str, list[int]]]:
    """(record id, token ids) of the built-in record PROMPT, as online decoding takes it."""
    record = list(iter_records(resolve_prompts("builtin:default")))[PROMPT]
    return [(record.record_id, prompt_token_ids(record, target.tokenizer))]


def _sampled_cache(out, setting: dict, runs: int):
    """PROMPT sampled ``runs`` times at ``setting`` (seed 11): the offline side's trajectories."""
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out / "cache"), prompts=str(_prompt_file(out / "prompt.jsonl")), layers="1,3,7",
            max_new_tokens=NEW, dtype="fp32", limit=1,
            sampling=SamplingSetting.from_flags(**setting, samples_per_prompt=runs, seed=11),
        )
    )  # fmt: skip
    return out / "cache"


@pytest.fixture(scope="module")
def agreement(trained_drafter, tmp_path_factory):
    """{rule: (offline tau, SE)} and {rule: (online pooled tau, SE)} for the session's DFlash drafter."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more threads spin against each other (20x slower)
    try:
        drafter = trained_drafter
        cache = _sampled_cache(tmp_path_factory.mktemp("agreement"), SETTING, RUNS)
        offline = {}
        for rule in ONLINE:
            served = tau_as_served(drafter, cache, rule=rule, config=EvalConfig(ddtree=(), n_boot=10))
            assert len(served.sequences) == RUNS
            tokens = [s.rounds.tokens for s in served.sequences]  # one prompt: each trajectory is a unit
            offline[rule] = _pooled_with_se(tokens, [s.rounds.expected_rounds for s in served.sequences])
            assert offline[rule][0] == pytest.approx(served.tau.tau, abs=1e-12)
        session = open_online(str(drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={}))
        prompts = _prompts(session.target)
        online_setting = SamplingSetting.from_flags(**SETTING, seed=5)
        online = {}
        for rule, draft_sampling in ONLINE.items():
            settings = DecodeSettings(online_setting, draft_sampling, max_new_tokens=NEW)
            runs = decode_runs(
                session.target, session.layer_ids, session.propose, prompts, settings, range(RUNS)
            )
            summary = summarise_runs(runs, n_boot=10)
            online[rule] = (summary["pooled"], summary["pooled_se"])
        return offline, online
    finally:
        torch.set_num_threads(before)


def _z(offline, online) -> float:
    """z of the difference; with both SEs 0 (every trajectory and run alike, as the trained target's
    peaked rows give at low T) equal values agree (0) and unequal ones differ without doubt (inf)."""
    difference, se = offline[0] - online[0], float(np.hypot(offline[1], online[1]))
    if se == 0:
        return 0.0 if difference == 0 else float(np.copysign(np.inf, difference))
    return difference / se


@pytest.mark.parametrize("rule,swapped", [("one-hot", "probabilistic"), ("probabilistic", "one-hot")])
def test_offline_tau_equals_online_and_the_swapped_rule_does_not(agreement, rule, swapped):
    """Measured (2026-12-07, the trained built-in target, PROMPT, 32 runs; ~12 CPU-s for both rules):
    one-hot offline 3.5 (SE 0), online 3.5 (SE 0), z 0, swapped z -inf; probabilistic offline 1.2949
    (SE 0), online 1.2655 +- 0.0384, z 0.76, swapped z +58. With the online rules swapped (ONLINE's
    values exchanged, tried once) both cases fail: z 58 and inf."""
    offline, online = agreement
    assert abs(_z(offline[rule], online[rule])) < 3, (rule, offline, online)
    assert abs(_z(offline[swapped], online[rule])) > 3, (rule, offline, online)


# ---- SGLang's EAGLE tree (scorer online --tree): the one-hot tree rule, offline vs online ----------
# The session's EAGLE-3 drafter (25 steps on the greedy cache of these prompts) as it is, NOT tempered:
# SGLang ranks candidates by cumulative softmax scores, which tempering would flatten. At T 0.01 (top-k
# 2) the sampled trajectories stay on the greedy path the drafter learned, where its top-1 is often
# wrong and its 2nd or 3rd choice right: the tree (1, 3, 4) (the root's best three children) has tau
# 1.75 where the chain of the same depth (K = 1) has 1.4 (measured, see the test). Probabilistic
# drafting has no tree rule in any engine (refused), so the swap is that chain. Every trajectory of
# PROMPT is alike at T 0.01 (SE 0): 16 runs show what 64 did.
TREE = (1, 3, 4)
TREE_SETTING = dict(temperature=0.01, top_k=2, top_p=1.0)
TREE_RUNS = 16


def _tree_runs(session, **shape) -> tuple[list, list]:
    """TREE_RUNS online decodes of the one prompt at TREE_SETTING (seed 5), one-hot verification, drafts
    shaped by ``shape`` (``tree=`` or ``ddtree=``); the runs and every round they took."""
    prompts = _prompts(session.target)
    settings = DecodeSettings(
        SamplingSetting.from_flags(**TREE_SETTING, seed=5), "greedy", max_new_tokens=NEW, **shape
    )
    rounds: list = []
    runs = decode_runs(
        session.target, session.layer_ids, session.propose, prompts, settings, range(TREE_RUNS), rounds.append
    )
    return runs, rounds


@pytest.fixture(scope="module")
def tree_cache(tmp_path_factory):
    """The trees' sampled cache (TREE_SETTING, TREE_RUNS trajectories of PROMPT): EAGLE tree and DDTree."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sampled_cache(tmp_path_factory.mktemp("tree-agreement"), TREE_SETTING, TREE_RUNS)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tree_agreement(eagle3_drafter, tree_cache):
    """(offline tree tau, SE), (offline chain of the tree's depth, SE), (online tree pooled tau, SE)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = tree_cache
        offline = {}
        for mode, config in (
            ("tree", EvalConfig(ddtree=(), n_boot=10, tree=TREE)),
            ("chain", EvalConfig(ddtree=(), n_boot=10, num_speculative_tokens=TREE[0])),
        ):
            served = tau_as_served(eagle3_drafter, cache, rule="one-hot", mode=mode, config=config)
            sequences = served.sequences
            offline[mode] = _pooled_with_se(
                [s.rounds.tokens for s in sequences], [s.rounds.expected_rounds for s in sequences]
            )
        session = open_online(
            str(eagle3_drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={})
        )
        runs, rounds = _tree_runs(session, tree=TREE)
        summary = summarise_runs(runs, n_boot=10)
        # How often a round accepted a child other than the root's first: the siblings were used.
        later_child = sum(int(r.verified.accepted[0]) > 0 and int(r.verified.path[0, 0]) > 0 for r in rounds)
        return offline, (summary["pooled"], summary["pooled_se"]), later_child
    finally:
        torch.set_num_threads(before)


def test_offline_tree_tau_equals_online_and_the_chain_of_its_depth_does_not(tree_agreement):
    """Measured (2026-12-03, the trained built-in target, PROMPT, 16 runs): offline tree 1.75, online
    1.75 (both SE 0), z 0; the chain of the tree's depth (K = 1) offline 1.4, swapped z -inf; 32 of the
    online rounds accepted the root's 2nd or 3rd child. ~6 CPU-s beyond the session fixtures (the
    sampled cache ~2.3, the 16 online runs ~2.8: three target sequences per round, one per leaf)."""
    offline, online, later_child = tree_agreement
    assert abs(_z(offline["tree"], online)) < 3, (offline, online)
    assert abs(_z(offline["chain"], online)) > 3, (offline, online)
    assert later_child > 0  # rounds accepted the root's 2nd or 3rd child: the tree rule, not a chain


# ---- DFlash's DDTree (scorer online --ddtree N): the same tree rule, offline vs online --------------
# The session's DFlash drafter as it is (block 6, NOT tempered: DDTree ranks prefixes by the product of
# the per-slot probabilities, which tempering would flatten into a breadth-first tree) on the trees'
# cache (T 0.01, top-k 2). On PROMPT its DDTree-2 is the root's two best children in some rounds
# (branched) and its top-1 chain of depth 2 in the rest, tau 1.75, where the block it is drafted from
# (the DFlash chain, K = 5) has 1.4. The swap is that block: scoring a DDTree server with the block
# replay, the mistake a DFlash cache invites (the other rule, probabilistic, has no tree in any
# engine: "Trees have one rule" in docs/sampling.md). On the first built-in record this 150-step
# drafter accepted one draft in 8 tokens (DDTree-2 and the block both 1.167, no swap to tell apart),
# which took a 300-step drafter of this file's own (~25 CPU-s of training) until 2026-12-03.
DDTREE = 2


@pytest.fixture(scope="module")
def ddtree_agreement(trained_drafter, tree_cache):
    """{mode: (offline tau, SE)} for ddtree-N and the block, (online DDTree pooled tau, SE), and the
    online rounds whose tree held two children of the root."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offline = {}
        for mode in (f"ddtree-{DDTREE}", "chain"):
            served = tau_as_served(
                trained_drafter,
                tree_cache,
                rule="one-hot",
                mode=mode,
                config=EvalConfig(ddtree=(), n_boot=10),
            )
            assert len(served.sequences) == TREE_RUNS
            offline[mode] = _pooled_with_se(
                [s.rounds.tokens for s in served.sequences],
                [s.rounds.expected_rounds for s in served.sequences],
            )
        session = open_online(
            str(trained_drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={})
        )
        runs, rounds = _tree_runs(session, ddtree=DDTREE)
        summary = summarise_runs(runs, n_boot=10)
        branched = sum(int((r.tree.parents == -1).sum()) > 1 for r in rounds)
        assert all(len(r.tree.tokens) == DDTREE for r in rounds)  # the budget, every round
        return offline, (summary["pooled"], summary["pooled_se"]), branched
    finally:
        torch.set_num_threads(before)


def test_offline_ddtree_tau_equals_online_and_the_block_does_not(ddtree_agreement):
    """Measured (2026-12-03, the trained built-in target, PROMPT, 16 runs): offline DDTree-2 1.75,
    online 1.75 (both SE 0), z 0; the block (K = 5) offline 1.4, swapped z -inf; 48 of the online
    rounds drafted two children of the root (none accepted the second). ~2.5 CPU-s beyond the session
    fixtures and the shared tree cache (offline ~0.3, the 16 online runs ~1.9)."""
    offline, online, branched = ddtree_agreement
    assert abs(_z(offline[f"ddtree-{DDTREE}"], online)) < 3, (offline, online)
    assert abs(_z(offline["chain"], online)) > 3, (offline, online)
    assert branched > 0  # rounds whose tree held two children of the root: a tree, not a chain
