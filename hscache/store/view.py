"""``CacheView``: what every kind of cache offers its readers (the scorer, verify, diff).

``Cache`` (a local directory), ``RemoteCache`` (an fsspec URL), ``ShardedCache`` (a directory
of shards) and ``RowRangeView`` (rows of any of them served from memory) all implement it; the
contract test (tests/hscache/test_cache_contract.py) reads the same data through each.
Per-sequence accessors take a row number ``i`` of ``index`` and return torch tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pyarrow as pa

if TYPE_CHECKING:  # hints only: opening a cache (`hscache info`) must not import torch
    import torch

from hscache.store.layout import ArraySpec
from hscache.store.sampling import SamplingSetting

__all__ = ["CacheView"]


@runtime_checkable
class CacheView(Protocol):
    """A read-only cache: its settings, per-sequence index, per-token arrays and target files."""

    path: Path  # the directory (a remote cache: the local mirror of its small files)
    index: pa.Table  # one row per committed sequence; metadata keys expanded into columns

    @property
    def layer_ids(self) -> list[int]: ...
    @property
    def dtype(self) -> torch.dtype: ...  # of the hidden states
    @property
    def num_tokens(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    @property
    def settings(self) -> dict[str, Any]: ...
    @property
    def manifest(self) -> dict[str, Any]: ...
    @property
    def specs(self) -> dict[str, ArraySpec]: ...
    @property
    def provenance(self) -> dict[str, Any]: ...
    @property
    def target_config(self) -> dict[str, Any]: ...
    @property
    def mask_token_id(self) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...

    def __len__(self) -> int: ...
    def hidden_states(self, i: int) -> torch.Tensor:
        """``[T, K, H]`` in ``dtype``; K follows ``layer_ids``."""
        ...

    def token_ids(self, i: int) -> torch.Tensor:
        """``[T]`` int64."""
        ...

    def target_argmax(self, i: int) -> torch.Tensor:
        """``[T]`` int64: the target's greedy prediction for position t + 1, at each position t."""
        ...

    def target_topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values ``[T, k]`` float32 logits, ids ``[T, k]`` int64), sorted descending."""
        ...

    def target_logsumexp(self, i: int) -> torch.Tensor:
        """``[T]`` float32 log-sum-exp of the full logits."""
        ...

    def target_logits(self, i: int) -> torch.Tensor:
        """``[T, V]`` float32 (only in caches written with ``--full-logits``)."""
        ...

    @property
    def sampling(self) -> SamplingSetting: ...  # hscache.store.sampling: GREEDY when none is recorded
    def sampled_support(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ``[T, W]`` int64, probs ``[T, W]`` float32): the processed distribution of token t + 1
        at row t, -1 / 0 past its support (sampled caches only)."""
        ...

    def realised_prob(self, i: int) -> torch.Tensor:
        """``[T]`` float32: p(token t + 1) at row t, NaN where no token was drawn (sampled caches only)."""
        ...

    def target_head(self) -> dict[str, torch.Tensor]:
        """``{"embed_tokens": [V, H], "lm_head": [V, H]}`` and the saved ``final_norm.*`` tensors."""
        ...

    def target_mtp(self) -> dict[str, torch.Tensor]:
        """The target's own MTP head (``mtp.*`` tensors); {} when the cache has none."""
        ...

    def tokenizer(self) -> Any:
        """The target's tokenizer, loaded from ``target/``."""
        ...
