"""Training-read benchmark: an epoch of hidden states through hscache's datasets against a raw
memmap copy and the peers' own per-sample formats, all measured in one interleaved run.

At Qwen3.6-27B's drafter dimensions by default (hidden 5120, 5 layers, 2,048-token sequences, bf16),
on a synthetic cache written through the normal writer (``StoreWriter``): values are bf16 with
per-channel scales and a few massive channels, like real hidden states, so codecs see realistic
mantissas. Paths, each one epoch over every sequence, each item's hidden states landing in a CPU
tensor of the consumer process (what a GPU copy would read next):

  memmap            ``np.memmap`` of the decoded bytes, one copy per sequence (the baseline)
  speculators       ``safetensors.torch.load_file(hs_{i}.safetensors)`` per sample and the split its
                    ArrowDataset makes (``[:, :-1].flatten(1)`` and ``[:, -1]``), copied once as its collate_fn's
                    ``torch.cat`` does (load_file maps the file lazily: without a copy nothing is read)
  specforge         ``torch.load(data_{i}.ckpt, weights_only=True)`` per sample, as SpecForge loads
  dataset_<codec>_w<N>   ``SequenceDataset`` through a ``DataLoader`` with N workers (persistent);
                    w0: ``SequenceDataset.prefetched()`` in the loop's process, no workers
  windows_<codec>_w<N>   ``PackedWindows`` (2,048-token windows, no shuffle), same loaders

The peers' files are written by ``hscache export`` from the caches, so they hold the same bytes
(checked on sample 0). Warm: the page cache holds every file (one untimed pass first; chunk
checksums then verified once per process, as in any epoch after the first). Cold: before each timed
run the path's files are evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` and the caches' chunk
files are touched (``utime``), so every reader process checks every chunk's crc32c again.
Best of ``--repeats`` interleaved repeats. Also: the codec table (bytes stored, write speed, read
speed warm/cold) for none/fast/balanced, and the first-touch cost of the checksum.

    python bench/training_read.py [--sequences 16] [--repeats 2] [--dir D] [--json F] [--quick]

Needs ~4.5x the cache's raw size of disk under --dir (the caches, a raw copy, two exports).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

# Run as `python bench/training_read.py`, bench/ is sys.path[0], and bench/scorer.py would shadow the
# scorer package: import the packages, never the sibling scripts.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# bench/common.py, loaded by path (bench/ is off sys.path)
common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))

import numpy as np
import torch
from torch.utils.data import DataLoader

import hscache
from hscache import schemas
from hscache.data import PackedWindows, SequenceDataset
from hscache.interop.specforge import export_specforge, feature_path
from hscache.interop.speculators import HIDDEN_DIR, export_speculators
from hscache.store.chunks import VERIFIED
from hscache.store.fsio import drop_page_cache
from hscache.store.layout import TARGET_DIR, array_specs
from hscache.store.writer import StoreWriter

CODECS = ("none", "fast", "balanced")
LAYER_IDS = [1, 16, 31, 46, 61]  # the DFlash drafter's target layers for a 64-layer target (spec/scale.md)
RATIO_KEYS = (
    "dataset_none_warm",
    "dataset_fast_warm",
    "speculators_warm",
    "specforge_warm",
    "dataset_none_cold",
    "speculators_cold",
    "specforge_cold",
)


def _sequence(
    rng: np.random.Generator, length: int, layers: int, hidden: int, scale: np.ndarray
) -> np.ndarray:
    """One sequence's bf16 hidden states as raw uint16 bits: normal values times per-channel scales."""
    values = rng.standard_normal((length, layers, hidden), dtype=np.float32)
    values *= scale
    return (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation to bf16 bits


def write_cache(
    out: Path,
    sequences: int,
    length: int,
    layers: int,
    hidden: int,
    codec: str,
    last_layer: bool = False,
    chunk_bytes: int = 8 << 20,
) -> float:
    """A cache through ``StoreWriter``; returns the seconds spent in the writer (data generation excluded).

    ``last_layer``: write ``target/config.json`` saying the target's last layer is that one
    (speculators' export needs it; SpecForge's refuses a cache holding the last layer).
    """
    rng = np.random.default_rng(0)
    scale = np.exp(rng.normal(0.0, 0.7, (layers, hidden))).astype(np.float32)
    scale[:, rng.choice(hidden, max(1, hidden // 1000), replace=False)] *= 60.0  # massive channels
    ids = LAYER_IDS[:layers] if layers <= len(LAYER_IDS) else list(range(layers))
    if last_layer:
        (out / TARGET_DIR).mkdir(parents=True)
        (out / TARGET_DIR / "config.json").write_text(json.dumps({"num_hidden_layers": ids[-1] + 1}))
    specs = array_specs(layers, hidden, "bfloat16", 8, None, chunk_bytes)
    writing = 0.0
    t0 = time.perf_counter()
    writer = StoreWriter.create(out, specs, codec, {"layer_ids": ids})
    writing += time.perf_counter() - t0
    for i in range(sequences):
        rows = common.synthetic_sequence(
            rng, f"s{i}", length, 248_320, lambda: _sequence(rng, length, layers, hidden, scale)
        )
        t0 = time.perf_counter()
        writer.append(rows)
        writing += time.perf_counter() - t0
    t0 = time.perf_counter()
    writer.finish()
    return writing + time.perf_counter() - t0


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _chunk_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "arrays").rglob("*") if p.is_file() and "/c/" in p.as_posix()]


def _make_cold(files: list[Path], chunk_files: list[Path]) -> None:
    """Evict ``files``; touch ``chunk_files`` so no process's verified-chunk record vouches for them."""
    now = time.time_ns()
    for path in chunk_files:
        os.utime(path, ns=(now, now))
    VERIFIED.clear()
    drop_page_cache(files)


class Path_:
    """One read path: ``run()`` reads an epoch; ``files`` are evicted for a cold run."""

    def __init__(self, name: str, run: Callable[[], int], files: list[Path], chunk_files: list[Path] = ()):
        self.name, self.run, self.files, self.chunk_files = name, run, files, list(chunk_files)


def _drain(items: Iterable[dict]) -> int:
    """Consume an epoch's items; the hidden-state bytes delivered."""
    return sum(item["hidden_states"].nbytes for item in items)


def _loader(dataset, workers: int) -> DataLoader:
    return DataLoader(
        dataset, batch_size=None, num_workers=workers, persistent_workers=True, prefetch_factor=4
    )


def build_paths(
    tmp: Path, caches: dict[str, Path], n_tokens: int, length: int, row_shape, workers
) -> list[Path_]:
    none, fast = caches["none"], caches["fast"]
    raw = tmp / "raw.bin"
    cache = hscache.open_cache(none)
    with raw.open("wb") as f:
        for _, rows in cache.iter_tokens("hidden_states"):
            rows.tofile(f)
    spec_dir, sf_dir = tmp / "speculators", tmp / "specforge"
    export_speculators(none, spec_dir)
    export_specforge(fast, sf_dir)
    count = len(cache)
    spans = [cache.sequence_span(i) for i in range(count)]
    _check_exports(cache, spec_dir, sf_dir)

    def memmap() -> int:
        mm = np.memmap(raw, dtype=np.uint16, mode="r", shape=(n_tokens, *row_shape))
        return _drain({"hidden_states": torch.from_numpy(np.array(mm[a:b]))} for a, b in spans)

    def speculators() -> int:
        from safetensors.torch import load_file

        def item(i: int) -> dict:
            hidden = load_file(str(spec_dir / HIDDEN_DIR / f"hs_{i}.safetensors"))["hidden_states"]
            # Its collate_fn's torch.cat copies both parts (flatten alone is a view of the mapped file).
            context, last = hidden[:, :-1].flatten(1).clone(), hidden[:, -1].clone()
            return {"hidden_states": context, "verifier_last_hidden_states": last}

        return sum(
            item["hidden_states"].nbytes + item["verifier_last_hidden_states"].nbytes
            for item in map(item, range(count))
        )

    def specforge() -> int:
        return _drain(
            torch.load(feature_path(sf_dir, i), weights_only=True, map_location="cpu") for i in range(count)
        )

    paths = [
        Path_("memmap", memmap, [raw]),
        Path_("speculators", speculators, _files(spec_dir)),
        Path_("specforge", specforge, _files(sf_dir)),
    ]
    for codec, root in (("none", none), ("fast", fast)):
        files, chunks = _files(root), _chunk_files(root)
        data = SequenceDataset(root)
        paths.append(Path_(f"dataset_{codec}_w0", lambda d=data: _drain(d.prefetched()), files, chunks))
        windows = PackedWindows(root, window=length, shuffle=False)
        paths.append(Path_(f"windows_{codec}_w0", lambda w=windows: _drain(w), files, chunks))
        for n in workers:
            loader = _loader(SequenceDataset(root), n)
            paths.append(Path_(f"dataset_{codec}_w{n}", lambda x=loader: _drain(x), files, chunks))
            wloader = _loader(PackedWindows(root, window=length, shuffle=False), n)
            paths.append(Path_(f"windows_{codec}_w{n}", lambda x=wloader: _drain(x), files, chunks))
    return paths


def _check_exports(cache, spec_dir: Path, sf_dir: Path) -> None:
    """The peers' files hold the cache's bytes (sample 0)."""
    from safetensors.torch import load_file

    want = cache.hidden_states(0).view(torch.int16)
    spec = load_file(str(spec_dir / HIDDEN_DIR / "hs_0.safetensors"))["hidden_states"].view(torch.int16)
    sf = torch.load(feature_path(sf_dir, 0), weights_only=True)["hidden_states"][0].view(torch.int16)
    if not (torch.equal(spec, want) and torch.equal(sf.reshape(want.shape), want)):
        raise RuntimeError("an export does not hold the cache's bytes")


def _time(path: Path_, cold: bool) -> tuple[float, int]:
    if cold:
        _make_cold(path.files, path.chunk_files)
    t0 = time.perf_counter()
    nbytes = path.run()
    return time.perf_counter() - t0, nbytes


def measure(paths: list[Path_], repeats: int) -> dict[str, dict[str, float]]:
    """GB/s per path, warm and cold, best of ``repeats`` interleaved runs."""
    for path in paths:  # warm the page cache, the workers and their verified-chunk records
        path.run()
    best: dict[str, dict[str, float]] = {"warm": {}, "cold": {}}
    for label in ("warm", "cold"):  # every warm run first: a cold run leaves its files evicted
        for _ in range(repeats):
            for path in paths:
                seconds, nbytes = _time(path, label == "cold")
                best[label][path.name] = max(best[label].get(path.name, 0.0), nbytes / seconds / 1e9)
    return best


def first_touch(root: Path, repeats: int) -> dict[str, float]:
    """What checking a chunk costs, warm. One thread over the chunk files into one reused buffer:
    the read alone, and the read with its crc32c (as a first touch does); then end to end, the GB/s
    of ``SequenceDataset.prefetched`` with the checksum computed (record cleared) and skipped."""
    paths = sorted((root / "arrays" / "hidden_states" / "c").rglob("*"))
    paths = [p for p in paths if p.is_file()]
    buffer = np.empty(max(p.stat().st_size for p in paths), np.uint8)
    nbytes = sum(p.stat().st_size for p in paths)

    def read(crc: bool) -> None:
        common.read_chunks(paths, buffer, crc)

    read(True)
    out = {"one_thread_read": 0.0, "one_thread_read_crc32c": 0.0}
    for _ in range(repeats):
        for label, crc in (("one_thread_read", False), ("one_thread_read_crc32c", True)):
            t0 = time.perf_counter()
            read(crc)
            out[label] = max(out[label], nbytes / (time.perf_counter() - t0) / 1e9)
    data = SequenceDataset(root)
    _drain(data.prefetched())
    out.update({"first_touch": 0.0, "verified": 0.0})
    for _ in range(repeats):
        for label in ("first_touch", "verified"):
            if label == "first_touch":
                VERIFIED.clear()
            t0 = time.perf_counter()
            nbytes = _drain(data.prefetched())
            out[label] = max(out[label], nbytes / (time.perf_counter() - t0) / 1e9)
    # Cold, as a NEW process sees the cache (pages evicted, this process's record cleared), the
    # chunks unchanged since an earlier process verified them: checked again without the user's
    # verification log, trusted from it with the log (store/verified_log.py).
    log_dir = root.parent / "verified-log"
    os.environ["HSCACHE_VERIFIED_DIR"] = str(log_dir)
    VERIFIED.clear()
    _drain(data.prefetched())  # verifies every chunk and logs it
    files = _files(root)
    out.update({"cold_first_touch": 0.0, "cold_logged": 0.0})
    for _ in range(repeats):
        for label, log in (("cold_first_touch", "off"), ("cold_logged", str(log_dir))):
            os.environ["HSCACHE_VERIFIED_DIR"] = log
            VERIFIED.clear()
            drop_page_cache(files)
            t0 = time.perf_counter()
            nbytes = _drain(data.prefetched())
            out[label] = max(out[label], nbytes / (time.perf_counter() - t0) / 1e9)
    os.environ["HSCACHE_VERIFIED_DIR"] = "off"
    return out


def codec_table(tmp: Path, args, repeats: int) -> dict[str, dict[str, float]]:
    """Per codec: stored/raw bytes of hidden_states, writer MB/s, in-process read GB/s warm and cold."""
    table = {}
    for codec in CODECS:
        root = tmp / f"codec-{codec}"
        # speculators' export needs the cache to hold the target's last layer; SpecForge's refuses it.
        seconds = write_cache(
            root,
            args.sequences,
            args.length,
            args.layers,
            args.hidden,
            codec,
            last_layer=codec == "none",
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
        )
        cache = hscache.open_cache(root)
        raw = cache.num_tokens * cache.specs["hidden_states"].bytes_per_token
        stored = sum(
            p.stat().st_size for p in (root / "arrays" / "hidden_states" / "c").rglob("*") if p.is_file()
        )
        data = SequenceDataset(root)
        _drain(data.prefetched())
        warm = cold = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            _drain(data.prefetched())
            warm = max(warm, raw / (time.perf_counter() - t0) / 1e9)
            _make_cold(_files(root), _chunk_files(root))
            t0 = time.perf_counter()
            _drain(data.prefetched())
            cold = max(cold, raw / (time.perf_counter() - t0) / 1e9)
        table[codec] = {
            "stored_over_raw": stored / raw,
            "write_mb_s": raw / seconds / 1e6,
            "read_warm_gb_s": warm,
            "read_cold_gb_s": cold,
        }
        print(
            f"codec {codec}: stored/raw {stored / raw:.3f}, write {raw / seconds / 1e6:,.0f} MB/s (whole writer), "
            f"SequenceDataset.prefetched warm {warm:.2f} GB/s, cold {cold:.2f} GB/s"
        )
        if codec == "balanced":
            shutil.rmtree(root)
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_size_flags(parser, repeats=2, sequences=16, length=2048, layers=5, hidden=5120)
    parser.add_argument("--chunk-mb", type=float, default=8.0, help="As hscache extract --chunk-mb.")
    parser.add_argument("--workers", default="1,2", help="DataLoader worker counts (besides 0: in-process).")
    parser.add_argument("--json", dest="json_path", default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    if common.quick_sizes(args, sequences=3, length=256, layers=2, hidden=64):
        args.chunk_mb = 1 / 16  # 256-token chunks, as at the real dimensions
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    load = os.getloadavg()
    size, sizes = common.size_line(args)
    print(
        f"{sizes}: {size / 2**30:.2f} GiB per copy; {os.cpu_count()} CPUs, load average {load[0]:.2f} at start"
    )
    # Every path below checks its chunks in-process only (the user's verification log off), as
    # before the log existed; first_touch measures the log separately. Restored at the end.
    log_setting = os.environ.get("HSCACHE_VERIFIED_DIR")
    os.environ["HSCACHE_VERIFIED_DIR"] = "off"
    try:
        return _run(args, workers, load)
    finally:
        if log_setting is None:
            os.environ.pop("HSCACHE_VERIFIED_DIR", None)
        else:
            os.environ["HSCACHE_VERIFIED_DIR"] = log_setting


def _run(args: argparse.Namespace, workers: list[int], load: tuple[float, float, float]) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        codecs = codec_table(tmp, args, args.repeats)
        caches = {"none": tmp / "codec-none", "fast": tmp / "codec-fast"}
        touch = first_touch(caches["none"], args.repeats)
        print(
            f"checksum cost, codec none, warm: one thread into a reused buffer, read {touch['one_thread_read']:.2f} "
            f"GB/s, read + crc32c {touch['one_thread_read_crc32c']:.2f} GB/s; SequenceDataset.prefetched, first touch "
            f"(crc32c + sha256 computed) {touch['first_touch']:.2f} GB/s, verified earlier in the process "
            f"{touch['verified']:.2f} GB/s; cold in a new process: checked again {touch['cold_first_touch']:.2f} GB/s, "
            f"trusted from the verification log {touch['cold_logged']:.2f} GB/s"
        )
        n_tokens = args.sequences * args.length
        paths = build_paths(tmp, caches, n_tokens, args.length, (args.layers, args.hidden), workers)
        gbps = measure(paths, args.repeats)
    ratios = {}
    for label in ("warm", "cold"):
        base = gbps[label]["memmap"]
        print(f"{label}: raw memmap copy {base:.2f} GB/s")
        for name, value in gbps[label].items():
            if name != "memmap":
                print(f"  {name:<18} {value:6.2f} GB/s  ratio to memmap {value / base:.2f}")
        for name in gbps[label]:
            ratios[f"{name}_{label}"] = gbps[label][name] / base
    best = {
        f"dataset_{codec}_{label}": max(
            v for k, v in ratios.items() if k.startswith(f"dataset_{codec}_w") and k.endswith(label)
        )
        for codec in ("none", "fast")
        for label in ("warm", "cold")
    }
    ratios.update(best)
    for key in RATIO_KEYS:
        print(f"ratio {key}: {ratios[key]:.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    document = {
        "bench": "training_read",
        "config": {
            "sequences": args.sequences,
            "length": args.length,
            "layers": args.layers,
            "hidden": args.hidden,
            "repeats": args.repeats,
            "workers": workers,
            "cpus": os.cpu_count(),
            "load_average_at_start": list(load),
            "cold": "posix_fadvise(DONTNEED) of the path's files + utime of the caches' chunk files",
        },
        "ratios": ratios,
        "gb_per_s": gbps,
        "codecs": codecs,
        "checksum_gb_per_s": touch,
    }
    schemas.validate(document, "training_read")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return document


if __name__ == "__main__":
    main()
