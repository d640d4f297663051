"""Issue 31 item 3: the real prompt sets ship in the package (`--prompts humaneval`, `--prompts
mt-bench`) with their licence texts and categories; an unknown set name lists the known ones."""

from __future__ import annotations

import collections
import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.capture.prompt_sets import PROMPT_SETS, held_out, load_prompt_set, prompt_set_path
from hscache.capture.prompts import iter_records, resolve_prompts
from hscache.errors import PromptFileError

# sha256 of the bundled default set as it was before issue 31: it stays so (the quickstart and many
# tests read it).
DEFAULT_SHA256 = "c703a61fe8984acb020fa98868fdc2c69fe70e660bc051cfda705e9012f2aa59"


def test_humaneval_is_the_164_problems_with_their_category():
    records = load_prompt_set("humaneval")
    assert len(records) == 164
    assert [r["id"] for r in records[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert {r["category"] for r in records} == {"code"}
    assert records[0]["prompt"].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert all(r["entry_point"] in r["prompt"] for r in records)
    parsed = list(iter_records(resolve_prompts("humaneval")))
    assert [p.record_id for p in parsed] == [r["id"] for r in records]
    assert parsed[0].content_key == "prompt" and parsed[0].metadata["category"] == "code"


def test_mt_bench_is_the_80_two_turn_questions_in_8_categories():
    records = load_prompt_set("mt-bench")
    assert len(records) == 80 and all(len(r["turns"]) == 2 for r in records)
    counts = collections.Counter(r["category"] for r in records)
    want = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    assert counts == {c: 10 for c in want}
    parsed = list(iter_records(resolve_prompts("mt-bench")))
    assert parsed[0].content_key == "messages"
    assert parsed[0].content == [{"role": "user", "content": records[0]["turns"][0]}]
    assert parsed[0].metadata["category"] == "writing"


def test_each_real_set_ships_its_licence_text():
    root = Path(str(prompt_set_path("humaneval"))).parent
    assert "The MIT License" in (root / "LICENSE-humaneval.txt").read_text()
    assert "Copyright (c) OpenAI" in (root / "LICENSE-humaneval.txt").read_text()
    assert "Apache License" in (root / "LICENSE-mt-bench.txt").read_text()


def test_the_default_set_is_unchanged():
    assert resolve_prompts("builtin:default") == prompt_set_path("builtin:default")
    assert len(list(iter_records(resolve_prompts("builtin:default")))) == 20
    data = prompt_set_path("builtin:default").read_bytes()
    assert hashlib.sha256(data).hexdigest() == DEFAULT_SHA256


def test_held_out_is_every_fourth_record_and_the_default_set():
    assert [i for i in range(9) if held_out("humaneval", i)] == [0, 4, 8]
    assert all(held_out("builtin:default", i) for i in range(20))


def test_an_unknown_set_name_lists_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PromptFileError) as err:
        resolve_prompts("human-eval")
    message = str(err.value)
    assert "\n" not in message and "'human-eval'" in message
    assert all(name in message for name in PROMPT_SETS)

    from hscache.cli import main

    result = CliRunner().invoke(main, ["extract", "--out", "c", "--prompts", "mtbench"])
    assert result.exit_code == 2
    assert "mt-bench" in result.output and "humaneval" in result.output
    assert not (tmp_path / "c").exists()
