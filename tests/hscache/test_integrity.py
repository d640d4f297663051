"""Every file of a cache is covered by a checksum recorded at commit (issue #14, item 14).

Each edit below once changed scores silently or passed ``hscache verify``: now verify (quick and
--deep) fails naming the file, and ``open_cache`` refuses in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import hscache
from hscache import schemas
from hscache.cli import main
from hscache.errors import CacheFormatError
from hscache.store.integrity import content_sha256, digest_file


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _edit_manifest(root: Path, change: Callable[[dict], None]) -> None:
    manifest = _manifest(root)
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _edit_index(root: Path, column: str, change: Callable[[list], list]) -> None:
    part = root / _manifest(root)["index_parts"][0]
    table = pq.read_table(part)
    i = table.column_names.index(column)
    table = table.set_column(
        i, column, pa.array(change(table.column(column).to_pylist()), table.schema.field(i).type)
    )
    pq.write_table(table, part)


def _swap_layers(root: Path) -> None:
    def swap(m: dict) -> None:
        m["settings"]["layer_ids"] = list(reversed(m["settings"]["layer_ids"]))

    _edit_manifest(root, swap)


def _flip_head_byte(root: Path) -> None:
    path = root / "target" / "head.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_config(root: Path) -> None:
    path = root / "target" / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = 1.0
    path.write_text(json.dumps(config))


EDITS: dict[str, tuple[Callable[[Path], None], str]] = {
    "layer ids swapped in manifest.json": (_swap_layers, "manifest.json was edited"),
    "prompt_len edited": (lambda r: _edit_index(r, "prompt_len", lambda v: [1] + v[1:]), "index/part-"),
    "record id edited": (lambda r: _edit_index(r, "record_id", lambda v: ["x"] + v[1:]), "index/part-"),
    "metadata edited": (
        lambda r: _edit_index(r, "metadata_json", lambda v: ['{"a": 1}'] + v[1:]),
        "index/part-",
    ),
    "provenance.json deleted": (lambda r: (r / "provenance.json").unlink(), "provenance.json is missing"),
    "head byte flipped": (_flip_head_byte, "target/head.safetensors"),
    "target config edited": (_edit_config, "target/config.json"),
    "tokenizer deleted": (
        lambda r: (r / "target" / "tokenizer.json").unlink(),
        "target/tokenizer.json is missing",
    ),
}


@pytest.fixture
def cache_copy(tmp_path, small_cache):
    return small_cache.copy(tmp_path / "c")


def test_a_fresh_cache_records_every_file_and_passes(small_cache):
    manifest = _manifest(small_cache.path)
    schemas.validate(manifest, "manifest")
    assert manifest["content_sha256"] == content_sha256(manifest)
    recorded = set(manifest["checksums"])
    assert {
        "provenance.json",
        "target/config.json",
        "target/head.safetensors",
        *manifest["index_parts"],
    } <= recorded
    on_disk = {
        p.relative_to(small_cache.path).as_posix()
        for p in small_cache.path.rglob("*")
        if p.is_file()
        and p.parts[len(small_cache.path.parts)] not in ("arrays",)
        and p.name != "manifest.json"
    }
    # runs.json is sealed apart from the other files (the manifest's run_log), outside the digest.
    assert on_disk | {"arrays/zarr.json"} == recorded | {"runs.json"}
    assert manifest["run_log"] == digest_file(small_cache.path / "runs.json")
    # Every array's metadata and every committed chunk is recorded too (issue 18, items 2-3).
    for entry in manifest["arrays"].values():
        assert len(entry["zarr_json_sha256"]) == 64
        assert len(entry["chunk_sha256"]) == -(-manifest["committed"]["tokens"] // entry["chunk_tokens"])
    result = CliRunner().invoke(main, ["verify", str(small_cache.path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("edit", list(EDITS))
def test_each_edit_fails_verify_and_open_cache(cache_copy, edit):
    change, fragment = EDITS[edit]
    change(cache_copy)
    for deep in ([], ["--deep"]):
        result = CliRunner().invoke(main, ["verify", "--json", *deep, str(cache_copy)])
        assert result.exit_code == 1, (edit, result.output)
        report = json.loads(result.output)
        assert any(fragment in p["message"] for p in report["problems"]), (edit, report["problems"])
    with pytest.raises(CacheFormatError, match="cannot be trusted") as err:
        hscache.open_cache(cache_copy)
    assert "\n" not in str(err.value) and "hscache verify" in str(err.value)


def test_a_cache_without_its_seal_is_refused_unless_allowed(cache_copy):
    """Stripping the seal once turned every check off (issue 18, item 1): now it is refused by
    verify and readers, naming older caches and --allow-unsealed, which reads it with a warning."""

    def drop(m: dict) -> None:
        del m["checksums"], m["content_sha256"]

    _edit_manifest(cache_copy, drop)
    with pytest.raises(
        CacheFormatError, match="written by hscache before checksums existed.*--allow-unsealed"
    ):
        hscache.open_cache(cache_copy)
    result = CliRunner().invoke(main, ["verify", "--json", str(cache_copy)])
    assert result.exit_code == 1, result.output
    assert any("--allow-unsealed" in p["message"] for p in json.loads(result.output)["problems"])
    assert len(hscache.open_cache(cache_copy, allow_unsealed=True)) > 0
    result = CliRunner().invoke(main, ["verify", "--json", "--allow-unsealed", str(cache_copy)])
    assert result.exit_code == 0, result.output
    warnings = [w["message"] for w in json.loads(result.output)["warnings"]]
    assert any("records no checksums (no seal)" in w for w in warnings), warnings


def test_a_resumed_extraction_keeps_checksums_current(tmp_path, small_cache):
    """Resume rewrites provenance.json and adds index parts: each is recorded as it is published."""
    out = tmp_path / "resumed"
    hscache.extract(small_cache.config_for(out, limit=3))
    hscache.extract(small_cache.config_for(out, limit=3))  # complete: a no-op resume
    manifest = _manifest(out)
    assert manifest["content_sha256"] == content_sha256(manifest)
    assert len(hscache.open_cache(out)) == 3


def test_a_sealed_cache_from_before_chunk_hashes_is_read_with_a_warning(cache_copy):
    """Caches sealed by the hscache before chunk hashes stay readable; verify says what is not covered."""

    def drop(m: dict) -> None:
        for entry in m["arrays"].values():
            del entry["chunk_sha256"], entry["zarr_json_sha256"]
        del m["checksums"]["arrays/zarr.json"]
        m["content_sha256"] = content_sha256(m)

    _edit_manifest(cache_copy, drop)
    cache = hscache.open_cache(cache_copy)
    assert cache.hidden_states(0).shape[0] > 0
    result = CliRunner().invoke(main, ["verify", "--deep", "--json", str(cache_copy)])
    assert result.exit_code == 0, result.output
    warnings = [w["message"] for w in json.loads(result.output)["warnings"]]
    assert any("records no chunk hashes (written before them)" in w for w in warnings), warnings
