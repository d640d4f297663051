"""DFlash drafter: reference vs batched forward, the block-sparse mask, config parsing."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from scorer.families.dflash.config import DFlashConfig, derive_target_layer_ids
from scorer.families.dflash.model import DFlashDrafter

V, MASK = 100, 99


def _config(**changes) -> DFlashConfig:
    base = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=V,
        attention_bias=False,
        block_size=4,
        mask_token_id=MASK,
        target_layer_ids=(1, 3),
        num_target_layers=6,
    )
    return dataclasses.replace(base, **changes)


def _drafter(config: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights, norms included (all-ones norms would hide a misplaced norm)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.attach_target(torch.randn(V, config.hidden_size), torch.randn(V, config.hidden_size))
    return model


def _blocks(anchors: list[int], B: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((len(anchors), B), MASK)
    tokens[:, 0] = torch.randint(0, MASK, (len(anchors),), generator=g)
    return tokens


def _features(config: DFlashConfig, T: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, config.num_features * config.hidden_size, generator=g)


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # rtol 1e-5 relative to the logit scale (elementwise rtol is meaningless near zero logits).
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"attention_bias": True},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"num_hidden_layers": 1, "target_layer_ids": (3,)},
    ],
)
def test_batched_forward_equals_one_block_forward(backend: str, changes: dict) -> None:
    config = _config(**changes)
    model = _drafter(config)
    anchors = [1, 9, 12, 3, 7, 0, 9]
    feats, tokens = _features(config, 12), _blocks(anchors, config.block_size)
    got = model.forward_blocks(
        feats, torch.tensor(anchors), tokens, max_blocks_per_forward=3, backend=backend
    )
    want = torch.stack([model.forward_one_block(feats, tokens[i], p) for i, p in enumerate(anchors)])
    assert got.shape == (len(anchors), config.block_size - 1, V) and model.backend_used == backend
    _assert_close(got, want)


def test_no_blocks_gives_an_empty_result() -> None:
    config = _config()
    out = _drafter(config).block_hidden(
        _features(config, 5),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, config.block_size, dtype=torch.long),
    )
    assert out.shape == (0, config.block_size - 1, config.hidden_size)


def test_block_sees_only_context_before_its_anchor_and_its_own_block() -> None:
    config = _config()
    model = _drafter(config)
    anchors, feats = torch.tensor([4, 8]), _features(config, 10)
    tokens = _blocks([4, 8], config.block_size)
    base = model.forward_blocks(feats, anchors, tokens)
    later = feats.clone()
    later[4:] += 5.0  # rows at positions >= 4: invisible to block 0
    out = model.forward_blocks(later, anchors, tokens)
    assert torch.equal(out[0], base[0]) and not torch.allclose(out[1], base[1])
    _assert_close(model.forward_one_block(later, tokens[0], 4), base[0])
    earlier = feats.clone()
    earlier[3] += 5.0  # row 3 < anchor 4: visible to both
    out = model.forward_blocks(earlier, anchors, tokens)
    assert not torch.allclose(out[0], base[0]) and not torch.allclose(out[1], base[1])
    other = tokens.clone()
    other[1, 0] = (other[1, 0] + 1) % MASK  # another block's tokens never leak into block 0
    out = model.forward_blocks(feats, anchors, other)
    assert torch.equal(out[0], base[0]) and not torch.allclose(out[1], base[1])


def test_empty_context_equals_transformers_qwen3_layers_without_mask() -> None:
    # At anchor 0 there is no context: the drafter is a Qwen3 stack with NO causal mask (spec s.1).
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

    config = _config(attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = _drafter(config)
    legacy_rope = ("rope_theta", "rope_scaling")
    hf = Qwen3Config(
        **{k: v for k, v in config.to_hf_config().items() if k not in legacy_rope},
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": config.rope_theta},
    )
    hf._attn_implementation = "eager"
    tokens = _blocks([0], config.block_size)[0]
    h = model.embed_weight[tokens][None]
    cos_sin = Qwen3RotaryEmbedding(hf)(h, torch.arange(config.block_size)[None])
    for i, layer in enumerate(model.layers):
        ref = Qwen3DecoderLayer(hf, layer_idx=i).eval()
        ref.load_state_dict(layer.state_dict())
        h = ref(h, attention_mask=None, position_embeddings=cos_sin)
    final = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
    final.load_state_dict(model.norm.state_dict())
    want = final(h)[0, 1:] @ model.lm_head_weight.T
    _assert_close(model.forward_one_block(_features(config, 0), tokens, 0), want.detach())


def test_state_dict_keys_are_the_hf_checkpoint_keys() -> None:
    model = _drafter(_config(num_hidden_layers=1, target_layer_ids=(2,), attention_bias=True))
    layer = {
        f"layers.0.{k}"
        for k in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
    }
    # attention_bias adds a bias to q, k, v AND o, as Qwen3Attention and the DFlash reference do.
    layer |= {f"layers.0.self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")}
    assert set(model.state_dict()) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | layer
    assert model.state_dict()["fc.weight"].shape == (32, 32)


def test_attach_target_checks_shapes_and_forward_needs_it() -> None:
    config = _config()
    with pytest.raises(RuntimeError, match="attach_target"):
        DFlashDrafter(config).forward_one_block(_features(config, 3), _blocks([3], 4)[0], 3)
    with pytest.raises(ValueError, match=r"embed_weight has shape \[100, 16\], expected \[100, 32\]"):
        DFlashDrafter(config).attach_target(torch.zeros(V, 16), torch.zeros(V, 32))


def test_bad_anchor_and_backend_are_rejected() -> None:
    config = _config()
    model = _drafter(config)
    with pytest.raises(ValueError, match="anchors span 13..13 but there are 12 context rows"):
        model.forward_blocks(_features(config, 12), torch.tensor([13]), _blocks([13], 4))
    with pytest.raises(ValueError, match="backend must be"):
        model.forward_blocks(_features(config, 12), torch.tensor([3]), _blocks([3], 4), backend="xformers")


@pytest.mark.parametrize(
    ("L", "n", "want"),
    [(36, 5, [1, 9, 17, 25, 33]), (36, 1, [18]), (28, 1, [14]), (28, 3, [1, 13, 25]), (64, 2, [1, 61])],
)
def test_derive_target_layer_ids(L: int, n: int, want: list[int]) -> None:
    assert derive_target_layer_ids(L, n) == want


def test_derive_target_layer_ids_rejects_impossible_targets() -> None:
    with pytest.raises(ValueError, match="a target with 2 layers is too small for 3 DFlash features"):
        derive_target_layer_ids(2, 3)
    with pytest.raises(ValueError, match="a target with 8 layers is too small for 20 DFlash features"):
        derive_target_layer_ids(8, 20)  # the rule would repeat ids: named as too few layers
    with pytest.raises(ValueError, match="asks for no layers"):
        derive_target_layer_ids(36, 0)


def test_config_round_trips_through_hf_json() -> None:
    config = _config(rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True)
    hf = config.to_hf_config()
    assert hf["model_type"] == "qwen3" and hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"] == {"block_size": 4, "mask_token_id": MASK, "target_layer_ids": [1, 3]}
    assert DFlashConfig.from_hf_config(hf) == config


def test_from_hf_config_precedence_and_transformers5_rope() -> None:
    hf = _config().to_hf_config()
    del hf["rope_theta"], hf["rope_scaling"], hf["dflash_config"]["target_layer_ids"]
    hf.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=8, num_target_layers=36)
    config = DFlashConfig.from_hf_config(hf)
    assert config.block_size == 4  # dflash_config.block_size wins over the top-level one
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.target_layer_ids == (1, 33)  # derived from 36 target layers, 2 draft layers
    del hf["dflash_config"]["block_size"]
    assert DFlashConfig.from_hf_config(hf).block_size == 8
    del hf["block_size"]
    assert DFlashConfig.from_hf_config(hf).block_size == 16


def test_config_rejects_unsupported_rope_and_missing_fields() -> None:
    with pytest.raises(
        ValueError, match="rope_scaling type 'yarn' is not supported; supported: default, linear"
    ):
        _config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    hf = _config().to_hf_config()
    del hf["dflash_config"]["target_layer_ids"], hf["num_target_layers"], hf["vocab_size"]
    with pytest.raises(ValueError, match="config.json lacks vocab_size, target_layer_ids"):
        DFlashConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "architectures=['DFlash2DraftModel']"),
        ({"output_multiplier": 2.0}, "output_multiplier=2.0"),
        ({"dflash_config": {"conv_kernel_size": 2}}, "conv_kernel_size=2"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        ({"use_swa": True}, "use_swa=True"),
        ({"attention_value_scale": 0.707}, "attention_value_scale=0.707"),
        ({"is_neox_style": False}, "is_neox_style=False"),
        ({"sample_from_anchor": True}, "sample_from_anchor=True"),
        (
            {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False},
            "use_sliding_window=False with sliding_attention layers",
        ),
    ],
)
def test_config_rejects_later_dflash_variants(change: dict, named: str) -> None:
    hf = {**_config().to_hf_config(), **change}
    with pytest.raises(ValueError, match=f"unsupported DFlash drafter variant \\({re.escape(named)}"):
        DFlashConfig.from_hf_config(hf)
    neutral = {**_config().to_hf_config(), "layer_types": ["full_attention"] * 2, "output_multiplier": 1.0}
    assert DFlashConfig.from_hf_config(neutral) == _config()


def test_auto_backend_falls_back_to_sdpa_when_flex_fails(monkeypatch) -> None:
    import scorer.families.dflash.model as drafter_module

    def broken_flex(*args, **kwargs):
        raise RuntimeError("no triton")

    config = _config()
    model = _drafter(config)
    feats, anchors, tokens = _features(config, 9), torch.tensor([2, 9]), _blocks([2, 9], config.block_size)
    want = model.forward_blocks(feats, anchors, tokens, backend="sdpa")
    monkeypatch.setattr(drafter_module, "pick_flex", lambda backend, device: True)
    monkeypatch.setattr(drafter_module, "flex_attend", broken_flex)
    with pytest.warns(RuntimeWarning, match=r"flex_attention failed \(RuntimeError: no triton\); using SDPA"):
        got = model.forward_blocks(feats, anchors, tokens, backend="auto")
    assert torch.equal(got, want) and model.backend_used == "sdpa"
    with pytest.raises(RuntimeError, match="no triton"):
        model.forward_blocks(feats, anchors, tokens, backend="flex")
