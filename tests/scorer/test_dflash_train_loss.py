"""The DFlash trainer's slot weights: slot j of a block weighs exp(-(j - 1) / gamma) in the loss,
gamma = block size / 2 unless ``loss_decay_gamma`` says otherwise (scorer/families/dflash/train.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from scorer.errors import ScorerError
from scorer.train import train_drafter


def _weights(cache, out, **settings) -> dict[str, torch.Tensor]:
    train_drafter(cache, out, steps=2, block_size=6, log_every=0, **settings)
    return load_file(str(out / "model.safetensors"))


def test_the_default_gamma_is_half_the_block_and_gamma_changes_the_training(scorer_cache, tmp_path):
    default = _weights(scorer_cache, tmp_path / "default")
    half = _weights(scorer_cache, tmp_path / "half", loss_decay_gamma=3)
    whole = _weights(scorer_cache, tmp_path / "whole", loss_decay_gamma=6)
    assert default.keys() == half.keys() and all(torch.equal(default[k], half[k]) for k in default)
    # the same seed, data and steps: only the slot weights differ, and they move the weights
    assert any(not torch.equal(default[k], whole[k]) for k in default)


def test_gamma_zero_is_no_decay_and_a_negative_one_is_refused_before_training(scorer_cache, tmp_path):
    flat = _weights(scorer_cache, tmp_path / "flat", loss_decay_gamma=0)
    default = _weights(scorer_cache, tmp_path / "default")
    assert any(not torch.equal(flat[k], default[k]) for k in flat)
    with pytest.raises(ScorerError, match=r"^loss_decay_gamma -1 is negative: pass a positive decay"):
        train_drafter(scorer_cache, tmp_path / "bad", steps=2, log_every=0, loss_decay_gamma=-1)
    assert not (tmp_path / "bad").exists()
