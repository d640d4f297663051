"""The DFlash drafter (spec/dflash.md section 1) in plain torch.

The drafter owns `fc`, `hidden_norm`, `layers.*` and `norm`; the target's `embed_tokens` and
`lm_head` are attached with `DFlashDrafter.attach_target` and never enter `state_dict`.

Two forward paths:
- `forward_one_block`: the reference, one block anchored at p, no mask, eager attention.
- `forward_blocks`: many blocks in one forward with the block-sparse mask used in training
  (SDPA + boolean mask, or flex_attention + block mask on CUDA). Equal to the reference up to
  rounding; it is the production path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scorer.families.dflash.attention import (
    AttentionBackend,
    block_sparse_mask,
    flex_attend,
    flex_mask,
    pick_flex,
    sdpa_attend,
    visible,
)
from scorer.families.dflash.config import DFlashConfig
from scorer.layers import RMSNorm, SwiGLU, rotate_half
from scorer.offline.sampled_view import head_log_q

__all__ = ["AttentionBackend", "DFlashDrafter"]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [M, heads, D]; cos/sin [M, D] -> broadcast over heads.
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * c.head_dim, bias=c.attention_bias)
        # attention_bias puts a bias on o_proj too, as in Qwen3Attention and the DFlash reference.
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> roped, normed keys [M, n_kv, D] and values [M, n_kv, D]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim)))
        return _apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> roped, normed queries [M, n_heads, D]."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)))
        return _apply_rope(q, cos, sin)


class DFlashLayer(nn.Module):
    """One decoder layer of the drafter; a variant (DFlash2) subclasses it and overrides the
    sublayer hooks (``attention_input``, ``attention_output``, ``mlp_block``)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def attention_input(self, h: torch.Tensor, B: int) -> tuple[torch.Tensor, Any]:
        """The attention sublayer's input rows [M, H] (M = whole blocks of B) and what
        ``attention_output`` needs back: input_layernorm(h)."""
        return self.input_layernorm(h), None

    def attention_output(self, out: torch.Tensor, state: Any, B: int) -> torch.Tensor:
        """The attention sublayer's output rows [M, H] (after o_proj), before the residual add."""
        return out

    def mlp_block(self, x: torch.Tensor, B: int) -> torch.Tensor:
        """The MLP sublayer on its normed input rows [M, H], before the residual add."""
        return self.mlp(x)

    def finish(self, h: torch.Tensor, attn: torch.Tensor, state: Any = None, B: int = 0) -> torch.Tensor:
        """Residual adds after attention: h [M, H], attn [M, n_heads, D] -> [M, H]."""
        h = h + self.attention_output(self.self_attn.o_proj(attn.flatten(-2)), state, B)
        return h + self.mlp_block(self.post_attention_layernorm(h), B)


class DFlashDrafter(nn.Module):
    """A DFlash drafter; parameter names equal the HF checkpoint keys (spec section 2).

    Call `attach_target(embed_weight, lm_head_weight)` before any forward: the target's
    embedding [V, H] and output head [V, H] are stored as non-persistent buffers, so they follow
    `.to()` but stay out of `state_dict`.
    """

    family = "dflash"
    # The block row that predicts the first draft. DFlash's row 0 holds the anchor token x_p and
    # predicts nothing: a block of ``block_size`` tokens drafts from rows 1..B-1. A variant whose
    # anchor row is itself the first prediction sets 0: its block is the B-1 tokens [x_p, MASK ...]
    # and every row drafts (row j predicts x_{p+j+1}); block_hidden then drops the callers' last
    # mask column, so every caller keeps building blocks of ``block_size`` tokens.
    first_draft_slot: int = 1

    def __init__(
        self, config: DFlashConfig, layer: Callable[[DFlashConfig], DFlashLayer] = DFlashLayer
    ) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(c.num_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # On the CPU even under ``with torch.device("meta")`` (shape checks build the module there):
        # meta arithmetic runs torch._refs, whose first use imports torch._dynamo (~1.8 s).
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64, device="cpu").float() / c.head_dim
        base = 1.0 / (c.rope_theta**exponents)  # [D/2]
        if c.rope_type == "linear":
            base = base / float(c.rope_scaling["factor"])
        self.register_buffer("inv_freq", base, persistent=False)
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.register_buffer("draft_to_target", None, persistent=False)  # [Vd] target ids (reduced vocab)
        self.backend_used: str | None = None  # attention kernel(s) of the last block_hidden call
        # Set by the loaders (scorer.families.dflash.features.context_norm): the final norm that turns the cached
        # last-layer output into hidden_states[L] for this drafter's features, or None.
        self.context_norm: Any = None
        # Added to the block's RoPE positions only (the masks keep the true positions): 0 is the
        # spec. `scorer diagnose` replays with +-1/2 to test a trainer's 0- vs 1-based convention.
        self.block_position_offset: int = 0

    def attach_target(
        self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None
    ) -> None:
        """Attach `embed_tokens.weight` [V, H] and `lm_head.weight` [V, H] (frozen).

        With a reduced draft vocabulary (speculators), ``lm_head_weight`` is [Vd, H] and ``d2t``
        [Vd] maps draft id d to target id d + d2t[d]; `head` then returns logits over the target
        vocabulary with -inf at target ids the drafter cannot propose, so argmax and
        log_softmax give exactly vLLM's `logits_new[:, targets] = logits`.

        Raises:
            ValueError: a shape does not match [vocab_size, hidden_size] (or [len(d2t), H]).
        """
        V, H = self.config.vocab_size, self.config.hidden_size
        rows = V if d2t is None else len(d2t)
        for name, w, want in (
            ("embed_weight", embed_weight, (V, H)),
            ("lm_head_weight", lm_head_weight, (rows, H)),
        ):
            if tuple(w.shape) != want:
                raise ValueError(
                    f"{name} has shape {list(w.shape)}, expected {list(want)} "
                    "(vocab_size, hidden_size) from the drafter config"
                )
        if d2t is not None:
            ids = torch.arange(len(d2t), device=d2t.device) + d2t.long()
            if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < V):
                raise ValueError(f"d2t maps draft ids outside the target vocabulary 0..{V - 1}")
            self.draft_to_target = ids.to(lm_head_weight.device)
        else:
            self.draft_to_target = None
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight

    def _target(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embed_weight is None or self.lm_head_weight is None:
            raise RuntimeError(
                "call DFlashDrafter.attach_target(embed_weight, lm_head_weight) before a forward"
            )
        return self.embed_weight, self.lm_head_weight

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [M] -> cos, sin [M, D]; angles in fp32 like transformers, then cast.
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)): [T, K*H] target features -> [T, H] context rows."""
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def context_kv(self, context_features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the roped keys and values of the context rows ``[T, K*H]``: ``[T, kv, D]`` x 2.

        ``block_hidden(..., context=...)`` reuses them, so a caller drafting a sequence in many
        small forwards projects its context once (and identically for every forward).
        """
        ctx = self.project_context(context_features)
        cos, sin = self._cos_sin(torch.arange(ctx.shape[0], device=ctx.device), ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on already-normed hidden states: [..., H] -> logits [..., V] over target ids."""
        logits = hidden @ self._target()[1].to(hidden.dtype).T
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = logits
        return full

    # Drafting from the head. Callers project a block's rows through the head in row chunks (the
    # vocabulary is large): ``slot_candidates`` keeps what the drafts need from one chunk's logits,
    # ``path`` turns the chunks' candidates into the drafts. DFlash's draft of a slot is its own
    # argmax, at T > 0 a draw from its own softmax (``drawn_block``, ``teacher_forced_log_q``); a variant
    # that drafts otherwise overrides these four.

    def slot_candidates(self, logits: torch.Tensor, dtype: torch.dtype) -> Any:
        """What the drafts need from head logits [m, V] (fp32; ``dtype`` the rows' own): the argmax [m]."""
        return logits.argmax(-1)

    def path(
        self, hidden: torch.Tensor, candidates: Sequence[Any], anchor_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The drafts [n, D] of blocks with normed rows ``hidden`` [n, D, H], from the
        ``slot_candidates`` of their row chunks in order: each slot's argmax (the anchor tokens
        [n], the blocks' slot-0 tokens, are not needed)."""
        return torch.cat(list(candidates)).reshape(hidden.shape[:-1])

    @torch.no_grad()
    def drawn_block(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, draw: Callable[[torch.Tensor], int]
    ) -> list[int]:
        """One block drafted at T > 0 from its normed rows [1, D, H] and anchor token [1]: each
        slot ``draw(logits)`` from its own marginal (vLLM's probabilistic drafting)."""
        return [draw(row) for row in self.head(hidden.reshape(-1, hidden.shape[-1])).float()]

    def proposal_log_q(
        self,
        hidden: torch.Tensor,
        anchor_tokens: torch.Tensor,
        want: np.ndarray,
        temperature: float,
        rows: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts and log q(y) of blocks along a sampled trajectory (scorer.families.dflash.proposals):
        normed rows [n, K, H], anchor tokens [n], the trajectory's tokens ``want`` [n, K] (-1 past
        the end) -> (drafts [n, K], log q [n, K]), from ``teacher_forced_log_q`` given each slot's
        predecessor along y: the anchor token for slot 1, then y_{a+1..a+K-1}."""
        wanted = torch.as_tensor(want, dtype=torch.long, device=hidden.device)  # [n, K], -1 past the end
        # past the end the predecessor is any valid id: its slot's y is -1, never counted
        prev = torch.cat([anchor_tokens[:, None].long(), wanted[:, :-1].clamp(min=0)], dim=1)
        return self.teacher_forced_log_q(hidden, prev, wanted, temperature, rows)

    def teacher_forced_log_q(
        self, hidden: torch.Tensor, prev: torch.Tensor, wanted: torch.Tensor, temperature: float, rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``proposal_log_q`` given the predecessors ``prev`` [n, K] along y: here slot j proposes from
        softmax(l_j / T) over the whole vocabulary, whatever came before it (a variant whose slots
        read their predecessor overrides this); the head projects ``rows`` rows at a time."""
        del prev
        n, k, h = hidden.shape
        arg, log_q = head_log_q(self.head, hidden.reshape(-1, h), wanted.reshape(-1), temperature, rows)
        return arg.reshape(n, k), log_q.reshape(n, k)

    # What a trainer's loss reads (scorer/families/dflash/train.py); a variant with more heads overrides them.

    def training_logits(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Logits [N, B-1, V] of blocks' rows ``hidden`` [N, B-1, H] for the training loss (``targets``
        [N, B-1] the tokens each slot should draft, -100 where none): DFlash's head."""
        return self.head(hidden)

    def auxiliary_loss(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        """A loss the trainer adds to the drafts' cross-entropy (another head's): none for DFlash."""
        return None

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self._target()[0]).to(self.fc.weight.dtype)

    @torch.no_grad()
    def forward_one_block(
        self, context_features: torch.Tensor, block_token_ids: torch.Tensor, anchor_pos: int
    ) -> torch.Tensor:
        """Reference forward for one block (spec section 1): no mask, eager softmax.

        Args:
            context_features: [T, K*H] target features, T >= anchor_pos; rows 0..p-1 are used.
            block_token_ids: [B] long, x_p then MASK ids.
            anchor_pos: p, the absolute position of slot 0.

        Returns:
            logits [B-1, V]; row j-1 predicts x_{p+j} (``first_draft_slot``).
        """
        block_token_ids = block_token_ids[: block_token_ids.shape[0] - 1 + self.first_draft_slot]
        p, B = int(anchor_pos), block_token_ids.shape[0]
        ctx = self.project_context(context_features[:p])  # [p, H]
        h = self._embed(block_token_ids)  # [B, H]
        pos = torch.arange(p + B, device=h.device)
        rope_pos = torch.cat([pos[:p], pos[p:] + self.block_position_offset])
        cos, sin = self._cos_sin(rope_pos, h.dtype)
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        q_pos = torch.arange(p, p + B, device=h.device)[:, None]
        for i, layer in enumerate(self.layers):
            causal, window = self.config.layer_attention(i)
            attn = layer.self_attn
            x, state = layer.attention_input(h, B)
            q = attn.q(x, cos[p:], sin[p:]).transpose(0, 1)  # [heads, B, D]
            k, v = attn.kv(torch.cat([ctx, x]), cos, sin)  # [p+B, kv, D]; ctx is not input-normed
            k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, p+B, D]
            v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.config.head_dim)
            if causal or window is not None:  # z-lab builds a mask only then (dflash/model.py)
                scores = scores.masked_fill(~visible(q_pos, pos[None], causal, window), float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            h = layer.finish(h, (probs @ v).transpose(0, 1), state, B)
        return self.head(self.norm(h)[self.first_draft_slot :])

    def forward(
        self, context_features: torch.Tensor, anchors: torch.Tensor, block_token_ids: torch.Tensor
    ) -> torch.Tensor:
        """Differentiable ``block_hidden`` (SDPA, one chunk): for training helpers.

        Returns:
            [N, B-1, H] final normed hidden states of the blocks; ``head()`` gives logits.
        """
        return self._block_hidden(
            context_features,
            anchors,
            block_token_ids,
            max_blocks_per_forward=max(1, block_token_ids.shape[0]),
            backend="sdpa",
        )

    @torch.no_grad()
    def block_hidden(
        self,
        context_features: torch.Tensor,
        anchors: torch.Tensor,
        block_token_ids: torch.Tensor,
        *,
        max_blocks_per_forward: int = 64,
        backend: AttentionBackend = "auto",
        context: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states of many blocks, scored with the block-sparse mask.

        Blocks are sorted by anchor and run `max_blocks_per_forward` at a time; each chunk only
        keys context rows below its largest anchor. Attention memory per chunk is about
        heads * (n*B) * (T + n*B) scores, so lower the chunk for long contexts on CPU.

        Args:
            context_features: [T, K*H], T >= max(anchors).
            anchors: [N] long, the absolute position of each block's slot 0.
            block_token_ids: [N, B] long, each row x_p then MASK ids.
            max_blocks_per_forward: blocks per chunk (memory bound).
            backend: "sdpa" (boolean mask), "flex" (flex_attention block mask; compiled on CUDA),
                or "auto" (flex on CUDA where importable, else sdpa; a flex failure falls back to
                sdpa with a RuntimeWarning). `self.backend_used` records what ran.
            context: `context_kv(context_features[:t])` with t >= max(anchors), computed once by
                a caller that drafts one sequence in several calls; None computes it here.

        Returns:
            [N, B-1, H], `norm(h)[:, 1:]` in input order; `head()` turns it into logits, so
            callers can project the vocabulary in pieces.

        Raises:
            ValueError: shapes disagree, an anchor is outside 0..T, or the backend is unknown.
        """
        return self._block_hidden(
            context_features,
            anchors,
            block_token_ids,
            max_blocks_per_forward=max_blocks_per_forward,
            backend=backend,
            context=context,
        )

    def _block_hidden(
        self,
        context_features: torch.Tensor,
        anchors: torch.Tensor,
        block_token_ids: torch.Tensor,
        *,
        max_blocks_per_forward: int,
        backend: AttentionBackend,
        context: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        N, B = block_token_ids.shape
        if anchors.shape != (N,) or B < 2:
            raise ValueError(
                f"anchors {list(anchors.shape)} / block_token_ids {[N, B]}: expected [N] and "
                "[N, B] with B >= 2 (one anchor per block)"
            )
        if N and not 0 <= int(anchors.min()) <= int(anchors.max()) <= context_features.shape[0]:
            raise ValueError(
                f"anchors span {int(anchors.min())}..{int(anchors.max())} but there are "
                f"{context_features.shape[0]} context rows; anchors must be in 0..T"
            )
        # the block's query rows: the drafted slots, after the anchor row where it predicts nothing
        block_token_ids = block_token_ids[:, : B - 1 + self.first_draft_slot]
        use_flex = pick_flex(backend, context_features.device)
        out = torch.empty(
            N, B - 1, self.config.hidden_size, dtype=self.fc.weight.dtype, device=self.fc.weight.device
        )
        t_max = int(anchors.max()) if N else 0
        if context is not None and N and context[0][0].shape[0] < t_max:
            raise ValueError(f"context covers {context[0][0].shape[0]} rows but anchors reach {t_max}")
        if context is None:  # per layer [t_max, kv, D] x2
            ctx = self.project_context(context_features[:t_max])  # [t_max, H]
            cos, sin = self._cos_sin(torch.arange(t_max, device=ctx.device), ctx.dtype)
            context = [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]
        ctx_kv = context
        order = torch.argsort(anchors.cpu(), stable=True).to(anchors.device)  # similar anchors share a chunk
        used: set[str] = set()
        for start in range(0, N, max_blocks_per_forward):
            idx = order[start : start + max_blocks_per_forward]
            try:
                out[idx] = self._chunk(ctx_kv, anchors[idx], block_token_ids[idx], use_flex)
            except Exception as e:  # compile or kernel failure of flex: "auto" falls back, loudly
                if not (use_flex and backend == "auto"):
                    raise
                warnings.warn(
                    f"flex_attention failed ({type(e).__name__}: {e}); using SDPA",
                    RuntimeWarning,
                    stacklevel=2,
                )
                use_flex = False
                out[idx] = self._chunk(ctx_kv, anchors[idx], block_token_ids[idx], use_flex)
            used.add("flex" if use_flex else "sdpa")
        # Kernel choice can move tau (spec section 5): callers record this next to their results.
        self.backend_used = "+".join(sorted(used)) or None
        return out

    def _chunk(
        self, ctx_kv: list, anchors: torch.Tensor, tokens: torch.Tensor, use_flex: bool
    ) -> torch.Tensor:
        """One chunk of n blocks: queries [n*B], keys [T_c context | n*B block] -> [n, B-1, H]."""
        n, B = tokens.shape
        t_c = int(anchors.max())
        h = self._embed(tokens.flatten())  # [n*B, H]
        pos = (anchors[:, None] + torch.arange(B, device=anchors.device)).flatten()  # [n*B]
        cos, sin = self._cos_sin(pos + self.block_position_offset, h.dtype)
        attend = flex_attend if use_flex else sdpa_attend
        masks: dict[tuple[bool, int | None], Any] = {}  # one mask per (causal, window) kind
        for i, (layer, (k_ctx, v_ctx)) in enumerate(zip(self.layers, ctx_kv)):
            kind = self.config.layer_attention(i)
            if kind not in masks:
                build = flex_mask if use_flex else block_sparse_mask
                masks[kind] = build(anchors, B, t_c, *kind)
            mask = masks[kind]
            x, state = layer.attention_input(h, B)
            q = layer.self_attn.q(x, cos, sin)
            k_blk, v_blk = layer.self_attn.kv(x, cos, sin)
            k = torch.cat([k_ctx[:t_c], k_blk])  # [t_c + n*B, kv, D]
            v = torch.cat([v_ctx[:t_c], v_blk])
            h = layer.finish(h, attend(q, k, v, mask), state, B)
        return self.norm(h).unflatten(0, (n, B))[:, self.first_draft_slot :]

    def forward_blocks(
        self,
        context_features: torch.Tensor,
        anchors: torch.Tensor,
        block_token_ids: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """`head(block_hidden(...))`: logits [N, B-1, V]. Same arguments as `block_hidden`.

        Full logits cost N*(B-1)*V floats; for large N use `block_hidden` and `head` on pieces.
        """
        return self.head(self.block_hidden(context_features, anchors, block_token_ids, **kwargs))
