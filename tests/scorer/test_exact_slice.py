"""``scorer eval`` on a compact cache (``--states fp8``) scores its exact slice both ways and reports
the paired delta tau (scorer/studies/exact_slice.py), checked against the same drafter scored on the
source cache (the exact slice holds the source states bit for bit, so those scores are identical);
``evaluate_module``, distributed eval and ``scorer compare`` report the same drift."""

from __future__ import annotations

import concurrent.futures
import io
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from hscache import schemas
from hscache.store.compact_convert import convert_states
from scorer.metrics import paired_bootstrap_delta, tau_per_request_from_totals
from scorer.report.terminal import render_report
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.studies.exact_slice import exact_slice_warning

_CONFIG = EvalConfig(ddtree=(), anchors="chain", n_boot=200)


@pytest.fixture(scope="module")
def compact(scorer_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("exact-slice") / "fp8"
    shutil.copytree(scorer_cache, out)
    convert_states(out, every=1)  # every sequence also kept exact: a 6-request paired interval
    return out


@pytest.fixture(scope="module")
def fp8_report(trained_drafter, compact):
    return evaluate(trained_drafter, compact, _CONFIG)


def test_eval_on_a_compact_cache_reports_the_exact_slice_both_ways(trained_drafter, scorer_cache, fp8_report):
    config = _CONFIG
    source = evaluate(trained_drafter, scorer_cache, config)
    report = fp8_report
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


def test_evaluate_module_and_compare_report_the_same_exact_slice(trained_drafter, compact, fp8_report):
    import scorer
    from scorer.cli import main
    from scorer.families.dflash.checkpoint import load_checkpoint
    from scorer.studies.compare import compare_drafters

    want = fp8_report["exact_slice"]
    state_dict = load_checkpoint(trained_drafter).state_dict
    config = json.loads((trained_drafter / "config.json").read_text())
    from_module = scorer.evaluate_module(state_dict, str(compact), config, _CONFIG)
    assert from_module["exact_slice"] == want
    document = compare_drafters([trained_drafter], compact, _CONFIG, timed_rounds=0)
    assert document["reports"][0]["exact_slice"] == want
    result = CliRunner().invoke(
        main, ["compare", str(trained_drafter), "--cache", str(compact), "--ddtree", ""]
    )
    assert result.exit_code == 0, result.output
    assert f"fp8 states, exact slice of {want['requests']} requests" in result.output


class _InProcess:
    """A dask client stand-in whose tasks run here at submit (no cluster: test_distributed.py covers
    the workers; what this checks is the client's report, where the exact slice is scored)."""

    def submit(self, fn, *args, pure=True):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


def test_distributed_eval_reports_the_same_exact_slice(monkeypatch, trained_drafter, compact, fp8_report):
    from scorer.studies.distributed import ScoringJob, evaluate_distributed

    monkeypatch.setattr(
        ScoringJob, "outputs", lambda self, on_output=None: [f.result() for f in self.futures]
    )
    threads = torch.get_num_threads()
    try:  # score_task sets one torch thread, as in a worker
        report = evaluate_distributed(trained_drafter, compact, _CONFIG, _InProcess(), tokens_per_task=40)
    finally:
        torch.set_num_threads(threads)
    assert report["exact_slice"] == fp8_report["exact_slice"]


def _contains_zero(drift):
    return all(d["lo"] <= 0 <= d["hi"] for d in drift["delta"].values())


def test_a_drift_whose_interval_excludes_zero_is_a_warning():
    delta = {"delta": -0.2, "lo": -0.3, "hi": -0.1, "n_requests": 4}
    drift = {"requests": 4, "delta": {"per_request": delta, "pooled": delta}, "interval_excludes_zero": True}
    assert "fp8 states moved tau on the exact slice (4 requests): per request -0.200" in exact_slice_warning(
        drift
    )
    assert exact_slice_warning({**drift, "interval_excludes_zero": False}) is None
