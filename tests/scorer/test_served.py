"""Scoring a SAMPLED cache as served (scorer/offline/sampled_view.py, docs/sampling.md; issue 25 items 3 and 5).

Every number is set against an independent computation: the one-hot rounds against a round loop
written here that drafts one anchor at a time (the family's single-anchor reference path) and
compares with the cached sampled tokens; the probabilistic rule's log q against per-anchor block
forwards and an explicit selector loop, and its E[rounds | y] against ``sequence_rounds`` fed those.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.offline.scoring import load_drafter
from scorer.rules.expectation import sequence_rounds, slot_acceptance
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.studies.tau_as_served import tau_as_served

FAST = dict(n_boot=50, ddtree=())


def _rows(cache):
    P = cache.index.column("prompt_len").to_pylist()
    return [(row, cache.token_ids(row).numpy(), P[row]) for row in range(len(cache))]


def _loop(y: np.ndarray, P: int, draft_at) -> tuple[list[int], list[int]]:
    """The served round loop along y: drafts at the anchor, acc = leading drafts equal to y."""
    anchors, accepted, a = [], [], P
    while a < len(y) - 1:
        avail = len(y) - 1 - a
        d = draft_at(a)
        acc = 0
        while acc < min(len(d), avail) and d[acc] == y[a + 1 + acc]:
            acc += 1
        anchors.append(a)
        accepted.append(acc)
        a += min(acc + 1, avail)
    return anchors, accepted


def _dflash_block(drafter, features, y, a):
    B = drafter.config.block_size
    block = torch.full((1, B), drafter.config.mask_token_id, dtype=torch.long)
    block[0, 0] = int(y[a])
    with torch.no_grad():
        hidden = drafter.block_hidden(features, torch.tensor([a]), block, max_blocks_per_forward=1)
        return drafter.head(hidden[0]).float()  # [B-1, V]


def _features(drafter, cache, row):
    from scorer.families.dflash.features import feature_index
    from scorer.offline.sequences import sequence_features

    index = feature_index(drafter.config, cache.layer_ids)
    return sequence_features(
        cache.hidden_states(row), index, torch.float32, "cpu", getattr(drafter, "context_norm", None)
    )


def test_one_hot_dflash_equals_a_round_loop_along_the_sampled_tokens(sampled_scorer_cache, trained_drafter):
    cache = hscache.open_cache(sampled_scorer_cache)
    report = evaluate(trained_drafter, sampled_scorer_cache, EvalConfig(n_boot=50, ddtree=(8,)))
    drafter, _ = load_drafter(trained_drafter, cache, EvalConfig())
    rounds = 0
    for (row, y, P), request in zip(_rows(cache), report["per_request"]):
        features = _features(drafter, cache, row)
        anchors, accepted = _loop(
            y, P, lambda a, f=features, y=y: _dflash_block(drafter, f, y, a).argmax(-1).tolist()
        )
        assert (request["anchors"], request["accepted"]) == (anchors, accepted)
        rounds += len(anchors)
    assert report["rounds"] == rounds and report["off_greedy"] == {"positions": 0, "rounds_cut_short": 0}
    sampling = report["sampling"]
    assert sampling["rule"] == "one-hot" and sampling["trajectories"] == 6 and sampling["prompts"] == 3
    assert (
        sampling["setting"]["temperature"] == 0.6 and sampling["setting"]["preset"] == "qwen-thinking-coding"
    )
    chain = sampling["modes"]["chain"]
    assert chain["expected_rounds"] == rounds and chain["tau"] == pytest.approx(report["tau"]["pooled"])
    assert chain["lo"] <= chain["tau"] <= chain["hi"] and chain["n_prompts"] == 3
    assert set(sampling["modes"]) == {"chain", "ddtree-8"}  # DDTree scored by the same rule
    accepted = [a for r in report["per_request"] for a in r["accepted"]]
    assert chain["served_acceptance"][0] == pytest.approx(np.mean(np.asarray(accepted) >= 1))
    assert chain["served_acceptance"][1] == pytest.approx(np.mean(np.asarray(accepted) >= 2))


def test_one_hot_eagle3_equals_vllms_loop_per_anchor_and_sglang_tree_walks_sampled_tokens(
    sampled_scorer_cache, eagle3_drafter
):
    cache = hscache.open_cache(sampled_scorer_cache)
    config = EvalConfig(n_boot=50, tree=(2, 2, 4), limit=2)  # vLLM's loop per anchor is slow: 2 rows
    report = evaluate(eagle3_drafter, sampled_scorer_cache, config)
    drafter, _ = load_drafter(eagle3_drafter, cache, config)
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    K = drafter.config.num_speculative_tokens
    for (row, y, P), request in zip(_rows(cache), report["per_request"]):
        features = cache.hidden_states(row)[:, index].reshape(len(y), -1).float()
        tokens = torch.as_tensor(y)
        expected = _loop(y, P, lambda a, f=features, t=tokens: drafter.draft_one_anchor(f, t, a, K))
        assert (request["anchors"], request["accepted"]) == expected
    modes = report["sampling"]["modes"]
    assert set(modes) == {"chain", "tree"} and modes["tree"]["tau"] == pytest.approx(
        report["tree"]["tau"]["pooled"]
    )


@pytest.mark.parametrize("checkpoint", ["dflash", "eagle3", "target:mtp", "target:mtp k3"])
def test_probabilistic_teacher_forced_drafts_give_the_same_one_hot_rounds(
    sampled_scorer_cache, trained_drafter, eagle3_drafter, checkpoint
):
    """Spec 4.3: fed y, a family's drafts equal its served drafts on every matched prefix, so the
    one-hot rounds of the probabilistic path's drafts are the one-hot report's rounds exactly."""
    path = {"dflash": trained_drafter, "eagle3": eagle3_drafter}.get(checkpoint, checkpoint.split()[0])
    k = 3 if checkpoint.endswith("k3") else None  # the MTP head's chain of 3 (its steps > 0 fed y)
    one_hot = evaluate(path, sampled_scorer_cache, EvalConfig(num_speculative_tokens=k, **FAST))
    probabilistic = evaluate(
        path,
        sampled_scorer_cache,
        EvalConfig(draft_sampling="probabilistic", num_speculative_tokens=k, **FAST),
    )
    for a, b in zip(one_hot["per_request"], probabilistic["per_request"]):
        assert (a["anchors"], a["accepted"]) == (b["anchors"], b["accepted"])
    s = probabilistic["sampling"]
    assert s["rule"] == "probabilistic" and s["draft_temperature"] == 0.6
    assert probabilistic["tau"]["pooled"] == pytest.approx(s["modes"]["chain"]["tau"])
    assert probabilistic["rounds"] == pytest.approx(s["modes"]["chain"]["expected_rounds"])
    assert probabilistic["config"]["draft_sampling"] == "probabilistic"


def test_probabilistic_dflash_log_q_and_rounds_equal_per_anchor_block_forwards(
    sampled_scorer_cache, trained_drafter
):
    cache = hscache.open_cache(sampled_scorer_cache)
    T = 0.6
    report = evaluate(
        trained_drafter, sampled_scorer_cache, EvalConfig(draft_sampling="probabilistic", **FAST)
    )
    drafter, _ = load_drafter(trained_drafter, cache, EvalConfig())
    K = drafter.config.block_size - 1
    total = 0.0
    for (row, y, P), request in zip(_rows(cache), report["per_request"]):
        features = _features(drafter, cache, row)
        log_q = np.full((len(y) - 1 - P, K), -np.inf)
        for r, a in enumerate(range(P, len(y) - 1)):
            logp = torch.log_softmax(_dflash_block(drafter, features, y, a).double() / T, dim=-1)
            for j in range(1, min(K, len(y) - 1 - a) + 1):
                log_q[r, j - 1] = float(logp[j - 1, y[a + j]])
        # p(y_t) from the stored support (row t-1 holds the distribution of token t)
        ids, probs = cache.sampled_support(row)
        logp_y = np.zeros(len(y))
        for t in range(P + 1, len(y)):
            logp_y[t] = np.log(float(probs[t - 1][ids[t - 1] == y[t]].sum()))
        expected = sequence_rounds(slot_acceptance(log_q, logp_y, P), P, len(y))
        assert request["rounds"] == pytest.approx(expected.expected_rounds, rel=1e-5)
        total += expected.expected_rounds
    assert report["rounds"] == pytest.approx(total, rel=1e-5)


def test_probabilistic_dflash2_selector_q_equals_an_explicit_walk(
    sampled_scorer_cache, trained_drafter, tmp_path
):
    """DFlash2's proposal at slot j: softmax over its candidates of the selector's scores / T with the
    predecessor y_{a+j-1}; 0 off the candidates (a perturbed selector, so the scores matter)."""
    from scorer.families.dflash.proposals import block_log_q
    from scorer.families.dflash2.init import init_from_dflash

    cache = hscache.open_cache(sampled_scorer_cache)
    drafter, _ = load_drafter(
        init_from_dflash(trained_drafter, tmp_path / "d2", selector_rank=8, selector_top_k=64),
        cache,
        EvalConfig(),
    )
    selector = drafter.candidate_selector
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for p in selector.parameters():
            p.add_(0.1 * torch.randn_like(p))
    T, K = 0.6, drafter.config.block_size - 1
    hits = 0
    for row, y, P in _rows(cache):
        features = _features(drafter, cache, row)
        draft, log_q = block_log_q(drafter, features, torch.as_tensor(y), P, T)
        for r, a in enumerate(range(P, len(y) - 1)):
            logits = _dflash_block(drafter, features, y, a)
            with torch.no_grad():
                B = drafter.config.block_size
                block = torch.full((1, B), drafter.config.mask_token_id, dtype=torch.long)
                block[0, 0] = int(y[a])
                hidden = drafter.block_hidden(features, torch.tensor([a]), block, max_blocks_per_forward=1)[0]
                for j in range(1, min(K, len(y) - 1 - a) + 1):
                    top = torch.topk(logits[j - 1], selector.top_k)
                    gate = selector.predecessor_codebook[int(y[a + j - 1])] * selector.hidden_projection(
                        hidden[j - 1]
                    )
                    scores = top.values + selector.successor_codebook[top.indices] @ gate
                    assert draft[r, j - 1] == int(top.indices[int(scores.argmax())])
                    where = (top.indices == int(y[a + j])).nonzero()
                    if len(where):
                        hits += 1
                        want = float(torch.log_softmax(scores.double() / T, dim=0)[int(where[0])])
                        assert log_q[r, j - 1] == pytest.approx(want, rel=1e-6, abs=1e-5)  # fp32 scores
                    else:
                        assert log_q[r, j - 1] == -np.inf
    assert hits > 0


def test_tau_as_served_is_the_reports_sampling_block(sampled_scorer_cache, scorer_cache, trained_drafter):
    config = EvalConfig(ddtree=(8,), n_boot=50)
    served = tau_as_served(trained_drafter, sampled_scorer_cache, mode="ddtree-8", config=config)
    report = evaluate(trained_drafter, sampled_scorer_cache, config)
    assert served.tau.to_dict() == report["sampling"]["modes"]["ddtree-8"]
    assert [s.sample for s in served.sequences] == [0, 1] * 3 and served.setting.temperature == 0.6
    with pytest.raises(ScorerError, match="is greedy"):
        tau_as_served(trained_drafter, scorer_cache)


def _invoke(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_refusals_are_one_line_and_write_nothing(sampled_scorer_cache, sampled_cache, scorer_cache, tmp_path):
    out = tmp_path / "r.json"
    cases = [
        (
            ["eval", "target:mtp", "--cache", str(sampled_scorer_cache), "--temperature", "0.7"],
            "--temperature 0.7 differs",
        ),
        (
            ["eval", "target:mtp", "--cache", str(sampled_scorer_cache), "--sampling", "qwen-instruct"],
            "differs",
        ),
        (
            ["eval", "target:mtp", "--cache", str(scorer_cache), "--draft-sampling", "probabilistic"],
            "needs a sampled cache",
        ),
        (["eval", "target:mtp", "--cache", str(scorer_cache), "--top-p", "0.9"], "--top-p 0.9 differs"),
        (
            [
                "eval",
                "target:mtp",
                "--cache",
                str(sampled_scorer_cache),
                "--draft-sampling",
                "probabilistic",
                "--tree",
                "2,2,4",
            ],
            "drop --tree",
        ),
        (
            ["eval", "target:mtp", "--cache", str(sampled_cache), "--tree", "2,2,4"],
            "measure it online (scorer online --tree",
        ),
        (
            ["compare", "target:mtp", "--cache", str(sampled_cache), "--tree", "2,2,4"],
            "measure it online (scorer online --tree",
        ),
    ]
    for args, message in cases:
        code, output = _invoke([*args, "--json", str(out)])
        assert code == 2 and message in output, output
        assert len(output.strip().splitlines()) == 1 and not out.exists(), output
    # the cache's own setting, restated, is accepted
    code, output = _invoke(
        ["eval", "target:mtp", "--cache", str(sampled_scorer_cache), "--sampling", "qwen-thinking-coding",
         "--temperature", "0.6", "--limit", "1", "--json", str(out), "--report", str(tmp_path / "r.html")]
    )  # fmt: skip
    assert code == 0, output
    assert "tau as served" in output and json.loads(out.read_text())["sampling"]["rule"] == "one-hot"
    page = (tmp_path / "r.html").read_text()
    assert "tau as served" in page and "qwen-thinking-coding" in page


def test_greedy_reports_are_unchanged(scorer_cache, trained_drafter):
    report = evaluate(trained_drafter, scorer_cache, EvalConfig(limit=1, **FAST))
    assert "sampling" not in report and "draft_sampling" not in report["config"]
    assert "sampling" not in report["config"] and isinstance(report["rounds"], int)


def test_compare_across_settings_sets_taus_side_by_side_with_ranks(
    sampled_scorer_cache, scorer_cache, trained_drafter, tmp_path
):
    out, page = tmp_path / "c.json", tmp_path / "c.html"
    code, output = _invoke(
        ["compare", str(trained_drafter), "target:mtp", "--cache", str(scorer_cache),
         "--cache", str(sampled_scorer_cache), "--limit", "4", "--json", str(out), "--report", str(page)]
    )  # fmt: skip
    assert code == 0, output
    document = json.loads(out.read_text())
    greedy, sampled = document["settings"]
    assert greedy["rule"] == "greedy" and sampled["rule"] == "one-hot"
    assert (greedy["prompts"], sampled["prompts"], sampled["requests"]) == (4, 2, 4)
    for i in range(2):  # each cell is that drafter's report on that cache: pooled tau / tau as served
        taus, (on_greedy, on_sampled) = (
            document["drafters"][i]["taus"],
            (c["reports"][i] for c in document["compares"]),
        )
        assert taus[0]["tau"] == on_greedy["tau"]["pooled"] and taus[0]["over"] == "requests"
        served = on_sampled["sampling"]["modes"]["chain"]
        assert (taus[1]["tau"], taus[1]["lo"], taus[1]["hi"]) == (served["tau"], served["lo"], served["hi"])
        assert taus[1]["over"] == "prompts" and served["n_prompts"] == 2
    for column, order in enumerate(document["ranking"]):
        by_tau = sorted(document["drafters"], key=lambda d: -d["taus"][column]["tau"])
        assert order == [d["checkpoint"] for d in by_tau]
    assert any("other prompts" in w for w in document["warnings"])  # 4 greedy prompts, 2 sampled
    assert "tau per sampling setting" in output and "tau per sampling setting" in page.read_text()
    # Not a terminal: whole plain columns (issue 26 item 12), never rich's boxes cut at 80 columns.
    assert "…" not in output and "┃" not in output and str(sampled_scorer_cache) in output


def test_pooled_tau_of_real_valued_rounds_is_not_truncated():
    """The probabilistic rule's rounds are E[rounds | y]: the pooled ratio (and compare's paired deltas
    over it) must divide by the real sum, not its integer part."""
    from scorer.metrics import tau_pooled_from_totals

    assert tau_pooled_from_totals(np.array([[10, 2.5], [6, 1.5]])) == 4.0
    assert tau_pooled_from_totals(np.array([[10, 2], [6, 2]], dtype=np.int64)) == 4.0


def test_probabilistic_eagle3_reduced_vocabulary(sampled_scorer_cache, tmp_path):
    """EAGLE-3 with a reduced draft vocabulary (d2t): slot 1's q is vLLM's compute_logits (-inf off the
    draft vocabulary over the target's) softmaxed at T, so q = 0 for a sampled token outside it; the
    drafts fed y are drafting.py's teacher-forced drafts."""
    from scorer.families.eagle3.drafting import draft_every_anchor
    from scorer.families.eagle3.init import init_eagle3
    from scorer.families.eagle3.proposal import eagle3_log_q

    cache = hscache.open_cache(sampled_scorer_cache)
    out = tmp_path / "reduced"
    init_eagle3(
        sampled_scorer_cache, out, layer_ids=[7, 1, 3], num_layers=2, draft_vocab_size=cache.vocab_size // 2
    )
    drafter, _ = load_drafter(out, cache, EvalConfig(num_speculative_tokens=3))
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    outside = 0
    for row, y, P in _rows(cache)[:2]:
        features = cache.hidden_states(row)[:, index].reshape(len(y), -1).float()
        tokens = torch.as_tensor(y)
        draft, log_q = eagle3_log_q(drafter, features, tokens, P, 0.6)
        np.testing.assert_array_equal(
            draft, draft_every_anchor(drafter, features, tokens, P, 3, teacher_forced=True)
        )
        with torch.no_grad():
            normed, _, _ = drafter.step0(features, tokens, len(y) - 2)
            logits = drafter.head_logits(normed[P - 1 :]).float()
        full = torch.full((len(logits), cache.vocab_size), float("-inf"))
        full[:, drafter.draft_to_target] = logits
        want = torch.log_softmax(full.double() / 0.6, dim=-1)[
            torch.arange(len(logits)), torch.as_tensor(y[P + 1 :])
        ]
        np.testing.assert_allclose(log_q[:, 0], want.numpy(), rtol=1e-5, atol=1e-5)
        outside += int(np.isneginf(log_q[:, 0]).sum())
    assert outside > 0  # some sampled tokens fall outside the reduced vocabulary: q = 0 there


def test_sglang_tree_on_a_min_p_cache_is_refused_by_name_and_vllm_chains_are_not():
    """SGLang renormalises min_p after top-k / top-p, the cache's vLLM order before them: the cached
    trajectories are not SGLang's, so its tree rule is refused there (as online --tree refuses
    --min-p); a chain (vLLM's rule, the cache's own order) is scored."""
    import dataclasses
    from types import SimpleNamespace

    from hscache.store.sampling import PRESETS, SamplingSetting
    from scorer.families import family_named
    from scorer.offline.sampled_view import check_request

    base = SamplingSetting.from_dict({**PRESETS["qwen-thinking-coding"], "seed": 0})
    for min_p, refused in ((0.05, True), (0.0, False)):
        cache = SimpleNamespace(settings={"sampling": dataclasses.replace(base, min_p=min_p).to_dict()})
        tree, chain = EvalConfig(tree=(2, 2, 4)), EvalConfig()
        check_request(cache, chain, family_named("eagle3"), "the cache")  # never refused
        if refused:
            with pytest.raises(ScorerError, match=r"--tree is SGLang's rule.*--min-p 0\.05"):
                check_request(cache, tree, family_named("eagle3"), "the cache")
        else:
            check_request(cache, tree, family_named("eagle3"), "the cache")


@pytest.fixture(scope="module")
def engine_text_cache(scorer_cache, tmp_path_factory):
    """A greedy cache whose text after each prompt is NOT this target's greedy text: two of the scorer
    cache's sequences with every fifth generated token replaced (an engine whose bf16 states part from
    transformers' at near-ties writes such text; here the parting is planted)."""
    from tests.conftest import write_jsonl

    cache = hscache.open_cache(scorer_cache)
    records = []
    for row, y, P in _rows(cache)[:2]:
        ids = y.tolist()
        for t in range(P + 2, len(ids), 5):
            ids[t] = (ids[t] + 7) % cache.vocab_size
        records.append({"id": f"r{row}", "input_ids": ids, "prompt_len": int(P)})
    root = tmp_path_factory.mktemp("engine-text")
    out = root / "cache"
    hscache.extract(
        hscache.ExtractConfig(prompts=str(write_jsonl(root / "p.jsonl", records)), out=str(out), layers="1,3,7",
                              max_new_tokens=0, dtype="fp32", commit_every_s=0.0, mtp=False)
    )  # fmt: skip
    return out


def test_greedy_reference_text_verifies_against_the_texts_next_token(engine_text_cache, trained_drafter):
    """``--greedy-reference text`` (scorer served's T 0 served cache): the round loop runs along the
    text, as at T > 0; the cache's argmax is only counted where it differs."""
    cache = hscache.open_cache(engine_text_cache)
    argmax = evaluate(trained_drafter, engine_text_cache, EvalConfig(**FAST))
    text = evaluate(trained_drafter, engine_text_cache, EvalConfig(greedy_reference="text", **FAST))
    drafter, _ = load_drafter(trained_drafter, cache, EvalConfig())
    differs = positions = 0
    for (row, y, P), request in zip(_rows(cache), text["per_request"]):
        features = _features(drafter, cache, row)
        anchors, accepted = _loop(
            y, P, lambda a, f=features, y=y: _dflash_block(drafter, f, y, a).argmax(-1).tolist()
        )
        assert (request["anchors"], request["accepted"]) == (anchors, accepted)
        a = cache.target_argmax(row).numpy()
        differs += int((y[P + 1 :] != a[P : len(y) - 1]).sum())
        positions += len(y) - 1 - P
    assert differs > 0 and argmax["off_greedy"]["positions"] == differs  # the planted text parts
    assert text["off_greedy"] == {"positions": 0, "rounds_cut_short": 0}
    assert text["greedy_reference"] == {
        "reference": "text",
        "argmax_differs": differs,
        "positions": positions,
    }
    assert any(f"differs from it at {differs} of {positions}" in note for note in text["notes"])
    assert text["config"]["greedy_reference"] == "text" and "greedy_reference" not in argmax["config"]
    assert "greedy_reference" not in argmax and "sampling" not in text


def test_greedy_reference_is_refused_where_it_means_nothing(
    sampled_scorer_cache, engine_text_cache, tmp_path
):
    out = tmp_path / "r.json"
    code, output = _invoke(["eval", "target:mtp", "--cache", str(sampled_scorer_cache), "--greedy-reference",
                            "text", "--json", str(out)])  # fmt: skip
    assert (
        code == 2 and "--greedy-reference text is for a greedy cache" in output and "drop the flag" in output
    )
    assert len(output.strip().splitlines()) == 1 and not out.exists()
    code, output = _invoke(["eval", "x", "--cache", str(engine_text_cache), "--greedy-reference", "served"])
    assert code == 2 and "'served' is not one of 'argmax', 'text'" in output
