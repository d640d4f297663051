"""Sampled extraction: vLLM's processed distribution, and seeded draws from it.

One processor serves both places it is needed (docs/extract.md "Sampled extraction"):

* during batched generation (``SeededSampler``, a transformers logits processor), it turns each
  row's logits into the processed distribution and draws the next token by Gumbel-max with noise
  from a counter-based hash keyed by (seed, record id, sample, position): no global RNG, so batch
  composition, a resume and the thread count do not change a draw;
* in the teacher-forced capture forward (``SupportBuilder``, fed row chunk by row chunk), it
  computes the distribution a vLLM verifier would at every generated position, with the penalty
  history = the generated tokens before it (repetition: prompt + generated), and stores its support.

vLLM's order (vllm/v1/sample/sampler.py ``Sampler.forward`` steps 6-7): penalties
(vllm/model_executor/layers/utils.py ``apply_penalties``: repetition via
``apply_repetition_penalties_torch`` in vllm/_custom_ops.py, then frequency, then presence), then
temperature (divide), min_p (vllm/v1/sample/logits_processor/builtin.py ``MinPLogitsProcessor``),
then top-k and top-p (vllm/v1/sample/ops/topk_topp_sampler.py ``apply_top_k_top_p``: top-k keeps
every value >= the k-th largest, so ties are kept; top-p drops the smallest while their ascending
cumulative probability is <= 1 - p, always keeping the largest), then softmax.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from transformers import LogitsProcessor

from hscache.capture.forward import CapturedSequence, continuations
from hscache.capture.prompts import PromptRecord
from hscache.capture.responses import ServedRecord, served_arrays
from hscache.capture.target import Target
from hscache.errors import HscacheError
from hscache.store.layout import SAMPLED_ARRAYS
from hscache.store.sampling import SamplingSetting
from hscache.store.writer import StoreWriter

__all__ = [
    "SeededSampler",
    "SupportBuilder",
    "SAMPLING_BYTES_PER_LOGIT",
    "SupportOverflowError",
    "attach",
    "draw_key",
    "gumbel_choice",
    "penalise_dense",
    "processed_support",
    "realised_counts",
    "sampled_arrays",
    "sampled_continuations",
]

# The [rows, V] temporaries of the processor beside next_token_stats' own 12 bytes a logit: its one
# float32 copy (penalised, then scaled in place) and, with min_p, a float32 softmax and a bool mask.
SAMPLING_BYTES_PER_LOGIT = 9
_KEY_DOMAIN = "hscache-gumbel-v1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class SupportOverflowError(HscacheError, ValueError):
    """More tokens tie at the top-k boundary than the stored support holds (2 * top_k)."""


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float32 scalar tensor on ``like``'s device: vLLM keeps its parameters as float32 tensors."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def penalise_dense(
    logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor | None, s: SamplingSetting
) -> torch.Tensor:
    """vLLM's penalties on ``[B, V]`` float32 logits with ``[B, V]`` output counts (a new tensor).

    ``prompt_mask``: ``[B, V]`` bool, the prompt's tokens (needed for the repetition penalty only).
    """
    out = logits.clone()
    seen = output_counts > 0
    if s.repetition_penalty != 1.0:
        r = _f32(s.repetition_penalty, out)
        hit = seen | prompt_mask if prompt_mask is not None else seen
        penalties = torch.where(hit, r, _f32(1.0, out))
        out *= torch.where(out > 0, 1.0 / penalties, penalties)
    if s.frequency_penalty != 0.0:
        out -= _f32(s.frequency_penalty, out) * output_counts
    if s.presence_penalty != 0.0:
        out -= _f32(s.presence_penalty, out) * seen
    return out


def processed_support(
    logits: torch.Tensor, s: SamplingSetting, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The processed distribution of ``[R, V]`` penalised float32 logits, as its support
    (``inplace``: ``logits`` may be overwritten, which saves a ``[R, V]`` copy).

    Returns:
        ids ``[R, W]`` int64 and probs ``[R, W]`` float32 (W = ``s.support_width``), sorted by
        probability, descending; the support is the entries with probability > 0, the rest are
        id -1 and probability 0. And overflow ``[R]`` bool: rows whose tokens tied at the k-th value
        do not fit W (their support is not exact).
    """
    vocab = logits.shape[-1]
    scaled = logits.div_(_f32(s.temperature, logits)) if inplace else logits / _f32(s.temperature, logits)
    if s.min_p > 0:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _f32(s.min_p, scaled)
        scaled.masked_fill_(probs < floor, -float("inf"))  # scaled is always this function's own tensor
        del probs
    k, width = min(s.top_k, vocab), min(s.support_width, vocab)
    values, ids = scaled.topk(min(width + 1, vocab), dim=-1)  # sorted descending; +1 sees an overflow
    kth = values[:, k - 1 : k]
    keep = (values >= kth) & (values > -float("inf"))
    overflow = keep[:, width] if values.shape[1] > width else torch.zeros_like(keep[:, 0])
    values, ids, keep = values[:, :width], ids[:, :width], keep[:, :width]
    values = values.masked_fill(~keep, -float("inf"))
    # Equal values in a fixed order (descending value, then descending id: what vLLM's ascending sort
    # gives when it is stable): top-p then drops the lower ids of a tie it cuts through.
    order = ids.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    if s.top_p < 1.0:
        ascending = values.flip(-1)  # vLLM sorts ascending; masked entries (probability 0) come first
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - _f32(s.top_p, ascending)
        drop[:, -1] = False  # at least one
        values = ascending.masked_fill(drop, -float("inf")).flip(-1)
    probs = values.softmax(dim=-1)
    support = probs > 0
    return ids.masked_fill(~support, -1), probs.masked_fill(~support, 0.0), overflow


def draw_key(seed: int, record_id: str, sample: int, position: int) -> int:
    """The 64-bit key of one draw: BLAKE2b-64 of ``hscache-gumbel-v1|seed|len:record_id|sample|position``
    (``position``: the drawn token's index among the generated tokens, from 0)."""
    text = f"{_KEY_DOMAIN}|{seed}|{len(record_id)}:{record_id}|{sample}|{position}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _uniform(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Counter-based uniforms in (0, 1): SplitMix64's finaliser of key + (token + 1) * golden ratio."""
    with np.errstate(over="ignore"):
        z = keys[:, None].astype(np.uint64) + (ids.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def gumbel_choice(ids: np.ndarray, probs: np.ndarray, keys: Sequence[int]) -> np.ndarray:
    """Per row, the support entry maximising log p + Gumbel noise (an exact draw from p), in float64.

    ``ids``/``probs``: ``[R, W]`` as ``processed_support`` returns them; ``keys``: ``draw_key`` per row.
    """
    keys_arr = np.asarray([int(k) for k in keys], dtype=np.uint64)
    safe_ids = np.where(ids >= 0, ids, 0)
    gumbel = -np.log(-np.log(_uniform(keys_arr, safe_ids)))
    with np.errstate(divide="ignore"):
        score = np.where(ids >= 0, np.log(probs.astype(np.float64)) + gumbel, -np.inf)
    return ids[np.arange(len(ids)), score.argmax(axis=1)]


class SeededSampler(LogitsProcessor):
    """The next-token draw inside transformers ``generate`` (do_sample=False): every row's scores
    become -inf except the drawn token's. Rows are left-padded prompts ``prompts``; ``keys`` holds
    (record id, sample) per row. Stateful: one instance per ``generate`` call."""

    def __init__(
        self, setting: SamplingSetting, prompts: Sequence[Sequence[int]], keys: Sequence[tuple[str, int]]
    ):
        self.setting, self.prompts, self.keys = setting, [list(p) for p in prompts], list(keys)
        self.width = max(len(p) for p in self.prompts)
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.counted = self.width  # input_ids columns already in counts

    def _history(self, input_ids: torch.Tensor, vocab: int) -> None:
        if self.counts is None:
            self.counts = torch.zeros((len(self.prompts), vocab), dtype=torch.long, device=input_ids.device)
            if self.setting.repetition_penalty != 1.0:
                self.prompt_mask = torch.zeros_like(self.counts, dtype=torch.bool)
                for row, prompt in enumerate(self.prompts):
                    self.prompt_mask[row, torch.tensor(prompt, device=input_ids.device)] = True
        new = input_ids[:, self.counted :]
        if new.shape[1]:
            self.counts.scatter_add_(1, new, torch.ones_like(new))
            self.counted = input_ids.shape[1]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._history(input_ids, scores.shape[-1])
        logits = penalise_dense(scores.float(), self.counts, self.prompt_mask, self.setting)
        ids, probs, overflow = processed_support(logits, self.setting)
        step = input_ids.shape[1] - self.width
        if bool(overflow.any()):
            row = int(overflow.nonzero()[0, 0])
            raise _overflow_error(self.setting, self.keys[row][0], step)
        keys = [draw_key(int(self.setting.seed), rid, sample, step) for rid, sample in self.keys]
        chosen = gumbel_choice(ids.cpu().numpy(), probs.cpu().numpy(), keys)
        out = torch.full_like(scores, -float("inf"))
        out[torch.arange(len(chosen)), torch.as_tensor(chosen, device=scores.device)] = 0.0
        return out


def _overflow_error(s: SamplingSetting, record_id: str, position: int) -> SupportOverflowError:
    return SupportOverflowError(
        f"record {record_id!r}, generated position {position}: more than {s.support_width} tokens tie at the "
        f"top-k boundary (top_k {s.top_k}), so vLLM's processed distribution does not fit the stored support; "
        "the committed sequences are intact: choose another --top-k"
    )


def sampled_continuations(
    target: Target,
    prompts: Sequence[Sequence[int]],
    keys: Sequence[tuple[str, int]],
    setting: SamplingSetting,
    max_new_tokens: int,
    max_length: int,
) -> list[tuple[list[int], str]]:
    """Sampled continuations of several prompts in one batched ``generate`` (as ``greedy_continuations``,
    each row drawn by ``SeededSampler``); ``keys``: (record id, sample) per prompt."""

    def sampler_for(rows: list[int]) -> SeededSampler:
        return SeededSampler(setting, [prompts[i] for i in rows], [keys[i] for i in rows])

    return continuations(target, prompts, max_new_tokens, max_length, sampler_for=sampler_for)


class _History:
    """One sequence's penalty history in the columns it touches: D, the distinct generated tokens
    (counts per row as an exclusive running sum), and the prompt-only tokens (repetition)."""

    def __init__(self, token_ids: torch.Tensor, prompt_len: int):
        generated = token_ids[prompt_len:]
        self.prompt_len, self.generated = prompt_len, generated
        self.distinct, self.inverse = torch.unique(generated, return_inverse=True)
        prompt = torch.unique(token_ids[:prompt_len])
        self.in_prompt = torch.isin(self.distinct, prompt)
        self.prompt_only = prompt[~torch.isin(prompt, self.distinct)]

    def counts(self, first_row: int, rows: int) -> torch.Tensor:
        """``[rows, |D|]`` counts of the generated tokens before each row's next token."""
        g0, n, u = first_row + 1 - self.prompt_len, len(self.generated), len(self.distinct)
        base = torch.bincount(self.inverse[:g0], minlength=u)
        step = torch.zeros((rows, u), dtype=torch.long, device=self.generated.device)
        r = torch.arange(rows, device=step.device)
        inside = g0 + r < n
        step[r[inside], self.inverse[g0 + r[inside]]] = 1
        return base + step.cumsum(0) - step

    def penalise_(self, out: torch.Tensor, first_row: int, s: SamplingSetting) -> torch.Tensor:
        """vLLM's penalties, in place, on rows ``first_row..`` of this sequence (equal to
        ``penalise_dense`` with this history)."""
        if len(self.distinct):
            counts = self.counts(first_row, len(out))
            cols = out[:, self.distinct]
            if s.repetition_penalty != 1.0:
                r = _f32(s.repetition_penalty, out)
                hit = (counts > 0) | self.in_prompt[None, :]
                cols = torch.where(hit, cols * torch.where(cols > 0, 1.0 / r, r), cols)
            if s.frequency_penalty != 0.0:
                cols = cols - _f32(s.frequency_penalty, out) * counts
            if s.presence_penalty != 0.0:
                cols = cols - _f32(s.presence_penalty, out) * (counts > 0)
            out[:, self.distinct] = cols
        if s.repetition_penalty != 1.0 and len(self.prompt_only):
            r = _f32(s.repetition_penalty, out)
            cols = out[:, self.prompt_only]
            out[:, self.prompt_only] = cols * torch.where(cols > 0, 1.0 / r, r)
        return out


class SupportBuilder:
    """The processed distribution at every generated position of one teacher-forced sequence.

    Called with each row chunk of the capture forward's float32 logits (``next_token_stats``'s
    ``on_logits``); rows ``prompt_len - 1 .. T - 2`` (those predicting a generated token) get the
    support, the others keep id -1 / probability 0 and a NaN realised probability.
    """

    def __init__(self, setting: SamplingSetting, token_ids: torch.Tensor, prompt_len: int, record_id: str):
        self.setting, self.token_ids, self.record_id = setting, token_ids, record_id
        length, width, device = len(token_ids), setting.support_width, token_ids.device
        self.first, self.stop = max(prompt_len - 1, 0), length - 1  # rows [first, stop)
        self.ids = torch.full((length, width), -1, dtype=torch.int32, device=device)
        self.probs = torch.zeros((length, width), dtype=torch.float32, device=device)
        self.token_prob = torch.full((length,), float("nan"), dtype=torch.float32, device=device)
        self.history = _History(token_ids, prompt_len)

    def __call__(self, first_row: int, logits: torch.Tensor) -> None:
        a, b = max(first_row, self.first), min(first_row + len(logits), self.stop)
        if a >= b:
            return
        rows = logits[a - first_row : b - first_row].clone()  # the one [rows, V] copy the processor makes
        penalised = self.history.penalise_(rows, a, self.setting)
        ids, probs, overflow = processed_support(penalised, self.setting, inplace=True)
        if bool(overflow.any()):
            row = a + int(overflow.nonzero()[0, 0])
            raise _overflow_error(self.setting, self.record_id, row + 1 - (self.history.prompt_len))
        self.ids[a:b], self.probs[a:b] = ids.to(torch.int32), probs
        realised = ids == self.token_ids[a + 1 : b + 1, None]
        self.token_prob[a:b] = (probs * realised).sum(dim=-1)


def attach(captured: CapturedSequence, builder: SupportBuilder) -> CapturedSequence:
    """``captured`` with the builder's support, probabilities and realised probabilities."""
    return replace(
        captured, support_ids=builder.ids, support_probs=builder.probs, token_prob=builder.token_prob
    )


def sampled_arrays(
    captured: CapturedSequence, record: PromptRecord, prompt_len: int
) -> dict[str, np.ndarray]:
    """The sampled arrays of one sequence in their stored dtypes: the teacher-forced support built
    here, or (``--responses-from``) the server's."""
    if isinstance(record, ServedRecord) and record.choice is not None:
        return served_arrays(record.choice, len(captured.token_ids), prompt_len)
    assert captured.support_ids is not None and captured.support_probs is not None
    assert captured.token_prob is not None
    return {
        SAMPLED_ARRAYS[0]: captured.support_ids.cpu().numpy().astype(np.int32, copy=False),
        SAMPLED_ARRAYS[1]: captured.support_probs.cpu().numpy().astype(np.float32, copy=False),
        SAMPLED_ARRAYS[2]: captured.token_prob.cpu().numpy().astype(np.float32, copy=False),
    }


def realised_counts(writer: StoreWriter, block_tokens: int = 1 << 22) -> dict[str, int]:
    """Over the committed rows of a sampled cache: positions that hold a drawn token, and those whose
    drawn token has probability 0 in the stored (teacher-forced) distribution. The generation
    forward (batched, KV-cached) and the teacher-forced one can differ in the last bits, so a token
    drawn at a truncation boundary can fall outside the stored support: counted, never hidden."""
    array = writer.appenders[SAMPLED_ARRAYS[2]].array
    positions = outside = 0
    for start in range(0, writer.committed_tokens, block_tokens):
        probs = np.asarray(array[start : min(start + block_tokens, writer.committed_tokens)])
        drawn = ~np.isnan(probs)
        positions += int(drawn.sum())
        outside += int((probs[drawn] == 0).sum())
    return {"sampled_positions": positions, "realised_outside_support": outside}
