"""vLLM's MTP proposer loop over a cached sequence, every anchor at once.

Transcribed from vLLM ``v1/spec_decode/llm_base_proposer.py`` (``SpecDecodeBaseProposer.propose``
at 00c4f22; ``eagle.py``'s ``EagleProposer`` before the split), method "mtp":

- first pass (``set_inputs_first_pass``): the target hidden state of position i is paired with
  token i + 1 (``input_ids[:n-1] = target_token_ids[1:]``, the last slot gets ``next_token_ids``)
  and placed at the target's position i. The hidden states are what the target's model returns:
  its last layer AFTER the final norm. The drafter's KV for verified positions is always rebuilt
  from these target states, so for an anchor p (tokens 0..p verified) its context is exactly the
  pairs (h_i, x_{i+1}) at positions 0..p-1: ONE causal forward over the sequence gives step 0 of
  every anchor (`MtpContext`), and the row at p-1 drafts token p+1.
- ``ret_hidden_states = self.model(**model_kwargs)``; ``model_returns_tuple()`` is False for MTP,
  so ``hidden_states = last_hidden_states``: the state fed back is MTP's own NORMED output (the
  one the logits come from). ``draft_token_ids = ...argmax(dim=-1)`` (greedy).
- later steps (``for token_index in range(self.num_speculative_tokens - 1)``):
  ``input_ids = draft_token_ids_list[-1]``, ``positions += 1``, ``hidden_states`` = the previous
  step's output, one query per request attending to its KV (context + its earlier drafts).

Steps > 0 run for all anchors at once: one query per anchor, keys = the shared context masked
to positions < anchor, plus that anchor's own draft keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hscache.capture.logit_rows import head_rows, row_chunks
from scorer.families.mtp.model import MtpHead

__all__ = ["MtpContext", "TreeSteps", "chain_outputs", "draft_anchors", "mtp_context"]

_SCORE_BYTES = 4  # fp32 attention scores


@dataclass
class MtpContext:
    """Step 0 over one sequence: per position i (0..n-1) the fused input at position i, its key
    and value, and MTP's normed output (which drafts token i + 2)."""

    keys: torch.Tensor  # [n, kv, D]
    values: torch.Tensor  # [n, kv, D]
    out: torch.Tensor  # [n, H] normed


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def mtp_context(head: MtpHead, hidden: torch.Tensor, token_ids: torch.Tensor) -> MtpContext:
    """Step 0 of every anchor: pairs (hidden[i], token_ids[i + 1]) at positions i = 0..T-2, one
    causal forward. ``hidden`` [T, H] is what MTP reads (the target's normed last layer)."""
    n = len(token_ids) - 1
    layer = head.layers[0]
    pos = torch.arange(n, device=hidden.device)
    x = head.fuse(token_ids[1:].to(hidden.device), hidden[:n])
    cos, sin = head.cos_sin(pos, x.dtype)
    q, gate, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    heads = q.shape[1]
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        _expand_kv(k, heads).transpose(0, 1)[None],
        _expand_kv(v, heads).transpose(0, 1)[None],
        is_causal=True,
    )[0].transpose(0, 1)
    out = head.norm(layer.finish(x, attn, gate))
    return MtpContext(k, v, out)


def _argmax(head: MtpHead, normed: torch.Tensor, rows: int) -> torch.Tensor:
    """Greedy token of each row, the [rows, V] logits built a chunk at a time."""
    out = []
    for lo, hi, new in row_chunks(normed.shape[0], rows):
        out.append(head.logits(normed[lo:hi])[new - lo :].float().argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=normed.device)


def _pick(
    head: MtpHead, normed: torch.Tensor, rows: int, draw: Callable[[torch.Tensor], int] | None
) -> torch.Tensor:
    if draw is None:
        return _argmax(head, normed, rows)
    logits = head.logits(normed).float()
    return torch.tensor([draw(row) for row in logits], dtype=torch.long, device=normed.device)


def _step(
    head: MtpHead,
    context: MtpContext,
    at: torch.Tensor,
    j: int,
    prev_out: torch.Tensor,
    prev_token: torch.Tensor,
    own: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Step j >= 1 for anchors ``at``: the previous normed output and drafted token at position
    p-1+j, attending to context keys at positions < p and the anchor's own steps 1..j."""
    layer = head.layers[0]
    x = head.fuse(prev_token, prev_out)
    cos, sin = head.cos_sin(at - 1 + j + head.step_position_offset, x.dtype)
    q, gate, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    own.append((k, v))
    heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[2]
    scale = D**-0.5
    qg = q.float().unflatten(1, (kv_heads, heads // kv_heads))  # [A, kv, rep, D]: head h reads kv h // rep
    k_ctx, v_ctx = context.keys.float(), context.values.float()  # [n, kv, D], never expanded per head
    s_ctx = torch.einsum("akrd,nkd->akrn", qg, k_ctx) * scale
    visible = torch.arange(k_ctx.shape[0], device=at.device)[None] < at[:, None]  # [A, n]
    s_ctx = s_ctx.masked_fill(~visible[:, None, None], float("-inf"))
    k_own = torch.stack([kk for kk, _ in own], dim=1).float()  # [A, j, kv, D]
    v_own = torch.stack([vv for _, vv in own], dim=1).float()
    s_own = torch.einsum("akrd,ajkd->akrj", qg, k_own) * scale
    p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1)
    n = k_ctx.shape[0]
    attn = torch.einsum("akrn,nkd->akrd", p[..., :n], v_ctx) + torch.einsum(
        "akrj,ajkd->akrd", p[..., n:], v_own
    )
    attn = attn.flatten(1, 2)  # [A, heads, D]
    return head.norm(layer.finish(x, attn.to(x.dtype), gate))


def chain_outputs(
    head: MtpHead,
    context: MtpContext,
    at: torch.Tensor,
    num_speculative_tokens: int,
    rows: int,
    forced: torch.Tensor | None = None,
    draw: Callable[[torch.Tensor], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One group of anchors ``at`` [A]: greedy drafts [A, K] and the normed MTP output of each
    step [A, K, H] (the state that both gives the logits and is fed to the next step).
    ``forced`` [A, K]: feed step j its column j - 1 instead of the drafted token (teacher forcing).
    ``draw``: each row's token is ``draw(its logits)`` instead of the argmax (probabilistic drafting)."""
    out = context.out[at - 1]  # step 0 of anchor p: the context row at p - 1
    tokens = _pick(head, out, rows, draw)
    drafted, states, own = [tokens], [out], []
    for j in range(1, num_speculative_tokens):
        fed = tokens if forced is None else forced[:, j - 1]
        out = _step(head, context, at, j, out, fed, own)
        tokens = _pick(head, out, rows, draw)
        drafted.append(tokens)
        states.append(out)
    return torch.stack(drafted, dim=1), torch.stack(states, dim=1)


def draft_anchors(
    head: MtpHead,
    context: MtpContext,
    anchors: np.ndarray,
    num_speculative_tokens: int,
    memory_gb: float = 2.0,
    token_ids: torch.Tensor | None = None,
    draw: Callable[[torch.Tensor], int] | None = None,
) -> np.ndarray:
    """Greedy drafts ``[A, K]`` for anchors p (tokens 0..p verified, 1 <= p <= n): slot j is the
    token proposed for position p + 1 + j, as vLLM's chain of K speculative tokens drafts it.
    Anchors go in groups sized so their [A, heads, n] attention scores fit ``memory_gb``.
    ``token_ids`` given: teacher forcing, step j is fed the true token x_{p+j} (training style).
    ``draw`` given: each slot is ``draw(its logits)`` and fed to the next step (``scorer online`` at T > 0)."""
    K, device = num_speculative_tokens, context.out.device
    rows = head_rows(head.config.vocab_size, memory_gb)
    n = context.keys.shape[0]
    per_anchor = head.config.num_attention_heads * (n + K) * _SCORE_BYTES * 3
    group = max(1, min(rows, int(memory_gb * 1e9) // max(per_anchor, 1)))
    parts = []
    for lo in range(0, len(anchors), group):
        at = torch.as_tensor(anchors[lo : lo + group], dtype=torch.long, device=device)
        forced = None
        if token_ids is not None:  # x_{p+j} for j = 1..K-1, clamped at the end (those slots never count)
            idx = (at[:, None] + torch.arange(1, K, device=device)[None]).clamp(max=len(token_ids) - 1)
            forced = token_ids.to(device)[idx]
        parts.append(chain_outputs(head, context, at, K, rows, forced, draw)[0].cpu().numpy())
    return np.concatenate(parts) if parts else np.zeros((0, K), dtype=np.int64)


class TreeSteps:
    """The MTP head seen through the step interface of the shared SGLang EAGLE-tree replay
    (scorer.families.autoregressive.tree_depths): step 0 over rows i (hidden i, token i + 1,
    position i), later steps per frontier slot at position row + j attending to the context up to
    its row and to its own slot's earlier keys. SGLang serves Qwen3.5's MTP with this EAGLE tree
    (``qwen3_5_mtp.py``: its draft forward returns the normed state, which the tree feeds back)."""

    def __init__(self, head: MtpHead) -> None:
        self.head, self.config, self.fc, self.layers = head, head.config, head.fc, head.layers

    def step0(self, hidden: torch.Tensor, token_ids: torch.Tensor, rows: int):
        context = mtp_context(self.head, hidden[:rows], token_ids[: rows + 1])
        return context.out, context.out, [(context.keys, context.values, context)]

    def step(self, rows, tokens, fed, j, kv0, own):
        context = kv0[0][2]
        normed = _step(self.head, context, rows + 1, j, fed, tokens, own[0])
        return normed, normed

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.logits(normed)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids
