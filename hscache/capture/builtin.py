"""Built-in targets that need no download: tiny random models of real architectures.

``builtin:tiny-qwen3.5`` is a ``Qwen3_5ForCausalLM`` (Gated DeltaNet linear attention with
a full-attention layer every 4th) that also ships an MTP head (``mtp.*``, one full-attention
layer, as Qwen3.5/3.6 checkpoints do; see `builtin_mtp_weights`), ``builtin:tiny-qwen3`` a plain
``Qwen3ForCausalLM``.
Weights come from a fixed seed on the CPU, so every machine with the same torch builds the
same model; the tokenizer is a byte-level BPE trained in code on bundled text.
"""

from __future__ import annotations

import functools
from importlib import resources

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from hscache.capture import BUILTIN_TARGETS

__all__ = [
    "BUILTIN_TARGETS",
    "MASK_TOKEN",
    "build_builtin",
    "build_tokenizer",
    "builtin_config",
    "builtin_mtp_weights",
]

MASK_TOKEN = "<|mask|>"
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
_TOKENIZER_VOCAB = 512
_SEED = 20260101
# The MTP head has its own seed: the target's weights (and every number computed from them) are
# exactly what they were before the head existed. transformers' Qwen3_5 model ignores mtp.* keys.
_MTP_SEED = 20260102
_MTP_NORM_STD = 0.1  # norms (1 + w) are not left at identity: a wrong norm formula must show
# Random init at std 0.02 collapses to one repeated token; 0.05 gives varied greedy text.
_INIT_STD = 0.05
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    corpus_files = ("tokenizer_corpus.txt", "default_prompts.jsonl")
    lines: list[str] = []
    for name in corpus_files:
        lines += resources.files("hscache.data").joinpath(name).read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level BPE tokenizer, with a chat template and a mask token."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token=MASK_TOKEN,
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


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

        return Qwen3_5TextConfig(
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            mtp_num_hidden_layers=1,  # read by the MTP head (vLLM qwen3_5_mtp.py), not by transformers
            **common,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def build_builtin(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a built-in target in float32 on the CPU, identical on every machine.

    Raises:
        KeyError: ``name`` is not one of BUILTIN_TARGETS.
    """
    if name not in BUILTIN_TARGETS:
        raise KeyError(name)
    tokenizer = build_tokenizer()
    config = builtin_config(name, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
    if name == "builtin:tiny-qwen3.5":
        from transformers import Qwen3_5ForCausalLM as model_cls
    else:
        from transformers import Qwen3ForCausalLM as model_cls
    # fork_rng keeps the caller's global RNG untouched: building a target is not a side effect.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = model_cls(config)
    model.generation_config.do_sample = False
    return model.eval(), tokenizer


def builtin_mtp_weights(config) -> dict[str, torch.Tensor]:
    """The seeded ``mtp.*`` tensors of ``builtin:tiny-qwen3.5``, named as in a Qwen3.5 checkpoint.

    ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and
    ``mtp.layers.0.*``: a decoder layer of the target's full-attention kind (gated attention,
    q/k norms, partial rotary), its parameter names taken from transformers' own layer so they are
    the checkpoint's. float32 on the CPU; the same on every machine with the same torch.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    full = list(config.layer_types).index("full_attention")
    with torch.device("meta"):  # shapes only: no weights built, no RNG drawn
        layer = Qwen3_5DecoderLayer(config, full)
    shapes = {
        f"layers.{n}.{k}": v.shape
        for n in range(config.mtp_num_hidden_layers)
        for k, v in layer.state_dict().items()
    }
    H = config.hidden_size
    shapes.update(
        {
            "fc.weight": torch.Size([H, 2 * H]),
            "norm.weight": torch.Size([H]),
            "pre_fc_norm_embedding.weight": torch.Size([H]),
            "pre_fc_norm_hidden.weight": torch.Size([H]),
        }
    )
    gen = torch.Generator().manual_seed(_MTP_SEED)
    out = {}
    for name in sorted(shapes):
        std = _MTP_NORM_STD if len(shapes[name]) == 1 else _INIT_STD
        out[f"mtp.{name}"] = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std
    return out
