"""``scorer online``: real greedy speculative decoding, the target verifying every block.

This is the calibration slice: on the same prompts, the offline replay of ``scorer eval``
must give the same tau (spec section 3), which is what makes the offline number the serving
number. For hybrid targets whose recurrent state cannot be cropped after a rejection, each
round re-runs the target over the committed prefix plus the drafted block: slow, exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import schemas
from hscache.capture.backend import resolve_backend, use_backend
from hscache.capture.final_norm import final_norm_module
from hscache.capture.forward import capture_batch
from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
from hscache.capture.provenance import git_commit, package_versions, utc_now
from hscache.capture.target import Target, load_target
from hscache.store.fsio import file_sha256
from scorer.checkpoint import load_checkpoint
from scorer.families.base import TARGET_PREFIX
from scorer.metrics import tau_per_request, tau_pooled
from scorer.model import DFlashDrafter

__all__ = [
    "ONLINE_SCHEMA_VERSION",
    "OnlineRequest",
    "online_decode",
    "run_online",
    "speculative_rounds",
]

# Version of the result document (schemas/online_report.schema.json); bump on a breaking change.
ONLINE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class OnlineRequest:
    record_id: str
    prompt_len: int
    token_ids: tuple[int, ...]
    tokens_per_round: tuple[int, ...]

    @property
    def tau(self) -> float | None:
        return sum(self.tokens_per_round) / len(self.tokens_per_round) if self.tokens_per_round else None


def _target_fallbacks(target: Target) -> dict[str, Any]:
    config = target.text_config
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "mask_token_id": target.mask_token_id,
        "vocab_size": int(config.vocab_size),
        "rope_theta": getattr(config, "rope_theta", None) or rope.get("rope_theta"),
        "num_target_layers": target.num_layers,
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
    }


def _eos_ids(target: Target) -> set[int]:
    eos = target.model.generation_config.eos_token_id
    eos = target.tokenizer.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def speculative_rounds(
    target: Target,
    prompt: list[int],
    layer_ids: list[int],
    max_new_tokens: int,
    max_length: int,
    propose: Callable[[list[int], torch.Tensor], list[int]],
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt with any drafter; returns (all token ids, tokens
    per round). ``propose(ids, states)`` drafts the continuation of ``ids`` (tokens 0..p verified)
    from ``states`` [p, K, H]: the target's pre-norm outputs of ``layer_ids`` at positions < p.

    Rounds follow spec section 3 exactly as the offline replay counts them: a round commits
    acc drafted tokens plus the target's bonus token, capped at the sequence end (EOS or the
    token budget), so ``sum(tokens) == generated - 1`` as in replay.
    """
    limit = min(len(prompt) + max_new_tokens, max_length)  # final length T
    eos = _eos_ids(target)
    prefill = capture_batch(target, [prompt], layer_ids, top_k=1, full_logits=False)[0]
    ids = list(prompt) + [int(prefill.argmax[-1])]  # x_P, the first bonus token
    rounds: list[int] = []
    while len(ids) < limit and ids[-1] not in eos:
        p = len(ids) - 1
        draft = propose(ids, prefill.hidden_states[:p])  # d_1..d_k
        verify = capture_batch(target, [ids + draft], layer_ids, top_k=1, full_logits=False)[0]
        greedy = verify.argmax[p:].tolist()  # greedy[j-1] = g_{p+j}
        acc = 0
        while acc < len(draft) and draft[acc] == greedy[acc]:
            acc += 1
        new = draft[:acc] + [greedy[acc]]  # acc drafted tokens + the bonus
        for n, token in enumerate(new):  # stop at EOS or the budget, like the cached sequence
            if len(ids) >= limit or (n and ids[-1] in eos):
                new = new[:n]
                break
            ids.append(token)
        # tokens this round as replay counts them: positions p+1..new end, capped at T-1
        rounds.append(len(ids) - 1 - p if (len(ids) >= limit or ids[-1] in eos) else len(new))
        prefill = verify
    return ids, rounds


def online_decode(
    target: Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    max_new_tokens: int,
    max_length: int,
    layout: str = "zlab",
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt with a DFlash drafter (`speculative_rounds`)."""
    config = drafter.config
    layer_ids = list(config.target_layer_ids)
    last = target.num_layers - 1
    last_slot = layer_ids.index(last) if last in layer_ids and layout != "speculators" else None
    final_norm = final_norm_module(target.model)

    def propose(ids: list[int], states: torch.Tensor) -> list[int]:
        p = len(ids) - 1
        features = states  # [p, K, H] pre-norm layer outputs
        if last_slot is not None:  # z-lab reads the last layer as hidden_states[L]: after the final norm
            features = features.clone()
            with torch.no_grad():
                features[:, last_slot] = final_norm(features[:, last_slot])
        features = features.reshape(p, -1).to(drafter.fc.weight.dtype)
        block = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.long)
        block[0, 0] = ids[p]
        hidden = drafter.block_hidden(features, torch.tensor([p]), block, max_blocks_per_forward=1)
        return drafter.head(hidden[0]).float().argmax(-1).tolist()  # d_1..d_{B-1}

    return speculative_rounds(target, prompt, layer_ids, max_new_tokens, max_length, propose)


def run_online(
    checkpoint: str | Path,
    model: str,
    prompts: str,
    *,
    max_new_tokens: int = 64,
    max_length: int = 4096,
    dtype: str = "fp32",
    device: str = "cpu",
    backend: str = "auto",
    limit: int | None = None,
    overrides: dict[str, Any] | None = None,
    trust_checkpoint: bool = False,
    config_path: str | None = None,
    num_speculative_tokens: int | None = None,
) -> dict[str, Any]:
    """Speculative decoding of every prompt; per-request and pooled online tau.

    ``checkpoint`` ``target:mtp`` drafts with the target's own MTP head (a chain of
    ``num_speculative_tokens``), read from the target checkpoint itself.

    Returns the result document (schemas/online_report.schema.json): the numbers, the settings, and
    what identifies the run like an eval report does: checkpoint and target weight hashes, the
    prompts' hash, package versions and the git commit.
    """
    t0 = time.perf_counter()
    backend = resolve_backend(backend, device)
    target = load_target(model, dtype, device)
    if str(checkpoint).startswith(TARGET_PREFIX):
        from scorer.families.mtp import online_proposer

        layer_ids, propose, report = online_proposer(
            target, str(checkpoint), num_speculative_tokens, overrides
        )

        def decode(prompt: list[int]) -> tuple[list[int], list[int]]:
            return speculative_rounds(target, prompt, layer_ids, max_new_tokens, max_length, propose)
    else:
        decode, report = _dflash_decoder(
            checkpoint, target, max_new_tokens, max_length, overrides, trust_checkpoint, config_path
        )
    requests = []
    with use_backend(target.model, backend):
        for n, record in enumerate(iter_records(resolve_prompts(prompts))):
            if limit is not None and n >= limit:
                break
            prompt = prompt_token_ids(record, target.tokenizer)
            ids, rounds = decode(prompt)
            requests.append(OnlineRequest(record.record_id, len(prompt), tuple(ids), tuple(rounds)))
    with_rounds = [list(r.tokens_per_round) for r in requests if r.tokens_per_round]
    result = {
        "schema_version": ONLINE_SCHEMA_VERSION,
        "tau": {
            "per_request": tau_per_request(with_rounds) if with_rounds else None,
            "pooled": tau_pooled(with_rounds) if with_rounds else None,
        },
        "rounds": sum(len(r) for r in with_rounds),
        "per_request": [
            {
                "record_id": r.record_id,
                "prompt_len": r.prompt_len,
                "tau": r.tau,
                "tokens_per_round": list(r.tokens_per_round),
                "generated": len(r.token_ids) - r.prompt_len,
            }
            for r in requests
        ],
        "checkpoint": report.to_dict(),
        "model": model,
        "model_weights_sha256": target.weights_sha256,
        "prompts": prompts,
        "prompts_sha256": file_sha256(resolve_prompts(prompts)),
        "dtype": dtype,
        "device": device,
        "backend": backend,
        "max_new_tokens": max_new_tokens,
        "max_length": max_length,
        "limit": limit,
        "versions": package_versions(),
        "hscache_git_commit": git_commit(),
        "seconds": time.perf_counter() - t0,
        "created_at": utc_now(),
    }
    schemas.validate(result, "online_report")
    return result


def _dflash_decoder(
    checkpoint: str | Path,
    target: Target,
    max_new_tokens: int,
    max_length: int,
    overrides: dict[str, Any] | None,
    trust_checkpoint: bool,
    config_path: str | None,
) -> tuple[Callable[[list[int]], tuple[list[int], list[int]]], Any]:
    """A DFlash checkpoint readied on the live target: (decode one prompt, its load report)."""
    device = str(target.model.device)
    loaded = load_checkpoint(
        checkpoint,
        overrides=overrides,
        fallbacks=_target_fallbacks(target),
        trust_checkpoint=trust_checkpoint,
        config_path=config_path,
    )
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    drafter = drafter.to(device=device, dtype=target.model.dtype).eval()
    own = loaded.head  # a speculators drafter's own embed_tokens / lm_head / d2t
    model_dtype = target.model.dtype
    drafter.attach_target(
        own["embed_tokens"].to(device, model_dtype)
        if "embed_tokens" in own
        else target.model.get_input_embeddings().weight.detach(),
        own["lm_head"].to(device, model_dtype)
        if "lm_head" in own
        else target.model.get_output_embeddings().weight.detach(),
        own["d2t"].to(device) if "d2t" in own else None,
    )

    def decode(prompt: list[int]) -> tuple[list[int], list[int]]:
        return online_decode(target, drafter, prompt, max_new_tokens, max_length, loaded.report.layout)

    return decode, loaded.report
