"""``scorer eval`` on a compact cache (``--states fp8``) scores its exact slice both ways and reports
the paired delta tau (scorer/studies/exact_slice.py), checked against the same drafter scored on the
source cache (the exact slice holds the source states bit for bit, so those scores are identical)."""

from __future__ import annotations

import io
import shutil

import numpy as np
from rich.console import Console

from hscache import schemas
from hscache.store.compact_convert import convert_states
from scorer.metrics import paired_bootstrap_delta, tau_per_request_from_totals
from scorer.report.terminal import render_report
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.studies.exact_slice import exact_slice_warning


def test_eval_on_a_compact_cache_reports_the_exact_slice_both_ways(trained_drafter, scorer_cache, tmp_path):
    compact = tmp_path / "fp8"
    shutil.copytree(scorer_cache, compact)
    convert_states(compact, every=1)  # every sequence also kept exact: a 6-request paired interval
    config = EvalConfig(ddtree=(), anchors="chain", n_boot=200)
    source = evaluate(trained_drafter, scorer_cache, config)
    report = evaluate(trained_drafter, compact, config)
    schemas.validate(report, "eval_report")
    assert "exact_slice" not in source
    drift = report["exact_slice"]
    ids = drift["record_ids"]
    assert drift["requests"] == len(ids) >= 2 and drift["codec"] == "float8_e4m3fn"

    def totals(rep):
        by_id = {r["record_id"]: r for r in rep["per_request"]}
        return np.array([[by_id[i]["tokens"], by_id[i]["rounds"]] for i in ids], dtype=float)

    exact, fp8 = totals(source), totals(report)  # exact = the source cache's own scores
    assert drift["tau"]["exact"]["per_request"] == tau_per_request_from_totals(exact)
    assert drift["tau"]["compact"]["per_request"] == tau_per_request_from_totals(fp8)
    want = paired_bootstrap_delta(exact, fp8, tau_per_request_from_totals, 200, config.seed).to_dict()
    assert drift["delta"]["per_request"] == want
    assert drift["interval_excludes_zero"] == (not _contains_zero(drift))
    assert (
        any(w.startswith("fp8 states moved tau") for w in report["warnings"])
        == drift["interval_excludes_zero"]
    )
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    assert f"fp8 states, exact slice of {len(ids)} requests" in out.getvalue()


def _contains_zero(drift):
    return all(d["lo"] <= 0 <= d["hi"] for d in drift["delta"].values())


def test_a_drift_whose_interval_excludes_zero_is_a_warning():
    delta = {"delta": -0.2, "lo": -0.3, "hi": -0.1, "n_requests": 4}
    drift = {"requests": 4, "delta": {"per_request": delta, "pooled": delta}, "interval_excludes_zero": True}
    assert "fp8 states moved tau on the exact slice (4 requests): per request -0.200" in exact_slice_warning(
        drift
    )
    assert exact_slice_warning({**drift, "interval_excludes_zero": False}) is None
