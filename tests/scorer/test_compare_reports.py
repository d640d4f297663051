"""``compare_reports`` on hand-made reports: which requests pair up, and what counts as a changed round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scorer.report.build import compare_reports

_CONFIG = SimpleNamespace(n_boot=50, seed=0)


def _row(row: int, record_id: str, sha: str, anchors: list[int], accepted: list[int]) -> dict:
    return {
        "row": row,
        "record_id": record_id,
        "token_sha256": sha,
        "anchors": anchors,
        "accepted": accepted,
        "rounds": len(anchors),
        "tokens": sum(a + 1 for a in accepted),
    }


def _report(path: str, rows: list[dict]) -> dict:
    return {"cache": {"path": path}, "tau": {"per_request": None, "pooled": None}, "per_request": rows}


def test_requests_pair_by_record_id_occurrence_and_token_ids() -> None:
    base = _report(
        "A",
        [
            _row(0, "x", "s0", [5, 8], [2, 3]),
            _row(1, "x", "s1", [5, 9], [3, 0]),
            _row(2, "y", "s2", [4], [1]),
            _row(3, "z", "s3", [4], [1]),
        ],
    )
    other = _report(
        "B",
        [
            _row(0, "x", "s0", [5, 8], [2, 3]),
            _row(1, "x", "s1", [5, 8], [2, 3]),
            _row(2, "y", "DIFFERENT", [4], [1]),
            _row(3, "w", "s4", [4], [1]),
        ],
    )
    comp = compare_reports(base, other, _CONFIG)
    # the second "x" pairs with the second "x"; y's text differs; z and w are each in one report only
    assert comp["requests_compared"] == 2
    assert comp["requests_left_out"] == {"missing": ["w", "z"], "different_tokens": ["y"], "no_rounds": []}
    # anchors both visit: (x#0: 5, 8) and (x#1: 5); only x#1 @ 5 changed (3 -> 2)
    assert (comp["rounds_compared"], comp["rounds_with_changed_acceptance"]) == (3, 1)
    assert comp["first_changes"] == [{"record_id": "x", "anchor": 5, "accepted": [3, 2]}]
    pooled = comp["delta"]["pooled"]
    assert pooled["n_requests"] == 2
    assert pooled["delta"] == pytest.approx((7 + 7) / 4 - (7 + 5) / 4)  # tokens / rounds over x#0, x#1


def test_no_common_request_gives_no_delta() -> None:
    comp = compare_reports(
        _report("A", [_row(0, "x", "s0", [5], [1])]), _report("B", [_row(0, "x", "s9", [5], [1])]), _CONFIG
    )
    assert comp["requests_compared"] == 0 and comp["delta"] == {"per_request": None, "pooled": None}
    assert comp["requests_left_out"]["different_tokens"] == ["x"]


def test_comparison_table_says_how_many_requests_each_delta_is_over() -> None:
    """Issue #14: "tau 7.750 vs 2.166" beside "delta +0.000" with 1 of 7 requests paired read as a
    contradiction; the table must name the paired count and say how to compare on identical tokens."""
    from rich.console import Console

    from scorer.report.terminal import render_comparison

    base = _report("A", [_row(i, f"r{i}", f"s{i}", [4, 8], [3, 3]) for i in range(7)])
    other = _report("B", [_row(0, "r0", "s0", [4, 8], [3, 3])] + [
        _row(i, f"r{i}", f"other{i}", [4], [0]) for i in range(1, 7)
    ])  # fmt: skip
    base["requests"], other["requests"] = 7, 7
    result = {"reports": [base, other], "comparisons": [compare_reports(base, other, _CONFIG)]}
    console = Console(record=True, width=300)
    render_comparison(result, console)
    text = console.export_text()
    assert "1 of 7 requests" in text
    assert "6 are left out" in text and "hscache extract --tokens-from A" in text


def test_comparison_names_every_cache_in_full_on_a_narrow_terminal() -> None:
    """Issue 35 item 13: two caches under one long directory were both cut to `../clon...`."""
    from rich.console import Console

    from scorer.report.terminal import render_comparison

    a, b = "../clones/experiment-one/caches/fp32-reference", "../clones/experiment-one/caches/bf16-candidate"
    base = _report(a, [_row(0, "r0", "s0", [4, 8], [3, 3])])
    other = _report(b, [_row(0, "r0", "s0", [4, 8], [3, 3])])
    base["requests"] = other["requests"] = 1
    result = {"reports": [base, other], "comparisons": [compare_reports(base, other, _CONFIG)]}
    console = Console(record=True, width=60)
    render_comparison(result, console)
    text = console.export_text()
    assert f"cache 1 (base): {a}" in text and f"cache 2: {b}" in text
