"""``verify --recompute N``: re-run sampled sequences through the target and compare with the cache.

The stored token ids are fed teacher-forced through ``capture_batch`` (the same code path
as extraction), one sequence per forward. With the cache's device, backend and dtype and a
cache built one sequence per forward, the result must be bit-identical (relative error 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.capture.backend import resolve_backend, use_backend
from hscache.capture.forward import capture_batch
from hscache.capture.target import load_target
from hscache.errors import InputError
from hscache.store.compact import SCALE_ARRAY, dequantise_numpy
from hscache.verify.report import Problem, RecomputeResult, VerifyReport
from hscache.verify.scan import as_float32
from hscache.verify.structure import CacheLayout

__all__ = ["recompute_sequences"]


def _relative_error(recomputed: np.ndarray, cached: np.ndarray) -> float | None:
    """||recomputed - cached|| / ||cached|| in float64 (None when either holds NaN/Inf)."""
    a, b = recomputed.astype(np.float64), cached.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), np.finfo(np.float64).tiny))


def recompute_sequences(
    layout: CacheLayout,
    report: VerifyReport,
    count: int,
    model: str | None,
    device: str | None,
    backend: str | None,
    tolerance: float | None,
    seed: int,
) -> None:
    """Re-run ``count`` sequences sampled with ``seed`` and record per-layer relative errors.

    Raises:
        InputError / ModelNotFoundError / BackendUnavailableError: the target cannot be loaded as asked.
    """
    if layout.index is None or not {"hidden_states", "token_ids", "target_argmax"} <= set(layout.arrays):
        return
    settings = layout.manifest["settings"]
    if "dtype" not in settings:
        raise InputError(f"{layout.root} records no extraction settings (dtype); --recompute needs them")
    if settings.get("engine", "transformers") != "transformers" and backend is None:
        raise InputError(
            f"{layout.root} was written by {settings['engine']} (hscache extract --engine {settings['engine']}); "
            "--recompute re-runs the target in transformers, another engine: pass --backend torch to compare "
            "against it anyway (not exact: --tolerance applies), or compare the engines with hscache diff"
        )
    model = model or settings["model"]
    device = device or settings.get("device", "cpu")
    backend = resolve_backend(backend or settings.get("backend", "auto"), device)
    target = load_target(model, settings["dtype"], device)
    if target.weights_sha256 != settings.get("weights_sha256"):
        report.add(
            Problem(
                "recompute",
                f"--model {model} has other weights than the cache's target "
                "(weights_sha256 differs): expect large errors",
            ),
            warning=True,
        )
    exact = (
        device == settings.get("device")
        and backend == settings.get("backend")
        and settings.get("batch_tokens") == 0
        and target.weights_sha256 == settings.get("weights_sha256")
    )
    limit = 0.0 if tolerance is None and exact else (0.02 if tolerance is None else tolerance)
    rng = np.random.default_rng(seed)
    picks = sorted(
        rng.choice(len(layout.offsets), size=min(count, len(layout.offsets)), replace=False).tolist()
    )
    results = []
    with use_backend(target.model, backend):
        for seq in picks:
            result = _one(layout, target, seq)
            if result is None:
                continue
            results.append(result)
            bad = [(lid, e) for lid, e in zip(report.layer_ids, result.rel_error) if e is None or e > limit]
            for layer_id, err in bad:
                report.add(
                    layout.problem(
                        "recompute",
                        f"layer {layer_id} differs from a re-run of the target "
                        f"(relative error {err}, tolerance {limit})",
                        seq,
                        array="hidden_states",
                        layer_id=layer_id,
                    )
                )
    report.recompute = _summary(model, device, backend, exact, limit, results, report.layer_ids)
    report.passed("recompute")


def _one(layout: CacheLayout, target: Any, seq: int) -> RecomputeResult | None:
    start = int(layout.offsets[seq])
    stop = start + int(layout.lengths[seq])
    try:
        ids = np.asarray(layout.arrays["token_ids"][start:stop]).astype(np.int64)
        cached = np.asarray(layout.arrays["hidden_states"][start:stop])
        scales = np.asarray(layout.arrays[SCALE_ARRAY][start:stop]) if "states" in layout.manifest else None
        argmax = np.asarray(layout.arrays["target_argmax"][start:stop])
    except Exception:  # an undecodable chunk: the scan has already named this sequence
        return None
    spec = layout.specs["hidden_states"]
    captured = capture_batch(target, [ids.tolist()], layout.manifest["settings"]["layer_ids"], 1, False)[0]
    hidden = captured.hidden_states.detach().float().cpu().numpy()  # [T, K, H]
    # fp8 states (store/compact.py) are compared as readers get them: their codec's error (~2.5%) is in it.
    cached32 = as_float32(cached, spec.logical_dtype) if scales is None else dequantise_numpy(cached, scales)
    errors = [_relative_error(hidden[:, k], cached32[:, k]) for k in range(hidden.shape[1])]
    agreement = float((captured.argmax.cpu().numpy() == argmax).mean())
    return RecomputeResult(seq, str(layout.record_id(seq)), errors, agreement)


def _summary(
    model: str,
    device: str,
    backend: str,
    exact: bool,
    limit: float,
    results: list[RecomputeResult],
    layer_ids: list[int],
) -> dict[str, Any]:
    worst: list[float | None] = []
    for k in range(len(layer_ids)):
        values = [r.rel_error[k] for r in results]
        worst.append(None if any(v is None for v in values) else max(values, default=0.0))
    return {
        "model": model,
        "device": device,
        "backend": backend,
        "exact_expected": exact,
        "tolerance": limit,
        "max_rel_error": worst,
        "results": [r.to_dict() for r in results],
    }
