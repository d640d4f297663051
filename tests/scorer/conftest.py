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
def sampled_scorer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scorer_cache``'s first 3 prompts (layers 1,3,7, fp32, the MTP head) sampled at Qwen's
    thinking-coding preset (T 0.6, top-p 0.95, top-k 20, no penalty), 2 samples x 16 tokens, seed 3:
    every drafter fixture here scores it (tests/scorer/test_served.py)."""
    from hscache.store.sampling import SamplingSetting

    out = tmp_path_factory.mktemp("scorer") / "sampled"
    sampling = SamplingSetting.from_flags("qwen-thinking-coding", samples_per_prompt=2, seed=3)
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="1,3,7", max_new_tokens=16, dtype="fp32", limit=3, sampling=sampling
        )
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


# ---- scorer diagnose: tiny drafters trained under a planted convention ---------------------------
# The smallest cache found to give clear gaps (see docs/diagnose.md): all 8 layers of the built-in
# target (so layer ids can shift by 1), 16 prompts x 32 greedy tokens; block 8, 300 steps, seed 0.
PLANTS: dict[str, tuple[dict, dict]] = {
    # name: (train_drafter settings, config.json dflash_config fields rewritten afterwards)
    "clean": ({}, {}),
    "positions+1": ({"block_position_offset": 1}, {}),
    "mask2": ({"mask_token_id": 2}, {"mask_token_id": 3}),  # the cache's mask id is 3
    "layers": ({}, {"target_layer_ids": [0, 2, 6]}),  # trained on [1, 3, 7]: the config is one off
    "prenorm": ({"last_layer_normed": False}, {}),
}


@pytest.fixture(scope="session")
def diagnose_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("diagnose") / "cache"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="0,1,2,3,4,5,6,7", max_new_tokens=32, dtype="fp32", limit=16
        )
    )
    return out


@pytest.fixture(scope="session")
def planted_drafter(diagnose_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> a drafter trained on ``diagnose_cache`` under ``PLANTS[name]`` (trained on first use;
    plants that differ only in their rewritten config share one training)."""
    import json
    import shutil

    root, trained, made = tmp_path_factory.mktemp("planted"), {}, {}

    def get(name: str) -> Path:
        if name not in made:
            settings, rewrite = PLANTS[name]
            key = json.dumps(settings, sort_keys=True)
            if key not in trained:
                trained[key] = root / f"trained{len(trained)}"
                train_drafter(
                    diagnose_cache, trained[key], steps=300, block_size=8, log_every=0,
                    **{"layer_ids": [1, 3, 7], **settings},
                )  # fmt: skip
            out = root / name
            shutil.copytree(trained[key], out)
            config = json.loads((out / "config.json").read_text())
            config["dflash_config"].update(rewrite)
            (out / "config.json").write_text(json.dumps(config))
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def diagnose_eagle3(diagnose_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer EAGLE-3 (speculators layout, layers 1,3,7, K=3) trained 200 steps on
    ``diagnose_cache``: tau 3.47 there, clear of the rope-theta and d2t plants of test_diagnose_families
    (2.5 CPU-s; 25 steps, ``eagle3_drafter``'s, leave tau 1.16, too close to 1 for any plant)."""
    from scorer.families.eagle3.train import train_eagle3

    out = tmp_path_factory.mktemp("diagnose") / "eagle3"
    train_eagle3(diagnose_cache, out, steps=200, layer_ids=[1, 3, 7], num_speculative_tokens=3)
    return out
