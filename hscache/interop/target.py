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

__all__ = ["TargetHead", "check_target_produced", "load_import_target"]

_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# The sample the check re-computes: the first sequence's first tokens (causal: a prefix's states are
# the full forward's). The producing target reproduces its own states up to kernel rounding; another
# target's states have nothing to do with them. Measured on the two built-in targets (random weights,
# bf16, 2 sequences each way): cosine 1.00 for the right one, -0.02..0.02 for the other; the head's
# argmax agreement with the next token 34-41% right, 0-2% wrong (greedy text: a random target's
# prompts are foreign text to it, where the right target can agree as rarely as a wrong one).
_SAMPLE_TOKENS = 128
_MIN_COSINE = 0.9


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


def check_target_produced(
    target: Any, hidden: torch.Tensor, token_ids: torch.Tensor, layer_ids: list[int], where: str
) -> dict[str, float]:
    """Refuse ``target`` unless it produced ``hidden`` (``[T, K, H]``, layers ``layer_ids``) from
    ``token_ids``: every id within its vocabulary, and its own forward on the first tokens giving the
    same layer states. Returns the figures: ``cosine`` (median over rows, the worst layer) and
    ``argmax_agreement`` (its head's argmax = the next token, on the sample; NaN without the last layer).

    Why the states and not only the argmax: a head's argmax agrees with the next token only where the
    target generated it (greedy) or is trained on the text; on a random target's sampled or foreign
    text the right target agrees as rarely as a wrong one. Re-computed states separate them always.

    Raises:
        InputError: a token id outside the vocabulary, or states the target does not reproduce.
    """
    from hscache.capture.forward import capture_batch

    vocab = target.vocab_size
    if int(token_ids.max()) >= vocab or int(token_ids.min()) < 0:
        raise InputError(
            f"--target {target.name} has a vocabulary of {vocab} ids, but {where} holds token id "
            f"{int(token_ids.max())}: it is not the target that produced the files; pass that one"
        )
    n = min(_SAMPLE_TOKENS, len(token_ids))
    ids = token_ids[:n].to(torch.int64)
    (captured,) = capture_batch(target, [ids.tolist()], layer_ids, top_k=1, full_logits=False)
    mine, theirs = captured.hidden_states.float().cpu(), hidden[:n].float()
    cosine = torch.nn.functional.cosine_similarity(mine, theirs, dim=-1)  # [n, K]
    worst = float(cosine.median(dim=0).values.min())
    agreement = float("nan")
    if layer_ids[-1] == target.num_layers - 1 and n > 1:  # argmax of row t predicts token t + 1
        agreement = float((captured.argmax[:-1].cpu() == ids[1:]).float().mean())
    if not worst >= _MIN_COSINE:
        argmax = "" if agreement != agreement else f"; its head's argmax is the next token at {agreement:.0%}"
        raise InputError(
            f"--target {target.name} did not produce these files: its layer states on the first {n} "
            f"tokens of {where} have cosine {worst:.2f} to the files' (the producing target gives > "
            f"{_MIN_COSINE}){argmax}; pass the target that produced them (or check --layer-ids)"
        )
    return {"cosine": round(worst, 4), "argmax_agreement": agreement}
