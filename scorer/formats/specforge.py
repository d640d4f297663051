"""SpecForge's current checkpoints: ``{run_id}-step{N}/training_state.pt``.

The file holds ``draft_state_dict`` (bare drafter keys, ``draft_model.`` already stripped) next to
the trainer's resume contract (``dflash_block_size``, ``dflash_target_layer_ids``,
``dflash_mask_token_id``, ``dflash_draft_num_hidden_layers``), and no draft config: the run's
``model.draft_model_config`` (layer_types, sliding_window, rope) must be passed with ``--config``.
The legacy ``epoch_E_step_S/`` directories are HF directories (config.json + model.safetensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STATE_FILE", "WEIGHTS_KEY", "contract_fields", "is_training_state"]

STATE_FILE = "training_state.pt"
WEIGHTS_KEY = "draft_state_dict"
_CONTRACT = {
    "dflash_block_size": "block_size",
    "dflash_target_layer_ids": "target_layer_ids",
    "dflash_mask_token_id": "mask_token_id",
    "dflash_draft_num_hidden_layers": "num_hidden_layers",
}


def is_training_state(obj: Any) -> bool:
    """A SpecForge training_state.pt payload (weights under ``draft_state_dict``)."""
    return isinstance(obj, Mapping) and WEIGHTS_KEY in obj


def contract_fields(obj: Mapping) -> dict[str, Any]:
    """DFlashConfig fields recorded in the resume contract (what the run trained with)."""
    out = {}
    for key, name in _CONTRACT.items():
        if obj.get(key) is not None:
            value = obj[key]
            out[name] = tuple(int(i) for i in value) if name == "target_layer_ids" else int(value)
    return out
