"""The standalone draft model as vLLM 0.32.0 serves it, replayed from one forward per cached sequence.

How vLLM drafts (``method: draft_model``, ``vllm/v1/spec_decode/draft_model.py`` ``DraftModelProposer``, a
``SpecDecodeBaseProposer`` with ``pass_hidden_states_to_model=False``, lines 26-31):

- first pass of a round (``llm_base_proposer.py`` ``set_inputs_first_pass``, lines 808-905, and the kernel
  ``utils.py`` ``copy_and_expand_eagle_inputs_kernel``, lines 466-560, with ``shift_input_ids`` False and one
  extra slot per request, lines 113-119): the draft LM is fed the tokens the target verified this step,
  UNSHIFTED at their own positions (the previous bonus token and the accepted drafts; rejected slots are
  padding that writes no KV), then the new bonus token at the next position. So after a round at anchor p
  (tokens 0..p verified, x_p the bonus) its KV holds exactly x_0..x_p, each written from the real token
  (a drafted token that was accepted is re-fed and overwritten). At prefill it is fed the whole prompt and
  the first sampled token, i.e. the first anchor is p = P.
- it samples the bonus slot (``token_indices_to_sample``): d_1 = argmax LM(x_0..x_p) (``_greedy_sample``,
  lines 470-478: ``compute_logits(h).argmax(-1)``), then K-1 single-token steps at positions p+1, p+2, ...
  (``propose``, lines 653-748: ``input_ids = draft_token_ids_list[-1]``, positions + 1 each step), each fed
  its own previous draft: d_j = argmax LM(x_0..x_p, d_1..d_{j-1}).
- the draft LM's own embedding and head (``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` are no-ops,
  draft_model.py:114-122); equal vocabulary sizes are required (``verify_equal_vocab_size_if_draft_model``,
  config/speculative.py:1870-1885).

The replay: a slot counts only while the earlier ones matched (scorer/rules/onehot_chain.py), and then
d_1..d_{j-1} ARE the cached tokens x_{p+1}..x_{p+j-1}; so d_j = argmax LM(x_0..x_{p+j-1}), the LM's
next-token argmax at position p+j-1 of the cached sequence. One causal forward over the sequence gives
every anchor's every slot (the head projected a chunk of rows at a time, never [T, V]). The same holds
along a sampled trajectory y (spec/sampling.md 4.3): q_{a,j} = softmax(logits at a+j-1 / T).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import head_rows, row_chunks
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.errors import CheckpointError
from scorer.families.base import (
    CheckpointProbe,
    DraftDraw,
    Loaded,
    OnlineOptions,
    Proposer,
    attention_flops,
    check_scored_sizes,
    longest_sequence,
)
from scorer.formats.checkpoint_io import LoadReport
from scorer.offline.sampled_view import head_log_q, proposal_arrays
from scorer.offline.sequences import (
    CachedSequence,
    SequenceResult,
    chain_parts,
    result_from_parts,
    score_rows_with,
)
from scorer.rules.expectation import slot_tokens

__all__ = [
    "PREFIX",
    "DraftModel",
    "claims",
    "cost",
    "draft_model_proposer",
    "draft_positions",
    "load",
    "next_token_argmax",
    "online",
    "proposals",
    "score_rows",
    "vllm_settings",
]

PREFIX = "draft:"  # a CKPT that says "this model, as a standalone draft model"
_BUILTIN = "builtin:"
# config.json keys that mark a drafter layout another family reads (an EAGLE-3, DFlash, P-EAGLE export is
# also a "*ForCausalLM" to transformers' eyes): such a directory is never claimed as a plain LM.
_DRAFTER_KEYS = (
    "speculators_model_type",
    "speculators_config",
    "dflash_config",
    "eagle_config",
    "draft_vocab_size",
    "eagle_aux_hidden_state_layer_ids",
    "target_layer_ids",
    "block_size",
)


def model_name(checkpoint: str) -> str:
    """The model a CKPT names: ``draft:X`` -> X, else the CKPT itself."""
    return checkpoint[len(PREFIX) :] if checkpoint.startswith(PREFIX) else checkpoint


def claims(probe: CheckpointProbe) -> bool:
    if probe.path.startswith((PREFIX, _BUILTIN)):
        return True
    config = probe.config or {}
    archs = config.get("architectures") or []
    return (
        bool(archs)
        and all(str(a).endswith("ForCausalLM") for a in archs)
        and not any(key in config for key in _DRAFTER_KEYS)
    )


@dataclass(frozen=True)
class DraftModelSettings:
    """What the shared code reads off a drafter's config (``DrafterSettings``)."""

    model: str  # the draft LM as named (builtin:<name> or a directory)
    num_speculative_tokens: int
    lm_config: dict[str, Any]

    @property
    def block_size(self) -> int:  # K drafted slots + the bonus token
        return self.num_speculative_tokens + 1

    @property
    def target_layer_ids(self) -> tuple[int, ...]:  # reads no target hidden state
        return ()

    def to_hf_config(self) -> dict[str, Any]:
        """The LM's architecture and sizes, with vLLM's method and K (the report's ``drafter``)."""
        return {
            **self.lm_config,
            "method": "draft_model",
            "model": self.model,
            "num_speculative_tokens": self.num_speculative_tokens,
        }


class DraftModel:
    """A loaded draft LM: the transformers model (eval, in the scoring dtype) and vLLM's K."""

    family = "draft_model"
    backend_used = "eager"

    def __init__(self, model: Any, settings: DraftModelSettings, weights_sha256: str = "") -> None:
        self.model, self.config, self.weights_sha256 = model, settings, weights_sha256

    def parameters(self) -> Iterator[Any]:
        return self.model.parameters()

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] the LM's last hidden states (after its final norm), one causal forward."""
        device = next(self.model.parameters()).device
        out = self.model.base_model(input_ids=token_ids.to(device)[None], use_cache=False)
        return out.last_hidden_state[0]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V] logits (the LM's own head, vLLM ``compute_logits``)."""
        return self.model.get_output_embeddings()(hidden)


def _refuse_flags(checkpoint: str, config: Any) -> None:
    refused = [
        flag
        for flag, given in (
            ("--block-size", config.block_size is not None),
            ("--tree", config.tree is not None),
            ("--config", config.config_path is not None),
            *((f"--{key.replace('_', '-')}", True) for key in config.overrides),
        )
        if given
    ]
    if refused:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(refused)} do not apply to a standalone draft model (vLLM draft_model: "
            "a chain of K tokens from a causal LM): pass --num-speculative-tokens K only"
        )


def check_tokenizer(checkpoint: str, draft_tokenizer: Any, target_tokenizer: Any, target_name: Any) -> None:
    """vLLM drafts in the target's token ids: the draft LM must read and write the same ones.

    Raises:
        CheckpointError: the vocabularies differ (sizes or any token's id), named with the fix.
    """
    mine, theirs = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:1]
        where = f"e.g. {differ[0][0]!r}" if differ else "their special tokens"
        raise CheckpointError(
            f"{checkpoint}: its tokenizer is not the target's ({len(mine)} vs {len(theirs)} tokens, {where} "
            f"differs); vLLM's draft_model drafts in the target's token ids: pass a draft LM trained with the "
            f"tokenizer of {target_name}"
        )


def load(checkpoint: str, cache: CacheView, config: Any) -> tuple[DraftModel, Loaded]:
    """The draft LM (hscache's loader: a built-in or an HF directory) in the scoring dtype, checked against
    the cache's tokenizer and vocabulary size.

    Raises:
        CheckpointError: no --num-speculative-tokens, a flag of another family, a model that does not load,
            or a tokenizer / vocabulary that is not the target's (one line each).
    """
    _refuse_flags(checkpoint, config)
    k = _required_k(checkpoint, config.num_speculative_tokens)
    check_scored_sizes(longest_sequence(cache), str(cache.path), num_speculative_tokens=k)
    target_vocab = (cache.target_config or {}).get("vocab_size")
    return _load_lm(
        checkpoint,
        k,
        config.dtype,
        config.device,
        cache.tokenizer(),
        target_vocab,
        cache.settings.get("model"),
    )


def online(checkpoint: str, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, LoadReport]:
    """``scorer online`` with a standalone draft model: the loader's checks against the live target (its
    tokenizer and vocabulary), the draft LM in the target's dtype, and `draft_model_proposer`.

    Raises:
        CheckpointError: as `load` (a flag of another family, no K, another tokenizer or vocabulary).
    """
    flags = [f"--{key.replace('_', '-')}" for key in options.overrides]
    flags += ["--config"] if options.config_path else []
    if flags:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(flags)} do not apply to a standalone draft model (vLLM draft_model: "
            "a chain of K tokens from a causal LM): pass --num-speculative-tokens K only"
        )
    k = _required_k(checkpoint, options.num_speculative_tokens)
    dtype = next(name for name, torch_type in DTYPES.items() if torch_type == target.model.dtype)
    vocab = target.model.get_input_embeddings().weight.shape[0]
    drafter, loaded = _load_lm(checkpoint, k, dtype, options.device, target.tokenizer, vocab, target.name)
    # The draft LM reads no target state: the capture is asked for the first layer, which it ignores.
    return [0], draft_model_proposer(drafter), loaded.report


def draft_model_proposer(drafter: DraftModel) -> Proposer:
    """One served round at anchor p, vLLM's loop literally (module docstring): d_1 from the LM over the
    verified tokens 0..p, then d_j from the LM over them and d_1..d_{j-1} (its own drafts, or with
    ``draw`` the drawn ones), each the argmax of (or ``draw`` over) the LM's next-token logits. The LM
    pieces are the replay's (``DraftModel.hidden`` / ``head``); each step re-runs the prefix (exact for a
    hybrid LM's recurrent layers too, whose state a KV cache would not hold)."""
    k = drafter.config.num_speculative_tokens

    @torch.no_grad()
    def propose(hidden: Any, ids: list[int], p: int, draw: DraftDraw | None = None) -> list[int]:
        del hidden  # the draft LM reads only tokens
        tokens = [int(t) for t in ids[: p + 1]]
        drafted: list[int] = []
        for _ in range(k):
            logits = drafter.head(drafter.hidden(torch.tensor(tokens + drafted))[-1:])[0].float()
            drafted.append(int(logits.argmax()) if draw is None else int(draw(logits)))
        return drafted

    return propose


def _required_k(checkpoint: str, k: int | None) -> int:
    if k is None:
        raise CheckpointError(
            f"{checkpoint}: pass --num-speculative-tokens K (vLLM's draft_model method has no default K)"
        )
    return int(k)


def _load_lm(
    checkpoint: str,
    k: int,
    dtype: str,
    device: str,
    target_tokenizer: Any,
    target_vocab: int | None,
    target_name: Any,
) -> tuple[DraftModel, Loaded]:
    """The draft LM named by ``checkpoint`` in ``dtype`` on ``device``, checked against the target's
    tokenizer and vocabulary size (vLLM requires them equal), with its load report.

    Raises:
        CheckpointError: a model that does not load, another tokenizer or vocabulary size (one line each).
    """
    from hscache.capture.target import load_target
    from hscache.errors import HscacheError

    name = model_name(checkpoint)
    try:
        lm = load_target(name, dtype=dtype, device=device)
    except HscacheError as exc:
        raise CheckpointError(f"{checkpoint}: {exc}") from exc
    check_tokenizer(checkpoint, lm.tokenizer, target_tokenizer, target_name)
    lm_config = lm.model.config.to_dict()
    draft_vocab = int(lm_config.get("vocab_size") or 0)
    target_vocab = int(target_vocab or draft_vocab)
    if draft_vocab != target_vocab:
        raise CheckpointError(
            f"{checkpoint}: vocab_size {draft_vocab} differs from the target's {target_vocab}; vLLM 0.32.0 "
            "refuses that for draft_model (config/speculative.py:1870-1885): pad the draft LM's embedding and "
            "head to the target's size"
        )
    settings = DraftModelSettings(name, k, _public(lm_config))
    described = json.dumps({"model": name, "num_speculative_tokens": k}, sort_keys=True).encode()
    report = LoadReport(
        path=name,
        format="module" if name.startswith(_BUILTIN) else "hf_dir",  # a built-in is built in memory
        file_sha256={},
        sha256=hashlib.sha256(described).hexdigest(),
        weights_sha256=lm.weights_sha256,
        field_sources={"num_speculative_tokens": "override", "model": "checkpoint"},
        stripped_prefixes=(),
        dropped_keys=(),
        notes=(
            "vLLM draft_model.py: the draft LM continues the verified tokens greedily, K tokens on its own KV cache",
        ),
        layout="vllm",
    )
    return DraftModel(lm.model.eval(), settings, lm.weights_sha256), Loaded(settings, report)


def _public(lm_config: dict[str, Any]) -> dict[str, Any]:
    """The LM's config as JSON (the report's ``drafter``): its architecture and sizes."""
    keep = (
        "architectures", "model_type", "num_hidden_layers", "hidden_size", "vocab_size", "head_dim",
        "num_attention_heads", "num_key_value_heads", "layer_types", "linear_key_head_dim",
        "linear_value_head_dim",
    )  # fmt: skip
    return {key: lm_config[key] for key in keep if key in lm_config}


def draft_positions(prompt_len: int, seq_len: int, k: int) -> np.ndarray:
    """[A, K] the cached position whose next-token argmax is slot j's draft at anchor p = P + r:
    p + j - 1 (1-based j), -1 where the slot predicts past the sequence's last token."""
    anchors = np.arange(prompt_len, seq_len - 1)
    pos = anchors[:, None] + np.arange(k)[None, :]
    return np.where(pos <= seq_len - 2, pos, -1)


@torch.no_grad()
def next_token_argmax(
    drafter: DraftModel, token_ids: torch.Tensor, start: int, memory_gb: float
) -> np.ndarray:
    """[T - start] the draft LM's next-token argmax at positions start..T-1 of the cached tokens, the head
    projected ``head_rows`` rows at a time (never [T, V])."""
    hidden = drafter.hidden(token_ids)[start:]
    vocab = int(drafter.config.lm_config.get("vocab_size") or hidden.shape[-1])
    out = np.zeros(hidden.shape[0], dtype=np.int64)
    for lo, hi, new in row_chunks(hidden.shape[0], max(1, head_rows(vocab, memory_gb))):
        out[new:hi] = drafter.head(hidden[lo:hi])[new - lo :].float().argmax(-1).cpu().numpy()
    return out


def sequence_drafts(
    drafter: DraftModel, token_ids: torch.Tensor, prompt_len: int, memory_gb: float
) -> np.ndarray:
    """[A, K] the served drafts at every anchor of one cached sequence (module docstring); -1 past its end."""
    k = drafter.config.num_speculative_tokens
    pos = draft_positions(prompt_len, len(token_ids), k)
    if not len(pos):
        return np.zeros((0, k), dtype=np.int64)
    argmax = next_token_argmax(drafter, token_ids, prompt_len, memory_gb)
    return np.where(pos >= 0, argmax[np.maximum(pos, prompt_len) - prompt_len], -1)


def _sequence_scorer(
    drafter: DraftModel, cache: CacheView, config: Any
) -> Callable[[CachedSequence], SequenceResult]:
    """Score the cache's sequences ``rows``: token ids only (the draft LM reads no target state)."""

    def score(seq: CachedSequence) -> SequenceResult:
        x, a = seq.token_ids(), seq.target_argmax()
        draft = sequence_drafts(drafter, x, seq.prompt_len, config.memory_gb)
        parts = chain_parts(draft, x.cpu().numpy(), a.cpu().numpy(), seq.prompt_len)
        return result_from_parts(seq.row, seq.record_id, seq.category, parts)

    return score


score_rows = score_rows_with(_sequence_scorer)


@torch.no_grad()
def proposals(
    drafter: DraftModel, cache: CacheView, row: int, config: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """``Family.proposals``: (drafts [A, K], log q [A, K]) along the cached sampled path y: slot j at anchor a
    is the LM at position a+j-1 of y (fed y's tokens, module docstring), q = softmax(logits / T) over the
    whole vocabulary (vLLM ``compute_probs_and_sample_next_token``: temperature only)."""
    token_ids = cache.token_ids(row)
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    k = drafter.config.num_speculative_tokens
    _, draft, log_q = proposal_arrays(prompt_len, len(token_ids), k)
    if not len(draft):
        return draft, log_q
    pos = draft_positions(prompt_len, len(token_ids), k)
    y = slot_tokens(token_ids, prompt_len, k)
    hidden = drafter.hidden(token_ids)
    vocab = int(drafter.config.lm_config.get("vocab_size") or hidden.shape[-1])
    for j in range(k):
        valid = pos[:, j] >= 0
        if not valid.any():
            continue
        rows = hidden[torch.as_tensor(pos[valid, j])]
        arg, lq = head_log_q(drafter.head, rows, y[valid, j], temperature, head_rows(vocab, config.memory_gb))
        draft[valid, j], log_q[valid, j] = arg, lq
        draft[~valid, j] = -1
    return draft, log_q


def cost(drafter: DraftModel, tau: float, context: float) -> dict[str, Any]:
    """One served round: the first pass over the ~tau newly verified tokens plus the bonus, then K-1
    one-token steps (K draft forwards), every token through every layer and the head on K rows."""
    k = drafter.config.num_speculative_tokens
    model = drafter.model
    head = model.get_output_embeddings().weight.numel()
    body = sum(
        p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name
    )
    rows = tau + k - 1
    flops = 2.0 * body * rows + 2.0 * head * k
    flops += attention_flops(model.config, rows, context)
    return {"draft_forwards_per_round": k, "flops_per_round": flops}


def vllm_settings(checkpoint: str, drafter: DraftModel) -> dict[str, Any]:
    """``VllmServing.settings``: the directory vLLM loads the draft LM from (a built-in written out once,
    as the judge writes a built-in target: hscache.engines.vllm.capture.model_directory)."""
    from hscache.engines.vllm.capture import model_directory

    name = drafter.config.model
    if name.startswith(_BUILTIN):
        return {"model": str(model_directory(name, drafter.weights_sha256))}
    return {"model": str(Path(name).resolve())}
