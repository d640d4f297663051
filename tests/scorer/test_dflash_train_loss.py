"""The DFlash trainer's slot weights: slot j of a block weighs exp(-(j - 1) / gamma) in the loss,
gamma = block size / 2 unless ``loss_decay_gamma`` says otherwise (scorer/families/dflash/train.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from scorer import train_drafter
from scorer.errors import ScorerError


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


def test_prompt_anchors_train_slot_one_on_the_targets_argmax_inside_the_prompt(scorer_cache):
    """``training_batch``: without the option every anchor lies in the generated region and every slot
    learns the text; with it anchors start at position 1, and one inside the prompt learns slot 1 from
    the target's argmax there (not the prompt's own next token) and nothing else."""
    import hscache
    from hscache.data import SequenceDataset
    from scorer.families.dflash.features import feature_index
    from scorer.families.dflash.init import dflash_config_for_cache
    from scorer.families.dflash.model import DFlashDrafter
    from scorer.families.dflash.train import training_batch

    cache = hscache.open_cache(scorer_cache)
    drafter = DFlashDrafter(dflash_config_for_cache(cache, num_layers=1, block_size=4))
    drafter.context_norm = None
    index, data, row = feature_index(drafter.config, cache.layer_ids), SequenceDataset(scorer_cache), 0
    x, a = cache.token_ids(row), cache.target_argmax(row)
    P = cache.index.column("prompt_len")[row].as_py()
    for prompt_anchors in (False, True):
        gen, seen = torch.Generator().manual_seed(0), torch.zeros(len(x), dtype=torch.bool)
        for _ in range(20):
            _, anchors, blocks, targets = training_batch(
                data, [row], index, drafter, 16, gen, {}, prompt_anchors
            )
            seen[anchors] = True
            assert torch.equal(blocks[:, 0], x[anchors]) and (anchors >= 1).all()
            for p, t in zip(anchors.tolist(), targets.tolist()):
                want = [int(x[p + j]) if p + j < len(x) else -100 for j in range(1, 4)]
                if p < P:
                    want = [int(a[p]), -100, -100]
                assert t == want, (prompt_anchors, p)
        assert seen[:P].any() == prompt_anchors  # the prompt is visited only with the option
        assert (x[1:P] != a[: P - 1]).any()  # the prompt's own tokens are not the target's choices


def test_prompt_anchors_change_the_training_and_are_refused_where_they_mean_nothing(scorer_cache, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    default = _weights(scorer_cache, tmp_path / "default")
    prompts = _weights(scorer_cache, tmp_path / "prompts", prompt_anchors=True)
    assert any(not torch.equal(default[k], prompts[k]) for k in default)
    for args, message in (
        ([], "--prompt-anchors chooses where a DFlash drafter trains: add --train-steps N"),
        (["--family", "eagle3", "--train-steps", "2"], "--prompt-anchors does not apply to --family eagle3"),
    ):
        out = tmp_path / "refused"
        result = CliRunner().invoke(
            main, ["init", str(out), "--cache", str(scorer_cache), "--prompt-anchors", *args]
        )
        assert (
            result.exit_code == 2
            and message in result.output
            and len(result.output.strip().splitlines()) == 1
        )
        assert not out.exists()
