"""The target's own MTP head (Qwen3.5 / Qwen3.6 / Qwen3-Next) as vLLM serves it, in plain torch.

Transcribed from vLLM (vllm-project/vllm, ``model_executor/models/qwen3_5_mtp.py`` at 01d9980,
``Qwen3_5MultiTokenPredictor.forward``):

    inputs_embeds = self.pre_fc_norm_embedding(inputs_embeds)      # -> MtpHead.fuse
    hidden_states = self.pre_fc_norm_hidden(hidden_states)
    hidden_states = torch.cat([inputs_embeds, hidden_states], dim=-1)
    hidden_states = self.fc(hidden_states)
    residual = None
    current_step_idx = spec_step_idx % self.num_mtp_layers          # one layer, every step
    hidden_states, residual = self.layers[current_step_idx](positions, hidden_states, residual)
    hidden_states, _ = self.norm(hidden_states, residual)           # -> MtpLayer + MtpHead.norm
    return hidden_states

and ``Qwen3_5MTP.compute_logits``: the target's ``lm_head`` on that normed state. The layer is
the target's full-attention decoder layer (``Qwen3_5DecoderLayer(layer_type="full_attention")``):
gated attention (``q_proj`` gives query and gate per head, output * sigmoid(gate)), q/k
RMSNorms, partial rotary (the first ``head_dim * partial_rotary_factor`` dims, neox halves; for
text tokens M-RoPE's three position streams are equal, so it is 1-D RoPE), SwiGLU MLP; every
RMSNorm is Qwen3.5's ``x_normed_fp32 * (1 + w)`` cast back. Weight names are the checkpoint's
``mtp.*`` names less the prefix (vLLM's ``load_weights`` maps ``mtp.`` to ``model.``).

The proposer (what is fed where) is in scorer/families/mtp/draft.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scorer.config_numbers import check_config_numbers
from scorer.layers import RMSNorm, SwiGLU, rotate_half

__all__ = ["MtpConfig", "MtpHead"]


@dataclass(frozen=True)
class MtpConfig:
    """The MTP head's shapes (from the target's config) and how it is scored.

    ``hidden_source``: "post_norm" feeds the target's last layer after its final norm (what vLLM's
    runner passes, as served); "pre_norm" its raw output (what speculators trains MTP on).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    vocab_size: int
    num_target_layers: int
    num_mtp_layers: int = 1
    num_speculative_tokens: int = 3
    hidden_source: str = "post_norm"

    def __post_init__(self) -> None:
        check_config_numbers({f: getattr(self, f) for f in self.__dataclass_fields__}, "MTP head config")

    @property
    def block_size(self) -> int:
        """Drafted slots + 1, as the shared replay counts them (scorer.families.base)."""
        return self.num_speculative_tokens + 1

    @property
    def draft_vocab_size(self) -> int:
        """The head is the target's: the draft vocabulary is the target's."""
        return self.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the head (cost estimates read drafters' configs by this name)."""
        return self.num_mtp_layers

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return (self.num_target_layers - 1,)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3_5MTP"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_mtp_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "vocab_size": self.vocab_size,
            "num_speculative_tokens": self.num_speculative_tokens,
            "mtp_hidden_source": self.hidden_source,
            "target_layer_ids": list(self.target_layer_ids),
        }


def _norm(dim: int, eps: float) -> RMSNorm:
    """Qwen3_5RMSNorm: normalise in fp32, scale by (1 + w) in fp32, cast back."""
    return RMSNorm(dim, eps, kind="rms_one_plus_weight")


class _Attention(nn.Module):
    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = _norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = _norm(c.head_dim, c.rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> q [N, heads, D], gate [N, heads*D], k, v [N, kv, D] (rotary applied)."""
        n = x.shape[0]
        q, gate = torch.chunk(self.q_proj(x).view(n, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(n, -1)
        q = _rope(self.q_norm(q), cos, sin)
        k = _rope(self.k_norm(self.k_proj(x).view(n, -1, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(n, -1, self.head_dim)
        return q, gate, k, v

    def finish(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn [N, heads, D] -> o_proj(attn * sigmoid(gate))."""
        return self.o_proj(attn.reshape(attn.shape[0], -1) * torch.sigmoid(gate))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial neox rotary on the first ``cos.shape[-1]`` dims; x [N, heads, D], cos/sin [N, R]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos[:, None] + rotate_half(rot) * sin[:, None], rest), dim=-1)


class MtpLayer(nn.Module):
    """The target's full-attention decoder layer (pre-norm residual block)."""

    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.input_layernorm = _norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _norm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Residual after attention, then the MLP block: the layer's output (before MTP's norm)."""
        h = x + self.self_attn.finish(attn, gate)
        return h + self.mlp(self.post_attention_layernorm(h))


class MtpHead(nn.Module):
    """``mtp.*`` (less the prefix): fc, the two pre-fc norms, ``layers``, norm. The target's
    embedding and lm_head are attached with `attach_target` and never enter ``state_dict``."""

    def __init__(self, config: MtpConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.pre_fc_norm_embedding = _norm(H, config.rms_norm_eps)
        self.pre_fc_norm_hidden = _norm(H, config.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(MtpLayer(config) for _ in range(config.num_mtp_layers))
        self.norm = _norm(H, config.rms_norm_eps)
        r = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device="cpu") / r))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Added to the positions of steps j >= 1 only (vLLM: p-1+j); `scorer diagnose` replays others.
        self.step_position_offset = 0
        self.embed_tokens: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None

    def attach_target(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.embed_tokens, self.lm_head = embed_tokens, lm_head

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] positions -> cos, sin [N, rotary_dim] (fp32 angles, cast like the target's rotary)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def fuse(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))``: [N, H]."""
        assert self.embed_tokens is not None, "attach_target first"
        embeds = self.pre_fc_norm_embedding(F.embedding(token_ids, self.embed_tokens))
        return self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The target's lm_head on MTP's normed output: [N, H] -> [N, V]."""
        assert self.lm_head is not None, "attach_target first"
        return normed @ self.lm_head.to(normed.dtype).T
