"""Compact hidden states (``--states fp8``): float8_e4m3fn bits plus a float32 scale per token and layer.

A compact cache stores ``hidden_states`` as the raw bits of float8_e4m3fn (``uint8``: zarr 3.1 has
no fp8 data type, as it has no bfloat16, store/layout.py) and ``hidden_states_scale`` ``[T, K]``
float32, ``scale = absmax / 448`` over the token's row of each layer (448: e4m3fn's largest finite
value). Never a plain cast: attention-sink tokens reach values past 448, which a cast saturates
(48% error, spec/compact.md); with the scale every row uses the full range (2.5% relative L2 on the
built-in target). A zero row has scale 0 and reads back as zeros.

Every reader dequantises to the **source dtype** (the dtype the cache was extracted in, recorded as
``manifest["states"]["dtype"]``: bfloat16 or float32), so ``cache.dtype``, ``cache.hidden_states(i)``,
``cache.rows("hidden_states", ...)``, the torch datasets, row ranges, xarray and export all see the
dtype they saw before the conversion. ``read_tokens`` / ``iter_tokens`` stay raw (stored dtype:
the uint8 bits), as they are for bfloat16's uint16. Dequantisation is one fused pass
(``hscache.store.fp8_decode``) straight into the reader's tensor: never a float32 copy of a read.

The exact slice: a few sequences whose states are also kept at the source dtype, in
``exact/hidden_states`` (a zarr v3 array, the exact sequences one after another in row order,
crc32c and one sha256 per chunk like every array). Which sequences: those whose
``sha256(f"{seed}:{record_id}")`` is 0 modulo ``every`` (at least one: the smallest hash), a rule
recorded in the manifest with the rows it chose. ``scorer eval`` scores them both ways.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hscache.errors import CacheFormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXACT_ARRAY",
    "FP8",
    "FP8_MAX",
    "SCALE_ARRAY",
    "STATES",
    "dequantise",
    "dequantise_numpy",
    "dequantise_tensor",
    "exact_problems",
    "exact_rows_for",
    "exact_states",
    "is_compact",
    "quantise",
    "quantise_per_token",
    "read_states",
    "relative_l2_per_layer",
    "states_dtype",
]

STATES = ("source", "fp8")  # --states: the source dtype (lossless, the default) or fp8 e4m3fn + scales
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # e4m3fn's largest finite value
SCALE_ARRAY = "hidden_states_scale"
EXACT_ARRAY = "exact/hidden_states"
# Tokens quantised at a time: a float32 temporary of 256 x K x H (20 MB at K 4, H 5120), never [T, K, H].
_BLOCK_TOKENS = 256


def is_compact(manifest: dict[str, Any]) -> bool:
    """True when the cache stores its hidden states as fp8 bits plus scales."""
    return (manifest.get("states") or {}).get("codec") == FP8


def states_dtype(manifest: dict[str, Any]) -> str:
    """The logical dtype every reader returns hidden states in: the source dtype of a compact cache."""
    if is_compact(manifest):
        return str(manifest["states"]["dtype"])
    return str(manifest["arrays"]["hidden_states"]["logical_dtype"])


def quantise(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``[n, K, H]`` rows (any float dtype) -> (float8_e4m3fn bits ``uint8 [n, K, H]``, scales
    ``float32 [n, K]``), ``scale = absmax / 448`` per token and layer, in blocks of tokens.

    Raises:
        ValueError: a row holds NaN or inf (fp8 with a scale cannot hold them: say where).
    """
    import torch

    n = rows.shape[0]
    bits = np.empty(tuple(rows.shape), np.uint8)
    scales = np.empty(tuple(rows.shape[:2]), np.float32)
    for a in range(0, n, _BLOCK_TOKENS):
        block = rows[a : a + _BLOCK_TOKENS].float()
        absmax = block.abs().amax(dim=-1)
        if not bool(torch.isfinite(absmax).all()):
            bad = int(torch.nonzero(~torch.isfinite(absmax))[0, 0]) + a
            raise ValueError(f"hidden states at token {bad} hold NaN or inf: fp8 states cannot store them")
        scale = absmax / FP8_MAX
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (block / divisor.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        bits[a : a + len(block)] = q.view(torch.uint8).numpy()
        scales[a : a + len(block)] = scale.numpy()
    return bits, scales


def dequantise(
    bits: np.ndarray, scales: np.ndarray, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8 bits ``uint8 [..., H]`` and scales ``[...]`` -> ``[..., H]`` of ``dtype``: bit for bit
    ``(torch's float8_e4m3fn -> float32 cast * scale)`` rounded once to ``dtype`` (tested over every
    byte), written into ``out``.

    bfloat16 and float32 (every source dtype a cache has) take the fused one-pass kernel
    (``hscache.store.fp8_decode``: a byte's exact fp32 value times the scale, rounded in the same
    pass; no temporary). A read holding NaN bytes or a non-finite scale (none that ``quantise``
    writes), another dtype or a non-contiguous ``out`` takes torch's cast, ``_BLOCK_TOKENS`` tokens
    at a time (never a float32 copy of a whole read). Measured in docs/storage.md."""
    import torch

    if out is None:
        out = torch.empty(tuple(bits.shape), dtype=dtype)
    bits = np.ascontiguousarray(bits)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if dtype in (torch.bfloat16, torch.float32) and out.is_contiguous():
        from hscache.store.fp8_decode import decode_rows

        rows = (scales.size, bits.shape[-1])
        view = out.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else out.numpy()
        if decode_rows(bits.reshape(rows), scales.reshape(-1), view.reshape(rows)):
            return out
    for a in range(0, bits.shape[0], _BLOCK_TOKENS):
        values = torch.from_numpy(bits[a : a + _BLOCK_TOKENS]).view(torch.float8_e4m3fn).float()
        out[a : a + len(values)].copy_(
            values.mul_(torch.from_numpy(scales[a : a + _BLOCK_TOKENS]).unsqueeze(-1))
        )
    return out


def dequantise_tensor(hidden: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn ``[..., K, H]`` and float32 scales ``[..., K]`` -> ``dtype``, on their device (e.g.
    a GPU, after ``PackedWindows(..., dequantise=False)`` moved half the bytes): the values readers get."""
    return (hidden.float() * scales.float().unsqueeze(-1)).to(dtype)


def dequantise_numpy(bits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """As ``dequantise``, float32 numpy (verify's statistics, the xarray view's blocks)."""
    import torch

    return dequantise(bits, scales, torch.float32).numpy()


def read_states(cache: Any, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden-state rows ``[start, stop)`` of a compact ``Cache``, dequantised to its source dtype,
    one storage chunk of bits (and its scales, both checked as every read is) at a time.

    Raises:
        ValueError: ``out`` of the wrong shape or dtype; as ``Cache.read_tokens`` otherwise.
    """
    import torch

    from hscache.store.dtypes import torch_dtype_of_logical

    spec = cache.specs["hidden_states"]
    dtype = torch_dtype_of_logical(states_dtype(cache.manifest))
    shape = (stop - start, *spec.row_shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(f"hidden_states: out is {tuple(out.shape)} {out.dtype}, need {shape} {dtype}")
    # copy=False: a local uncompressed chunk is decoded straight from its mapped file (checked on
    # first touch as every read is), not copied first: 0.79-1.08x of codec none warm against 0.67-0.69x
    # with the copy (docs/storage.md); compressed or remote chunks are read as always.
    for a, bits in cache.iter_tokens("hidden_states", start, stop, copy=False):
        b = a + len(bits)
        dequantise(bits, cache.read_tokens(SCALE_ARRAY, a, b), dtype, out[a - start : b - start])
    return out


def quantise_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs-connectors' fp8 format (0.9.0 ``fp8_utils.quantize_tensor_to_fp8``, what speculators' fp8
    backend reads): ``[T, K, H]`` -> (float8_e4m3fn ``[T, K, H]``, float32 scales ``[T, 1, 1]``), one
    scale per token over all layers, ``max(absmax / 448, 1e-12)``. For export only: a per-token scale
    is set by the token's largest layer, so the others lose range (spec/compact.md)."""
    import torch

    out = torch.empty(tuple(rows.shape), dtype=torch.float8_e4m3fn)
    scales = torch.empty((rows.shape[0], 1, 1), dtype=torch.float32)
    for a in range(0, rows.shape[0], _BLOCK_TOKENS):
        block = rows[a : a + _BLOCK_TOKENS].float()
        scale = (block.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=1e-12)
        out[a : a + len(block)] = (block / scale).to(torch.float8_e4m3fn)
        scales[a : a + len(block)] = scale
    return out, scales


def relative_l2_per_layer(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """``||a - b|| / ||b||`` per layer of ``[T, K, H]`` states (b the reference), in float32."""
    diff = (a.float() - b.float()).pow(2).sum(dim=(0, 2))
    ref = b.float().pow(2).sum(dim=(0, 2)).clamp_min(1e-30)
    return [float(x) for x in (diff / ref).sqrt()]


def exact_rows_for(record_ids: list[str], seed: int, every: int) -> list[int]:
    """The rows of the exact slice: ``sha256(f"{seed}:{record_id}") % every == 0``, at least one."""
    hashes = [int(hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()[:16], 16) for rid in record_ids]
    rows = [i for i, h in enumerate(hashes) if h % every == 0]
    if not rows and hashes:
        rows = [int(np.argmin(hashes))]
    return rows


def _exact_array(root: Path, url: str | None = None) -> Any:
    """The exact slice's zarr array: local, or read through ``url`` (a remote cache's mirror holds
    only its small files)."""
    import zarr

    if url is not None:
        from zarr.storage import FsspecStore

        store = FsspecStore.from_url(f"{url}/{EXACT_ARRAY}", read_only=True)
        return zarr.open_array(store, mode="r", zarr_format=3)
    return zarr.open_array(str(Path(root) / EXACT_ARRAY), mode="r", zarr_format=3)


def exact_states(cache: Any, row: int) -> torch.Tensor | None:
    """Sequence ``row``'s hidden states at the source dtype from the exact slice (None: not in it),
    every chunk it touches checked against its recorded sha256.

    Raises:
        CacheFormatError: the slice is missing, damaged or does not match its recorded sha256.
    """
    from hscache.store.dtypes import tensor_from_stored
    from hscache.store.integrity import rows_sha256

    exact = (cache.manifest.get("states") or {}).get("exact")
    if not exact or row not in exact["rows"]:
        return None
    k = exact["rows"].index(row)
    a, n = int(exact["offsets"][k]), int(cache.lengths[row])
    step, total = int(exact["chunk_tokens"]), int(exact["tokens"])
    lo, hi = a // step * step, min(total, -(-(a + n) // step) * step)
    try:
        rows = np.asarray(_exact_array(cache.path, getattr(cache, "url", None))[lo:hi])
    except Exception as exc:  # zarr: a bad crc32c, a missing file, codec errors
        raise CacheFormatError(
            f"{cache.path}/{EXACT_ARRAY} cannot be read ({exc}); run `hscache verify {cache.path}`"
        ) from exc
    for c in range(lo // step, -(-hi // step)):
        piece = rows[c * step - lo : min(total, (c + 1) * step) - lo]
        if c >= len(exact["chunk_sha256"]) or rows_sha256(piece) != exact["chunk_sha256"][c]:
            raise CacheFormatError(
                f"{cache.path}/{EXACT_ARRAY} chunk {c} does not match its sha256 recorded at commit; "
                f"run `hscache verify {cache.path}`"
            )
    return tensor_from_stored(rows[a - lo : a - lo + n], exact["logical_dtype"])


def exact_problems(root: Path, manifest: dict[str, Any], digests: str) -> list[Any]:
    """What in the exact slice disagrees with the manifest: its zarr.json always, every chunk's
    sha256 with ``digests="all"`` (``hscache verify``). [] for a cache without a slice."""
    from hscache.store.integrity import Mismatch, rows_sha256, zarr_json_sha256

    exact = (manifest.get("states") or {}).get("exact")
    if not exact:
        return []
    meta_path = Path(root) / EXACT_ARRAY / "zarr.json"
    try:
        meta = json.loads(meta_path.read_bytes())
    except (OSError, ValueError):
        return [Mismatch(f"{EXACT_ARRAY}/zarr.json", f"{EXACT_ARRAY}/zarr.json is missing or unreadable")]
    if zarr_json_sha256(meta) != exact.get("zarr_json_sha256"):
        return [
            Mismatch(f"{EXACT_ARRAY}/zarr.json", f"{EXACT_ARRAY}/zarr.json is not the one recorded at commit")
        ]
    if digests != "all":
        return []
    step, total = int(exact["chunk_tokens"]), int(exact["tokens"])
    array = _exact_array(root)
    problems = []
    for c in range(-(-total // step)):
        try:
            got = rows_sha256(np.asarray(array[c * step : min(total, (c + 1) * step)]))
        except Exception as exc:  # zarr: a bad crc32c, a missing chunk
            problems.append(
                Mismatch(f"{EXACT_ARRAY}/c/{c}", f"{EXACT_ARRAY} chunk {c} cannot be read ({exc})")
            )
            continue
        if c >= len(exact["chunk_sha256"]) or got != exact["chunk_sha256"][c]:
            problems.append(
                Mismatch(
                    f"{EXACT_ARRAY}/c/{c}",
                    f"{EXACT_ARRAY} chunk {c} does not match its sha256 recorded at commit",
                )
            )
    return problems
