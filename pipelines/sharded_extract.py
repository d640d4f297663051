"""Run the N shards of one extraction as dask tasks: one shard per worker (one GPU per worker).

Each task is ``hscache.extract(config with shard=(I, N))`` writing ``OUT/shard-IIIII-of-NNNNN``
(hscache/store/shards.py); the client then checks the shards and writes ``OUT/shards.json``.
``OUT`` must be a directory every worker sees at the same path (a shared filesystem); it, and any
local model or prompts file, is made absolute before it is sent. A killed
shard resumes like any extraction: re-running the pipeline skips committed sequences.

On GPUs, start one worker per GPU with ``--resources GPU=1`` and ``CUDA_VISIBLE_DEVICES`` set per
worker (dask-cuda's ``dask cuda worker`` does both); the tasks then request ``GPU=1`` and use
``--device cuda``.

    python -m pipelines.sharded_extract --out cache/ --shards 4 --scheduler tcp://host:8786 \\
        --device cuda --layers dflash:5
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import hscache
from hscache.capture.extract import ExtractConfig, ExtractResult
from hscache.store.shards import merge_shards
from hscache.store.urls import absolute_location, is_url

__all__ = ["extract_shard", "sharded_extract"]


def extract_shard(config: ExtractConfig) -> ExtractResult:
    """One shard on this worker (runs in the worker process)."""
    if not config.device.startswith("cuda"):
        torch.set_num_threads(
            1
        )  # one core per single-threaded CPU worker; also makes shards bit-reproducible
    result = hscache.extract(config)
    return replace(result, provenance={})  # the provenance stays on disk; keep the reply small


def _absolute_paths(config: ExtractConfig) -> ExtractConfig:
    """``config`` with ``out`` and every local file it names absolute: a worker's working directory
    is not ours, and a relative ``cache/`` there is another directory (a model id, a built-in name or
    a URL stays as it is)."""
    local = {
        name: absolute_location(value)
        for name in ("model", "prompts", "tokens_from", "responses_from")
        if (value := getattr(config, name)) and not is_url(value) and Path(value).exists()
    }
    return replace(config, out=absolute_location(config.out), **local)


def sharded_extract(config: ExtractConfig, shards: int, client: Any) -> list[ExtractResult]:
    """Extract ``config`` as ``shards`` shards on the cluster of ``client`` and check them.

    Returns:
        One ExtractResult per shard, in shard order.

    Raises:
        InputError: ``shards`` < 1 or ``config.shard`` already set.
        Whatever ``hscache.capture.extract`` raises in a worker (re-raised here); CacheFormatError if the
        finished shards disagree.
    """
    if shards < 1 or config.shard is not None:
        raise hscache.InputError(
            f"shards={shards}, config.shard={config.shard}: give shards >= 1 and no config.shard"
        )
    config = _absolute_paths(config)
    resources = {"GPU": 1} if config.device.startswith("cuda") else None
    futures = [
        client.submit(
            extract_shard,
            replace(config, shard=(i, shards)),
            pure=False,
            resources=resources,
            key=f"extract-shard-{i}-of-{shards}",
        )
        for i in range(shards)
    ]
    results = client.gather(futures)
    merge_shards(config.out)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--shards", type=int, required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--scheduler", help="address of a running dask scheduler")
    where.add_argument("--workers", type=int, help="start a local cluster of N worker processes")
    parser.add_argument("--model", default="builtin:tiny-qwen3.5")
    parser.add_argument("--prompts", default="builtin:default")
    parser.add_argument("--layers", default="dflash:3")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    from hscache.cluster import cluster_client

    flags = ("out", "model", "prompts", "layers", "max_new_tokens", "dtype", "device", "limit")
    config = ExtractConfig(**{name: getattr(args, name) for name in flags})
    with cluster_client(scheduler=args.scheduler, workers=args.workers) as client:
        results = sharded_extract(config, args.shards, client)
    for result in results:
        print(
            f"{result.path}: {result.sequences} sequences, {result.tokens} tokens in {result.seconds:.1f} s"
        )


if __name__ == "__main__":
    main()
