"""The DFlash trainer's slot weights: slot j of a block weighs exp(-(j - 1) / gamma) in the loss,
gamma = block size / 2 unless ``loss_decay_gamma`` says otherwise (scorer/families/dflash/train.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

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
