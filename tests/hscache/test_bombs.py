"""No allocation bombs from prompts files (issue 18, items 11 and 12)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import hscache.capture.extract as extract_module
from hscache.cli import main


def _one_error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_an_over_long_prompt_line_is_refused_before_it_is_tokenized(tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "short", "prompt": "hello"})
        + "\n"
        + json.dumps({"id": "huge", "prompt": "word " * 2_000_000})  # 10 MB on one line
        + "\n"
    )
    tokenized = []
    original = extract_module.prompt_token_ids
    monkeypatch.setattr(
        extract_module,
        "prompt_token_ids",
        lambda record, *a: tokenized.append(record.record_id) or original(record, *a),
    )
    out = tmp_path / "c"
    line = _one_error_line(
        CliRunner().invoke(
            main, ["extract", "--quiet", "--prompts", str(prompts), "--out", str(out), "--max-length", "64"]
        )
    )
    assert "record 'huge' (line 2) holds 10000000 characters, more than --max-length 64 tokens" in line
    assert tokenized == ["short"]  # the long line was never tokenized
    assert not (out / "manifest.json").exists()


def test_a_prompt_line_nested_100000_levels_deep_is_one_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    line = _one_error_line(
        CliRunner().invoke(main, ["extract", "--prompts", str(prompts), "--out", str(tmp_path / "c")])
    )
    assert ":2: not valid JSON (nested too deeply to parse)" in line
