"""The fused fp8 decode (numba): float8_e4m3fn bits times a scale per row, rounded to bf16 or fp32, in
one pass over the bytes.

``decode_rows`` is what ``hscache.store.compact.dequantise`` runs. Per row: a pass over its bytes
for NaN (``_has_nan``, 32 bytes per vector), then per value, in one loop that LLVM vectorises:

- the byte's e4m3fn value as an exact fp32 (``_e4m3_float32``): for a normal byte ``s eeee mmm``
  the bits ``eeee mmm`` moved to bits 26..20 plus 120 in the exponent (fp32's bias 127 - e4m3's 7)
  are the magnitude; a subnormal (``eeee`` 0) is ``mmm x 2**-9``, converted from the integer; the
  sign bit is or-ed in. Every value is a normal fp32 (>= 2**-9): the numpy decode this replaced
  read e4m3 subnormals as fp32 subnormals, which this CPU multiplies many times slower;
- one fp32 multiply by the row's scale: the same IEEE product as torch's ``float() * scale``;
- for bf16, round to nearest even on the fp32 bits (``_round_bfloat16``: ``(x + 0x7FFF + ((x >> 16)
  & 1)) >> 16``, torch's ``c10::round_to_nearest_even`` for every value that is not NaN).

A row holding a NaN byte (``0x7F``/``0xFF``, which the magnitude rule would read as 480) or a
non-finite scale (whose products can be NaN) makes it return False: NaN's bf16 bits are torch's
business (its vectorised and strided casts differ), so the caller takes torch's cast. Neither occurs
in a cache ``quantise`` wrote. The tests check every byte against torch's cast, bit for bit.

The bit work is LLVM intrinsics (``llvmlite``'s IR builder) in 8- and 32-bit integers: numba types
integer arithmetic on uint8/uint32 as 64-bit, which made the loop run 4 lanes of 64 bits at half
the speed. Measured in docs/storage.md.

Compiled once per output type (``cache=True``: numba keeps the machine code next to this file, or in
its user cache when that is read-only, so a later process loads it instead of compiling; importing
numba costs ~0.3 CPU-s once per process that decodes). One thread with the GIL released (``nogil``):
a prefetching reader decodes in its own thread, and on the shared two cores neither numba's
``parallel=True`` nor a chunk split over two threads read faster (docs/storage.md).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["decode_rows"]

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


@intrinsic
def _e4m3_float32(typingctx, byte):
    """A float8_e4m3fn byte's value as fp32, exactly (NaN bytes read as +-480: the caller checks)."""

    def codegen(context, builder, signature, args):
        b = builder.zext(args[0], _I32)
        m = builder.and_(b, _I32(0x7F))  # exponent and mantissa
        sign = builder.shl(builder.and_(b, _I32(0x80)), _I32(24))
        normal = builder.bitcast(builder.add(builder.shl(m, _I32(20)), _I32(120 << 23)), _F32)
        subnormal = builder.fmul(builder.uitofp(m, _F32), _F32(2.0**-9))
        magnitude = builder.select(builder.icmp_unsigned(">=", m, _I32(8)), normal, subnormal)
        return builder.bitcast(builder.or_(builder.bitcast(magnitude, _I32), sign), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def _round_bfloat16(typingctx, value):
    """fp32 -> bfloat16 bits, round to nearest even (NaN excluded by the caller)."""

    def codegen(context, builder, signature, args):
        x = builder.bitcast(args[0], _I32)
        lsb = builder.and_(builder.lshr(x, _I32(16)), _I32(1))
        rounded = builder.lshr(builder.add(builder.add(x, _I32(0x7FFF)), lsb), _I32(16))
        return builder.trunc(rounded, _I16)

    return types.uint16(types.float32), codegen


@intrinsic
def _or_nan_flag(typingctx, seen, byte):
    """``seen | ((byte & 0x7F) + 1)`` in 8 bits: bit 7 ends up set iff some byte was an e4m3fn NaN
    (``0x7F``/``0xFF``); a pass of 32 bytes per vector."""

    def codegen(context, builder, signature, args):
        return builder.or_(args[0], builder.add(builder.and_(args[1], _I8(0x7F)), _I8(1)))

    return types.uint8(types.uint8, types.uint8), codegen


@njit(nogil=True, error_model="numpy", boundscheck=False, inline="always")
def _has_nan(row):
    seen = np.uint8(0)
    for j in range(row.shape[0]):
        seen = _or_nan_flag(seen, row[j])
    return seen >= 0x80


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
def _decode_float32(bits, scales, out):
    clean = True
    for r in range(bits.shape[0]):
        scale = scales[r]
        if not np.isfinite(scale) or _has_nan(bits[r]):
            clean = False
            continue
        for j in range(bits.shape[1]):
            out[r, j] = _e4m3_float32(bits[r, j]) * scale
    return clean


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
def _decode_bfloat16(bits, scales, out):
    clean = True
    for r in range(bits.shape[0]):
        scale = scales[r]
        if not np.isfinite(scale) or _has_nan(bits[r]):
            clean = False
            continue
        for j in range(bits.shape[1]):
            out[r, j] = _round_bfloat16(_e4m3_float32(bits[r, j]) * scale)
    return clean


def decode_rows(bits: np.ndarray, scales: np.ndarray, out: np.ndarray) -> bool:
    """fp8 bits ``uint8 [R, W]`` x scales ``float32 [R]`` -> ``out [R, W]``: float32, or uint16 holding
    bfloat16 bits; all C-contiguous. False (``out`` then partly written) when a row holds a NaN byte
    or a non-finite scale: the caller decodes those with torch's cast.

    Raises:
        ValueError: ``out`` is neither float32 nor uint16.
    """
    if out.dtype == np.float32:
        return bool(_decode_float32(bits, scales, out))
    if out.dtype == np.uint16:
        return bool(_decode_bfloat16(bits, scales, out))
    raise ValueError(f"decode_rows writes float32 or bfloat16 bits (uint16), not {out.dtype}")
