"""Hard edges, round five (issues 35 and 36): advice that names flags the command has, sizes
bounded before work, refusals before the model loads. Each test failed before its fix."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.capture.builtin import build_tokenizer
from scorer.cli import main as scorer_main


def _scorer(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(scorer_main, [str(a) for a in args])
    return result.exit_code, result.output


def _one_line_error(code: int, text: str, *needles: str) -> None:
    assert code == 2, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for needle in needles:
        assert needle in lines[0], text


@pytest.fixture(scope="session")
def maskless_cache(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scorer_cache`` as a target whose tokenizer names no mask token would have written it."""
    from hscache.store import integrity

    root = tmp_path_factory.mktemp("edges") / "maskless"
    shutil.copytree(scorer_cache, root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["settings"]["mask_token_id"] = None
    integrity.seal(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def test_init_takes_the_mask_token_id_its_advice_names(maskless_cache: Path, tmp_path: Path):
    # issue 35 item 1: the advice named --mask-token-id, which scorer init did not have
    code, text = _scorer("init", tmp_path / "none", "--cache", maskless_cache)
    _one_line_error(code, text, "scorer init --mask-token-id ID", "defines none")
    vocab = len(build_tokenizer())  # the built-in target's
    code, text = _scorer("init", tmp_path / "far", "--cache", maskless_cache, "--mask-token-id", vocab)
    _one_line_error(code, text, f"--mask-token-id {vocab} is outside the target's vocabulary of {vocab}")
    assert not (tmp_path / "far").exists() and not (tmp_path / "none").exists()
    code, text = _scorer("init", tmp_path / "ok", "--cache", maskless_cache, "--mask-token-id", 7)
    assert code == 0, text
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 7


def _hscache(*args: str) -> tuple[int, str]:
    from hscache.cli import main as hscache_main

    result = CliRunner().invoke(hscache_main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args, needles",
    [
        # the old stored-logits spelling at greedy: the new name
        (["--top-k", "32"], ["--logits-top-k 32", "renamed from --top-k"]),
        # the old sampling spelling: refused by name, pointing to --top-k
        (["--temperature", "0.7", "--sample-top-k", "20"], ["--sample-top-k was renamed", "--top-k 20"]),
        # the engines' spelling samples: checked as sampling's top-k (its range)
        (["--temperature", "0.7", "--top-p", "0.9", "--top-k", "0"], ["--top-k 0 must be -1"]),
        (["--logits-top-k", "0"], ["--logits-top-k", "0"]),
    ],
)
def test_extract_top_k_is_sampling_and_logits_top_k_the_stored_count(tmp_path: Path, args, needles):
    # issue 35 item 2: --top-k is the engines' sampling top-k; the stored logits are --logits-top-k
    code, text = _hscache("extract", "--out", tmp_path / "c", *args)
    assert code == 2, text
    assert all(n in text for n in needles), text
    assert not (tmp_path / "c").exists()


def test_extract_samples_with_the_engines_top_k_spelling(tmp_path: Path):
    # a vLLM user's flags sample at top-k 20 (was: "sampling with top-k disabled"): the setting is
    # valid, so the refusal that comes is the next one, about --max-new-tokens 0
    args = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--max-new-tokens", "0"]
    code, text = _hscache("extract", "--out", tmp_path / "c", *args)
    assert code == 2 and "top-k disabled" not in text and "sampling draws new tokens" in text, text


@pytest.mark.parametrize("command", ["online", "eval"])
def test_scorer_refuses_the_old_sample_top_k_by_name(command: str, tmp_path: Path):
    code, text = _scorer(command, tmp_path / "d", "--cache", tmp_path, "--sample-top-k", "5")
    if command == "online":
        code, text = _scorer(command, tmp_path / "d", "--temperature", "0.7", "--sample-top-k", "5")
    _one_line_error(code, text, "--sample-top-k was renamed", "--top-k 5")


@pytest.mark.parametrize(
    "args, needles",
    [
        # issue 35 item 11: the drafter's depth has its own name; the old one is refused with it
        (["--layers", "99"], ["--layers was renamed", "--draft-layers 99"]),
        # issue 36 item 8: every size bounded by the target or the cache, before anything is allocated
        (["--draft-layers", "1000000"], ["deeper than its target (8 layers)", "at most 8"]),
        (["--block-size", "100000"], ["--block-size 100000 is longer than the longest sequence"]),
        (
            ["--family", "eagle3", "--num-speculative-tokens", "1000000000", "--train-steps", "1"],
            ["--num-speculative-tokens 1000000000", "longest sequence"],
        ),
        # issue 36 item 15 / 35 item 11: an untrained EAGLE-3 reading a layer the cache lacks (the
        # engines' default [1, 3, 4]; the cache has 1, 3, 7), refused as training refuses it
        (["--family", "eagle3"], ["need layers [4]", "re-extract with --layers 1,3,4,7"]),
    ],
)
def test_init_refuses_what_eval_would_refuse_before_allocating(scorer_cache, tmp_path, args, needles):
    out = tmp_path / "d"
    code, text = _scorer("init", out, "--cache", scorer_cache, *args)
    _one_line_error(code, text, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "checkpoint, args, needles",
    [
        # issue 36 item 8: sizes bounded by the cache or the target before any work (were 14 GiB,
        # minutes, no answer)
        (
            "ngram",
            ["--num-speculative-tokens", "1000000000"],
            ["--num-speculative-tokens 1000000000", "longest"],
        ),
        (
            "ngram",
            ["--num-speculative-tokens", "3", "--prompt-lookup-max", "1000000000"],
            ["--prompt-lookup-max 1000000000 is longer than the longest sequence"],
        ),
        ("dflash", ["--ddtree", "1000000000"], ["--ddtree 1000000000", "max_position_embeddings"]),
        ("eagle3", ["--num-speculative-tokens", "1000000000"], ["--num-speculative-tokens 1000000000"]),
        ("target:mtp", ["--num-speculative-tokens", "1000000000"], ["--num-speculative-tokens 1000000000"]),
    ],
)
def test_eval_bounds_every_size_flag_before_work(
    scorer_cache, trained_drafter, eagle3_drafter, checkpoint, args, needles
):
    path = {"ngram": "ngram", "dflash": trained_drafter, "eagle3": eagle3_drafter}.get(checkpoint, checkpoint)
    code, text = _scorer("eval", path, "--cache", scorer_cache, *args)
    _one_line_error(code, text, *needles)


def _prompts(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CHAT_WITH_ANSWER = {
    "id": "c",
    "messages": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
}


@pytest.mark.parametrize(
    "records, needles",
    [
        # issue 35 item 9: hscache extract refuses duplicate ids; scorer online took them silently
        ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], ["record id 'a' (line 2) is used before"]),
        # issue 35 item 11: the assistant turn was dropped silently
        ([CHAT_WITH_ANSWER], ["record 'c' (line 1) ends with an assistant turn ('Blue.')"]),
    ],
)
def test_online_refuses_prompts_it_would_mishandle_before_the_model_loads(tmp_path, records, needles):
    prompts = _prompts(tmp_path / "p.jsonl", records)
    # a --model of config.json alone: a refusal after the load would be about its missing weights
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4}))
    code, text = _scorer(
        "online", "ngram", "--num-speculative-tokens", 2, "--prompts", prompts, "--model", model
    )
    _one_line_error(code, text, *needles)


def test_extract_refuses_a_chat_whose_answer_it_would_drop(tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", [CHAT_WITH_ANSWER])
    code, text = _hscache("extract", "--prompts", prompts, "--out", tmp_path / "c", "--max-new-tokens", 4)
    _one_line_error(code, text, "ends with an assistant turn ('Blue.')", "--max-new-tokens 0")
    assert not (tmp_path / "c").exists()


def test_a_tokenizer_that_gives_no_ids_is_one_line():
    # issue 35 item 9: was transformers' IndexError in generate()
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from hscache.capture.prompts import PromptRecord, prompt_token_ids
    from hscache.errors import PromptFileError

    # a BPE without an unknown token drops what it does not know: here, everything
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"a": 0}, merges=[])))
    record = PromptRecord(3, "r", "prompt", "bbb", {}, None)
    with pytest.raises(
        PromptFileError, match=r"^record 'r' \(line 3\): the --model tokenizer gives no token ids"
    ):
        prompt_token_ids(record, tokenizer)


@pytest.mark.parametrize(
    "args, needles",
    [
        # issue 36 item 8: bounded before the model loads (were 9 GiB, 14 GiB, minutes)
        (
            ["--temperature", "0.7", "--top-k", "5", "--runs", "1000000000"],
            ["--runs 1000000000", "more than half of this machine's"],
        ),
        (["--num-speculative-tokens", "1000000000"], ["--num-speculative-tokens 1000000000", "--max-length"]),
        (
            ["--num-speculative-tokens", "2", "--prompt-lookup-max", "1000000000"],
            ["--prompt-lookup-max 1000000000 is longer than the longest sequence in --max-length"],
        ),
    ],
)
def test_online_bounds_its_sizes_before_the_model_loads(tmp_path, args, needles):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4}))
    code, text = _scorer("online", "ngram", "--model", model, *args)
    _one_line_error(code, text, *needles)


def test_online_ddtree_is_bounded_by_the_targets_context(trained_drafter):
    code, text = _scorer("online", trained_drafter, "--temperature", "0.7", "--top-k", "5", "--ddtree", 10**9)
    _one_line_error(code, text, "--ddtree 1000000000", "context of 4096")


def test_online_prints_progress(tmp_path):
    # issue 35 item 12: scorer online printed nothing until it ended
    code, text = _scorer(
        "online", "ngram", "--num-speculative-tokens", 2, "--limit", 1, "--max-new-tokens", 3
    )
    assert code == 0, text
    assert "online: 1 prompts (decoding 1 prompts" in text and "online tau:" in text


def _with_layers(drafter: Path, out: Path, layer_ids: list[int]) -> Path:
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = layer_ids
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_compare_checks_every_drafter_before_scoring_the_first(scorer_cache, trained_drafter, tmp_path):
    # issue 35 item 12: the second drafter's missing layer was found after the first was scored
    other = _with_layers(trained_drafter, tmp_path / "other", [1, 3, 5])
    code, text = _scorer("compare", trained_drafter, other, "--cache", scorer_cache)
    _one_line_error(code, text, "need layers [5]")


@pytest.mark.parametrize(
    "args, needle",
    [
        # issue 35 item 8: tau 1.05 without a word
        (
            ["--target-layer-ids", "7,3,1"],
            "--target-layer-ids 7,3,1 reorders the layers the drafter's config states [1, 3, 7]",
        ),
        (["--target-layer-ids", "1,3,3"], "--target-layer-ids 1,3,3 replaces the layers"),
        # issue 35 item 11: only "(override)" in the config dump
        (
            ["--block-size", "12"],
            "--block-size 12 overrides the drafter's trained block size 6 (its config): it drafts slots 6-11",
        ),
    ],
)
def test_an_override_of_what_the_drafter_was_trained_with_is_said(
    scorer_cache, trained_drafter, tmp_path, args, needle
):
    report = tmp_path / "r.json"
    code, text = _scorer(
        "eval",
        trained_drafter,
        "--cache",
        scorer_cache,
        "--ddtree",
        "",
        "--limit",
        1,
        "--json",
        report,
        *args,
    )
    assert code == 0, text
    assert needle in " ".join(text.split()), text  # the terminal (rich may wrap it)
    assert any(needle in w for w in json.loads(report.read_text())["warnings"])


def test_diagnose_names_only_the_layer_ids_outside_the_target():
    # issue 35 item 13: "[2, 4, 5, 8] fall outside 0..7" when only 8 does
    from types import SimpleNamespace

    from scorer.diagnose.ranking import shifted_layer_ids

    cache = SimpleNamespace(target_config={"num_hidden_layers": 8}, layer_ids=list(range(8)))
    said = shifted_layer_ids([1, 3, 4, 7], 1, cache)
    assert said == "layer ids [2, 4, 5, 8]: 8 falls outside the target's 0..7"


def test_dflash_tree_advice_on_a_penalty_cache_names_what_dflash_runs_online(sampled_cache, trained_drafter):
    # issue 35 item 13: it advised `scorer online --tree`, which refuses DFlash
    code, text = _scorer("eval", trained_drafter, "--cache", sampled_cache, "--tree", "2,2,4", "--ddtree", "")
    _one_line_error(code, text, "scorer online --ddtree N")
    assert "online --tree" not in text


def test_a_probabilistic_report_labels_its_one_hot_tables_and_rounds_its_rounds(sampled_scorer_cache):
    # issue 35 item 13: E[rounds] printed as 981.4157143710868; one-hot tables unlabelled
    code, text = _scorer(
        "eval",
        "target:mtp",
        "--cache",
        sampled_scorer_cache,
        "--draft-sampling",
        "probabilistic",
        "--limit",
        2,
    )
    assert code == 0, text
    flat = " ".join(text.split())
    assert "requests / E[rounds] / tokens" in flat
    assert re.search(r"\b2 / \d+\.\d / \d+\b", flat), text
    assert "tokens per round (one-hot rule along the cached tokens, not the probabilistic tau above)" in flat
