"""``hscache info``: what a cache holds, in numbers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hscache import schemas
from hscache.store.integrity import cache_digest
from hscache.store.layout import IMPORTING_MARK
from hscache.store.lock import current_writer
from hscache.store.open import open_cache
from hscache.store.run_log import read_run_log
from hscache.store.sampling import sampling_setting
from hscache.store.shards import has_shards, shard_dirs
from hscache.store.view import CacheView

__all__ = ["INFO_SCHEMA_VERSION", "cache_completeness", "cache_summary", "format_summary"]

INFO_SCHEMA_VERSION = 1  # schemas/cache_info.schema.json


def cache_completeness(cache: CacheView) -> dict[str, Any]:
    """Whether the cache is finished: ``complete``, ``committed_sequences`` and ``expected_sequences``
    (the records its extraction set out to write, from the provenance; None when not recorded),
    and ``writer``: the live process writing it (pid, host, command, started_at), or None."""
    records = ((cache.provenance or {}).get("prompts") or {}).get("records")
    if isinstance(records, int):  # a sampled cache holds samples_per_prompt sequences per record
        records *= sampling_setting(cache).samples_per_prompt
    writer = None
    if not cache.complete and not str(getattr(cache, "url", "")).startswith(("s3://", "gs://")):
        writer = current_writer(cache.path)
    return {
        "complete": bool(cache.complete),
        "committed_sequences": len(cache),
        "expected_sequences": int(records) if isinstance(records, int) else None,
        "writer": writer,
    }


def _state(s: dict[str, Any]) -> str:
    """``complete``, or why not and what to do."""
    if s["complete"]:
        return "complete"
    of = f" of {s['expected_sequences']}" if s.get("expected_sequences") else ""
    committed = f"{s['sequences']}{of} sequences committed"
    writer = s.get("writer")
    if writer is not None:
        who = (
            f"pid {writer.get('pid')} on {writer.get('host')} ({writer.get('command')})"
            if writer
            else "a process"
        )
        return f"INCOMPLETE: {committed}; a writer is running: {who}; wait for it to finish"
    if s.get("interrupted_import"):
        return f"INCOMPLETE: {committed}; an import was interrupted: re-run the same hscache import command"
    return f"INCOMPLETE: {committed}; no writer is running: resume with the same extract command"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _layer_types(prov: dict[str, Any], layer_ids: list[int]) -> list[str | None]:
    """Each cached layer's type as the provenance records it (None where it records none: an imported
    cache, or a layer id past the model's layers)."""
    types = (prov.get("model") or {}).get("layer_types")
    types = types if isinstance(types, list) else []
    return [types[i] if isinstance(i, int) and 0 <= i < len(types) else None for i in layer_ids]


def _imported_from(prov: dict[str, Any]) -> str | None:
    imported = prov.get("imported")
    return f"imported from {imported['format']} files at {imported['source']}" if imported else None


def cache_summary(path: str | os.PathLike, allow_unsealed: bool = False) -> dict[str, Any]:
    """A JSON-ready summary of the cache at ``path`` (schemas/cache_info.schema.json); ``digest`` is
    ``cache_digest``, to pin."""
    cache = open_cache(path, allow_unsealed=allow_unsealed)
    prov = cache.provenance
    roots = shard_dirs(cache.path) if has_shards(cache.path) else [cache.path]
    stored = {name: sum(_dir_bytes(root / "arrays" / name) for root in roots) for name in cache.specs}
    raw = {name: spec.bytes_per_token * cache.num_tokens for name, spec in cache.specs.items()}
    lengths = cache.index.column("length").to_pylist()
    prompt_lens = cache.index.column("prompt_len").to_pylist()
    completeness = cache_completeness(cache)
    summary = {
        "schema_version": INFO_SCHEMA_VERSION,
        "path": str(cache.path),
        "digest": cache_digest(cache),
        "complete": cache.complete,
        # A complete cache holds every file (its completion mark is written last): a mark left
        # beside it by an import killed after that is stale, not an interrupted import.
        "interrupted_import": not cache.complete and (Path(cache.path) / IMPORTING_MARK).is_file(),
        "expected_sequences": completeness["expected_sequences"],
        "writer": completeness["writer"],
        "sequences": len(cache),
        "tokens": cache.num_tokens,
        "generated_tokens": sum(lengths) - sum(prompt_lens),
        "layer_ids": cache.layer_ids,
        "layer_types": _layer_types(prov, cache.layer_ids),
        "dtype": cache.settings.get("dtype"),
        "backend": cache.settings.get("backend"),
        "kernels": {k: v["backend"] for k, v in prov.get("capture", {}).get("kernels", {}).items()},
        "device": cache.settings.get("device"),
        "model": cache.settings.get("model") or _imported_from(prov),
        "mask_token_id": cache.mask_token_id,
        # the target's own MTP head in target/mtp.safetensors (score it as CKPT target:mtp)
        "mtp_head": bool(cache.settings.get("mtp")),
        "compression": cache.manifest["compression"],
        "states": _states_summary(cache.manifest),
        "bytes_on_disk": _dir_bytes(cache.path),
        "arrays": {
            name: {
                **spec.to_dict(),
                "stored_bytes": stored[name],
                "compression_ratio": round(raw[name] / stored[name], 3)
                if stored[name] and raw[name]
                else None,
            }
            for name, spec in cache.specs.items()
        },
        "bytes_per_token": round(sum(stored.values()) / cache.num_tokens, 1) if cache.num_tokens else None,
        "runs": sum(len(read_run_log(root)) for root in roots),
        "sampling": _sampling_summary(cache, prov),
    }
    schemas.validate(summary, "cache_info")
    return summary


def _sampling_summary(cache: CacheView, prov: dict[str, Any]) -> dict[str, Any]:
    """The setting (greedy: temperature 0) and, once complete, the realised-token counts."""
    setting = sampling_setting(cache)
    counts = prov.get("sampling") or {}
    return {
        **setting.to_dict(),
        "greedy": setting.greedy,
        "description": setting.describe(),
        "sampled_positions": counts.get("sampled_positions"),
        "realised_outside_support": counts.get("realised_outside_support"),
    }


def _sampling_line(s: dict[str, Any]) -> str:
    if s["greedy"]:
        return s["description"]
    if s["sampled_positions"] is None:
        return f"{s['description']}; realised tokens counted when the extraction completes"
    return (
        f"{s['description']}; {s['realised_outside_support']} of {s['sampled_positions']} drawn tokens "
        "outside the stored support"
    )


def _kernels(kernels: dict[str, str]) -> str:
    """``kernel=backend`` pairs, grouped by backend: ``kernels torch (4: causal_conv1d_fn, ...)``."""
    if not kernels:
        return ""
    by_backend: dict[str, list[str]] = {}
    for name, backend in sorted(kernels.items()):
        by_backend.setdefault(backend, []).append(name)
    return "; kernels " + "; ".join(f"{b}: {', '.join(names)}" for b, names in sorted(by_backend.items()))


def _storage(s: dict[str, Any]) -> str:
    """Bytes on disk, and per token and the compression ratio explained where they are printed."""
    hidden = s["arrays"]["hidden_states"]
    ratio = hidden["compression_ratio"]
    size = f"{s['bytes_on_disk'] / 2**20:.2f} MiB on disk, {s['compression']} compression"
    if not s["tokens"] or s["bytes_per_token"] is None:
        return f"{size}, no tokens yet (no per-token figure), chunk {hidden['chunk_tokens']} tokens"
    padded = (
        " (under 1: the last chunk is stored whole, mostly padding)"
        if ratio is not None and ratio < 1
        else ""
    )
    return (
        f"{size}, {s['bytes_per_token']:g} B/token (every array's bytes on disk / committed tokens), "
        f"hidden states x{ratio} (raw bytes / bytes on disk){padded}, chunk {hidden['chunk_tokens']} tokens"
    )


def _pin_advice(s: dict[str, Any]) -> str:
    """Pin a digest only when it is final: a complete cache nobody is writing."""
    if s["complete"] and s.get("writer") is None:
        return "pin it: scorer eval/hscache verify --expect-digest"
    if s.get("writer") is not None:
        return "not final, do not pin: a writer is adding to the cache; pin the digest once it is complete"
    return "not final, do not pin: the cache is incomplete and changes when it is finished"


def _states_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the hidden states are stored as (store/compact.py) and the dtype readers get."""
    from hscache.store.compact import is_compact, states_dtype

    if not is_compact(manifest):
        return {"codec": "source", "read_as": states_dtype(manifest), "exact_sequences": 0}
    exact = manifest["states"]["exact"]
    return {"codec": "fp8", "read_as": states_dtype(manifest), "exact_sequences": len(exact["rows"])}


def _states_line(s: dict[str, Any]) -> str:
    states = s.get("states") or {"codec": "source"}
    if states["codec"] == "source":
        return "source dtype (lossless)"
    return (
        f"fp8 e4m3fn + a float32 scale per token and layer, read as {states['read_as']}; exact slice: "
        f"{states['exact_sequences']} sequences at {states['read_as']} (scorer eval reports the drift)"
    )


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text lines (``hscache info``)."""
    runs = s.get("runs") or 0
    lines = [
        f"cache      {s['path']} ({_state(s)})",
        f"model      {s['model']}",
        f"sequences  {s['sequences']}  tokens {s['tokens']} ({s['generated_tokens']} generated)",
        f"layers     {s['layer_ids']}  types {s['layer_types']}",
        f"dtype      {s['dtype']} on {s['device']}, backend {s['backend']}{_kernels(s['kernels'])}",
        f"storage    {_storage(s)}",
        f"states     {_states_line(s)}",
        f"mask id    {s['mask_token_id']}",
        f"mtp head   {'stored (scorer eval target:mtp)' if s.get('mtp_head') else 'none'}",
        f"runs       {runs} in runs.json (when, where, versions; outside the digest)"
        if runs
        else "runs       none recorded (written before the run log)",
        f"sampling   {_sampling_line(s['sampling'])}",
        f"digest     {s['digest']}  ({_pin_advice(s)})",
    ]
    return "\n".join(lines)
