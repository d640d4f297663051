"""Run the target: greedy continuation, then one teacher-forced forward that captures
the requested layers and the target's next-token data. Tensors in, tensors out; no I/O.

Capture uses forward hooks on decoder layers, so "layer i" is the raw output of decoder
layer i (= transformers ``hidden_states[i + 1]`` for i < L - 1; for the last layer the hook
sees it BEFORE the final norm, unlike transformers' last entry). Spec section 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import GenerationConfig

from hscache.capture.target import Target

__all__ = ["CapturedSequence", "capture_batch", "greedy_continuation", "next_token_stats", "to_host_async"]

_LOGIT_ROWS_PER_STEP = 2048  # bounds the [rows, V] float32 logits held at once


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


def greedy_continuation(
    target: Target, prompt_ids: Sequence[int], max_new_tokens: int, max_length: int
) -> tuple[list[int], str]:
    """Prompt + the target's greedy continuation (transformers ``generate``, do_sample=False).

    Returns the full token list and why generation stopped: "eos", "max_new_tokens",
    "max_length", or "none" when no tokens were requested.
    """
    budget = min(max_new_tokens, max_length - len(prompt_ids))
    if max_new_tokens <= 0:
        return list(prompt_ids), "none"
    if budget <= 0:
        return list(prompt_ids), "max_length"
    model, tokenizer = target.model, target.tokenizer
    eos = model.generation_config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=budget,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    # generate() fills every unset field from model.generation_config, so a target shipping e.g.
    # repetition_penalty=1.05 would bend "greedy" text off the argmax path that replay assumes.
    # A neutral model-level config for the call keeps the continuation the plain argmax chain.
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
    finally:
        model.generation_config = saved
    ids = out[0].tolist()
    new = ids[len(prompt_ids) :]
    eos_set = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    if new and new[-1] in eos_set:
        return ids, "eos"
    return ids, ("max_length" if budget < max_new_tokens else "max_new_tokens")


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
    lm_head: torch.nn.Module, final_hidden: torch.Tensor, top_k: int, keep_logits: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """argmax / top-k / logsumexp of ``lm_head(final_hidden)`` for ``[T, H]`` rows, in row blocks.

    The argmax is taken on the logits in the model's dtype (what greedy decoding does);
    top-k values and the log-sum-exp in float32 (bf16 logits are exact in float32).
    """
    argmax, values, ids, lse, full = [], [], [], [], []
    for start in range(0, final_hidden.shape[0], _LOGIT_ROWS_PER_STEP):
        logits = lm_head(final_hidden[start : start + _LOGIT_ROWS_PER_STEP])
        argmax.append(logits.argmax(dim=-1))
        logits32 = logits.float()
        top = torch.topk(logits32, k=min(top_k, logits32.shape[-1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices)
        lse.append(torch.logsumexp(logits32, dim=-1))
        if keep_logits:
            full.append(logits32)
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
) -> list[CapturedSequence]:
    """One teacher-forced forward over ``sequences`` (right-padded when more than one).

    Padding never reaches the result: every output is sliced to the sequence's own length,
    and causal attention keeps real positions from seeing the pads that follow them.
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
    with torch.no_grad(), _hooked(target.layers, layer_ids) as captured:
        final = _base_model(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        final_hidden = final.last_hidden_state
        out = []
        for row, length in enumerate(lengths):
            hidden = torch.stack([captured[i][row, :length] for i in layer_ids], dim=1)
            argmax, values, ids, lse, logits = next_token_stats(
                lm_head, final_hidden[row, :length], top_k, full_logits
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
