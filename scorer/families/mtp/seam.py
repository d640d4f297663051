"""The target's own MTP head as a drafter family: ``target:mtp`` scores the head stored in the
cache's ``target/mtp.safetensors`` (hscache/capture/mtp.py) as vLLM serves it.

model.py is the head (vLLM ``qwen3_5_mtp.py``), draft.py the proposer loop (vLLM's method
"mtp"), this module the functions of the family's row (scorer/families/mtp/__init__.py binds them
lazily): config from the cache's target config, weight names checked, drafts for every anchor
handed to the shared replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch

from hscache.capture.final_norm import KINDS, apply_final_norm, final_norm_module
from hscache.capture.logit_rows import head_rows
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.errors import CheckpointError, IncompatibleCacheError
from scorer.families.base import (
    TARGET_PREFIX,
    CheckpointProbe,
    DraftDraw,
    Loaded,
    OnlineOptions,
    Proposer,
    attention_flops,
    check_scored_sizes,
    linear_params,
    longest_sequence,
    target_head_name,
)
from scorer.families.mtp.draft import TreeSteps, chain_outputs, draft_anchors, mtp_context
from scorer.families.mtp.model import MtpConfig, MtpHead
from scorer.families.mtp.proposal import mtp_log_q
from scorer.formats.checkpoint_io import LoadReport, state_dict_sha256
from scorer.metrics import acceptance_counts, train_accept_len
from scorer.offline.replay import round_loop
from scorer.offline.sequences import (
    CachedSequence,
    SequenceResult,
    chain_parts,
    result_from_parts,
    score_rows_with,
)

__all__ = [
    "HEADS",
    "claims",
    "cost",
    "effective_config",
    "load_mtp",
    "mtp_config",
    "mtp_hidden",
    "online",
    "online_proposer",
    "proposals",
    "ready_head",
    "score_rows",
    "score_sequence_mtp",
    "time_round",
]

# CKPT names this family reads -> the target hidden state fed to the head.
HEADS = {
    "mtp": "post_norm",  # as vLLM serves it: the model's output after the final norm
    "mtp-prenorm": "pre_norm",  # as speculators trains MTP: the last layer before the final norm
}
_PREFIX = "mtp."
_VLLM_DEFAULT_K = "vLLM: num_speculative_tokens defaults to n_predict = mtp_num_hidden_layers"


def claims(probe: CheckpointProbe) -> bool:
    return target_head_name(probe.path) in HEADS


def mtp_config(
    target_config: dict[str, Any], vocab_size: int, weights: dict[str, torch.Tensor], **fields
) -> MtpConfig:
    """The head's config from the target's text config (target/config.json) and its weights.

    Raises:
        CheckpointError: a field the head needs is missing, or a setting it does not implement.
    """
    if target_config.get("hidden_act", "silu") != "silu":  # the head's MLP is SwiGLU (model.py)
        raise CheckpointError(
            f"target:mtp: the target's hidden_act {str(target_config.get('hidden_act'))[:40]!r} is not "
            "implemented for the MTP head (silu is)"
        )
    rope = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(
            f"target:mtp: the target's rope_type {rope_type!r} is not implemented for the MTP head "
            "(default and text-only M-RoPE are)"
        )
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
    if len(layers) != 1:
        raise CheckpointError(
            f"target:mtp: the head has {len(layers)} MTP layers ({layers}); only mtp_num_hidden_layers 1 "
            "(Qwen3.5 / Qwen3.6) is implemented"
        )
    need = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
    )
    missing = [k for k in need if target_config.get(k) is None]
    if missing:
        raise CheckpointError(f"target:mtp: the cache's target/config.json lacks {', '.join(missing)}")
    c = target_config
    try:
        return _mtp_config(c, rope, vocab_size, len(layers), fields)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"target:mtp: the cache's target/config.json: {exc}") from None


def _mtp_config(
    c: dict[str, Any], rope: dict[str, Any], vocab_size: int, num_layers: int, fields: dict[str, Any]
) -> MtpConfig:
    return MtpConfig(
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_attention_heads=int(c["num_attention_heads"]),
        num_key_value_heads=int(c["num_key_value_heads"]),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        vocab_size=int(vocab_size),
        num_target_layers=int(c["num_hidden_layers"]),
        num_mtp_layers=num_layers,
        **fields,
    )


def _check_keys(head: MtpHead, weights: dict[str, torch.Tensor]) -> None:
    want = head.state_dict()
    unknown = sorted(set(weights) - set(want))
    missing = sorted(set(want) - set(weights))
    if unknown or missing:
        parts = ([f"unknown key(s) {', '.join(_PREFIX + k for k in unknown[:5])}"] if unknown else []) + (
            [f"missing key(s) {', '.join(_PREFIX + k for k in missing[:5])}"] if missing else []
        )
        raise CheckpointError(
            f"target:mtp: the cache's MTP head is not a Qwen3.5-style mtp.* layout: {'; '.join(parts)}"
        )
    bad = [k for k, v in want.items() if tuple(weights[k].shape) != tuple(v.shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(
            f"target:mtp: {_PREFIX}{k} has shape {list(weights[k].shape)}, the target config implies "
            f"{list(want[k].shape)}"
        )


def load_mtp(checkpoint: str, cache: CacheView, config: Any) -> tuple[MtpHead, Loaded]:
    """Ready the cache's own MTP head (``checkpoint``: ``target:mtp`` or ``target:mtp-prenorm``).

    Raises:
        IncompatibleCacheError: the cache stores no MTP head, or lacks the layer / norm it reads.
        CheckpointError: the stored head's keys or shapes do not fit the target's config.
    """
    name = target_head_name(checkpoint) or ""
    where = str(getattr(cache, "url", cache.path))
    _refuse_block_flags(checkpoint, config.block_size, config.overrides)
    check_scored_sizes(longest_sequence(cache), where, num_speculative_tokens=config.num_speculative_tokens)
    stored = cache.target_mtp()
    if not stored:
        model = cache.settings.get("model", "MODEL")
        raise IncompatibleCacheError(
            f"{where} stores no MTP head (target/mtp.safetensors): its target has no mtp.* weights, or the "
            f"cache was made with --no-mtp or by an hscache before MTP heads were stored; re-extract with "
            f"`hscache extract --model {model} --out NEW_CACHE` (a Qwen3.5/3.6 checkpoint that ships mtp.*)"
        )
    last = int(cache.target_config.get("num_hidden_layers", 0)) - 1
    if last not in cache.layer_ids:
        raise IncompatibleCacheError(
            f"{where} lacks layer {last}, the target's last layer that the MTP head reads (it has "
            f"{cache.layer_ids}); re-extract with --layers {','.join(map(str, [*cache.layer_ids, last]))}"
        )
    target_head = cache.target_head()
    if HEADS[name] == "post_norm" and "final_norm.weight" not in target_head:
        raise IncompatibleCacheError(
            f"{where} has no final norm saved, and the MTP head reads the last layer after it; re-extract "
            "it with this hscache"
        )
    dtype = DTYPES[config.dtype]
    embed = target_head["embed_tokens"].to(config.device, dtype)
    lm_head = (
        embed
        if target_head["lm_head"] is target_head["embed_tokens"]
        else target_head["lm_head"].to(config.device, dtype)
    )
    head, k_source = ready_head(
        stored, cache.target_config, cache.vocab_size, name, config.num_speculative_tokens, embed, lm_head
    )
    head.family = "mtp"
    head.backend_used = "sdpa"
    head.final_norm = (  # the last layer as the target's model returns it (features.py's rule)
        partial(
            apply_final_norm,
            KINDS[int(target_head["final_norm.kind"][0])],
            target_head["final_norm.weight"],
            float(target_head["final_norm.eps"][0]),
        )
        if HEADS[name] == "post_norm"
        else None
    )
    # what shared code (scorer compare's timing) applies to the features, as features.py's rule
    head.context_norm = None if head.final_norm is None else (0, head.final_norm)
    recorded = cache.manifest.get("checksums", {}).get("target/mtp.safetensors", {}).get("sha256", "")
    report = _report(str(checkpoint), stored, head.config, k_source, recorded)
    return head, Loaded(head.config, report)


def ready_head(
    stored: dict[str, torch.Tensor],
    target_config: dict[str, Any],
    vocab_size: int,
    name: str,
    num_speculative_tokens: int | None,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> tuple[MtpHead, str]:
    """The head built from the target's ``mtp.*`` tensors, on embed's device and dtype, with the
    target's embedding and head attached; and where its K came from ("override" / "default")."""
    weights = {k[len(_PREFIX) :]: v for k, v in stored.items() if k.startswith(_PREFIX)}
    unknown = sorted(k for k in stored if not k.startswith(_PREFIX))
    if unknown:
        raise CheckpointError(f"target:mtp: unknown key(s) {', '.join(unknown[:5])} (expected mtp.*)")
    head_config = mtp_config(target_config, vocab_size, weights, hidden_source=HEADS[name])
    # vLLM: num_speculative_tokens defaults to n_predict, the number of MTP layers
    K = num_speculative_tokens if num_speculative_tokens is not None else head_config.num_mtp_layers
    if K < 1:
        raise CheckpointError(f"--num-speculative-tokens {K}: give a chain of at least 1 token")
    head = MtpHead(replace(head_config, num_speculative_tokens=int(K)))
    _check_keys(head, weights)
    head.load_state_dict(weights)
    head = head.to(device=embed.device, dtype=embed.dtype).eval()
    head.attach_target(embed, lm_head)
    head.family = "mtp"
    head.backend_used = "sdpa"
    head.final_norm = None
    head.context_norm = None
    return head, "override" if num_speculative_tokens is not None else "default"


def _report(
    path: str, stored: dict[str, torch.Tensor], c: MtpConfig, k_source: str, sha256: str
) -> LoadReport:
    K = c.num_speculative_tokens
    return LoadReport(
        path=path,
        format="target_head",
        file_sha256={"target/mtp.safetensors": sha256} if sha256 else {},
        sha256=sha256 or state_dict_sha256(stored),
        weights_sha256=state_dict_sha256(stored),
        field_sources={
            "num_speculative_tokens": k_source,
            "hidden_size": "cache",
            "num_attention_heads": "cache",
            "rope_theta": "cache",
            "partial_rotary_factor": "cache",
        },
        stripped_prefixes=(_PREFIX,),
        dropped_keys=(),
        notes=(
            f"num_speculative_tokens {K} ({_VLLM_DEFAULT_K})"
            if k_source == "default"
            else f"num_speculative_tokens {K}",
            "MTP reads the target's last layer after the final norm (as vLLM serves it)"
            if c.hidden_source == "post_norm"
            else "MTP reads the target's last layer BEFORE the final norm (as speculators trains it; "
            "vLLM serves it after: compare with target:mtp)",
        ),
        layout="target",
    )


def online_proposer(
    target: Any, checkpoint: str, num_speculative_tokens: int | None, overrides: dict[str, Any] | None = None
) -> tuple[list[int], Callable[..., list[int]], LoadReport]:
    """The live target's own MTP head for ``scorer online``: (layers it reads, propose, report).

    ``propose(ids, states, draw=None, tree=None)`` drafts K tokens after ``ids`` (tokens 0..p verified)
    from the target's pre-norm last layer ``states`` [p, 1, H], through the same `mtp_context` /
    `draft_anchors` as the offline replay (``draw``: see scorer.families.base.DraftDraw); with
    ``tree`` (steps, topk, tokens) SGLang's EAGLE tree there instead (an ``EagleTree``).

    Raises:
        CheckpointError: an unknown head name, or a target without an MTP head.
    """
    from hscache.capture.mtp import target_mtp_weights

    name = target_head_name(checkpoint) or ""
    _refuse_block_flags(checkpoint, None, overrides)
    if name not in HEADS:
        raise CheckpointError(
            f"{checkpoint}: unknown target head; choose {', '.join(TARGET_PREFIX + h for h in HEADS)}"
        )
    stored = target_mtp_weights(target.name, target.model, target.text_config)
    if not stored:
        raise CheckpointError(
            f"--model {target.name} has no MTP head (no mtp.* weights in its checkpoint); "
            "target:mtp needs a Qwen3.5/3.6/Qwen3-Next checkpoint that ships one"
        )
    embed = target.model.get_input_embeddings().weight.detach()
    lm_head = target.model.get_output_embeddings().weight.detach()
    head, k_source = ready_head(
        stored, target.text_config.to_dict(), target.vocab_size, name, num_speculative_tokens, embed, lm_head
    )
    final_norm = final_norm_module(target.model) if head.config.hidden_source == "post_norm" else None
    K = head.config.num_speculative_tokens

    def propose(
        ids: list[int],
        states: torch.Tensor,
        draw: DraftDraw | None = None,
        tree: tuple[int, int, int] | None = None,
    ) -> Any:
        with torch.no_grad():
            hidden = states[:, 0] if final_norm is None else final_norm(states[:, 0])
            if tree is not None:  # SGLang's EAGLE tree over the head, the offline replay's construction
                from scorer.families.autoregressive import eagle_tree

                return eagle_tree(TreeSteps(head), hidden, torch.tensor(ids), len(ids) - 1, tree)
            context = mtp_context(head, hidden, torch.tensor(ids, device=hidden.device))
            return draft_anchors(head, context, np.asarray([len(ids) - 1]), K, draw=draw)[0].tolist()

    return [target.num_layers - 1], propose, _report(checkpoint, stored, head.config, k_source, "")


def _refuse_block_flags(checkpoint: str, block_size: int | None, overrides: dict[str, Any] | None) -> None:
    """Flags of block drafters mean nothing to the MTP head: refused, never silently ignored."""
    given = (["--block-size"] if block_size is not None else []) + [
        "--" + k.replace("_", "-") for k in (overrides or {}) if k != "block_size"
    ]
    if given or (overrides or {}).get("block_size") is not None:
        given = given or ["--block-size"]
        raise CheckpointError(
            f"{checkpoint}: {', '.join(given)} do(es) not apply to the target's MTP head (its config is the "
            "target's); set its chain length with --num-speculative-tokens"
        )


def effective_config(config: Any) -> Any:
    # Every anchor is drafted in one batched pass, so "chain" anchors would only drop metrics;
    # DDTree budgets are a block-family mode; --tree as SGLang takes it.
    from scorer.families.autoregressive import check_tree

    return replace(config, ddtree=(), anchors="all", tree=check_tree(config.tree))


def mtp_hidden(
    head: MtpHead, cached: torch.Tensor, layer_ids: list[int], dtype: torch.dtype, device: str
) -> torch.Tensor:
    """``[T, K, H]`` cached states -> ``[T, H]`` what MTP reads: the last layer, through the final
    norm in the cache's dtype (as the target applied it) unless the head reads it pre-norm."""
    last = cached[:, layer_ids.index(head.config.num_target_layers - 1)]
    if head.final_norm is not None:
        last = head.final_norm(last)
    return last.to(device=device, dtype=dtype)


def score_sequence_mtp(
    head: MtpHead,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    prompt_len: int,
    memory_gb: float,
    tree: tuple[int, int, int] | None = None,
) -> tuple:
    """Served chain drafts at every anchor P..T-2 and the shared replay; beside them the
    teacher-forced counts (true tokens into steps > 0, as MTP trainers score) and, with ``tree``,
    SGLang's EAGLE tree over the same head. Returns (the 7 parts of a SequenceResult, extras)."""
    from scorer.families.autoregressive import tree_depths  # the shared SGLang tree replay

    K = head.config.num_speculative_tokens
    B = head.config.block_size
    x, a = token_ids.cpu().numpy(), target_argmax.cpu().numpy()
    anchors = np.arange(prompt_len, len(x) - 1)
    extras: dict[str, Any] = {}
    if len(anchors):
        with torch.no_grad():
            context = mtp_context(head, hidden, token_ids.to(hidden.device))
            draft = draft_anchors(head, context, anchors, K, memory_gb)
            forced = draft_anchors(head, context, anchors, K, memory_gb, token_ids=token_ids)
            if tree is not None:
                depths = tree_depths(
                    TreeSteps(head), hidden, token_ids, target_argmax, prompt_len, tree, memory_gb=memory_gb
                )
                loop = round_loop(x, a, prompt_len)
                while not loop.done:
                    loop.step(int(depths[loop.p - prompt_len]))
                extras["tree"] = loop.log()
    else:
        draft = forced = np.zeros((0, B - 1), dtype=np.int64)
    extras["teacher_forced_acceptance"] = acceptance_counts(forced, x, a, prompt_len)
    extras["teacher_forced_accept_len"] = train_accept_len(forced, x, a, prompt_len)
    return chain_parts(draft, x, a, prompt_len), extras


def _sequence_scorer(
    head: MtpHead, cache: CacheView, config: Any
) -> Callable[[CachedSequence], SequenceResult]:
    """Score the cache's sequences ``rows`` with the MTP head (the distributed unit of work)."""
    dtype = DTYPES[config.dtype]

    def score(seq: CachedSequence) -> SequenceResult:
        hidden = mtp_hidden(head, seq.hidden_states(), cache.layer_ids, dtype, config.device)
        parts, extras = score_sequence_mtp(
            head, hidden, seq.token_ids(), seq.target_argmax(), seq.prompt_len, config.memory_gb, config.tree
        )
        return result_from_parts(seq.row, seq.record_id, seq.category, parts, extras)

    return score


score_rows = score_rows_with(_sequence_scorer)


def online(checkpoint: str, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, LoadReport]:
    """``scorer online`` on the seam: the live target's own MTP head (see `online_proposer`)."""
    layer_ids, propose, report = online_proposer(
        target, str(checkpoint), options.num_speculative_tokens, options.overrides
    )

    def proposer(
        hidden: Any,
        ids: list[int],
        p: int,
        draw: DraftDraw | None = None,
        tree: tuple[int, int, int] | None = None,
    ) -> Any:
        return propose(ids[: p + 1], hidden, draw, tree)

    return layer_ids, proposer, report


def cost(head: MtpHead, tau: float, context: float) -> dict[str, Any]:
    """One chain round served (vLLM propose, method "mtp"): step 0 over the ~tau newly verified rows
    (fc and the layer; the head on the last row only), then K-1 one-row steps; K forwards in all."""
    c = head.config
    k = c.num_speculative_tokens
    rows = tau + k - 1
    flops = 2.0 * linear_params(head) * rows + 2.0 * head.lm_head.numel() * k
    flops += attention_flops(c, rows, context)
    return {"draft_forwards_per_round": k, "flops_per_round": flops}


def time_round(
    head: MtpHead, features: Any, token_ids: Any, anchor: int, tau: float
) -> tuple[float, list[int]]:
    """One served round's drafting at ``anchor``: the step-0 head projection and the K-1 later
    steps, the context (its keys/values and step-0 outputs) built untimed. The step-0 extend over
    the ~tau newly verified rows (fc and one layer on those rows) is NOT in the time."""
    import time

    device = head.fc.weight.device
    with torch.no_grad():
        context = mtp_context(head, features.to(device)[:anchor], token_ids.to(device)[: anchor + 1])
        rows = head_rows(head.config.vocab_size, 2.0)
        t0 = time.perf_counter()
        drafts, _ = chain_outputs(
            head, context, torch.tensor([anchor], device=device), head.config.num_speculative_tokens, rows
        )
        return time.perf_counter() - t0, drafts[0].tolist()


def proposals(
    head: MtpHead, cache: CacheView, row: int, config: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """``Family.proposals``: the head fed y along ``row`` (scorer/families/mtp/proposal.py)."""
    hidden = mtp_hidden(head, cache.hidden_states(row), cache.layer_ids, DTYPES[config.dtype], config.device)
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    return mtp_log_q(head, hidden, cache.token_ids(row), prompt_len, temperature, memory_gb=config.memory_gb)
