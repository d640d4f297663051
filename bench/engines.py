"""Extraction with each engine, side by side: transformers vs vLLM on the same prompts, target, machine.

Prints, from one run of each (a shared machine moves single runs; read ratios, not absolutes):
  1. tokens/s of ``hscache extract`` per engine: wall and CPU time of the whole call (target load,
     generation, capture, writing), and for vLLM also without its engine start
  2. bytes written per token: the cache (every array, the store's own metadata) against vLLM's
     per-request safetensors files for the same sequences (``--connector-dir``: hidden states and
     token ids only)

Runs in vLLM's interpreter (transformers runs there too):

    PYTHONPATH=. .vllm/bin/python bench/engines.py [--model builtin:tiny-qwen3] [--dtype fp32]
        [--prompts builtin:default] [--max-new-tokens 32] [--limit N] [--layers 1,3,7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import hscache
from hscache.capture.extract import ExtractConfig, extract


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(config: ExtractConfig) -> dict:
    wall, cpu = time.perf_counter(), _cpu_s()
    result = extract(config)
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    out = Path(config.out)
    return {
        "engine": config.engine,
        "tokens": result.tokens,
        "sequences": result.sequences,
        "wall_s": wall,
        "cpu_s": cpu,
        "engine_start_s": result.engine_start_s,
        "tokens_per_s": result.tokens / wall,
        "tokens_per_cpu_s": result.tokens / cpu,
        "tokens_per_s_after_engine_start": result.tokens / (wall - result.engine_start_s),
        "cache_bytes_per_token": _size(out) / result.tokens,
        "hidden_bytes_per_token": _size(out / "arrays" / "hidden_states") / result.tokens,
        # what each token adds once chunks fill (compression none): every array's row, by name
        "array_bytes_per_token": {n: s.bytes_per_token for n, s in hscache.open_cache(out).specs.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-qwen3")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompts", default="builtin:default")
    parser.add_argument("--layers", default="1,3,7")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cuda: both engines on the GPU (bench/gpu_check.sh)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    try:
        flags = ("model", "prompts", "layers", "max_new_tokens", "dtype", "limit", "device")
        common = {**{name: getattr(args, name) for name in flags}, "mtp": False}
        runs = [_run(ExtractConfig(out=str(root / "tf"), **common))]
        files = root / "connector"
        runs.append(
            _run(ExtractConfig(out=str(root / "vllm"), engine="vllm", connector_dir=str(files), **common))
        )
        runs[1]["connector_bytes_per_token"] = _size(files) / runs[1]["tokens"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tf, vl = runs
    print(f"{args.model} {args.dtype}, {tf['sequences']} sequences, {tf['tokens']} / {vl['tokens']} tokens")
    for r in runs:
        print(
            f"  {r['engine']:>12}: {r['tokens_per_s']:8.1f} tokens/s wall, {r['tokens_per_cpu_s']:8.1f} tokens/CPU-s "
            f"({r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} CPU-s; engine start {r['engine_start_s']:.1f} s)"
        )
    print(f"  vllm after its engine start: {vl['tokens_per_s_after_engine_start']:.1f} tokens/s wall")
    print(f"  tokens/s vllm / transformers: {vl['tokens_per_s'] / tf['tokens_per_s']:.2f} (wall)")
    rows = vl["array_bytes_per_token"]
    print(
        f"  bytes per token, steady state: cache {sum(rows.values())} ("
        + ", ".join(f"{n} {b}" for n, b in rows.items())
        + f") vs vLLM's files {vl['connector_bytes_per_token']:.0f} on disk (hidden states + int64 ids + header); "
        f"ratio {sum(rows.values()) / vl['connector_bytes_per_token']:.2f}"
    )
    print(
        f"  bytes per token on disk, this run: cache {vl['cache_bytes_per_token']:.0f} (target/ head and "
        f"tokenizer, whole chunks: fixed costs of a small cache; hidden states {vl['hidden_bytes_per_token']:.0f})"
    )
    document = {"config": vars(args), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2))
    return document


if __name__ == "__main__":
    main()
