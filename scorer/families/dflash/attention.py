"""Attention masks and kernels of the batched drafter forward (scorer.families.dflash.model).

The masks are z-lab's ``_attention_mask`` (dflash/model.py) applied to many blocks at once:
block i sees context keys before its anchor and its own block's keys, restricted per layer by
causality inside the block and by a sliding window over absolute positions. `block_sparse_mask`
is the SDPA boolean form, `flex_mask_mod` the flex_attention form of the same predicate.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionBackend",
    "block_sparse_mask",
    "flex_attend",
    "flex_mask",
    "flex_mask_mod",
    "pick_flex",
    "sdpa_attend",
    "visible",
]

AttentionBackend = Literal["auto", "sdpa", "flex"]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """z-lab ``_attention_mask`` over absolute positions (broadcasting): True = attend.

    Causal: ``k <= q``. Window W: ``q - k < W`` (W keys including the query's own position),
    and for non-causal layers also ``k - q < W``.
    """
    out = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        out &= k_pos <= q_pos
    if window is not None:
        out &= q_pos - k_pos < window
        if not causal:
            out &= k_pos - q_pos < window
    return out


def block_sparse_mask(
    anchors: torch.Tensor, B: int, t_c: int, causal: bool = False, window: int | None = None
) -> torch.Tensor:
    """Boolean [n*B, t_c + n*B]: block i sees context keys < anchor_i and its own block's keys,
    restricted as z-lab's mask restricts one block's forward (causal / sliding window)."""
    n, dev = anchors.shape[0], anchors.device
    slot = torch.arange(B, device=dev)
    q_pos = (anchors[:, None] + slot).reshape(-1, 1)  # [n*B, 1] absolute positions
    k_ctx = torch.arange(t_c, device=dev)[None]  # [1, t_c]
    ctx_ok = (k_ctx < anchors.repeat_interleave(B)[:, None]) & visible(q_pos, k_ctx, causal, window)
    own = torch.eye(n, dtype=torch.bool, device=dev).repeat_interleave(B, 0).repeat_interleave(B, 1)
    in_block = visible(slot.repeat(n)[:, None], slot.repeat(n)[None], causal, window)  # same block only
    return torch.cat([ctx_ok, own & in_block], dim=1)


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # q [M, heads, D], k/v [S, kv, D] -> [M, heads, D]; GQA by repeating kv heads.
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask)[0].transpose(0, 1)


def pick_flex(backend: AttentionBackend, device: torch.device) -> bool:
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"backend must be 'auto', 'sdpa' or 'flex', got {backend!r}")
    if backend == "sdpa":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as e:
        if backend == "flex":
            raise ValueError("backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)") from e
        return False
    return backend == "flex" or device.type == "cuda"


def flex_mask_mod(anchors: torch.Tensor, B: int, t_c: int, causal: bool, window: int | None) -> Any:
    """flex_attention ``mask_mod`` equal to `block_sparse_mask` (tested densely on CPU)."""
    # t_c as a tensor: a compiled kernel would otherwise guard on (and recompile for) each value.
    t_ctx = torch.tensor(t_c, device=anchors.device)

    def mask_mod(b, h, q_idx, kv_idx):
        block, q_slot = q_idx // B, q_idx % B
        q_pos = anchors[block] + q_slot
        is_ctx = kv_idx < t_ctx
        k_slot = kv_idx - t_ctx
        # Context keys sit at their absolute position, block keys at anchor + slot.
        k_pos = torch.where(is_ctx, kv_idx, anchors[block] + k_slot % B)
        ok = torch.where(is_ctx, kv_idx < anchors[block], k_slot // B == block)
        if causal:
            ok = ok & (k_pos <= q_pos)
        if window is not None:
            ok = ok & (q_pos - k_pos < window)
            if not causal:
                ok = ok & (k_pos - q_pos < window)
        return ok

    return mask_mod


def flex_mask(
    anchors: torch.Tensor, B: int, t_c: int, causal: bool = False, window: int | None = None
) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = flex_mask_mod(anchors, B, t_c, causal, window)
    n = anchors.shape[0]
    return create_block_mask(mask_mod, None, None, n * B, t_c + n * B, device=anchors.device)


_compiled_flex: Any = None


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:  # uncompiled flex materialises all scores; compile once per process on GPU
        _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    out = fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
