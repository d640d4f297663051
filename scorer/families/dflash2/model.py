"""DFlash2 (z-lab 2026; NeMo Automodel 0.7 ``Qwen3DFlash2DraftModel``): DFlash's one-pass block
draft plus two modules, transcribed from ``nemo_automodel/components/speculative/dflash/
draft_qwen3_dflash2.py`` (nemo-automodel 0.7.0):

- `GroupedDynamicCausalConv` (``GroupedDynamicCausalConv`` / ``_grouped_dynamic_convolve``): a
  two-tap depthwise convolution before and after each attention and MLP sublayer,
  ``Conv(x)_t = k_{t,0} * x_t + k_{t,1} * x_{t-1}`` within a draft block (slot 0 reads zeros),
  each tap a learned base kernel plus a correction predicted from the sublayer's input and
  shared by ``conv_group_size`` channels. Both convolutions' corrections come from the
  sublayer's input (``prepare`` returns the second set for ``finish``).
- `CandidateSelector` (``CandidateSelector.walk``, greedy): each drafted slot keeps its top
  ``selector_top_k`` candidates by the draft logit ``U_t(b)``; adjacent pairs are scored
  ``S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)>`` (A, B rank-``selector_rank`` codebooks, H the
  hidden projection) and the path walks from the anchor token, taking the best successor of the
  token it just chose at each slot.

The backbone is scorer.families.dflash.model.DFlashDrafter, subclassed: `DFlash2Layer` overrides
DFlash's sublayer hooks (``attention_input``, ``attention_output``, ``mlp_block``) with the
convolutions, `DFlash2Drafter` DFlash's drafting from the head (``slot_candidates``, ``path``,
``drawn_block``, ``teacher_forced_log_q``) with the selector. Parameter names are NeMo's checkpoint keys
(``layers.N.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}``,
``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}``).
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
from scorer.families.dflash.model import DFlashDrafter, DFlashLayer

__all__ = ["CandidateSelector", "DFlash2Config", "DFlash2Drafter", "GroupedDynamicCausalConv"]


@dataclass(frozen=True)
class DFlash2Config:
    """DFlash's config plus DFlash2's four settings (``dflash_config`` keys; NeMo's defaults)."""

    base: DFlashConfig
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __getattr__(self, name: str) -> Any:  # everything else is the DFlash backbone's
        if name == "base" or name.startswith("__"):  # unpickling: no base yet
            raise AttributeError(name)
        return getattr(self.base, name)

    def to_hf_config(self) -> dict[str, Any]:
        hf = self.base.to_hf_config()
        hf["architectures"] = ["DFlash2DraftModel"]
        hf["dflash_config"] = {
            **hf.get("dflash_config", {}),
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }
        return hf


def _convolve(
    hidden: torch.Tensor, dynamic: torch.Tensor, base_kernel: torch.Tensor, group_size: int
) -> torch.Tensor:
    """NeMo ``_grouped_dynamic_convolve`` on blocks laid out ``[n, B, H]``: tap ``offset`` reads
    slot ``t - offset`` of the same block, zero before slot ``offset``."""
    n, B, H = hidden.shape
    groups, kernel_size = H // group_size, base_kernel.shape[0]
    blocks = hidden.view(n, B, groups, group_size)
    dynamic = dynamic.view(n, B, kernel_size, groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(kernel_size):
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        kernel = base_kernel[offset].view(1, 1, groups, group_size).to(hidden.dtype)
        output = output + kernel * values
        output = torch.addcmul(output, dynamic[:, :, offset], values)
    return output.view(n, B, H)


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer (index 0 before it, 1 after it)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, hidden: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [M, H] (whole blocks of B) -> (convolved rows, the post-sublayer coefficients)."""
        M, H = hidden.shape
        groups = H // self.group_size
        dynamic = self.kernel_projection(hidden).view(M, 2, self.kernel_size, groups)
        convolved = _convolve(hidden.view(-1, B, H), dynamic[:, 0], self.base_kernel[0], self.group_size)
        return convolved.reshape(M, H), dynamic[:, 1]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor, B: int) -> torch.Tensor:
        M, H = hidden.shape
        return _convolve(hidden.view(-1, B, H), dynamic, self.base_kernel[1], self.group_size).reshape(M, H)


class CandidateSelector(nn.Module):
    """The pairwise path selector; ``top_k`` candidates per slot, rank-``rank`` codebooks."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.rank, self.top_k = rank, top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidate_ids: torch.Tensor,
        anchor_ids: torch.Tensor,
        draw: Callable[[torch.Tensor], int] | None = None,
    ) -> torch.Tensor:
        """Greedy path: hidden [n, D, H], top-k draft logits ``unary`` and their token ids
        [n, D, k], the anchor tokens [n] -> the chosen tokens [n, D] (NeMo ``walk``, greedy).

        ``draw`` (one block, n = 1): each position's token is ``draw(scores)`` instead of the argmax,
        the scores over the whole vocabulary and -inf outside the position's candidates, and the drawn
        token is the next position's predecessor: NeMo's walk at T > 0 (``CandidateSelector.walk``
        L261-315, softmax(scores / T) over the candidates, spec/sampling.md 1.3), which vLLM MRV2
        runs for DFlash2 at any T > 0."""
        gate_hidden = self.hidden_projection(hidden)
        predecessor = anchor_ids
        path = []
        for position in range(hidden.shape[1]):
            gate = F.embedding(predecessor, self.predecessor_codebook) * gate_hidden[:, position]
            scores = unary[:, position] + torch.einsum(
                "br,bkr->bk", gate, F.embedding(candidate_ids[:, position], self.successor_codebook)
            )
            if draw is not None:
                full = scores.new_full((self.predecessor_codebook.shape[0],), float("-inf"))
                full[candidate_ids[0, position]] = scores[0].float()
                predecessor = torch.tensor([int(draw(full))], device=scores.device)
            else:
                choice = scores.argmax(dim=-1)
                predecessor = candidate_ids[:, position].gather(-1, choice.unsqueeze(-1)).squeeze(-1)
            path.append(predecessor)
        return torch.stack(path, dim=1)

    def teacher_forced_scores(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidate_ids: torch.Tensor,
        predecessors: torch.Tensor,
    ) -> torch.Tensor:
        """The pair scores S_t(prev_t, b) of every slot at once, the predecessors given instead of
        walked: hidden [n, D, H], ``unary`` and ``candidate_ids`` [n, D, k], predecessors [n, D]
        -> [n, D, k]."""
        gate = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        return unary + torch.einsum(
            "bkr,bkcr->bkc", gate, F.embedding(candidate_ids, self.successor_codebook)
        )


class DFlash2Layer(DFlashLayer):
    """A DFlash layer with DFlash2's in-block convolutions around each sublayer."""

    def __init__(self, c: DFlashConfig, kernel_size: int, group_size: int) -> None:
        super().__init__(c)
        self.attention_conv = GroupedDynamicCausalConv(c.hidden_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(c.hidden_size, kernel_size, group_size)

    def attention_input(self, h: torch.Tensor, B: int) -> tuple[torch.Tensor, Any]:
        return self.attention_conv.prepare(self.input_layernorm(h), B)

    def attention_output(self, out: torch.Tensor, state: Any, B: int) -> torch.Tensor:
        return self.attention_conv.finish(out, state, B)

    def mlp_block(self, x: torch.Tensor, B: int) -> torch.Tensor:
        x, conv = self.mlp_conv.prepare(x, B)
        return self.mlp_conv.finish(self.mlp(x), conv, B)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash backbone with DFlash2's convolutions in every layer and the path selector."""

    family = "dflash2"

    def __init__(self, config: DFlash2Config) -> None:
        c = config
        super().__init__(c.base, layer=lambda base: DFlash2Layer(base, c.conv_kernel_size, c.conv_group_size))
        self.config = config  # type: ignore[assignment]  # DFlash2Config reads through to the base
        self.candidate_selector = CandidateSelector(
            c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k
        )

    # DFlash's drafting from the head (DFlashDrafter.slot_candidates ...), drafted by the selector:
    # each slot keeps its top ``selector_top_k`` candidates, the walk picks the path through them.

    def slot_candidates(self, logits: torch.Tensor, dtype: torch.dtype) -> Any:
        """Each row's top ``selector_top_k`` draft logits and token ids (``torch.return_types.topk``),
        NeMo's walk input: ``torch.topk`` of the draft logits in the drafter's ``dtype``."""
        return torch.topk(logits.to(dtype), self.candidate_selector.top_k, dim=-1)

    def path(
        self, hidden: torch.Tensor, candidates: Sequence[Any], anchor_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The selector's greedy walk from the anchor tokens [n] through the chunks' candidates."""
        shape = (*hidden.shape[:-1], -1)
        unary = torch.cat([top.values for top in candidates]).reshape(shape)
        ids = torch.cat([top.indices for top in candidates]).reshape(shape)
        return self.candidate_selector.walk(hidden, unary, ids, anchor_tokens)

    @torch.no_grad()
    def drawn_block(
        self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, draw: Callable[[torch.Tensor], int]
    ) -> list[int]:
        """One block at T > 0: the selector's walk with ``draw`` over the same top-k candidates as
        its greedy path (vLLM MRV2 runs it for DFlash2 at any T > 0)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        top = self.slot_candidates(self.head(flat).float(), flat.dtype)
        return self.candidate_selector.walk(
            hidden, top.values[None], top.indices[None], anchor_tokens, draw=draw
        )[0].tolist()

    def teacher_forced_log_q(
        self, hidden: torch.Tensor, prev: torch.Tensor, wanted: torch.Tensor, temperature: float, rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """vLLM MRV2's selector walk at T > 0, fed the trajectory y: slot j proposes from the softmax
        over its candidates (``slot_candidates``, the head projected ``rows`` rows at a time) of
        scores(prev, .) / T with prev the previous drafted token, which along y is y_{a+j-1} (the
        anchor token for j = 1); q = 0 off the candidates. The draft is the candidate of the highest
        score (the greedy walk, fed y)."""
        n, k, h = hidden.shape
        flat = hidden.reshape(-1, h)
        chunks = [
            self.slot_candidates(self.head(flat[lo:hi])[new - lo :].float(), flat.dtype)
            for lo, hi, new in row_chunks(flat.shape[0], rows)
        ]
        unary = torch.cat([top.values for top in chunks]).reshape(n, k, -1)
        cand = torch.cat([top.indices for top in chunks]).reshape(n, k, -1)
        scores = self.candidate_selector.teacher_forced_scores(hidden, unary, cand, prev)
        draft = cand.gather(-1, scores.argmax(dim=-1, keepdim=True))[..., 0]
        logq_all = torch.log_softmax(scores.float() / temperature, dim=-1)
        hit = cand == wanted[..., None]
        picked = torch.where(hit, logq_all, torch.full_like(logq_all, -torch.inf)).amax(dim=-1)
        return draft.cpu().numpy(), picked.double().cpu().numpy()
