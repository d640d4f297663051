"""A large index opens without per-row Python work, and scoring reads it per row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pytest

import hscache
from hscache.store import jsonio
from scorer.studies.evaluate import EvalConfig, evaluate


def _load_synthetic_index():
    # Loaded by file path: bench/ on sys.path would shadow the scorer package with
    # bench/scorer.py, in this process and in every dask worker started from it.
    path = Path(__file__).resolve().parents[2] / "bench" / "synthetic_index.py"
    spec = importlib.util.spec_from_file_location("synthetic_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_index


synthetic_index = _load_synthetic_index()

_N = 10_000  # any per-row work shows at this size (10,000 parses or to_pylist calls, not 3)


class _NoListColumn:
    """An index column that refuses to become a Python list of every row."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        self._column = column

    def __getattr__(self, name: str):
        return getattr(self._column, name)

    def __getitem__(self, row):
        return self._column[row]

    def __len__(self) -> int:
        return len(self._column)

    def to_pylist(self):
        raise AssertionError(f"to_pylist() over all {len(self._column)} index rows")


class _GuardedIndex:
    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def __getattr__(self, name: str):
        return getattr(self._table, name)

    def column(self, name):
        return _NoListColumn(self._table.column(name))


@pytest.fixture(scope="module")
def big_index(scorer_cache, tmp_path_factory) -> Path:
    """The scorer cache behind a synthetic 10,000-row index (built once: both tests only read it)."""
    return synthetic_index(scorer_cache, tmp_path_factory.mktemp("index-scale") / "big", _N)


def test_large_index_opens_parsing_only_distinct_metadata(big_index, monkeypatch):
    path = big_index
    calls = []
    real = jsonio.loads
    # Every JSON the store parses goes through jsonio.loads; the index metadata arrives as str (files as bytes).
    monkeypatch.setattr(jsonio, "loads", lambda s: (isinstance(s, str) and calls.append(s)) or real(s))
    cache = hscache.open_cache(path)
    assert len(cache) == _N
    assert 1 <= len(calls) <= 3  # the 3 distinct metadata strings, not one per row
    assert cache.index.column("category")[_N - 1].as_py() == ["code", "math", "chat"][(_N - 1) % 3]


def test_scoring_a_large_index_reads_it_per_row(big_index, trained_drafter, monkeypatch):
    path = big_index
    real_open = hscache.open_cache

    def guarded(p, **options):
        cache = real_open(p, **options)
        cache.index = _GuardedIndex(cache.index)
        return cache

    monkeypatch.setattr(hscache, "open_cache", guarded)
    report = evaluate(trained_drafter, path, EvalConfig(ddtree=(), n_boot=10, limit=2, anchors="chain"))
    assert report["requests"] == 2 and report["cache"]["sequences"] == _N
