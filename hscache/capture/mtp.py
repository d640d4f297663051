"""The target's own MTP head (``mtp.*``): found in the checkpoint, stored in the cache's ``target/``.

Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints ship ``mtp_num_hidden_layers`` multi-token-prediction
layers under ``mtp.`` (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.N``,
``norm``). transformers' models ignore those keys, so they are read from the safetensors files
directly. The MTP head reads the target's LAST layer (after the final norm, as vLLM serves it):
`mtp_layer_id` names the layer extraction adds to ``--layers`` so the cache can score it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hscache.errors import ModelNotFoundError

__all__ = ["MTP_PREFIX", "checkpoint_mtp_weights", "mtp_layer_id", "target_mtp_weights"]

MTP_PREFIX = "mtp."


def checkpoint_mtp_weights(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor of the ``*.safetensors`` files in ``directory`` (cast to ``dtype``);
    {} when there are none. Only the matching tensors are read, never the whole checkpoint.

    Raises:
        ModelNotFoundError: a safetensors file cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(MTP_PREFIX):
                        out[key] = f.get_tensor(key).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise ModelNotFoundError(f"cannot read {path}: {exc}") from exc
    return out


def target_mtp_weights(name: str, model: torch.nn.Module, text_config) -> dict[str, torch.Tensor]:
    """The MTP head of the target loaded from ``name`` (built-in or a local directory), in the
    model's dtype on the CPU; {} when it has none."""
    dtype = next(model.parameters()).dtype
    if name.startswith("builtin:"):
        from hscache.capture.builtin import builtin_mtp_weights

        if not getattr(text_config, "mtp_num_hidden_layers", 0):
            return {}
        return {k: v.to(dtype) for k, v in builtin_mtp_weights(text_config).items()}
    directory = Path(name)
    if not (directory / "config.json").is_file():
        return {}
    return checkpoint_mtp_weights(directory, dtype)


def mtp_layer_id(num_target_layers: int) -> int:
    """The layer MTP reads: the target's last (the cache holds it pre-norm with the final norm
    saved in target/, so the post-norm state vLLM feeds MTP is rebuilt exactly)."""
    return num_target_layers - 1
