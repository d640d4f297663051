"""vllm-project/speculators DFlash checkpoints (`speculators_model_type: dflash`).

Their config nests the draft's Qwen3 fields in `transformer_layer_config` (serialised with
`to_diff_dict`, so absent keys mean Qwen3Config defaults), names the target layers as vLLM aux
ids (z-lab id + 1) and keeps `block_size`/`mask_token_id` at top level. The weights carry the
drafter's own `embed_tokens` [V, H] and `lm_head` [Vd, H]; with a reduced draft vocabulary
(`draft_vocab_size` < V) also `d2t` [Vd] (target id = draft id + d2t[draft id]) and `t2d`
(bool [V] membership mask).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HEAD_KEYS", "is_speculators", "split_head", "to_hf_config"]

HEAD_KEYS = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")
# Top-level speculators keys that change the math; passed on so hf_config_fields reads or refuses them.
_PASSED = ("architectures", "block_size", "mask_token_id", "sliding_window_non_causal", "sample_from_anchor")
# speculators' own keys, translated here (a variant's other top-level keys are passed on to it).
_TRANSLATED = (
    "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "aux_hidden_state_layer_ids", "target_hidden_size", "draft_vocab_size", "auto_package", "torch_dtype",
    "dtype", "transformers_version", "has_no_defaults_at_init",
)  # fmt: skip


def is_speculators(config: dict[str, Any] | None) -> bool:
    """True for a speculators DFlash config (any other speculators model type is not a drafter here)."""
    return bool(config) and "speculators_model_type" in config


def to_hf_config(
    config: dict[str, Any], kinds: tuple[str, ...] = ("dflash",)
) -> tuple[dict[str, Any], list[str]]:
    """The equivalent z-lab style config dict, and notes on what was translated. ``kinds``: the
    speculators model types read (a later DFlash variant in speculators' DFlash layout adds its own;
    its keys are passed on at top level for the variant to take).

    Raises:
        ValueError: another speculators model type, a layer config that is not qwen3, or no
            `aux_hidden_state_layer_ids`.
    """
    from transformers import Qwen3Config

    kind = config.get("speculators_model_type")
    if kind not in kinds:
        raise ValueError(
            f"speculators_model_type {kind!r} is not a DFlash drafter (expected {' or '.join(map(repr, kinds))})"
        )
    layer_config = dict(config.get("transformer_layer_config") or {})
    model_type = layer_config.pop("model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"transformer_layer_config.model_type {model_type!r} is not supported (qwen3 only)")
    # speculators builds Qwen3Config(**transformer_layer_config): fill the defaults it implies.
    hf = Qwen3Config(**layer_config).to_dict()
    notes = ["speculators config: fields read from transformer_layer_config (Qwen3Config defaults filled)"]
    passed = _PASSED if kind == "dflash" else tuple(k for k in config if k not in _TRANSLATED)
    for key in passed:
        if key in config:
            hf[key] = config[key]
    if "block_size" not in config:  # DFlashSpeculatorConfig's own default, not z-lab's 16
        hf["block_size"] = 8
        notes.append("block_size absent: speculators' default 8")
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(
            "speculators config has no aux_hidden_state_layer_ids; cannot tell the target layers"
        )
    hf["dflash_config"] = {"target_layer_ids": [int(a) - 1 for a in aux]}
    notes.append(
        f"aux_hidden_state_layer_ids {list(aux)} are vLLM ids (z-lab id + 1): target layers {[int(a) - 1 for a in aux]}"
    )
    if config.get("target_hidden_size") is not None:
        hf["target_hidden_size"] = config["target_hidden_size"]
    if hf.get("layer_types") and "sliding_attention" in hf["layer_types"]:
        notes.append(
            "sliding layers scored as vLLM serves them (key visible iff q_pos - k_pos < W); speculators' "
            "training mask anchors the window at the block's anchor instead"
        )
    return hf, notes


def split_head(raw: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Take the drafter's own `embed_tokens`/`lm_head`/`d2t` out of ``raw`` (mutated), checked.

    Returns:
        ``{"embed_tokens": [V, H], "lm_head": [Vd, H], "d2t": [Vd] long}`` (keys present in the file).

    Raises:
        ValueError: the reduced vocabulary is inconsistent (sizes, ids outside V, t2d disagreeing).
    """
    head = {}
    for key in HEAD_KEYS:
        for name in (key, f"model.{key}"):
            if name in raw:
                head[key.removesuffix(".weight")] = raw.pop(name)
    t2d = head.pop("t2d", None)
    vocab = int((config.get("transformer_layer_config") or {}).get("vocab_size", 0) or 0)
    draft_vocab = config.get("draft_vocab_size")
    lm_head, d2t = head.get("lm_head"), head.get("d2t")
    if lm_head is not None and draft_vocab is not None and lm_head.shape[0] != draft_vocab:
        raise ValueError(f"lm_head.weight has {lm_head.shape[0]} rows but draft_vocab_size is {draft_vocab}")
    if d2t is None:
        if lm_head is not None and vocab and lm_head.shape[0] != vocab:
            raise ValueError(
                f"lm_head.weight has {lm_head.shape[0]} rows (a reduced draft vocabulary) but the file has "
                "no d2t mapping to target ids"
            )
        return head
    d2t = d2t.long()
    target_ids = torch.arange(len(d2t)) + d2t
    if lm_head is not None and len(d2t) != lm_head.shape[0]:
        raise ValueError(f"d2t has {len(d2t)} entries but lm_head.weight has {lm_head.shape[0]} rows")
    if len(target_ids) and (int(target_ids.min()) < 0 or (vocab and int(target_ids.max()) >= vocab)):
        raise ValueError(f"d2t maps draft ids to target ids outside 0..{vocab - 1}")
    if len(target_ids) > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise ValueError(
            "d2t target ids are not strictly increasing (speculators sorts the draft vocabulary)"
        )
    if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), target_ids):
        raise ValueError("t2d and d2t disagree on which target ids are in the draft vocabulary")
    head["d2t"] = d2t
    return head
