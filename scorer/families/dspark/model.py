"""DSpark (vLLM 0.32.0 ``Qwen3DSparkModel``; speculators 0.9 ``DSparkDraftModel``; SpecForge 0.2
``DSparkDraftModel``): DFlash's one-pass block backbone plus a sequential Markov head and a confidence
head, transcribed from vLLM, which defines how it is served:

- ``model_executor/models/qwen3_dspark.py``: ``DSparkMarkovHead`` (L48-161: ``markov_w1`` an
  embedding [V, r] of the previous token, ``markov_w2`` [Vd, r] projecting it to a draft-vocabulary
  bias added to the base logits), ``DSparkConfidenceHead`` (L164-189: one linear unit, fp32, on the
  block row, with the Markov embedding concatenated when ``confidence_head_with_markov``), sigmoid
  (``compute_confidence`` L305-310); ``Qwen3DSparkModel`` reads ``markov_rank``,
  ``enable_confidence_head`` and ``confidence_head_with_markov`` at the config's top level (L205-230).
- ``v1/worker/gpu/spec_decode/dspark/speculator.py``: ``sample_from_anchor`` (L49-55, default True: a
  block of N = num_speculative_tokens query rows [x_p, MASK x (N-1)], row j predicting x_{p+j+1};
  False: DFlash's 1 + N rows, the anchor predicting nothing); ``_sample_sequential`` (L156-199): the
  anchor token is the first predecessor, each slot's logits are base + markov_w2(markov_w1(prev)) and
  the slot's draft (argmax when greedy, L124-126) is the next slot's predecessor;
  ``_sample_sequential_topk`` (L201-248, ``dspark_draft_topk``): the top-k base logits of each slot,
  chosen once, corrected with the Markov bias at each step, -inf elsewhere; the confidences are
  computed from the rows and the Markov embeddings of the predecessors (L192-199, L241-248).
- the backbone is DFlash's (qwen3_dflash.py, reused by L192 ``Qwen3DSparkModel(DFlashQwen3Model)``):
  scorer.families.dflash.model.DFlashDrafter, subclassed; the anchor-row layout through its
  ``first_draft_slot`` hook, the Markov walk through its drafting hooks (``slot_candidates``, ``path``,
  ``drawn_block``, ``teacher_forced_log_q``).

Parameter names are the checkpoints' (vLLM maps ``X`` to ``model.X``, qwen3_dspark.py:325-326):
``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [Vd, r],
``confidence_head.proj.{weight,bias}`` [1, in], [1].

Only the vanilla Markov head is served by vLLM 0.32.0 (no gate or recurrence in ``DSparkMarkovHead``);
speculators' and SpecForge's ``gated`` and ``rnn`` heads are refused by name (seam.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hscache.capture.logit_rows import row_chunks
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter

__all__ = ["ConfidenceHead", "DSparkConfig", "DSparkDrafter", "MarkovHead"]


@dataclass(frozen=True)
class DSparkConfig:
    """DFlash's config (``base``; its ``block_size`` is the drafted slots + 1, the seam's) plus DSpark's
    settings, named as in vLLM's config (qwen3_dspark.py, config/speculative.py ``dspark_draft_topk``)."""

    base: DFlashConfig
    markov_rank: int
    draft_vocab_size: int
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = True
    dspark_draft_topk: int | None = None

    def __getattr__(self, name: str) -> Any:  # everything else is the DFlash backbone's
        if name == "base" or name.startswith("__"):  # unpickling: no base yet
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def num_draft_tokens(self) -> int:
        """Drafted tokens per round (vLLM's num_speculative_tokens)."""
        return self.base.block_size - 1

    def to_hf_config(self) -> dict[str, Any]:
        """The dense HF layout vLLM 0.32.0 loads as ``Qwen3DSparkModel`` (deepseek-ai/dspark_qwen3_8b_block7's):
        DSpark's keys at top level, where Qwen3DSparkModel (qwen3_dspark.py:205-230) and the speculator
        (speculator.py:49-51, 78-80) read them. ``sample_from_anchor`` never goes into dflash_config: the
        DFlash speculator vLLM builds first refuses it there (dflash/speculator.py:77-85). ``block_size`` is
        the query block, N in the anchor layout (vLLM's default num_speculative_tokens,
        config/speculative.py:1481-1490)."""
        hf = self.base.to_hf_config()
        width = self.num_draft_tokens if self.sample_from_anchor else self.base.block_size
        hf["architectures"] = ["Qwen3DSparkModel"]
        hf["block_size"] = width
        hf["dflash_config"] = {**hf.get("dflash_config", {}), "block_size": width}
        hf.update(
            markov_rank=self.markov_rank,
            markov_head_type="vanilla",
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov,
            sample_from_anchor=self.sample_from_anchor,
        )
        if self.draft_vocab_size != self.base.vocab_size:
            hf["draft_vocab_size"] = self.draft_vocab_size
        if self.dspark_draft_topk is not None:
            hf["dspark_draft_topk"] = self.dspark_draft_topk
        return hf


class MarkovHead(nn.Module):
    """The low-rank previous-token bias (vLLM ``DSparkMarkovHead``): markov_w2(markov_w1(prev))."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """The acceptance-confidence logit (vLLM ``DSparkConfidenceHead``, bias True, L225-230)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone with DSpark's anchor layout, Markov walk and confidence head."""

    family = "dspark"

    def __init__(self, config: DSparkConfig) -> None:
        c = config
        super().__init__(c.base)
        self.config = config  # type: ignore[assignment]  # DSparkConfig reads through to the base
        self.first_draft_slot = 0 if c.sample_from_anchor else 1
        self.markov_head = MarkovHead(c.vocab_size, c.draft_vocab_size, c.markov_rank)
        self.confidence_head: ConfidenceHead | None = None
        if c.enable_confidence_head:
            extra = c.markov_rank if c.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(c.hidden_size + extra)

    def attach_target(
        self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None
    ) -> None:
        """DFlash's (the target's embedding and head, a reduced vocabulary's d2t); forgets the inverse map."""
        super().attach_target(embed_weight, lm_head_weight, d2t)
        self._target_to_draft = None

    # -- the Markov bias over the target vocabulary

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Previous tokens [n] (target ids) -> the bias [n, V] over target ids (qwen3_dspark.py:83-93;
        a reduced draft vocabulary's bias lands on its target ids, 0 elsewhere where the base logits
        are -inf anyway)."""
        bias = self.markov_head.markov_w2(self.markov_head.markov_w1(prev)).float()
        if self.draft_to_target is None:
            return bias
        full = bias.new_zeros((bias.shape[0], self.config.vocab_size))
        full[:, self.draft_to_target] = bias
        return full

    def _draft_rows(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> rows of markov_w2 (draft ids) for a reduced vocabulary; the ids themselves otherwise."""
        if self.draft_to_target is None:
            return target_ids
        inverse = getattr(self, "_target_to_draft", None)
        if inverse is None or inverse.device != target_ids.device:  # built once per attach_target and device
            inverse = torch.zeros(self.config.vocab_size, dtype=torch.long, device=target_ids.device)
            inverse[self.draft_to_target] = torch.arange(len(self.draft_to_target), device=target_ids.device)
            self._target_to_draft = inverse
        return inverse[target_ids]

    def _corrected(self, candidate: Any, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot's corrected logits for predecessors ``prev`` [n]: (scores [n, V] or [n, k], the
        candidates' target ids [n, k] under ``dspark_draft_topk``, else None)."""
        if isinstance(candidate, torch.Tensor):  # full rows: base + bias (speculator.py:184-185)
            return candidate + self.markov_bias(prev), None
        values, ids = candidate  # the top-k of the base logits, corrected (qwen3_dspark.py:154-161)
        weight = self.markov_head.markov_w2.weight[self._draft_rows(ids)]  # [n, k, r]
        embed = self.markov_head.markov_w1(prev).to(weight.dtype)  # [n, r]
        return values.float() + torch.einsum("nkr,nr->nk", weight, embed).float(), ids

    # -- DFlash's drafting hooks, drafted by the Markov walk

    def slot_candidates(self, logits: torch.Tensor, dtype: torch.dtype) -> Any:
        """Head logits [m, V] -> what the walk needs: the rows themselves (fp32), or with
        ``dspark_draft_topk`` their top-k values and ids in the drafter's ``dtype`` (vLLM takes
        ``base_logits.topk`` once per block, speculator.py:215)."""
        k = self.config.dspark_draft_topk
        if k is None:
            return logits
        top = torch.topk(logits.to(dtype), k, dim=-1)
        return (top.values, top.indices)

    @staticmethod
    def _slots(candidates: Sequence[Any], shape: tuple[int, int]) -> list[Any]:
        """The chunks' candidates laid out per slot: ``[slot j] -> [n, ...]`` for blocks of ``shape`` (n, D)."""
        n, d = shape
        if isinstance(candidates[0], torch.Tensor):
            full = torch.cat(list(candidates)).reshape(n, d, -1)
            return [full[:, j] for j in range(d)]
        values = torch.cat([c[0] for c in candidates]).reshape(n, d, -1)
        ids = torch.cat([c[1] for c in candidates]).reshape(n, d, -1)
        return [(values[:, j], ids[:, j]) for j in range(d)]

    def path(
        self, hidden: torch.Tensor, candidates: Sequence[Any], anchor_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The greedy walk (speculator.py:177-190): slot j's draft is the argmax of its corrected
        logits given slot j-1's draft (the anchor token for the first), the predecessor of slot j+1."""
        prev = anchor_tokens.long()
        drafts = []
        for slot in self._slots(candidates, hidden.shape[:2]):
            scores, ids = self._corrected(slot, prev)
            choice = scores.argmax(-1)
            prev = choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]
            drafts.append(prev)
        return torch.stack(drafts, dim=1)

    @torch.no_grad()
    def drawn_block(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, draw: Callable[[torch.Tensor], int]
    ) -> list[int]:
        """One block at T > 0 (probabilistic drafting): each slot ``draw``s from its corrected logits
        over the target vocabulary (-inf off the top-k), the drawn token the next slot's predecessor."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = self.head(flat).float()
        slots = self._slots([self.slot_candidates(logits, flat.dtype)], (1, flat.shape[0]))
        prev, out = anchor_tokens.long().reshape(1), []
        for slot in slots:
            scores, ids = self._corrected(slot, prev)
            if ids is not None:
                full = scores.new_full((1, self.config.vocab_size), float("-inf"))
                scores = full.scatter(1, ids, scores)
            token = int(draw(scores[0]))
            out.append(token)
            prev = torch.tensor([token], device=flat.device)
        return out

    def teacher_forced_scores(
        self, logits: torch.Tensor, dtype: torch.dtype, prev: torch.Tensor
    ) -> torch.Tensor:
        """Head logits [m, V] of slots whose predecessors ``prev`` [m] are given (a trajectory's tokens,
        not the walk's) -> their corrected logits [m, V], -inf off the top-k."""
        scores, ids = self._corrected(self.slot_candidates(logits, dtype), prev)
        if ids is None:
            return scores
        return scores.new_full((len(prev), self.config.vocab_size), float("-inf")).scatter(1, ids, scores)

    def teacher_forced_log_q(
        self, hidden: torch.Tensor, prev: torch.Tensor, wanted: torch.Tensor, temperature: float, rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """vLLM's DSpark drafting at T > 0 fed the trajectory y: slot j proposes from softmax(corrected
        logits / T) with the predecessor the previous drafted token, which along y is y_{a+j-1} (the
        anchor token for j = 1); q = 0 off the top-k. The draft is the corrected argmax, fed y."""
        from scorer.rules.expectation import draft_log_q

        n, k, h = hidden.shape
        flat = hidden.reshape(-1, h)
        prev, columns = prev.reshape(-1), wanted.reshape(-1)
        draft = np.zeros(n * k, dtype=np.int64)
        log_q = np.zeros(n * k, dtype=np.float64)
        with torch.no_grad():
            for lo, hi, new in row_chunks(flat.shape[0], max(1, rows)):
                logits = self.head(flat[lo:hi])[new - lo :].float()
                scores = self.teacher_forced_scores(logits, flat.dtype, prev[new:hi])
                draft[new:hi] = scores.argmax(-1).cpu().numpy()
                log_q[new:hi] = draft_log_q(scores, columns[new:hi], temperature).double().cpu().numpy()
        return draft.reshape(n, k), log_q.reshape(n, k)

    # -- training (scorer/families/dflash/train.py's loop): teacher-forced predecessors, as speculators
    # trains (core.py: slot k's bias from the block's ground-truth token before it)

    @staticmethod
    def _teacher_prev(anchor_tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each slot's predecessor along the text: the anchor token, then the targets (-100: any id, unused)."""
        return torch.cat([anchor_tokens[:, None].long(), targets[:, :-1].clamp(min=0)], dim=1)

    def training_logits(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The head plus the Markov bias of each slot's teacher-forced predecessor: [N, B-1, V]."""
        prev = self._teacher_prev(anchor_tokens, targets)
        bias = self.markov_bias(prev.reshape(-1)).reshape(*prev.shape, -1)
        return self.head(hidden) + bias.to(hidden.dtype)

    def auxiliary_loss(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        """The confidence head's BCE against each slot's acceptance rate, sum_v min(q_v, p_v)
        (speculators dspark/metrics.py L1-5, weight 1.0, its default ``confidence_head_alpha``); the
        cached target is one-hot (its greedy token), so that is q(target), detached."""
        if self.confidence_head is None:
            return None
        valid = targets != -100
        prev = self._teacher_prev(anchor_tokens, targets)
        q = torch.softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0].detach()
        x = hidden
        if self.config.confidence_head_with_markov:
            x = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        raw = self.confidence_head.proj(x.float())[..., 0]
        bce = F.binary_cross_entropy_with_logits(raw, q, reduction="none")
        return (bce * valid).sum() / valid.sum().clamp(min=1)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Per-slot acceptance confidence (qwen3_dspark.py:185-189, 305-310): block rows [m, H] and their
        slots' predecessors [m] -> sigmoid(proj(cat(row, markov_w1(prev)))) [m], fp32.

        Raises:
            ValueError: the drafter has no confidence head.
        """
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head false)")
        x = hidden
        if self.config.confidence_head_with_markov:
            x = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        proj = self.confidence_head.proj
        return torch.sigmoid(F.linear(x.float(), proj.weight.float(), proj.bias.float())[..., 0])
