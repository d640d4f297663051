"""Run the target: greedy continuation, then one teacher-forced forward that captures
the requested layers and the target's next-token data. Tensors in, tensors out; no I/O.

Capture uses forward hooks on decoder layers, so "layer i" is the raw output of decoder
layer i (= transformers ``hidden_states[i + 1]`` for i < L - 1; for the last layer the hook
sees it BEFORE the final norm, unlike transformers' last entry). Spec section 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from hscache.capture.logit_rows import BYTES_PER_LOGIT, DEFAULT_MEMORY_GB, head_rows, row_chunks
from hscache.capture.target import Target

__all__ = [
    "CapturedSequence",
    "capture_batch",
    "continuations",
    "eos_token_ids",
    "greedy_continuation",
    "greedy_continuations",
    "next_token_stats",
    "to_host_async",
]


@dataclass
class CapturedSequence:
    """What one forward produced for one sequence (no padding), on the device it ran on."""

    token_ids: torch.Tensor  # [T] int64
    hidden_states: torch.Tensor  # [T, K, H] run dtype
    argmax: torch.Tensor  # [T] int64: greedy prediction for position t + 1
    topk_values: torch.Tensor  # [T, k] float32 logits
    topk_ids: torch.Tensor  # [T, k] int64
    logsumexp: torch.Tensor  # [T] float32 over the full vocabulary
    logits: torch.Tensor | None  # [T, V] float32 when full logits are kept
    # Sampled caches (capture/sampling.py SupportBuilder): the processed distribution's support per row.
    support_ids: torch.Tensor | None = None  # [T, W] int32, -1 outside the support
    support_probs: torch.Tensor | None = None  # [T, W] float32
    token_prob: torch.Tensor | None = None  # [T] float32: p(token t + 1); NaN where nothing was drawn


def greedy_continuation(
    target: Target, prompt_ids: Sequence[int], max_new_tokens: int, max_length: int
) -> tuple[list[int], str]:
    """Prompt + the target's greedy continuation (transformers ``generate``, do_sample=False).

    Returns the full token list and why generation stopped: "eos", "max_new_tokens",
    "max_length", or "none" when no tokens were requested.
    """
    return greedy_continuations(target, [prompt_ids], max_new_tokens, max_length)[0]


def eos_token_ids(target: Target) -> set[int]:
    """The token ids that end a continuation: the target's generation config's, else its tokenizer's."""
    return _eos_ids(target)[1]


def _eos_ids(target: Target) -> tuple[Any, set[int]]:
    eos = target.model.generation_config.eos_token_id
    eos = eos if eos is not None else target.tokenizer.eos_token_id
    return eos, set(eos) if isinstance(eos, (list, tuple)) else {eos}


def greedy_continuations(
    target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_length: int
) -> list[tuple[list[int], str]]:
    """Greedy continuations of several prompts in ONE batched ``generate`` (left padding).

    Each sequence stops on its own: at its first EOS, at ``max_new_tokens``, or where it
    reaches ``max_length`` (shorter prompts simply generate further; a greedy prefix does not
    depend on how long decoding went on, so cutting afterwards equals stopping there). One
    prompt runs unpadded, exactly as before. With padding, full-attention layers mask the pads
    and the Gated DeltaNet layers zero them (their state stays exactly zero through them), so in
    fp32 the tokens equal one-at-a-time generation (tested); in bf16 a near-tie may flip, and
    the teacher-forced capture then counts it as ``off_greedy``.

    Returns:
        Per prompt, in order: (prompt + continuation, stop reason) as in ``greedy_continuation``.
    """
    return continuations(target, prompts, max_new_tokens, max_length)


def continuations(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    max_length: int,
    sampler_for: Callable[[list[int]], Any] | None = None,
) -> list[tuple[list[int], str]]:
    """``greedy_continuations``, or with ``sampler_for`` sampled ones: ``sampler_for(rows)`` gives the
    logits processor that draws each next token of the prompts ``rows`` (they are the batch, in
    order), leaving only the drawn token's score finite (capture/sampling.py ``SeededSampler``)."""
    budgets = [min(max_new_tokens, max_length - len(p)) for p in prompts]
    results: list[tuple[list[int], str] | None] = [None] * len(prompts)
    todo = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if max_new_tokens <= 0:
            results[i] = (list(prompt), "none")
        elif budget <= 0:
            results[i] = (list(prompt), "max_length")
        else:
            todo.append(i)
    if todo:
        eos, eos_set = _eos_ids(target)
        processor = sampler_for(todo) if sampler_for is not None else None
        new = _generate(target, [prompts[i] for i in todo], max(budgets[i] for i in todo), eos, processor)
        for i, tokens in zip(todo, new):
            tokens = tokens[: budgets[i]]
            stop = next((k for k, t in enumerate(tokens) if t in eos_set), None)
            if stop is not None:
                results[i] = (list(prompts[i]) + tokens[: stop + 1], "eos")
            else:
                reason = "max_length" if budgets[i] < max_new_tokens else "max_new_tokens"
                results[i] = (list(prompts[i]) + tokens, reason)
    return [r for r in results if r is not None]


def _generate(
    target: Target, prompts: Sequence[Sequence[int]], budget: int, eos: Any, processor: Any = None
) -> list[list[int]]:
    """New tokens per prompt (finished rows padded past their EOS by ``generate``); ``processor``: a
    logits processor that picks each token (sampling), else the plain argmax."""
    model, tokenizer = target.model, target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(_eos_ids(target)[1]))
    config = GenerationConfig(
        max_new_tokens=budget, do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad
    )
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token is aligned
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    # generate() fills every unset field from model.generation_config, so a target shipping e.g.
    # repetition_penalty=1.05 would bend "greedy" text off the argmax path that replay assumes.
    # A neutral model-level config for the call keeps the continuation the plain argmax chain.
    saved = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                **({"logits_processor": LogitsProcessorList([processor])} if processor is not None else {}),
            )
    finally:
        model.generation_config = saved
    return [row[width:].tolist() for row in out.cpu()]


@contextlib.contextmanager
def _hooked(layers: torch.nn.ModuleList, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def next_token_stats(
    lm_head: torch.nn.Module,
    final_hidden: torch.Tensor,
    top_k: int,
    keep_logits: bool,
    rows_per_step: int = 2048,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """argmax / top-k / logsumexp of ``lm_head(final_hidden)`` for ``[T, H]`` rows, in row blocks.

    The argmax is taken on the logits in the model's dtype (what greedy decoding does);
    top-k values and the log-sum-exp in float32 (bf16 logits are exact in float32). Only
    ``rows_per_step`` rows of logits exist at once (see ``head_rows``); each row's numbers do not
    depend on the blocking (tested), and ``keep_logits`` is the one opt-in ``[T, V]`` result.
    ``on_logits(first_row, logits32)``: called with each chunk's new rows (sampled caches).
    """
    argmax, values, ids, lse, full = [], [], [], [], []
    for lo, hi, new in row_chunks(final_hidden.shape[0], rows_per_step):
        logits = lm_head(final_hidden[lo:hi])[new - lo :]
        argmax.append(logits.argmax(dim=-1))
        logits32 = logits.float()
        top = torch.topk(logits32, k=min(top_k, logits32.shape[-1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices)
        lse.append(torch.logsumexp(logits32, dim=-1))
        if keep_logits:
            full.append(logits32)
        if on_logits is not None:
            on_logits(new, logits32)
    cat = torch.cat
    return cat(argmax), cat(values), cat(ids), cat(lse), (cat(full) if keep_logits else None)


def _base_model(target: Target) -> torch.nn.Module:
    # CausalLM: .model is the text model; ConditionalGeneration: .model wraps language_model
    # and runs it alone on text input. Calling the base model skips the [T, V] logits the
    # full forward would materialise for every position at once.
    return target.model.model


def capture_batch(
    target: Target,
    sequences: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    top_k: int,
    full_logits: bool,
    memory_gb: float = DEFAULT_MEMORY_GB,
    on_logits: Sequence[Callable[[int, torch.Tensor], None] | None] | None = None,
    extra_bytes_per_logit: int = 0,
) -> list[CapturedSequence]:
    """One teacher-forced forward over ``sequences`` (right-padded when more than one).

    Padding never reaches the result: every output is sliced to the sequence's own length,
    and causal attention keeps real positions from seeing the pads that follow them. The
    vocabulary projection runs in row chunks sized by ``memory_gb`` (never ``[T, V]`` at once).
    ``on_logits[i]``: sequence i's ``next_token_stats`` observer, whose own ``[rows, V]`` temporaries
    take ``extra_bytes_per_logit`` more of the budget (sampled caches).
    """
    device = next(target.model.parameters()).device
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    pad = target.tokenizer.pad_token_id or 0
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    input_ids = input_ids.to(device)
    # A single sequence runs without a mask: exactly the forward a user would write.
    attention_mask = None
    if len(sequences) > 1:
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
    lm_head = target.model.get_output_embeddings()
    rows_per_step = head_rows(lm_head.weight.shape[0], memory_gb, BYTES_PER_LOGIT + extra_bytes_per_logit)
    with torch.no_grad(), _hooked(target.layers, layer_ids) as captured:
        final = _base_model(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        final_hidden = final.last_hidden_state
        out = []
        for row, length in enumerate(lengths):
            hidden = torch.stack([captured[i][row, :length] for i in layer_ids], dim=1)
            observer = on_logits[row] if on_logits is not None else None
            argmax, values, ids, lse, logits = next_token_stats(
                lm_head, final_hidden[row, :length], top_k, full_logits, rows_per_step, observer
            )
            out.append(CapturedSequence(input_ids[row, :length], hidden, argmax, values, ids, lse, logits))
    return out


def to_host_async(captured: list[CapturedSequence]) -> tuple[list[CapturedSequence], Any]:
    """Queue device-to-host copies into pinned memory; return the host tensors and a CUDA event.

    The copies run on the current stream ahead of the next forward; whoever reads the host
    tensors must ``event.synchronize()`` first. CPU tensors are returned as they are, event None.
    """
    if not captured or not captured[0].hidden_states.is_cuda:
        return captured, None

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks
        host.copy_(t, non_blocking=True)
        return host

    host = [CapturedSequence(*(pinned(getattr(c, f.name)) for f in fields(c))) for c in captured]
    event = torch.cuda.Event()
    event.record()
    return host, event
