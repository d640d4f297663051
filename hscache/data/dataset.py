"""Torch datasets over a cache: what a training loop reads, from the same bytes the scorer reads.

``SequenceDataset`` is map-style, one item per sequence (variable length: use ``batch_size=None``
or your own collate). ``PackedWindows`` is iterable and yields fixed-length token windows cut from
the cache's flat token axis, so every batch has the same shape; windows are visited storage chunk
by storage chunk (each chunk is read once), the chunk order shuffled with a seed.

Both pickle without their open cache: each ``DataLoader`` worker (and each process after a fork)
opens its own handle on first use, so nothing unpicklable crosses a process boundary, and both
take local paths, shard directories and fsspec URLs (``s3://...``) alike.

Feeding a GPU (docs/training.md): both read each item's hidden states with one copy out of the page
cache, into shared memory inside a ``DataLoader`` worker (so handing the item to the main process
copies nothing) or into pinned memory when asked (``pin_memory=True`` of ``prefetched`` /
``PackedWindows``). ``SequenceDataset.prefetched`` reads the next items in background threads for
a loop without worker processes; ``PackedWindows`` reads the next storage chunk's windows while the
current ones are consumed. Chunk checksums are checked on first touch per process (store/chunks.py).

Ranks split the work disjointly and completely: ``SequenceDataset`` gives rank r the contiguous
block ``[n*r//world, n*(r+1)//world)`` of sequences, ``PackedWindows`` every ``world``-th chunk of
the shuffled chunk order (then every ``num_workers``-th of those per worker).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hscache.errors import InputError
from hscache.store.open import open_cache
from hscache.store.reader import Cache
from hscache.store.urls import absolute_location

__all__ = ["PackedWindows", "SequenceDataset"]

# Per-token arrays an item carries when the cache has them (imported caches may lack the target's).
_ITEM_ARRAYS = (
    "token_ids",
    "target_argmax",
    "target_topk_values",
    "target_topk_ids",
    "target_logsumexp",
)
_AS_LONG = {"token_ids", "target_argmax", "target_topk_ids"}
_PREFETCH_THREADS = 2  # items read at once by ``prefetched`` (each read already spans its chunks in parallel)


class _CacheHandle:
    """Opens the cache lazily, once per process; pickles as its path only."""

    path: str
    _cache: Cache | None
    _pid: int

    def _open_handle(self, path_or_url: Any) -> Cache:
        self.path = absolute_location(path_or_url)  # workers reopen it: never relative to their directory
        self._cache, self._pid = open_cache(self.path), os.getpid()
        return self._cache

    @property
    def cache(self) -> Cache:
        """This process's handle on the cache (opened again after a fork or an unpickle)."""
        if self._cache is None or self._pid != os.getpid():
            self._cache, self._pid = open_cache(self.path), os.getpid()
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state


def _layer_positions(cache: Cache, layer_ids: list[int] | None) -> list[int] | None:
    """Positions in the K axis of ``layer_ids`` (None: every cached layer, no copy)."""
    if layer_ids is None:
        return None
    cached = cache.layer_ids
    missing = [i for i in layer_ids if i not in cached]
    if missing or not layer_ids:
        raise InputError(
            f"layer_ids {list(layer_ids)} are not all in the cache {cache.path} "
            f"(it holds layers {cached}); pass a non-empty subset of those"
        )
    positions = [cached.index(i) for i in layer_ids]
    return None if positions == list(range(len(cached))) else positions


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(
            f"rank {rank} / world_size {world_size}: need world_size >= 1 and 0 <= rank < world_size"
        )


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """An uninitialised tensor for an item's hidden states: pinned when asked; in a DataLoader worker,
    in shared memory (what torch's own collate does), so passing it to the main process is no copy;
    else numpy's memory, which asks the kernel for huge pages on big arrays: a fresh 100 MB item then
    costs ~50 page faults instead of ~25,000 (half the time of filling a ``torch.empty`` buffer here)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if pin_memory:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return torch.from_numpy(np.empty(nbytes, np.uint8)).view(dtype).view(shape)


def _hidden(
    cache: Cache, start: int, stop: int, positions: list[int] | None, pin_memory: bool
) -> torch.Tensor:
    """Hidden-state rows ``[start, stop)`` (layers at ``positions``), read straight into their buffer."""
    spec = cache.specs["hidden_states"]
    dtype = cache.dtype  # the logical dtype; a compact cache's source dtype (fp8 states dequantised)
    if positions is None:
        return cache.rows(
            "hidden_states", start, stop, out=_empty((stop - start, *spec.row_shape), dtype, pin_memory)
        )
    rows = cache.rows("hidden_states", start, stop)
    out = _empty((stop - start, len(positions), spec.row_shape[1]), dtype, pin_memory)
    return torch.index_select(rows, 1, torch.tensor(positions), out=out)


def _fp8_hidden(
    cache: Cache, start: int, stop: int, positions: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A compact cache's rows as stored: (float8_e4m3fn ``[n, K, H]``, float32 scales ``[n, K]``), for a
    consumer that dequantises on its own device (``hscache.store.compact.dequantise_tensor``)."""
    from hscache.store.compact import SCALE_ARRAY

    bits = torch.from_numpy(cache.read_tokens("hidden_states", start, stop)).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(cache.read_tokens(SCALE_ARRAY, start, stop))
    if positions is None:
        return bits, scales
    index = torch.tensor(positions)
    return bits.index_select(1, index), scales.index_select(1, index)


def _tensor(cache: Cache, name: str, start: int, stop: int) -> torch.Tensor:
    t = cache.rows(name, start, stop)
    return t.long() if name in _AS_LONG else t


class SequenceDataset(_CacheHandle, Dataset):
    """One item per committed sequence of the cache at ``path_or_url``.

    An item is a dict of tensors: ``hidden_states [T, K, H]`` (logical dtype, K = ``layer_ids``
    or all cached layers, in that order), ``token_ids [T]``, ``target_argmax [T]`` (the target's
    greedy token for position t + 1), ``target_topk_values/ids [T, k]``, ``target_logsumexp [T]``
    (each only when the cache has it: imported caches lack the target's arrays), ``loss_mask [T]``
    bool (the generated positions, t >= prompt_len; an imported cache's own mask), plus
    ``record_id`` (str), ``row`` (int) and ``metadata`` (the index row: prompt_len, stop_reason,
    ... and the prompt record's metadata keys).
    """

    def __init__(
        self, path_or_url: Any, layer_ids: list[int] | None = None, rank: int = 0, world_size: int = 1
    ):
        _check_rank(rank, world_size)
        cache = self._open_handle(path_or_url)
        self.layer_ids = list(cache.layer_ids if layer_ids is None else layer_ids)
        self._positions = _layer_positions(cache, layer_ids)
        n = len(cache)
        self.rows = range(n * rank // world_size, n * (rank + 1) // world_size)
        self._index: pa.Table = cache.index.drop_columns(["metadata_json"])
        self._names = [name for name in _ITEM_ARRAYS if name in cache.specs]
        self._has_mask = "loss_mask" in cache.specs

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._item(i, pin_memory=False)

    def prefetched(
        self, indices: Iterable[int] | None = None, ahead: int = 4, pin_memory: bool = False
    ) -> Iterator[dict[str, Any]]:
        """Items ``indices`` (default: all, in order) in that order, the next ``ahead`` read in
        background threads while the caller works on this one: a training loop without DataLoader
        worker processes. ``pin_memory``: hidden states land in pinned memory (needs CUDA), ready for
        ``.to("cuda", non_blocking=True)``.

        Raises:
            IndexError: an index past ``len(self)``; CacheFormatError: as ``Cache.read_tokens``.
        """
        if ahead < 1:
            raise InputError(f"ahead {ahead}: need at least 1 item read ahead")
        order = iter(range(len(self)) if indices is None else indices)
        _ = self.cache  # open the handle here, not in two reader threads at once
        pool = ThreadPoolExecutor(max_workers=_PREFETCH_THREADS, thread_name_prefix="hscache-prefetch")
        pending: deque[Future] = deque()
        try:
            for i in order:
                pending.append(pool.submit(self._item, i, pin_memory))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _item(self, i: int, pin_memory: bool) -> dict[str, Any]:
        row = self.rows[i]  # IndexError past the end, as a Dataset should
        # A sharded cache reads each sequence from its shard (there is no global token axis).
        locate = getattr(self.cache, "locate", None)
        cache, local = locate(row) if locate else (self.cache, row)
        start, stop = cache.sequence_span(local)
        meta = self._index.slice(row, 1).to_pylist()[0]
        item: dict[str, Any] = {"hidden_states": _hidden(cache, start, stop, self._positions, pin_memory)}
        for name in self._names:
            item[name] = _tensor(cache, name, start, stop)
        if self._has_mask:
            item["loss_mask"] = cache.rows("loss_mask", start, stop) != 0
        else:
            item["loss_mask"] = torch.arange(stop - start) >= int(meta["prompt_len"])
        item["record_id"] = meta["record_id"]
        item["row"] = row
        item["metadata"] = meta
        return item


class PackedWindows(_CacheHandle, IterableDataset):
    """Fixed-length windows of ``window`` tokens over the cache's flat token axis.

    Window w covers tokens ``[w*window, (w+1)*window)``; the tail shorter than a window is
    dropped. Windows cross sequence boundaries: each carries ``sequence_ids [W]`` (row of the
    sequence each token belongs to) and ``position_ids [W]`` (position inside that sequence), so
    attention and loss can stay within one sequence. Items: ``hidden_states [W, K, H]``,
    ``token_ids``, ``target_argmax`` (when cached), ``loss_mask`` (bool, generated positions),
    ``position_ids``, ``sequence_ids``, ``start`` (first token).

    Order: the storage chunks holding window starts are shuffled with ``seed + epoch``
    (``set_epoch``), and the windows inside a chunk too; ``shuffle=False`` keeps token order.

    Reading: the windows of one storage chunk are read as one block; ``prefetch`` blocks ahead are
    read in a background thread while the current block's windows are yielded (0: none).
    ``pin_memory``: blocks land in pinned memory (needs CUDA; for a loop without worker processes:
    with workers, pass ``pin_memory=True`` to the ``DataLoader`` instead); windows are views of
    their block.

    ``dequantise=False`` on a compact cache (``--states fp8``): ``hidden_states`` as stored, float8_e4m3fn,
    with ``hidden_states_scale [W, K]`` float32: half the bytes to move, dequantised where the model
    runs (``hscache.store.compact.dequantise_tensor(h, scale, dtype)``, any device). By default (True)
    every cache's items hold its source dtype.
    """

    def __init__(
        self,
        path_or_url: Any,
        window: int,
        layer_ids: list[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        prefetch: int = 1,
        pin_memory: bool = False,
        dequantise: bool = True,
    ):
        _check_rank(rank, world_size)
        if window < 1:
            raise InputError(f"window {window}: need a window of at least 1 token")
        if prefetch < 0:
            raise InputError(f"prefetch {prefetch}: need 0 (no read-ahead) or more blocks")
        self.prefetch, self.pin_memory = int(prefetch), bool(pin_memory)
        cache = self._open_handle(path_or_url)
        if hasattr(cache, "shards"):
            raise InputError(
                f"{cache.path} is sharded: PackedWindows cuts one cache's token axis; use SequenceDataset, "
                f"or write one cache with `hscache merge {cache.path} --into DEST`"
            )
        self.window, self.seed, self.shuffle, self.epoch = int(window), int(seed), shuffle, 0
        # The epoch as DataLoader workers see it: shared memory, so set_epoch reaches persistent
        # workers too (each keeps the copy of the dataset it started with).
        self._shared_epoch: Any = multiprocessing.RawValue("q", 0)
        self.rank, self.world_size = rank, world_size
        self.layer_ids = list(cache.layer_ids if layer_ids is None else layer_ids)
        self._positions = _layer_positions(cache, layer_ids)
        self._offsets = np.asarray(cache.index.column("offset").to_numpy(), dtype=np.int64)
        self._prompt = np.asarray(cache.index.column("prompt_len").to_numpy(), dtype=np.int64)
        self._chunk = cache.specs["hidden_states"].chunk_tokens
        self._windows = cache.num_tokens // self.window
        self._names = [n for n in ("token_ids", "target_argmax") if n in cache.specs]
        self._has_mask = "loss_mask" in cache.specs
        # Raw fp8 items only from a compact cache: any other cache's states are its source dtype already.
        self._fp8 = not dequantise and "states" in cache.manifest

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call on every rank with the same value before iterating)."""
        self.epoch = int(epoch)
        if self._shared_epoch is not None:
            self._shared_epoch.value = self.epoch

    def _epoch(self) -> int:
        return self.epoch if self._shared_epoch is None else int(self._shared_epoch.value)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if get_spawning_popen() is None:  # a plain pickle, not a worker being started: keep a number
            state["_shared_epoch"] = None
        return state

    def _plan(self) -> tuple[list[np.ndarray], np.ndarray]:
        """(windows grouped by the storage chunk of their first token, this rank's group order)."""
        starts = np.arange(self._windows, dtype=np.int64) * self.window
        bounds = np.flatnonzero(np.diff(starts // self._chunk)) + 1
        groups = np.split(np.arange(self._windows), bounds) if self._windows else []
        rng = np.random.default_rng([self.seed, self._epoch()])
        order = rng.permutation(len(groups)) if self.shuffle else np.arange(len(groups))
        return groups, order[self.rank :: self.world_size]

    def _groups(self) -> list[np.ndarray]:
        """This rank's and this worker's windows, one array per storage chunk, in visiting order."""
        groups, mine = self._plan()
        info = get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        rng = np.random.default_rng([self.seed, self._epoch(), self.rank, 0 if info is None else info.id + 1])
        return [rng.permutation(groups[int(g)]) if self.shuffle else groups[int(g)] for g in mine]

    def __len__(self) -> int:
        """Windows this rank yields per epoch (all its workers together)."""
        groups, mine = self._plan()
        return int(sum(len(groups[int(g)]) for g in mine))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        groups = self._groups()
        _ = self.cache  # open the handle here, not in the reader thread
        if not self.prefetch:
            for windows in groups:
                yield from self._windows_of(windows, self._block(windows))
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hscache-windows")
        pending: deque[tuple[np.ndarray, Future]] = deque()
        try:
            for windows in groups:
                pending.append((windows, pool.submit(self._block, windows)))
                if len(pending) > self.prefetch:
                    first, future = pending.popleft()
                    yield from self._windows_of(first, future.result())
            while pending:
                first, future = pending.popleft()
                yield from self._windows_of(first, future.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _block(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows of every array from the first to the last of ``windows`` (one storage chunk's)."""
        cache, w = self.cache, self.window
        first, last = int(windows.min()) * w, (int(windows.max()) + 1) * w
        if self._fp8:
            hidden, scales = _fp8_hidden(cache, first, last, self._positions)
            if self.pin_memory:
                hidden, scales = hidden.pin_memory(), scales.pin_memory()
            block = {"hidden_states": hidden, "hidden_states_scale": scales}
        else:
            block = {"hidden_states": _hidden(cache, first, last, self._positions, self.pin_memory)}
        for name in self._names:
            block[name] = _tensor(cache, name, first, last)
        if self._has_mask:
            block["loss_mask"] = cache.rows("loss_mask", first, last) != 0
        tokens = np.arange(first, last, dtype=np.int64)
        seq = np.searchsorted(self._offsets, tokens, side="right") - 1
        position = tokens - self._offsets[seq]
        if not self._has_mask:
            block["loss_mask"] = torch.from_numpy(position >= self._prompt[seq])
        block["position_ids"] = torch.from_numpy(position)
        block["sequence_ids"] = torch.from_numpy(seq)
        return block

    def _windows_of(self, windows: np.ndarray, block: dict[str, torch.Tensor]) -> Iterator[dict[str, Any]]:
        w, first = self.window, int(windows.min()) * self.window
        for k in windows:
            a = int(k) * w - first
            item: dict[str, Any] = {name: t[a : a + w] for name, t in block.items()}
            item["start"] = int(k) * w
            yield item
