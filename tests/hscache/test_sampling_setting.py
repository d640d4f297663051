"""The sampling setting: presets, flags over presets, generation_config.json, and one-line refusals
of every out-of-range value, all before torch is imported (hscache/store/sampling.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hscache.cli import main
from hscache.errors import InputError
from hscache.store.sampling import GREEDY, PRESETS, SamplingSetting, sampling_setting


def test_qwen_presets_are_the_model_cards_values():
    # Qwen3.6-35B-A3B model card, "Best Practices" (spec sampling.md section 2).
    expected = {
        "qwen-thinking": (1.0, 0.95, 20, 0.0, 1.5, 1.0),
        "qwen-thinking-coding": (0.6, 0.95, 20, 0.0, 0.0, 1.0),
        "qwen-instruct": (0.7, 0.8, 20, 0.0, 1.5, 1.0),
    }
    fields = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty")
    assert set(PRESETS) == set(expected)
    for name, values in expected.items():
        setting = SamplingSetting.from_flags(name)
        assert tuple(getattr(setting, f) for f in fields) == values, name
        assert (setting.preset, setting.seed, setting.samples_per_prompt, setting.support_width) == (
            name,
            0,
            1,
            40,
        )


def test_explicit_flags_override_a_presets_field():
    setting = SamplingSetting.from_flags(
        "qwen-instruct", temperature=0.3, top_k=5, seed=11, samples_per_prompt=3
    )
    assert (setting.temperature, setting.top_k, setting.top_p, setting.presence_penalty) == (0.3, 5, 0.8, 1.5)
    assert (setting.seed, setting.samples_per_prompt, setting.support_width) == (11, 3, 10)


def test_greedy_is_the_default_and_what_a_cache_without_a_record_reads_as():
    assert SamplingSetting.from_flags() == GREEDY and SamplingSetting.from_flags("greedy") == GREEDY
    assert GREEDY.greedy and GREEDY.temperature == 0 and GREEDY.support_width == 0
    assert sampling_setting({"layer_ids": [1]}) == GREEDY
    assert GREEDY.describe() == "greedy (temperature 0)"
    sampled = SamplingSetting.from_flags("qwen-thinking", seed=3)
    assert sampling_setting({"sampling": sampled.to_dict()}) == sampled
    assert sampled.to_dict()["order"][-1] == "renormalise" and sampled.to_dict()["engine"] == "vllm"


def test_generation_config_takes_what_vllm_takes(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "eos_token_id": 2})
    )
    setting = SamplingSetting.from_flags("generation-config", model=str(tmp_path), seed=1)
    assert (setting.temperature, setting.top_k, setting.top_p, setting.preset) == (
        0.6,
        20,
        0.95,
        "generation-config",
    )
    assert (setting.min_p, setting.presence_penalty, setting.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )  # vLLM's defaults
    args = [
        "--model",
        str(tmp_path),
        "--sampling",
        "generation-config",
        "--prompts",
        str(tmp_path / "none.jsonl"),
    ]
    out = CliRunner().invoke(main, ["extract", *args, "--out", str(tmp_path / "c")])
    # What it took is said first, before the (missing) prompts file stops the run.
    assert out.exit_code == 2 and out.output.startswith(
        f"sampling: took temperature 0.6, top_k 20, top_p 0.95 from {tmp_path / 'generation_config.json'}; "
        "now temperature 0.6, top_p 0.95, top_k 20"
    ), out.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--temperature", "1", "--top-k", "0"],
            "--top-k 0 must be -1 (disabled) or at least 1",
        ),
        (["--temperature", "1"], "sampling with top-k disabled (--top-k -1, vLLM's default) leaves"),
        (["--temperature", "-1"], "--temperature -1 must be 0 (greedy) or at least 1e-05"),
        (["--temperature", "nan"], "--temperature nan must be a finite number"),
        (["--sampling", "qwen-thinking", "--top-p", "0"], "--top-p 0 must be in (0, 1] (as vLLM requires)"),
        (
            ["--sampling", "qwen-thinking", "--min-p", "1.5"],
            "--min-p 1.5 must be in [0, 1] (as vLLM requires)",
        ),
        (
            ["--sampling", "qwen-thinking", "--presence-penalty", "3"],
            "--presence-penalty 3 must be in [-2, 2]",
        ),
        (
            ["--sampling", "qwen-thinking", "--repetition-penalty", "0"],
            "--repetition-penalty 0 must be in (0, 2]",
        ),
        (
            ["--sampling", "qwen-thinking", "--samples-per-prompt", "0"],
            "--samples-per-prompt 0 must be at least 1",
        ),
        (["--sampling", "qwen-thinking", "--seed", "-1"], "--seed -1 must be an integer in 0..2^63-1"),
        (["--samples-per-prompt", "2"], "--samples-per-prompt 2 does nothing at temperature 0"),
        (["--seed", "5"], "--seed 5 does nothing at temperature 0 (greedy: the argmax chain, no sampling)"),
        (
            ["--sampling", "qwen-thinking", "--temperature", "0"],
            "--temperature 0 with --sampling qwen-thinking is",
        ),
        (
            ["--sampling", "hot"],
            "--sampling 'hot' is not a preset; choose one of greedy, generation-config, qwen-",
        ),
        (["--sampling", "generation-config"], "--sampling generation-config reads the model directory's gen"),
        (
            ["--responses-from", "/no/such/file.jsonl"],
            "--responses-from '/no/such/file.jsonl' cannot be read",
        ),
    ],
)
def test_bad_sampling_flags_are_one_line_before_anything_is_written(tmp_path, flags, message):
    out = tmp_path / "cache"
    result = CliRunner().invoke(main, ["extract", "--out", str(out), *flags])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), (
        result.output
    )
    assert not out.exists()


def test_flags_are_checked_before_torch_is_imported():
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom hscache.cli import main\n"
        "r = CliRunner().invoke(main, ['extract', '--out', 'x', '--temperature', '2', '--top-k', '0'])\n"
        "assert r.exit_code == 2, r.output\nprint('torch' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_validate_knows_the_vocabulary():
    with pytest.raises(InputError, match="^--top-k 600 is larger than the model's vocabulary of 512$"):
        SamplingSetting.from_flags("qwen-thinking", top_k=600).validate(vocab_size=512)
