"""Offline tau as served (scorer/studies/tau_as_served.py) equals ``scorer online``'s pooled tau at T > 0, and the
comparison tells the two verification rules apart (issue 25, first "Done when"; the every-family table
is bench/sampled_agreement.py's, in docs/sampling.md "Offline equals online").

Both sides estimate E over trajectories of the same prompts: offline on a cache SAMPLED at the setting
(64 trajectories of the prompt, SE by the delta method over them), online over 64 fresh seeded runs
(``summarise_runs``' pooled tau and SE). z = (offline - online) / sqrt(SE_off^2 + SE_on^2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hscache
from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
from hscache.store.sampling import SamplingSetting
from scorer.families.base import OnlineOptions
from scorer.offline.scoring import EvalConfig
from scorer.online.greedy import open_online
from scorer.online.sampled import DecodeSettings, decode_runs, summarise_runs
from scorer.studies.tau_as_served import tau_as_served

# The setting (measured, see the test's docstring): top-k 2 at T 0.03 on the built-in target (top-1
# logit gaps ~0.05-0.4) keeps p(greedy token) ~0.8-1, so sampled trajectories stay long on the greedy
# path the session's DFlash drafter learned: one-hot tau ~1.6-1.8, far from 1 and from its SE. The
# drafter is TEMPERED (its final norm x 0.001: logits / 1000, the same argmax, so the same one-hot
# drafts): its q = softmax(logits / T) is then nearly flat over the vocabulary, and the probabilistic
# rule accepts almost nothing (tau ~1.004). One prompt x 8 tokens, 64 runs and 64 trajectories.
SETTING = dict(temperature=0.03, top_k=2, top_p=1.0)
TEMPER = 1e-3
PROMPTS, NEW, RUNS, SAMPLES = 1, 8, 64, 64
ONLINE = {"one-hot": "greedy", "probabilistic": "probabilistic"}


def _pooled_with_se(tokens, rounds) -> tuple[float, float]:
    tokens, rounds = np.asarray(tokens, np.float64), np.asarray(rounds, np.float64)
    n, tau = len(tokens), float(tokens.sum() / rounds.sum())
    residual = tokens - tau * rounds
    return tau, float(np.sqrt((residual**2).sum() / (n * (n - 1))) / rounds.mean())


def _tempered(checkpoint, out, scale: float):
    """A copy of a DFlash checkpoint with its final norm scaled: logits x ``scale``, argmax unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    weights["norm.weight"] = weights["norm.weight"] * scale
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def agreement(trained_drafter, tmp_path_factory):
    """{rule: (offline tau, SE)} and {rule: (online pooled tau, SE)} for the session's DFlash drafter,
    tempered."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more threads spin against each other (20x slower)
    try:
        drafter = _tempered(trained_drafter, tmp_path_factory.mktemp("agreement") / "tempered", TEMPER)
        cache = tmp_path_factory.mktemp("agreement") / "sampled"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(cache), layers="1,3,7", max_new_tokens=NEW, dtype="fp32", limit=PROMPTS,
                sampling=SamplingSetting.from_flags(**SETTING, samples_per_prompt=SAMPLES, seed=11),
            )
        )  # fmt: skip
        offline = {}
        for rule in ONLINE:
            served = tau_as_served(drafter, cache, rule=rule, config=EvalConfig(ddtree=(), n_boot=10))
            assert len(served.sequences) == PROMPTS * SAMPLES
            tokens = [s.rounds.tokens for s in served.sequences]  # one prompt: each trajectory is a unit
            offline[rule] = _pooled_with_se(tokens, [s.rounds.expected_rounds for s in served.sequences])
            assert offline[rule][0] == pytest.approx(served.tau.tau, abs=1e-12)
        session = open_online(str(drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={}))
        records = list(iter_records(resolve_prompts("builtin:default")))[:PROMPTS]
        prompts = [(r.record_id, prompt_token_ids(r, session.target.tokenizer)) for r in records]
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
    """Measured (2026-12-02, 2 shared cores, load ~9; ~16 CPU-s for both rules): one-hot offline
    1.635 +- 0.104, online 1.771 +- 0.122, z -0.85, swapped z -6.26; probabilistic offline
    1.0043 +- 0.0009, online 1.0045 +- 0.0032, z -0.07, swapped z +6.08. The swapped |z| ~6 leaves
    room: the one-hot SE would have to double for a swap to pass."""
    offline, online = agreement
    assert abs(_z(offline[rule], online[rule])) < 3, (rule, offline, online)
    assert abs(_z(offline[swapped], online[rule])) > 3, (rule, offline, online)


# ---- SGLang's EAGLE tree (scorer online --tree): the one-hot tree rule, offline vs online ----------
# The session's EAGLE-3 drafter (25 steps on the greedy cache of these prompts) as it is, NOT tempered:
# SGLang ranks candidates by cumulative softmax scores, which tempering would flatten. At T 0.01 (top-k
# 2) the sampled trajectories stay near the greedy path the drafter learned, where its top-1 is often
# wrong and its 2nd or 3rd choice right: the tree (1, 3, 4) (the root's best three children) has tau
# ~1.7 where the chain of the same depth (K = 1) has ~1.39, both with small SEs (measured, see the
# test). Probabilistic drafting has no tree rule in any engine (refused), so the swap is that chain.
TREE = (1, 3, 4)
TREE_SETTING = dict(temperature=0.01, top_k=2, top_p=1.0)


@pytest.fixture(scope="module")
def tree_cache(tmp_path_factory):
    """The trees' sampled cache (TREE_SETTING, 64 trajectories of one prompt): EAGLE tree and DDTree."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = tmp_path_factory.mktemp("tree-agreement") / "sampled"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(cache), layers="1,3,7", max_new_tokens=NEW, dtype="fp32", limit=PROMPTS,
                sampling=SamplingSetting.from_flags(**TREE_SETTING, samples_per_prompt=SAMPLES, seed=11),
            )
        )  # fmt: skip
        return cache
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
        records = list(iter_records(resolve_prompts("builtin:default")))[:PROMPTS]
        prompts = [(r.record_id, prompt_token_ids(r, session.target.tokenizer)) for r in records]
        settings = DecodeSettings(
            SamplingSetting.from_flags(**TREE_SETTING, seed=5), "greedy", max_new_tokens=NEW, tree=TREE
        )
        rounds = []
        runs = decode_runs(
            session.target, session.layer_ids, session.propose, prompts, settings, range(RUNS), rounds.append
        )
        summary = summarise_runs(runs, n_boot=10)
        # How often a round accepted a child other than the root's first: the siblings were used.
        later_child = sum(int(r.verified.accepted[0]) > 0 and int(r.verified.path[0, 0]) > 0 for r in rounds)
        return offline, (summary["pooled"], summary["pooled_se"]), later_child
    finally:
        torch.set_num_threads(before)


def test_offline_tree_tau_equals_online_and_the_chain_of_its_depth_does_not(tree_agreement):
    """Measured (2026-12-02, 2 shared cores, load ~4): offline tree 1.723 +- 0.016, online 1.678 +- 0.029
    (64 runs), z +1.36; the chain of the tree's depth (K = 1) offline 1.387 +- 0.007, swapped z -9.69; 60
    of the online rounds accepted the root's 2nd or 3rd child. ~10 CPU-s beyond the session fixtures
    (the sampled cache ~2, the 64 online runs ~6: three target sequences per round, one per leaf)."""
    offline, online, later_child = tree_agreement
    assert abs(_z(offline["tree"], online)) < 3, (offline, online)
    assert abs(_z(offline["chain"], online)) > 3, (offline, online)
    assert later_child > 0  # rounds accepted the root's 2nd or 3rd child: the tree rule, not a chain


# ---- DFlash's DDTree (scorer online --ddtree N): the same tree rule, offline vs online --------------
# The session's DFlash drafter as it is (block 6, NOT tempered: DDTree ranks prefixes by the product of
# the per-slot probabilities, which tempering would flatten into a breadth-first tree) on the trees'
# cache (T 0.01, top-k 2). The drafter is confident along the greedy path its trajectories stay near:
# DDTree-2 is its top-1 chain of depth 2 in ~2/3 of the rounds and the root's two best children in the
# rest, tau ~2.3, where the block it is drafted from (the DFlash chain, K = 5) has ~3.3. The swap is
# that block: scoring a DDTree server with the block replay, the mistake a DFlash cache invites (the
# other rule, probabilistic, has no tree in any engine: "Trees have one rule" in docs/sampling.md).
DDTREE = 2
# On the trained built-in target (2026-12-03) the session's 150-step drafter accepts one draft in 8
# tokens on this cache: DDTree-2 and the block both 1.167 (SE 0), no swap to tell apart. 300 steps on
# the same cache give offline DDTree-2 2.333 and the block 3.5 (both SE 0: T 0.01 keeps every
# trajectory on one path), online DDTree-2 2.286 +- 0.033 (z +1.46, swapped z +37); 400 and 600 steps
# the same. ~25 CPU-s of training, this file's only. This drafter is confident along the path: no
# online round drafted two children of the root (300, 400 and 600 steps alike), so the test no longer
# asserts a branched round; the EAGLE-3 tree test above covers siblings in the same loop.
DDTREE_STEPS = 300


@pytest.fixture(scope="module")
def ddtree_drafter(scorer_cache, tmp_path_factory):
    """The session's DFlash drafter's recipe (block 6, the scorer cache) trained DDTREE_STEPS steps."""
    from scorer.train import train_drafter

    out = tmp_path_factory.mktemp("ddtree") / "drafter"
    train_drafter(scorer_cache, out, steps=DDTREE_STEPS, block_size=6, log_every=0)
    return out


@pytest.fixture(scope="module")
def ddtree_agreement(ddtree_drafter, tree_cache):
    """{mode: (offline tau, SE)} for ddtree-N and the block, (online DDTree pooled tau, SE), and the
    online rounds whose tree held two children of the root."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offline = {}
        for mode in (f"ddtree-{DDTREE}", "chain"):
            served = tau_as_served(
                ddtree_drafter,
                tree_cache,
                rule="one-hot",
                mode=mode,
                config=EvalConfig(ddtree=(), n_boot=10),
            )
            assert len(served.sequences) == PROMPTS * SAMPLES
            offline[mode] = _pooled_with_se(
                [s.rounds.tokens for s in served.sequences],
                [s.rounds.expected_rounds for s in served.sequences],
            )
        session = open_online(
            str(ddtree_drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={})
        )
        records = list(iter_records(resolve_prompts("builtin:default")))[:PROMPTS]
        prompts = [(r.record_id, prompt_token_ids(r, session.target.tokenizer)) for r in records]
        settings = DecodeSettings(
            SamplingSetting.from_flags(**TREE_SETTING, seed=5), "greedy", max_new_tokens=NEW, ddtree=DDTREE
        )
        rounds = []
        runs = decode_runs(
            session.target, session.layer_ids, session.propose, prompts, settings, range(RUNS), rounds.append
        )
        summary = summarise_runs(runs, n_boot=10)
        branched = sum(int((r.tree.parents == -1).sum()) > 1 for r in rounds)
        assert all(len(r.tree.tokens) == DDTREE for r in rounds)  # the budget, every round
        return offline, (summary["pooled"], summary["pooled_se"]), branched
    finally:
        torch.set_num_threads(before)


def test_offline_ddtree_tau_equals_online_and_the_block_does_not(ddtree_agreement):
    """Measured (2026-12-02, 2 shared cores): offline DDTree-2 2.274 +- 0.038, online 2.240 +- 0.049
    (64 runs), z +0.55; the block (K = 5) offline 3.343 +- 0.105, swapped z +9.51; 64 of the ~200 online
    rounds drafted two children of the root (no round accepted the second: this drafter's 2nd choice is
    rarely the sampled token; the EAGLE-3 tree test above exercises sibling acceptance, same loop). ~2-3
    CPU-s beyond the session fixtures and the shared tree cache (the file: 27.4 CPU-s with it, 25.5
    without; offline ~0.5, the 64 online runs ~2.4). On the trained target (2026-12-03) see DDTREE_STEPS."""
    offline, online, branched = ddtree_agreement
    assert abs(_z(offline[f"ddtree-{DDTREE}"], online)) < 3, (offline, online)
    assert abs(_z(offline["chain"], online)) > 3, (offline, online)
    # branched: 0 on the trained target (see DDTREE_STEPS); the depth cap is what the swap shows here
