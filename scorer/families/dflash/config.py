"""A DFlash drafter's configuration and its mapping from published ``config.json`` layouts.

`DFlashConfig` is what the model in `scorer.families.dflash.model` is built from; `hf_config_fields` reads the
fields a published config sets (and refuses, by name, the keys that change the math but are not
implemented), so checkpoint loading can say where every field came from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hscache.capture.layers import dflash_layer_ids
from scorer.config_numbers import check_config_numbers
from scorer.families.base import DecoderDims

__all__ = ["DFlashConfig", "derive_target_layer_ids", "draft_value", "hf_config_fields"]


def derive_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers a drafter reads when its config does not list them: the DFlash rule (spec section 1).

    One definition, shared with ``hscache extract --layers dflash:N``.

    Raises:
        ValueError: n < 1, or the rule gives ids outside 0..L-1 or repeated ids.
    """
    return dflash_layer_ids(num_target_layers, num_draft_layers)


_SUPPORTED_ROPE_TYPES = ("default", "linear")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_type(rope_scaling: dict | None) -> str:
    if rope_scaling is None:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


@dataclass(frozen=True)
class DFlashConfig(DecoderDims):
    """Architecture of a DFlash drafter; mirrors the HF `config.json` fields (spec section 1)."""

    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    # Per-layer attention, exactly as z-lab dflash/model.py reads them (spec section 1): a
    # "sliding_attention" layer sees keys with q_pos - k_pos < sliding_window (absolute positions)
    # and is causal inside the block unless `is_causal` (one flag for every layer) says otherwise.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None

    def __post_init__(self) -> None:
        # Each number as the CLI flag of its name checks it (rope_theta 0 / NaN, block_size 8.5).
        check_config_numbers({f: getattr(self, f) for f in self.__dataclass_fields__}, "DFlash config")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
            if all(t == "full_attention" for t in self.layer_types) and self.is_causal is None:
                object.__setattr__(self, "layer_types", None)  # the classic drafter: one canonical form
        if not (self.layer_types and "sliding_attention" in self.layer_types):
            object.__setattr__(self, "sliding_window", None)  # read only by sliding layers
        self._check_layer_types()
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; a drafter reads at least one target layer")
        self.check_attention_heads()
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the known token), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "linear" and not float(self.rope_scaling.get("factor", 0)) > 0:
            raise ValueError(f"linear rope_scaling needs a positive 'factor', got {self.rope_scaling}")

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is None:
            return
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        if bad := sorted(set(types) - set(LAYER_TYPES)):
            raise ValueError(
                f"layer_types {bad} not supported; each entry must be one of {list(LAYER_TYPES)}"
            )
        if "sliding_attention" in types and not (
            isinstance(self.sliding_window, int) and self.sliding_window > 0
        ):
            raise ValueError(
                f"sliding_attention layers need a positive integer sliding_window, got {self.sliding_window!r}"
            )

    def layer_attention(self, layer: int) -> tuple[bool, int | None]:
        """(causal inside the block, window or None) of draft layer ``layer`` (z-lab rule)."""
        kind = self.layer_types[layer] if self.layer_types else "full_attention"
        causal = kind == "sliding_attention" if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if kind == "sliding_attention" else None)

    @property
    def rope_type(self) -> str:
        """'default' or 'linear' (the RoPE variants this model implements)."""
        return _rope_type(self.rope_scaling)

    @property
    def num_features(self) -> int:
        """K, the number of target layers concatenated into each context row (K*H columns)."""
        return len(self.target_layer_ids)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DFlashConfig:
        """Build from an HF `config.json` dict.

        Args:
            config: the parsed JSON. `dflash_config.block_size` wins over `block_size` (default 16);
                `rope_theta` may sit at top level or under `rope_parameters` (transformers 5).

        Returns:
            The config.

        Raises:
            ValueError: a required field is missing or a value is unsupported.
        """
        fields = hf_config_fields(config)
        if "target_layer_ids" not in fields and fields.get("num_target_layers") is not None:
            fields["target_layer_ids"] = tuple(
                derive_target_layer_ids(fields["num_target_layers"], fields["num_hidden_layers"])
            )
        fields.setdefault("block_size", 16)
        fields.setdefault("rope_scaling", None)
        fields.setdefault("attention_bias", False)
        optional = ("num_target_layers", "layer_types", "sliding_window", "is_causal")
        missing = [f for f in cls.__dataclass_fields__ if f not in fields and f not in optional]
        if missing:
            raise ValueError(
                f"config.json lacks {', '.join(missing)}; a DFlash drafter config needs "
                "them (target_layer_ids may be replaced by num_target_layers)"
            )
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (`model_type: qwen3`, `architectures: [DFlashDraftModel]`)."""
        out = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("target_layer_ids", "block_size", "mask_token_id", "num_target_layers")
        }
        out.update(
            model_type="qwen3",
            architectures=["DFlashDraftModel"],
            block_size=self.block_size,
            hidden_act="silu",
            tie_word_embeddings=False,
        )
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        for key in ("layer_types", "sliding_window", "is_causal"):
            out.pop(key)
            if getattr(self, key) is not None:
                out[key] = list(self.layer_types) if key == "layer_types" else getattr(self, key)
        if self.layer_types and "sliding_attention" in self.layer_types:
            out["use_sliding_window"] = True  # transformers' Qwen3Config drops the window otherwise
        out["dflash_config"] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        return out


def draft_value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """z-lab's ``_draft_value``: ``dflash_config[name]``, else the top-level key, else ``default``."""
    dflash = config.get("dflash_config") or {}
    return dflash[name] if name in dflash else config.get(name, default)


def hf_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The DFlashConfig fields present in an HF config dict (a partial parse; nothing defaulted).

    Args:
        config: parsed `config.json`, or a trainer's config dict (`aux`/`aux_layer_ids` are read
            as `target_layer_ids`).

    Returns:
        Field name -> value for the fields the dict sets.

    Raises:
        ValueError: the config sets a key that changes the math in a way this drafter does not
            implement (each one named), e.g. DFlash2 convolutions or partial RoPE.
    """
    _reject_unsupported(config)
    dflash = config.get("dflash_config") or {}
    rope_params = config.get("rope_parameters") or {}
    fields: dict[str, Any] = {k: config[k] for k in DFlashConfig.__dataclass_fields__ if k in config}
    if "rope_theta" not in fields and "rope_theta" in rope_params:
        fields["rope_theta"] = rope_params["rope_theta"]
    if "rope_scaling" not in fields and rope_params:
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        fields["rope_scaling"] = None if _rope_type(scaling) == "default" else scaling
    for alias in ("aux_layer_ids", "aux"):
        if isinstance(config.get(alias), (list, tuple)) and "target_layer_ids" not in fields:
            fields["target_layer_ids"] = config[alias]
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
        if dflash.get(key) is not None:
            fields[key] = dflash[key]
    if fields.get("target_layer_ids") is not None:
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
    fields.update(_attention_fields(config))
    return {k: v for k, v in fields.items() if v is not None or k == "rope_scaling"}


def _attention_fields(config: dict[str, Any]) -> dict[str, Any]:
    """layer_types / sliding_window / is_causal as z-lab's model reads them through Qwen3Config."""
    n_layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    window = config.get("sliding_window")
    use_sw = config.get("use_sliding_window")
    if types is None and use_sw and window is not None and isinstance(n_layers, int):
        # transformers' Qwen3Config: layers at index >= max_window_layers slide.
        first = int(config.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    sliding = bool(types) and "sliding_attention" in types
    is_causal = config.get("is_causal")
    if is_causal is None:
        is_causal = (config.get("dflash_config") or {}).get("causal")  # vLLM's spelling
    if is_causal is None and "MuseGlimmerAssistantModel" in (config.get("architectures") or []):
        is_causal = False  # z-lab MLX and vLLM: this head's in-block attention is bidirectional
    if config.get("sliding_window_non_causal"):  # speculators: sliding layers see the whole block
        is_causal = False
    return {
        "layer_types": tuple(types) if types is not None else None,
        "sliding_window": window if sliding else None,
        "is_causal": None if is_causal is None else bool(is_causal),
    }


# Keys that change the math, with the value (or values) that leaves it unchanged; any other
# value is refused by name. Looked up like z-lab's _draft_value (dflash_config, then top level).
_INERT: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", None),  # the MLP is SwiGLU (model.py): another activation is refused by name
    "input_embedding_scale": (1, None),
    "output_multiplier": (1, None),
    "final_logit_softcapping": (0, None),
    "logit_scale": (1, None),
    "partial_rotary_factor": (1, None),
    "attention_value_scale": (1, None),
    "is_neox_style": (True, None),
    "use_swa": (False, None),
    "swa_window_size": (None,),
    "attention_sink_bias": (False, None),
    "add_swa_attention_sink_bias": (False, None),
    "sample_from_anchor": (False, None),
    "use_aux_hidden_state": (True, None),
    "projector_type": (None,),
    "pure_draft_prefix_len": (0, None),
    "shift_label": (False, None),
    "conv_kernel_size": (None,),
    "conv_group_size": (None,),
    "selector_rank": (None,),
    "selector_top_k": (None,),
}
_ACCEPTED_ARCHITECTURES = ("DFlashDraftModel", "DFlashSpeculator", "MuseGlimmerAssistantModel")


def _reject_unsupported(config: dict[str, Any]) -> None:
    """Refuse, by name, every key whose value changes the math in a way this model does not do."""
    # Later variants (DFlash2DraftModel: convolutions + candidate selector) share the key layout.
    archs = config.get("architectures") or []
    problems = [
        f"architectures={archs}"
        for a in archs[:1]
        if a.startswith("DFlash") and a not in _ACCEPTED_ARCHITECTURES
    ]
    rope_params = config.get("rope_parameters") or {}
    for key, inert in _INERT.items():
        value = draft_value(config, key, rope_params.get(key))
        if not any(value is v or (v is not None and value == v) for v in inert):
            problems.append(f"{key}={value!r}")
    types = config.get("layer_types") or []
    use_sw = config.get("use_sliding_window")
    if "sliding_attention" in types and use_sw is not True and config.get("model_type", "qwen3") == "qwen3":
        # transformers' Qwen3Config then drops the window (z-lab torch: causal, no window), vLLM
        # keeps it; SpecForge refuses. Non-qwen3 configs (the z-lab assistant) keep the window.
        problems.append(
            f"use_sliding_window={use_sw} with sliding_attention layers (transformers drops the window, "
            "vLLM keeps it; set use_sliding_window: true)"
        )
    hidden, target_hidden = config.get("hidden_size"), config.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        problems.append(f"target_hidden_size={target_hidden} (!= hidden_size {hidden})")
    if problems:
        raise ValueError(
            f"unsupported DFlash drafter variant ({'; '.join(problems)}); this scorer "
            "implements the block-diffusion drafter of z-lab's DFlash only (docs/families.md)"
        )
