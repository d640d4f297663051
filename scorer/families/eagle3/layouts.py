"""Reading EAGLE-3 checkpoints of every layout into an `Eagle3Drafter` checked against a cache.

Layouts and their key names:
- speculators ``Eagle3Speculator`` directory: config.json (``speculators_model_type: eagle3``) +
  model.safetensors with ``fc``, ``layers.N.*`` (``layers.0.hidden_norm``), ``norm``, ``lm_head``,
  ``embed_tokens``, ``d2t``/``t2d``, optionally ``input_norm`` / ``fc_norm.N``.
- SpecForge ``LlamaForCausalLMEagle3`` export (config.json + model.safetensors) and its training
  checkpoints (``epoch_E_step_S/`` HF directories; ``{run}-stepN/training_state.pt`` with
  ``draft_state_dict`` and the draft config passed by ``--config``): ``midlayer.*`` for layer 0.
- the original EAGLE-3 release (``yuhuili/EAGLE3-*``): config.json + pytorch_model.bin, ``midlayer.*``.
vLLM renames ``midlayer.`` to ``layers.0.`` (llama_eagle3.py ``load_weights``); so does this reader.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.errors import CheckpointError
from scorer.families.base import Loaded, check_scored_sizes, longest_sequence
from scorer.families.eagle3.config import (
    ENGINE_DEFAULT_K,
    ENGINE_DEFAULT_K_SOURCE,
    Eagle3Config,
    from_hf_eagle3,
    from_speculators,
    vllm_aux_ids,
)
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.formats.checkpoint_io import (
    LoadReport,
    check_state_dict,
)
from scorer.formats.files import FORMAT_PICKLE, read_json, read_weights, resolve_files
from scorer.offline.sequences import check_fits, fit_problems, layer_fit_problem

__all__ = ["EAGLE3", "Eagle3Variant", "check_eagle3_compatible", "load_eagle3", "read_eagle3"]

_PREFIXES = ("module.", "_orig_mod.", "draft_model.", "model.")
_OWN_HEAD = ("embed_tokens.weight", "d2t", "t2d")
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators training-only


@dataclasses.dataclass(frozen=True)
class Eagle3Variant:
    """A family built on EAGLE-3's loaders (offline `load_eagle3`, online ``online.load_online``).

    ``speculators_type``: the ``speculators_model_type`` read as a speculators config.
    ``drafter_class``: the module (an `Eagle3Drafter` subclass) whose state dict the weights must fit.
    ``own_embedding_unless_identical``: keep a shipped ``embed_tokens`` of the target's shape unless it
    equals the target's (vLLM 0.32.0 ``llm_base_proposer.py`` ``_maybe_share_embeddings``, lines
    1435-1460: the target's is shared only when the drafter ships none or an identical one); without it,
    the target's whenever the shapes match.
    """

    speculators_type: str = "eagle3"
    drafter_class: type[Eagle3Drafter] = Eagle3Drafter
    own_embedding_unless_identical: bool = False


EAGLE3 = Eagle3Variant()  # EAGLE-3 itself


def _normalize(
    raw: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """(drafter weights, own head tensors, what was renamed/stripped/dropped)."""
    weights, head, changes = {}, {}, set()
    for original, tensor in raw.items():
        key = original
        while prefix := next((p for p in _PREFIXES if key.startswith(p)), None):
            key = key[len(prefix) :]
            changes.add(f"stripped {prefix}")
        key = key.replace("_orig_mod.", "")
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
            changes.add("midlayer. -> layers.0.")
        if key in _OWN_HEAD:
            head[key] = tensor
        elif key in _IGNORED or key.endswith("rotary_emb.inv_freq"):
            changes.add(f"dropped {key}")
        else:
            weights[key] = tensor
    return weights, head, sorted(changes)


def _validate(
    sd: dict[str, torch.Tensor], config: Eagle3Config, root: Path, drafter_class: type[Eagle3Drafter]
) -> None:
    check_state_dict(sd, lambda: drafter_class(config), f"{root} is not an EAGLE-3 checkpoint")


def _d2t(head: dict[str, torch.Tensor], config: Eagle3Config, root: Path) -> torch.Tensor | None:
    d2t, t2d = head.get("d2t"), head.get("t2d")
    if config.draft_vocab_size == config.vocab_size:
        if d2t is not None and bool(d2t.any()):
            raise CheckpointError(
                f"{root}: d2t is not all zero but the draft vocabulary is the full vocabulary"
            )
        return None
    if d2t is None:
        raise CheckpointError(
            f"{root}: draft_vocab_size {config.draft_vocab_size} < vocab_size {config.vocab_size} but the "
            "checkpoint has no d2t (draft id -> target id offsets); the draft tokens cannot be mapped"
        )
    ids = torch.arange(len(d2t)) + d2t.long()
    if len(d2t) != config.draft_vocab_size or int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise CheckpointError(
            f"{root}: d2t has {len(d2t)} entries mapping to target ids {int(ids.min())}..{int(ids.max())}; "
            f"expected {config.draft_vocab_size} entries inside 0..{config.vocab_size - 1}"
        )
    if t2d is not None and t2d.dtype == torch.bool and not torch.equal(t2d.nonzero().flatten(), ids):
        raise CheckpointError(f"{root}: t2d and d2t disagree on which target ids are in the draft vocabulary")
    return d2t.long()


def read_eagle3(
    path: str | os.PathLike,
    *,
    num_target_layers: int | None,
    num_speculative_tokens: int | None = None,
    trust_checkpoint: bool = False,
    config_path: str | None = None,
    variant: Eagle3Variant = EAGLE3,
) -> tuple[Eagle3Config, dict[str, torch.Tensor], dict[str, torch.Tensor], LoadReport]:
    """Read an EAGLE-3 checkpoint: (config, drafter weights, own head tensors, load report).

    A family built on EAGLE-3 reads its own speculators layout through this (``variant``: its
    ``speculators_model_type`` and the module whose state dict the weights must fit).

    Raises:
        CheckpointError: unreadable files, no config, an unsupported option or key (named).
    """
    root = Path(path)
    fmt, files, config = resolve_files(root)
    if config_path:
        config = read_json(Path(config_path))
        files = [*files, Path(config_path)]
    raw, pickled_config, _ = read_weights(fmt, files, root, trust_checkpoint)
    config = config or pickled_config
    if not config:
        raise CheckpointError(
            f"{root}: an EAGLE-3 checkpoint without a config (heads, rope, vocabulary cannot be read "
            "from the weights); pass --config DRAFT_CONFIG.json (SpecForge: the run's draft model config)"
        )
    try:
        if config.get("speculators_model_type") == variant.speculators_type:
            fields, sources, notes = from_speculators(config, num_target_layers)
        else:
            layout = "eagle_release" if fmt == FORMAT_PICKLE and root.is_dir() else "specforge"
            fields, sources, notes = from_hf_eagle3(config, num_target_layers, layout)
    except (ValueError, KeyError, TypeError) as e:
        what = f"missing config key {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{root}: {what}") from e
    if "target_layer_ids" not in fields:
        raise CheckpointError(
            f"{root}: the config names no target layers and the target's layer count is unknown; "
            "score it on a cache whose target config records num_hidden_layers"
        )
    if num_speculative_tokens is not None:
        fields["num_speculative_tokens"] = num_speculative_tokens
        sources["num_speculative_tokens"] = "override (--num-speculative-tokens)"
    elif "num_speculative_tokens" not in fields:
        fields["num_speculative_tokens"] = ENGINE_DEFAULT_K
        sources["num_speculative_tokens"] = ENGINE_DEFAULT_K_SOURCE
    try:
        eagle = Eagle3Config(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{root}: invalid EAGLE-3 config: {e}") from e
    weights, head, changes = _normalize(raw)
    _validate(weights, eagle, root, variant.drafter_class)
    report = LoadReport.of_files(
        root,
        fmt,
        files,
        weights,
        field_sources=_source_kinds(sources),
        stripped_prefixes=tuple(c for c in changes if not c.startswith("dropped")),
        dropped_keys=tuple(c.removeprefix("dropped ") for c in changes if c.startswith("dropped")),
        notes=tuple(
            notes
            + [
                f"{name}: {sources[name]}"
                for name in ("target_layer_ids", "num_speculative_tokens")
                if name in sources
            ]
        ),
        layout=eagle.layout,
        warnings=tuple(
            ["norm_output: fed-back state is post-norm (speculators Eagle 3.1), not vLLM's hidden_prenorm"]
            if eagle.norm_output
            else []
        ),
    )
    return eagle, weights, {**head, "d2t": _d2t(head, eagle, root)}, report


def _source_kinds(sources: dict[str, str]) -> dict[str, str]:
    """The report's source vocabulary (config, override, default, derived); details go to notes."""
    kinds = {}
    for name, text in sorted(sources.items()):
        word = text.split(" ", 1)[0]
        kinds[name] = {"engine": "default", "vocab_size": "derived"}.get(word, word)
        if kinds[name] == "default" and "from the cache" in text:
            kinds[name] = "derived"
    return kinds


def check_eagle3_compatible(config: Eagle3Config, cache: CacheView, cache_name: str) -> None:
    """One IncompatibleCacheError naming every mismatch (layers, hidden size, vocabulary)."""
    field = "target_hidden_size" if config.target_hidden_size else "hidden_size"
    vocab, layers, size = config.vocab_size, config.target_layer_ids, config.feature_size
    problems = fit_problems(
        cache, cache_name, layer_ids=layers, feature_size=size, vocab_size=vocab, feature_field=field
    )
    served = config.vllm_layer_ids
    if served is not None and (problem := layer_fit_problem(served, cache, cache_name, "vLLM-served layers")):
        # The chain is replayed as vLLM serves it, on other layers than the drafter was trained on.
        problems.append(
            f'{problem}; or add a top-level "eagle_aux_hidden_state_layer_ids": '
            f"{vllm_aux_ids(layers)} to the drafter's config.json so that vLLM serves it on the "
            f"layers it was trained on ({list(layers)}), as SGLang does"
        )
    check_fits(problems)


def load_eagle3(
    checkpoint: str | Path,
    cache: CacheView,
    config: Any,
    *,
    variant: Eagle3Variant = EAGLE3,
) -> tuple[Eagle3Drafter, Any]:
    """The family's loader: read, check against ``cache``, build and ready the drafter (``variant``: a
    family built on this one, `Eagle3Variant`).

    Raises:
        CheckpointError: a DFlash-only flag was given (named), or the checkpoint is unreadable.
        IncompatibleCacheError: layers, hidden size or vocabulary do not fit the cache (all named).
    """
    refused = [
        flag
        for flag, given in (
            ("--block-size", config.block_size is not None),
            ("--target-layer-ids", "target_layer_ids" in config.overrides),
            ("--mask-token-id", "mask_token_id" in config.overrides),
            ("--rope-theta", "rope_theta" in config.overrides),
            ("--anchors chain", config.anchors == "chain"),
        )
        if given
    ]
    if refused:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(refused)} set DFlash settings; an EAGLE-3 drafter takes its layers and "
            "rope from its config and drafts every anchor in batched forwards (drafting: "
            "--num-speculative-tokens K, --tree STEPS,TOPK,TOKENS)"
        )
    eagle, weights, head, report = read_eagle3(
        checkpoint,
        num_target_layers=cache.target_config.get("num_hidden_layers"),
        num_speculative_tokens=config.num_speculative_tokens,
        trust_checkpoint=config.trust_checkpoint,
        config_path=config.config_path,
        variant=variant,
    )
    check_eagle3_compatible(eagle, cache, str(cache.path))
    check_scored_sizes(
        longest_sequence(cache),
        str(cache.path),
        num_speculative_tokens=eagle.num_speculative_tokens,
        k_source="--num-speculative-tokens"
        if config.num_speculative_tokens is not None
        else "its config's K",
    )
    dtype = DTYPES[config.dtype]
    drafter = variant.drafter_class(eagle)
    drafter.load_state_dict(weights)
    drafter = drafter.to(device=config.device, dtype=dtype).eval()
    embed = cache.target_head()["embed_tokens"]
    own = head.get("embed_tokens.weight")
    # vLLM eagle.py load_model: the drafter shares the target's embedding when the shapes match,
    # else keeps its own.
    note = "embedding: the target's (from the cache), as vLLM shares it when the shapes match"
    if own is not None and tuple(own.shape) != tuple(embed.shape):
        embed, note = (
            own,
            "embedding: the checkpoint's own embed_tokens (its shape differs from the target's)",
        )
    elif (
        own is not None
        and variant.own_embedding_unless_identical
        and not torch.equal(own.to(embed.dtype), embed)
    ):
        embed, note = own, "embedding: the checkpoint's own embed_tokens (it differs from the target's)"
    drafter.attach_embedding(embed.to(device=config.device, dtype=dtype), head.get("d2t"))
    return drafter, Loaded(eagle, dataclasses.replace(report, notes=(*report.notes, note)))
