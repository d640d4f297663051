"""Issue #14's hard edges in extract: flags checked against the model before anything is written,
token ids against the embedding rows, chat data that carries its answer, duplicate record ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.capture.builtin import build_tokenizer
from hscache.cli import main
from tests.conftest import write_jsonl


def _run(*args: str):
    result = CliRunner().invoke(main, ["extract", "--quiet", *args])
    return result.exit_code, result.output.strip()


def _one_line_error(code: int, text: str, *fragments: str) -> None:
    assert code == 2, text
    assert text.startswith("error: ") and "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_top_k_past_the_vocabulary_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "c"
    code, text = _run("--out", str(out), "--logits-top-k", "1000", "--limit", "1", "--max-new-tokens", "2")
    _one_line_error(code, text, "--logits-top-k 1000", f"vocabulary of {len(build_tokenizer())}")
    assert not out.exists(), "nothing may be written: a half-made cache could not be resumed"


@pytest.fixture(scope="module")
def wide_embedding_model(tmp_path_factory) -> Path:
    """A local HF target with 600 embedding rows for a 512-entry tokenizer (as Qwen3.6 has more
    rows than tokenizer entries)."""
    from hscache.capture.builtin import build_builtin

    directory = tmp_path_factory.mktemp("wide") / "model"
    model, tokenizer = build_builtin("builtin:tiny-qwen3")
    model.resize_token_embeddings(600, mean_resizing=False)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_token_ids_are_checked_against_the_embedding_rows(tmp_path, wide_embedding_model):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "input_ids": [1, 2, 550], "prompt_len": 2}])
    out = tmp_path / "c"
    code, text = _run(
        "--model", str(wide_embedding_model), "--prompts", str(prompts), "--out", str(out),
        "--max-new-tokens", "0", "--dtype", "fp32", "--layers", "1",
    )  # fmt: skip
    assert code == 0, text
    assert hscache.open_cache(out).token_ids(0).tolist() == [1, 2, 550]
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "input_ids": [1, 600]}])
    code, text = _run(
        "--model", str(wide_embedding_model), "--prompts", str(prompts), "--out", str(tmp_path / "d"),
        "--layers", "1",
    )  # fmt: skip
    _one_line_error(code, text, "token id 600 is outside the model's vocabulary of 600")


def _chat_cache(tmp_path: Path, record: dict) -> hscache.Cache:
    prompts = write_jsonl(tmp_path / "chat.jsonl", [record])
    out = tmp_path / "chat"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), prompts=str(prompts), max_new_tokens=0, dtype="fp32", layers="1", overwrite=True
        )
    )
    return hscache.open_cache(out)


def _expected_chat_split(messages: list[dict]) -> tuple[list[int], int]:
    from hscache.capture.builtin import build_builtin

    _, tok = build_builtin("builtin:tiny-qwen3.5")
    full = tok.apply_chat_template(messages, tokenize=False)
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert full.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    return tok(full)["input_ids"], len(tok(prompt)["input_ids"])


def test_chat_ending_in_an_assistant_turn_scores_that_turn(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky at noon."},
    ]
    ids, prompt_len = _expected_chat_split(messages)
    cache = _chat_cache(tmp_path, {"id": "chat-1", "messages": messages, "topic": "colour"})
    assert cache.token_ids(0).tolist() == ids
    assert cache.index.column("prompt_len")[0].as_py() == prompt_len < len(ids)
    assert cache.index.column("stop_reason")[0].as_py() == "dataset"
    assert cache.index.column("topic")[0].as_py() == "colour"


def test_sharegpt_conversations_read_as_messages(tmp_path):
    turns = [
        {"from": "human", "value": "Name a colour."},
        {"from": "gpt", "value": "Blue, like the sky at noon."},
    ]
    ids, prompt_len = _expected_chat_split(
        [{"role": "user", "content": turns[0]["value"]}, {"role": "assistant", "content": turns[1]["value"]}]
    )
    cache = _chat_cache(tmp_path, {"id": "sg", "conversations": turns})
    assert cache.token_ids(0).tolist() == ids
    assert cache.index.column("prompt_len")[0].as_py() == prompt_len
    assert "conversations" not in cache.index.column_names


def test_bad_sharegpt_turn_is_one_line(tmp_path):
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "x", "conversations": [{"from": "bot", "value": "hi"}]}]
    )
    code, text = _run("--out", str(tmp_path / "c"), "--prompts", str(prompts))
    _one_line_error(code, text, "'conversations' must be", "ShareGPT")


def test_duplicate_record_ids_are_refused_or_suffixed(tmp_path):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}, {"id": "a", "prompt": "three"}],
    )
    out = tmp_path / "c"
    code, text = _run("--out", str(out), "--prompts", str(prompts), "--max-new-tokens", "1")
    _one_line_error(code, text, "record id 'a' (line 3) is used before, on line 1", "--suffix-duplicate-ids")
    assert not out.exists()
    code, text = _run(
        "--out", str(out), "--prompts", str(prompts), "--max-new-tokens", "1", "--suffix-duplicate-ids"
    )  # fmt: skip
    assert code == 0, text
    assert hscache.open_cache(out).index.column("record_id").to_pylist() == ["a", "b", "a#2"]


def test_dflash_layers_past_the_model_depth_say_so_on_the_cli(tmp_path):
    code, text = _run("--out", str(tmp_path / "c"), "--layers", "dflash:20")
    _one_line_error(code, text, "20", "8 layers")
    assert "listed twice" not in text


def test_metadata_survives_in_json(tmp_path):
    cache = _chat_cache(
        tmp_path, {"id": "m", "messages": [{"role": "user", "content": "hi"}], "tags": {"k": [1, 2]}}
    )
    assert json.loads(cache.index.column("metadata_json")[0].as_py()) == {"tags": {"k": [1, 2]}}


def test_tokens_from_replays_another_cache_on_identical_tokens(tmp_path, bf16_cache):
    """A cache re-extracted from bf16_cache's tokens in fp32 diffs without --intersect: same record
    ids, metadata, token ids and prompt_len."""
    out = tmp_path / "fp32-on-bf16-tokens"
    code, text = _run(
        "--tokens-from", str(bf16_cache), "--out", str(out), "--dtype", "fp32", "--layers", "1,3,7"
    )
    assert code == 0, text
    a, b = hscache.open_cache(bf16_cache), hscache.open_cache(out)
    for column in ("record_id", "prompt_len", "token_sha256", "metadata_json"):
        assert b.index.column(column).to_pylist() == a.index.column(column).to_pylist(), column
    from hscache.diff.compare import diff_caches

    assert diff_caches(bf16_cache, out).sequences.compared == len(a)
    code, text = _run("--tokens-from", str(bf16_cache), "--out", str(tmp_path / "x"), "--max-new-tokens", "3")
    _one_line_error(code, text, "--tokens-from replays", "--max-new-tokens 0")


def test_diff_mismatch_offers_tokens_from(fp32_cache, tmp_path):
    """Caches whose greedy tokens differ. (On the random built-in target the bf16 cache's tokens
    drifted from the fp32 one's; the trained target's do not over 12 tokens, so the other cache
    generates fewer tokens instead.)"""
    from hscache.diff.compare import diff_caches
    from hscache.errors import CacheMismatchError

    shorter = tmp_path / "shorter"
    hscache.extract(
        hscache.ExtractConfig(out=str(shorter), layers="1,3,7", max_new_tokens=6, dtype="bf16", limit=4)
    )
    with pytest.raises(CacheMismatchError) as err:
        diff_caches(fp32_cache, shorter)
    message = str(err.value)
    assert "--intersect" in message and f"--tokens-from {fp32_cache}" in message
    assert "intersect=True" not in message


def test_cache_files_are_readable_as_the_umask_says(bf16_cache):
    mask = os.umask(0o022)
    os.umask(mask)
    want = 0o666 & ~mask
    modes = {
        str(p.relative_to(bf16_cache)): p.stat().st_mode & 0o777 for p in bf16_cache.rglob("*") if p.is_file()
    }
    assert modes["target/head.safetensors"] == want
    assert all(mode == want for mode in modes.values()), modes


def test_sequences_by_record_id(bf16_cache):
    cache = hscache.open_cache(bf16_cache)
    rid = cache.index.column("record_id")[2].as_py()
    assert torch.equal(cache.hidden_states(rid), cache.hidden_states(2))
    assert torch.equal(cache.token_ids(rid), cache.token_ids(2))
    with pytest.raises(KeyError, match="no sequence has record id 'nope'"):
        cache.hidden_states("nope")
    with pytest.raises(TypeError, match=r"row number \(int\) or a record id \(str\)"):
        cache.hidden_states(1.5)


def test_info_prints_kernels_as_text_and_an_empty_cache_without_a_ratio(bf16_cache, tmp_path):
    from hscache.store.layout import ArraySpec
    from hscache.store.reader import read_manifest
    from hscache.store.writer import StoreWriter

    result = CliRunner().invoke(main, ["info", str(bf16_cache)])
    assert result.exit_code == 0, result.output
    assert "{" not in result.output and "kernels torch: " in result.output
    manifest = read_manifest(bf16_cache)
    empty = tmp_path / "empty"
    specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
    StoreWriter.create(empty, specs, manifest["compression"], manifest["settings"])
    result = CliRunner().invoke(main, ["info", str(empty)])
    assert result.exit_code == 0, result.output
    assert "x0.0" not in result.output and "no tokens yet" in result.output


def test_dtype_auto_is_fp32_on_cpu_and_progress_prints_lines_without_a_terminal(tmp_path):
    from hscache.capture.extract import auto_dtype

    assert (auto_dtype("cpu"), auto_dtype("cuda"), auto_dtype("cuda:1")) == ("fp32", "bf16", "bf16")
    out = tmp_path / "c"
    result = CliRunner().invoke(main, ["extract", "--out", str(out), "--limit", "2", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    cache = hscache.open_cache(out)
    assert cache.settings["dtype"] == "fp32" and cache.dtype == torch.float32
    # CliRunner's stderr is no terminal: plain progress lines, the first and the last at least
    assert "extract: 2 sequences" in result.output and "extract: 2/2 sequences" in result.output


def test_verify_diff_export_import_report_progress(bf16_cache, tmp_path, monkeypatch):
    """Issue 20.10: every long hscache step prints progress lines when stderr is not a terminal."""
    import hscache.progress

    monkeypatch.setattr(hscache.progress, "DEFAULT_EVERY_S", 0.0)
    n = len(hscache.open_cache(bf16_cache))
    runs = {
        "verify": ["verify", str(bf16_cache), "--deep"],
        "diff": ["diff", str(bf16_cache), str(bf16_cache)],
        "export": [
            "export",
            str(bf16_cache),
            "--format",
            "specforge",
            "--layers",
            "1,3",
            "--out",
            str(tmp_path / "f"),
        ],
        "import": ["import", "--format", "specforge", str(tmp_path / "f"), "--out", str(tmp_path / "c")],
    }
    expected = {
        "verify": ["verify: ", " tokens", "verify --deep: "],
        "diff": [f"diff: {n}/{n} sequences"],
        "export": [f"export: {n}/{n} sequences"],
        "import": [f"import: {n}/{n} sequences"],
    }
    for name, args in runs.items():
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        for fragment in expected[name]:
            assert fragment in result.output, (name, result.output)
