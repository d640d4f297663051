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
