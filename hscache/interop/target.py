"""``hscache import --target MODEL``: what an import can compute from the target itself.

speculators' files hold the target's last decoder layer (before the final norm) as their last
slot, so the target's own final norm and output head give its next-token logits exactly as the
forward that produced the file did: ``target_argmax``, top-k and logsumexp are computed, not
guessed, and the cache becomes scorable. SpecForge's files never hold the last layer; for them
``--target`` only adds ``target/`` (config, tokenizer, head) and the target arrays stay absent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hscache.errors import InputError

__all__ = ["TargetHead", "load_import_target"]

_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class TargetHead:
    """The target's final norm and output head, applied to last-layer states ``[T, H]``."""

    def __init__(self, target: Any, top_k: int):
        self.target, self.top_k = target, top_k
        parent_path = target.layer_path.rsplit(".", 1)[0] if "." in target.layer_path else ""
        parent = target.model.get_submodule(parent_path) if parent_path else target.model
        self.norm = getattr(parent, "norm", None)
        if self.norm is None:
            raise InputError(
                f"{target.name}: no final norm next to {target.layer_path}; cannot compute target logits "
                "from the last layer (import without --target)"
            )
        self.lm_head = target.model.get_output_embeddings()
        self.dtype = next(target.model.parameters()).dtype

    def rows(self, last: torch.Tensor) -> dict[str, np.ndarray]:
        """Stored-dtype rows of target_argmax, target_topk_values/ids, target_logsumexp."""
        from hscache.capture.forward import next_token_stats

        with torch.no_grad():
            final = self.norm(last.to(self.dtype)[None])[0]
            argmax, values, ids, lse, _ = next_token_stats(self.lm_head, final, self.top_k, False)
        return {
            "target_argmax": argmax.to(torch.int32).numpy(),
            "target_topk_values": values.float().numpy(),
            "target_topk_ids": ids.to(torch.int32).numpy(),
            "target_logsumexp": lse.float().numpy(),
        }


def load_import_target(name: str, hidden_dtype: torch.dtype, hidden_size: int, layer_ids: list[int]) -> Any:
    """The target ``name`` in the files' dtype, checked against their width and layers.

    Raises:
        InputError: the target's hidden size or layer count does not fit the files.
    """
    from hscache.capture.target import load_target

    target = load_target(name, _DTYPE[hidden_dtype], "cpu")
    width = int(target.text_config.hidden_size)
    if width != hidden_size or max(layer_ids) >= target.num_layers:
        raise InputError(
            f"--target {name} has hidden size {width} and {target.num_layers} layers, but the files hold "
            f"width {hidden_size} and layers {layer_ids}; pass the target that produced them"
        )
    return target
