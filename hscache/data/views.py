"""The cache as an ``xarray.Dataset`` of lazy dask arrays: analysis with xarray/dask, no copy.

Each array of ``arrays/`` becomes a variable along a ``token`` dimension (cut to the committed
tokens: rows past them do not exist yet), chunked like the store (one dask chunk per zarr
chunk). bfloat16, stored as raw uint16 bits, is viewed back as ``ml_dtypes.bfloat16`` (exact;
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

from hscache.errors import InputError
from hscache.store.open import open_cache
from hscache.store.reader import Cache

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
    n = cache.num_tokens
    variables: dict[str, Any] = {}
    for name, spec in cache.specs.items():
        data = da.from_zarr(cache.array(name))[:n]
        if name == "hidden_states" and "states" in cache.manifest:
            from hscache.store.compact import SCALE_ARRAY, states_dtype

            logical = states_dtype(cache.manifest)
            scales = da.from_zarr(cache.array(SCALE_ARRAY))[:n].rechunk((data.chunks[0], -1))
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
