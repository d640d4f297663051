"""The engines' penalties and processor orders over a round's rows: which tokens a row's penalties count
(vLLM's in-round history, SGLang's relaxed pre-round vector) and the processed target distribution of
every row (penalties, then /T, min_p, top-k, top-p: hscache.capture.sampling's processor, vLLM's order,
spec/sampling.md 1.1). The online loop (scorer/online/sampled.py) verifies against these rows; the
offline scorer reads the same processor's output from a sampled cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hscache.capture.sampling import penalise_dense, processed_support
from hscache.store.sampling import SamplingSetting
from scorer.errors import ScorerError

__all__ = ["SGLANG_PENALTY", "VLLM_PENALTY", "RowBlock", "processed_rows", "sglang_penalty_history"]

# SGLang's penalties in tree verification, as read in sgl-project/sglang (the EAGLE worker, v1):
# - python/sglang/srt/speculative/eagle_info.py @ 0007d13b0099d8b0b42b74b19fc4b16b8ce1dd3a,
#   EagleVerifyInput.verify L230-241, line numbers counted in the stored copy ("This is a relaxed version of penalties for speculative decoding"):
#   linear_penalty = zeros(bs, V); sampling_info.apply_logits_bias(linear_penalty);
#   next_token_logits.add_(repeat_interleave(linear_penalty, draft_token_num)): ONE additive vector per
#   request, the same for every node and the bonus row; then /T, softmax, top_k_renorm_prob,
#   top_p_renorm_prob (L273-292; no min_p in that verify).
# - the vector: python/sglang/srt/sampling/sampling_batch_info.py @ 009db01a7c0d5460611d543516401eb497641918,
#   apply_logits_bias -> penalizer_orchestrator.apply, whose penalizers are {Frequency, MinNewTokens,
#   Presence} (no repetition penalizer: from_schedule_batch); penaltylib/presence_penalty.py
#   @ 0a39d72aa8f04acbf3f97ba67d8b6b67c88903e7 (_cumulate_output_tokens: scatter_ of the penalty at each fed
#   token; _apply: logits.sub_) and frequency_penalty.py @ 0eaa70667ecaf8c8974101f8dc39aaefab0b0e0b
#   (scatter_add_ per fed token; logits.sub_): -presence * [fed] - frequency * count(fed). The counters
#   start at zero (no prompt token). Even a multiplicative repetition penalizer (older commits) would map
#   the zero vector to zero: SGLang's tree verification never applies --repetition-penalty.
# - which tokens are fed: eagle_worker.py @ 00559eacbf0841146db7e27e445d1971e35e6294,
#   _draft_preprocess_decode ("Accumulate penalty ... relaxed version"): cumulate_output_tokens(
#   spec_info.verified_id) once per round, before drafting; verified_id is then ONE token per request:
#   eagle_info.py @ 0007d13b EagleDraftInput.prepare_extend_after_decode -> create_extend_after_decode_spec_info
#   stores verified_id[accept_len_cumsum + accept_len - 1], the round's last (bonus / recovered) token;
#   before the first round, the prefill's token (forward_draft_extend: verified_id=next_token_ids).
#   So the history of a round is the anchor token of every round so far, this one included: accepted
#   drafts are never counted, in their round or later (sglang_penalty_history). Newer SGLang (multi-token
#   cumulation, DFlash block penalty state) counts more: this transcribes the commits above.
SGLANG_PENALTY = "sglang-relaxed"
VLLM_PENALTY = "vllm-in-round"  # the generated tokens and the drafts before each row (spec 1.1)


def sglang_penalty_history(ids: Sequence[int], prompt_len: int, tokens_per_round: Sequence[int]) -> list[int]:
    """The tokens SGLang's penalizers were fed before a round (``SGLANG_PENALTY``'s sources): the first
    token after the prompt, then each finished round's last emitted token, i.e. every round's anchor,
    the current one included; the accepted drafts before a round's last token are never counted.

    Args:
        ids: the committed tokens (prompt + generated) at the round's start.
        prompt_len: the prompt's length (``ids[prompt_len]`` is the first generated token).
        tokens_per_round: the tokens each finished round committed (``commit_round``).
    """
    history, at = [], prompt_len
    if at < len(ids):
        history.append(int(ids[at]))
    for n in tokens_per_round:
        at += n
        history.append(int(ids[at]))
    return history


@dataclass(frozen=True)
class RowBlock:
    """The rows of one round's sequence (its first row predicts the token after the anchor, row j + 1
    the token after ``extra[j]``) and what their penalties count.

    Attributes:
        history: the output tokens counted at the first row (never the prompt: vLLM and SGLang count
            generated tokens for presence and frequency).
        prompt: the prompt (vLLM's repetition penalty covers it too).
        extra: the drafts (a chain) or a tree path after the anchor.
        in_round: vLLM's rule (row j counts ``extra[:j]`` as well, spec 1.1) if true; SGLang's relaxed
            rule (every row the same ``history``, spec 1.2) if false.
    """

    history: Sequence[int]
    prompt: Sequence[int]
    extra: Sequence[int]
    in_round: bool = True


def processed_rows(
    logits: torch.Tensor, blocks: Sequence[RowBlock], setting: SamplingSetting, vocab: int
) -> torch.Tensor:
    """Dense processed distributions [R, V] float32 of stacked round rows (``len(extra) + 1`` rows a
    block, in ``blocks`` order): penalties with each block's counts (``RowBlock``), then /T, min_p,
    top-k, top-p (hscache.capture.sampling's processor: ``penalise_dense``, ``processed_support``).

    SGLang adds ``-presence * [seen] - frequency * count`` as one vector before /T; vLLM subtracts the
    same two terms from the logits: one ``penalise_dense`` serves both, the rules differ in the counts.

    Raises:
        ScorerError: more tokens tie at the top-k boundary than the support holds.
    """
    counts = torch.zeros((len(logits), vocab), dtype=torch.int32, device=logits.device)
    prompt_mask = None
    if setting.repetition_penalty != 1.0:
        prompt_mask = torch.zeros((len(logits), vocab), dtype=torch.bool, device=logits.device)
    row = 0
    for block in blocks:
        base = torch.bincount(torch.tensor(list(block.history), dtype=torch.long), minlength=vocab).int()
        rows = base.repeat(len(block.extra) + 1, 1)
        if block.in_round:
            for j, token in enumerate(block.extra):
                rows[j + 1 :, token] += 1
        counts[row : row + len(rows)] = rows.to(counts.device)
        if prompt_mask is not None:
            prompt_mask[row : row + len(rows), torch.tensor(list(block.prompt), dtype=torch.long)] = True
        row += len(rows)
    ids, probs, overflow = processed_support(penalise_dense(logits, counts, prompt_mask, setting), setting)
    if bool(overflow.any()):
        raise ScorerError(
            f"more than {setting.support_width} target tokens tie at the top-k boundary (top_k {setting.top_k}): "
            "the processed distribution is not exact; choose another --top-k"
        )
    dense = torch.zeros((len(logits), vocab), dtype=torch.float32, device=logits.device)
    return dense.scatter_add_(1, ids.clamp(min=0).long(), probs).cpu()  # id -1 carries probability 0
