"""The n-gram proposer registered as a family: ``scorer eval ngram`` / ``scorer compare ... ngram``.

The proposer and its replay are tested against vLLM in test_ngram.py; here the family's report is
checked against replay_ngram run independently on the cache's rows, and its refusals.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import hscache
from scorer.cli import main
from scorer.families import FAMILIES, family_for, probe_checkpoint
from scorer.families.ngram.propose import NgramConfig
from scorer.families.ngram.replay import mean_acceptance_length, replay_ngram
from scorer.studies.evaluate import EvalConfig
from tests.scorer.family_contract import FamilyContract

K, MIN_N, MAX_N = 3, 1, 3


def test_the_word_ngram_names_the_family_whatever_the_registry_order():
    assert family_for(probe_checkpoint("ngram")).name == "ngram"
    assert {f.name for f in FAMILIES} >= {"dflash", "dflash2", "eagle3", "mtp", "ngram"}


def test_scorer_eval_ngram_reports_tau_and_vllms_mean_acceptance_length(scorer_cache, tmp_path):
    out = tmp_path / "ngram.json"
    args = ["eval", "ngram", "--cache", str(scorer_cache), "--num-speculative-tokens", str(K)]
    args += ["--prompt-lookup-min", str(MIN_N), "--prompt-lookup-max", str(MAX_N), "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "vLLM mean_acceptance_length" in result.output
    report = json.loads(out.read_text())
    assert report["drafter"]["family"] == "ngram" and report["checkpoint"]["format"] == "no_weights"
    assert report["drafter"]["prompt_lookup_min"] == MIN_N and report["drafter"]["prompt_lookup_max"] == MAX_N
    # The same rounds, replayed here from the cache's rows without the scorer's loop.
    cache = hscache.open_cache(scorer_cache)
    prompt_lens = cache.index.column("prompt_len").to_pylist()
    rounds = [
        replay_ngram(
            np.asarray(cache.token_ids(r)),
            np.asarray(cache.target_argmax(r)),
            prompt_lens[r],
            NgramConfig(K, MIN_N, MAX_N),
        )
        for r in range(len(cache))
    ]
    tokens, n_rounds = sum(r.log.n_tokens for r in rounds), sum(r.log.n_rounds for r in rounds)
    assert report["rounds"] == n_rounds and report["tokens"] == tokens
    assert report["tau"]["pooled"] == pytest.approx(tokens / n_rounds, rel=1e-12)  # float64 sums
    metrics = report["family_metrics"]
    assert metrics["mean_acceptance_length"]["value"] == pytest.approx(
        mean_acceptance_length(rounds), rel=1e-12
    )
    assert metrics["rounds_with_a_draft"]["value"] == sum(r.num_drafts for r in rounds)
    # vLLM's number leaves out the rounds without a match, tau counts them as 1 token each.
    assert metrics["mean_acceptance_length"]["value"] >= report["tau"]["pooled"]
    assert [r["accepted"] for r in report["per_request"]] == [list(r.log.accepted) for r in rounds]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "pass --num-speculative-tokens K (vLLM's ngram method has no default K)"),
        (["--num-speculative-tokens", "3", "--block-size", "4"], "--block-size do not apply to the n-gram"),
        (
            ["--num-speculative-tokens", "3", "--prompt-lookup-min", "4", "--prompt-lookup-max", "2"],
            "--prompt-lookup-min 4 must be <= --prompt-lookup-max 2",
        ),
    ],
)
def test_ngram_settings_it_cannot_use_are_refused_in_one_line(scorer_cache, extra, message):
    result = CliRunner().invoke(main, ["eval", "ngram", "--cache", str(scorer_cache), "--ddtree", "", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_scorer_compare_ngram_is_the_free_baseline(scorer_cache, trained_drafter, tmp_path):
    out = tmp_path / "compare.json"
    args = ["compare", "ngram", str(trained_drafter), "--cache", str(scorer_cache), "--limit", "3"]
    args += ["--num-speculative-tokens", "4", "--prompt-lookup-max", "2", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    baseline, trained = document["drafters"]
    assert baseline["family"] == "ngram" and trained["family"] == "dflash"
    assert baseline["cost"]["draft_params"] == 0 and baseline["cost"]["flops_per_round"] is None
    assert baseline["drafting"] == {"mode": "chain", "draft_slots": 4, "source": "override"}
    # the n-gram settings reached the n-gram family only (the DFlash drafter scored as alone)
    assert document["reports"][0]["drafter"]["prompt_lookup_max"] == 2
    assert document["reports"][1]["config"]["overrides"] == {}
    assert trained["delta_vs_first"]["requests_compared"] == 3


class TestNgramContract(FamilyContract):
    """The family contract for the n-gram proposer (K 3, n-grams of 1..3)."""

    family = "ngram"
    config = EvalConfig(
        ddtree=(),
        n_boot=10,
        num_speculative_tokens=K,
        overrides={"prompt_lookup_min": MIN_N, "prompt_lookup_max": MAX_N},
    )

    @pytest.fixture
    def checkpoint(self):
        return "ngram"

    def wrong_checkpoint(self, checkpoint, tmp_path):
        return ["ngram", "--block-size", "4"], "--block-size do not apply to the n-gram proposer"


def test_an_explicit_ddtree_is_refused_naming_the_flags_the_family_reads(tmp_path):
    """The refusal comes from the family seam (Family.eval_options), before any cache is opened."""
    result = CliRunner().invoke(main, ["eval", "ngram", "--cache", str(tmp_path / "none"), "--ddtree", "8"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: --ddtree does not apply to ngram")
    assert lines[0].endswith("reads --num-speculative-tokens, --prompt-lookup-max, --prompt-lookup-min")


def test_compare_refuses_a_family_flag_none_of_its_drafters_reads(trained_drafter, tmp_path):
    """scorer compare passes each family its own flags; one that no compared drafter reads is refused
    by name (it used to be dropped silently), before any cache is opened."""
    missing = str(tmp_path / "none")
    result = CliRunner().invoke(
        main, ["compare", str(trained_drafter), "target:mtp", "--cache", missing, "--prompt-lookup-max", "2"]
    )
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(
        f"error: --prompt-lookup-max does not apply to any of {trained_drafter}, target:mtp:"
    )
    assert "their families (DFlash, MTP head) read --ddtree, " in lines[0], lines[0]
    # with the n-gram proposer among them, the flag reaches it (test_scorer_compare_ngram_is_the_free_baseline)
