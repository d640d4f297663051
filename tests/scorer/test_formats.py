"""Every published DFlash drafter layout, built here with the exact key names and nesting.

SpecForge (`configs/qwen3.6-27b-dflash.json`, `{run}-stepN/training_state.pt`), speculators
(`speculators_model_type: dflash`, nested `transformer_layer_config`, reduced vocabulary), the
z-lab assistant layout (`encoder.fc`), and broken or hostile files (issue #14). No downloads.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scorer.errors import CheckpointError, UntrustedCheckpointError
from scorer.families.dflash.checkpoint import load_checkpoint
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter

H, V, L = 32, 100, 8  # hidden, target vocabulary, target layers


def _qwen3_fields(n_layers: int = 3) -> dict:
    """The Qwen3 part of a draft config, scaled down from SpecForge's qwen3.6-27b-dflash.json."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": 64,
        "layer_types": ["sliding_attention"] * (n_layers - 1) + ["full_attention"],
        "max_position_embeddings": 4096,
        "max_window_layers": n_layers,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "sliding_window": 8,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "vocab_size": V,
    }


def _specforge_config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 6,
        "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3, 5]},
        "num_target_layers": L,
        **_qwen3_fields(),
        "rope_theta": 10000000,
        "rope_scaling": None,
    }


def _weights(n_features: int = 3, n_layers: int = 3) -> dict[str, torch.Tensor]:
    config = DFlashConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        vocab_size=V, attention_bias=False, block_size=6, mask_token_id=99,
        target_layer_ids=tuple(range(n_features)),
    )  # fmt: skip
    torch.manual_seed(0)
    return {k: 0.2 * torch.randn_like(v) for k, v in DFlashDrafter(config).state_dict().items()}


# ---- SpecForge ---------------------------------------------------------------------------------
def _specforge_step_dir(tmp_path: Path) -> Path:
    step = tmp_path / "run7-step1200"
    step.mkdir()
    torch.save(
        {
            "draft_state_dict": _weights(),
            "global_step": 1200,
            "epoch": 0,
            "strategy": "dflash",
            "run_id": "run7",
            "world_size": 8,
            "replicated_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(3)}}},
            "dflash_draft_num_hidden_layers": 3,
            "dflash_target_layer_ids": (1, 3, 5),
            "dflash_block_size": 6,
            "dflash_mask_token_id": 99,
            "dflash_attention_backend": "flex_attention",
        },
        step / "training_state.pt",
    )
    torch.save({"optimizer": None, "rng": None}, step / "training_state_rank1.pt")
    return step


def test_specforge_step_dir_needs_the_draft_config_and_loads_the_qwen36_layout(tmp_path: Path) -> None:
    step = _specforge_step_dir(tmp_path)
    with pytest.raises(CheckpointError, match="holds the weights but no draft config .* pass --config"):
        load_checkpoint(step)
    (tmp_path / "draft.json").write_text(json.dumps(_specforge_config()))
    for path in (step, step / "training_state.pt"):
        loaded = load_checkpoint(path, config_path=tmp_path / "draft.json")
        c = loaded.config
        assert loaded.report.format == "specforge_training_state" and loaded.report.layout == "specforge"
        assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
        assert c.sliding_window == 8 and c.is_causal is None and c.layer_attention(0) == (True, 8)
        assert c.layer_attention(2) == (False, None)
        assert c.rope_theta == 1e7 and c.target_layer_ids == (1, 3, 5) and c.block_size == 6
        sources = loaded.report.field_sources
        assert sources["layer_types"] == "config_file" and sources["hidden_size"] == "config_file"
        assert sources["block_size"] == "config_file"  # the contract agrees; the config file wins


def test_specforge_contract_disagreeing_with_the_config_is_noted(tmp_path: Path) -> None:
    step = _specforge_step_dir(tmp_path)
    (tmp_path / "draft.json").write_text(json.dumps({**_specforge_config(), "block_size": 16}))
    loaded = load_checkpoint(step, config_path=tmp_path / "draft.json")
    assert loaded.config.block_size == 16
    assert "config_file block_size=16 replaced checkpoint value 6" in loaded.report.notes


# ---- speculators -------------------------------------------------------------------------------
def _speculators_dir(tmp_path: Path, draft_vocab: list[int] | None) -> Path:
    out = tmp_path / "spec"
    out.mkdir()
    layer_config = {**_qwen3_fields(), "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    del layer_config["tie_word_embeddings"]  # to_diff_dict leaves defaults out
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": V if draft_vocab is None else len(draft_vocab),
        "block_size": 6,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [2, 4, 6],
        "mask_token_id": 99,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = _weights()
    torch.manual_seed(5)
    weights["embed_tokens.weight"] = torch.randn(V, H)
    if draft_vocab is None:
        weights["lm_head.weight"] = torch.randn(V, H)
    else:
        selected = torch.tensor(draft_vocab)
        weights["lm_head.weight"] = torch.randn(len(draft_vocab), H)
        weights["d2t"] = selected - torch.arange(len(draft_vocab))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[selected] = True
        weights["t2d"] = t2d
    save_file(weights, out / "model.safetensors")
    return out


def test_speculators_config_is_read_from_its_nesting(tmp_path: Path) -> None:
    loaded = load_checkpoint(_speculators_dir(tmp_path, None))
    c = loaded.config
    assert loaded.report.layout == "speculators"
    assert c.rope_theta == 1e6  # from transformer_layer_config.rope_parameters, not a default
    assert c.target_layer_ids == (1, 3, 5)  # aux ids 2, 4, 6 are z-lab ids + 1
    assert c.block_size == 6 and c.mask_token_id == 99 and c.layer_attention(0) == (True, 8)
    assert set(loaded.head) == {"embed_tokens", "lm_head"} and "d2t" not in loaded.head
    assert loaded.report.warnings == ()


def test_speculators_reduced_vocabulary_drafts_in_target_ids(tmp_path: Path) -> None:
    draft_vocab = [0, 3, 4, 10, 11, 12, 40, 41, 77, 98]  # sorted target ids, as speculators stores them
    loaded = load_checkpoint(_speculators_dir(tmp_path, draft_vocab))
    assert loaded.head["lm_head"].shape == (len(draft_vocab), H)
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    drafter.attach_target(loaded.head["embed_tokens"], loaded.head["lm_head"], loaded.head["d2t"])
    hidden = torch.randn(5, 7, H)
    logits = drafter.head(hidden)  # [5, 7, V] over target ids
    draft_logits = hidden @ loaded.head["lm_head"].T  # [5, 7, Vd], independently
    want = torch.tensor(draft_vocab)[draft_logits.argmax(-1)]  # target id = d + d2t[d]
    assert torch.equal(logits.argmax(-1), want)
    lp = torch.log_softmax(logits, -1)
    others = torch.ones(V, dtype=torch.bool)
    others[draft_vocab] = False
    assert torch.isneginf(lp[..., others]).all()
    assert torch.allclose(lp[..., draft_vocab], torch.log_softmax(draft_logits, -1), atol=1e-6)


def test_speculators_inconsistent_vocabulary_is_refused(tmp_path: Path) -> None:
    out = _speculators_dir(tmp_path, [1, 2, 3])
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    weights["t2d"][50] = True
    save_file(weights, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="t2d and d2t disagree"):
        load_checkpoint(out)


# ---- z-lab assistant layout --------------------------------------------------------------------
def test_zlab_assistant_layout(tmp_path: Path) -> None:
    config = {  # tests/fixtures/assistant-config.json of z-lab/dflash, scaled down
        "architectures": ["MuseGlimmerAssistantModel"],
        "block_size": 6,
        "mask_token_id": 99,
        "model_type": "muse_glimmer_assistant",
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "target_layer_ids": [1, 3, 5],
        **{k: v for k, v in _qwen3_fields().items() if k not in ("use_sliding_window", "model_type")},
    }
    config["layer_types"] = ["sliding_attention"] * 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = _weights()
    weights["encoder.fc.weight"] = weights.pop("fc.weight")
    weights["encoder.output_norm_enc.weight"] = weights.pop("hidden_norm.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_checkpoint(tmp_path)
    c = loaded.config
    assert c.target_layer_ids == (1, 3, 5) and c.rope_theta == 5e5 and c.sliding_window == 8
    assert c.layer_attention(1) == (False, 8)  # this head is bidirectional in the block (MLX, vLLM)
    assert "encoder.fc. -> fc." in loaded.report.stripped_prefixes


# ---- warnings ----------------------------------------------------------------------------------
def test_config_fields_not_read_and_another_target_are_warned(tmp_path: Path) -> None:
    config = DFlashConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        vocab_size=V, attention_bias=False, block_size=6, mask_token_id=99, target_layer_ids=(1, 3, 5),
        num_target_layers=36,
    ).to_hf_config()  # fmt: skip
    config["text_config"] = {"rms_norm_eps": 1e-5}  # a nesting this reader does not know
    del config["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(_weights(), tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path, fallbacks={"rms_norm_eps": 1e-6, "num_target_layers": L})
    warnings = "\n".join(loaded.report.warnings)
    assert "config sets text_config.rms_norm_eps but it was not read" in warnings
    assert f"num_target_layers=36 (config) but the cache's target has {L} layers" in warnings


# ---- issue #14 items 1, 9, 15 ------------------------------------------------------------------
def test_config_less_pickle_must_name_its_block_size(tmp_path: Path) -> None:
    torch.save({"model": {"module." + k: v for k, v in _weights().items()}}, tmp_path / "d.pt")
    fallbacks = {"target_layer_ids": (1, 3, 5), "mask_token_id": 99, "vocab_size": V, "rope_theta": 1e4}
    with pytest.raises(CheckpointError, match=r"no config that sets block_size.*pass --block-size N"):
        load_checkpoint(tmp_path / "d.pt", fallbacks=fallbacks)
    loaded = load_checkpoint(tmp_path / "d.pt", fallbacks=fallbacks, overrides={"block_size": 8})
    assert loaded.config.block_size == 8 and loaded.report.field_sources["block_size"] == "override"


def test_random_bytes_are_not_a_checkpoint(tmp_path: Path) -> None:
    for name, data in (("garbage.pt", os.urandom(300)), ("proto.pt", b"\x80\x02" + os.urandom(300))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError, match=f"{name} is not a checkpoint") as info:
            load_checkpoint(tmp_path / name)
        assert not isinstance(info.value, UntrustedCheckpointError)


def _header(obj: dict) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text


BAD_SAFETENSORS = {
    "empty": b"",
    "header-too-large": struct.pack("<Q", 2**62) + b"{}",
    "header-past-end": struct.pack("<Q", 1000) + b"{}",
    "bad-json": struct.pack("<Q", 5) + b"{abc}",
    "offsets-past-end": _header({"fc.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    + b"\0" * 4,
    "truncated": None,  # a valid file cut short
}


@pytest.mark.parametrize("case", list(BAD_SAFETENSORS))
def test_corrupt_safetensors_is_one_line(tmp_path: Path, case: str) -> None:
    data = BAD_SAFETENSORS[case]
    if data is None:
        save_file(_weights(), tmp_path / "ok.safetensors")
        data = (tmp_path / "ok.safetensors").read_bytes()[:-100]
    (tmp_path / "d.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="d.safetensors is not a (valid )?safetensors file") as info:
        load_checkpoint(tmp_path / "d.safetensors")
    assert "\n" not in str(info.value)


def test_shard_index_naming_a_path_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    save_file(_weights(), outside)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_specforge_config()))
    for name in (str(outside), "../elsewhere.safetensors"):
        index = {"metadata": {}, "weight_map": {"fc.weight": name}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="names shard files outside the checkpoint directory"):
            load_checkpoint(ckpt)


def test_cli_corrupt_safetensors_exits_2_with_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from scorer.cli import main

    (tmp_path / "d.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    result = CliRunner().invoke(main, ["online", str(tmp_path / "d.safetensors"), "--limit", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("error: ") and "\n" not in result.output.strip()


def test_warnings_and_field_sources_reach_terminal_json_and_html(scorer_cache, trained_drafter, tmp_path):
    import shutil

    from click.testing import CliRunner

    from scorer.cli import main

    ckpt = tmp_path / "drafter"
    shutil.copytree(trained_drafter, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_target_layers"] = 36  # sized for another target than the cache's 8 layers
    (ckpt / "config.json").write_text(json.dumps(config))
    args = ["eval", str(ckpt), "--cache", str(scorer_cache), "--limit", "1", "--ddtree", ""]
    args += ["--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    warning = "num_target_layers=36 (config) but the cache's target has 8 layers"
    flat = " ".join(result.output.split())  # rich wraps long lines
    assert warning in flat and "block_size=6 (config)" in flat and "hidden_size=" in flat
    assert any(warning in w for w in json.loads((tmp_path / "r.json").read_text())["warnings"])
    assert warning.replace("'", "&#x27;") in (tmp_path / "r.html").read_text()
