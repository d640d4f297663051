"""Scaling benchmark of dask scoring and the reader: ratios measured in one run.

Prints:
  1. scoring throughput: 1 vs 2 dask workers (and 1 worker vs one process), tokens/s
  2. per-task scheduling overhead as a share of task time at the task size used (target < 5%)
  3. a worker's peak memory while scoring a cache and one 4x larger (should be flat)
  4. the reader's full-scan throughput / a raw memmap of the same bytes (target >= 0.8),
     cold (page cache dropped with posix_fadvise) and warm

The caches are synthetic (random hidden states, the template cache's target and settings), so
sizes are free; scoring work per token is what a real cache of that length costs.

    python bench/scale.py [--sequences 64] [--length 256] [--scheduler ADDR] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

# Run as `python bench/scale.py`, bench/ is sys.path[0], and bench/scorer.py would shadow the
# scorer package: import the packages, never the sibling scripts.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# bench/common.py, loaded by path (bench/ is off sys.path)
common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))

import numpy as np
import torch

import hscache
from hscache.cluster import cluster_client
from hscache.store.fsio import drop_page_cache
from hscache.store.writer import SequenceRows, StoreWriter
from scorer.families.dflash.init import init_dflash
from scorer.studies.distributed import DEFAULT_TASK_TOKENS, TaskOutput, score_task
from scorer.studies.evaluate import EvalConfig, evaluate

CONFIG = EvalConfig(ddtree=(8,), n_boot=10)


def _rows(spec, length: int, rng: np.random.Generator, vocab: int, tokens: np.ndarray) -> np.ndarray:
    shape = (length, *spec.row_shape)
    if spec.name in ("token_ids",):
        return tokens
    if spec.name == "target_argmax":
        return np.append(tokens[1:], tokens[-1]).astype(np.int32)  # the text follows the target's greedy path
    if spec.stored_dtype == "int32":
        return rng.integers(0, vocab, shape, dtype=np.int32)
    values = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    if spec.logical_dtype == "bfloat16":
        return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return values.numpy().astype(spec.stored_dtype)


def synthetic_cache(
    template: hscache.Cache,
    out: Path,
    sequences: int,
    length: int,
    seed: int = 0,
    compression: str | None = None,
) -> Path:
    """A cache with ``template``'s target, settings and arrays, holding random sequences."""
    rng = np.random.default_rng(seed)
    vocab = int(template.target_head()["embed_tokens"].shape[0])
    writer = StoreWriter.create(
        out, template.specs, compression or template.manifest["compression"], template.settings
    )
    for i in range(sequences):
        tokens = rng.integers(0, vocab, length, dtype=np.int32)
        arrays = {name: _rows(spec, length, rng, vocab, tokens) for name, spec in template.specs.items()}
        writer.append(
            SequenceRows(
                arrays,
                f"s{i}",
                length // 4,
                "length",
                hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest(),
                "{}",
            )
        )
    writer.finish()
    shutil.copytree(template.path / "target", out / "target")
    writer.record_files(["target"])  # the seal covers every file (store/integrity.py)
    return out


def _run(
    client, drafter: Path, cache: Path, tokens_per_task: int, workers: list[str] | None
) -> tuple[float, list[TaskOutput]]:
    """Wall seconds and outputs of scoring ``cache``; ``workers`` pins the tasks ("1 worker" on 2)."""
    specs = _specs(drafter, cache, tokens_per_task)
    t0 = time.perf_counter()
    futures = [
        client.submit(score_task, spec, pure=False, workers=workers, allow_other_workers=False)
        for spec in specs
    ]
    outputs = client.gather(futures)
    return time.perf_counter() - t0, outputs


def _specs(drafter: Path, cache: Path, tokens_per_task: int):
    from scorer.studies.distributed import TaskSpec, checkpoint_fingerprint, plan_tasks

    c = hscache.open_cache(cache)
    lengths = np.asarray(c.index.column("length").to_numpy())
    return [
        TaskSpec(
            str(drafter), checkpoint_fingerprint(drafter), str(cache), c.num_tokens, CONFIG, r.start, r.stop
        )
        for r in plan_tasks(lengths, tokens_per_task)
    ]


def throughput(client, drafter: Path, cache: Path, tokens_per_task: int) -> None:
    tokens = hscache.open_cache(cache).num_tokens
    names = sorted(client.scheduler_info()["workers"])
    _run(client, drafter, cache, tokens_per_task, None)  # warm: every worker loads the drafter once
    one_s, outputs = _run(client, drafter, cache, tokens_per_task, names[:1])
    two_s, both = _run(client, drafter, cache, tokens_per_task, None)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    evaluate(drafter, cache, CONFIG)
    single_s = time.perf_counter() - t0
    print(f"scoring: {tokens} tokens in {len(outputs)} tasks of ~{tokens_per_task} tokens")
    print(
        f"  one process {tokens / single_s:,.0f} tok/s, 1 worker {tokens / one_s:,.0f} tok/s, "
        f"{len(names)} workers {tokens / two_s:,.0f} tok/s"
    )
    print(
        f"throughput ratio {len(names)} workers / 1 worker: {one_s / two_s:.2f}x "
        f"(1 worker / one process: {single_s / one_s:.2f}x; {os.cpu_count()} cores)"
    )
    per_worker = sorted(sum(1 for o in both if o.pid == pid) for pid in {o.pid for o in both})
    print(
        f"  {len(names)} workers: tasks per worker {per_worker}, in-task time {sum(o.seconds for o in both):.2f} s "
        f"vs {sum(o.seconds for o in outputs):.2f} s on 1 worker (more: the workers slow each other down)"
    )
    in_task = sum(o.seconds + o.load_seconds for o in outputs)
    share = (one_s - in_task) / in_task
    print(
        f"scheduling overhead per task: {(one_s - in_task) / len(outputs) * 1e3:.1f} ms = {share:.1%} of task time "
        f"({in_task / len(outputs) * 1e3:.0f} ms/task; target < 5%)"
    )


def _peak_during(spec_list) -> tuple[float, float]:
    """(RSS before, peak RSS while scoring ``spec_list`` one after another) in MiB; runs on a worker."""
    import psutil

    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    before = process.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    for spec in spec_list:
        score_task(spec)
    done.set()
    thread.join()
    return before / 2**20, max(peak[0], before) / 2**20


def memory(client, drafter: Path, small: Path, large: Path, tokens_per_task: int) -> None:
    worker = sorted(client.scheduler_info()["workers"])[:1]
    run = lambda cache: client.submit(
        _peak_during,
        _specs(drafter, cache, tokens_per_task),
        pure=False,
        workers=worker,
        allow_other_workers=False,
    ).result()
    run(small)  # warm: drafter and target head loaded
    results = {}
    for name, cache in (("1x", small), ("4x", large)):
        results[name] = run(cache)
        size = sum(p.stat().st_size for p in (cache / "arrays").rglob("*") if p.is_file()) / 2**20
        print(
            f"worker memory, {name} cache ({size:.1f} MiB on disk): rss before {results[name][0]:.0f} MiB, "
            f"peak {results[name][1]:.0f} MiB"
        )
    growth = results["4x"][1] - results["1x"][1]
    print(f"peak memory 4x cache - 1x cache: {growth:+.1f} MiB (flat: bounded by drafter + a few chunks)")


def scan(cache_path: Path, tmp: Path, repeats: int) -> None:
    """Full scan of ``hidden_states``: the reader (``Cache.iter_tokens``, chunk files read directly)
    and zarr-python's own slicing, each against a raw memmap of the same bytes; then random reads
    of single sequences against a raw pread of the same bytes."""
    copy = common.RawCopy(cache_path, tmp)
    cache, array, n, step, raw = copy.cache, copy.array, copy.n, copy.step, copy.raw

    def zarr_path() -> None:
        for a in range(0, n, step):
            np.asarray(array[a : min(n, a + step)])

    for label, drop in (("cold", True), ("warm", False)):
        best = {"reader": float("inf"), "zarr": float("inf"), "memmap": float("inf")}
        for _ in range(repeats):
            for name, fn in (("reader", copy.reader), ("zarr", zarr_path), ("memmap", copy.memmap)):
                if drop:
                    drop_page_cache(copy.files + [raw])
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        print(
            f"full scan {label}, --compression {copy.compression}: reader {copy.nbytes / best['reader'] / 1e6:,.0f} MB/s, "
            f"raw memmap {copy.nbytes / best['memmap'] / 1e6:,.0f} MB/s; reader/memmap ratio {best['memmap'] / best['reader']:.2f} "
            f"(target >= 0.8; zarr-python slicing {best['memmap'] / best['zarr']:.2f})"
        )
    random_reads(cache, raw, repeats)


def random_reads(cache: hscache.Cache, raw: Path, repeats: int) -> None:
    """Warm random access: ``cache.hidden_states(i)`` (decodes the chunks covering sequence i) vs
    a raw pread of the same bytes (no decode, no checksum), and zarr-python's slicing."""
    offsets = np.asarray(cache.index.column("offset").to_numpy())
    lengths = np.asarray(cache.index.column("length").to_numpy())
    array = cache.array("hidden_states")
    row_bytes = int(np.prod(array.shape[1:])) * array.dtype.itemsize
    order = np.random.default_rng(0).permutation(len(cache))[:64]
    fd = os.open(raw, os.O_RDONLY)

    def pread() -> None:
        for i in order:
            os.pread(fd, int(lengths[i]) * row_bytes, int(offsets[i]) * row_bytes)

    def reader() -> None:
        for i in order:
            cache.hidden_states(int(i))

    def zarr_path() -> None:
        for i in order:
            np.asarray(array[int(offsets[i]) : int(offsets[i] + lengths[i])])

    best = {"pread": float("inf"), "reader": float("inf"), "zarr": float("inf")}
    try:
        for _ in range(repeats + 1):  # the first round warms the page cache
            for name, fn in (("pread", pread), ("reader", reader), ("zarr", zarr_path)):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        os.close(fd)
    per = {k: v / len(order) * 1e3 for k, v in best.items()}
    print(
        f"random sequence reads, warm ({int(lengths[order].mean())} tokens, {array.chunks[0]}-token chunks): "
        f"hidden_states(i) {per['reader']:.2f} ms, raw pread {per['pread']:.2f} ms, zarr-python {per['zarr']:.2f} ms; "
        f"pread/reader ratio {per['pread'] / per['reader']:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--tokens-per-task", type=int, default=DEFAULT_TASK_TOKENS)
    parser.add_argument(
        "--template", default=None, help="a cache whose target and settings to copy (default: extract one)"
    )
    parser.add_argument(
        "--scheduler", default=None, help="a running scheduler with 2 workers (default: start one)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    args = parser.parse_args(argv)
    if args.quick:
        # small: 2 tasks, one per worker; the 4x caches: 2 chunks of 256 tokens, so the scans cross one
        args.sequences, args.length, args.tokens_per_task = 2, 64, 64
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        template = args.template
        if template is None:
            template = str(tmp / "template")
            hscache.extract(
                hscache.ExtractConfig(out=template, layers="1,3,7", max_new_tokens=2, dtype="fp32", limit=1)
            )
        template_cache = hscache.open_cache(template)
        small = synthetic_cache(template_cache, tmp / "small", args.sequences, args.length)
        large = synthetic_cache(template_cache, tmp / "large", 4 * args.sequences, args.length, seed=1)
        drafter = tmp / "drafter"
        init_dflash(template, drafter)
        with cluster_client(scheduler=args.scheduler, workers=None if args.scheduler else 2) as client:
            throughput(client, drafter, small, args.tokens_per_task)
            memory(client, drafter, small, large, args.tokens_per_task)
        scan(large, tmp, repeats=1 if args.quick else 3)
        plain = synthetic_cache(
            template_cache, tmp / "plain", 4 * args.sequences, args.length, seed=1, compression="none"
        )
        scan(plain, tmp, repeats=1 if args.quick else 3)


if __name__ == "__main__":
    main()
