"""The drift study end to end on CPU (built-in hybrid target, fp32 reference vs bf16), its CLI,
``scorer eval --report``, and on a GPU machine fla vs the torch fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import hscache
from hscache import schemas
from hscache.store.run_log import read_run_log
from pipelines.drift_study import DriftStudyConfig, DriftStudyError, main, parse_settings, run_drift_study
from tests.chromium import png_is_not_blank, screenshot

pytestmark = pytest.mark.slow

# The fixture's study as CLI flags: the CLI test re-runs it on the same directory (reusing everything).
_FLAGS = [
    "--settings",
    "torch:fp32,torch:bf16",
    "--limit",
    "3",
    "--max-new-tokens",
    "12",
    "--train-steps",
    "20",
    "--block-size",
    "4",
    "--layers",
    "0,1,2,3,4,5,6,7",
    "--n-boot",
    "200",
]


def _config(out: Path, **changes) -> DriftStudyConfig:
    settings = {
        "settings": parse_settings("torch:fp32,torch:bf16"),
        "limit": 3,
        "max_new_tokens": 12,
        "train_steps": 20,  # tau as at 60 steps (1.18 pooled, both settings), a third of the CPU
        "block_size": 4,
        "layers": "0,1,2,3,4,5,6,7",
        "n_boot": 200,
        **changes,
    }
    return DriftStudyConfig(out=str(out), **settings)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("drift") / "study"
    return out, run_drift_study(_config(out))


def test_both_caches_hold_the_reference_tokens(study) -> None:
    out, document = study
    assert [s["name"] for s in document["settings"]] == ["torch-fp32", "torch-bf16"]
    ref, bf16 = (hscache.open_cache(out / "caches" / name) for name in ("torch-fp32", "torch-bf16"))
    assert len(ref) == len(bf16) == 3 and ref.settings["dtype"] == "fp32" and bf16.settings["dtype"] == "bf16"
    assert ref.index.column("token_sha256").to_pylist() == bf16.index.column("token_sha256").to_pylist()
    # bf16 ran one forward over the whole reference text ({input_ids, prompt_len} records, no
    # generation), and its prompt ends where the reference's did: the same region is scored.
    assert bf16.index.column("stop_reason").to_pylist() == ["dataset"] * 3
    assert bf16.index.column("prompt_len").to_pylist() == ref.index.column("prompt_len").to_pylist()


def test_drift_is_nonzero_and_grows_with_depth(study) -> None:
    _, document = study
    (diff,) = document["diffs"]
    assert diff["setting"] == "torch-bf16" and diff["sequences_compared"] == 3
    rel = [layer["rel_l2"] for layer in diff["layers"]]
    assert all(1e-4 < r < 1e-1 for r in rel), rel
    # Drift compounds through the layers: > 1.5x first to last, and no layer more than 1 % below the
    # one before it. The trained built-in target drifts 1.65x (0.0036 -> 0.0059); the old random one
    # drifted > 2x. Not strictly monotonic: on an AVX-512 CPU layer 6 measured 0.04 % below layer 5
    # (0.0057663 after 0.0057687; strictly rising on the VMs before it). Still failing for a flat or
    # shrinking profile.
    assert all(b > 0.99 * a for a, b in zip(rel, rel[1:])) and rel[-1] > 1.5 * rel[0], rel
    assert diff["worst_layer"]["layer_id"] == 7, rel
    assert diff["provenance_differences"] == ["capture.dtype"]
    assert {"prompts.sha256", "capture.max_new_tokens"} <= set(diff["provenance_by_construction"])


def test_tau_for_both_caches_with_a_paired_delta(study) -> None:
    _, document = study
    (score,) = document["scores"]
    assert score["trained_here"]
    assert [p["setting"] for p in score["per_setting"]] == ["torch-fp32", "torch-bf16"]
    fp32, bf16 = score["per_setting"]
    for p in (fp32, bf16):
        assert p["tau"]["per_request"] > 1 and p["tau"]["pooled"] > 1
        lo, hi = p["tau"]["pooled_ci95"]
        assert lo <= p["tau"]["pooled"] <= hi
    assert bf16["rounds"] > 0 and bf16["requests"] == fp32["requests"] == 3  # the same region is scored
    (comp,) = score["comparisons"]
    assert comp["requests_compared"] == 3 and comp["rounds_compared"] > 0
    assert comp["requests_left_out"] == {"missing": [], "different_tokens": [], "no_rounds": []}
    for name in ("per_request", "pooled"):
        delta = comp["delta"][name]
        assert delta["lo"] <= delta["delta"] <= delta["hi"] and delta["n_requests"] == 3
    assert 0 <= comp["rounds_with_changed_acceptance"] <= comp["rounds_compared"]


def test_every_json_validates(study) -> None:
    out, document = study
    assert json.loads((out / "drift_study.json").read_text()) == json.loads(json.dumps(document))
    schemas.validate(document, "drift_study")
    schemas.validate(json.loads((out / "diffs" / "torch-bf16.json").read_text()), "diff_report")
    for report in json.loads((out / "scores" / "drafter.json").read_text())["reports"]:
        schemas.validate(report, "eval_report")


def test_html_is_self_contained_and_renders_in_headless_chromium(study, tmp_path) -> None:
    out, _ = study
    page = out / "drift_study.html"
    html = page.read_text()
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for text in (
        "Relative L2 error per layer vs torch-fp32",
        "Per-position acceptance (conditional)",
        "tau per request [95%]",
        "delta pooled [95%]",
        "torch-bf16 vs torch-fp32",
        "capture.dtype",
    ):
        assert text in html, text
    assert html.count("<svg") == 7  # drift per layer, 2 acceptance, 4 of the bf16 diff
    png = screenshot(page, tmp_path, height=3000)
    assert png_is_not_blank(png.read_bytes())


def test_cli_rerun_reuses_caches_and_the_drafter(study) -> None:
    out, _ = study
    # Data files only: a resume of a complete cache re-publishes its manifest and provenance.
    data = [
        p
        for name in ("torch-fp32", "torch-bf16")
        for part in ("arrays", "index")
        for p in (out / "caches" / name / part).rglob("*")
        if p.is_file()
    ]
    stamps = {p: p.stat().st_mtime_ns for p in [*data, out / "drafter" / "model.safetensors"]}
    result = CliRunner().invoke(main, ["--out", str(out), *_FLAGS])
    assert result.exit_code == 0, result.output
    assert "torch-bf16           worst layer 7 rel L2" in result.output and "delta" in result.output
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_cli_rerun_with_overwrite_reuses_caches_whose_settings_hold(study) -> None:
    out, _ = study
    caches = [out / "caches" / name for name in ("torch-fp32", "torch-bf16")]
    data = [
        p
        for cache in caches
        for part in ("arrays", "index")
        for p in (cache / part).rglob("*")
        if p.is_file()
    ]
    stamps = {p: p.stat().st_mtime_ns for p in data}
    started = [read_run_log(c) for c in caches]
    result = CliRunner().invoke(main, ["--out", str(out), *_FLAGS, "--overwrite"])
    assert result.exit_code == 0, result.output
    # --overwrite rebuilds only caches of other settings: these were complete and left alone (not even
    # a run log entry: a re-run that adds nothing writes nothing).
    assert [read_run_log(c) for c in caches] == started
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_overwrite_rebuilds_only_the_cache_extract_refuses(tmp_path, monkeypatch) -> None:
    from hscache.errors import ResumeMismatchError
    from pipelines import drift_study

    calls = []

    def fake_extract(config):
        calls.append((Path(config.out).name, config.overwrite))
        if Path(config.out).name == "torch-bf16" and not config.overwrite:
            raise ResumeMismatchError("torch-bf16 was built with dtype='fp16' but this run has dtype='bf16'")

    monkeypatch.setattr(hscache, "extract", fake_extract)
    fp32, bf16 = parse_settings("torch:fp32,torch:bf16")
    for overwrite in (False, True):
        config = _config(tmp_path, overwrite=overwrite)
        calls.clear()
        drift_study._extract(config, fp32, "builtin:default", 12, 3)
        assert calls == [("torch-fp32", False)]  # a cache whose settings hold is reused, never rebuilt
        calls.clear()
        if overwrite:
            drift_study._extract(config, bf16, "replay.jsonl", 0, None)
            assert calls == [("torch-bf16", False), ("torch-bf16", True)]
        else:
            with pytest.raises(ResumeMismatchError, match="dtype='fp16'"):
                drift_study._extract(config, bf16, "replay.jsonl", 0, None)
            assert calls == [("torch-bf16", False)]


def test_position_buckets_are_checked_before_any_cache_is_built(tmp_path) -> None:
    for buckets in ((16, 64), (0, 64, 64), ()):
        with pytest.raises(
            DriftStudyError,
            match=r"^--position-buckets '.*' must start at 0 and increase strictly; "
            r"e\.g\. 0,",
        ):
            _config(tmp_path, position_buckets=buckets)
    result = CliRunner().invoke(main, ["--out", str(tmp_path / "study"), "--position-buckets", "16,64"])
    assert result.exit_code == 2
    assert result.output.startswith(
        "error: --position-buckets '16,64' must start at 0 and increase strictly; e.g. 0,"
    )
    assert result.output.count("\n") == 1 and not (tmp_path / "study").exists()


def test_scorer_eval_report_option_writes_one_page(study, tmp_path) -> None:
    from scorer.cli import main as scorer_main

    out, _ = study
    page, doc = tmp_path / "eval.html", tmp_path / "eval.json"
    caches = [str(out / "caches" / name) for name in ("torch-fp32", "torch-bf16")]
    result = CliRunner().invoke(
        scorer_main,
        [
            "eval",
            str(out / "drafter"),
            "--cache",
            caches[0],
            "--cache",
            caches[1],
            "--ddtree",
            "",
            "--report",
            str(page),
            "--json",
            str(doc),
        ],
    )
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert html.count("<svg") == 2 and html.count("<polyline") == 4 and "rounds changed" in html
    comparison = json.loads(doc.read_text())["comparisons"][0]
    assert comparison["requests_compared"] == 3 and comparison["rounds_compared"] > 0


def test_config_errors_name_the_value_and_the_fix(tmp_path) -> None:
    with pytest.raises(
        DriftStudyError, match=r"^setting 'torch' is not backend:dtype\[:device\]; e.g. torch:"
    ):
        parse_settings("torch:fp32,torch")
    with pytest.raises(
        DriftStudyError, match=r"^dtype 'fp64' in setting torch:fp64; choose one of bf16, fp16, fp32"
    ):
        parse_settings("torch:fp64")
    with pytest.raises(DriftStudyError, match=r"^reference 2 out of range for 2 settings; choose 0-1$"):
        _config(tmp_path, reference=2)
    with pytest.raises(DriftStudyError, match=r"^a drift study needs at least 2 settings, got 1"):
        _config(tmp_path, settings=parse_settings("torch:fp32"))
    result = CliRunner().invoke(main, ["--out", str(tmp_path), "--settings", "torch:fp32,torch:fp32"])
    assert result.exit_code == 2
    assert result.output == "error: settings repeat: torch:fp32, torch:fp32; list each once\n"


@pytest.mark.gpu
def test_fla_vs_torch_fallback_drift_study(tmp_path) -> None:
    from hscache.capture.backend import fla_status

    available, why = fla_status("cuda")
    if not available:
        pytest.skip(f"fla vs torch drift study needs CUDA and flash-linear-attention: {why}")
    settings = parse_settings("torch:bf16:cuda,fla:bf16:cuda")
    document = run_drift_study(_config(tmp_path / "study", settings=settings, train_steps=30))
    torch_kernels, fla_kernels = (set(s["kernels"].values()) for s in document["settings"])
    assert torch_kernels == {"torch"} and "fla" in fla_kernels
    (diff,) = document["diffs"]
    differing = diff["provenance_differences"]
    assert any(k.startswith("capture.kernels.") and k.endswith(".backend") for k in differing), differing
    linear = [x["rel_l2"] for x in diff["layers"] if x["layer_type"] == "linear_attention"]
    assert all(0 < r < 1e-1 for r in linear), linear
    assert all(p["tau"]["pooled"] is not None for p in document["scores"][0]["per_setting"])
