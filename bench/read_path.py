"""Read-path benchmark: the cache reader against the hardware, ratios measured in one run.

For codec ``none`` and the default ``fast`` (lz4 + bitshuffle), on a synthetic bf16 cache:
  1. full sequential scan of ``hidden_states`` (``Cache.iter_tokens``: chunk files read directly,
     crc32c checked, decoded into fresh arrays, the next chunks read in the background) against a
     raw ``np.memmap`` of the same decoded bytes copied chunk by chunk, warm (page cache hot) and
     cold (both evicted with posix_fadvise before each run); target reader/memmap >= 0.8
  2. one sequence (``Cache.hidden_states(i)``, random i) against decoding the whole chunks it
     touches (read + crc32c + decompress each chunk file, no slicing, no tensor); target <= 2x
  3. the training read (``hscache.data.SequenceDataset[i]``) against ``Cache.hidden_states(i)``

    python bench/read_path.py [--sequences 48] [--length 1024] [--layers 4] [--hidden 1024] [--quick]

Cold numbers need a real disk: on tmpfs, or where posix_fadvise cannot evict, cold == warm.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# Run as `python bench/read_path.py`, bench/ is sys.path[0], and bench/scorer.py would shadow the
# scorer package: import the packages, never the sibling scripts.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# bench/common.py, loaded by path (bench/ is off sys.path)
common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))

import numpy as np

import hscache
from hscache.data import SequenceDataset
from hscache.store.layout import array_specs
from hscache.store.writer import StoreWriter


def synthetic_cache(
    out: Path, sequences: int, length: int, layers: int, hidden: int, compression: str
) -> Path:
    """A cache of random bf16 hidden states (the other arrays small and random), no target dir.

    Values are drawn like real activations (normal, bf16): random mantissas compress about as
    little as real hidden states do (~1.1-1.2x with ``fast``), so decode cost is realistic.
    """
    rng = np.random.default_rng(0)
    specs = array_specs(layers, hidden, "bfloat16", 8, None, 8 << 20)
    writer = StoreWriter.create(out, specs, compression, {"layer_ids": list(range(layers))})

    def bf16() -> np.ndarray:  # truncation to bf16 bits
        values = rng.standard_normal((length, layers, hidden), dtype=np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)

    for i in range(sequences):
        writer.append(common.synthetic_sequence(rng, f"s{i}", length, 1000, bf16))
    writer.finish()
    return out


def scan(cache_path: Path, tmp: Path, repeats: int) -> dict[str, float]:
    """Reader/memmap ratios of a full ``hidden_states`` scan, warm and cold."""
    copy = common.RawCopy(cache_path, tmp)
    compression, nbytes, reader, memmap = copy.compression, copy.nbytes, copy.reader, copy.memmap

    ratios = {}
    reader()  # warm the thread pool and the page cache
    for label, evict in (("warm", None), ("cold", copy.files + [copy.raw])):
        t_reader = common.best_of(reader, repeats, evict)
        t_memmap = common.best_of(memmap, repeats, evict)
        ratios[label] = t_memmap / t_reader
        print(
            f"scan {label}, codec {compression}: reader {nbytes / t_reader / 1e6:,.0f} MB/s, raw memmap "
            f"{nbytes / t_memmap / 1e6:,.0f} MB/s; reader/memmap ratio {ratios[label]:.2f} (target >= 0.8)"
        )
    return ratios


def floors(cache_path: Path, repeats: int) -> None:
    """What one thread pays per chunk, warm: the copy out of the page cache alone, + crc32c, +
    decode (the reader's whole work). Bounds the scan ratio: memmap does the copy only."""
    cache = hscache.open_cache(cache_path)
    reader = cache._chunk_reader("hidden_states")
    spec = cache.specs["hidden_states"]
    count = -(-cache.num_tokens // spec.chunk_tokens)
    paths = [reader.chunk_path(i) for i in range(count)]
    buffer = np.empty(max(p.stat().st_size for p in paths), np.uint8)
    rows = np.empty((spec.chunk_tokens, *spec.row_shape), np.uint16)

    def copy(crc: bool) -> None:
        common.read_chunks(paths, buffer, crc)

    def decode() -> None:
        for i in range(count):
            base = i * spec.chunk_tokens
            reader._decode(i, base, base + spec.chunk_tokens, rows)

    nbytes = count * spec.chunk_tokens * spec.bytes_per_token
    copy(False)
    t = [common.best_of(fn, repeats) for fn in (lambda: copy(False), lambda: copy(True), decode)]
    print(
        f"one thread, warm, codec {cache.manifest['compression']}: read {nbytes / t[0] / 1e6:,.0f} MB/s, "
        f"read + crc32c {nbytes / t[1] / 1e6:,.0f} MB/s, read + crc32c + decode {nbytes / t[2] / 1e6:,.0f} MB/s "
        "(decoded bytes per second)"
    )


def sequence_reads(cache_path: Path, repeats: int) -> float:
    """Warm: one sequence read against decoding the whole chunks it touches; the dataset's overhead."""
    cache = hscache.open_cache(cache_path)
    reader = cache._chunk_reader("hidden_states")
    spec = cache.specs["hidden_states"]
    order = np.random.default_rng(0).permutation(len(cache))[: min(32, len(cache))]
    buffer = np.empty((spec.chunk_tokens, *spec.row_shape), np.uint16)
    data = SequenceDataset(cache_path)

    def sequences() -> None:
        fresh = hscache.open_cache(cache_path)  # no decoded chunk kept from an earlier pass
        for i in order:
            fresh.hidden_states(int(i))

    def chunks() -> None:
        for i in order:
            start, stop = cache.sequence_span(int(i))
            for index in range(start // spec.chunk_tokens, (stop - 1) // spec.chunk_tokens + 1):
                base = index * spec.chunk_tokens
                reader._read_chunk(index, base, base + spec.chunk_tokens, buffer)

    def dataset() -> None:
        for i in order:
            data[int(i)]

    def dataset_fresh() -> None:
        fresh = SequenceDataset(cache_path)
        for i in order:
            fresh[int(i)]

    sequences()
    dataset()
    t_seq, t_chunks, t_data, t_fresh = (
        common.best_of(fn, repeats) for fn in (sequences, chunks, dataset, dataset_fresh)
    )
    per = len(order)
    ratio = t_seq / t_chunks
    print(
        f"sequence read, codec {cache.manifest['compression']}: hidden_states(i) {t_seq / per * 1e3:.2f} ms, "
        f"decode its chunks {t_chunks / per * 1e3:.2f} ms; read/decode ratio {ratio:.2f} (target <= 2); "
        f"SequenceDataset[i] (all arrays) {t_fresh / per * 1e3:.2f} ms first pass, "
        f"{t_data / per * 1e3:.2f} ms once the small arrays' chunks are decoded"
    )
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_size_flags(parser, repeats=3, sequences=48, length=1024, layers=4, hidden=1024)
    args = parser.parse_args(argv)
    common.quick_sizes(args, sequences=6, length=300, layers=2, hidden=64)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        size, sizes = common.size_line(args)
        print(f"{sizes}: {size / 2**20:.0f} MiB")
        for compression in ("none", "fast"):
            path = synthetic_cache(
                tmp / compression, args.sequences, args.length, args.layers, args.hidden, compression
            )
            scan(path, tmp, args.repeats)
            floors(path, args.repeats)
            sequence_reads(path, args.repeats)


if __name__ == "__main__":
    main()
