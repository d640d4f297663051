"""Each bad input: one clear line naming the problem and the fix, exit 2, nothing lost."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import hscache
from hscache.capture.builtin import build_tokenizer
from hscache.cli import main
from tests.conftest import write_jsonl


def _run(*args: str):
    result = CliRunner().invoke(main, ["extract", "--quiet", *args])
    return result.exit_code, result.output.strip()


def _assert_one_line_error(code: int, text: str, *fragments: str) -> None:
    assert code == 2, text
    assert text.startswith("error: ") and "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_missing_prompts_file(tmp_path):
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(tmp_path / "nope.jsonl"))
    _assert_one_line_error(code, text, "nope.jsonl' does not exist", "builtin:default")


def test_malformed_jsonl_line_names_its_line_number(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "ok"}\n\n{"id": 2, "prompt": "broken"\n')
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(code, text, "p.jsonl:3:", "not valid JSON")
    assert not (tmp_path / "c").exists()  # rejected before anything was written


def test_record_without_content_key(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "text": "hi"}])
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(
        code, text, "p.jsonl:1:", "exactly one of 'prompt', 'messages', 'conversations', 'input_ids'"
    )


def test_empty_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n\n")
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(code, text, "has no records")


@pytest.mark.parametrize(
    "layers,fragment",
    [
        ("9", "layer 9 out of range for a target with 8 layers; choose 0-7"),
        ("1,3,1", "layer 1 is listed twice"),
        ("1,x", "not a comma-separated list of integers"),
        ("dflash:x", "expected dflash:N"),
        ("-1", "layer -1 out of range"),
    ],
)
def test_bad_layer_ids(tmp_path, layers, fragment):
    code, text = _run("--out", str(tmp_path / "c"), "--layers", layers)
    _assert_one_line_error(code, text, fragment)
    assert not (tmp_path / "c").exists()


def test_unknown_model_path(tmp_path):
    code, text = _run("--out", str(tmp_path / "c"), "--model", str(tmp_path / "no-model"))
    _assert_one_line_error(code, text, "neither a built-in target", "nothing is downloaded")
    code, text = _run("--out", str(tmp_path / "c"), "--model", "builtin:huge")
    _assert_one_line_error(code, text, "unknown built-in target 'builtin:huge'")


def test_prompt_longer_than_max_length(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 200}]
    )
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path), "--max-length", "50")
    _assert_one_line_error(code, text, "record 'long' (line 2)", "more than --max-length 50")


def test_out_of_vocabulary_input_ids(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "input_ids": [1, 2, 99999]}])
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    vocab = len(build_tokenizer())
    _assert_one_line_error(code, text, f"token id 99999 is outside the model's vocabulary of {vocab}")


def test_fla_backend_on_a_cpu_machine(tmp_path):
    code, text = _run("--out", str(tmp_path / "c"), "--backend", "fla")
    _assert_one_line_error(code, text, "--backend fla cannot run here", "use --backend torch")


def test_out_dir_with_foreign_files_is_not_touched(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, text = _run("--out", str(out), "--limit", "1", "--max-new-tokens", "2")
    _assert_one_line_error(code, text, "is not empty and holds no cache")
    assert (out / "precious.txt").read_text() == "keep me"


def test_mismatched_resume_keeps_the_existing_cache(tmp_path, bf16_cache):
    import shutil

    out = tmp_path / "c"
    shutil.copytree(bf16_cache, out)
    before = json.loads((out / "manifest.json").read_text())
    code, text = _run(
        "--out", str(out), "--layers", "1,3,7", "--max-new-tokens", "12", "--limit", "4", "--dtype", "fp32"
    )
    _assert_one_line_error(code, text, "built with --dtype bf16 but this run has --dtype fp32", "--overwrite")
    assert json.loads((out / "manifest.json").read_text()) == before
    assert len(hscache.open_cache(out)) == 4


def test_info_on_a_directory_that_is_not_a_cache(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path)])
    _assert_one_line_error(
        result.exit_code,
        result.output.strip(),
        f"{tmp_path} is an empty directory, not a cache; make one with",
    )


@pytest.mark.parametrize(
    "record,fragment",
    [
        (
            {"id": "a", "messages": [{"role": "user", "content": "hi"}], "response": "x"},
            "'response' must be a string",
        ),
        (
            {"id": "a", "input_ids": [1, 2], "prompt_len": 5},
            "'prompt_len' must be an integer in 1..len(input_ids)",
        ),
    ],
)
def test_bad_dataset_continuations(tmp_path, record, fragment):
    path = write_jsonl(tmp_path / "p.jsonl", [record])
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path), "--max-new-tokens", "0")
    _assert_one_line_error(code, text, "p.jsonl:1:", fragment)


@pytest.mark.parametrize(
    "device,fragment",
    [
        ("gpu", "--device 'gpu' is not a torch device; use cpu or cuda[:N]"),
        ("cuda", "torch reports no CUDA device on this machine; use --device cpu"),
    ],
)
def test_bad_or_absent_device(tmp_path, device, fragment):
    if device == "cuda" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, text = _run("--out", str(tmp_path / "c"), "--device", device)
    _assert_one_line_error(code, text, fragment)


def test_messages_that_are_not_role_content_objects(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "messages": ["hi"]}])
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(code, text, "p.jsonl:1:", "'messages' must be a non-empty list of")


def test_a_prompts_file_that_is_not_utf8_names_its_line(tmp_path):
    """Issue 20.5: one line with the line number, not a UnicodeDecodeError traceback."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(code, text, "p.jsonl:2:", "not UTF-8", "0xe9")
    assert not (tmp_path / "c").exists()


def test_a_utf8_bom_is_read_not_refused(tmp_path):
    from hscache.capture.prompts import iter_records

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "caf\xc3\xa9"}\n{"id": "b", "prompt": "x"}\n')
    records = list(iter_records(path))
    assert [(r.record_id, r.content) for r in records] == [("a", "café"), ("b", "x")]


def test_a_record_without_an_id_is_refused_or_numbered_by_line(tmp_path):
    """Issue 20.7: never silently renamed to its line number."""
    from hscache.capture.prompts import iter_records

    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "no id here"}])
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(path))
    _assert_one_line_error(code, text, "p.jsonl:2:", "no 'id'", "--id-from-line")
    assert not (tmp_path / "c").exists()
    numbered = list(iter_records(path, id_from_line=True))
    assert [r.record_id for r in numbered] == ["a", "2"]


def test_out_that_is_a_file_says_not_a_directory(tmp_path):
    """Issue 20.6: not disk-full advice; the file is left as it was."""
    a_file = tmp_path / "cache.txt"
    a_file.write_text("mine")
    code, text = _run("--out", str(a_file), "--limit", "1")
    _assert_one_line_error(code, text, "is a file, not a directory")
    assert "disk" not in text and a_file.read_text() == "mine"
    code, text = _run("--out", str(a_file / "sub"), "--limit", "1")
    _assert_one_line_error(code, text, "not a directory")
    assert "disk" not in text and a_file.read_text() == "mine"


def test_output_paths_under_a_file_are_refused_before_any_work(tmp_path, bf16_cache):
    """Issue 20.6: --json / --report / --out under a file: one line naming the flag, no traceback."""
    from scorer.cli import main as scorer_main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    runs = [
        (main, ["diff", str(bf16_cache), str(bf16_cache), "--json", str(a_file / "d.json")], "--json"),
        (main, ["diff", str(bf16_cache), str(bf16_cache), "--report", str(tmp_path)], "--report"),
        (
            main,
            ["export", str(bf16_cache), "--format", "specforge", "--layers", "1,3", "--out", str(a_file)],
            "--out",
        ),
        (
            scorer_main,
            ["eval", str(tmp_path), "--cache", str(bf16_cache), "--json", str(a_file / "r.json")],
            "--json",
        ),
    ]
    for command, args, flag in runs:
        result = CliRunner().invoke(command, args)
        _assert_one_line_error(result.exit_code, result.output.strip(), flag)
        assert "is a file" in result.output or "is a directory" in result.output, result.output
    assert a_file.read_text() == "mine"
