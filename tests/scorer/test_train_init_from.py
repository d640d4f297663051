"""``train_drafter(..., init_from=DIR)``: a DFlash run that starts from a trained drafter's weights
(the fine-tuned plants of tests/scorer/conftest.py), and refuses one whose config differs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from scorer import train_drafter
from scorer.errors import ScorerError


def test_a_run_from_a_drafter_starts_at_its_weights(scorer_cache, trained_drafter, tmp_path):
    start = load_file(str(trained_drafter / "model.safetensors"))
    train_drafter(
        scorer_cache, tmp_path / "same", steps=0, block_size=6, log_every=0, init_from=trained_drafter
    )
    same = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert same.keys() == start.keys() and all(torch.equal(same[k], start[k]) for k in start)
    train_drafter(
        scorer_cache, tmp_path / "moved", steps=3, block_size=6, log_every=0, init_from=trained_drafter
    )
    moved = load_file(str(tmp_path / "moved" / "model.safetensors"))
    # three steps move the weights a little from the start, nowhere near a fresh init's distance
    fresh = {"steps": 0, "block_size": 6, "log_every": 0}
    train_drafter(scorer_cache, tmp_path / "fresh", **fresh)
    random = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    key = "layers.0.mlp.down_proj.weight"
    assert 0 < (moved[key] - start[key]).norm() < 0.5 * (random[key] - start[key]).norm()


def test_a_start_of_another_shape_is_refused_naming_the_field(scorer_cache, trained_drafter, tmp_path):
    """Two target layers read instead of three: the fc's input width differs. (A convention, e.g.
    the block size, may change: the plants of tests/scorer/conftest.py are fine-tuned so.)"""
    want = r"do not fit .*target_layer_ids \(1, 3, 7\) \(this run: \(1, 3\)\)"
    with pytest.raises(ScorerError, match=want) as err:
        train_drafter(
            scorer_cache, tmp_path / "x", steps=1, layer_ids=[1, 3], log_every=0, init_from=trained_drafter
        )
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()
    # another block size is a convention: a run at block 8 starts from the block-6 drafter
    train_drafter(
        scorer_cache, tmp_path / "b8", steps=0, block_size=8, log_every=0, init_from=trained_drafter
    )
    assert (tmp_path / "b8" / "model.safetensors").is_file()
