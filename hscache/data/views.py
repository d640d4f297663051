"""The cache as an ``xarray.Dataset`` of lazy dask arrays: analysis with xarray/dask.

Each array of ``arrays/`` becomes a variable along a ``token`` dimension (cut to the committed
tokens: rows past them do not exist yet), chunked like the store (one dask chunk per zarr
chunk), each chunk read through the cache's checked reader (crc32c and its recorded sha256, as
the scorer reads it). bfloat16, stored as raw uint16 bits, is viewed back as ``ml_dtypes.bfloat16`` (exact;
``.astype("float32")`` to compute). A compact cache's fp8 ``hidden_states`` (store/compact.py) are
dequantised block by block to its source dtype (bfloat16 as ``ml_dtypes.bfloat16``), its scales
kept as ``hidden_states_scale``. The index becomes variables along ``sequence``
(``offset``, ``length``, ``prompt_len``, ``record_id``...), so sequence i is
``ds.isel(token=slice(offset[i], offset[i] + length[i]))``.

Needs ``xarray`` (``pip install xarray``); dask is a dependency of hscache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.errors import CacheFormatError, InputError
from hscache.store.integrity import cache_digest
from hscache.store.open import open_cache
from hscache.store.reader import Cache
from hscache.store.urls import absolute_location

__all__ = ["open_xarray"]

_DIMS = {
    "hidden_states": ("token", "layer", "hidden"),
    "target_topk_values": ("token", "k"),
    "target_topk_ids": ("token", "k"),
    "target_logits": ("token", "vocab"),
    "hidden_states_scale": ("token", "layer"),
}


def _numpy_dtype(logical: str) -> np.dtype:
    if logical == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(logical)


def _dequantised(bits: np.ndarray, scales: np.ndarray, dtype_name: str) -> np.ndarray:
    """One block of fp8 bits ``[n, K, H]`` and its scales ``[n, K, 1]`` -> the source dtype."""
    from hscache.store.compact import dequantise_numpy

    return dequantise_numpy(bits, scales[..., 0]).astype(_numpy_dtype(dtype_name), copy=False)


def _bf16_view(block: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return block.view(ml_dtypes.bfloat16)


class _CheckedRows:
    """Rows of one array for ``da.from_array``: each block read through the cache's checked reader
    (crc32c and every chunk's sha256, as the scorer reads them), never zarr's crc32c-only decode
    (issue 52). Pickles as the cache's location and digest: a dask worker opens the cache itself
    and refuses one whose digest is not the one the view was built on."""

    def __init__(self, cache: Cache, name: str, digest: str):
        self._cache: Cache | None = cache
        self.location = str(getattr(cache, "url", None) or absolute_location(cache.path))
        self.name, self.digest = name, digest
        spec = cache.specs[name]
        self.shape = (cache.num_tokens, *spec.row_shape)
        self.dtype = np.dtype(spec.stored_dtype)
        self.ndim = len(self.shape)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}

    def _open(self) -> Cache:
        if self._cache is None:
            cache = open_cache(self.location)
            if cache_digest(cache) != self.digest:
                raise CacheFormatError(
                    f"{self.location} changed after open_xarray opened it (digest {cache_digest(cache)}, "
                    f"not {self.digest}); open the view again"
                )
            self._cache = cache
        return self._cache

    def __getitem__(self, key: tuple[slice, ...]) -> np.ndarray:
        rows = key[0] if isinstance(key, tuple) else key
        start, stop, _ = rows.indices(self.shape[0])
        block = self._open().read_tokens(self.name, start, stop)
        return block[(slice(None), *key[1:])] if isinstance(key, tuple) and len(key) > 1 else block


def _checked_array(cache: Cache, name: str, digest: str) -> Any:
    """One array as a dask array, one dask chunk per zarr chunk, each read through ``_CheckedRows``."""
    import dask.array as da

    spec = cache.specs[name]
    chunks = (spec.chunk_tokens, *spec.row_shape)
    return da.from_array(
        _CheckedRows(cache, name, digest), chunks=chunks, name=f"hscache-{name}-{digest}", lock=False
    )


def open_xarray(path_or_cache: Any) -> Any:
    """An ``xarray.Dataset`` over the cache at ``path_or_cache`` (a path, URL or open ``Cache``).

    Raises:
        InputError: xarray is not installed.
        CacheNotFoundError, CacheFormatError: as ``open_cache``.
    """
    try:
        import xarray as xr
    except ImportError as exc:
        raise InputError("open_xarray needs xarray; pip install xarray") from exc
    import dask.array as da

    cache = path_or_cache if isinstance(path_or_cache, Cache) else open_cache(path_or_cache)
    variables: dict[str, Any] = {}
    digest = cache_digest(cache)
    for name, spec in cache.specs.items():
        cache.array(name)  # a directory of shards has none: refused by name
        data = _checked_array(cache, name, digest)
        if name == "hidden_states" and "states" in cache.manifest:
            from hscache.store.compact import SCALE_ARRAY, states_dtype

            logical = states_dtype(cache.manifest)
            scales = _checked_array(cache, SCALE_ARRAY, digest).rechunk((data.chunks[0], -1))
            data = da.map_blocks(
                _dequantised, data, scales[:, :, None], dtype=_numpy_dtype(logical), dtype_name=logical
            )
        elif spec.logical_dtype == "bfloat16":
            import ml_dtypes

            data = data.map_blocks(_bf16_view, dtype=ml_dtypes.bfloat16)
        dims = _DIMS.get(name, ("token",))[: 1 + len(spec.row_shape)]
        variables[name] = (dims, data)
    index = cache.index
    for column in index.column_names:
        if column == "metadata_json":
            continue
        values = index.column(column).to_numpy(zero_copy_only=False)
        variables[column] = (("sequence",), values)
    coords = {"layer": ("layer", np.asarray(cache.layer_ids, dtype=np.int64))}
    attrs = {
        "path": str(getattr(cache, "url", cache.path)),
        "layer_ids": list(cache.layer_ids),
        "compression": cache.manifest.get("compression"),
    }
    return xr.Dataset(variables, coords=coords, attrs=attrs)
