"""The calibration proof: offline replay on a cache equals real speculative decoding (fp32)."""

from __future__ import annotations

import pytest

import hscache
from scorer.online.greedy import OnlineConfig, run_online
from scorer.studies.evaluate import EvalConfig, evaluate
from tests.scorer.family_contract import FamilyContract


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny-qwen3.5", "builtin:tiny-qwen3"])
def test_offline_tau_equals_online_tau(model, request):
    """A drafter trained on a cache of the target, its first 2 prompts: the hybrid's the session's
    ``trained_drafter`` (block 6) on ``scorer_cache`` (24 tokens, layers 1,3,7); the plain Qwen3's a
    the session's ``qwen3_drafter`` (block 5) on ``qwen3_cache`` (2 x 16, layers 1,3,4,7)."""
    limit = 2
    if model == "builtin:tiny-qwen3":
        cache, new_tokens = request.getfixturevalue("qwen3_cache"), 16
        drafter = request.getfixturevalue("qwen3_drafter")
    else:
        cache, new_tokens = request.getfixturevalue("scorer_cache"), 24
        drafter = request.getfixturevalue("trained_drafter")
    offline = evaluate(drafter, cache, EvalConfig(ddtree=(), n_boot=20, limit=limit))
    online = run_online(drafter, OnlineConfig(model=model, max_new_tokens=new_tokens, limit=limit))
    cached = hscache.open_cache(cache)
    assert offline["off_greedy"]["positions"] == 0  # fp32: the cache is the target's greedy path
    for i, (off, on) in enumerate(zip(offline["per_request"], online["per_request"])):
        assert on["record_id"] == off["record_id"]
        # same text, then the same rounds, round by round
        assert on["generated"] == cached.index.column("length")[i].as_py() - off["anchors"][0]
        tokens = [
            min(a + 1, on["generated"] + off["anchors"][0] - 1 - p)
            for a, p in zip(off["accepted"], off["anchors"])
        ]
        assert on["tokens_per_round"] == tokens, off["record_id"]
    assert online["tau"]["per_request"] == pytest.approx(offline["tau"]["per_request"], abs=0)
    assert online["tau"]["pooled"] == pytest.approx(offline["tau"]["pooled"], abs=0)
    assert offline["tau"]["pooled"] > 1.0


def test_online_result_carries_schema_versions_and_hashes(trained_drafter, scorer_cache, tmp_path):
    import json

    from click.testing import CliRunner

    from hscache import schemas
    from scorer.cli import main
    from scorer.families.dflash.checkpoint import load_checkpoint

    out = tmp_path / "online.json"
    args = ["online", str(trained_drafter), "--max-new-tokens", "3", "--limit", "1", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    cache = hscache.open_cache(scorer_cache)  # same built-in target (fp32) and prompts
    assert document["schema_version"] == 1 and document["versions"]["torch"]
    assert document["model_weights_sha256"] == cache.settings["weights_sha256"]
    assert document["prompts_sha256"] == cache.settings["prompts_sha256"]
    assert document["checkpoint"]["sha256"] == load_checkpoint(trained_drafter).report.sha256
    assert not list(tmp_path.glob("*.hscache-tmp-*"))  # written through the atomic helper
    with pytest.raises(schemas.SchemaError, match="model_weights_sha256"):
        schemas.validate({k: v for k, v in document.items() if k != "model_weights_sha256"}, "online_report")


@pytest.mark.slow
def test_sliding_window_drafter_online_equals_offline(scorer_cache, trained_drafter, tmp_path):
    """A window of 4 (smaller than the contexts) in both paths: same rounds, round by round."""
    import json
    import shutil

    drafter = tmp_path / "sliding"
    shutil.copytree(trained_drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    n = config["num_hidden_layers"]
    config.update(layer_types=["sliding_attention"] * n, sliding_window=4, use_sliding_window=True)
    (drafter / "config.json").write_text(json.dumps(config))
    offline = evaluate(drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20, limit=2))
    assert offline["drafter"]["layer_types"] == ["sliding_attention"] * n
    online = run_online(drafter, OnlineConfig(model="builtin:tiny-qwen3.5", max_new_tokens=24, limit=2))
    for off, on in zip(offline["per_request"], online["per_request"]):
        tokens = [
            min(a + 1, on["generated"] + off["anchors"][0] - 1 - p)
            for a, p in zip(off["accepted"], off["anchors"])
        ]
        assert on["tokens_per_round"] == tokens, off["record_id"]
    full = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20, limit=2))
    assert [r["accepted"] for r in full["per_request"]] != [r["accepted"] for r in offline["per_request"]]


class TestDFlashContract(FamilyContract):
    """The family contract (tests/scorer/family_contract.py) for DFlash: the session's trained
    drafter (block 6) on the hybrid built-in target, round for round."""

    family = "dflash"

    @pytest.fixture
    def checkpoint(self, trained_drafter):
        return str(trained_drafter)
