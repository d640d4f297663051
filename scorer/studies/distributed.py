"""Score on a dask.distributed cluster: the same report as ``evaluate``, split into tasks.

Named steps: plan tasks (contiguous row ranges of about ``tokens_per_task`` tokens, so each
task has far more work than dask's per-task cost; spec/storage.md "dask") -> submit one task
per range -> each worker loads the drafter and target head once per checkpoint (a small
per-process LRU) and reads its rows straight from the store with one slice per array -> the
client merges the ``SequenceResult``s in row order and builds the report with ``build_report``.

Only paths, settings and row ranges travel to workers, and only small ``SequenceResult``s come
back: hidden states never pass through the scheduler. Workers therefore need the cache and
the checkpoint at the same path (a shared filesystem) or URL (s3://...). Paths leave the client
absolute (a worker's working directory is not the client's: ``cache/`` there is another cache),
and each worker checks that the cache it opened has the client's digest before scoring a row.

    >>> with hscache.cluster.cluster_client(workers=2) as client:                               # doctest: +SKIP
    ...     report = evaluate_distributed("drafter/", "cache/", EvalConfig(), client)
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hscache
from hscache.store.integrity import cache_digest, check_expected_digest
from hscache.store.row_ranges import RowRangeView, check_other_arrays, plan_row_ranges, read_rows
from hscache.store.urls import absolute_location, is_url
from scorer.errors import ScorerError
from scorer.offline.scoring import EvalConfig, effective_config, load_drafter, score_rows
from scorer.offline.sequences import SequenceResult
from scorer.report.build import build_report, merge_results
from scorer.studies.exact_slice import with_exact_slice

__all__ = [
    "DEFAULT_TASK_TOKENS",
    "ScoringJob",
    "TaskOutput",
    "TaskSpec",
    "evaluate_distributed",
    "plan_tasks",
    "score_task",
    "submit_scoring",
]

# Tokens per task. One tiny-drafter sequence of ~100 tokens scores in ~0.1-0.5 s on one core, so
# 2048 tokens is seconds of work: dask's ~5-15 ms per task is well under 5% (bench/scale.py).
DEFAULT_TASK_TOKENS = 2048
_MAX_DRAFTERS = 2  # per worker: the current checkpoint and the next one of a sweep
_MAX_CACHES = 4


def plan_tasks(lengths: Sequence[int], tokens_per_task: int = DEFAULT_TASK_TOKENS) -> list[range]:
    """Contiguous row ranges of about ``tokens_per_task`` tokens each (see ``hscache.store.row_ranges.plan_row_ranges``)."""
    return plan_row_ranges(lengths, tokens_per_task)


def checkpoint_fingerprint(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the checkpoint's files: a worker reloads when any changes."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple(
        (str(p.relative_to(path) if path.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns)
        for p in files
        if p.exists()
    )


@dataclass(frozen=True)
class TaskSpec:
    """What one task needs: paths and settings, never data."""

    checkpoint: str
    fingerprint: tuple[tuple[str, int, int], ...]
    cache: str
    cache_tokens: int  # the committed size the client saw: a grown cache is reopened
    config: EvalConfig
    start: int
    stop: int
    cache_digest: str | None = None  # the client's: a worker that opened another cache refuses


@dataclass
class TaskOutput:
    """A task's results plus what the benchmark and the report need from the worker."""

    results: list[SequenceResult]
    seconds: float  # scoring time inside the task (excludes the one-time drafter load)
    load_seconds: float  # drafter load time on this call (0 when the worker had it)
    loaded_drafter: bool  # True when this task loaded the drafter (the worker did not have it yet)
    backend_used: str | None
    peak_rss_mb: float  # the worker process's peak resident memory so far
    pid: int


_CACHES: OrderedDict[tuple[str, int], Any] = OrderedDict()
_DRAFTERS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def _lru_get(table: OrderedDict, key: Any, limit: int, make: Callable[[], Any]) -> tuple[Any, bool]:
    if key in table:
        table.move_to_end(key)
        return table[key], False
    value = make()
    table[key] = value
    while len(table) > limit:
        table.popitem(last=False)
    return value, True


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


_malloc_tuned = False


def _tune_malloc() -> None:
    """Undo what dask's nanny does to glibc malloc in workers, once per process.

    The nanny sets MALLOC_TRIM_THRESHOLD_=65536, which also freezes glibc's mmap threshold at
    128 KiB: every activation tensor above it is then mmapped and unmapped on each allocation,
    measured 1.4-2x slower scoring (bench/scale.py). Large thresholds restore the default speed.
    """
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (glibc's maximum on 64-bit)
    except (OSError, AttributeError):
        pass  # not glibc (e.g. musl): nothing to undo


def _check_same_cache(cache: Any, spec: TaskSpec) -> None:
    """Refuse to score when this worker's cache at ``spec.cache`` is not the one the client opened.

    Raises:
        ScorerError: the digests differ (another machine's copy, a relative path, a changed cache).
    """
    if spec.cache_digest is None:
        return
    digest = cache_digest(cache)
    if digest != spec.cache_digest:
        raise ScorerError(
            f"worker {socket.gethostname()} (pid {os.getpid()}) opened {spec.cache} with digest "
            f"{digest[:16]}..., but the client's cache there has digest {spec.cache_digest[:16]}...: the "
            "workers must see the same cache at the same path (a shared filesystem) or URL (s3://...)"
        )


def score_task(spec: TaskSpec) -> TaskOutput:
    """Score rows ``spec.start..spec.stop`` on this worker (runs in the worker process)."""
    _tune_malloc()
    torch.set_num_threads(1)  # one torch thread per single-threaded dask worker (spec/storage.md)
    t0 = time.perf_counter()
    cache, _ = _lru_get(
        _CACHES,
        (spec.cache, spec.cache_tokens),
        _MAX_CACHES,
        lambda: hscache.open_cache(spec.cache, allow_unsealed=spec.config.allow_unsealed),
    )
    _check_same_cache(cache, spec)
    key = (
        spec.checkpoint,
        spec.fingerprint,
        spec.cache,
        spec.cache_tokens,
        json.dumps(spec.config.to_dict(), sort_keys=True),
    )
    (drafter, _loaded), loaded_now = _lru_get(
        _DRAFTERS, key, _MAX_DRAFTERS, lambda: load_drafter(spec.checkpoint, cache, spec.config)
    )
    t1 = time.perf_counter()
    rows = range(spec.start, spec.stop)
    view = RowRangeView(cache, read_rows(cache, rows))
    check_other_arrays(cache, rows)  # as evaluate does: the report's digest vouches for these rows
    with torch.inference_mode():
        results = score_rows(drafter, view, rows, effective_config(drafter, spec.config))
    return TaskOutput(
        results,
        time.perf_counter() - t1,
        t1 - t0,
        loaded_now,
        drafter.backend_used,
        _peak_rss_mb(),
        os.getpid(),
    )


@dataclass
class ScoringJob:
    """Submitted tasks of one (checkpoint, cache) pair; ``collect`` waits and builds the report."""

    checkpoint: str
    cache_path: str
    config: EvalConfig
    futures: list[Any]
    started: float
    sequences: int = 0  # scored by the tasks (progress)

    def outputs(self, on_output: Callable[[TaskOutput], None] | None = None) -> list[TaskOutput]:
        from distributed import as_completed

        outputs = []
        for future in as_completed(self.futures):
            output = future.result()  # re-raises the worker's exception (e.g. IncompatibleCacheError)
            outputs.append(output)
            if on_output:
                on_output(output)
        return outputs

    def collect(self, on_sequence: Callable[[SequenceResult], None] | None = None) -> dict[str, Any]:
        """Wait for every task; the report equals ``evaluate``'s for the same inputs (timings aside)."""
        cache = hscache.open_cache(self.cache_path, allow_unsealed=self.config.allow_unsealed)
        drafter, loaded = load_drafter(self.checkpoint, cache, self.config)

        def progress(output: TaskOutput) -> None:
            for result in output.results if on_sequence else ():
                on_sequence(result)

        outputs = self.outputs(progress)
        backends = {o.backend_used for o in outputs if o.backend_used}
        drafter.backend_used = "+".join(sorted(backends)) or None
        results = merge_results([r for o in outputs for r in o.results])
        config = effective_config(drafter, self.config)
        report = build_report(
            results,
            cache=cache,
            drafter=drafter,
            loaded=loaded,
            config=config,
            seconds=time.perf_counter() - self.started,
        )
        # A compact cache's exact slice (1 sequence in 64) is scored here, as the workers scored the rest.
        return with_exact_slice(report, drafter, cache, config, results, None, score_rows)


def submit_scoring(
    client: Any,
    checkpoint: str | Path,
    cache_path: str | Path,
    config: EvalConfig = EvalConfig(),
    tokens_per_task: int = DEFAULT_TASK_TOKENS,
) -> ScoringJob:
    """Submit the tasks of one checkpoint on one cache without waiting (a sweep submits many)."""
    started = time.perf_counter()
    cache = hscache.open_cache(cache_path, allow_unsealed=config.allow_unsealed)
    check_expected_digest(cache, config.expect_digest, str(cache_path))
    where = absolute_location(checkpoint), absolute_location(cache_path)  # what the workers open
    n = len(cache) if config.limit is None else min(config.limit, len(cache))
    lengths = np.asarray(cache.index.column("length").to_numpy())[:n]
    fingerprint = checkpoint_fingerprint(checkpoint) if not is_url(checkpoint) else ()
    digest = cache_digest(cache)
    specs = [
        TaskSpec(where[0], fingerprint, where[1], cache.num_tokens, config, r.start, r.stop, digest)
        for r in plan_tasks(lengths, tokens_per_task)
    ]
    futures = [client.submit(score_task, spec, pure=False) for spec in specs]
    return ScoringJob(str(checkpoint), str(cache_path), config, futures, started, n)


def evaluate_distributed(
    checkpoint: str | Path,
    cache_path: str | Path,
    config: EvalConfig = EvalConfig(),
    client: Any = None,
    tokens_per_task: int = DEFAULT_TASK_TOKENS,
    on_sequence: Callable[[SequenceResult], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """``evaluate`` on a dask cluster: identical report (all numbers) for the same inputs.

    Args:
        client: a ``distributed.Client`` (see ``cluster_client``).
        tokens_per_task: work per task; smaller gives more parallelism, larger less overhead.
        on_start / on_sequence: progress, as ``evaluate`` calls them.

    Raises:
        ScorerError: no client; any error ``evaluate`` raises (re-raised from the worker).
    """
    if client is None:
        raise ScorerError(
            "evaluate_distributed needs a dask client; use cluster_client(scheduler=..., workers=...)"
        )
    job = submit_scoring(client, checkpoint, cache_path, config, tokens_per_task)
    if on_start is not None:
        on_start(job.sequences)
    return job.collect(on_sequence)
