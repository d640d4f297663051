"""Issue 48 item 2: tau logged from inside a training loop equals `scorer eval` on the checkpoint saved at
that step, exactly (transformers' Trainer on CPU with TauCallback; the plain-loop TauScorer); a scorer
failure is said in one line and training goes on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import scorer.watch.callbacks as callbacks_module
from scorer.families.dflash.checkpoint import load_checkpoint
from scorer.families.dflash.model import DFlashDrafter
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.watch.callbacks import TauCallback, TauScorer, speculators_step_callback
from scorer.watch.results import LOG_NAME, read_records

EVAL = dict(ddtree=(8,), limit=2, n_boot=50)


def _module(checkpoint: Path) -> DFlashDrafter:
    loaded = load_checkpoint(checkpoint)
    module = DFlashDrafter(loaded.config)
    module.load_state_dict(loaded.state_dict)
    return module


class _Wrapped(torch.nn.Module):
    """A training model holding the drafter (saved by the Trainer as draft_model.* weights only: not a
    PreTrainedModel); its loss pushes the fc projection along a fixed random direction, enough to move
    the drafts (the projection's scale alone would not: a norm follows it)."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.draft_model = drafter
        self.register_buffer("direction", _direction(drafter), persistent=False)

    def forward(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.draft_model.fc.weight * self.direction).sum() * scale.mean()}


def _direction(drafter: DFlashDrafter) -> torch.Tensor:
    return torch.randn(drafter.fc.weight.shape, generator=torch.Generator().manual_seed(0))


class _Ones(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor(1.0)}


def _same_values(a: dict, b: dict) -> None:
    assert a["metrics"]["tau"] == b["metrics"]["tau"]
    assert a["metrics"]["acceptance"] == b["metrics"]["acceptance"]
    assert a["metrics"]["ddtree"] == b["metrics"]["ddtree"]
    assert a["metrics"]["acceptance_histogram"] == b["metrics"]["acceptance_histogram"]
    assert a["checkpoint_sha256"] == b["checkpoint_sha256"]  # the same weights


def test_transformers_trainer_callback_logs_scorer_eval_values(tmp_path, scorer_cache, trained_drafter):
    pytest.importorskip(
        "accelerate", reason="transformers' Trainer needs accelerate: pip install -e '.[dev]'"
    )
    from transformers import Trainer, TrainingArguments

    shutil.copy(trained_drafter / "config.json", tmp_path / "drafter_config.json")
    eval_config = EvalConfig(config_path=str(tmp_path / "drafter_config.json"), **EVAL)
    lines: list[str] = []
    callback = TauCallback(scorer_cache, every_steps=2, eval_config=eval_config, say=lines.append)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        save_steps=2,
        save_only_model=True,
        per_device_train_batch_size=1,
        learning_rate=0.1,
        max_grad_norm=0.0,  # no clipping: the step must move the drafts
        optim="sgd",
        lr_scheduler_type="constant",
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=_Wrapped(_module(trained_drafter)), args=args, train_dataset=_Ones(), callbacks=[callback]
    )
    trainer.train()
    records = list(read_records(tmp_path / "run-watch" / LOG_NAME))
    assert [(r["step"], r["layout"], r["status"]) for r in records] == [
        (2, "module", "scored"),
        (2, "transformers", "scored"),
        (4, "module", "scored"),
        (4, "transformers", "scored"),
    ]
    for in_memory, saved in ((records[0], records[1]), (records[2], records[3])):
        _same_values(in_memory, saved)
    # training moved the weights (a stale module would log step 2's weights again) and tau with them
    assert records[0]["checkpoint_sha256"] != records[2]["checkpoint_sha256"]
    assert records[0]["metrics"]["tau"] != records[2]["metrics"]["tau"]
    # and the saved checkpoints' records are scorer eval's values on them
    report = evaluate(tmp_path / "run" / "checkpoint-4", scorer_cache, eval_config)
    assert records[3]["metrics"]["tau"] == report["tau"]
    assert {"step": 4, "tau_pooled": records[2]["metrics"]["tau"]["pooled"]} in trainer.state.log_history
    assert (tmp_path / "run-watch" / "tensorboard").is_dir() and lines == []


def test_a_scorer_failure_is_said_and_training_goes_on(tmp_path, scorer_cache, trained_drafter, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory on the scoring device")

    monkeypatch.setattr(callbacks_module, "evaluate_module", broken)
    lines: list[str] = []
    module = _module(trained_drafter)
    with TauScorer(
        scorer_cache, results=tmp_path / "r", eval_config=EvalConfig(**EVAL), say=lines.append
    ) as tau:
        assert tau.score_module(3, module) is None
    assert lines == [
        "scorer: step 3 (module) not scored, training goes on: out of memory on the scoring device"
    ]
    [record] = read_records(tmp_path / "r" / LOG_NAME)
    assert (record["status"], record["step"], record["reason"]) == (
        "refused",
        3,
        "out of memory on the scoring device",
    )


def test_plain_loop_and_speculators_step_callback(tmp_path, scorer_cache, trained_drafter):
    """A plain loop calls TauScorer.score_module; speculators' Trainer calls step_callback() after
    global_step += 1 (speculators/train/trainer.py), read from the trainer object it was given."""
    module = _module(trained_drafter)
    eval_config = EvalConfig(**EVAL)
    tau = TauScorer(scorer_cache, eval_config=eval_config)

    class _SpeculatorsTrainer:  # the two attributes the step callback reads
        global_step = 0
        model = torch.nn.ModuleDict({"draft": module})  # found inside the trainer's model

    trainer = _SpeculatorsTrainer()
    callback = speculators_step_callback(trainer, tau, every_steps=2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    direction = _direction(module)
    for _ in range(4):
        (module.fc.weight * direction).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        trainer.global_step += 1
        callback()
        if trainer.global_step == 2:
            saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    tau.close()
    assert [r["step"] for r in tau.history] == [2, 4]
    # the checkpoint saved at step 2, scored by scorer eval, gives the logged values
    out = tmp_path / "step_2"
    shutil.copytree(trained_drafter, out)
    from safetensors.torch import save_file

    save_file(saved, str(out / "model.safetensors"))
    report = evaluate(out, scorer_cache, eval_config)
    assert tau.history[0]["metrics"]["tau"] == report["tau"]
    assert tau.history[0]["metrics"]["acceptance"]["conditional"] == report["acceptance"]["conditional"]
    assert tau.history[0]["checkpoint_sha256"] == report["checkpoint"]["weights_sha256"]
    assert json.dumps(tau.history[1]["metrics"]["tau"]) != json.dumps(tau.history[0]["metrics"]["tau"])


def test_sinks_without_a_results_folder_are_refused(scorer_cache):
    from scorer.errors import ScorerError

    with pytest.raises(ScorerError, match=r"needs a results folder to write to; pass results="):
        TauScorer(scorer_cache, log_to=("tensorboard",))
