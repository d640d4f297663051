"""The judge's drafters of the families issue 49 adds (the standalone draft model, P-EAGLE, suffix decoding),
built on the greedy tiny-qwen3 cache and served in the judge's one vLLM process (tests/judge/conftest.py adds
them).

A module of its own (not conftest), as vllm_env.py: the conftest and the test files import it by name."""

from __future__ import annotations

from pathlib import Path

# name -> (drafter, ServedConfig fields), merged into conftest's QWEN3_ENGINES.
METHOD_ENGINES = {
    # the target's first 2 layers as a standalone LM (scorer init --family draft_model): vLLM's K 3
    "draft_model": ("draft_model", {"num_speculative_tokens": 3}),
    # P-EAGLE K 3 (EAGLE-3 with parallel_drafting), trained briefly so its parallel slots accept something
    "peagle": ("peagle", {}),
    # suffix decoding at vLLM's defaults (K = tree depth 24): no file, its requests served one at a time
    "suffix": ("suffix", {}),
}
WRITTEN = ("draft_model", "peagle")  # the engines above whose drafters are files written here
PEAGLE_STEPS = 25  # ~4 CPU-s; slot 2 then accepts on the shipped target (slot 3 rarely)


def method_drafters(cache: Path, root: Path) -> dict[str, str]:
    """Write the drafters of METHOD_ENGINES under ``root``; their paths by name."""
    from scorer.families.draft_model.init import init_draft_model
    from scorer.families.peagle.seam import train

    init_draft_model(cache, root / "draft_model", num_layers=2)
    train(cache, root / "peagle", steps=PEAGLE_STEPS, num_speculative_tokens=3, layer_ids=[1, 3, 7])
    return {name: str(root / name) if name in WRITTEN else name for name in METHOD_ENGINES}


def assert_equal_round_for_round(run, requests: int) -> dict:
    """vLLM's own per-request counters equal the offline replay of what it served, round for round (fp32:
    no tie excuses anything), and drafts were accepted (not vacuous). Returns the judge's report."""
    from scorer.studies.vllm_judge import score_served

    report = score_served(run)
    rows = report["per_request"]
    assert len(rows) == requests
    assert report["verdict"] == "equal" and report["equal"] is True and not report["ties"], report[
        "differences"
    ]
    for row in rows:
        assert row["offline"]["anchors"] == row["vllm"]["anchors"]
        assert row["offline"]["accepted"] == row["vllm"]["accepted"]
    assert report["tau"]["offline_report"]["pooled"] == report["tau"]["vllm"]["pooled"]
    assert sum(a for row in rows for a in row["vllm"]["accepted"]) > 0
    return report
