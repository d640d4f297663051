"""Loading real layouts from local Hugging Face directories the tests write."""

from __future__ import annotations

import pytest
import torch

import hscache
from hscache.capture.builtin import build_builtin, build_tokenizer
from hscache.capture.layers import dflash_layer_ids, parse_layer_spec
from hscache.capture.target import load_target


def test_dflash_rule_matches_the_released_drafters():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_layer_ids(36, 1) == [18]
    assert parse_layer_spec("dflash:3", 8) == [1, 3, 5]
    assert parse_layer_spec(" 5, 0 ,2", 8) == [5, 0, 2]  # the user's order is kept


def test_builtin_targets_are_deterministic():
    a, _ = build_builtin("builtin:tiny-qwen3.5")
    b, _ = build_builtin("builtin:tiny-qwen3.5")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert (
        load_target("builtin:tiny-qwen3.5").weights_sha256
        == load_target("builtin:tiny-qwen3.5").weights_sha256
    )


def test_plain_qwen3_directory_extracts_like_the_builtin(tmp_path):
    model, tokenizer = build_builtin("builtin:tiny-qwen3")
    model.save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    common = dict(layers="1,4,6", max_new_tokens=6, dtype="fp32", limit=2)
    hscache.extract(hscache.ExtractConfig(out=str(tmp_path / "a"), model=str(tmp_path / "qwen3"), **common))
    hscache.extract(hscache.ExtractConfig(out=str(tmp_path / "b"), model="builtin:tiny-qwen3", **common))
    a, b = hscache.open_cache(tmp_path / "a"), hscache.open_cache(tmp_path / "b")
    assert a.provenance["model"]["architecture"] == "Qwen3ForCausalLM"
    assert a.provenance["model"]["layer_types"] == ["full_attention"] * 8
    assert a.provenance["capture"]["kernels"] == {}  # no linear-attention layers at all
    for i in range(2):
        assert torch.equal(a.token_ids(i), b.token_ids(i))
        assert torch.equal(a.hidden_states(i), b.hidden_states(i))


def _tiny_multimodal(path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from hscache.capture.builtin import builtin_config

    tokenizer = build_tokenizer()
    text = builtin_config("builtin:tiny-qwen3.5", len(tokenizer), tokenizer.eos_token_id).to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=128,
        patch_size=4,
        spatial_merge_size=1,
        temporal_patch_size=1,
    )
    torch.manual_seed(1)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_multimodal_wrapper_layout_captures_the_language_model_layers(tmp_path):
    model = _tiny_multimodal(tmp_path / "vl")
    hscache.extract(
        hscache.ExtractConfig(
            out=str(tmp_path / "c"),
            model=str(tmp_path / "vl"),
            layers="0,3,5",
            max_new_tokens=4,
            dtype="fp32",
            limit=2,
        )
    )
    cache = hscache.open_cache(tmp_path / "c")
    assert cache.provenance["model"]["layer_path"] == "model.language_model.layers"
    assert cache.provenance["model"]["architecture"] == "Qwen3_5ForConditionalGeneration"
    with torch.no_grad():
        out = model(input_ids=cache.token_ids(0)[None], output_hidden_states=True)
    for k, layer_id in enumerate([0, 3, 5]):
        torch.testing.assert_close(
            cache.hidden_states(0)[:, k], out.hidden_states[layer_id + 1][0], rtol=0, atol=0
        )
    head = cache.target_head()
    assert torch.equal(head["lm_head"], model.get_output_embeddings().weight)  # untied: stored apart
    assert not torch.equal(head["lm_head"], head["embed_tokens"])


def test_directory_without_weights_gives_a_clear_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}'
    )
    with pytest.raises(hscache.ModelNotFoundError, match="cannot load a model from"):
        load_target(str(tmp_path / "m"))
