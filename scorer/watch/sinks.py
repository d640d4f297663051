"""Where scored records go besides the log: TensorBoard event files (the default), W&B, trackio, MLflow.

Each record becomes a set of scalars at its training step (``scalars``); a sink asked for and not
installed is refused before anything is scored, in one line naming the pip command. TensorBoard is
written with ``torch.utils.tensorboard.SummaryWriter`` (it needs the ``tensorboard`` package:
``pip install 'hscache[watch]'``), to ``<results>/tensorboard/``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scorer.errors import ScorerError

__all__ = ["SINKS", "Sinks", "check_sinks", "scalars"]

SINKS = ("tensorboard", "wandb", "trackio", "mlflow")
_MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
_PIP = {
    "tensorboard": "pip install 'hscache[watch]' (or pip install tensorboard)",
    "wandb": "pip install wandb",
    "trackio": "pip install trackio",
    "mlflow": "pip install mlflow",
}
_NAME = re.compile(r"[^A-Za-z0-9_./-]+")  # what every sink accepts in a metric name (MLflow is strictest)


def check_sinks(names: Sequence[str]) -> None:
    """Refuse a sink this package does not write or one whose library is not installed.

    Raises:
        ScorerError: one line, naming the sink and the pip command that installs it.
    """
    for name in names:
        if name not in SINKS:
            raise ScorerError(
                f"--log-to {name}: not a sink scorer watch writes; choose from {', '.join(SINKS)}"
            )
        if importlib.util.find_spec(_MODULE[name]) is None:
            raise ScorerError(
                f"--log-to {name}: {name} is not installed; {_PIP[name]}, or leave it out of --log-to"
            )


def _put(out: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out[_NAME.sub("_", name)] = float(value)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a scored record, named ``tau/pooled``, ``acceptance/slot_3``, ``ddtree/8``,
    ``tau_category/<name>``, ``tau_context/<start>-<stop>``, ... (None values left out)."""
    m, out = record["metrics"], {}
    for key in ("per_request", "pooled"):
        _put(out, f"tau/{key}", m["tau"][key])
        interval = m["tau"][f"{key}_ci95"]
        if interval:
            _put(out, f"tau/{key}_ci95_lo", interval[0])
            _put(out, f"tau/{key}_ci95_hi", interval[1])
    for j, (cond, uncond) in enumerate(
        zip(m["acceptance"]["conditional"], m["acceptance"]["unconditional"]), 1
    ):
        _put(out, f"acceptance/slot_{j}", cond)
        _put(out, f"acceptance_unconditional/slot_{j}", uncond)
    _put(out, "train_accept_len", m["train_accept_len"])
    for budget, block in m["ddtree"].items():
        _put(out, f"ddtree/{budget}", block["per_request"])
    for name, block in m["per_category"].items():
        _put(out, f"tau_category/{name}", block["tau_per_request"])
    for bucket in m["context_length"] or ():
        stop = "" if bucket["stop"] is None else bucket["stop"]
        _put(out, f"tau_context/{bucket['start']}-{stop}", bucket["tau_pooled"])
    histogram = m["acceptance_histogram"]
    if histogram and sum(histogram["total"]):
        for j, count in enumerate(histogram["total"]):
            _put(out, f"accepted_drafts/{j}", count / sum(histogram["total"]))
    for mode, block in (m["served"] or {}).items():
        if block:
            _put(out, f"served/{mode}", block["tau"])
    return out


class Sinks:
    """The sinks of one watch (or callback), opened once; ``log(record)`` writes a scored record's
    scalars at its step; ``close()`` flushes them."""

    def __init__(self, names: Sequence[str], folder: str | Path, run_name: str):
        check_sinks(names)
        self._writers: list[Any] = []
        self.names = tuple(names)
        for name in names:
            self._writers.append(_OPEN[name](Path(folder), run_name))

    def log(self, record: dict[str, Any]) -> None:
        if record["status"] != "scored" or record["step"] is None:
            return
        values = scalars(record)
        for writer in self._writers:
            writer.log(record["step"], values)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []


class _TensorBoard:
    def __init__(self, folder: Path, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a dashboard reading the folder sees each checkpoint as it is scored

    def close(self) -> None:
        self.writer.close()


class _WandbLike:
    """W&B and trackio (trackio copies wandb's init / log / finish)."""

    def __init__(self, module: str, folder: Path, run_name: str):
        self.lib = importlib.import_module(module)
        kwargs = {"dir": str(folder)} if module == "wandb" else {}
        self.run = self.lib.init(project="scorer-watch", name=run_name, **kwargs)

    def log(self, step: int, values: dict[str, float]) -> None:
        # the training step as a metric, not wandb's own step: a restarted watch may log an older step
        self.lib.log({"train/step": step, **values})

    def close(self) -> None:
        self.lib.finish()


class _MLflow:
    def __init__(self, folder: Path, run_name: str):
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN = {
    "tensorboard": _TensorBoard,
    "wandb": lambda folder, name: _WandbLike("wandb", folder, name),
    "trackio": lambda folder, name: _WandbLike("trackio", folder, name),
    "mlflow": _MLflow,
}
