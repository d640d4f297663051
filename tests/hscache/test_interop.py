"""hscache export/import: the peers' offline formats as their sources define them, and round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import hscache
from hscache.cli import main as hscache_main
from hscache.data import SequenceDataset
from hscache.interop.specforge import export_specforge, feature_path, import_specforge
from hscache.interop.speculators import export_speculators, import_speculators
from scorer.errors import IncompatibleCacheError

# bf16_cache: the 8-layer built-in target, layers 1,3,7 (7 is the last layer), 4 sequences.


@pytest.fixture(scope="module")
def speculators_dir(bf16_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interop") / "speculators"
    assert export_speculators(bf16_cache, out) == 4
    return out


@pytest.fixture(scope="module")
def specforge_dir(bf16_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interop") / "specforge"
    assert export_specforge(bf16_cache, out, layer_ids=[1, 3]) == 4
    return out


def _generated(cache, i: int) -> torch.Tensor:
    mask = torch.zeros(cache.sequence_span(i)[1] - cache.sequence_span(i)[0], dtype=torch.int64)
    mask[cache.index.column("prompt_len")[i].as_py() :] = 1
    return mask


def test_speculators_files_are_the_layout_speculators_reads(bf16_cache, speculators_dir):
    cache = hscache.open_cache(bf16_cache)
    state = json.loads((speculators_dir / "state.json").read_text())
    assert state["_format_type"] == "torch" and state["_data_files"] == [
        {"filename": "data-00000-of-00001.arrow"}
    ]
    table = pa.ipc.open_stream(pa.memory_map(str(speculators_dir / "data-00000-of-00001.arrow"))).read_all()
    assert table.schema.field("input_ids").type == pa.list_(pa.int64())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int64())
    for i in range(len(cache)):
        hs = load_file(str(speculators_dir / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs) == {"hidden_states", "token_ids"} and hs["token_ids"].dtype == torch.int64
        # [T, num_layers, H], layers in id order, the target's last layer (7 = vLLM aux id 8) last.
        assert torch.equal(hs["hidden_states"], cache.hidden_states(i))
        assert table.column("input_ids")[i].as_py() == cache.token_ids(i).tolist()
        assert table.column("loss_mask")[i].as_py() == _generated(cache, i).tolist()
        assert table.column("seq_len")[i].as_py() == len(hs["token_ids"])
    sidecar = json.loads((speculators_dir / "hscache_export.json").read_text())
    assert sidecar["vllm_layer_ids"] == [2, 4, 8] and sidecar["aux_hidden_state_layer_ids"] == [2, 4]


def test_speculators_export_loads_with_hugging_face_datasets(speculators_dir):
    datasets = pytest.importorskip("datasets", reason="the speculators oracle needs `datasets`")
    data = datasets.load_from_disk(str(speculators_dir))
    for i in range(len(data)):  # what speculators' ArrowDataset checks before using a file
        hs = load_file(str(speculators_dir / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], data[i]["input_ids"])


def test_specforge_files_are_the_layout_specforge_reads(bf16_cache, specforge_dir):
    cache = hscache.open_cache(bf16_cache)
    for i in range(len(cache)):
        path = feature_path(specforge_dir, i)
        assert path.relative_to(specforge_dir).as_posix() == f"rows_0-2000/data_{i}.ckpt"
        record = torch.load(path, weights_only=True)
        assert set(record) == {"input_ids", "loss_mask", "hidden_states"}
        hidden = cache.hidden_states(i)
        # [1, T, K*H]: layers 1 and 3 (no shift) concatenated on the last dim in ascending order.
        assert torch.equal(record["hidden_states"], torch.cat([hidden[:, 0], hidden[:, 1]], -1)[None])
        assert torch.equal(record["input_ids"], cache.token_ids(i))
        assert torch.equal(record["loss_mask"], _generated(cache, i))


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_import_of_export_equals_the_cache_on_every_shared_array(
    fmt, bf16_cache, speculators_dir, specforge_dir, tmp_path
):
    source = speculators_dir if fmt == "speculators" else specforge_dir
    load = import_speculators if fmt == "speculators" else import_specforge
    assert load(source, tmp_path / "c", compression="none") == (4, hscache.open_cache(bf16_cache).num_tokens)
    original, imported = SequenceDataset(bf16_cache), SequenceDataset(tmp_path / "c")
    layers = 3 if fmt == "speculators" else 2
    assert imported.layer_ids == [1, 3, 7][:layers]
    for a, b in zip(original, imported):
        assert torch.equal(b["hidden_states"], a["hidden_states"][:, :layers])
        assert torch.equal(b["token_ids"], a["token_ids"]) and torch.equal(b["loss_mask"], a["loss_mask"])
        assert b["record_id"] == a["record_id"]
        assert b["metadata"]["prompt_len"] == a["metadata"]["prompt_len"]
        assert "target_argmax" not in b
    cache = hscache.open_cache(tmp_path / "c")
    assert set(cache.specs) == {"hidden_states", "token_ids", "loss_mask"}
    # chunks no longer than the source's bytes allow: ~320 tokens are not 4096-1M-token padded chunks
    assert all(cache.num_tokens <= s.chunk_tokens < 4 * cache.num_tokens for s in cache.specs.values())
    prov = cache.provenance["imported"]
    assert (
        prov["format"] == fmt
        and prov["source"] == str(source.resolve())
        and "target_argmax" in prov["absent"]
    )
    assert prov["exported_from"] == str(bf16_cache)
    from hscache.verify import verify_cache

    assert verify_cache(tmp_path / "c").to_dict()["problems"] == []  # no target/ is expected here


def test_scorer_refuses_an_imported_cache_by_name(speculators_dir, bf16_cache, tmp_path):
    from scorer import init_drafter
    from scorer.studies.evaluate import evaluate

    import_speculators(speculators_dir, tmp_path / "c")
    init_drafter(bf16_cache, tmp_path / "d")
    with pytest.raises(IncompatibleCacheError, match=r"imported from speculators .* holds no target_argmax"):
        evaluate(tmp_path / "d", tmp_path / "c")


def test_foreign_files_need_layer_ids_in_the_source_convention(speculators_dir, specforge_dir, tmp_path):
    import shutil

    bare = shutil.copytree(speculators_dir, tmp_path / "bare")
    (bare / "hscache_export.json").unlink()
    with pytest.raises(hscache.InputError, match="pass --layer-ids with the vLLM aux ids"):
        import_speculators(bare, tmp_path / "x")
    import_speculators(bare, tmp_path / "y", layer_ids=[2, 4, 8])  # the +1 shift: aux 2 = layer 1
    assert hscache.open_cache(tmp_path / "y").layer_ids == [1, 3, 7]
    assert SequenceDataset(tmp_path / "y")[0]["record_id"] == "hs_0"
    with pytest.raises(hscache.InputError, match=r"hidden_states \(\d+, 3, 128\) is not \[T, 2, H\]"):
        import_speculators(bare, tmp_path / "z", layer_ids=[2, 8])
    forge = shutil.copytree(specforge_dir, tmp_path / "forge")
    (forge / "hscache_export.json").unlink()
    import_specforge(forge, tmp_path / "f", layer_ids=[1, 3])  # SpecForge's ids are hscache's
    assert hscache.open_cache(tmp_path / "f").layer_ids == [1, 3]


def test_unimplemented_variants_are_refused_by_name(bf16_cache, specforge_dir, tmp_path):
    with pytest.raises(
        hscache.InputError, match="include the target's last layer 7; SpecForge's SGLang capture"
    ):
        export_specforge(bf16_cache, tmp_path / "a")
    with pytest.raises(hscache.InputError, match="do not end with the target's last layer 7"):
        export_speculators(bf16_cache, tmp_path / "b", layer_ids=[1, 3])
    eagle = tmp_path / "eagle" / "rows_0-2000"
    eagle.mkdir(parents=True)
    torch.save({"input_ids": torch.zeros(3), "aux_hidden_state": torch.zeros(1, 3, 6)}, eagle / "data_0.ckpt")
    with pytest.raises(hscache.InputError, match="EAGLE3 capture"):
        import_specforge(tmp_path / "eagle", tmp_path / "c", layer_ids=[1])
    with pytest.raises(hscache.InputError, match="exists and is not empty"):
        export_speculators(bf16_cache, specforge_dir)


def test_cli_export_import_and_one_line_errors(bf16_cache, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(
        hscache_main,
        ["export", str(bf16_cache), "--format", "specforge", "--out", str(tmp_path / "e"), "--layers", "3"],
    )
    assert ok.exit_code == 0 and "exported 4 sequences" in ok.output
    ok = runner.invoke(
        hscache_main, ["import", "--format", "specforge", str(tmp_path / "e"), "--out", str(tmp_path / "c")]
    )
    assert ok.exit_code == 0 and "holds no target logits" in ok.output
    assert hscache.open_cache(tmp_path / "c").layer_ids == [3]
    bad = runner.invoke(
        hscache_main, ["export", str(bf16_cache), "--format", "specforge", "--out", str(tmp_path / "f")]
    )
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and bad.output.startswith("error: cache layers")
    bad = runner.invoke(
        hscache_main, ["import", "--format", "speculators", str(tmp_path / "e"), "--out", str(tmp_path / "g")]
    )
    assert bad.exit_code == 2 and "no state.json" in bad.output


def test_import_with_target_computes_the_target_arrays_from_the_last_layer(
    speculators_dir, bf16_cache, tmp_path
):
    """speculators' last slot is the target's last layer before the final norm: the target's own norm
    and head give back exactly the arrays hscache extract stored (same dtype and device)."""
    from scorer import init_drafter
    from scorer.studies.evaluate import EvalConfig, evaluate

    result = CliRunner().invoke(
        hscache_main,
        [
            "import",
            "--format",
            "speculators",
            str(speculators_dir),
            "--out",
            str(tmp_path / "c"),
            "--target",
            "builtin:tiny-qwen3.5",
        ],
    )
    assert result.exit_code == 0 and "target arrays computed" in result.output, result.output
    original, imported = hscache.open_cache(bf16_cache), hscache.open_cache(tmp_path / "c")
    assert imported.provenance["imported"]["absent"] == [] and imported.provenance["imported"]["computed"]
    for i in range(len(original)):
        assert torch.equal(imported.target_argmax(i), original.target_argmax(i))
        for a, b in zip(imported.target_topk(i), original.target_topk(i)):
            assert torch.equal(a, b)
        assert torch.equal(imported.target_logsumexp(i), original.target_logsumexp(i))
    init_drafter(bf16_cache, tmp_path / "d")
    config = EvalConfig(ddtree=(4,), n_boot=5)
    a, b = evaluate(tmp_path / "d", bf16_cache, config), evaluate(tmp_path / "d", tmp_path / "c", config)
    assert a["tau"] == b["tau"] and a["acceptance"] == b["acceptance"] and a["tokens"] == b["tokens"]


@pytest.fixture(scope="module")
def qwen3_speculators_dir(tmp_path_factory) -> Path:
    """A speculators export of a one-sequence ``builtin:tiny-qwen3`` cache (layers 1,7: the last included)."""
    root = tmp_path_factory.mktemp("qwen3")
    config = dict(model="builtin:tiny-qwen3", layers="1,7", max_new_tokens=8, dtype="bf16", limit=1)
    hscache.extract(hscache.ExtractConfig(out=str(root / "cache"), **config))
    assert export_speculators(root / "cache", root / "speculators") == 1
    return root / "speculators"


def test_import_refuses_a_target_that_did_not_produce_the_files(
    speculators_dir, qwen3_speculators_dir, tmp_path
):
    """Issue 35.7: an export of a tiny-qwen3.5 cache imported with ``--target builtin:tiny-qwen3`` (same
    width, vocabulary and depth) was written with the wrong target's logits. Each built-in target is
    refused on the other's files, in one line, before anything is written; the right one is taken."""
    cases = ((speculators_dir, "builtin:tiny-qwen3"), (qwen3_speculators_dir, "builtin:tiny-qwen3.5"))
    for source, wrong in cases:
        out = tmp_path / wrong.split(":")[1]
        args = ["import", "--format", "speculators", str(source), "--out", str(out), "--target", wrong]
        result = CliRunner().invoke(hscache_main, args)
        assert result.exit_code == 2, result.output
        line = result.output.strip()
        assert "\n" not in line and f"--target {wrong} did not produce these files" in line, line
        cosine = float(line.split(" have cosine ")[1].split(" ")[0])
        assert abs(cosine) < 0.5 and "argmax is the next token at" in line, line
        assert not (out / "manifest.json").exists() and not (out / "target").exists()
    assert import_speculators(qwen3_speculators_dir, tmp_path / "right", target="builtin:tiny-qwen3")[0] == 1
    assert hscache.open_cache(tmp_path / "right").provenance["imported"]["computed"]


def test_import_refuses_token_ids_outside_the_targets_vocabulary(speculators_dir, tmp_path):
    from hscache.capture.target import load_target
    from hscache.interop.target import check_target_produced

    target = load_target("builtin:tiny-qwen3.5", "fp32")
    hidden = torch.zeros(3, 1, 128)
    with pytest.raises(
        hscache.InputError, match=f"vocabulary of {target.vocab_size} ids, but hs_0 holds token id"
    ):
        check_target_produced(target, hidden, torch.tensor([1, target.vocab_size, 2]), [7], "hs_0")
