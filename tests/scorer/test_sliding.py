"""Sliding-window and causal draft layers against the published definition (z-lab dflash 0.1.0).

`_zlab_forward` re-implements, line for line, `dflash/model.py` of the `dflash==0.1.0` wheel
(`_attention_mask`, `apply_rotary_pos_emb`, `Qwen3DFlashAttention.forward`,
`Qwen3DFlashDecoderLayer.forward`, `DFlashDraftModel.forward`) on transformers' own Qwen3
modules, so nothing of scorer.families.dflash.model is shared with the oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RotaryEmbedding, rotate_half

from scorer.families.dflash.attention import block_sparse_mask, flex_mask_mod
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter

V, MASK, W = 100, 99, 8
SPECFORGE_TYPES = ["sliding_attention"] * 2 + ["full_attention"]  # qwen3.6-27b-dflash.json, 3 layers


def _config(**changes) -> DFlashConfig:
    base = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=V,
        attention_bias=False,
        block_size=6,
        mask_token_id=MASK,
        target_layer_ids=(1, 3),
        layer_types=tuple(SPECFORGE_TYPES),
        sliding_window=W,
    )
    return dataclasses.replace(base, **changes)


def _drafter(config: DFlashConfig) -> DFlashDrafter:
    torch.manual_seed(0)
    model = DFlashDrafter(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.attach_target(torch.randn(V, 32, dtype=torch.float64), torch.randn(V, 32, dtype=torch.float64))
    return model


# ---- the oracle: z-lab dflash/model.py (wheel 0.1.0), transcribed ------------------------------
def _attention_mask(query, key, *, is_causal, sliding_window):
    query_position = key.shape[-2] - query.shape[-2] + torch.arange(query.shape[-2])[:, None]
    key_position = torch.arange(key.shape[-2])[None, :]
    visible = torch.ones((query.shape[-2], key.shape[-2]), dtype=torch.bool)
    if is_causal:
        visible &= key_position <= query_position
    if sliding_window is not None:
        visible &= query_position - key_position < sliding_window
        if not is_causal:
            visible &= key_position - query_position < sliding_window
    return visible[None, None]


def _rms(x, w, eps):  # Qwen3RMSNorm
    x32 = x.float() if x.dtype != torch.float64 else x
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _zlab_forward(
    model: DFlashDrafter, hf: Qwen3Config, ctx: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """DFlashDraftModel.forward + compute_logits for one block anchored at p = len(ctx)."""
    sd = {k: v for k, v in model.state_dict().items()}
    eps, hd = hf.rms_norm_eps, hf.head_dim
    p, q_len = ctx.shape[0], block.shape[0]
    target_hidden = _rms(ctx[None] @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    hidden = torch.nn.functional.embedding(block[None], model.embed_weight)
    position_ids = torch.arange(p + q_len)[None]
    cos, sin = Qwen3RotaryEmbedding(hf)(hidden, position_ids)
    for i in range(hf.num_hidden_layers):
        pre = f"layers.{i}."
        layer_type = hf.layer_types[i] if hf.layer_types else "full_attention"
        is_causal = getattr(hf, "is_causal", None)
        is_causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        window = hf.sliding_window if layer_type == "sliding_attention" else None
        residual = hidden
        x = _rms(hidden, sd[pre + "input_layernorm.weight"], eps)
        q = _rms(
            (x @ sd[pre + "self_attn.q_proj.weight"].T).view(1, q_len, -1, hd),
            sd[pre + "self_attn.q_norm.weight"],
            eps,
        ).transpose(1, 2)
        kv_in = torch.cat([target_hidden, x], dim=1)
        k = (kv_in @ sd[pre + "self_attn.k_proj.weight"].T).view(1, p + q_len, -1, hd)
        v = (kv_in @ sd[pre + "self_attn.v_proj.weight"].T).view(1, p + q_len, -1, hd).transpose(1, 2)
        k = _rms(k, sd[pre + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * c[..., -q_len:, :] + rotate_half(q) * s[..., -q_len:, :]
        k = k * c + rotate_half(k) * s
        mask = (
            _attention_mask(q, k, is_causal=is_causal, sliding_window=window)
            if (is_causal or window is not None)
            else None
        )
        rep = hf.num_attention_heads // hf.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
        hidden = residual + out.transpose(1, 2).reshape(1, q_len, -1) @ sd[pre + "self_attn.o_proj.weight"].T
        residual = hidden
        x = _rms(hidden, sd[pre + "post_attention_layernorm.weight"], eps)
        gate, up = x @ sd[pre + "mlp.gate_proj.weight"].T, x @ sd[pre + "mlp.up_proj.weight"].T
        hidden = residual + (torch.nn.functional.silu(gate) * up) @ sd[pre + "mlp.down_proj.weight"].T
    hidden = _rms(hidden, sd["norm.weight"], eps)
    return hidden[0, 1:] @ model.lm_head_weight.T  # draft_hidden[:, 1 - block_size:]


# ---------------------------------------------------------------------------------------------
CASES = [  # (config changes, also run flex: uncompiled flex on CPU is slow, two cases suffice)
    pytest.param({}, True, id="specforge-qwen3.6-layout"),
    pytest.param({"is_causal": False}, True, id="sliding-non-causal"),
    pytest.param({"is_causal": True, "layer_types": ("full_attention",) * 3}, False, id="full-causal"),
    pytest.param({"sliding_window": 3}, False, id="window-smaller-than-block"),
    pytest.param({"layer_types": None}, False, id="classic-full"),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("changes", "with_flex"), CASES)
def test_one_block_and_batched_paths_equal_the_zlab_definition(changes: dict, with_flex: bool) -> None:
    config = _config(**changes)
    model = _drafter(config)
    hf = Qwen3Config(**{k: v for k, v in config.to_hf_config().items() if k != "dflash_config"})
    T = 100
    feats = torch.randn(T, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    anchors = [1, 5, 9, 37, 60, 93]
    blocks = torch.full((len(anchors), config.block_size), MASK)
    blocks[:, 0] = torch.arange(len(anchors)) * 7 % MASK
    want = torch.stack([_zlab_forward(model, hf, feats[:p], blk) for p, blk in zip(anchors, blocks)])
    one = torch.stack([model.forward_one_block(feats, blk, p) for p, blk in zip(anchors, blocks)])
    batched = model.forward_blocks(
        feats, torch.tensor(anchors), blocks, backend="sdpa", max_blocks_per_forward=4
    )
    flex = (
        model.forward_blocks(feats, torch.tensor(anchors), blocks, backend="flex", max_blocks_per_forward=4)
        if with_flex
        else batched
    )
    scale = want.abs().max()
    # fp64 weights, but two steps round to fp32 on purpose: the one-block reference's softmax
    # (eager attention does it in fp32) and transformers' RoPE angles pos * inv_freq (|angle|
    # <= 105, so ~1e-5 rad). 1e-4 of the logit scale covers those and nothing more: one wrong
    # key in a window of 8 moves the logits by ~1e-1 of the scale (checked below).
    for got in (one, batched, flex):
        assert (got - want).abs().max() <= 1e-4 * scale
    assert (batched - flex).abs().max() <= 1e-10 * scale  # same arithmetic, other mask form
    if config.sliding_window is not None:  # the window changed the numbers: the test can fail
        full = _drafter(dataclasses.replace(config, layer_types=None, sliding_window=None, is_causal=None))
        assert (full.forward_one_block(feats, blocks[-1], anchors[-1]) - want[-1]).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 3), (True, 8)])
def test_flex_mask_mod_equals_the_sdpa_mask(causal: bool, window: int | None) -> None:
    anchors, B, t_c = torch.tensor([0, 2, 7, 11]), 4, 11
    dense = block_sparse_mask(anchors, B, t_c, causal, window)
    mod = flex_mask_mod(anchors, B, t_c, causal, window)
    q = torch.arange(len(anchors) * B)[:, None]
    kv = torch.arange(t_c + len(anchors) * B)[None]
    assert torch.equal(mod(0, 0, q, kv), dense)


def test_window_rule_at_the_edge() -> None:
    """Slot j of a block anchored at p sees context p+j-W+1..p-1 (W keys counting itself)."""
    mask = block_sparse_mask(torch.tensor([10]), 4, 10, True, 4)
    ctx = mask[:, :10]
    assert ctx[0].nonzero().flatten().tolist() == [7, 8, 9]
    assert ctx[2].nonzero().flatten().tolist() == [9]
    assert ctx[3].nonzero().flatten().tolist() == []
    assert mask[2, 10:].tolist() == [True, True, True, False]  # causal inside the block
