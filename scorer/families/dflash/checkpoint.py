"""Load any DFlash drafter checkpoint into (DFlashConfig, state_dict) and say what was inferred.

Accepted (spec/dflash.md section 2, docs/scoring.md "Drafter formats"): an HF directory (config.json +
model.safetensors, or shards with `model.safetensors.index.json`, or pytorch_model.bin) in the
z-lab, SpecForge-export or speculators layout, a bare `.safetensors` file, a training pickle
(`.pt`, `.pth`, `.bin`), or SpecForge's `{run}-stepN/training_state.pt` (`draft_state_dict`).
A separate draft config can be given (`config_path`, the CLI's `--config`). Pickles load with
`weights_only=True` unless the caller trusts the file, since full unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hscache.store.fsio import atomic_write_with
from scorer.errors import CheckpointError
from scorer.families.dflash import speculators
from scorer.families.dflash.config import DFlashConfig, derive_target_layer_ids, hf_config_fields
from scorer.families.dflash.model import DFlashDrafter
from scorer.formats.checkpoint_io import (
    LoadReport,
    check_state_dict,
    state_dict_sha256,
)
from scorer.formats.files import (
    FORMAT_PICKLE,
    FORMAT_SPECFORGE,
    few,
    read_json,
    read_training_state_contract,
    read_weights,
    resolve_files,
)

__all__ = [
    "CheckpointVariant",
    "LoadedCheckpoint",
    "in_memory_checkpoint",
    "load_checkpoint",
    "save_hf_checkpoint",
    "variant_tensor_problems",
]

# Fixed strings: they are written into cache manifests and result files.
_LEADING_PREFIXES = ("module.", "draft_model.", "model.")
_WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # may sit mid-key
_RENAMES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
_ST_METADATA = {"format": "pt"}  # what transformers writes; lets it load our shards
# Used only when a config file exists and omits the key: the published code's own default then.
_DEFAULTS = {"block_size": 16, "rms_norm_eps": 1e-6, "rope_scaling": None, "attention_bias": False}
# Fields that change the numbers and that nothing but a config or a flag can tell: without a
# config they stop the run, naming the flag (issue: a block-8 drafter scored at block 16).
_FLAG_FOR = {"block_size": "--block-size", "mask_token_id": "--mask-token-id"}


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A drafter ready for `DFlashDrafter(config).load_state_dict(state_dict)`."""

    config: DFlashConfig
    state_dict: dict[str, torch.Tensor]
    report: LoadReport
    # The drafter's own output side, when its layout defines one (speculators): "embed_tokens"
    # [V, H], "lm_head" [Vd, H], "d2t" [Vd]; empty means the target's embedding and head.
    head: dict[str, torch.Tensor] = field(default_factory=dict)
    # A CheckpointVariant's own settings (config key -> value as found) and tensors, split off.
    variant_config: dict[str, Any] = field(default_factory=dict)
    variant_state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointVariant:
    """A later DFlash variant in DFlash's layout (DFlash2):
    its config keys and architecture names are taken out of every config before DFlash's parse
    (which refuses them by name) and its tensors out of the state dict before DFlash's checks;
    the variant's family reads them from ``LoadedCheckpoint.variant_config`` / ``variant_state``."""

    config_keys: tuple[str, ...]
    architectures: tuple[str, ...]
    tensor_markers: tuple[str, ...]  # a key containing one of these belongs to the variant
    speculators_type: str | None = None  # its speculators_model_type, in speculators' DFlash layout

    def split_config(self, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        config, found = dict(config), {}
        dflash = dict(config.get("dflash_config") or {})
        for key in self.config_keys:
            for holder in (config, dflash):
                if key in holder:
                    found[key] = holder.pop(key)
        if "dflash_config" in config:
            config["dflash_config"] = dflash
        archs = config.get("architectures") or []
        if any(a in self.architectures for a in archs):
            config["architectures"] = ["DFlashDraftModel"]
        return config, found

    def split_state(self, sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        mine = {k: v for k, v in sd.items() if any(m in k for m in self.tensor_markers)}
        return {k: v for k, v in sd.items() if k not in mine}, mine


def variant_tensor_problems(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """What keeps a variant's tensors ``got`` (``LoadedCheckpoint.variant_state``) from its drafter's
    ``want``: up to three missing, three unknown and three misshapen keys, each named; [] when they fit."""
    problems = [f"missing {k}" for k in sorted(set(want) - set(got))][:3]
    problems += [f"unknown {k}" for k in sorted(set(got) - set(want))][:3]
    problems += [
        f"{k} has shape {list(got[k].shape)}, expected {list(want[k].shape)}"
        for k in sorted(set(want) & set(got))
        if got[k].shape != want[k].shape
    ][:3]
    return problems


def load_checkpoint(
    path: str | os.PathLike,
    *,
    overrides: dict[str, Any] | None = None,
    fallbacks: dict[str, Any] | None = None,
    trust_checkpoint: bool = False,
    config_path: str | os.PathLike | None = None,
    variant: CheckpointVariant | None = None,
) -> LoadedCheckpoint:
    """Load a DFlash drafter checkpoint of any supported format (``variant``: a later DFlash
    variant's keys and tensors split off, see CheckpointVariant).

    Args:
        path: HF directory, `.safetensors` file, or `.pt`/`.pth`/`.bin` pickle.
        overrides: DFlashConfig field -> value for what the weights cannot tell (target_layer_ids
            or num_target_layers, mask_token_id, rope_theta, vocab_size, ...); wins over a config.
        fallbacks: values used only for fields that neither the config, the weights nor the
            overrides supply (the scorer passes what the hidden-state cache knows); source "cache".
        trust_checkpoint: allow full unpickling of a pickle that `weights_only` refuses.
        config_path: a separate draft config JSON (SpecForge's `model.draft_model_config`); it
            replaces a config.json beside the weights.

    Returns:
        LoadedCheckpoint with exactly the drafter's keys (no embed_tokens / lm_head).

    Raises:
        CheckpointNotFoundError: no such path, or a directory without weights.
        UntrustedCheckpointError: the pickle needs full unpickling and trust_checkpoint is False.
        CheckpointError: not a DFlash drafter (keys or shapes), or fields nothing could supply.

    Example:
        >>> ckpt = load_checkpoint("Qwen3-8B-DFlash-b16")  # doctest: +SKIP
        >>> drafter = DFlashDrafter(ckpt.config); drafter.load_state_dict(ckpt.state_dict)  # doctest: +SKIP
    """
    root = Path(path)
    fmt, files, config_json = resolve_files(root)
    raw, embedded_config, recorded = read_weights(fmt, files, root, trust_checkpoint)
    if recorded is not None and fmt == FORMAT_PICKLE:
        fmt = FORMAT_SPECFORGE
    layers: list[tuple[str, dict]] = []  # (source label, raw config dict), weakest first
    notes: list[str] = []
    if recorded is None and root.is_dir() and fmt != FORMAT_SPECFORGE:
        # SpecForge's legacy export keeps training_state.pt beside config.json: its contract holds
        # the mask id the run trained with, which the shipped config leaves null (issue 20).
        recorded, skipped = read_training_state_contract(root, trust_checkpoint)
        notes += [skipped] if skipped else []
    if recorded:
        layers.append(("checkpoint", recorded))
    if embedded_config:  # a trainer's config saved with the weights counts as a config
        layers.append(("config", embedded_config))
    if config_json is not None:
        layers.append(("config", config_json))
    if config_path is not None:
        file_config = read_json(Path(config_path))
        layers.append(("config_file", file_config))
        files = [*files, Path(config_path)]
    elif fmt == FORMAT_SPECFORGE and config_json is None:
        raise CheckpointError(
            f"{root} is a SpecForge training_state.pt: it holds the weights but no draft config "
            "(layer_types, sliding_window, rope); pass --config DRAFT_CONFIG.json, the run's "
            "model.draft_model_config"
        )
    head: dict[str, torch.Tensor] = {}
    layout = "specforge" if fmt == FORMAT_SPECFORGE else "zlab"
    for n, (label, cfg) in enumerate(layers):
        if speculators.is_speculators(cfg):
            try:
                kinds = ("dflash",) + (
                    (variant.speculators_type,) if variant and variant.speculators_type else ()
                )
                converted, converted_notes = speculators.to_hf_config(cfg, kinds)
                layers[n] = (label, converted)
                notes += converted_notes
                head = speculators.split_head(raw, cfg)
            except ValueError as e:
                raise CheckpointError(f"{root}: {e}") from e
            layout = "speculators"
    variant_config: dict[str, Any] = {}
    if variant is not None:
        for n, (label, cfg) in enumerate(layers):
            cfg, found = variant.split_config(cfg)
            layers[n] = (label, cfg)
            variant_config.update(found)  # later (stronger) configs win, as for DFlash's fields
    state_dict, stripped, dropped = _normalize_keys(raw, root)
    del raw  # drop the last reference to anything else the file held
    variant_state: dict[str, torch.Tensor] = {}
    if variant is not None:
        state_dict, variant_state = variant.split_state(state_dict)
    config, sources, more_notes, warnings = _resolve_config(
        state_dict, layers, overrides or {}, root, fallbacks or {}
    )
    notes += more_notes
    _validate(state_dict, config, root)
    report = LoadReport.of_files(
        root,
        fmt,
        files,
        {**state_dict, **variant_state},
        field_sources=sources,
        stripped_prefixes=stripped,
        dropped_keys=dropped,
        notes=tuple(notes),
        layout=layout,
        warnings=tuple(warnings),
    )
    return LoadedCheckpoint(
        config=config,
        state_dict=state_dict,
        report=report,
        head=head,
        variant_config=variant_config,
        variant_state=variant_state,
    )


def in_memory_checkpoint(config: DFlashConfig, state_dict: dict[str, torch.Tensor]) -> LoadedCheckpoint:
    """A LoadedCheckpoint for weights that never were a file (``scorer.evaluate_module``).

    Raises:
        CheckpointError: the weights do not match the config.
    """
    state_dict, stripped, dropped = _normalize_keys(state_dict, Path("<in-memory>"))
    _validate(state_dict, config, "<in-memory drafter>")
    report = LoadReport(
        path="<in-memory>",
        format="module",
        file_sha256={},
        sha256="",
        weights_sha256=state_dict_sha256(state_dict),
        field_sources=dict.fromkeys(sorted(DFlashConfig.__dataclass_fields__), "config"),
        stripped_prefixes=stripped,
        dropped_keys=dropped,
    )
    return LoadedCheckpoint(config=config, state_dict=state_dict, report=report)


def _normalize_keys(raw: dict[str, torch.Tensor], root: Path) -> tuple[dict, tuple, tuple]:
    """Strip wrapper prefixes, apply vLLM renames, drop target copies. -> (sd, stripped, dropped)."""
    out: dict[str, torch.Tensor] = {}
    stripped: set[str] = set()
    dropped: list[str] = []
    for original, tensor in raw.items():
        key = original
        for seg in _WRAPPER_SEGMENTS:
            if seg in key:
                key = key.replace(seg, "")
                stripped.add(seg)
        while prefix := next((p for p in _LEADING_PREFIXES if key.startswith(p)), None):
            key = key[len(prefix) :]
            stripped.add(prefix)
        for old, new in _RENAMES:
            if key.startswith(old):
                key = new + key[len(old) :]
                stripped.add(f"{old} -> {new}")
        if key in _TARGET_COPIES or key.endswith("rotary_emb.inv_freq"):
            dropped.append(original)
            continue
        if key in out:
            raise CheckpointError(
                f"{root}: two keys map to {key!r} after prefix stripping; the file holds more than one model"
            )
        out[key] = tensor
    return out, tuple(sorted(stripped)), tuple(sorted(dropped))


def _infer_from_shapes(sd: dict[str, torch.Tensor], root: Path) -> dict[str, Any]:
    """Architecture fields the weight shapes determine (spec section 2 key layout)."""
    need = [
        "fc.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.mlp.gate_proj.weight",
    ]
    if missing := [k for k in need if k not in sd]:
        raise CheckpointError(
            f"{root} is not a DFlash drafter checkpoint: missing {few(missing)}; present: {few(sorted(sd))}"
        )
    hidden, fc_in = sd["fc.weight"].shape
    head_dim = sd["layers.0.self_attn.q_norm.weight"].shape[0]
    if fc_in % hidden:
        raise CheckpointError(f"{root}: fc.weight is {[hidden, fc_in]}; columns must be K * hidden_size")
    return {
        "hidden_size": hidden,
        "num_features": fc_in // hidden,
        "num_hidden_layers": len({k.split(".")[1] for k in sd if k.startswith("layers.")}),
        "intermediate_size": sd["layers.0.mlp.gate_proj.weight"].shape[0],
        "head_dim": head_dim,
        "num_attention_heads": sd["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        "num_key_value_heads": sd["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        "attention_bias": "layers.0.self_attn.q_proj.bias" in sd,
    }


def _resolve_config(
    sd: dict,
    layers: list[tuple[str, dict]],
    overrides: dict[str, Any],
    root: Path,
    fallbacks: dict[str, Any] | None = None,
) -> tuple[DFlashConfig, dict[str, str], list[str], list[str]]:
    """Merge config layers, weight shapes, overrides, cache and defaults.

    Returns the config, where each field came from, notes, and warnings for the report.
    """
    names = set(DFlashConfig.__dataclass_fields__)
    if unknown := sorted(set(overrides) - names):
        raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(names)}")
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for label, raw_config in layers:  # weakest first: a later layer wins, a clash is noted
        try:
            parsed = hf_config_fields(raw_config) if raw_config.keys() - names else dict(raw_config)
        except ValueError as e:
            raise CheckpointError(f"{root}: {e}") from e
        for name, value in parsed.items():
            if name in fields and fields[name] != value:
                notes.append(f"{label} {name}={value!r} replaced {sources[name]} value {fields[name]!r}")
            fields[name], sources[name] = value, label
    have_config = any(label in ("config", "config_file") for label, _ in layers)
    shapes = _infer_from_shapes(sd, root)
    k_features = shapes.pop("num_features")
    for name, value in shapes.items():
        if name in fields and fields[name] != value:
            raise CheckpointError(
                f"{root}: {sources[name]} says {name}={fields[name]} but the weights say {value}"
            )
        fields.setdefault(name, value)
        sources.setdefault(name, "shapes")
    overridden: list[str] = []
    for name, value in overrides.items():
        if sources.get(name) == "shapes" and fields[name] != value:
            raise CheckpointError(f"{root}: override {name}={value} contradicts the weights ({fields[name]})")
        if name in fields and sources[name] != "shapes" and fields[name] != value:
            notes.append(f"override {name}={value!r} replaced {sources[name]} value {fields[name]!r}")
            if said := _override_warning(name, fields[name], value, sources[name]):
                overridden.append(said)
        fields[name], sources[name] = value, "override"
    if "target_layer_ids" not in fields and fields.get("num_target_layers") is not None:
        fields["target_layer_ids"] = derive_target_layer_ids(
            fields["num_target_layers"], fields["num_hidden_layers"]
        )
        sources["target_layer_ids"] = "derived"
    if not have_config and (lacking := [f for f in _FLAG_FOR if f not in fields]):
        # block_size cannot be derived from weights or cache; mask_token_id only guessed.
        if "mask_token_id" in lacking and (fallbacks or {}).get("mask_token_id") is not None:
            lacking.remove("mask_token_id")
        if lacking:
            raise CheckpointError(
                f"{root} has no config that sets {', '.join(lacking)}, and a default would change "
                f"the numbers silently; pass {', '.join(_FLAG_FOR[f] + ' N' for f in lacking)} "
                "(or --config DRAFT_CONFIG.json)"
            )
    for name, value in (fallbacks or {}).items():
        if name not in fields and value is not None:
            fields[name], sources[name] = value, "cache"
    for name, value in _DEFAULTS.items():
        if name not in fields:
            fields[name], sources[name] = value, "default"
    if missing := sorted(names - set(fields) - _OPTIONAL):
        raise CheckpointError(
            f"{root}: cannot tell {', '.join(missing)} from the checkpoint; pass them "
            "as overrides (CLI flags, or from the hidden-state cache)"
        )
    if len(fields["target_layer_ids"]) != k_features:
        raise CheckpointError(
            f"{root}: target_layer_ids {list(fields['target_layer_ids'])} has "
            f"{len(fields['target_layer_ids'])} entries but fc.weight takes {k_features} "
            "features"
        )
    warnings = overridden + _warnings(layers, sources, fields, fallbacks or {})
    if not have_config:
        guessed = [
            f"{n}={fields[n]!r}"
            for n in ("target_layer_ids", "rope_theta", "rms_norm_eps")
            if sources.get(n) == "cache"
        ]
        if guessed:
            warnings.append(
                f"the checkpoint has no config: {', '.join(guessed)} taken from the cache's target; "
                "pass --target-layer-ids / --rope-theta or --config if the drafter was trained otherwise"
            )
    try:
        return DFlashConfig(**fields), dict(sorted(sources.items())), notes, warnings
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{root}: invalid drafter config: {e}") from e


_OPTIONAL = {"num_target_layers", "layer_types", "sliding_window", "is_causal"}


def _override_warning(name: str, stated: Any, given: Any, label: str) -> str | None:
    """One line for the report when a flag replaces what the drafter was trained with (its config
    ``label`` states ``stated``): the numbers are then those of another drafter (issue 35 item 8)."""
    if name == "target_layer_ids":
        stated, given = [int(i) for i in stated], [int(i) for i in given]
        how = "reorders" if sorted(stated) == sorted(given) else "replaces"
        return (
            f"--target-layer-ids {','.join(map(str, given))} {how} the layers the drafter's {label} states "
            f"{stated}: each feature slot reads another layer than it was trained on, so this scores a "
            "different drafter (drop the flag to score the one trained)"
        )
    if name == "block_size":
        more = (
            f"drafts slots {int(stated)}-{int(given) - 1} it was never trained on"
            if int(given) > int(stated)
            else f"drafts {int(given) - 1} of its {int(stated) - 1} trained slots"
        )
        return f"--block-size {given} overrides the drafter's trained block size {stated} (its {label}): it {more}"
    flag = {"mask_token_id": "--mask-token-id", "rope_theta": "--rope-theta"}.get(name)
    if flag is None:
        return None
    return f"{flag} {given} replaces the {stated!r} the drafter's {label} states: scored as given, not as trained"


def _find_key(obj: Any, key: str, trail: str = "", null: bool = False) -> str | None:
    """Dotted path of the first ``key`` anywhere in a nested config dict set to a value (or, with
    ``null``, explicitly set to null), or None."""
    if isinstance(obj, Mapping):
        if key in obj and (obj[key] is None) == null:
            return f"{trail}{key}"
        for k, v in obj.items():
            if (found := _find_key(v, key, f"{trail}{k}.", null)) is not None:
                return found
    return None


# Fields the cache can fill that change the drafter's numbers (vocab_size is only checked).
_MATH_FIELDS = (
    "mask_token_id",
    "target_layer_ids",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "num_target_layers",
)
_NULL_ADVICE = {
    "mask_token_id": "pass --mask-token-id N (SpecForge records the trained id in training_state.pt: "
    "keep it beside config.json, or score the training_state.pt itself)",
    "target_layer_ids": "pass --target-layer-ids",
    "rope_theta": "pass --rope-theta",
}


def _warnings(
    layers: list[tuple[str, dict]], sources: dict[str, str], fields: dict[str, Any], fallbacks: dict[str, Any]
) -> list[str]:
    """A field the config states but that was taken from the cache; a config sized for another target."""
    out = []
    for name, source in sorted(sources.items()):
        if source != "cache":
            continue
        nulls = [(label, where) for label, raw in layers if (where := _find_key(raw, name, null=True))]
        if nulls and name in _MATH_FIELDS:
            label, where = nulls[-1]
            out.append(
                f"drafter {name}={fields[name]!r} came from the cache's target because the {label} sets "
                f"{where}: null; if the drafter was trained with another value every number here is "
                f"wrong: {_NULL_ADVICE.get(name, 'pass it with --config')} "
                "(`scorer diagnose` tests the alternatives)"
            )
        for label, raw_config in layers:
            if (where := _find_key(raw_config, name)) is not None:
                out.append(
                    f"drafter {name}: the {label} sets {where} but it was not read; "
                    f"the value {fields[name]!r} came from the cache's target"
                )
    stated, target = fields.get("num_target_layers"), fallbacks.get("num_target_layers")
    if stated is not None and target is not None and int(stated) != int(target):
        out.append(
            f"drafter num_target_layers={stated} ({sources.get('num_target_layers')}) but the cache's "
            f"target has {target} layers: the drafter was built for another target"
        )
    return out


def _validate(sd: dict[str, torch.Tensor], config: DFlashConfig, root: Path | str) -> None:
    """Exactly the drafter's keys with the drafter's shapes, else one CheckpointError naming them."""
    check_state_dict(
        sd, lambda: DFlashDrafter(config), f"{root} is not a DFlash drafter checkpoint", floats=True
    )


def save_hf_checkpoint(
    directory: str | os.PathLike,
    config: DFlashConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
    extra_config: dict[str, Any] | None = None,
) -> list[Path]:
    """Write config.json + model.safetensors (or shards + model.safetensors.index.json).

    Each file goes to a temp name then is renamed; stale weight files of the other layout in
    `directory` are removed so a later load cannot mix them.

    Args:
        directory: created if missing.
        config: written as the HF config.json (`DFlashConfig.to_hf_config`).
        state_dict: exactly the drafter's keys.
        max_shard_bytes: shard when given; a tensor larger than this gets a shard of its own.
        extra_config: keys added to config.json (e.g. ``hscache_target``, the target's identity).

    Returns:
        Paths written.

    Raises:
        CheckpointError: state_dict does not match config.
    """
    out = Path(directory)
    _validate(state_dict, config, out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for key in sorted(state_dict):  # safetensors refuses tensors that share storage
        t = state_dict[key].detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    shards = _plan_shards(tensors, max_shard_bytes)
    config_text = json.dumps({**config.to_hf_config(), **(extra_config or {})}, indent=2)
    written = [atomic_write_with(out / "config.json", lambda p: p.write_text(config_text))]
    names = (
        ["model.safetensors"]
        if len(shards) == 1 and max_shard_bytes is None
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        written.append(
            atomic_write_with(out / name, lambda p, s=shard: save_file(s, str(p), metadata=_ST_METADATA))
        )
    if len(names) > 1 or max_shard_bytes is not None:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {k: n for n, s in zip(names, shards) for k in s},
        }
        written.append(
            atomic_write_with(
                out / "model.safetensors.index.json", lambda p: p.write_text(json.dumps(index, indent=2))
            )
        )
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        if stale not in written:
            stale.unlink()
    return written


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        if max_bytes is not None and shards[-1] and size + t.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.nbytes
    return shards
