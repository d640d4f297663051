"""``hscache extract`` refusals knowable from the target's config.json and an existing cache's
manifest come before the model loads (issue 35 item 12). The target here is a directory holding
only config.json: a refusal that waited for the load would be about its missing weights instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.cli import main


def _extract(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["extract", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture()
def config_only(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4}))
    return model


@pytest.mark.parametrize(
    "layers, needle",
    [
        ("--layers=1,99", "layer 99 out of range for a target with 4 layers"),
        ("--layers=-1,2", "layer -1 out of range for a target with 4 layers"),
        ("--layers=1,4", "layer 4 out of range for a target with 4 layers"),  # the layer count itself
    ],
)
def test_layers_out_of_range_are_refused_before_the_model_loads(config_only, tmp_path, layers, needle):
    code, text = _extract("--model", config_only, layers, "--out", tmp_path / "c")
    assert code == 2 and text.startswith("error: ") and needle in text and len(text.splitlines()) == 1, text
    assert not (tmp_path / "c").exists()


def test_a_builtin_targets_depth_is_known_without_torch():
    from hscache.capture import BUILTIN_LAYERS, BUILTIN_TARGETS
    from hscache.capture.builtin import builtin_config

    assert {n: builtin_config(n, 512, 0).num_hidden_layers for n in BUILTIN_TARGETS} == BUILTIN_LAYERS


def test_a_settings_mismatch_with_an_existing_cache_is_refused_before_the_model_loads(
    fp32_cache, config_only
):
    before = sorted(p.relative_to(fp32_cache) for p in fp32_cache.rglob("*"))
    code, text = _extract(
        "--model", config_only, "--layers", "1,2", "--out", fp32_cache, "--max-new-tokens", 5
    )
    assert code == 2 and len(text.splitlines()) == 1, text
    assert f"{fp32_cache} was built with --layers 0,1,2,3,4,5,6,7 but this run has --layers 1,2" in text
    assert "--model" in text and "--max-new-tokens" in text and "--overwrite to start over" in text
    assert sorted(p.relative_to(fp32_cache) for p in fp32_cache.rglob("*")) == before
    code, text = _extract(
        "--out", fp32_cache, "--layers", "0,1,2,3,4,5,6,7", "--max-new-tokens", 5, "--limit", 4
    )
    assert code == 2 and "was built with --max-new-tokens 12 but this run has --max-new-tokens 5" in text, (
        text
    )


def test_export_of_an_incomplete_cache_is_refused_unless_allowed(small_cache, tmp_path):
    # issue 35 item 11: an export of a killed extraction wrote 7 of 20 sequences without a word
    from hscache.store.writer import publish_manifest

    cache = small_cache.copy(tmp_path / "killed")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["complete"] = False  # as an extraction killed before its last commit leaves it
    publish_manifest(cache, manifest)
    result = CliRunner().invoke(
        main, ["export", str(cache), "--format", "speculators", "--out", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert f"{cache} is incomplete: 12 of " in result.output and "--allow-incomplete" in result.output
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(
        main,
        ["export", str(cache), "--format", "specforge", "--out", str(tmp_path / "y"), "--allow-incomplete"],
    )
    assert result.exit_code == 0 and "exporting only those (--allow-incomplete)" in result.output, (
        result.output
    )
