"""EAGLE-3 drafter configuration and its mapping from each published layout's config.

Layouts (spec/families.md "EAGLE-3"):
- speculators ``Eagle3Speculator`` (``speculators_model_type: eagle3``): decoder fields nested in
  ``transformer_layer_config`` (a Qwen3Config unless its ``model_type`` says otherwise), target
  layers as vLLM aux ids ``eagle_aux_hidden_state_layer_ids`` (id k = output of decoder layer k-1;
  default ``[2, L // 2, L - 3]``, speculators ``models/utils.py resolve_target_layer_ids``), the
  default K in ``speculators_config.proposal_methods[*].speculative_tokens``.
- SpecForge ``LlamaForCausalLMEagle3`` (HF export, training checkpoints) and the original EAGLE-3
  release (``yuhuili/EAGLE3-*``, same class name): a flat LlamaConfig plus ``draft_vocab_size``;
  layer ids, when given, in ``eagle_config.eagle_aux_hidden_state_layer_ids`` counted as SGLang's
  ``set_eagle3_layers_to_capture`` counts them (id i = output of decoder layer i, SGLang adds the
  +1 itself); default ``[1, L // 2 - 1, L - 4]`` (SpecForge ``resolve_eagle_capture_layers``).

This project's layer ids are the OUTPUT of decoder layer i (``hscache extract --layers``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scorer.config_numbers import check_config_numbers
from scorer.families.base import DecoderDims

__all__ = [
    "ENGINE_DEFAULT_K",
    "ENGINE_DEFAULT_K_SOURCE",
    "NEMO_ARCHITECTURE",
    "SGLANG_DEFAULT_TREE",
    "Eagle3Config",
    "default_layer_ids",
    "new_drafter_layer_ids",
    "from_hf_eagle3",
    "from_speculators",
    "layers_of_vllm_aux_ids",
    "vllm_aux_ids",
    "is_eagle3_config",
]

# vLLM has no default K (num_speculative_tokens is required unless a speculators config supplies
# it); 3 is what speculators writes into speculators_config when it converts a checkpoint that has
# none (convert/eagle/eagle3_converter.py: GreedyTokenProposalConfig(speculative_tokens=3)).
ENGINE_DEFAULT_K = 3
ENGINE_DEFAULT_K_SOURCE = "default (speculators' converter writes speculative_tokens=3; vLLM needs one)"
# SGLang's auto_choose_speculative_params (server_args.py) for every non-DeepSeek target:
# --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8.
SGLANG_DEFAULT_TREE = (5, 4, 8)
HF_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Qwen3ForCausalLMEagle3")
# NeMo Automodel 0.7's EAGLE-3 draft class (components/speculative/eagle/draft_llama.py): a flat config (the
# target's, plus draft_vocab_size, target_hidden_size, fc_norm, norm_output, parallel_drafting), weights under
# ``model.``; its serve_vllm.py rewrites the architecture to LlamaForCausalLMEagle3 for vLLM.
NEMO_ARCHITECTURE = "LlamaEagle3DraftModel"
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")


@dataclass(frozen=True)
class Eagle3Config(DecoderDims):
    """Architecture of an EAGLE-3 drafter (vLLM ``llama_eagle3.py`` / speculators ``Eagle3DraftModel``).

    ``target_layer_ids`` are this project's ids. ``qk_norm`` is the Qwen3 decoder layer (q/k RMSNorm
    per head); Llama layers have none. ``block_size`` = K + 1 is the report's slot count.
    """

    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_speculative_tokens: int
    target_hidden_size: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # speculators: one RMSNorm over the concatenated features (input_norm)
    fc_norm: bool = False  # speculators / SpecForge: one RMSNorm per feature before fc
    norm_output: bool = False  # speculators Eagle 3.1: feed the post-norm state back across steps
    layout: str = "speculators"
    # The decoder config's rope-table length: vLLM's Qwen3 decoder layer reads it with no default
    # (vllm 0.32.0 models/qwen3.py:205; llama.py:266 defaults to 8192); it does not change the math.
    max_position_embeddings: int = 4096
    # The target layers vLLM feeds the drafter where they are not ``target_layer_ids`` (the layers it
    # was trained on, which SGLang feeds): a SpecForge-layout config whose ids only
    # ``eagle_config`` gives, which vLLM reads one layer lower (``from_hf_eagle3``). None: the same.
    vllm_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_config_numbers({f: getattr(self, f) for f in self.__dataclass_fields__}, "EAGLE-3 config")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.vllm_layer_ids is not None:
            vllm = tuple(int(i) for i in self.vllm_layer_ids)
            object.__setattr__(self, "vllm_layer_ids", None if vllm == self.target_layer_ids else vllm)
        self.check_attention_heads()
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size {self.vocab_size}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive (speculators refuses both)")
        if self.rope_scaling is not None and self.rope_type not in ("default", "linear"):
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: default, linear"
            )

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def feature_size(self) -> int:
        """Width of one target feature (the target's hidden size)."""
        return self.target_hidden_size or self.hidden_size

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def block_size(self) -> int:
        """Slots of one round as the shared report counts them: K drafted tokens + the known token."""
        return self.num_speculative_tokens + 1

    def layer_ids_served_by(self, engine: str) -> tuple[int, ...]:
        """The target layers ``engine`` ("vllm": its chain; "sglang": its tree) feeds this drafter."""
        if engine == "vllm" and self.vllm_layer_ids is not None:
            return self.vllm_layer_ids
        return self.target_layer_ids

    def to_hf_config(self) -> dict[str, Any]:
        """The report's ``drafter`` block: every field, plus the family."""
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        if self.vllm_layer_ids is None:
            del out["vllm_layer_ids"]  # the common case: reports stay as they were
        else:
            out["vllm_layer_ids"] = list(self.vllm_layer_ids)
        out["architectures"] = ["Eagle3"]
        return out


def vllm_aux_ids(layer_ids: Any) -> list[int]:
    """This project's layer ids (id i = output of decoder layer i) as vLLM's and speculators' aux ids
    ``eagle_aux_hidden_state_layer_ids`` (id k = output of decoder layer k-1)."""
    return [int(i) + 1 for i in layer_ids]


def layers_of_vllm_aux_ids(aux_ids: Any) -> tuple[int, ...]:
    """vLLM's aux ids as this project's layer ids: the inverse of ``vllm_aux_ids``."""
    return tuple(int(i) - 1 for i in aux_ids)


def default_layer_ids(num_target_layers: int) -> list[int]:
    """vLLM/speculators/SGLang/SpecForge's shared default, in this project's ids: [1, L//2 - 1, L - 4]."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def new_drafter_layer_ids(num_target_layers: int) -> list[int]:
    """The layers a NEW drafter reads (``scorer init``): the engines' default where its three layers are
    distinct, else three distinct layers spread as it spreads them (early, middle, late; the last layer
    kept out while the target has room). The default repeats a layer below 7 layers (6: [1, 2, 2], vLLM aux
    ids [2, 3, 3]), which vLLM 0.32.0 loads and then fails on at its first forward (fc's input is 3 x H
    wide, the states it gets 2 x H: ``shape '[-1, 384]' is invalid``, _custom_ops.py onednn_mm).

    Raises:
        ValueError: fewer than 3 target layers (an EAGLE-3 drafter reads three distinct ones).
    """
    if num_target_layers < 3:
        raise ValueError(
            f"the target has {num_target_layers} layer(s); an EAGLE-3 drafter reads 3 distinct target layers"
        )
    ids = default_layer_ids(num_target_layers)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    lo = 1 if num_target_layers >= 4 else 0
    hi = num_target_layers - 2 if num_target_layers - 2 - lo >= 2 else num_target_layers - 1
    return [lo, (lo + hi) // 2, hi]


def is_eagle3_config(config: dict[str, Any] | None) -> bool:
    """A config any of the EAGLE-3 layouts wrote."""
    if not config:
        return False
    kind = config.get("speculators_model_type")
    if kind is not None:  # a speculators config says which algorithm it holds (its architectures may not)
        return kind == "eagle3"
    archs = config.get("architectures") or []
    return any(a in HF_ARCHITECTURES or a in SPECULATORS_ARCHITECTURES for a in archs)


def _rope(cfg: dict[str, Any]) -> tuple[float | None, dict | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        scaling = rest if rest.get("rope_type", "default") != "default" else None
    if scaling is not None and str(scaling.get("rope_type", scaling.get("type", "default"))) == "default":
        scaling = None
    return theta, scaling


def _refusals(cfg: dict[str, Any], where: str) -> list[str]:
    """Keys of a decoder config that change the math and are not implemented, each by name."""
    problems = []
    types = cfg.get("layer_types") or []
    if "sliding_attention" in types or cfg.get("use_sliding_window"):
        problems.append(f"{where}layer_types/use_sliding_window (sliding-window EAGLE-3 layers)")
    partial = cfg.get(
        "partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    )
    if partial not in (None, 1, 1.0):
        problems.append(f"{where}partial_rotary_factor={partial!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}hidden_act={cfg['hidden_act']!r}")
    if cfg.get("logit_scale", 1.0) not in (1, 1.0, None):
        problems.append(f"{where}logit_scale={cfg['logit_scale']!r}")
    return problems


def _decoder_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    return {
        "hidden_size": int(cfg["hidden_size"]),
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_hidden_layers": int(cfg.get("num_hidden_layers", 1)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta if theta is not None else 10000.0),
        "rope_scaling": scaling,
        "vocab_size": int(cfg["vocab_size"]),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096),
    }


def from_speculators(
    config: dict[str, Any], num_target_layers: int | None
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(Eagle3Config fields, field sources, notes) of a speculators Eagle3Speculator config.

    Raises:
        ValueError: an option that changes the math and is not implemented (named), or no way to
            tell the target layers.
    """
    from transformers import AutoConfig

    layer = dict(config.get("transformer_layer_config") or {})
    model_type = layer.pop("model_type", "qwen3")
    if model_type not in ("qwen3", "llama"):
        raise ValueError(
            f"transformer_layer_config.model_type {model_type!r} is not supported (llama, qwen3)"
        )
    # speculators builds AutoConfig.for_model(model_type)(**layer) from a diff dict: fill the defaults.
    filled = AutoConfig.for_model(model_type, **layer).to_dict()
    problems = _refusals(filled, "transformer_layer_config.")
    if problems:
        raise ValueError(f"unsupported EAGLE-3 option(s): {'; '.join(problems)}")
    fields = _decoder_fields(filled)
    sources = {name: "config (transformer_layer_config)" for name in fields}
    notes = [
        f"speculators Eagle3Speculator, {model_type} decoder layer (defaults of its config class filled)"
    ]
    fields["qk_norm"] = model_type == "qwen3"
    fields["draft_vocab_size"] = int(config.get("draft_vocab_size", 32000))
    sources["draft_vocab_size"] = "config" if "draft_vocab_size" in config else "default (speculators 32000)"
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        fields[key] = bool(config.get(key, False))
        sources[key] = "config" if key in config else "default (speculators False)"
    if config.get("norm_output"):
        notes.append(
            "norm_output (Eagle 3.1): the post-norm state is fed back across steps, as speculators "
            "defines it; vLLM's llama_eagle3.py (read at 00bd149) always returns hidden_prenorm"
        )
    if config.get("target_hidden_size") is not None:
        fields["target_hidden_size"] = int(config["target_hidden_size"])
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        fields["target_layer_ids"] = layers_of_vllm_aux_ids(aux)
        sources["target_layer_ids"] = "config (eagle_aux_hidden_state_layer_ids, vLLM ids - 1)"
        notes.append(
            f"eagle_aux_hidden_state_layer_ids {list(aux)} are vLLM aux ids (id k = output of layer "
            f"k-1): target layers {list(layers_of_vllm_aux_ids(aux))}"
        )
    elif num_target_layers is not None:
        fields["target_layer_ids"] = tuple(default_layer_ids(num_target_layers))
        sources["target_layer_ids"] = "default (speculators [2, L//2, L-3] vLLM ids, L from the cache)"
    k = _speculators_k(config)
    if k is not None:
        fields["num_speculative_tokens"] = k
        sources["num_speculative_tokens"] = "config (speculators_config.proposal_methods speculative_tokens)"
    fields["layout"] = "speculators"
    return fields, sources, notes


def _speculators_k(config: dict[str, Any]) -> int | None:
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    for method in methods:
        if isinstance(method, dict) and (default is None or method.get("proposal_type") == default):
            if method.get("speculative_tokens") is not None:
                return int(method["speculative_tokens"])
    return None


def from_hf_eagle3(
    config: dict[str, Any], num_target_layers: int | None, layout: str
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(fields, sources, notes) of a SpecForge / original-release ``LlamaForCausalLMEagle3`` config (and of
    SpecForge's ``PEagleDraftModel``, the same flat LlamaConfig).

    Raises:
        ValueError: an option that changes the math and is not implemented, named.
    """
    problems = _refusals(config, "")
    nemo = NEMO_ARCHITECTURE in (config.get("architectures") or [])
    if config.get("model_type", "llama") not in ("llama", "qwen3"):
        problems.append(f"model_type={config.get('model_type')!r}")
    if config.get("norm_output") is False and not nemo:  # NeMo's False is EAGLE-3's normed head
        # SpecForge's norm_output=False projects the UN-normed state (compute_logits); vLLM always norms.
        problems.append("norm_output=False (SpecForge: lm_head on the un-normed state; vLLM norms it)")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        problems.append("eagle_config.use_aux_hidden_state=False (EAGLE-1 style input)")
    if problems:
        raise ValueError(f"unsupported EAGLE-3 option(s): {'; '.join(problems)}")
    fields = _decoder_fields(config)
    sources = {name: "config" for name in fields}
    # NeMo's draft carries the target's model_type but has no q/k norm (Eagle3LlamaAttention), and NeMo's
    # vLLM export serves it as LlamaForCausalLMEagle3 (llama_eagle3.py, none either).
    fields["qk_norm"] = config.get("model_type", "llama") == "qwen3" and not nemo
    fields["draft_vocab_size"] = int(config.get("draft_vocab_size") or fields["vocab_size"])
    sources["draft_vocab_size"] = "config" if config.get("draft_vocab_size") else "vocab_size (not reduced)"
    fields["fc_norm"] = bool(config.get("fc_norm", False))
    sources["fc_norm"] = "config" if "fc_norm" in config else "default (False)"
    # vLLM reads both from a flat config too (llama_eagle3.py:101 norm_before_residual; :184-188
    # norm_before_fc, eagle_config's first); SpecForge's PEagleDraftModel writes norm_before_residual.
    fields["norm_before_residual"] = bool(config.get("norm_before_residual", False))
    sources["norm_before_residual"] = "config" if "norm_before_residual" in config else "default (False)"
    fields["norm_before_fc"] = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    sources["norm_before_fc"] = (
        "config" if "norm_before_fc" in eagle or "norm_before_fc" in config else "default (False)"
    )
    if config.get("target_hidden_size") is not None:
        fields["target_hidden_size"] = int(config["target_hidden_size"])
    notes = [f"{layout} {_architecture(config)} layout ({fields['num_hidden_layers']} decoder layer(s))"]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        fields["target_layer_ids"] = tuple(int(i) for i in ids)
        sources["target_layer_ids"] = "config (eagle_config.eagle_aux_hidden_state_layer_ids, SGLang ids)"
    elif num_target_layers is not None:
        fields["target_layer_ids"] = tuple(default_layer_ids(num_target_layers))
        sources["target_layer_ids"] = "default ([1, L//2-1, L-4], SpecForge/EAGLE, L from the cache)"
    vllm, why = _vllm_reading(config.get("eagle_aux_hidden_state_layer_ids"), ids)
    if vllm is not None and vllm != fields.get("target_layer_ids"):
        # Found by the vLLM judge (docs/families.md): vLLM and SGLang feed this drafter other layers.
        fields["vllm_layer_ids"] = vllm
        trained = list(fields.get("target_layer_ids", ()))
        notes.append(
            f"vllm 0.32.0 serves this drafter on target layers {list(vllm)} ({why}; "
            f"v1/worker/gpu_model_runner.py:5268-5283), SGLang on {trained}: the chain (vLLM) is replayed "
            f"on {list(vllm)}, the SGLang tree on {trained}. To serve it in vLLM on {trained}, add a "
            f'top-level "eagle_aux_hidden_state_layer_ids": {vllm_aux_ids(trained)} to its '
            "config.json (vLLM reads it first; SGLang reads only eagle_config's)"
        )
    fields["layout"] = layout
    return fields, sources, notes


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else "LlamaForCausalLMEagle3"


def _vllm_reading(top_level: Any, eagle_config_ids: Any) -> tuple[tuple[int, ...] | None, str]:
    """(the layers vLLM 0.32.0 feeds a LlamaForCausalLMEagle3 config's drafter, why); None: the target's
    default, the same as SGLang's. vLLM (v1/worker/gpu_model_runner.py:5268-5283) reads a top-level
    ``eagle_aux_hidden_state_layer_ids`` first, else ``eagle_config``'s, both as its own aux ids (id k =
    output of layer k-1), while SGLang reads only ``eagle_config``'s, as id i = output of layer i."""
    if top_level:
        why = f"its top-level eagle_aux_hidden_state_layer_ids {list(top_level)}"
        return layers_of_vllm_aux_ids(top_level), why
    if eagle_config_ids:
        return (
            layers_of_vllm_aux_ids(eagle_config_ids),
            f"it reads eagle_config.eagle_aux_hidden_state_layer_ids {list(eagle_config_ids)} without "
            "SGLang's +1",
        )
    return None, ""
