"""scorer compare: drafters of different families on one cache, the same rounds, paired deltas, cost."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from hscache import schemas
from scorer.cli import main
from scorer.metrics import paired_bootstrap_delta, tau_pooled_from_totals
from scorer.studies.compare import compare_drafters
from scorer.studies.evaluate import EvalConfig, evaluate
from tests.chromium import png_is_not_blank, screenshot


@pytest.fixture(scope="module")
def document(trained_drafter, eagle3_drafter, scorer_cache) -> dict:
    return compare_drafters(
        [trained_drafter, eagle3_drafter],
        scorer_cache,
        EvalConfig(ddtree=(), n_boot=200, num_speculative_tokens=4),
    )


def test_one_table_same_rounds_each_family_scored_as_alone(
    document, trained_drafter, eagle3_drafter, scorer_cache
):
    schemas.validate(document, "compare_report")
    dflash, eagle = document["drafters"]
    assert (dflash["family"], eagle["family"]) == ("dflash", "eagle3")
    # --num-speculative-tokens applies to the drafter it fits; DFlash keeps its block of 6.
    assert dflash["drafting"] == {"mode": "block", "draft_slots": 5, "source": "config"}
    assert eagle["drafting"] == {"mode": "chain", "draft_slots": 4, "source": "override"}
    alone = {
        "dflash": evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=200)),
        "eagle3": evaluate(eagle3_drafter, scorer_cache, EvalConfig(n_boot=200, num_speculative_tokens=4)),
    }
    for row, report in zip(document["drafters"], document["reports"]):
        assert row["tau"] == alone[row["family"]]["tau"]
        mine, theirs = report["per_request"], alone[row["family"]]["per_request"]
        assert [r["accepted"] for r in mine] == [r["accepted"] for r in theirs]
        assert row["acceptance"]["unconditional"] == alone[row["family"]]["acceptance"]["unconditional"]
    # Same sequences for both: every request pairs, token hashes equal.
    a, b = (r["per_request"] for r in document["reports"])
    assert [x["token_sha256"] for x in a] == [x["token_sha256"] for x in b]
    assert eagle["delta_vs_first"]["requests_compared"] == len(a) == 6
    assert dflash["delta_vs_first"] is None and eagle["teacher_forced"] is not None


def test_delta_is_the_paired_bootstrap_over_requests(document):
    """An independent recomputation from the per-request totals of both reports."""
    base, other = (
        np.array([[r["tokens"], r["rounds"]] for r in rep["per_request"]], float)
        for rep in document["reports"]
    )
    expected = paired_bootstrap_delta(base, other, tau_pooled_from_totals, n_boot=200, seed=0)
    got = document["drafters"][1]["delta_vs_first"]["pooled"]
    assert got["delta"] == pytest.approx(
        tau_pooled_from_totals(other) - tau_pooled_from_totals(base), abs=1e-12
    )
    assert got == pytest.approx(expected.to_dict(), abs=1e-12)


def test_cost_per_round(document):
    dflash, eagle = (row["cost"] for row in document["drafters"])
    assert dflash["draft_forwards_per_round"] == 1 and eagle["draft_forwards_per_round"] == 4
    assert eagle["draft_params"] > 0 and dflash["draft_params"] > 0
    for cost in (dflash, eagle):
        assert cost["flops_per_round"] > 2 * cost["draft_params"]  # at least one token through every weight
        assert cost["scoring_seconds_per_round"] > 0


def test_cli_json_html_and_target_heads(trained_drafter, eagle3_drafter, scorer_cache, tmp_path):
    out, page = tmp_path / "compare.json", tmp_path / "compare.html"
    args = [
        "compare",
        str(eagle3_drafter),
        str(trained_drafter),
        "--cache",
        str(scorer_cache),
        "--limit",
        "2",
    ]
    result = CliRunner().invoke(main, [*args, "--json", str(out), "--report", str(page)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    schemas.validate(saved, "compare_report")
    assert [r["family"] for r in saved["drafters"]] == ["eagle3", "dflash"]
    assert saved["drafters"][0]["drafting"]["source"] == "config"  # K from the speculators config
    html = page.read_text()
    assert "Per-slot acceptance" in html and "(eagle3)" in html and "(dflash)" in html
    assert png_is_not_blank(screenshot(page, tmp_path).read_bytes())
    both = tmp_path / "both.json"
    result = CliRunner().invoke(
        main,
        [
            "compare",
            str(eagle3_drafter),
            "target:mtp",
            "--cache",
            str(scorer_cache),
            "--limit",
            "1",
            "--json",
            str(both),
        ],
    )
    assert result.exit_code == 0, result.output
    assert [r["family"] for r in json.loads(both.read_text())["drafters"]] == ["eagle3", "mtp"]
    result = CliRunner().invoke(
        main, ["compare", str(eagle3_drafter), "target:foo", "--cache", str(scorer_cache)]
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and "'foo'" in result.output


def test_timed_rounds_draft_what_the_replay_drafted(document, trained_drafter, eagle3_drafter, scorer_cache):
    """The timed round (context cached, only the round's own work timed) drafts the same tokens as
    the replay at that anchor, so the time is the time of the scored work."""
    import torch

    import hscache
    from scorer.families import family_named
    from scorer.families.dflash.score import draft_all_anchors
    from scorer.families.eagle3.drafting import draft_every_anchor
    from scorer.offline.sequences import sequence_features

    cache = hscache.open_cache(scorer_cache)
    for checkpoint, name in ((trained_drafter, "dflash"), (eagle3_drafter, "eagle3")):
        family = family_named(name)
        drafter, _ = family.load(
            checkpoint, cache, EvalConfig(num_speculative_tokens=4 if name == "eagle3" else None)
        )
        index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
        norm = getattr(drafter, "context_norm", None)
        features = sequence_features(cache.hidden_states(0), index, torch.float32, "cpu", norm)
        tokens, prompt_len = cache.token_ids(0), cache.index.column("prompt_len")[0].as_py()
        if name == "eagle3":
            replay = draft_every_anchor(drafter, features, tokens, prompt_len, 4)
        else:
            replay = draft_all_anchors(drafter, features, tokens, prompt_len, 0)[0]
        for anchor in (prompt_len, prompt_len + 3, len(tokens) - 2):
            for tau in (1.0, 2.6):
                seconds, drafts = family.time_round(drafter, features, tokens, anchor, tau)
                assert seconds > 0 and drafts == replay[anchor - prompt_len].tolist()
    for row in document["drafters"]:
        assert row["cost"]["timed_rounds"] > 0 and row["cost"]["draft_seconds_per_round"] > 0


def test_compare_and_eval_print_tau_per_category(diagnose_cache, tmp_path):
    """Issue 31.3: the prompts' categories (the cache index) reach `scorer compare`'s tables (terminal,
    markdown) and both HTML reports; each cell equals tau recomputed from the per-request rows. The cache:
    the first 16 default prompts (12 code, 4 math)."""
    import hscache

    assert sorted(set(hscache.open_cache(diagnose_cache).index.column("category").to_pylist())) == [
        "code",
        "math",
    ]
    out, page = tmp_path / "c.json", tmp_path / "c.html"
    args = ["compare", "ngram", "target:mtp", "--num-speculative-tokens", "3", "--cache", str(diagnose_cache)]
    result = CliRunner().invoke(
        main, [*args, "--format", "markdown", "--json", str(out), "--report", str(page)]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    header = "| category | requests | ngram (ngram): tau per request | ngram (ngram): tau pooled | target:mtp (mtp):"
    assert header in result.output, result.output
    html = page.read_text()
    assert "<h2>Per category</h2>" in html
    for category in ("code", "math"):
        cells = [f"| {category} | {12 if category == 'code' else 4} |"]
        for report in document["reports"]:
            rows = [r for r in report["per_request"] if r["category"] == category and r["rounds"]]
            per_request = np.mean([r["tokens"] / r["rounds"] for r in rows])
            pooled = sum(r["tokens"] for r in rows) / sum(r["rounds"] for r in rows)
            cells.append(f" {per_request:.3f} | {pooled:.3f} |")
        assert "".join(cells) in result.output, (cells, result.output)
    single = evaluate("target:mtp", diagnose_cache, EvalConfig(ddtree=(), n_boot=10))
    from scorer.report.html import render_eval_html

    eval_page = render_eval_html(single)
    assert (
        "<h2>Per category</h2>" in eval_page
        and f"{single['per_category']['math']['tau_pooled']:.3f}" in eval_page
    )
