"""Load a target model (built-in or a local Hugging Face directory) and describe its layers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hscache.capture.builtin import build_builtin
from hscache.capture.device import check_device
from hscache.capture.model_config import read_model_config
from hscache.capture.preflight import check_model_name
from hscache.errors import InputError, ModelNotFoundError
from hscache.store.dtypes import DTYPES

__all__ = ["Target", "load_target", "torch_dtype"]

# Where decoder layers live, by model layout: multimodal wrappers nest the text model.
_LAYER_PATHS = ("model.language_model.layers", "model.layers", "language_model.model.layers")


def torch_dtype(name: str) -> torch.dtype:
    """``bf16``/``fp16``/``fp32`` -> torch dtype, with a clear error for anything else."""
    if name not in DTYPES:
        raise InputError(f"--dtype {name!r} is unknown; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class Target:
    """A loaded target model and the facts about it that the cache records."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user passed to --model
    weights_sha256: str
    layers: torch.nn.ModuleList = field(repr=False)
    layer_path: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def text_config(self) -> Any:
        config = self.model.config
        return getattr(config, "text_config", None) or config

    @property
    def layer_types(self) -> list[str]:
        """Per decoder layer "linear_attention" or "full_attention" (plain models: all full)."""
        types = getattr(self.text_config, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: every valid token id (may exceed the tokenizer's entries)."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def mask_token_id(self) -> int | None:
        return getattr(self.tokenizer, "mask_token_id", None)


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _find_layers(model: PreTrainedModel) -> tuple[torch.nn.ModuleList, str]:
    for path in _LAYER_PATHS:
        layers = _get_path(model, path)
        if isinstance(layers, torch.nn.ModuleList):
            return layers, path
    raise InputError(
        f"cannot find the decoder layers of {type(model).__name__} (looked at {', '.join(_LAYER_PATHS)}); "
        "hscache supports Qwen3 / Qwen3.5 / Qwen3-Next style causal LMs and their multimodal wrappers"
    )


def _state_dict_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _files_sha256(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin")):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def _load_hf_directory(
    directory: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_model_config(directory, "--model")
    architectures = config.get("architectures") or []
    if any(a.endswith("ForConditionalGeneration") for a in architectures):
        from transformers import AutoModelForImageTextToText as auto_cls
    else:
        auto_cls = AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # transformers' own "Loading weights" bar would precede (and break) hscache's one-line errors.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = auto_cls.from_pretrained(directory, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"cannot load a model from {directory}: {exc}; the directory needs config.json, "
            "*.safetensors weights and tokenizer files"
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def load_target(name: str, dtype: str = "fp32", device: str = "cpu") -> Target:
    """Load ``name`` (``builtin:...`` or a local HF directory) in ``dtype`` on ``device``, eval mode.

    Raises:
        ModelNotFoundError: neither a built-in name nor a directory with config.json.
    """
    torch_type = torch_dtype(dtype)
    check_device(device)
    check_model_name(name)
    if name.startswith("builtin:"):
        model, tokenizer = build_builtin(name)
        weights_sha256 = _state_dict_sha256(model)  # of the fp32 weights, before the dtype cast
        model = model.to(torch_type)
    else:
        directory = Path(name)
        model, tokenizer = _load_hf_directory(directory, torch_type)
        weights_sha256 = _files_sha256(directory)
    model = model.to(device).eval()
    layers, layer_path = _find_layers(model)
    return Target(model, tokenizer, name, weights_sha256, layers, layer_path)
