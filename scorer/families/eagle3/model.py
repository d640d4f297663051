"""The EAGLE-3 drafter in plain torch, and its serving-exact drafting (vLLM's proposer loop).

Math, as vLLM serves it (``model_executor/models/llama_eagle3.py``; speculators'
``Eagle3FirstLayerMixin.forward`` and SpecForge's ``LlamaDecoderLayer.forward`` are the same):

    g      = fc(cat(features))                            # combine_hidden_states
    layer 0: residual = g   (hidden_norm(g) with norm_before_residual: _norm_before_residual)
             x = cat(input_layernorm(embed(token)), hidden_norm(g))  # 2H wide into q/k/v
    later layers: the plain pre-norm decoder layer
    h_pre  = the residual stream after the last layer;   h = norm(h_pre)
    logits = lm_head(h) over the draft vocabulary; target id = draft id + d2t[draft id]

The serving loop (vLLM ``v1/spec_decode/eagle.py`` ``propose``), for an anchor p (tokens 0..p verified,
target features known for positions 0..p-1):

    step 0: rows i = 0..p-1 pair target feature F[i] with token x[i+1] at position i
            ("input_ids[:num_tokens - 1] = target_token_ids[1:]", "input_ids[last_token_indices]
            = next_token_ids", "positions = target_positions"); causal; row p-1 gives d_1.
    step j: one row: token d_j, hidden = step j-1's PRE-norm state of that row ("last_hidden_states,
            hidden_states = self.model(...)", llama_eagle3 returns (norm, hidden_prenorm)),
            position p-1+j ("positions += 1"); it attends to the step-0 keys 0..p-1 and to its own
            earlier steps' keys (the KV cache); gives d_{j+1}.

Because step 0 is causal, ONE forward over the whole sequence gives step 0 for every anchor; the
later steps of all anchors run together (each row attends to the step-0 keys up to its own row
and to its own earlier steps: the mask speculators trains with, ``extend_mask_for_draft_tokens``).
`draft_one_anchor` is the literal one-anchor loop, kept as the reference and for ``scorer online``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scorer.families.eagle3.config import Eagle3Config
from scorer.layers import RMSNorm, SwiGLU, rotate_half

__all__ = ["Eagle3Drafter"]


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, first: bool) -> None:
        super().__init__()
        width = 2 * c.hidden_size if first else c.hidden_size
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(width, self.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, self.n_kv * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, self.n_kv * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, width] -> roped q [M, heads, D], roped k [M, kv, D], v [M, kv, D]."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        return q, k, self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))


class _Layer(nn.Module):
    def __init__(self, c: Eagle3Config, first: bool) -> None:
        super().__init__()
        self.first = first
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, first)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)

    def enter(self, embeds: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of this layer: the EAGLE-3 first layer or a plain one."""
        if not self.first:
            return self.input_layernorm(h), h
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def leave(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = residual + self.self_attn.o_proj(attn.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys [M, kv, D], values [M, kv, D]


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter; parameter names are the canonical checkpoint keys (``layers.0.*``).

    The embedding is attached (`attach_embedding`: the target's, as vLLM shares it when the
    shapes match, else the checkpoint's own) and never enters ``state_dict``; ``d2t`` is a buffer
    holding each draft id's target id.
    """

    family = "eagle3"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = self.config = config
        width = c.num_features * c.feature_size
        self.input_norm = RMSNorm(width, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.feature_size, c.rms_norm_eps) for _ in range(c.num_features))
            if c.fc_norm
            else None
        )
        self.fc = nn.Linear(width, c.hidden_size, bias=False)
        self.layers = nn.ModuleList(_Layer(c, first=i == 0) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # On the CPU even under ``with torch.device("meta")`` (shape checks): see DFlashDrafter.
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64, device="cpu").float() / c.head_dim
        inv_freq = 1.0 / (c.rope_theta**exponents)
        if c.rope_type == "linear":
            inv_freq = inv_freq / float(c.rope_scaling["factor"])
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size), persistent=False)
        self.backend_used: str | None = "eager"
        # Added to the positions of steps j >= 1 only (step 0 keeps the target's 0..p-1): vLLM
        # places step j at p-1+j; `scorer diagnose` replays a trainer that placed them elsewhere.
        self.step_position_offset = 0

    # ---- target attachments -------------------------------------------------------------------
    def attach_embedding(self, embed_weight: torch.Tensor, d2t: torch.Tensor | None) -> None:
        """The token embedding [V, H] and the draft->target map (``d2t`` offsets [Vd], or None).

        Raises:
            ValueError: shapes do not match the config, or d2t maps outside the target vocabulary.
        """
        c = self.config
        if tuple(embed_weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embedding has shape {list(embed_weight.shape)}, expected {[c.vocab_size, c.hidden_size]}"
            )
        ids = torch.arange(c.draft_vocab_size)
        if d2t is not None:
            if len(d2t) != c.draft_vocab_size:
                raise ValueError(f"d2t has {len(d2t)} entries, draft_vocab_size is {c.draft_vocab_size}")
            ids = ids + d2t.long().cpu()
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < c.vocab_size):
            raise ValueError(f"d2t maps draft ids outside the target vocabulary 0..{c.vocab_size - 1}")
        self.embed_weight = embed_weight
        self.draft_to_target = ids.to(self.fc.weight.device)

    # ---- pieces -------------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("call Eagle3Drafter.attach_embedding(...) before a forward")
        return F.embedding(token_ids.to(self.embed_weight.device), self.embed_weight).to(self.fc.weight.dtype)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """[T, K*Ht] target features -> [T, H] (input_norm / fc_norm as configured, then fc)."""
        x = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def finish(self, h_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream -> (normed state for the head, state fed back to the next step)."""
        h = self.norm(h_pre)
        return h, (h if self.config.norm_output else h_pre)

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] (``draft_to_target`` maps their argmax to target ids)."""
        return self.lm_head(normed)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    # ---- step 0 for a whole sequence (differentiable: the trainer uses it too) -----------------
    def step0(
        self, features: torch.Tensor, token_ids: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """Step 0 for rows i = 0..rows-1 (feature F[i], token x[i+1], position i), causal, one forward.

        Returns:
            (normed [rows, H], fed-back state [rows, H], per-layer roped keys/values [rows, kv, D]).
        """
        g = self.combine(features[:rows])
        embeds = self._embed(token_ids[1 : rows + 1])
        cos, sin = self._cos_sin(torch.arange(rows, device=g.device), g.dtype)
        kv: KV = []
        h = g
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        for layer in self.layers:
            x, residual = layer.enter(embeds, h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            kv.append((k, v))
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
                v.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
                is_causal=True,
            )[0].transpose(0, 1)
            h = layer.leave(residual, out)
        normed, fed = self.finish(h)
        return normed, fed, kv

    # ---- step 0 for new rows over a cached prefix (one served round) --------------------------
    @torch.no_grad()
    def extend(
        self, features: torch.Tensor, token_ids: torch.Tensor, start: int, cache: KV
    ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """Step 0 for rows start..start+n-1 (features ``[n, K*Ht]``, tokens x[i+1] ``[n]``) attending to
        the cached step-0 keys of rows < start and causally to each other: what a served round runs
        for its newly verified tokens. Returns (normed [n, H], fed-back [n, H], the extended cache)."""
        g = self.combine(features)
        embeds = self._embed(token_ids)
        n = g.shape[0]
        cos, sin = self._cos_sin(torch.arange(start, start + n, device=g.device), g.dtype)
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        visible = (
            torch.arange(start + n, device=g.device)[None, :]
            <= torch.arange(start, start + n, device=g.device)[:, None]
        )
        h, out_cache = g, []
        for layer, (k0, v0) in zip(self.layers, cache):
            x, residual = layer.enter(embeds, h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            keys, values = torch.cat([k0, k]), torch.cat([v0, v])
            out_cache.append((keys, values))
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
                values.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
                attn_mask=visible[None, None],
            )[0].transpose(0, 1)
            h = layer.leave(residual, out)
        normed, fed = self.finish(h)
        return normed, fed, out_cache

    # ---- later steps for many rows at once ----------------------------------------------------
    def step_inputs(
        self, rows: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a later step for ``rows`` is fed: here the chain's own draft ``tokens`` [N] and fed-back
        state [N, H]; a variant that feeds something else (P-EAGLE's mask slots) overrides this."""
        del rows
        return tokens, fed

    def step(
        self,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        fed: torch.Tensor,
        j: int,
        kv0: KV,
        own: list[list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step j >= 1 for step-0 rows ``rows`` [N]: token ``tokens`` [N], fed-back state [N, H].

        Each row attends to the step-0 keys 0..row and to its own keys of steps 1..j (``own[l]``
        holds layer l's [N, kv, D] pairs of earlier steps; this step's are appended).

        Returns:
            (normed [N, H], fed-back state [N, H]).
        """
        tokens, fed = self.step_inputs(rows, tokens, fed)
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        embeds = self._embed(tokens)
        cos, sin = self._cos_sin(rows + j + self.step_position_offset, fed.dtype)
        h = fed
        scale = 1.0 / math.sqrt(c.head_dim)
        for n, layer in enumerate(self.layers):
            x, residual = layer.enter(embeds, h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)  # [N, heads|kv, D]
            own[n].append((k, v))
            k0, v0 = kv0[n]
            qg = q.unflatten(1, (c.num_key_value_heads, rep))  # [N, kv, rep, D]
            ctx = torch.einsum("nkrd,mkd->nkrm", qg, k0) * scale  # [N, kv, rep, M]
            visible = torch.arange(k0.shape[0], device=q.device)[None, :] <= rows[:, None]
            ctx = ctx.masked_fill(~visible[:, None, None, :], float("-inf"))
            ks = torch.stack([kk for kk, _ in own[n]], dim=1)  # [N, j, kv, D]
            vs = torch.stack([vv for _, vv in own[n]], dim=1)
            self_scores = torch.einsum("nkrd,njkd->nkrj", qg, ks) * scale
            probs = torch.softmax(torch.cat([ctx, self_scores], dim=-1), dim=-1, dtype=torch.float32)
            probs = probs.to(q.dtype)
            m = k0.shape[0]
            out = torch.einsum("nkrm,mkd->nkrd", probs[..., :m], v0)
            out = out + torch.einsum("nkrj,njkd->nkrd", probs[..., m:], vs)
            h = layer.leave(residual, out.flatten(1, 2))
        return self.finish(h)

    # ---- the literal serving loop for one anchor ----------------------------------------------
    @torch.no_grad()
    def draft_one_anchor(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        anchor: int,
        num_tokens: int,
        draw: Callable[[torch.Tensor], int] | None = None,
    ) -> list[int]:
        """vLLM's ``propose`` for one request at anchor p (the reference): K target token ids.

        ``features`` [>= p, K*Ht] rows 0..p-1; ``token_ids`` [>= p+1] tokens 0..p. Eager attention
        over an explicit KV cache, one query per later step. ``draw``: each step's token is
        ``draw(logits over the target vocabulary)`` (-inf outside the draft vocabulary) instead of
        the argmax, and the next step is fed it (vLLM's probabilistic drafting).
        """
        c = self.config
        p = int(anchor)
        rep = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        h, cache = self.causal_forward(self._embed(token_ids[1 : p + 1]), self.combine(features[:p]))
        normed, fed = self.finish(h[-1:])
        drafted = [self._pick(normed, draw)]
        position = p - 1
        for _ in range(num_tokens - 1):
            position += 1
            embeds = self._embed(torch.tensor([drafted[-1]]))
            cos, sin = self._cos_sin(torch.tensor([position]), fed.dtype)
            h = fed
            for n, layer in enumerate(self.layers):
                x, residual = layer.enter(embeds, h)
                q, k, v = layer.self_attn.qkv(x, cos, sin)
                cache[n] = (torch.cat([cache[n][0], k]), torch.cat([cache[n][1], v]))
                keys = cache[n][0].repeat_interleave(rep, dim=1)
                values = cache[n][1].repeat_interleave(rep, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                h = layer.leave(residual, torch.einsum("hqk,khd->qhd", probs, values))
            normed, fed = self.finish(h)
            drafted.append(self._pick(normed, draw))
        return drafted

    def causal_forward(self, embeds: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, KV]:
        """One eager causal forward of rows at positions 0..len-1 (token embeddings ``embeds`` [R, H],
        input states ``h`` [R, H]): the pre-norm states [R, H] and each layer's (keys, values)."""
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        positions = torch.arange(h.shape[0], device=h.device)
        cos, sin = self._cos_sin(positions, h.dtype)
        causal = positions[None, :] <= positions[:, None]
        cache: KV = []
        for layer in self.layers:
            x, residual = layer.enter(embeds, h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            cache.append((k, v))
            scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, dim=1)) * scale
            scores = scores.masked_fill(~causal[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            h = layer.leave(residual, torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, dim=1)))
        return h, cache

    def _pick(self, normed: torch.Tensor, draw: Callable[[torch.Tensor], int] | None) -> int:
        """The target token id of one step's [1, H] normed state: argmax, or ``draw`` of its logits."""
        logits = self.head_logits(normed).float()[0]
        if draw is None:
            return int(self.to_target(logits.argmax(-1)))
        full = logits.new_full((self.config.vocab_size,), float("-inf"))
        full[self.draft_to_target] = logits
        return int(draw(full))
