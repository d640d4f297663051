"""The tampering run of issue 18, repeated: every file of a small cache edited in every way.

Each edit is applied to a fresh copy of one 4-sequence cache (one file of every kind a cache has).
Then ``hscache verify --deep`` (with and without the digest pinned before the edit) and ``scorer eval`` run in-process. Asserted, for every
edit: verify with the pinned digest fails; verify alone fails unless the edit was resealed (every
hash the manifest records recomputed, which anyone can do: that is what the digest is for); eval
refuses in one ``error:`` line with exit 2, or scores and reports another ``cache.digest``;
nothing prints a traceback. The counts are the table in docs/faults.md. CPU: ~9 s for 104 edits
(up to three in-process CLI runs each), the one test of the suite that needs it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from click.testing import CliRunner

import hscache
from hscache.cli import main as hscache_main
from hscache.store.layout import PROVENANCE, RUN_LOG, TARGET_DIR
from hscache.store.writer import SequenceRows, StoreWriter
from scorer import init_drafter
from scorer.cli import main as scorer_main
from tests.hscache.tamper import reseal

_INDEX_FIELDS = ("record_id", "prompt_len", "stop_reason", "token_sha256", "metadata_json")
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def _json_edit(rel: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        data = json.loads((root / rel).read_text())
        change(data)
        (root / rel).write_text(json.dumps(data))

    return edit


def _index_edit(column: str, change: Callable[[list], list]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        part = root / json.loads((root / "manifest.json").read_text())["index_parts"][0]
        table = pq.read_table(part)
        i = table.column_names.index(column)
        values = change(table.column(column).to_pylist())
        pq.write_table(table.set_column(i, column, pa.array(values, table.schema.field(i).type)), part)

    return edit


def _rewrite_rows(name: str) -> Callable[[Path], None]:
    """Rewrite the first committed chunk of ``name`` through zarr: other values, valid crc32c."""

    def edit(root: Path) -> None:
        array = zarr.open_array(str(root / "arrays" / name), mode="r+")
        n = min(array.chunks[0], json.loads((root / "manifest.json").read_text())["committed"]["tokens"])
        rows = np.asarray(array[:n])
        array[:n] = rows[::-1].copy() if name != "hidden_states" else rows * np.float32(1.001)

    return edit


def _swap_layers(m: dict) -> None:
    m["settings"]["layer_ids"] = list(reversed(m["settings"]["layer_ids"]))


def _strip_seal(m: dict) -> None:
    del m["checksums"], m["content_sha256"]


def _huge_shape(meta: dict) -> None:
    meta["shape"][0] = 10**12


def _big_endian(meta: dict) -> None:
    meta["codecs"][0]["configuration"]["endian"] = "big"


def _absurd_header(root: Path) -> None:
    path = root / "target" / "head.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["embed_tokens"]["shape"] = [10**9, 10**9]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])


def _symlink_arrays(root: Path) -> None:
    outside = shutil.copytree(root, root.parent / f"{root.name}-outside")
    _rewrite_rows("target_argmax")(outside)
    shutil.rmtree(root / "arrays")
    os.symlink(outside / "arrays", root / "arrays")


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _flip(rel: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        data = bytearray((root / rel).read_bytes())
        data[len(data) // 2] ^= 0x01
        (root / rel).write_bytes(bytes(data))

    return edit


def _truncate(rel: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        data = (root / rel).read_bytes()
        (root / rel).write_bytes(data[: len(data) // 2])

    return edit


def _delete(rel: str) -> Callable[[Path], None]:
    return lambda root: (root / rel).unlink()


def _deep_json(rel: str) -> Callable[[Path], None]:
    return lambda root: (root / rel).write_text(DEEP_JSON)


def _edits(files: list[str]) -> dict[str, tuple[Callable[[Path], None], bool]]:
    """name -> (edit, resealed afterwards)."""
    edits: dict[str, tuple[Callable[[Path], None], bool]] = {}
    for rel in files:
        edits[f"flip a byte of {rel}"] = (_flip(rel), False)
        edits[f"truncate {rel}"] = (_truncate(rel), False)
        if rel != "manifest.json":
            edits[f"delete {rel}"] = (_delete(rel), False)
        if rel.endswith(".json"):
            edits[f"nest {rel} 100,000 levels deep"] = (_deep_json(rel), False)
    semantic: dict[str, Callable[[Path], None]] = {
        "strip the seal": _json_edit("manifest.json", _strip_seal),
        "swap layer ids": _json_edit("manifest.json", _swap_layers),
        "prompt_len + 5": _index_edit("prompt_len", lambda v: [x + 5 for x in v]),
        "record id renamed": _index_edit("record_id", lambda v: ["other", *v[1:]]),
        "config num_hidden_layers changed": _json_edit(
            "target/config.json", lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1)
        ),
        "target_argmax big-endian": _json_edit("arrays/target_argmax/zarr.json", _big_endian),
        "hidden_states claims 10^12 rows": _json_edit("arrays/hidden_states/zarr.json", _huge_shape),
        "hidden_states rows rewritten (valid crc32c)": _rewrite_rows("hidden_states"),
        "target_argmax rows rewritten (valid crc32c)": _rewrite_rows("target_argmax"),
        "target_topk_ids rows rewritten (valid crc32c)": _rewrite_rows("target_topk_ids"),
        "absurd head.safetensors header": _absurd_header,
    }
    for name, edit in semantic.items():
        edits[name] = (edit, False)
        if name != "strip the seal":
            edits[f"{name}, resealed"] = (edit, True)
    edits["arrays/ symlinked outside the cache"] = (_symlink_arrays, False)
    # Issue 36: links out of the cache below arrays/ and at the manifest (the same bytes outside), an
    # index part the manifest does not list, and metadata that readers refuse.
    edits["a chunk file symlinked outside the cache"] = (_link_outside("arrays/hidden_states/c/0/0/0"), False)
    edits["manifest.json symlinked outside the cache"] = (_link_outside("manifest.json"), False)
    edits["an unlisted index part added"] = (_unlisted_part, False)
    edits["metadata_json '{', resealed"] = (_index_edit("metadata_json", lambda v: ["{"] * len(v)), True)
    return edits


def _link_outside(rel: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        outside = root.parent / f"{root.name}-{Path(rel).name}"
        shutil.copy2(root / rel, outside)
        (root / rel).unlink()
        os.symlink(outside, root / rel)

    return edit


def _unlisted_part(root: Path) -> None:
    shutil.copy2(root / "index" / "part-000000.parquet", root / "index" / "part-000001.parquet")


def _no_traceback(result) -> bool:
    return "Traceback" not in result.output and (
        result.exception is None or isinstance(result.exception, SystemExit)
    )


@pytest.fixture(scope="module")
def tamper_cache(small_cache, tmp_path_factory) -> Path:
    """Sequences 1, 4, 7, 10 of ``small_cache`` (those of them that fit in its 256-token chunk: all
    four, ~200 tokens, with the shipped tokenizer) rewritten as a cache of their own (as extract would
    write them: target files, provenance and ``runs.json`` recorded): one chunk per array and every
    kind of file ``small_cache`` has, once: 22 files, not 28 (~40% less CPU)."""
    source = hscache.open_cache(small_cache.path)
    dest = tmp_path_factory.mktemp("tamper") / "cache"
    writer = StoreWriter.create(dest, source.specs, source.manifest["compression"], source.settings)
    spans, tokens = [], 0
    for row in range(1, len(source), 3):
        start, stop = source.sequence_span(row)
        if tokens + stop - start <= 256:  # the smallest chunk small_cache's arrays have
            spans.append((row, start, stop))
            tokens += stop - start
    assert len(spans) >= 2, "small_cache's sequences outgrew the tamper cache's one chunk"
    for row, start, stop in spans:
        fields = source.index.slice(row, 1).to_pylist()[0]
        arrays = {name: source.read_tokens(name, start, stop) for name in source.specs}
        writer.append(SequenceRows(arrays=arrays, **{k: fields[k] for k in _INDEX_FIELDS}))
    writer.finish()
    shutil.copytree(source.path / TARGET_DIR, dest / TARGET_DIR)
    shutil.copy2(source.path / PROVENANCE, dest / PROVENANCE)
    writer.record_files([TARGET_DIR, PROVENANCE])
    writer.write_run_log((source.path / RUN_LOG).read_bytes())
    return dest


@pytest.fixture(scope="module")
def drafter(small_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tamper") / "drafter"
    init_drafter(small_cache.path, out, num_layers=1, block_size=4)
    return out


def _eval(drafter: Path, cache: Path, tmp: Path) -> tuple[object, dict | None]:
    out = tmp / f"eval-{cache.name}.json"
    result = CliRunner().invoke(
        scorer_main, ["eval", str(drafter), "--cache", str(cache), "--ddtree", "", "--json", str(out)]
    )
    return result, json.loads(out.read_text()) if result.exit_code == 0 else None


def test_every_edit_of_every_file_is_caught_without_a_traceback(tamper_cache, drafter, tmp_path):
    pinned = hscache.cache_digest(hscache.open_cache(tamper_cache))
    clean, clean_report = _eval(drafter, tamper_cache, tmp_path)
    assert clean.exit_code == 0 and clean_report["cache"]["digest"] == pinned, clean.output
    assert f"digest     {pinned}" in CliRunner().invoke(hscache_main, ["info", str(tamper_cache)]).output
    assert CliRunner().invoke(hscache_main, ["verify", "--deep", str(tamper_cache)]).exit_code == 0
    files = _files(tamper_cache)
    # Every kind of file once: one chunk file per array (6 arrays), 22 files in all.
    assert len(files) == 22 and sum("/c/" in f for f in files) == 6, files
    edits = _edits(files)
    counts = dict.fromkeys(("edits", "verify", "verify_pinned", "eval_refused", "eval_other_digest"), 0)
    failures, rows = [], []
    for k, (name, (edit, resealed)) in enumerate(edits.items()):
        root = Path(shutil.copytree(tamper_cache, tmp_path / f"c{k}"))
        edit(root)
        if resealed:
            reseal(root)
        counts["edits"] += 1
        plain = CliRunner().invoke(hscache_main, ["verify", "--deep", "--json", str(root)])
        # A pinned digest only adds a problem: run it where plain verify passed (the resealed edits).
        pinned_run = plain
        if plain.exit_code == 0:
            pinned_run = CliRunner().invoke(
                hscache_main, ["verify", "--deep", "--json", "--expect-digest", pinned, str(root)]
            )
        scored, report = _eval(drafter, root, tmp_path)
        counts["verify"] += plain.exit_code != 0
        counts["verify_pinned"] += pinned_run.exit_code != 0
        lines = [line for line in scored.output.splitlines() if line.strip()]
        refused = scored.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
        other = scored.exit_code == 0 and report["cache"]["digest"] != pinned
        counts["eval_refused"] += refused
        counts["eval_other_digest"] += other
        problems = [
            what
            for what, bad in (
                ("verify passed an unsealed edit", plain.exit_code == 0 and not resealed),
                ("verify --expect-digest passed", pinned_run.exit_code == 0),
                # Arrays no drafter reads (top-k, logsumexp) included: eval reads their scored rows too.
                ("eval neither refused nor reported another digest", not (refused or other)),
                ("traceback", not all(_no_traceback(r) for r in (plain, pinned_run, scored))),
            )
            if bad
        ]
        outcome = "refused" if refused else "other digest" if other else "?"
        rows.append(f"| {name} | {'fails' if plain.exit_code else 'passes'} | fails | {outcome} |")
        if problems:
            failures.append(f"{name}: {problems}: {scored.output[-300:]} {plain.output[-300:]}")
    print(counts, *rows, sep="\n")  # the table in docs/faults.md
    assert not failures, "\n".join(failures)
    assert counts["verify_pinned"] == counts["edits"] >= 100


def test_the_pinned_digest_is_checked_by_eval_and_verify(small_cache, drafter, tmp_path):
    from tests.hscache.test_cache_contract import split_into_shards

    cache = hscache.open_cache(small_cache.path)
    pinned, other = hscache.cache_digest(cache), "0" * 64
    ok = CliRunner().invoke(
        scorer_main,
        [
            "eval",
            str(drafter),
            "--cache",
            str(small_cache.path),
            "--ddtree",
            "",
            "--limit",
            "1",
            "--expect-digest",
            pinned,
        ],
    )
    assert ok.exit_code == 0, ok.output
    refused = CliRunner().invoke(
        scorer_main,
        ["eval", str(drafter), "--cache", str(small_cache.path), "--ddtree", "", "--expect-digest", other],
    )
    lines = [line for line in refused.output.splitlines() if line.strip()]
    assert (
        refused.exit_code == 2
        and len(lines) == 1
        and f"has digest {pinned}, not the expected {other}" in lines[0]
    )
    two = CliRunner().invoke(
        scorer_main,
        [
            "eval",
            str(drafter),
            "--cache",
            str(small_cache.path),
            "--cache",
            str(small_cache.path),
            "--ddtree",
            "",
            "--expect-digest",
            pinned,
        ],
    )
    assert two.exit_code == 2 and "1 --expect-digest for 2 --cache" in two.output
    for digest, code in ((pinned, 0), (other, 1)):
        result = CliRunner().invoke(
            hscache_main, ["verify", "--expect-digest", digest, str(small_cache.path)]
        )
        assert result.exit_code == code, result.output
    # A directory of shards: one digest over its shards', printed by info and checked by verify.
    sharded = split_into_shards(cache, tmp_path / "sharded", 2)
    digest = hscache.cache_digest(hscache.open_cache(sharded))
    assert digest in CliRunner().invoke(hscache_main, ["info", str(sharded)]).output
    for expected, code in ((digest, 0), (other, 1)):
        result = CliRunner().invoke(hscache_main, ["verify", "--expect-digest", expected, str(sharded)])
        assert result.exit_code == code, result.output
