"""A DFlash drafter's configuration and its mapping from published ``config.json`` layouts.

`DrafterConfig` is what the model in `scorer.model` is built from; `hf_config_fields` reads the
fields a published config sets (and refuses, by name, the keys that change the math but are not
implemented), so checkpoint loading can say where every field came from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hscache.capture.layers import dflash_layer_ids

__all__ = ["DrafterConfig", "derive_target_layer_ids", "hf_config_fields"]


def derive_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers a drafter reads when its config does not list them: the DFlash rule (spec section 1).

    One definition, shared with ``hscache extract --layers dflash:N``.

    Raises:
        ValueError: n < 1, or the rule gives ids outside 0..L-1 or repeated ids.
    """
    return dflash_layer_ids(num_target_layers, num_draft_layers)


_SUPPORTED_ROPE_TYPES = ("default", "linear")


def _rope_type(rope_scaling: dict | None) -> str:
    if rope_scaling is None:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


@dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a DFlash drafter; mirrors the HF `config.json` fields (spec section 1)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; a drafter reads at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
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

    @property
    def rope_type(self) -> str:
        """'default' or 'linear' (the RoPE variants this model implements)."""
        return _rope_type(self.rope_scaling)

    @property
    def num_features(self) -> int:
        """K, the number of target layers concatenated into each context row (K*H columns)."""
        return len(self.target_layer_ids)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DrafterConfig:
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
        missing = [f for f in cls.__dataclass_fields__ if f not in fields and f != "num_target_layers"]
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
        out["dflash_config"] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        return out


def hf_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The DrafterConfig fields present in an HF config dict (a partial parse; nothing defaulted).

    Args:
        config: parsed `config.json`, or a trainer's config dict (`aux`/`aux_layer_ids` are read
            as `target_layer_ids`).

    Returns:
        Field name -> value for the fields the dict sets.

    Raises:
        ValueError: the config describes a later DFlash variant (DFlash2, sliding/causal layers,
            embedding or logit scaling) that this drafter does not implement.
    """
    _reject_unsupported(config)
    dflash = config.get("dflash_config") or {}
    rope_params = config.get("rope_parameters") or {}
    fields: dict[str, Any] = {k: config[k] for k in DrafterConfig.__dataclass_fields__ if k in config}
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
    return {k: v for k, v in fields.items() if v is not None or k == "rope_scaling"}


def _reject_unsupported(config: dict[str, Any]) -> None:
    """Fail on features of later DFlash variants that this model does not implement."""
    dflash = config.get("dflash_config") or {}
    # Later variants (DFlash2DraftModel: convolutions + candidate selector) share the key layout.
    problems = (
        [f"architectures={config['architectures']}"]
        if any(a.startswith("DFlash") and a != "DFlashDraftModel" for a in config.get("architectures") or [])
        else []
    )
    neutral = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0}
    for key, inert in neutral.items():
        value = dflash.get(key, config.get(key))
        if value is not None and float(value) != inert:
            problems.append(f"{key}={value}")
    if any(t != "full_attention" for t in config.get("layer_types") or []) or config.get("is_causal"):
        problems.append("sliding-window or causal draft layers")
    if problems:
        raise ValueError(
            f"unsupported DFlash drafter variant ({'; '.join(problems)}); this scorer "
            "implements the block-diffusion drafter of spec/dflash.md section 1 only"
        )
