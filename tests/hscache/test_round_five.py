"""Issue 36, faults and hostile input round five: the store's side.

Each test failed before its fix. The caches are the session fixtures (tests/hscache/conftest.py,
tests/conftest.py), copied where a test edits them; CLI runs are in-process (CliRunner) or forked
from the warm server (tests/hscache/forked_cli.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import hscache
from hscache.cli import main as hscache_main
from scorer import init_drafter
from scorer.cli import main as scorer_main
from tests.cli_result import one_line_refusal


@pytest.fixture(scope="module")
def drafter(small_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("round-five") / "drafter"
    init_drafter(small_cache.path, out, num_layers=1, block_size=4)
    return out


def _eval(drafter: Path, cache: Path, out: Path, *extra: str):
    result = CliRunner().invoke(
        scorer_main, ["eval", str(drafter), "--cache", str(cache), "--ddtree", "", "--json", str(out), *extra]
    )
    return result, json.loads(out.read_text()) if result.exit_code == 0 else None


# 1. A target/ file swapped while eval runs: the bytes hashed at open are the bytes used.
def test_a_target_file_swapped_after_open_is_not_scored_under_the_pinned_digest(
    small_cache, drafter, tmp_path, monkeypatch
):
    root = small_cache.copy(tmp_path / "cache")
    pinned = hscache.cache_digest(hscache.open_cache(root))
    _, clean = _eval(drafter, root, tmp_path / "clean.json", "--expect-digest", pinned)
    head = root / "target" / "head.safetensors"
    original = load_file(str(head))
    real_open = hscache.open_cache

    def open_then_swap(path, **kwargs):
        cache = real_open(path, **kwargs)
        permuted = {k: v.flip(0).contiguous() for k, v in original.items()}  # same size, rows reversed
        save_file(permuted, str(head.with_name("swap")), metadata={"tied": "true"})
        head.with_name("swap").replace(head)
        config = root / "target" / "config.json"
        config.write_text(config.read_text().replace('"num_hidden_layers": ', '"num_hidden_layers": 1'))
        return cache

    monkeypatch.setattr(hscache, "open_cache", open_then_swap)
    result, report = _eval(drafter, root, tmp_path / "swapped.json", "--expect-digest", pinned)
    assert "Traceback" not in result.output
    if result.exit_code == 0:  # scored: then from the bytes hashed at open, i.e. the clean scores
        assert report["cache"]["digest"] == pinned
        assert report["tau"] == clean["tau"], (report["tau"], clean["tau"])
    else:
        assert one_line_refusal(result), result.output
    # The Python API: every target file is what open_cache hashed, whatever is on disk now.
    cache = real_open(small_cache.path)
    swapped = real_open(small_cache.copy(tmp_path / "api"))
    for rel in ("target/head.safetensors", "target/config.json", "target/tokenizer.json", "provenance.json"):
        (swapped.path / rel).write_bytes(b"{}" if rel.endswith(".json") else (root / rel).read_bytes())
    assert swapped.target_config == cache.target_config and swapped.provenance == cache.provenance
    assert all((swapped.target_head()[k] == v).all() for k, v in cache.target_head().items())
    assert swapped.vocab_size == cache.vocab_size
    assert swapped.tokenizer()("hello world")["input_ids"] == cache.tokenizer()("hello world")["input_ids"]


# 3. A sampled cache: its intended NaN rows are not damage, and its distributions are checked.
def _verify(root: Path, *flags: str):
    result = CliRunner().invoke(hscache_main, ["verify", "--deep", "--json", *flags, str(root)])
    return result, json.loads(result.output) if result.output.startswith("{") else None


def test_verify_deep_passes_a_clean_sampled_cache_and_checks_its_distributions(sampled_cache, tmp_path):
    import numpy as np
    import zarr

    from tests.hscache.tamper import reseal

    clean, report = _verify(sampled_cache)
    assert clean.exit_code == 0 and report["checks"]["sampling"] == "ok", clean.output[-2000:]
    cache = hscache.open_cache(sampled_cache)
    row, (start, _) = 1, cache.sequence_span(1)
    t = start + int(cache.index["prompt_len"][row].as_py())  # a row whose next token was drawn

    def tripled(root: Path) -> None:
        array = zarr.open_array(str(root / "arrays" / "sampled_support_probs"), mode="r+")
        array[t] = np.asarray(array[t]) * 3

    def moved(root: Path) -> None:  # the drawn token's support entry renamed: drawn outside the support
        ids = zarr.open_array(str(root / "arrays" / "sampled_support_ids"), mode="r+")
        drawn = int(np.asarray(zarr.open_array(str(root / "arrays" / "token_ids"))[t + 1]))
        row_ids = np.asarray(ids[t])
        row_ids[row_ids == drawn] = max(int(row_ids.max()) + 1, drawn + 1)
        ids[t] = row_ids

    for name, edit in (("probabilities x3", tripled), ("drawn token moved out of the support", moved)):
        root = shutil.copytree(sampled_cache, tmp_path / name.replace(" ", "-"))
        edit(root)
        reseal(root)
        result, found = _verify(root)
        assert result.exit_code == 1 and found["checks"]["sampling"] == "failed", (
            name,
            result.output[-1500:],
        )
        assert [b["record_id"] for b in found["bad_sequences"]] == [cache.index["record_id"][row].as_py()], (
            name
        )


# 4. A directory of shards with another cache's files at its top level: verify what eval reads.
def test_a_directory_with_shards_and_a_cache_of_its_own_is_refused_by_verify_and_eval(
    small_cache, drafter, tmp_path
):
    from tests.hscache.test_cache_contract import split_into_shards

    sharded = split_into_shards(hscache.open_cache(small_cache.path), tmp_path / "sharded", 2)
    pinned = hscache.cache_digest(hscache.open_cache(sharded))
    for path in small_cache.path.iterdir():  # another cache's files, copied into the top level
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, sharded / path.name)
    verify = CliRunner().invoke(hscache_main, ["verify", "--deep", "--expect-digest", pinned, str(sharded)])
    assert verify.exit_code != 0 and "Traceback" not in verify.output, verify.output[-1500:]
    assert "holds both a cache of its own (manifest.json) and shard folders" in verify.output
    scored, _ = _eval(drafter, sharded, tmp_path / "eval.json")
    assert one_line_refusal(scored), scored.output
    assert "holds both a cache of its own (manifest.json) and shard folders" in scored.output


class _Run:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output, self.exception = exit_code, output, None


def _forked(args_of: dict, tmp: Path, seconds: float) -> dict:
    """Each CLI run of ``args_of`` ({name: (main, args)}) in a fork of this process, killed after
    ``seconds``: a hang (a FIFO opened for reading waits for a writer forever, in whichever thread)
    is a result ("hung"), never a stalled suite. Forked, not started: no interpreter start-up."""
    import os
    import signal
    import time

    results = {}
    for name, (main, args) in args_of.items():
        out = tmp / f"forked-{name}.json"
        pid = os.fork()
        if pid == 0:  # the child: run the CLI in-process, write its result, leave without cleanup
            try:
                result = CliRunner().invoke(main, args)
                text = result.output + (
                    "".join(__import__("traceback").format_exception(result.exception))
                    if result.exception and not isinstance(result.exception, SystemExit)
                    else ""
                )
                out.write_text(json.dumps({"exit_code": result.exit_code, "output": text}))
            finally:
                os._exit(0)
        deadline = time.monotonic() + seconds
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        results[name] = _Run(**json.loads(out.read_text())) if out.exists() else None
    return results


def _eval_and_verify(drafter: Path, root: Path, pinned: str, tmp: Path, seconds: float = 60):
    """verify --deep --expect-digest and eval --expect-digest of ``root``, each forked (``_forked``)."""
    runs = _forked(
        {
            "verify": (hscache_main, ["verify", "--deep", "--expect-digest", pinned, str(root)]),
            "eval": (
                scorer_main,
                ["eval", str(drafter), "--cache", str(root), "--ddtree", "", "--expect-digest", pinned],
            ),
        },
        tmp,
        seconds,
    )
    assert runs["verify"] is not None, f"verify of {root.name} hung"
    assert runs["eval"] is not None, f"eval of {root.name} hung"
    return runs["verify"], runs["eval"]


# 5. Links out of the cache: refused by every reader, not only flagged by verify.
@pytest.mark.parametrize(
    "rel",
    ["arrays/hidden_states/c/0/0/0", "arrays/token_ids/c/0", "arrays/hidden_states/c/1", "manifest.json"],
)
def test_a_link_out_of_the_cache_is_refused_by_eval_and_verify(small_cache, drafter, tmp_path, rel):
    root = small_cache.copy(tmp_path / "cache")
    pinned = hscache.cache_digest(hscache.open_cache(root))
    outside = tmp_path / "outside"
    (shutil.copytree if (root / rel).is_dir() else shutil.copy2)(root / rel, outside)  # the same bytes
    (shutil.rmtree if (root / rel).is_dir() else Path.unlink)(root / rel)
    (root / rel).symlink_to(outside)
    verify, scored = _eval_and_verify(drafter, root, pinned, tmp_path)
    assert verify.exit_code != 0 and "Traceback" not in verify.output, verify.output[-800:]
    assert one_line_refusal(scored), scored.output
    assert "outside the cache" in scored.output, scored.output


# 6. A FIFO (or another non-regular file) in place of a cache file: refused, never waited on.
@pytest.mark.parametrize(
    "rel",
    [
        "arrays/hidden_states/c/0/0/0",
        "arrays/token_ids/c/0",
        "arrays/target_topk_values/c/0/0",
        "target/head.safetensors",
        "manifest.json",
    ],
)
def test_a_fifo_in_place_of_a_cache_file_is_refused_without_waiting(small_cache, drafter, tmp_path, rel):
    import os

    root = small_cache.copy(tmp_path / "cache")
    pinned = hscache.cache_digest(hscache.open_cache(root))
    (root / rel).unlink()
    os.mkfifo(root / rel)
    verify, scored = _eval_and_verify(drafter, root, pinned, tmp_path, seconds=30)
    assert verify.exit_code != 0 and "Traceback" not in verify.output, verify.output[-800:]
    assert one_line_refusal(scored), scored.output


# 7. Decompression bombs in the SpecForge importer: sizes bounded before anything is allocated.
def _zeros_into(stream, nbytes: int) -> None:
    block = bytes(1 << 20)
    for _ in range(nbytes >> 20):
        stream.write(block)


def test_specforge_decompression_bombs_are_refused_before_allocating(tmp_path):
    import gzip
    import io
    import resource
    import zipfile

    import torch

    bomb = 256 << 20  # inflates 1000x: real hidden states compress ~1.2x (docs/storage.md)
    small = {
        "input_ids": torch.arange(4),
        "loss_mask": torch.ones(4, dtype=torch.int64),
        "hidden_states": torch.zeros(1, 4, 8),
    }
    buffer = io.BytesIO()
    torch.save(small, buffer)
    gz = tmp_path / "gz" / "rows_0-2000" / "data_0.ckpt.gz"
    gz.parent.mkdir(parents=True)
    with gzip.open(gz, "wb", compresslevel=1) as f:
        f.write(buffer.getvalue())
        _zeros_into(f, bomb)  # trailing bytes a reader must inflate to find where the file ends
    deflated = tmp_path / "zip" / "rows_0-2000" / "data_0.ckpt"
    deflated.parent.mkdir(parents=True)
    with (
        zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src,
        zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst,
    ):
        for info in src.infolist():
            if info.filename.endswith("/data/0"):  # the hidden states' storage, declared 256 MiB
                with dst.open(info.filename, "w", force_zip64=True) as f:
                    _zeros_into(f, bomb)
            else:
                dst.writestr(info.filename, src.read(info.filename))
    for folder in ("gz", "zip"):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = CliRunner().invoke(
            hscache_main,
            ["import", "--format", "specforge", str(tmp_path / folder), "--layer-ids", "1",
             "--out", str(tmp_path / f"out-{folder}")],
        )  # fmt: skip
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert one_line_refusal(result), (folder, result.output[-1500:])
        assert "inflates to more than" in result.output, result.output
        assert grown_mb < 128, (folder, grown_mb)
        assert not (tmp_path / f"out-{folder}" / "manifest.json").exists()  # only the restart mark


def _specforge_folder(root: Path, files: int = 2, tokens: int = 4) -> Path:
    import torch

    for i in range(files):
        path = root / "rows_0-2000" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "input_ids": torch.arange(tokens) + i,
                "loss_mask": (torch.arange(tokens) >= 2).to(torch.int64),
                "hidden_states": torch.randn(1, tokens, 8, generator=torch.Generator().manual_seed(i)),
            },
            path,
        )
    return root


# 13. Complete means every file written; 15. a stray import mark beside a complete cache is stale.
def test_an_import_killed_after_its_completion_mark_holds_every_file(tmp_path, monkeypatch):
    import os
    import signal

    from hscache.store.writer import StoreWriter

    source = _specforge_folder(tmp_path / "forge")
    args = ["import", "--format", "specforge", str(source), "--layer-ids", "1", "--out"]
    finished = CliRunner().invoke(hscache_main, [*args, str(tmp_path / "finished")])
    assert finished.exit_code == 0, finished.output
    real_finish = StoreWriter.finish

    def finish_then_die(self):  # kill -9 the moment the cache is marked complete
        real_finish(self)
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(StoreWriter, "finish", finish_then_die)
    assert (
        _forked({"import": (hscache_main, [*args, str(tmp_path / "killed")])}, tmp_path, 60)["import"] is None
    )
    monkeypatch.undo()
    killed = tmp_path / "killed"
    assert (killed / ".hscache-importing").exists()  # killed before the import removed its mark
    info = CliRunner().invoke(hscache_main, ["info", "--json", str(killed)])
    summary = json.loads(info.output)
    assert summary["complete"] and not summary["interrupted_import"], info.output
    assert (killed / "provenance.json").is_file()
    assert summary["digest"] == hscache.cache_digest(hscache.open_cache(tmp_path / "finished"))


# 9. Hostile speculators folders: one line each, no traceback, no probe outside the folder.
def _text(rel: str, text: str):
    return lambda root: (root / rel).write_text(text)


def _sidecar(change):
    def edit(root: Path) -> None:
        path = root / "hscache_export.json"
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document))

    return edit


def _truncated(rel: str, keep: int):
    def edit(root: Path) -> None:
        data = (root / rel).read_bytes()
        (root / rel).write_bytes(data[:keep])

    return edit


@pytest.fixture(scope="module")
def speculators_folder(bf16_cache, tmp_path_factory) -> Path:
    from hscache.interop.speculators import export_speculators

    out = tmp_path_factory.mktemp("round-five-spec") / "speculators"
    export_speculators(bf16_cache, out)
    return out


HOSTILE_SPECULATORS = {
    "state.json nested 100,000 deep": _text("state.json", "[" * 100_000 + "]" * 100_000),
    "state.json a list": _text("state.json", "[]"),
    "state.json _data_files a string": _text("state.json", json.dumps({"_data_files": "data.arrow"})),
    "state.json _data_files of numbers": _text("state.json", json.dumps({"_data_files": [5]})),
    "state.json names a missing shard": _text(
        "state.json", json.dumps({"_data_files": [{"filename": "x.arrow"}]})
    ),
    "arrow file truncated": _truncated("data-00000-of-00001.arrow", 100),
    "arrow file garbage": _text("data-00000-of-00001.arrow", "not arrow at all"),
    "hs_0 truncated": _truncated("hidden_states/hs_0.safetensors", 200),
    "hs_0 empty": _truncated("hidden_states/hs_0.safetensors", 0),
    "hs_0 header garbage": _text(
        "hidden_states/hs_0.safetensors", "\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"
    ),
    "sidecar a list": _text("hscache_export.json", "[1]"),
    "sidecar record ids numbers": _sidecar(lambda d: d.update(record_ids=[1, 2, 3, 4])),
    "sidecar record ids a string": _sidecar(lambda d: d.update(record_ids="abcd")),
    "sidecar layer ids strings": _sidecar(lambda d: d.update(vllm_layer_ids=["a", "b", "c"])),
    "sidecar layer ids past the target": _sidecar(lambda d: d.update(vllm_layer_ids=[2, 4, 20000])),
    "sidecar files outside the folder": _sidecar(lambda d: d.update(files=["../../../../etc/hostname"])),
}


def test_hostile_speculators_folders_are_one_line_each(speculators_folder, tmp_path):
    failures = []
    for k, (name, edit) in enumerate(HOSTILE_SPECULATORS.items()):
        source = shutil.copytree(speculators_folder, tmp_path / f"s{k}")
        edit(source)
        result = CliRunner().invoke(
            hscache_main, ["import", "--format", "speculators", str(source), "--out", str(tmp_path / f"o{k}")]
        )
        if not one_line_refusal(result):
            failures.append(f"{name}: exit {result.exit_code}: {result.output[-400:]!r} {result.exception!r}")
        elif "outside" in name and "which is not a path inside" not in result.output:
            failures.append(f"{name}: probed the path instead of refusing it: {result.output!r}")
    assert not failures, "\n".join(failures)
    # --layer-ids past the target's layer count (the sidecar records it): refused, never a cache info cannot read
    result = CliRunner().invoke(
        hscache_main,
        ["import", "--format", "speculators", str(speculators_folder), "--layer-ids", "2,4,20000",
         "--out", str(tmp_path / "layers")],
    )  # fmt: skip
    assert one_line_refusal(result) and "20000" in result.output, result.output


# 10. An index whose prompt_len is out of range, resealed: one line from eval, never a ValueError.
@pytest.mark.parametrize("change", ["0", "len+5", "-7", "2^31-1"])
def test_an_out_of_range_prompt_len_resealed_is_one_line(small_cache, drafter, tmp_path, change):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.hscache.tamper import reseal

    root = small_cache.copy(tmp_path / "cache")
    part = root / "index" / "part-000000.parquet"
    table = pq.read_table(part)
    lengths = table.column("length").to_pylist()
    new = {"0": lambda n: 0, "len+5": lambda n: n + 5, "-7": lambda n: -7, "2^31-1": lambda n: 2**31 - 1}[
        change
    ]
    i = table.column_names.index("prompt_len")
    values = [new(lengths[0]), *table.column("prompt_len").to_pylist()[1:]]
    pq.write_table(table.set_column(i, "prompt_len", pa.array(values, pa.int32())), part)
    reseal(root)
    result, report = _eval(drafter, root, tmp_path / "eval.json")
    assert "Traceback" not in result.output and not (
        result.exception and not isinstance(result.exception, SystemExit)
    ), (result.output, result.exception)
    assert one_line_refusal(result) and "prompt_len" in result.output, result.output


def test_a_lone_surrogate_in_a_prompt_or_an_id_is_refused_before_anything_is_written(tmp_path):
    for record in ({"id": "a", "prompt": "x\ud800y"}, {"id": "\udc00", "prompt": "hello"}):
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps(record) + "\n")  # json.dumps writes the escape: the file is UTF-8
        out = tmp_path / "out"
        result = CliRunner().invoke(
            hscache_main, ["extract", "--prompts", str(prompts), "--out", str(out), "--quiet"]
        )
        assert one_line_refusal(result) and "lone surrogate" in result.output, result.output
        assert not (out / "manifest.json").exists()


# 11. A shard that selects no record: refused before anything is written, never a shard that never completes.
def test_a_shard_that_selects_no_record_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "sharded"
    result = CliRunner().invoke(
        hscache_main,
        ["extract", "--out", str(out), "--limit", "2", "--shard", "3/4", "--max-new-tokens", "2", "--quiet"],
    )
    assert one_line_refusal(result) and "--shard 3/4 selects no record" in result.output, result.output
    assert not out.exists(), list(out.rglob("*"))


# 14. verify while `hscache recompress` swaps the arrays: one consistent state, never phantom damage.
def test_verify_during_a_recompress_checks_one_consistent_state(small_cache, tmp_path, monkeypatch):
    import hscache.verify as verify_module

    root = small_cache.copy(tmp_path / "cache")
    real_scan, swapped = verify_module.scan_sequences, []

    def scan_after_a_recompress(layout, report, progress):
        # The arrays were opened with their codecs; a recompress now swaps every array (forked, as a
        # concurrent process would): this pass reads the new chunk files with the old metadata.
        if not swapped:
            run = _forked({"recompress": (hscache_main, ["recompress", str(root), "--compression", "balanced"])},
                          tmp_path, 120)["recompress"]  # fmt: skip
            assert run is not None and run.exit_code == 0, run and run.output
            swapped.append(True)
        return real_scan(layout, report, progress)

    monkeypatch.setattr(verify_module, "scan_sequences", scan_after_a_recompress)
    result = CliRunner().invoke(hscache_main, ["verify", "--deep", "--json", str(root)])
    report = json.loads(result.output)
    assert swapped and result.exit_code == 0 and report["ok"], result.output[-2000:]


# 15. `scorer init --overwrite` killed between its renames: the next run clears what it left.
def test_the_leftovers_of_a_killed_init_overwrite_are_cleared_by_the_next_run(small_cache, drafter, tmp_path):
    out = tmp_path / "d"
    shutil.copytree(drafter, out)
    config = (out / "config.json").read_text()
    dead = 32768 * 128 + 1  # no process has this pid (above any pid_max)
    # killed after moving the old drafter aside and before publishing the new one:
    out.rename(tmp_path / f".d.replaced-{dead}")
    (tmp_path / f".d.staging-{dead}").mkdir()
    (tmp_path / f".d.staging-{dead}" / "config.json").write_text("{}")
    result = CliRunner().invoke(
        scorer_main, ["eval", str(out), "--cache", str(small_cache.path), "--ddtree", ""]
    )
    assert result.exit_code != 0  # the drafter is not there until a writer recovers it
    init = CliRunner().invoke(
        scorer_main,
        ["init", str(out), "--cache", str(small_cache.path), "--draft-layers", "1", "--block-size", "4"],
    )
    # The old drafter is back (nothing written is lost), so a run without --overwrite is refused...
    assert init.exit_code != 0 and "not empty; pass --overwrite" in init.output, init.output
    assert (out / "config.json").read_text() == config
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".d.")) == []


# 15. The index: what a reader refuses, verify refuses; nothing under index/ escapes the seal.
def test_index_damage_that_readers_refuse_fails_verify_too(small_cache, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.hscache.tamper import reseal

    broken = small_cache.copy(tmp_path / "metadata")
    part = broken / "index" / "part-000000.parquet"
    table = pq.read_table(part)
    i = table.column_names.index("metadata_json")
    pq.write_table(table.set_column(i, "metadata_json", pa.array(["{"] * table.num_rows, pa.string())), part)
    reseal(broken)
    extra = small_cache.copy(tmp_path / "unlisted")
    shutil.copy2(extra / "index" / "part-000000.parquet", extra / "index" / "part-000001.parquet")
    for root in (broken, extra):
        with pytest.raises(hscache.CacheFormatError):
            hscache.open_cache(root)
        result, report = _verify(root)
        assert result.exit_code == 1 and not report["ok"], (root.name, result.output[-1500:])
