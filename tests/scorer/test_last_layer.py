"""Layer id L-1 read as transformers' hidden_states[L] (after the final norm), as z-lab does."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

import hscache
from hscache.capture.final_norm import KINDS, describe_final_norm
from hscache.capture.target import load_target
from scorer.errors import IncompatibleCacheError
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.features import context_norm, feature_index
from scorer.offline.sequences import sequence_features


def _config(layer_ids: tuple[int, ...], hidden: int) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        vocab_size=10, attention_bias=False, block_size=4, mask_token_id=1, target_layer_ids=layer_ids,
    )  # fmt: skip


def test_last_layer_feature_equals_transformers_hidden_states_L(scorer_cache) -> None:
    cache = hscache.open_cache(scorer_cache)
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    L, H = target.num_layers, int(target.text_config.hidden_size)
    assert L - 1 in cache.layer_ids  # the fixture caches the last layer
    config = _config((1, L - 1), H)
    norm = context_norm(config, cache)
    assert norm is not None and norm[0] == 1
    for row in range(2):
        ids = cache.token_ids(row)
        with torch.no_grad():
            out = target.model(input_ids=ids[None], output_hidden_states=True)
        idx = feature_index(config, cache.layer_ids)
        feats = sequence_features(cache.hidden_states(row), idx, torch.float32, "cpu", norm)
        assert torch.equal(feats[:, :H], out.hidden_states[2][0])  # layer 1 = hidden_states[2]
        assert torch.equal(feats[:, H:], out.hidden_states[L][0])  # bit for bit, fp32
        plain = sequence_features(cache.hidden_states(row), idx, torch.float32, "cpu")
        assert not torch.equal(plain[:, H:], out.hidden_states[L][0])  # the norm mattered
    assert context_norm(config, cache, "speculators") is None  # vLLM captures pre-norm
    assert context_norm(_config((1, 3), H), cache) is None


def test_a_cache_without_the_final_norm_is_refused(scorer_cache) -> None:
    cache = hscache.open_cache(scorer_cache)

    class Old:
        target_config = cache.target_config

        def target_head(self):
            return {k: v for k, v in cache.target_head().items() if not k.startswith("final_norm")}

    L = cache.target_config["num_hidden_layers"]
    with pytest.raises(IncompatibleCacheError, match=f"include the last target layer {L - 1}.*re-extract"):
        context_norm(_config((L - 1,), 64), Old())


@pytest.mark.parametrize(
    ("module", "kind"),
    [(Qwen3RMSNorm(16, eps=1e-6), "rms_weight"), (Qwen3_5RMSNorm(16, eps=1e-6), "rms_one_plus_weight")],
)
def test_final_norm_formula_is_identified_bit_for_bit(module: torch.nn.Module, kind: str) -> None:
    with torch.no_grad():
        module.weight.copy_(torch.randn(16))
    for dtype in (torch.float32, torch.bfloat16):
        saved = describe_final_norm(module.to(dtype))
        assert KINDS[int(saved["final_norm.kind"][0])] == kind
    assert describe_final_norm(torch.nn.LayerNorm(16)) == {}  # not an RMSNorm: nothing saved
