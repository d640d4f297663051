"""Checkpoint loading: every format to the same weights, shape inference, pickle safety, errors."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scorer.errors import CheckpointError, CheckpointNotFoundError, UntrustedCheckpointError
from scorer.families.dflash.checkpoint import LoadedCheckpoint, load_checkpoint, save_hf_checkpoint
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter

SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
)


def _config(**changes) -> DFlashConfig:
    base = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=100,
        attention_bias=False,
        block_size=4,
        mask_token_id=99,
        target_layer_ids=(1, 3),
    )
    return dataclasses.replace(base, **changes)


def _overrides(config: DFlashConfig) -> dict:
    """What a caller supplies for a checkpoint without config: everything shapes cannot tell."""
    return {
        k: getattr(config, k)
        for k in (
            "target_layer_ids",
            "block_size",
            "mask_token_id",
            "rope_theta",
            "vocab_size",
            "rms_norm_eps",
        )
    }


def _weights(config: DFlashConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: torch.randn_like(v).to(dtype) for k, v in DFlashDrafter(config).state_dict().items()}


def _assert_same_weights(loaded: LoadedCheckpoint, weights: dict[str, torch.Tensor]) -> None:
    assert loaded.state_dict.keys() == weights.keys()
    for key, tensor in weights.items():
        got = loaded.state_dict[key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    DFlashDrafter(loaded.config).load_state_dict(loaded.state_dict, strict=True)


class _Payload:
    """Pickles to a call that creates `marker`: harmless, but proves code ran at load time."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_hf_directory_round_trips(tmp_path: Path) -> None:
    config, weights = _config(attention_bias=True), _weights(_config(attention_bias=True), torch.bfloat16)
    save_hf_checkpoint(tmp_path / "hf", config, weights)
    loaded = load_checkpoint(tmp_path / "hf")
    assert loaded.config == config
    _assert_same_weights(loaded, weights)
    report = loaded.report
    assert report.format == "hf_dir" and set(report.file_sha256) == {"config.json", "model.safetensors"}
    assert all(source == "config" for name, source in report.field_sources.items() if name in SHAPE_FIELDS)
    assert report.stripped_prefixes == () and report.dropped_keys == ()
    json.dumps(report.to_dict())  # manifest-ready


def test_sharded_hf_directory_loads_the_same_weights(tmp_path: Path) -> None:
    config, weights = _config(), _weights(_config())
    written = save_hf_checkpoint(tmp_path / "hf", config, weights, max_shard_bytes=20_000)
    shards = [p.name for p in written if p.name.startswith("model-")]
    assert len(shards) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    loaded = load_checkpoint(tmp_path / "hf")
    assert loaded.report.format == "hf_dir_sharded" and loaded.config == config
    _assert_same_weights(loaded, weights)
    plain = load_checkpoint(_saved_unsharded(tmp_path, config, weights))
    assert plain.report.weights_sha256 == loaded.report.weights_sha256
    assert plain.report.sha256 != loaded.report.sha256  # file hashes follow the container


def _saved_unsharded(tmp_path: Path, config: DFlashConfig, weights: dict) -> Path:
    save_hf_checkpoint(tmp_path / "plain", config, weights)
    return tmp_path / "plain"


def test_resaving_unsharded_removes_stale_shards(tmp_path: Path) -> None:
    config, weights = _config(), _weights(_config())
    save_hf_checkpoint(tmp_path, config, weights, max_shard_bytes=20_000)
    save_hf_checkpoint(tmp_path, config, weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert load_checkpoint(tmp_path).report.format == "hf_dir"


def test_bare_safetensors_infers_the_saved_config_from_shapes(tmp_path: Path) -> None:
    config = _config(num_key_value_heads=1, attention_bias=True)
    weights = _weights(config)
    save_file(weights, tmp_path / "drafter.safetensors")
    loaded = load_checkpoint(tmp_path / "drafter.safetensors", overrides=_overrides(config))
    assert loaded.config == config
    _assert_same_weights(loaded, weights)
    sources = loaded.report.field_sources
    assert {sources[k] for k in SHAPE_FIELDS} == {"shapes"}
    assert {sources[k] for k in _overrides(config)} == {"override"} and sources["rope_scaling"] == "default"
    digest = hashlib.sha256((tmp_path / "drafter.safetensors").read_bytes()).hexdigest()
    assert loaded.report.sha256 == digest == loaded.report.file_sha256["drafter.safetensors"]


def test_num_target_layers_override_derives_target_layer_ids(tmp_path: Path) -> None:
    config = _config(target_layer_ids=(1, 33))
    save_file(_weights(config), tmp_path / "d.safetensors")
    overrides = {**_overrides(config), "num_target_layers": 36}
    del overrides["target_layer_ids"]
    loaded = load_checkpoint(tmp_path / "d.safetensors", overrides=overrides)
    assert loaded.config.target_layer_ids == (1, 33)
    assert loaded.report.field_sources["target_layer_ids"] == "derived"


def test_nested_training_pickle_with_optimizer_and_prefixes(tmp_path: Path, monkeypatch) -> None:
    config, weights = _config(), _weights(_config())
    wrapped = {f"module._orig_mod.{k}": v for k, v in weights.items()}
    wrapped["module._orig_mod.embed_tokens.weight"] = torch.zeros(100, 32)
    trainer_config = {
        "aux": [1, 3],
        "mask_token_id": 99,
        "vocab_size": 100,
        "rope_theta": 10000.0,
        "block_size": 4,
        "rms_norm_eps": 1e-5,
        "lr": 3e-4,
    }
    torch.save(
        {
            "state_dict": {"model": wrapped},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(1000)}}},
            "step": 7,
            "config": trainer_config,
        },
        tmp_path / "ckpt.pt",
    )
    seen: list[weakref.ref] = []
    real_load = torch.load

    def spying_load(*args, **kwargs):
        obj = real_load(*args, **kwargs)
        seen.append(weakref.ref(obj["optimizer"]["state"][0]["exp_avg"]))
        return obj

    monkeypatch.setattr(torch, "load", spying_load)
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    gc.collect()
    assert seen and seen[0]() is None  # optimizer state was not kept alive
    assert loaded.config == config and loaded.report.field_sources["target_layer_ids"] == "config"
    _assert_same_weights(loaded, weights)
    assert loaded.report.stripped_prefixes == ("_orig_mod.", "module.")
    assert loaded.report.dropped_keys == ("module._orig_mod.embed_tokens.weight",)
    assert loaded.report.format == "torch_pickle"


def test_vllm_renamed_keys(tmp_path: Path) -> None:
    config = _config(num_hidden_layers=1, target_layer_ids=(2,))
    weights = _weights(config)
    renamed = {
        k.replace("layers.0.", "midlayer.")
        .replace("fc.", "encoder.fc.")
        .replace("hidden_norm.", "encoder.output_norm_enc."): v
        for k, v in weights.items()
    }
    renamed["lm_head.weight"] = torch.zeros(100, 32)
    save_file(renamed, tmp_path / "vllm.safetensors")
    loaded = load_checkpoint(tmp_path / "vllm.safetensors", overrides=_overrides(config))
    assert loaded.config == config
    _assert_same_weights(loaded, weights)
    assert set(loaded.report.stripped_prefixes) == {
        "midlayer. -> layers.0.",
        "encoder.fc. -> fc.",
        "encoder.output_norm_enc. -> hidden_norm.",
    }
    assert loaded.report.dropped_keys == ("lm_head.weight",)


def test_malicious_pickle_is_refused_unless_trusted(tmp_path: Path) -> None:
    config, weights = _config(), _weights(_config())
    marker = tmp_path / "pwned"
    torch.save({"model": weights, "extra": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UntrustedCheckpointError) as info:
        load_checkpoint(tmp_path / "evil.pt", overrides=_overrides(config))
    assert str(info.value) == (
        f"{tmp_path / 'evil.pt'} cannot be loaded with weights_only=True (it references exec): it needs full "
        "unpickling, which runs arbitrary code from the file. Pass --trust-checkpoint "
        "only if you trust its source."
    )
    assert not marker.exists()
    loaded = load_checkpoint(tmp_path / "evil.pt", overrides=_overrides(config), trust_checkpoint=True)
    assert marker.exists()  # trusted: the payload ran, as full unpickling does
    _assert_same_weights(loaded, weights)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing 1 key: layers.1.mlp.up_proj.weight"),
        (lambda w: w.update({"junk.weight": torch.zeros(3)}), "unexpected 1 key: junk.weight"),
        (
            lambda w: w.update({"norm.weight": torch.zeros(31)}),
            "wrong shape/dtype 1 key: norm.weight [31] (expected [32])",
        ),
    ],
)
def test_bad_checkpoint_names_the_key(tmp_path: Path, edit, message: str) -> None:
    weights = _weights(_config())
    edit(weights)
    save_file(weights, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "bad.safetensors", overrides=_overrides(_config()))
    assert str(info.value) == (
        f"{tmp_path / 'bad.safetensors'} is not a DFlash drafter checkpoint matching its config: {message}"
    )


def test_not_a_drafter_at_all(tmp_path: Path) -> None:
    save_file({f"model.layers.{i}.weight": torch.zeros(2) for i in range(8)}, tmp_path / "llm.safetensors")
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "is not a DFlash drafter checkpoint: missing 5 keys: fc.weight, layers.0.self_attn.q_norm.weight,"
        ),
    ):
        load_checkpoint(tmp_path / "llm.safetensors")


def test_missing_fields_and_contradictions_are_errors(tmp_path: Path) -> None:
    config = _config()
    save_file(_weights(config), tmp_path / "d.safetensors")
    with pytest.raises(
        CheckpointError,
        match="cannot tell rope_theta, target_layer_ids, "
        "vocab_size from the checkpoint; pass them as overrides",
    ):
        load_checkpoint(tmp_path / "d.safetensors", overrides={"block_size": 4, "mask_token_id": 99})
    with pytest.raises(CheckpointError, match=r"override hidden_size=64 contradicts the weights \(32\)"):
        load_checkpoint(tmp_path / "d.safetensors", overrides={**_overrides(config), "hidden_size": 64})
    with pytest.raises(CheckpointError, match="has 3 entries but fc.weight takes 2 features"):
        load_checkpoint(
            tmp_path / "d.safetensors", overrides={**_overrides(config), "target_layer_ids": [1, 2, 3]}
        )
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['mask_id'\]"):
        load_checkpoint(tmp_path / "d.safetensors", overrides={"mask_id": 5})


def test_config_json_disagreeing_with_weights(tmp_path: Path) -> None:
    save_hf_checkpoint(tmp_path, _config(), _weights(_config()))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config says intermediate_size=128 but the weights say 64"):
        load_checkpoint(tmp_path)


def test_missing_path_says_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"does not exist; expected an HF directory") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert isinstance(info.value, FileNotFoundError) and str(tmp_path / "nope.pt") in str(info.value)
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        load_checkpoint(tmp_path)


def test_save_refuses_a_state_dict_that_does_not_match(tmp_path: Path) -> None:
    weights = _weights(_config())
    del weights["norm.weight"]
    with pytest.raises(CheckpointError, match="missing 1 key: norm.weight"):
        save_hf_checkpoint(tmp_path / "out", _config(), weights)
    assert not (tmp_path / "out").exists()


def test_corrupt_pickle_is_unreadable_not_untrusted(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt is not a checkpoint: neither a torch zip") as info:
        load_checkpoint(tmp_path / "junk.pt")
    assert not isinstance(info.value, UntrustedCheckpointError)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    written = save_hf_checkpoint(tmp_path, _config(), _weights(_config()), max_shard_bytes=20_000)
    shard = next(p for p in written if p.name.startswith("model-00002-of-"))
    shard.unlink()
    with pytest.raises(
        CheckpointNotFoundError,
        match=f"shards named in model.safetensors.index.json are missing: 1 file: {shard.name}",
    ):
        load_checkpoint(tmp_path)
