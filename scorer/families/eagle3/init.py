"""Write EAGLE-3 drafters in each published layout (tests, docs, `scorer init --family eagle3`).

``save_eagle3`` writes what each trainer writes: speculators' ``Eagle3Speculator`` directory
(config.json with ``transformer_layer_config`` + model.safetensors, ``layers.0.*``, vLLM aux ids),
SpecForge's ``LlamaForCausalLMEagle3`` export (flat config.json + model.safetensors, ``midlayer.*``,
SGLang ids under ``eagle_config``), or the original release (config.json + pytorch_model.bin).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import hscache
from hscache.store.fsio import atomic_write_with
from hscache.store.view import CacheView
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.errors import IncompatibleCacheError
from scorer.families.base import check_new_drafter_sizes
from scorer.families.eagle3.config import Eagle3Config, new_drafter_layer_ids, vllm_aux_ids
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.layers import seeded_init
from scorer.offline.sequences import check_has_target, layer_fit_problem
from scorer.target_identity import IDENTITY_KEY, cache_target_identity

__all__ = ["EAGLE3_LAYOUTS", "eagle3_config_for_cache", "init_eagle3", "save_eagle3"]

EAGLE3_LAYOUTS = ("speculators", "specforge", "eagle_release")


def eagle3_config_for_cache(
    cache: CacheView,
    *,
    layer_ids: list[int] | None = None,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    num_speculative_tokens: int = 3,
    qk_norm: bool = True,
    layout: str = "speculators",
    **options: Any,
) -> Eagle3Config:
    """An EAGLE-3 config sized for the cache's target (default layers: the engines' default where its
    layers are distinct, else distinct ones: ``new_drafter_layer_ids``);
    ``options`` set any other Eagle3Config field (fc_norm, norm_before_residual, ...)."""
    check_has_target(cache, str(cache.path))
    check_new_drafter_sizes(cache, num_layers=num_layers, num_speculative_tokens=num_speculative_tokens)
    target = cache.target_config
    hidden = int(target["hidden_size"])
    heads = int(target.get("num_attention_heads", max(1, hidden // 64)))
    rope = target.get("rope_parameters") or {}
    n_layers = int(target["num_hidden_layers"])
    if layer_ids is None:
        try:
            layer_ids = new_drafter_layer_ids(n_layers)
        except ValueError as exc:
            raise IncompatibleCacheError(f"{cache.path}: {exc}; choose a deeper target") from exc
    elif len(set(layer_ids)) != len(layer_ids):
        raise IncompatibleCacheError(
            f"target layers {list(layer_ids)} repeat a layer, which vLLM 0.32.0 loads and then fails on at its "
            "first forward (fc expects one state per layer): pass distinct layers"
        )
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(target.get("intermediate_size", 4 * hidden)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target.get("num_key_value_heads", heads)),
        head_dim=int(target.get("head_dim") or hidden // heads),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=float(target.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=None,
        vocab_size=cache.vocab_size,
        draft_vocab_size=draft_vocab_size or cache.vocab_size,
        target_layer_ids=tuple(layer_ids),
        num_speculative_tokens=num_speculative_tokens,
        qk_norm=qk_norm if layout == "speculators" else False,
        layout=layout,
        max_position_embeddings=int(target.get("max_position_embeddings") or 4096),
        **options,
    )


def _decoder_json(c: Eagle3Config, model_type: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        # vLLM builds the decoder layer's rope table from it (vllm 0.32.0 models/qwen3.py:205); the
        # speculators layout's transformer_layer_config is read as a bare config, so no default fills it.
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _config_json(c: Eagle3Config, layout: str) -> dict[str, Any]:
    if layout == "speculators":
        return {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": _decoder_json(c, "qwen3" if c.qk_norm else "llama"),
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": c.norm_before_fc,
            "fc_norm": c.fc_norm,
            "norm_output": c.norm_output,
            "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(c.target_layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": c.num_speculative_tokens}
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            },
        }
    if c.qk_norm or c.norm_before_fc or c.norm_output or c.norm_before_residual:
        raise ValueError(
            f"the {layout} layout cannot express qk_norm / norm_before_fc / norm_output / norm_before_residual"
        )
    out = {**_decoder_json(c, "llama"), "architectures": ["LlamaForCausalLMEagle3"]}
    out["draft_vocab_size"] = c.draft_vocab_size
    if c.fc_norm:
        out["fc_norm"] = True
    if layout == "specforge":
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids)}  # SGLang ids
        # vLLM reads eagle_config's ids as its own aux ids (one layer lower than SGLang does) unless a
        # top-level key, which it reads first and SGLang never reads, says otherwise: with it both
        # engines serve the drafter on the layers it was trained on (docs/families.md).
        out["eagle_aux_hidden_state_layer_ids"] = vllm_aux_ids(c.target_layer_ids)
    return out


def save_eagle3(
    directory: str | Path,
    config: Eagle3Config,
    state_dict: dict[str, torch.Tensor],
    *,
    layout: str = "speculators",
    embed_tokens: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    extra_config: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``layout`` to ``directory``: config.json and the weights file that layout uses;
    ``extra_config`` adds keys to config.json (e.g. the target identity, scorer/target_identity.py).

    Raises:
        ValueError: an unknown layout, or a config the layout cannot express.
    """
    if layout not in EAGLE3_LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}; choose one of {', '.join(EAGLE3_LAYOUTS)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    if layout != "speculators":
        tensors = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()
        }
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.detach().cpu().contiguous().clone()
    if config.draft_vocab_size < config.vocab_size:
        # A reduced vocabulary ships its map; the full one ships none, as speculators' Eagle3 model
        # holds no d2t/t2d then (models' _init_vocab: buffers only when use_draft_vocab) and vLLM
        # refuses one ("no module or parameter named 'draft_id_to_target_id'": vllm 0.32.0
        # qwen3_eagle3.py:318 and llama_eagle3.py:340 make the parameter only for a reduced vocabulary).
        offsets = torch.zeros(config.draft_vocab_size, dtype=torch.long) if d2t is None else d2t.long().cpu()
        tensors["d2t"] = offsets
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(config.draft_vocab_size) + offsets] = True
        tensors["t2d"] = t2d
    elif d2t is not None and bool(d2t.any()):
        raise ValueError("d2t maps a full draft vocabulary to other ids; a full vocabulary has no map")
    text = json.dumps({**_config_json(config, layout), **(extra_config or {})}, indent=2)
    written = [atomic_write_with(out / "config.json", lambda p: p.write_text(text))]
    if layout == "eagle_release":
        written.append(atomic_write_with(out / "pytorch_model.bin", lambda p: torch.save(tensors, p)))
    else:
        written.append(
            atomic_write_with(
                out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
            )
        )
    return written


def init_eagle3(
    cache_path: str | Path,
    out: str | Path,
    *,
    layout: str = "speculators",
    seed: int = 0,
    draft_vocab_size: int | None = None,
    overwrite: bool = False,
    **config_options: Any,
) -> tuple[Eagle3Config, Eagle3Drafter]:
    """A random EAGLE-3 drafter for the cache's target, written in ``layout`` at ``out`` (whole, as
    scorer/drafter_dir.py publishes drafters: a non-empty ``out`` needs ``overwrite``).

    With ``draft_vocab_size`` below the target's, the draft vocabulary is every other target id
    from 0 (a deterministic reduced vocabulary, d2t/t2d written as speculators writes them).
    """
    check_drafter_dir(out, overwrite)
    cache = hscache.open_cache(cache_path)
    config = eagle3_config_for_cache(
        cache, draft_vocab_size=draft_vocab_size, layout=layout, **config_options
    )
    # a layer the cache lacks: refused here, as training refuses it and eval would
    if layers := layer_fit_problem(config.target_layer_ids, cache, str(cache_path), what="target layers"):
        raise IncompatibleCacheError(layers)
    # Norms near 1, but not exactly, so a swapped norm shows in the numbers.
    drafter = seeded_init(lambda: Eagle3Drafter(config), seed, std=0.05, norm_range=(0.8, 1.2))
    d2t = None
    if config.draft_vocab_size < config.vocab_size:
        ids = torch.arange(config.draft_vocab_size) * (config.vocab_size // config.draft_vocab_size)
        d2t = ids - torch.arange(config.draft_vocab_size)
    publish_eagle3(out, overwrite, cache, config, drafter.state_dict(), layout, d2t)
    return config, drafter


def publish_eagle3(
    out: str | Path,
    overwrite: bool,
    cache: CacheView,
    config: Eagle3Config,
    state_dict: dict[str, torch.Tensor],
    layout: str,
    d2t: torch.Tensor | None = None,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Write a drafter made for ``cache`` whole at ``out`` in ``layout`` (scorer/drafter_dir.py),
    the target's embedding beside it and the cache's target recorded (scorer/target_identity.py);
    ``extra_config``: more config.json entries (a trained drafter's steps, scorer/training_stop.py;
    keys a family built on EAGLE-3 adds or changes)."""
    with staged_drafter_dir(out, overwrite) as staging:
        save_eagle3(
            staging,
            config,
            state_dict,
            layout=layout,
            embed_tokens=cache.target_head()["embed_tokens"],
            d2t=d2t,
            extra_config={**(extra_config or {}), IDENTITY_KEY: cache_target_identity(cache)},
        )
