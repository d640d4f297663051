"""bench/dflash_anchor.py on the session's DFlash drafter (the bench's own run lives with the scorer's fixtures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_dflash_anchor_probe_takes_each_input_away(scorer_cache: Path, trained_drafter: Path, capsys):
    """Every line printed; the real drafter's slot-1 accuracy is its own (``scorer eval``'s unconditional
    slot-1 acceptance over every anchor of the same sequences); taking the context away changes drafts."""
    from scorer.studies.evaluate import EvalConfig, evaluate

    spec = importlib.util.spec_from_file_location("dflash_anchor_bench", ROOT / "bench" / "dflash_anchor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rates = bench.main([str(trained_drafter), "--cache", str(scorer_cache), "--limit", "6"])
    out = capsys.readouterr().out
    for name in ("real", "random anchor", "zero context", "shuffled context", "bigram (in-sample)"):
        assert name in out and 0 <= rates[name] <= 1
    report = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=10, limit=6))
    assert rates["real"] == pytest.approx(report["acceptance"]["unconditional"][0])
    assert rates["zero context"] != rates["real"]
