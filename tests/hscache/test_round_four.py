"""Issue 26 ("Hard edges, round four"), hscache's items: a digest that a re-run keeps, refusals
before the work, not-a-cache errors that fit the path, diff of imports and of other targets, info
and progress that say what they mean."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import hscache
from hscache import schemas
from hscache.cli import main
from hscache.errors import CacheFormatError
from hscache.store.integrity import content_sha256
from hscache.store.lock import writer_lock
from hscache.store.run_log import provenance_with_runs, read_run_log
from hscache.store.writer import publish_manifest
from hscache.verify import verify_cache
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime: a run that "changes nothing" must leave both."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _one_line(result, *, code: int = 2) -> str:
    text = result.output.strip()
    assert result.exit_code == code, result.output
    assert text.startswith("error: ") and "\n" not in text, text
    return text.removeprefix("error: ")


# ----------------------------------------------------------------------------- item 1: the digest


def test_a_rerun_on_a_complete_cache_changes_no_byte_and_keeps_the_digest(small_cache, tmp_path):
    """Was: "resumed after 12", provenance.json rewritten, another digest; --expect-digest then failed."""
    out = small_cache.copy(tmp_path / "c")
    digest = hscache.cache_digest(hscache.open_cache(out))
    before = _files(out)
    result = CliRunner().invoke(main, small_cache.cli_args(out))
    assert result.exit_code == 0, result.output
    tokens = hscache.open_cache(out).num_tokens
    assert result.output == (
        f"{out} is already complete with these settings (12 sequences, {tokens} tokens): nothing to do, "
        f"nothing written; digest {digest}\n"
    )
    assert _files(out) == before
    verified = CliRunner().invoke(main, ["verify", str(out), "--expect-digest", digest, "--json"])
    assert verified.exit_code == 0 and json.loads(verified.output)["digest"] == digest


def test_two_extractions_of_the_same_prompts_give_one_digest(small_cache, tmp_path):
    """Same settings, same machine, bit-identical rows: one digest, whatever the commit rhythm (the
    reference committed after every sequence, this run once at the end); only the run logs differ."""
    out = tmp_path / "again"
    hscache.extract(small_cache.config_for(out, commit_every_s=3600.0))
    again, reference = hscache.open_cache(out), hscache.open_cache(small_cache.path)
    assert again.manifest["index_parts"] == reference.manifest["index_parts"] == ["index/part-000000.parquet"]
    assert hscache.cache_digest(again) == hscache.cache_digest(reference)
    assert (out / "provenance.json").read_bytes() == (small_cache.path / "provenance.json").read_bytes()
    assert read_run_log(out)[0]["started_at"] >= read_run_log(small_cache.path)[0]["started_at"]


def test_the_run_log_is_sealed_but_outside_the_digest(small_cache, tmp_path):
    out = small_cache.copy(tmp_path / "c")
    digest = hscache.cache_digest(hscache.open_cache(out))
    log = json.loads((out / "runs.json").read_text())
    log["runs"][0]["hardware"]["hostname"] = "elsewhere"
    (out / "runs.json").write_text(json.dumps(log))
    with pytest.raises(CacheFormatError, match=r"runs\.json (has \d+ bytes|does not match its sha256)"):
        hscache.open_cache(out)
    # Resealed (anyone can): accepted, and the digest is the same: nothing a reader scores changed.
    manifest = json.loads((out / "manifest.json").read_text())
    data = (out / "runs.json").read_bytes()
    manifest["run_log"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    publish_manifest(out, manifest)
    assert hscache.cache_digest(hscache.open_cache(out)) == digest
    assert read_run_log(out)[0]["hardware"]["hostname"] == "elsewhere"


def test_a_reader_waits_out_a_writer_between_the_run_log_and_its_checksum(small_cache, tmp_path):
    """A complete cache whose writer has published a new runs.json but not yet the manifest that
    records its checksum (what extract's last step does after finish()): a reader waits for that
    manifest while the writer holds the lock, and refuses the same files once nobody writes."""
    import threading

    out = small_cache.copy(tmp_path / "c")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"]
    data = (out / "runs.json").read_bytes().replace(b'"runs"', b'"runs" ', 1)
    opened: list = []
    with writer_lock(out, "test"):
        (out / "runs.json").write_bytes(data)  # the new run log; the manifest still has the old one
        reader = threading.Thread(target=lambda: opened.append(hscache.open_cache(out)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # waiting, not refusing
        manifest["run_log"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        publish_manifest(out, manifest)
        reader.join(5)
    assert len(opened) == 1 and len(opened[0]) == len(hscache.open_cache(small_cache.path))
    (out / "runs.json").write_bytes(data + b" ")  # nobody writes now: the mismatch is damage
    with pytest.raises(CacheFormatError, match=r"runs\.json has \d+ bytes"):
        hscache.open_cache(out)


def test_a_cache_written_before_the_run_log_still_reads_verifies_and_keeps_its_digest(small_cache, tmp_path):
    """What caches of the last release hold: provenance v1 with the run facts, no runs.json, no run_log."""
    out = small_cache.copy(tmp_path / "old")
    (run,) = read_run_log(out)
    provenance = json.loads((out / "provenance.json").read_text())
    old = provenance_with_runs({**provenance, "schema_version": 1}, [run])
    schemas.validate(old, "provenance")
    data = (json.dumps(old, indent=2, sort_keys=True) + "\n").encode()
    (out / "provenance.json").write_bytes(data)
    (out / "runs.json").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["run_log"]
    manifest["checksums"]["provenance.json"] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    publish_manifest(out, manifest)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["content_sha256"] == content_sha256(manifest)
    body = {k: v for k, v in manifest.items() if k not in ("content_sha256", "updated_at")}
    expected = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    cache = hscache.open_cache(out)
    assert hscache.cache_digest(cache) == expected  # the formula such caches were pinned with
    assert cache.provenance["timestamps"]["started_at"] == run["started_at"]
    assert verify_cache(out).ok
    info = CliRunner().invoke(main, ["info", str(out)])
    assert "runs       none recorded (written before the run log)\n" in info.output


# ----------------------------------------------------------------------------- item 2 / 14: info


def test_info_explains_its_figures_and_pins_only_a_final_digest(small_cache, tmp_path):
    cache = hscache.open_cache(small_cache.path)
    arrays = small_cache.path / "arrays"
    stored = sum(p.stat().st_size for p in arrays.rglob("*") if p.is_file() and p.name != "zarr.json")
    stored += sum(p.stat().st_size for p in arrays.glob("*/zarr.json"))
    hidden = sum(p.stat().st_size for p in (arrays / "hidden_states").rglob("*") if p.is_file())
    raw = cache.num_tokens * 3 * cache.specs["hidden_states"].row_shape[-1] * 4
    text = CliRunner().invoke(main, ["info", str(small_cache.path)]).output
    assert (
        f", {round(stored / cache.num_tokens, 1):g} B/token (every array's bytes on disk / committed tokens), "
        f"hidden states x{round(raw / hidden, 3)} (raw bytes / bytes on disk" in text
    ), text
    assert (
        f"digest     {hscache.cache_digest(cache)}  (pin it: scorer eval/hscache verify --expect-digest)"
        in text
    )

    # A cache being written: no "pin it".
    with writer_lock(small_cache.copy(tmp_path / "busy"), "hscache extract"):
        manifest = json.loads((tmp_path / "busy" / "manifest.json").read_text())
        manifest["complete"] = False
        publish_manifest(tmp_path / "busy", manifest)
        busy = CliRunner().invoke(main, ["info", str(tmp_path / "busy")]).output
    assert (
        "(not final, do not pin: a writer is adding to the cache; pin the digest once it is complete)" in busy
    )
    assert "pin it" not in busy


def test_info_on_a_cache_with_no_tokens_gives_no_per_token_figure(tmp_path):
    """Was: "37752552.0 B/token ... no tokens yet" and "(pin it)" on an interrupted empty cache."""
    from hscache.store.layout import array_specs
    from hscache.store.writer import StoreWriter

    specs = array_specs(1, 8, "float32", 4, None, 1 << 16)
    StoreWriter.create(tmp_path / "empty", specs, "none", {"layer_ids": [0]})
    summary = CliRunner().invoke(main, ["info", str(tmp_path / "empty"), "--json"])
    assert json.loads(summary.output)["bytes_per_token"] is None
    text = CliRunner().invoke(main, ["info", str(tmp_path / "empty")]).output
    assert (
        "storage    0." in text and ", none compression, no tokens yet (no per-token figure), chunk " in text
    )
    assert "B/token" not in text and "pin it" not in text
    assert "(not final, do not pin: the cache is incomplete and changes when it is finished)" in text


# ----------------------------------------------------------------------------- item 3: refuse first

_PROBE = r"""
import importlib.abc, json, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith(("torch.", "transformers")):
            raise ImportError(f"{name} imported before the refusal")
sys.meta_path.insert(0, NoTorch())
from click.testing import CliRunner
from hscache.cli import main
out = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    out.append([result.exit_code, result.output.strip()])
print(json.dumps(out))
"""


def test_every_command_refuses_bad_paths_and_flags_before_torch_is_imported(small_cache, tmp_path):
    """Was: 6-25 s to refuse a bad flag, 13.7 s for an empty prompts file, 53-59 s for a second writer
    (the model loaded first). Any torch import in the probe fails the command with a traceback."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    a_file = tmp_path / "cache.txt"
    a_file.write_text("x")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    busy = small_cache.copy(tmp_path / "busy")
    missing = tmp_path / "missing"
    cache = str(small_cache.path)
    extract = ["extract", "--quiet", "--out"]
    cases = [
        (
            [*extract, str(busy)],
            f"{busy} is being written by pid {os.getpid()} on ",
        ),
        ([*extract, str(tmp_path / "c"), "--prompts", str(empty)], f"prompts file '{empty}' has no records"),
        ([*extract, str(a_file)], f"--out {a_file} is a file, not a directory; a cache is a directory"),
        ([*extract, str(a_file / "c")], f"--out {a_file / 'c'}: {a_file} is a file, not a directory"),
        ([*extract, f"{cache}/arrays/x"], f"--out {cache}/arrays/x is inside the cache {cache}"),
        ([*extract, str(drafter)], f"--out {drafter} is a drafter or model directory (config.json, model."),
        ([*extract, str(tmp_path / "c"), "--layers", "1,x"], "--layers '1,x' is not a comma-separated list"),
        (
            [*extract, str(tmp_path / "c"), "--model", str(missing)],
            f"--model '{missing}' is neither a built-in",
        ),
        ([*extract, str(tmp_path / "c"), "--shard", "5/2"], "--shard 5/2 out of range"),
        ([*extract, str(tmp_path / "c"), "--tokens-from", str(missing)], f"{missing} does not exist"),
        (["info", str(missing)], f"{missing} does not exist"),
        (["verify", str(missing)], f"{missing} does not exist"),
        (["diff", cache, str(missing)], f"{missing} does not exist"),
        (["merge", str(missing)], f"{missing} does not exist"),
        (["recompress", str(missing), "--compression", "none"], f"{missing} does not exist"),
        (
            ["export", str(missing), "--format", "specforge", "--out", str(tmp_path / "e")],
            f"{missing} does not",
        ),
        (["export", cache, "--format", "specforge", "--out", str(a_file)], f"--out {a_file} is a file"),
        (
            ["import", "--format", "speculators", str(missing), "--out", str(tmp_path / "i")],
            f"{missing} does not",
        ),
    ]
    with writer_lock(busy, "hscache extract"):
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps([args for args, _ in cases])],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    for (args, fragment), (code, text) in zip(cases, json.loads(probe.stdout)):
        assert code == 2 and text.startswith("error: ") and "\n" not in text, (args, text)
        assert fragment in text, (args, text)
    assert not missing.exists() and not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- item 8: the right advice


def test_not_a_cache_errors_say_what_the_path_is(small_cache, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    manifest = small_cache.path / "manifest.json"
    expected = {
        manifest: f"{manifest} is inside the cache {small_cache.path}; pass the cache directory itself: "
        f"{small_cache.path}",
        tmp_path / "nope": f"{tmp_path / 'nope'} does not exist; check the path, or make one with "
        f"`hscache extract --out {tmp_path / 'nope'}`",
        empty: f"{empty} is an empty directory, not a cache; make one with `hscache extract --out {empty}`",
        drafter: f"{drafter} is a drafter or model directory (config.json, model.safetensors; no manifest.json), "
        "not a cache; pass the cache directory (scorer commands take the drafter first and the cache with --cache)",
        other: f"{other} holds no cache (no manifest.json); pass a cache directory, or make one with "
        "`hscache extract --out NEW_DIR` (a new or empty directory)",
    }
    for path, message in expected.items():
        assert _one_line(CliRunner().invoke(main, ["info", str(path)])) == message
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    assert _one_line(CliRunner().invoke(main, ["info", str(a_file)])) == (
        f"{a_file} is a file, not a cache (a cache is a directory holding manifest.json); pass the cache directory"
    )
    assert _one_line(CliRunner().invoke(main, ["merge", str(small_cache.path)])) == (
        f"{small_cache.path} is one cache, not a directory of shards (shard-IIIII-of-NNNNN/ folders written by "
        "`hscache extract --shard I/N`): there is nothing to merge, read it as it is"
    )
    args = ["import", "--format", "specforge", str(tmp_path / "nope"), "--out", str(tmp_path / "i")]
    assert _one_line(CliRunner().invoke(main, args)) == (
        f"{tmp_path / 'nope'} does not exist; pass the folder of specforge files to import (e.g. what "
        "`hscache export --format specforge` or specforge itself wrote)"
    )


# ----------------------------------------------------------------------------- items 6 and 7: diff


@pytest.fixture(scope="module")
def imported_cache(bf16_cache, tmp_path_factory) -> Path:
    """An import of speculators files without --target: hidden states and token ids only."""
    root = tmp_path_factory.mktemp("imported")
    runner = CliRunner()
    export = ["export", str(bf16_cache), "--format", "speculators", "--out", str(root / "spec")]
    assert runner.invoke(main, export).exit_code == 0
    imported = ["import", "--format", "speculators", str(root / "spec"), "--out", str(root / "c")]
    assert runner.invoke(main, imported).exit_code == 0
    return root / "c"


def test_diff_of_an_import_without_target_arrays_says_what_is_missing(imported_cache, bf16_cache):
    """Was: KeyError: 'target_topk_ids'."""
    source = imported_cache.parent / "spec"
    for args, side in (([imported_cache, bf16_cache], "A"), ([bf16_cache, imported_cache], "B")):
        text = _one_line(CliRunner().invoke(main, ["diff", *map(str, args)]))
        assert text == (
            f"cache {side} ({imported_cache}) holds no target_argmax, target_topk_values, target_topk_ids, "
            f"target_logsumexp, which hscache diff compares; re-import it with `hscache import --format "
            f"speculators {source} --out NEW --target MODEL` (the model that produced the files), which computes them"
        )


def test_the_other_commands_take_an_import_without_target_arrays(imported_cache, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(imported_cache, copy)
    runner = CliRunner()
    assert "runs       1 in runs.json" in runner.invoke(main, ["info", str(copy)]).output
    for deep in ((), ("--deep",)):
        report = json.loads(runner.invoke(main, ["verify", str(copy), "--json", *deep]).output)
        assert report["ok"] and report["checks"]["chunks"] == "ok", report["problems"]
    result = runner.invoke(main, ["recompress", str(copy), "--compression", "fast"])
    assert result.exit_code == 0 and result.output.endswith(
        f"{copy} now stores every array with compression fast\n"
    )
    assert runner.invoke(main, ["verify", str(copy), "--deep"]).exit_code == 0


def test_diff_of_two_targets_is_refused_naming_both(bf16_cache, tmp_path):
    """Was: exit 0 and "drift" (relative L2 1.24) between caches of the two built-in targets."""
    other = tmp_path / "qwen3"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(other), model="builtin:tiny-qwen3", tokens_from=str(bf16_cache), max_new_tokens=0,
            layers="1,3,7", dtype="bf16",
        )
    )  # fmt: skip
    a = json.loads((bf16_cache / "provenance.json").read_text())["model"]
    b = json.loads((other / "provenance.json").read_text())["model"]
    fields = [k for k in ("weights_sha256", "model_type", "tokenizer_sha256") if a[k] != b[k]]
    assert "weights_sha256" in fields and "model_type" in fields

    def short(v: str) -> str:
        return v[:12] if len(v) == 64 else v

    differences = "; ".join(f"{k} {short(a[k])} vs {short(b[k])}" for k in fields)
    text = _one_line(CliRunner().invoke(main, ["diff", str(bf16_cache), str(other)]))
    assert text == (
        f"A ({bf16_cache}) and B ({other}) come from different targets: builtin:tiny-qwen3.5 vs "
        f"builtin:tiny-qwen3 ({differences}), so their distance is not drift; compare caches of one target, or "
        "pass --allow-target-mismatch to compare them anyway (the report says so)"
    )
    args = [
        "diff",
        str(bf16_cache),
        str(other),
        "--allow-target-mismatch",
        "--json",
        str(tmp_path / "d.json"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        f"WARNING: A and B come from different targets ({differences}), compared anyway "
        "(--allow-target-mismatch): the distances below are not drift\n"
    )
    document = json.loads((tmp_path / "d.json").read_text())
    assert document["config"]["allow_target_mismatch"] is True
    assert (
        document["target"]["status"] == "mismatch" and document["target"]["b"]["name"] == "builtin:tiny-qwen3"
    )


# ----------------------------------------------------------------------------- items 13 / 14: progress


def test_extract_says_each_step_in_logs_and_the_last_count_once(tmp_path, monkeypatch):
    """Was: a bar at 0/12 for 70 s (model load, generation) and "extract: 8/8 sequences" twice in logs."""
    import hscache.progress

    monkeypatch.setattr(hscache.progress, "DEFAULT_EVERY_S", 0.0)  # a line at every update
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"count {i}"} for i in range(3)])
    args = ["extract", "--out", str(tmp_path / "c"), "--prompts", str(prompts), "--max-new-tokens", "2"]
    result = CliRunner().invoke(main, [*args, "--layers", "1", "--no-mtp", "--generate-batch", "2"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("extract: ")]
    assert lines[:3] == [
        "extract: loading the target builtin:tiny-qwen3.5 (fp32 on cpu)",
        "extract: checking the prompts against the tokenizer and --max-length",
        "extract: 3 sequences",
    ]
    assert any(line.endswith("generating 2 continuations of up to 2 tokens") for line in lines), lines
    assert [line for line in lines if line.startswith("extract: 3/3 sequences")] == [lines[-1]]
    assert "generating" not in lines[-1] and "capturing" not in lines[-1]


def test_a_step_note_is_one_line_on_a_terminal_too():
    from hscache.progress import StepProgress

    stream = io.StringIO()
    progress = StepProgress("extract", "sequences", stream=stream, terminal=True)
    progress.note("loading the target [builtin]")
    progress.start(2)
    progress.note("writing target/")
    progress.finish()
    text = stream.getvalue()
    assert text.startswith("extract: loading the target [builtin]\n") and "extract: writing target/\n" in text
