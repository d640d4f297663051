"""``hscache verify`` names every bad sequence and exits non-zero; a clean cache passes.

Each fault is injected into a copy of one small reference cache (~600 tokens in 256-token
chunks, so a chunk holds only some of the sequences).
"""

from __future__ import annotations

import json
import os

import google_crc32c
import numpy as np
import pytest
import zarr
from click.testing import CliRunner

import hscache
from hscache import schemas
from hscache.cli import main
from hscache.errors import CacheFormatError
from hscache.verify import VerifyConfig, verify_cache

pytestmark = pytest.mark.usefixtures("one_thread")


def _verify_cli(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["verify", "--json", *args])
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.output)
    schemas.validate(report, "verify_report")
    return result.exit_code, report


def _seqs_holding(cache: hscache.Cache, start: int, stop: int) -> list[int]:
    offsets = cache.index.column("offset").to_numpy()
    ends = offsets + cache.index.column("length").to_numpy()
    return [i for i in range(len(cache)) if offsets[i] < stop and ends[i] > start]


def _bad(report: dict, check: str) -> list[int]:
    return sorted(
        {p["seq_id"] for p in report["problems"] if p["check"] == check and p["seq_id"] is not None}
    )


@pytest.fixture
def cache_copy(tmp_path, small_cache):
    return small_cache.copy(tmp_path / "c")


def test_clean_cache_passes_every_check_and_the_report_matches_its_schema(small_cache):
    code, report = _verify_cli(str(small_cache.path), "--deep")
    assert code == 0 and report["ok"] and report["problems"] == [] and report["bad_sequences"] == []
    assert set(report["checks"].values()) == {"ok", "skipped"} and report["checks"]["chunks"] == "ok"
    assert report["sequences"] == 12 and [s["layer_id"] for s in report["layers"]] == [1, 3, 5]
    assert all(s["nan"] == 0 and s["zero_rows"] == 0 and s["norm_mean"] > 0 for s in report["layers"])
    assert report["chunks_decoded"] >= 3 * 3  # 3 chunk files in each of the three 256-token arrays
    text = CliRunner().invoke(main, ["verify", str(small_cache.path)]).output
    # Without --deep and --recompute the verdict never says OK: it names what it did not check.
    assert (
        "verdict    no problem found in what was checked; not checked: the sha256 of the rows of "
        "target_argmax, target_logsumexp, target_topk_ids, target_topk_values (--deep); a re-run of "
        "sampled sequences through the target (--recompute N)\n" in text
    ), text
    assert "chunks=ok" in text and "token_hash=ok" in text and "verdict    OK" not in text


def test_flipped_byte_in_a_chunk_names_exactly_its_sequences(cache_copy):
    path = cache_copy / "arrays" / "hidden_states" / "c" / "1" / "0" / "0"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, report = _verify_cli(str(cache_copy))
    expected = _seqs_holding(hscache.open_cache(cache_copy), 256, 512)
    assert code == 1 and _bad(report, "chunks") == expected and 0 < len(expected) < 12
    records = {s["seq_id"]: s["record_id"] for s in report["bad_sequences"]}
    assert all(records[s] for s in expected)  # each named with its record id too
    assert "hidden_states chunk 1 does not decode" in report["problems"][0]["message"]
    # The rest of the cache is still checked: other sequences pass the hash check.
    assert report["checks"]["token_hash"] == "ok"


def test_a_flip_in_a_top_k_chunk_is_found_without_deep(cache_copy):
    """Issue 26, item 2b: the quick verify said "verdict OK" with chunks=skipped on a flipped byte in
    a target_topk_values chunk; it now checks every chunk file's crc32c (--deep also decodes)."""
    path = cache_copy / "arrays" / "target_topk_values" / "c" / "2" / "0"
    data = bytearray(path.read_bytes())
    data[7] ^= 0x80
    path.write_bytes(bytes(data))
    expected = _seqs_holding(hscache.open_cache(cache_copy), 512, 768)
    for deep in ((), ("--deep",)):
        code, report = _verify_cli(str(cache_copy), *deep)
        assert code == 1 and _bad(report, "chunks") == expected and report["checks"]["chunks"] == "failed"
        assert {p["array"] for p in report["problems"]} == {"target_topk_values"}
    computed = google_crc32c.value(bytes(data[:-4])).to_bytes(4, "little").hex()
    assert (
        verify_cache(cache_copy)
        .problems[0]
        .message.endswith(
            f"target_topk_values chunk 2 fails its crc32c check (stored {bytes(data[-4:]).hex()}, computed "
            f"{computed}): a byte changed or was lost after it was written"
        )
    )
    text = CliRunner().invoke(main, ["verify", str(cache_copy)]).output
    assert f"verdict    FAILED: {len(expected)} bad sequences, {len(expected)} problems\n" in text, text


def test_truncated_chunk_is_caught(cache_copy):
    path = cache_copy / "arrays" / "token_ids" / "c" / "0"
    path.write_bytes(path.read_bytes()[:-9])
    code, report = _verify_cli(str(cache_copy))
    assert code == 1 and _bad(report, "chunks") == list(range(12))  # one 2048-token chunk holds all


def test_missing_chunk_file_would_read_as_zeros_and_is_named(cache_copy):
    (cache_copy / "arrays" / "hidden_states" / "c" / "0" / "0" / "0").unlink()
    code, report = _verify_cli(str(cache_copy))
    expected = _seqs_holding(hscache.open_cache(cache_copy), 0, 256)
    assert code == 1 and _bad(report, "files") == expected
    assert _bad(report, "zeros") == expected  # and the zeros it reads as are flagged as such


def test_deleted_index_is_named_and_readers_refuse_in_one_line(cache_copy):
    for part in (cache_copy / "index").glob("*.parquet"):
        part.unlink()
    code, report = _verify_cli(str(cache_copy))
    assert code == 1 and report["checks"]["index"] == "failed"
    assert "is missing" in report["problems"][0]["message"]
    assert report["checks"]["token_hash"] == "skipped"  # tokens cannot be attributed without an index
    with pytest.raises(CacheFormatError, match=r"index/part-\d+\.parquet is missing \(recorded at commit\)"):
        hscache.open_cache(cache_copy)


def test_nan_inf_and_zeroed_layers_are_flagged_per_sequence_and_layer(cache_copy):
    cache = hscache.open_cache(cache_copy)
    hidden = zarr.open_array(str(cache_copy / "arrays" / "hidden_states"), mode="r+")
    (s_nan, s_zero), (o_nan, o_zero) = (
        (2, 9),
        (int(cache.index["offset"][2].as_py()), int(cache.index["offset"][9].as_py())),
    )
    block = np.asarray(hidden[o_nan : o_nan + 3])
    block[0, 1, 5], block[2, 1, 0] = np.nan, np.inf  # layer position 1 = layer id 3
    hidden[o_nan : o_nan + 3] = block
    n = int(cache.index["length"][9].as_py())
    block = np.asarray(hidden[o_zero : o_zero + n])
    block[:, 2] = 0.0  # the whole of layer 5 for sequence 9: the "all-zero states" bug
    hidden[o_zero : o_zero + n] = block
    code, report = _verify_cli(str(cache_copy))
    assert code == 1
    assert [(p["seq_id"], p["layer_id"]) for p in report["problems"] if p["check"] == "nonfinite"] == [
        (s_nan, 3)
    ]
    assert [(p["seq_id"], p["layer_id"]) for p in report["problems"] if p["check"] == "zeros"] == [
        (s_zero, 5)
    ]
    layers = {s["layer_id"]: s for s in report["layers"]}
    assert (layers[3]["nan"], layers[3]["inf"]) == (1, 1) and layers[1]["nan"] == 0
    assert layers[5]["zero_rows"] == n and layers[5]["zero_fraction"] == pytest.approx(n / cache.num_tokens)
    assert s_zero in layers[5]["outlier_seq_ids"]  # a mean norm of 0 is also a robust outlier


def test_token_ids_that_do_not_match_their_hash_are_named(cache_copy):
    cache = hscache.open_cache(cache_copy)
    tokens = zarr.open_array(str(cache_copy / "arrays" / "token_ids"), mode="r+")
    offset = int(cache.index["offset"][4].as_py())
    tokens[offset + 1] = int(tokens[offset + 1]) + 1
    code, report = _verify_cli(str(cache_copy))
    assert code == 1 and _bad(report, "token_hash") == [4]


def test_index_inconsistent_with_the_manifest_is_named(cache_copy):
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    manifest["committed"]["tokens"] += 1
    (cache_copy / "manifest.json").write_text(json.dumps(manifest))
    code, report = _verify_cli(str(cache_copy))
    assert code == 1 and "lengths sum to" in report["problems"][0]["message"]


def test_recompute_is_exact_on_the_same_backend_and_catches_a_plausible_corruption(cache_copy):
    report = verify_cache(cache_copy, VerifyConfig(recompute=3, seed=1))
    assert report.ok and report.recompute["exact_expected"] and report.recompute["tolerance"] == 0.0
    assert report.recompute["max_rel_error"] == [0.0, 0.0, 0.0] and len(report.recompute["results"]) == 3
    # Scale one layer of one sequence by 1.001: finite, no zeros, checksums valid; only a re-run sees it.
    cache = hscache.open_cache(cache_copy)
    hidden = zarr.open_array(str(cache_copy / "arrays" / "hidden_states"), mode="r+")
    start, n = int(cache.index["offset"][7].as_py()), int(cache.index["length"][7].as_py())
    block = np.asarray(hidden[start : start + n])
    block[:, 0] *= np.float32(1.001)
    hidden[start : start + n] = block
    # The rewrite kept every crc32c valid; the chunk's sha256 recorded at commit names it (issue 18).
    deep = verify_cache(cache_copy, VerifyConfig(deep=True))
    assert not deep.ok and 7 in [b["seq_id"] for b in deep.bad_sequences]
    assert all("does not match its sha256 recorded at commit" in p.message for p in deep.problems)
    code, report = _verify_cli(str(cache_copy), "--recompute", "12", "--model", "builtin:tiny-qwen3.5")
    assert code == 1 and _bad(report, "recompute") == [7]
    rel = {r["seq_id"]: r["rel_error"] for r in report["recompute"]["results"]}
    assert rel[7][0] == pytest.approx(1e-3, rel=0.01) and rel[7][1:] == [0.0, 0.0]


def test_paths_from_the_manifest_cannot_leave_the_cache(cache_copy, tmp_path):
    outside = tmp_path / "outside.parquet"
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    outside.write_bytes((cache_copy / manifest["index_parts"][0]).read_bytes())
    for bad in ("index/../../outside.parquet", "/etc/passwd"):
        (cache_copy / "manifest.json").write_text(json.dumps({**manifest, "index_parts": [bad]}))
        with pytest.raises(CacheFormatError, match="which is not index/part-NNNNNN.parquet"):
            hscache.open_cache(cache_copy)
        code, report = _verify_cli(str(cache_copy))
        assert code == 1 and report["checks"]["manifest"] == "failed"
    # A listed name that is a symlink to a file outside the cache is refused too.
    link = cache_copy / "index" / "part-000777.parquet"
    os.symlink(outside, link)
    listed = {**manifest, "index_parts": [str(link.relative_to(cache_copy))]}
    (cache_copy / "manifest.json").write_text(json.dumps(listed))
    with pytest.raises(CacheFormatError, match="points outside the cache directory"):
        hscache.open_cache(cache_copy)
    code, report = _verify_cli(str(cache_copy))
    assert code == 1 and any("symlink that leads outside" in p["message"] for p in report["problems"])


def test_nothing_in_a_cache_is_unpickled(small_cache, monkeypatch):
    import pickle

    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("a cache must never be unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    cache = hscache.open_cache(small_cache.path)
    cache.hidden_states(0), cache.target_head(), cache.tokenizer(), cache.provenance
    assert verify_cache(small_cache.path, VerifyConfig(deep=True)).ok
    suffixes = {p.suffix for p in small_cache.path.rglob("*") if p.is_file()}
    assert not suffixes & {".pkl", ".pickle", ".bin", ".pt", ".pth", ".py"}, suffixes


def test_bf16_caches_verify_too(bf16_cache):
    report = verify_cache(bf16_cache, VerifyConfig(deep=True))
    assert report.ok and all(s.norm_mean and s.norm_mean > 0 for s in report.layers)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["NOPE"], "nope does not exist; check the path, or make one with `hscache extract --out "),
        (["CACHE", "--model", "builtin:tiny-qwen3.5"], "only apply to --recompute N"),
        (["CACHE", "--recompute", "1", "--model", "/no/such/model"], "is neither a built-in target"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(small_cache, tmp_path, args, fragment):
    paths = {"NOPE": str(tmp_path / "nope"), "CACHE": str(small_cache.path)}
    args = [paths.get(a, a) for a in args]
    result = CliRunner().invoke(main, ["verify", *args])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert text.startswith("error: ") and "\n" not in text and fragment in text, text


@pytest.mark.parametrize(
    "means, expected",
    [
        ([10.0, 10.001, 9.999, 10.0, 10.002, 9.998, 10.2], []),  # 7 sequences: too few to judge
        ([10.0, 10.001, 9.999, 10.0, 10.002, 9.998, 10.001, 9.999, 10.0, 10.0, 10.0, 10.2], []),  # 2%
        ([10.0, 10.001, 9.999, 10.0, 10.002, 9.998, 10.001, 9.999, 10.0, 10.0, 10.0, 0.0], [11]),  # zeroed
        ([10.0, 10.001, 9.999, 10.0, 10.002, 9.998, 10.001, 9.999, 10.0, 10.0, 10.0, 30.0], [11]),
    ],
)
def test_norm_outliers_need_enough_sequences_and_a_large_deviation(means, expected):
    """Issue #14: a 2% norm difference on a 7-sequence cache was a "robust z > 6" warning."""
    from hscache.verify.scan import robust_outliers

    rows = np.full(len(means), 4)
    assert robust_outliers(np.array(means) * rows, rows, np.ones(len(means), bool)) == expected
