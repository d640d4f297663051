"""What a cache directory holds and how each array is chunked and compressed.

    cache/                       (written by hscache/store/..., read by ...)
      manifest.json              the commit record: which tokens and index parts exist (truth)
                                 writer.py; reader.py
      provenance.json            how the rows were computed (schemas/provenance.schema.json)
                                 cache_dir.py; cache_dir.py
      runs.json                  what each run did: times, host, versions (outside the digest)
                                 run_log.py; run_log.py
      zarr.json, arrays/...      zarr v3 group; token-major ragged arrays, one row per token
                                 writer.py; chunks.py, reader.py
      index/part-NNNNNN.parquet  per-sequence rows (offset, length, prompt_len, hashes, metadata)
                                 writer.py; index.py
      target/                    config.json, head.safetensors, tokenizer files
                                 target_files.py; target_files.py
      .hscache-creating          a fresh run's mark until its first manifest
                                 cache_dir.py; writer.py removes it

Remote copies (remote.py) and merged shards (shards.py) copy these files as they are.

All arrays are flat along the token axis (sequence i = rows offset..offset+length), so one
sequence is one contiguous slice (random access) and a full scan reads chunks in order
(streaming). Chunks hold whole powers of two of tokens, sized to ``chunk_bytes`` and no larger than
the tokens the writer can write (``max_tokens``): zarr stores an edge chunk at its full shape, so a
100-token cache in 1M-token chunks would take megabytes of padding per array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ARRAYS_GROUP",
    "ArraySpec",
    "CREATING_MARK",
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "IMPORTING_MARK",
    "INDEX_DIR",
    "LOGICAL_TO_STORED",
    "MANIFEST",
    "MAX_CHUNK_TOKENS",
    "MIN_CHUNK_TOKENS",
    "PROVENANCE",
    "RUN_LOG",
    "SAMPLED_ARRAYS",
    "TARGET_DIR",
    "WRITER_LOCK",
    "array_specs",
    "chunk_key",
    "chunk_tokens_for",
    "codecs_for",
    "sampled_array_specs",
    "spec_for",
]

FORMAT_NAME = "hscache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROVENANCE = "provenance.json"
# One entry per run that wrote the cache (store/run_log.py): sealed by the manifest, not in the digest.
RUN_LOG = "runs.json"
ARRAYS_GROUP = "arrays"
INDEX_DIR = "index"
TARGET_DIR = "target"
# Written first into an empty --out and removed once the first manifest is durable: a directory
# holding it but no manifest is a fresh run that was killed early, safe to wipe and restart.
CREATING_MARK = ".hscache-creating"
# Held (flock) by the one process writing the cache (store/lock.py); never part of the cache's content.
WRITER_LOCK = ".hscache-writer.lock"
# Written into --out by `hscache import` first and removed last: a cache holding it is a killed
# import, which the same command starts over (interop/common.py).
IMPORTING_MARK = ".hscache-importing"

# zarr 3.1 has no bfloat16: store the raw 16 bits as uint16 and name the logical dtype in the
# array's attributes. Bit-exact, and readable by any zarr reader without a registration. fp8 states
# (--states fp8, store/compact.py) likewise: float8_e4m3fn bits as uint8.
LOGICAL_TO_STORED = {
    "bfloat16": "uint16",
    "float16": "float16",
    "float32": "float32",
    "float8_e4m3fn": "uint8",
}

# Measured on bf16 hidden states at real dimensions (bench/training_read.py, docs/storage.md): "none"
# (the default) reads 2-3x faster than "fast" warm and ~1.5x cold on 2 cores, writes as fast, and
# stores 15% more bytes; "fast" (lz4 + bitshuffle) for archives and transfers, "balanced" 8% smaller still.
COMPRESSIONS = ("balanced", "fast", "none")
DEFAULT_COMPRESSION = "none"


@dataclass(frozen=True)
class ArraySpec:
    name: str  # fixed on-disk name; survives renames in code
    row_shape: tuple[int, ...]  # shape of one token's row
    logical_dtype: str  # numpy/ml_dtypes name of what readers get back
    chunk_tokens: int

    @property
    def stored_dtype(self) -> str:
        return LOGICAL_TO_STORED.get(self.logical_dtype, self.logical_dtype)

    @property
    def bytes_per_token(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.stored_dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "row_shape": list(self.row_shape),
            "logical_dtype": self.logical_dtype,
            "stored_dtype": self.stored_dtype,
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> ArraySpec:
        return cls(name, tuple(d["row_shape"]), d["logical_dtype"], int(d["chunk_tokens"]))


def chunk_key(spec: ArraySpec, chunk_index: int) -> str:
    """The chunk file of token-chunk ``chunk_index`` inside the array's directory (zarr v3 default
    encoding; row dimensions are never split, so their chunk coordinates are 0)."""
    return "/".join(["c", str(chunk_index), *["0"] * len(spec.row_shape)])


# Chunk lengths in tokens. The floor keeps a tiny array's chunk files few KiB, not a file per row; a
# cache of over MAX_CHUNK_TOKENS tokens is never capped by its token bound.
MIN_CHUNK_TOKENS = 256
MAX_CHUNK_TOKENS = 1 << 20


def chunk_tokens_for(bytes_per_token: int, chunk_bytes: int, max_tokens: int | None = None) -> int:
    """The largest power of two of tokens whose chunk fits ``chunk_bytes`` (256 .. 1M tokens), and at
    most ``max_tokens`` rounded up to a power of two when the writer knows that bound on what it writes.

    Every chunk file, an edge chunk too, holds ``chunk_tokens`` rows, so the cap is what keeps a small
    cache small; readers take ``chunk_tokens`` from the manifest and never assume a size.
    """
    tokens = max(1, chunk_bytes // max(1, bytes_per_token))
    fit = 1 << (tokens.bit_length() - 1)
    if max_tokens is not None:
        fit = min(fit, 1 << max(0, max_tokens - 1).bit_length())  # the power of two >= max_tokens
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, fit)))


def spec_for(
    name: str, row_shape: tuple[int, ...], dtype: str, chunk_bytes: int, max_tokens: int | None = None
) -> ArraySpec:
    """One array's spec, its chunk length from ``chunk_tokens_for`` (the same rule for every writer)."""
    per_token = ArraySpec(name, row_shape, dtype, 1).bytes_per_token
    return ArraySpec(name, row_shape, dtype, chunk_tokens_for(per_token, chunk_bytes, max_tokens))


def _specs(
    rows: dict[str, tuple[tuple[int, ...], str]], chunk_bytes: int, max_tokens: int | None
) -> dict[str, ArraySpec]:
    return {
        name: spec_for(name, shape, dtype, chunk_bytes, max_tokens) for name, (shape, dtype) in rows.items()
    }


def array_specs(
    num_layers: int,
    hidden_size: int,
    hidden_dtype: str,
    top_k: int,
    vocab_size: int | None,
    chunk_bytes: int,
    max_tokens: int | None = None,
) -> dict[str, ArraySpec]:
    """The arrays of one cache; ``vocab_size`` adds full logits (``--full-logits``); ``max_tokens``
    (an upper bound on the tokens the cache will hold, None: unknown) caps the chunk length."""
    rows: dict[str, tuple[tuple[int, ...], str]] = {
        "hidden_states": ((num_layers, hidden_size), hidden_dtype),
        "token_ids": ((), "int32"),
        "target_argmax": ((), "int32"),
        "target_topk_values": ((top_k,), "float32"),
        "target_topk_ids": ((top_k,), "int32"),
        "target_logsumexp": ((), "float32"),
    }
    if vocab_size:
        rows["target_logits"] = ((vocab_size,), "float32")
    return _specs(rows, chunk_bytes, max_tokens)


# A sampled cache's (hscache/store/sampling.py) per-token support of the processed distribution: row t
# holds the distribution of token t + 1 for t in prompt_len - 1 .. length - 2 (ids -1 / probability 0
# past the support and on every other row), and p(token t + 1) (NaN where no token was drawn).
SAMPLED_ARRAYS = ("sampled_support_ids", "sampled_support_probs", "sampled_token_prob")


def sampled_array_specs(
    support_width: int, chunk_bytes: int, max_tokens: int | None = None
) -> dict[str, ArraySpec]:
    """The arrays a sampled cache adds to ``array_specs``: support ids and probabilities
    ``[support_width]`` (int32, float32), the realised token's probability (float32)."""
    rows = dict(
        zip(SAMPLED_ARRAYS, (((support_width,), "int32"), ((support_width,), "float32"), ((), "float32")))
    )
    return _specs(rows, chunk_bytes, max_tokens)


def codecs_for(spec: ArraySpec, compression: str) -> list[Any]:
    """zarr v3 bytes-to-bytes codecs; crc32c is always last so any flipped bit is caught."""
    from zarr.codecs import BloscCodec, Crc32cCodec

    itemsize = np.dtype(spec.stored_dtype).itemsize
    if compression == "none":
        chain: list[Any] = []
    elif compression == "fast":
        chain = [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=itemsize)]
    elif compression == "balanced":
        chain = [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=itemsize)]
    else:
        raise ValueError(f"compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
    return [*chain, Crc32cCodec()]
