"""Built-in targets that need no download: tiny random models of real architectures.

``builtin:tiny-qwen3.5`` is a ``Qwen3_5ForCausalLM`` (Gated DeltaNet linear attention with
a full-attention layer every 4th), ``builtin:tiny-qwen3`` a plain ``Qwen3ForCausalLM``.
Weights come from a fixed seed on the CPU, so every machine with the same torch builds the
same model; the tokenizer is a byte-level BPE trained in code on bundled text.
"""

from __future__ import annotations

import functools
from importlib import resources

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["BUILTIN_TARGETS", "MASK_TOKEN", "build_builtin", "build_tokenizer"]

MASK_TOKEN = "<|mask|>"
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
_TOKENIZER_VOCAB = 512
_SEED = 20260101
# Random init at std 0.02 collapses to one repeated token; 0.05 gives varied greedy text.
_INIT_STD = 0.05
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_TARGETS = ("builtin:tiny-qwen3.5", "builtin:tiny-qwen3")


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


def _config(name: str, vocab_size: int, eos_id: int):
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
    config = _config(name, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
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
