"""What the benchmarks share: their size flags, best-of timing, a cache beside a raw copy of its bytes,
and the chain-drafting speed comparison of the autoregressive families.

bench/ is not on sys.path (bench/scorer.py would shadow the scorer package), so a script loads this
file by path, one line::

    common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hscache
from hscache.store.fsio import drop_page_cache
from hscache.store.writer import SequenceRows

SIZES = ("sequences", "length", "layers", "hidden")


def int_flags(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """An integer option per keyword, ``--name-with-dashes``, defaulting to its value."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def add_size_flags(parser: argparse.ArgumentParser, repeats: int, **sizes: int) -> None:
    """``--sequences --length --layers --hidden`` of a synthetic bf16 cache (``sizes``: their defaults),
    ``--repeats``, ``--dir`` (where its caches go) and ``--quick``."""
    int_flags(parser, **{name: sizes[name] for name in SIZES}, repeats=repeats)
    parser.add_argument("--dir", default=None, help="Where to write the caches (default: a temp dir).")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")


def quick_sizes(args: argparse.Namespace, **sizes: int) -> bool:
    """With ``--quick``: the tiny ``sizes`` and one repeat. Returns whether it applied."""
    if args.quick:
        for name in SIZES:
            setattr(args, name, sizes[name])
        args.repeats = 1
    return bool(args.quick)


def size_line(args: argparse.Namespace) -> tuple[int, str]:
    """The bytes of one bf16 copy of the hidden states and the line that says the sizes."""
    size = args.sequences * args.length * args.layers * args.hidden * 2
    return (
        size,
        f"{args.sequences} sequences x {args.length} tokens, hidden_states [{args.layers}, {args.hidden}] bf16",
    )


def best_of(fn: Callable[[], Any], repeats: int, evict: Sequence[Path] | None = None) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds; ``evict``: files dropped from the page
    cache before each run (a cold read)."""
    best = float("inf")
    for _ in range(repeats):
        if evict:
            drop_page_cache(list(evict))
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic_sequence(
    rng: np.random.Generator, name: str, length: int, vocab: int, hidden: Callable
) -> SequenceRows:
    """One synthetic sequence's rows for ``StoreWriter.append``: random tokens below ``vocab``, then
    ``hidden()`` (its [length, K, H] stored states), then random target arrays, drawn in that order."""
    tokens = rng.integers(0, vocab, length, dtype=np.int32)
    arrays = {
        "hidden_states": hidden(),
        "token_ids": tokens,
        "target_argmax": tokens,
        "target_topk_values": rng.standard_normal((length, 8), dtype=np.float32),
        "target_topk_ids": rng.integers(0, vocab, (length, 8), dtype=np.int32),
        "target_logsumexp": rng.standard_normal(length, dtype=np.float32),
    }
    digest = hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
    return SequenceRows(arrays, name, length // 4, "length", digest, "{}")


def read_chunks(paths: Sequence[Path], buffer: np.ndarray, crc: bool) -> None:
    """One thread reading each file whole into ``buffer`` (reused), and with ``crc`` its crc32c too, a
    MiB at a time: what checking a chunk costs beside reading it."""
    import google_crc32c

    for path in paths:
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(buffer)
        if crc:
            for k in range(0, n, 1 << 20):
                google_crc32c.extend(0, buffer[k : min(n, k + (1 << 20))])


class RawCopy:
    """A cache's ``hidden_states`` beside a raw file of the same stored bytes, and a full scan of each:
    ``reader`` (``Cache.iter_tokens``) and ``memmap`` (an ``np.memmap`` copied chunk by chunk)."""

    def __init__(self, cache_path: Path, tmp: Path) -> None:
        self.cache = cache = hscache.open_cache(cache_path)
        self.compression = cache.manifest["compression"]
        self.array = cache.array("hidden_states")
        self.n, self.step = cache.num_tokens, cache.specs["hidden_states"].chunk_tokens
        self.raw = tmp / f"raw-{self.compression}.bin"
        data = cache.read_tokens("hidden_states", 0, self.n)
        data.tofile(self.raw)
        self.nbytes = data.nbytes
        self.files = [p for p in (Path(cache_path) / "arrays" / "hidden_states").rglob("*") if p.is_file()]

    def reader(self) -> None:
        for _first, _rows in self.cache.iter_tokens("hidden_states"):
            pass

    def memmap(self) -> None:
        mm = np.memmap(self.raw, dtype=self.array.dtype, mode="r", shape=(self.n, *self.array.shape[1:]))
        for a in range(0, self.n, self.step):
            np.array(mm[a : min(self.n, a + self.step)])


def chain_speed(
    family: str,
    layers: str,
    setup: Callable[[Path, Path, Any, int], tuple[list[tuple], dict[str, Callable]]],
    argv: list[str] | None,
    description: str,
) -> None:
    """An autoregressive family's chain drafting, batched over every anchor against the baselines that
    draft one anchor at a time (bench/eagle3.py, bench/mtp.py): on a fresh fp32 cache of the built-in
    target at ``layers`` (or ``--cache``, one that holds them), ``setup(tmp, cache dir, cache, K) ->
    (sequences, paths)`` gives each path (``batched``, ``vllm_loop``, ``shared_step0``:
    ``path(*sequence) -> drafts [anchors, K]``); every path's drafts are checked equal before the
    ratios are printed."""
    import torch

    parser = argparse.ArgumentParser(description=description)
    int_flags(parser, sequences=4, new_tokens=128, k=3)
    parser.add_argument("--quick", action="store_true", help="2 sequences x 32 tokens (the test's form)")
    parser.add_argument(
        "--cache",
        default=None,
        help=f"score this cache of the built-in target instead (it must hold layers {layers}; "
        "--sequences and --new-tokens then do not apply): the test suite passes its session cache",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.new_tokens = 2, 32
    if args.cache and (
        missing := set(map(int, layers.split(","))) - set(hscache.open_cache(args.cache).layer_ids)
    ):
        parser.error(f"--cache {args.cache} lacks layers {sorted(missing)}: extract them (--layers {layers})")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(args.cache) if args.cache else Path(tmp) / "cache"
        if args.cache is None:
            hscache.extract(
                hscache.ExtractConfig(
                    out=str(cache_dir),
                    layers=layers,
                    max_new_tokens=args.new_tokens,
                    dtype="fp32",
                    limit=args.sequences,
                )
            )
        sequences, paths = setup(Path(tmp), cache_dir, hscache.open_cache(cache_dir), args.k)
        timings, drafts = {}, {}
        for name, path in paths.items():
            t0 = time.perf_counter()
            drafts[name] = [path(*sequence) for sequence in sequences]
            timings[name] = time.perf_counter() - t0
    for name in ("vllm_loop", "shared_step0"):
        for mine, theirs in zip(drafts["batched"], drafts[name]):
            np.testing.assert_array_equal(mine, theirs)
    anchors = sum(len(d) for d in drafts["batched"])
    print(f"sequences {len(sequences)}, anchors {anchors}, K {args.k}, threads 1, drafts equal on every path")
    batched = timings["batched"]
    print(
        f"{family} chain batched vs one anchor at a time (vLLM loop): {timings['vllm_loop'] / batched:.1f}x"
    )
    print(
        f"{family} chain batched vs step 0 shared, later steps per anchor: {timings['shared_step0'] / batched:.1f}x"
    )
