"""Sampled extraction end to end on the built-in target: the stored distributions are vLLM's processed
distribution of the cached logits (recomputed here independently), every drawn token lies in them,
a kill -9 and a resume (the same seed again) give the same cache, and greedy caches are untouched."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.cli import main
from hscache.errors import ResumeMismatchError
from hscache.store import integrity
from hscache.store.layout import SAMPLED_ARRAYS
from hscache.store.row_ranges import RowRangeView, read_rows
from hscache.store.sampling import GREEDY, SamplingSetting
from tests.conftest import SAMPLED_CACHE_CONFIG, SAMPLED_CACHE_FLAGS
from tests.hscache.test_cache_contract import split_into_shards
from tests.hscache.test_sampling_processor import vllm_processed


def _content_digest(cache: hscache.Cache) -> str:
    """``cache_digest`` without provenance.json's run log (times, host, command line): what a re-run
    can reproduce. (Once provenance keeps run-specific fields out of the digest, this is the digest.)"""
    manifest = json.loads(json.dumps(cache.manifest))
    manifest["checksums"].pop("provenance.json")
    provenance = {
        k: v for k, v in cache.provenance.items() if k in ("model", "capture", "prompts", "sampling")
    }
    provenance["capture"] = {k: v for k, v in provenance["capture"].items() if k != "kernels"}
    manifest["provenance_content"] = hashlib.sha256(
        json.dumps(provenance, sort_keys=True).encode()
    ).hexdigest()
    return integrity.manifest_digest(manifest)


def test_the_stored_distribution_is_vllms_on_the_cached_logits(sampled_cache):
    cache = hscache.open_cache(sampled_cache)
    setting = cache.sampling
    assert setting == SamplingSetting.from_flags("qwen-thinking", samples_per_prompt=2, seed=7)
    assert [cache.specs[n].row_shape for n in SAMPLED_ARRAYS] == [(40,), (40,), ()]
    checked = 0
    for row in range(len(cache)):
        tokens, logits = cache.token_ids(row), cache.target_logits(row)
        ids, probs = cache.sampled_support(row)
        realised = cache.realised_prob(row)
        prompt_len = int(cache.index["prompt_len"][row].as_py())
        for t in range(len(tokens)):
            if not prompt_len - 1 <= t < len(tokens) - 1:  # nothing drawn here
                assert (ids[t] == -1).all() and (probs[t] == 0).all() and realised[t].isnan()
                continue
            want = vllm_processed(
                logits[t], tokens[:prompt_len].tolist(), tokens[prompt_len : t + 1].tolist(), setting
            )
            got = torch.zeros_like(want)
            got[ids[t][ids[t] >= 0]] = probs[t][ids[t] >= 0]
            assert torch.equal(got > 0, want > 0), (row, t)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-7)  # fp32 rounding of probabilities <= 1
            # Every drawn token lies in the stored support, and its stored probability is its own.
            assert realised[t] > 0 and realised[t] == got[tokens[t + 1]], (row, t)
            checked += 1
    assert checked == sum(
        len(cache.token_ids(r)) - int(cache.index["prompt_len"][r].as_py()) for r in range(len(cache))
    )
    counts = cache.provenance["sampling"]
    assert (counts["sampled_positions"], counts["realised_outside_support"]) == (checked, 0)


def test_samples_are_index_rows_of_their_prompt(sampled_cache):
    cache = hscache.open_cache(sampled_cache)
    index = cache.index.to_pylist()
    assert [(r["record_id"], r["sample"]) for r in index] == [
        (rid, s) for rid in ("fizzbuzz", "binary_search", "reverse_linked_list") for s in (0, 1)
    ]
    pairs = [(cache.token_ids(2 * i), cache.token_ids(2 * i + 1)) for i in range(3)]
    assert all(not torch.equal(a, b) for a, b in pairs)  # two samples of one prompt differ
    assert cache.manifest["settings"]["sampling"]["seed"] == 7


def test_every_kind_of_view_reads_the_sampled_arrays(sampled_cache, tmp_path):
    cache = hscache.open_cache(sampled_cache)
    sharded = hscache.open_cache(split_into_shards(cache, tmp_path / "sharded", 2))
    in_memory = RowRangeView(cache, read_rows(cache, range(1, 3), SAMPLED_ARRAYS))
    for view in (sharded, in_memory):
        assert view.sampling == cache.sampling
        for row in range(len(cache)):
            (ids, probs), (want_ids, want_probs) = view.sampled_support(row), cache.sampled_support(row)
            assert ids.dtype == torch.int64 and torch.equal(ids, want_ids) and torch.equal(probs, want_probs)
            assert torch.equal(
                view.realised_prob(row).nan_to_num(-1), cache.realised_prob(row).nan_to_num(-1)
            )


def test_info_carries_the_setting_in_both_forms(sampled_cache, fp32_cache):
    text = CliRunner().invoke(main, ["info", str(sampled_cache)]).output
    line = next(x for x in text.splitlines() if x.startswith("sampling"))
    assert line == (
        "sampling   temperature 1, top_p 0.95, top_k 20, min_p 0, presence 1.5, frequency 0, repetition 1, seed 7, "
        "2 sample(s) per prompt, preset qwen-thinking; vllm order, drawn by hscache (seeded Gumbel-max); 0 of 96 "
        "drawn tokens outside the stored support"
    )
    summary = json.loads(CliRunner().invoke(main, ["info", str(sampled_cache), "--json"]).output)
    assert summary["sampling"]["top_k"] == 20 and summary["expected_sequences"] == 6 == summary["sequences"]
    greedy = json.loads(CliRunner().invoke(main, ["info", str(fp32_cache), "--json"]).output)["sampling"]
    assert (
        greedy["greedy"] and greedy["temperature"] == 0 and greedy["description"] == "greedy (temperature 0)"
    )


def test_a_greedy_cache_records_nothing_new(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    assert cache.sampling == GREEDY and hscache.sampling_setting(cache) == GREEDY
    assert "sampling" not in cache.settings and "sampling" not in cache.provenance
    assert set(cache.specs) == {
        "hidden_states", "token_ids", "target_argmax", "target_topk_values", "target_topk_ids", "target_logsumexp"
    }  # fmt: skip
    assert "sample" not in cache.index.column_names
    with pytest.raises(KeyError, match="sampled_support_ids"):
        cache.sampled_support(0)


@pytest.mark.slow
def test_kill9_then_resume_gives_the_same_cache_as_one_run(tmp_path, sampled_cache, cli_server):
    out = tmp_path / "c"
    flags = []
    for key, value in SAMPLED_CACHE_CONFIG.items():
        if key == "full_logits":
            flags.append("--full-logits")
        elif key == "mtp":
            flags.append("--no-mtp")
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    args = ["extract", "--out", str(out), *flags, *SAMPLED_CACHE_FLAGS, "--quiet"]
    proc = cli_server.start(args)  # its own process (forked warm: no torch import to pay)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads((out / "manifest.json").read_text())["committed"]["sequences"] >= 2:
                proc.kill()  # SIGKILL mid-run: no cleanup
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.002)
    proc.wait()
    committed = json.loads((out / "manifest.json").read_text())["committed"]["sequences"]
    assert 2 <= committed < 6, committed  # killed mid-run, at a commit
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the same command, resumed in-process (one thread, as the reference was built)
        setting = SamplingSetting.from_flags("qwen-thinking", samples_per_prompt=2, seed=7)
        result = hscache.extract(
            hscache.ExtractConfig(out=str(out), sampling=setting, **SAMPLED_CACHE_CONFIG)
        )
    finally:
        torch.set_num_threads(before)
    assert result.resumed_from == committed and result.sequences == 6
    resumed, reference = hscache.open_cache(out), hscache.open_cache(sampled_cache)
    for name in reference.specs:  # bit for bit, the chunk hashes of the manifest included
        assert (
            resumed.manifest["arrays"][name]["chunk_sha256"]
            == reference.manifest["arrays"][name]["chunk_sha256"]
        )
    assert resumed.index.to_pylist() == reference.index.to_pylist()
    assert _content_digest(resumed) == _content_digest(reference)


def test_a_greedy_cache_is_not_resumed_as_a_sampled_one(tmp_path, fp32_cache):
    import shutil

    out = shutil.copytree(fp32_cache, tmp_path / "c")
    before = {p: p.read_bytes() for p in Path(out).rglob("*") if p.is_file()}
    setting = SamplingSetting.from_flags("qwen-thinking")
    config = hscache.ExtractConfig(
        out=str(out), layers="0,1,2,3,4,5,6,7", max_new_tokens=12, dtype="fp32", limit=4, sampling=setting
    )
    with pytest.raises(
        ResumeMismatchError, match=r"was built with --sampling greedy but this run has --sampling temp"
    ):
        hscache.extract(config)
    assert {p: p.read_bytes() for p in Path(out).rglob("*") if p.is_file()} == before  # nothing lost


def test_sampled_extraction_refuses_cached_text(tmp_path):
    result = CliRunner().invoke(
        main,
        ["extract", "--out", str(tmp_path / "c"), "--sampling", "qwen-thinking", "--max-new-tokens", "0"],
    )
    assert result.exit_code == 2 and result.output.strip() == (
        "error: sampling draws new tokens, and --max-new-tokens 0 / --tokens-from cache given text as it is: "
        "raise --max-new-tokens, or drop the sampling flags"
    )
    assert not np.any([p.is_file() for p in (tmp_path / "c").rglob("*")])


def test_verify_and_diff_reports_carry_the_setting(sampled_cache, fp32_cache, tmp_path):
    from hscache import schemas
    from hscache.diff.compare import diff_caches
    from hscache.verify import VerifyConfig, verify_cache

    described = hscache.open_cache(sampled_cache).sampling.describe()
    report = verify_cache(sampled_cache, VerifyConfig())
    assert report.ok and report.sampling == described and report.to_dict()["sampling"] == described
    schemas.validate(report.to_dict(), "verify_report")
    assert verify_cache(fp32_cache, VerifyConfig()).sampling == "greedy (temperature 0)"
    diff = diff_caches(sampled_cache, sampled_cache).to_dict()
    schemas.validate(diff, "diff_report")
    assert diff["cache_a"]["sampling"] == diff["cache_b"]["sampling"] == described
