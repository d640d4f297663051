"""Fixtures for stage two: a trained tiny drafter on a small fp32 cache of the built-in target."""

from __future__ import annotations

from pathlib import Path

import pytest

import hscache
from scorer.train import train_drafter


@pytest.fixture(scope="session")
def scorer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scorer") / "cache"
    hscache.extract(
        hscache.ExtractConfig(out=str(out), layers="1,3,7", max_new_tokens=24, dtype="fp32", limit=6)
    )
    return out


@pytest.fixture(scope="session")
def trained_drafter(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scorer") / "drafter"
    train_drafter(scorer_cache, out, steps=150, block_size=6, log_every=0)
    return out


@pytest.fixture(scope="session")
def eagle3_drafter(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly trained 1-layer EAGLE-3 (speculators layout, layers 1,3,7, K=3) for the cache."""
    from scorer.families.eagle3.train import train_eagle3

    out = tmp_path_factory.mktemp("scorer") / "eagle3"
    train_eagle3(scorer_cache, out, steps=25, layer_ids=[1, 3, 7])
    return out
