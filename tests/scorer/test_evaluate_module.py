"""``scorer.evaluate_module``: an in-memory drafter scored without files, equal to ``scorer eval`` of
the same weights; the block-position offset that ``scorer diagnose`` replays; and issue 20 item 4:
a null mask id in a shipped config is read from SpecForge's training_state.pt or warned about."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

import hscache
import scorer
from scorer.errors import CheckpointError
from scorer.families.dflash.checkpoint import load_checkpoint
from scorer.families.dflash.features import attach_cache_head
from scorer.families.dflash.model import DFlashDrafter
from scorer.report.html import render_eval_html
from scorer.report.terminal import render_report
from scorer.studies.evaluate import EvalConfig, evaluate

_TAU_ONLY = EvalConfig(ddtree=(), anchors="chain")


def _module(checkpoint: Path) -> DFlashDrafter:
    loaded = load_checkpoint(checkpoint)
    module = DFlashDrafter(loaded.config)
    module.load_state_dict(loaded.state_dict)
    return module


def test_a_training_loop_reads_tau_from_memory_equal_to_the_saved_drafters(scorer_cache, tmp_path):
    from scorer import train_drafter

    seen = []
    result = train_drafter(
        scorer_cache,
        tmp_path / "d",
        steps=6,
        eval_every=3,
        eval_limit=None,
        log_every=0,
        on_eval=lambda step, report: seen.append((step, report["tau"]["pooled"])),
    )
    assert [step for step, _ in result["tau_history"]] == [3, 6] and seen == result["tau_history"]
    # Training moved tau between the two evaluations (1.05 -> 1.13): a stale module would show.
    assert result["tau_history"][0][1] != result["tau_history"][1][1]
    # The last in-memory tau is the saved drafter's tau: evaluate_module scored those very weights.
    assert result["tau_history"][-1][1] == evaluate(tmp_path / "d", scorer_cache, _TAU_ONLY)["tau"]["pooled"]


def test_module_and_state_dict_score_like_the_file(scorer_cache, trained_drafter):
    from_file = evaluate(trained_drafter, scorer_cache, _TAU_ONLY)
    module = _module(trained_drafter)
    module.train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    from_module = scorer.evaluate_module(module, scorer_cache)
    state_dict = load_checkpoint(trained_drafter).state_dict
    config = json.loads((trained_drafter / "config.json").read_text())
    from_state = scorer.evaluate_module(state_dict, str(scorer_cache), config)
    for report in (from_module, from_state):
        assert report["tau"]["pooled"] == from_file["tau"]["pooled"]  # same weights, same replay: exact
        assert [r["accepted"] for r in report["per_request"]] == [
            r["accepted"] for r in from_file["per_request"]
        ]
        assert report["checkpoint"]["format"] == "module"
        assert report["checkpoint"]["weights_sha256"] == from_file["checkpoint"]["weights_sha256"]
    assert module.training  # the caller's module is left as it was
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_a_module_with_the_target_attached_is_reused_and_limit_applies(scorer_cache, trained_drafter):
    cache = hscache.open_cache(scorer_cache)
    module = _module(trained_drafter)
    attach_cache_head(module, cache, torch.float32, "cpu")  # as a training loop has it
    report = scorer.evaluate_module(module, cache, limit=2)
    reference = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), anchors="chain", limit=2))
    assert report["requests"] == 2 and report["tau"]["pooled"] == reference["tau"]["pooled"]


def test_a_state_dict_without_a_config_is_one_clear_error(scorer_cache, trained_drafter):
    state_dict = load_checkpoint(trained_drafter).state_dict
    with pytest.raises(CheckpointError, match="needs the drafter's config"):
        scorer.evaluate_module(state_dict, scorer_cache)
    config = load_checkpoint(trained_drafter).config
    bad = {k: v for k, v in state_dict.items() if k != "norm.weight"}
    with pytest.raises(CheckpointError, match="missing 1 key: norm.weight"):
        scorer.evaluate_module(bad, scorer_cache, config)


def test_block_position_offset_moves_only_the_block_rope_in_both_forwards(scorer_cache, trained_drafter):
    cache = hscache.open_cache(scorer_cache)
    module = _module(trained_drafter).eval()
    attach_cache_head(module, cache, torch.float32, "cpu")
    features = torch.randn(20, module.config.num_features * module.config.hidden_size)
    block = torch.full((module.config.block_size,), module.config.mask_token_id)
    block[0] = 5
    plain = module.forward_one_block(features, block, 12)
    module.block_position_offset = 1
    shifted_one = module.forward_one_block(features, block, 12)
    shifted_many = module.forward_blocks(features, torch.tensor([12]), block[None])[0]
    assert not torch.allclose(plain, shifted_one, atol=1e-3)
    torch.testing.assert_close(shifted_many, shifted_one, rtol=1e-5, atol=1e-5)  # fp32, two kernels


# ---- issue 20 item 4: mask_token_id null -----------------------------------------------------------
def _null_mask_export(trained_drafter: Path, out: Path) -> Path:
    shutil.copytree(trained_drafter, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = None  # as SpecForge's shipped configs
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_null_mask_id_filled_from_the_cache_warns_in_every_output(scorer_cache, trained_drafter, tmp_path):
    export = _null_mask_export(trained_drafter, tmp_path / "export")
    report = evaluate(export, scorer_cache, _TAU_ONLY)
    warning = next(w for w in report["warnings"] if w.startswith("drafter mask_token_id="))
    assert "dflash_config.mask_token_id: null" in warning and "--mask-token-id" in warning
    assert report["checkpoint"]["field_sources"]["mask_token_id"] == "cache"
    assert warning in report["checkpoint"]["warnings"]  # JSON: both places
    console = Console(record=True, width=400)
    render_report(report, console)
    assert warning in console.export_text()
    assert "drafter mask_token_id=" in render_eval_html(report)


def test_a_training_state_beside_the_export_supplies_the_trained_mask_id(
    scorer_cache, trained_drafter, tmp_path
):
    export = _null_mask_export(trained_drafter, tmp_path / "epoch_0_step_10")
    torch.save(
        {"optimizer": {}, "dflash_mask_token_id": 2, "dflash_block_size": 6, "global_step": 10},
        export / "training_state.pt",
    )
    loaded = load_checkpoint(export)
    assert loaded.config.mask_token_id == 2 and loaded.report.field_sources["mask_token_id"] == "checkpoint"
    assert not any("mask_token_id" in w for w in loaded.report.warnings)
    with_state = evaluate(export, scorer_cache, _TAU_ONLY)
    flagged = evaluate(
        trained_drafter, scorer_cache, EvalConfig(ddtree=(), anchors="chain", overrides={"mask_token_id": 2})
    )
    assert with_state["tau"]["pooled"] == flagged["tau"]["pooled"]


class _Opaque:  # a pickled object that weights_only refuses to load
    pass


def test_a_training_state_that_needs_unpickling_is_skipped_with_a_note(trained_drafter, tmp_path):
    export = _null_mask_export(trained_drafter, tmp_path / "export")

    torch.save({"dflash_mask_token_id": 2, "args": _Opaque()}, export / "training_state.pt")
    loaded = load_checkpoint(export, fallbacks={"mask_token_id": 3})
    assert loaded.config.mask_token_id == 3
    assert any("--trust-checkpoint" in n for n in loaded.report.notes)
    assert any(w.startswith("drafter mask_token_id=3") for w in loaded.report.warnings)


def test_scorer_init_eval_every_prints_tau_while_training_and_needs_train_steps(scorer_cache, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    runner = CliRunner()
    done = runner.invoke(
        main,
        [
            "init",
            str(tmp_path / "d"),
            "--cache",
            str(scorer_cache),
            "--train-steps",
            "4",
            "--eval-every",
            "2",
        ],
    )
    assert done.exit_code == 0, done.output
    assert [line.split(":")[0] for line in done.output.splitlines() if line.startswith("step ")] == [
        "step 2",
        "step 4",
    ]
    refused = runner.invoke(
        main, ["init", str(tmp_path / "e"), "--cache", str(scorer_cache), "--eval-every", "2"]
    )
    assert refused.exit_code == 2 and refused.output.strip().splitlines() == [
        "error: --eval-every watches a DFlash drafter while it trains: add --train-steps N"
    ]
