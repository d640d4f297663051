"""``scorer diagnose``: pure ranking on hand-made inputs, then drafters trained with a planted
convention (scorer/train.py) whose finding must name the plant with its value, and a clean one
that must get no finding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hscache import schemas
from scorer.cli import main
from scorer.diagnose.ranking import (
    HYPOTHESIS_KINDS,
    Hypothesis,
    Outcome,
    paired_se,
    rank_outcomes,
    sequences_needed,
    verdict,
)
from scorer.diagnose.run import DiagnoseConfig, diagnose_checkpoint, measure_drift
from tests.chromium import png_is_not_blank, screenshot

# ---- pure ranking -------------------------------------------------------------------------------


def _totals(tokens: list[int], rounds: list[int]) -> np.ndarray:
    return np.asarray(list(zip(tokens, rounds)), dtype=np.int64)


BASE = _totals([30, 40, 25, 33, 41, 28, 36, 30], [20, 25, 20, 22, 30, 20, 24, 21])


def test_a_clear_fix_is_the_finding_and_rows_are_sorted_by_gain() -> None:
    better = BASE.copy()
    better[:, 0] += 12  # every request gains tokens over the same rounds
    worse = BASE.copy()
    worse[:, 0] -= 3
    ranked = rank_outcomes(
        BASE,
        [
            Outcome(Hypothesis("mask_token_id", 7, "mask 7"), worse),
            Outcome(Hypothesis("position_offset", 1, "shift +1"), better),
            Outcome(Hypothesis("layer_ids", 1, "layers +1"), untested="cache lacks layers [8]"),
        ],
        n_boot=500,
    )
    # independent computation of the pooled taus
    base_tau = BASE[:, 0].sum() / BASE[:, 1].sum()
    assert ranked["baseline"]["tau_pooled"] == pytest.approx(base_tau, rel=1e-12)
    top = ranked["hypotheses"][0]
    assert (top["kind"], top["value"]) == ("position_offset", 1)
    assert top["gain"] == pytest.approx(better[:, 0].sum() / better[:, 1].sum() - base_tau, rel=1e-12)
    assert top["significant"] and top["ci"][0] > 0
    assert [r["gain"] for r in ranked["hypotheses"]] == sorted(
        (r["gain"] for r in ranked["hypotheses"]), reverse=True
    )
    assert ranked["finding"]["kind"] == "position_offset" and ranked["finding"]["value"] == 1
    assert ranked["untested"] == [{"kind": "layer_ids", "value": 1, "reason": "cache lacks layers [8]"}]
    assert ranked["level"] == pytest.approx(1 - 0.05 / 2)  # Bonferroni over the 2 tested
    line = verdict(ranked)
    assert line.startswith("shift +1: tau ") and f"{base_tau:.2f} -> " in line
    # it beat the runner-up (the next fix) beyond their paired interval, and says so
    assert ranked["runner_up"]["kind"] == "mask_token_id" and ranked["runner_up"]["ci"][0] > 0
    assert "ahead of mask 7 by +" in line and ranked["inconclusive"] is None


def test_a_top_hypothesis_that_does_not_beat_the_baseline_is_not_passed_over_for_a_lower_one() -> None:
    """Issue 26 item 10: the true id ranked first with an interval reaching 0 while a lower-ranked id
    was significant, and the lower one was named. Neither is: the verdict is inconclusive between
    them, with a --limit from the observed variance (more than the cache holds here)."""
    steady = BASE.copy()
    steady[:, 0] += 3  # +3 tokens on every request: a small gain, a tight interval
    lumpy = BASE.copy()
    lumpy[[1, 4], 0] += 20  # +20 on two requests only: a larger gain, an interval down to 0
    ranked = rank_outcomes(
        BASE,
        [
            Outcome(Hypothesis("mask_token_id", 3, "mask token id 3"), lumpy),
            Outcome(Hypothesis("mask_token_id", 2, "mask token id 2"), steady),
        ],
        available=8,
    )
    top, second = ranked["hypotheses"]
    assert top["value"] == 3 and not top["significant"] and second["value"] == 2 and second["significant"]
    assert ranked["finding"] is None
    between = ranked["inconclusive"]["between"]
    assert [b["value"] for b in between] == [3, 2]
    limit = ranked["inconclusive"]["limit"]
    assert limit > 2 * len(BASE)
    # the sample that separates max(|observed|, 0.15) against the baseline and (the top gains
    # 0.15 or more) against the runner-up, by the independent formula
    level, runner = ranked["level"], ranked["runner_up"]
    want = max(
        sequences_needed(8, paired_se(BASE, lumpy), max(top["gain"], 0.15), level),
        sequences_needed(8, paired_se(steady, lumpy), max(runner["delta"], 0.15), level),
    )
    assert top["gain"] >= 0.15 and ranked["sample_needed"] == want > 8
    line = verdict(ranked)
    assert (
        line.startswith("inconclusive between mask token id 3 (gain +")
        and " and mask token id 2 (gain +" in line
    )
    assert f"run with --limit {limit} (the cache has 8 sequences" in line and "extract more" in line


def test_a_top_hypothesis_level_with_the_runner_up_is_inconclusive_between_them() -> None:
    """Both beat the baseline; the top one is not ahead of the runner-up beyond their interval."""
    one, two = BASE.copy(), BASE.copy()
    one[:, 0] += 3
    one[1::2, 0] += 1
    one[0, 0] += 1
    two[:, 0] += 3
    two[::2, 0] += 1
    ranked = rank_outcomes(
        BASE,
        [
            Outcome(Hypothesis("position_offset", 1, "shift +1"), one),
            Outcome(Hypothesis("position_offset", 2, "shift +2"), two),
        ],
        available=10_000,
    )
    assert all(r["significant"] for r in ranked["hypotheses"]) and ranked["finding"] is None
    runner = ranked["runner_up"]
    assert runner["value"] == 2 and runner["ci"][0] <= 0 < runner["delta"]
    # the suggested limit is the independent formula on the paired spread and observed difference
    want = sequences_needed(len(BASE), paired_se(two, one), runner["delta"], ranked["level"])
    assert ranked["inconclusive"]["limit"] == max(want, 2 * len(BASE))
    line = verdict(ranked)
    assert line.startswith("inconclusive between shift +1") and line.endswith(f"--limit {want}")


def test_a_gain_the_interval_cannot_rule_out_is_inconclusive_against_the_configured_setting() -> None:
    lumpy = BASE.copy()
    lumpy[[1, 4], 0] += 20
    ranked = rank_outcomes(BASE, [Outcome(Hypothesis("rope_theta", 1e6, "rope_theta 1e+06"), lumpy)])
    assert ranked["finding"] is None and ranked["hypotheses"][0]["ci"][1] >= ranked["resolution"]
    assert ranked["inconclusive"]["between"][1] is None
    assert verdict(ranked).startswith("inconclusive between rope_theta 1e+06 (gain +")
    assert "and the configured setting (tau " in verdict(ranked)


def test_a_mask_id_not_separated_from_the_configured_one_is_named_with_the_limit_to_run() -> None:
    """Issue 35 item 4: a mask id the interval cannot separate from the configured one is
    "inconclusive between mask token id N ... and the configured mask token id M: run with --limit L",
    never no verdict; the configured value comes from the config (only the top fix's kind counts)."""
    lumpy = BASE.copy()
    lumpy[[1, 4], 0] += 20
    outcome = Outcome(Hypothesis("mask_token_id", 1, "mask token id 1 (<pad>)"), lumpy)
    ranked = rank_outcomes(BASE, [outcome], configured={"mask_token_id": 0, "block_size": 8})
    assert ranked["finding"] is None
    assert ranked["inconclusive"]["configured"] == {"kind": "mask_token_id", "value": 0}
    limit = ranked["inconclusive"]["limit"]
    base = BASE[:, 0].sum() / BASE[:, 1].sum()
    line = verdict(ranked)
    assert line.startswith("inconclusive between mask token id 1 (<pad>) (gain +")
    assert f"and the configured mask token id 0 (tau {base:.2f}): run with --limit {limit}" in line
    # a kind the config does not state keeps the generic wording
    other = rank_outcomes(BASE, [outcome], configured={"block_size": 8})
    assert "configured" not in other["inconclusive"]
    assert "and the configured setting (tau " in verdict(other)


def test_paired_se_is_the_bootstrap_spread_and_sequences_needed_the_power_formula() -> None:
    from scorer.metrics import tau_pooled_from_totals

    rng = np.random.default_rng(1)
    rounds = rng.integers(10, 40, size=400)
    a = np.stack([rounds + rng.integers(0, 30, size=400), rounds], axis=1)
    b = a.copy()
    b[:, 0] += rng.integers(-3, 8, size=400)
    boots = []
    for _ in range(2000):
        i = rng.integers(0, 400, size=400)
        boots.append(tau_pooled_from_totals(b[i]) - tau_pooled_from_totals(a[i]))
    assert paired_se(a, b) == pytest.approx(np.std(boots), rel=0.08)  # 2000 resamples: ~2 % noise
    assert paired_se(a[:1], b[:1]) == float("inf")
    # n * ((z_{1-(1-level)/2} + z_power) * se / margin)^2 with z = 1.95996 and 0.84162
    assert sequences_needed(10, 0.1, 0.2, 0.95) == 20  # 10 * (2.80158 * 0.5)^2 = 19.6
    assert sequences_needed(10, 0.0, 0.0, 0.95) is None  # identical replays: nothing separates them
    assert sequences_needed(10, float("inf"), 0.2, 0.95) is None


def test_noise_and_non_fixes_never_make_a_finding() -> None:
    rng = np.random.default_rng(0)
    noisy = BASE.copy()
    noisy[:, 0] += rng.integers(-2, 3, size=len(BASE))  # no systematic gain
    ablated = BASE.copy()
    ablated[:, 0] += 20  # a big gain, but an ablation is never a fix
    ranked = rank_outcomes(
        BASE,
        [
            Outcome(Hypothesis("rope_theta", 1e6, "theta"), noisy),
            Outcome(Hypothesis("feature_ablation", 3, "layer 3 mean", fix=False), ablated),
        ],
    )
    assert ranked["finding"] is None
    assert ranked["hypotheses"][0]["kind"] == "feature_ablation" and ranked["hypotheses"][0]["significant"]
    assert "no setting tried beats the configured one" in verdict(ranked)


def test_every_family_declares_known_kinds_on_the_seam() -> None:
    from scorer.families import FAMILIES, family_named

    for family in FAMILIES:  # kinds in the shared order, a hook exactly when there are kinds
        assert list(family.diagnose_kinds) == [k for k in HYPOTHESIS_KINDS if k in family.diagnose_kinds]
        assert (family.diagnose is None) == (not family.diagnose_kinds), family.name
    assert set(family_named("dflash").diagnose_kinds) == set(HYPOTHESIS_KINDS) - {"d2t", "selector"}
    assert set(family_named("dflash2").diagnose_kinds) == set(family_named("dflash").diagnose_kinds) | {
        "selector"
    }
    assert {"layer_ids", "final_norm", "rope_theta", "position_offset", "d2t"} == set(
        family_named("eagle3").diagnose_kinds
    )
    assert {"final_norm", "position_offset"} == set(family_named("mtp").diagnose_kinds)


class _FakeCache:
    """hidden_states(row), token_ids(row) and layer_ids: what measure_drift reads."""

    def __init__(self, states: list[torch.Tensor], layer_ids: list[int]) -> None:
        self.states, self.layer_ids = states, layer_ids

    def hidden_states(self, row: int) -> torch.Tensor:
        return self.states[row]

    def token_ids(self, row: int) -> torch.Tensor:
        return torch.arange(len(self.states[row]))


def test_measure_drift_is_the_relative_l2_per_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, 4, generator=gen), torch.randn(7, 3, 4, generator=gen)]
    b = [x + 0.01 * torch.randn(x.shape, generator=gen) for x in a]
    drift = measure_drift(
        _FakeCache(a, [1, 3, 7]), _FakeCache([b[1], b[0]], [1, 3, 7]), [0, 1], [1, 0], [3, 7]
    )
    for layer, slot in ((3, 1), (7, 2)):
        num = sum(((y[:, slot] - x[:, slot]).double() ** 2).sum() for x, y in zip(a, b))
        den = sum((x[:, slot].double() ** 2).sum() for x in a)
        assert drift[layer] == pytest.approx(float((num / den) ** 0.5), rel=1e-5)


# ---- planted conventions ------------------------------------------------------------------------
# Measured with seed 0 on the trained target of 2026-12-04 (docs/diagnose.md): the finding's interval
# lower end is >= 0.88 tau above zero for the positions, layers and final-norm plants; we assert the
# name and value, and a margin of 0.05 on the lower end. The mask plant: its own test below. The
# layers plant (the config one layer off: tau ~1.7 against the clean ~5.6) on 6 sequences, 0.6 CPU-s
# less than 16: measured 2026-12-07 for clean seeds 0/1/2, +5.73 [+5.00, +6.24], +3.65 [+2.55, +5.35],
# +3.44 [+2.70, +4.66] (on 16: lower ends +2.80, +2.47, +3.42).
PLANTED = [  # plant, kind, value, --limit (None: the default sample, all 16 sequences)
    ("positions+1", "position_offset", 1, None),
    ("layers", "layer_ids", 1, 6),
    ("prenorm", "final_norm", "pre", None),
]


def _diagnose(checkpoint: Path, cache: Path, **options) -> dict:
    return diagnose_checkpoint(checkpoint, [cache], DiagnoseConfig(anchors="all", **options))


@pytest.mark.parametrize("plant, kind, value, limit", PLANTED)
def test_a_planted_convention_is_named_with_its_value(
    planted_drafter, diagnose_cache, plant, kind, value, limit
):
    report = _diagnose(planted_drafter(plant), diagnose_cache, limit=limit)
    finding = report["finding"]
    assert finding is not None, report["verdict"]
    assert (finding["kind"], finding["value"]) == (kind, value), report["verdict"]
    assert finding["ci"][0] > 0.05 and finding["tau_pooled"] > report["baseline"]["tau_pooled"]
    # all of them (fewer than the default sample of 32), or the --limit asked for
    assert report["sample"]["sequences"] == (limit or 16)


def test_a_wrong_mask_id_is_named(planted_drafter, diagnose_cache):
    """Trained with the cache's mask 3 (<|mask|>), configured with 0 (<|endoftext|>): the finding is the
    trained id, beyond its interval and ahead of every other mask id (conftest.PLANTS: lower ends
    +0.86 to +1.35 over clean seeds 0-2)."""
    report = _diagnose(planted_drafter("mask0"), diagnose_cache)
    finding = report["finding"]
    assert finding is not None, report["verdict"]
    assert (finding["kind"], finding["value"]) == ("mask_token_id", 3), report["verdict"]
    assert finding["ci"][0] > 0.05 and finding["tau_pooled"] > report["baseline"]["tau_pooled"]
    assert report["sample"]["sequences"] == 16


def test_a_clean_drafter_gets_no_finding(planted_drafter, diagnose_cache):
    report = _diagnose(planted_drafter("clean"), diagnose_cache)
    assert report["finding"] is None, report["verdict"]
    assert report["baseline"]["tau_pooled"] > 3  # a real drafter, not a flat one nobody could fix
    kinds = {h["kind"] for h in report["hypotheses"]} | {u["kind"] for u in report["untested"]}
    assert kinds == set(HYPOTHESIS_KINDS) - {
        "d2t",
        "selector",
    }  # every DFlash hypothesis tried or said why not
    # layer 7 is the last target layer: +1 leaves the target, and the message says so
    assert any(
        u["kind"] == "layer_ids" and "outside the target's 0..7" in u["reason"] for u in report["untested"]
    )
    # a real drafter reads the target: a layer it reads, replaced by its mean, costs tau beyond the
    # interval. On the shipped target it reads all three about evenly (each costs 1.2-1.6 of tau 5.5);
    # a drafter trained from a wider initialisation on a longer-trained target read two (costs 5.4, 4.8
    # and 0.0), so at least one must cost; the shortcut note ("leans on target layer 7": one layer
    # costing more than half the gain over 1 and twice the next) is said exactly when the rule,
    # recomputed from the rows, says so:
    costs = sorted(
        (-h["gain"] for h in report["hypotheses"] if h["kind"] == "feature_ablation"), reverse=True
    )
    assert len(costs) == 3 and any(
        h["ci"][1] < 0 for h in report["hypotheses"] if h["kind"] == "feature_ablation"
    )
    leans = costs[0] > 0.5 * (report["baseline"]["tau_pooled"] - 1) and costs[0] > 2 * max(costs[1], 0)
    assert leans == any(n.startswith("the drafter leans on target layer") for n in report["notes"])


def test_cli_names_the_plant_and_writes_json_and_html(planted_drafter, diagnose_cache, tmp_path):
    """The CLI on the block-position plant, on 6 sequences: the plant whose gain is clear there on
    both VMs it was measured on (earlier: +3.39 on 16; AVX-512: +1.87 [+0.65, +2.89] on 6). The final-norm
    plant ran here until 2026-12-04: found on 6 on earlier VMs (+1.08 [+0.51, +1.44]), inconclusive
    on the AVX-512 one (+0.56 [-0.95, +1.75]), where the drafters trained differ in their last bits.
    (The mask2 plant before that: on the trained target it has nothing to find.)"""
    json_out, html_out = tmp_path / "d.json", tmp_path / "d.html"
    result = CliRunner().invoke(
        main,
        [
            "diagnose", str(planted_drafter("positions+1")), "--cache", str(diagnose_cache),
            "--anchors", "all", "--limit", "6", "--train-metric", "5.0",
            "--json", str(json_out), "--report", str(html_out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(json_out.read_text())
    schemas.validate(report, "diagnose_report")
    assert report["finding"] is not None, report["verdict"]
    assert (report["finding"]["kind"], report["finding"]["value"]) == ("position_offset", 1), report[
        "verdict"
    ]
    assert report["sample"]["sequences"] == 6
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert any(line.startswith("verdict: block positions shifted by +1") for line in lines[-3:])
    assert report["drift"] is None  # one cache (the drift test below gives two)
    tm = report["train_metric"]
    assert tm["value"] == 5.0 and tm["best_kind"] == "position_offset"
    assert tm["train_accept_len_best"] > tm["train_accept_len"]  # the fix closes part of the gap
    assert tm["gap_after_best"] == pytest.approx(5.0 - tm["train_accept_len_best"])
    page = html_out.read_text()
    assert "Verdict:" in page and "block positions shifted by +1" in page
    assert png_is_not_blank(screenshot(html_out, tmp_path).read_bytes())


def test_cli_bad_input_is_one_line(planted_drafter, diagnose_cache, tmp_path):
    runner = CliRunner()
    three = ["--cache", str(diagnose_cache)] * 3
    result = runner.invoke(main, ["diagnose", str(planted_drafter("clean")), *three])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: diagnose takes one --cache, or two to test the drift between them; got 3"
    ]
    result = runner.invoke(main, ["diagnose", str(tmp_path / "nope"), "--cache", str(diagnose_cache)])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error:") and len(result.output.strip().splitlines()) == 1


def test_a_family_without_declared_hypotheses_is_refused_by_name(scorer_cache):
    result = CliRunner().invoke(main, ["diagnose", "ngram", "--cache", str(scorer_cache)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "is a ngram drafter" in lines[0] and "scorer compare" in lines[0]


def test_drift_noise_has_the_measured_relative_l2(scorer_cache, trained_drafter):
    import hscache
    from scorer.families.dflash.checkpoint import load_checkpoint
    from scorer.families.dflash.diagnose import DFlashReplayer, Setting

    cache = hscache.open_cache(scorer_cache)
    loaded = load_checkpoint(trained_drafter, fallbacks={"mask_token_id": cache.mask_token_id})
    replayer = DFlashReplayer(loaded, [cache], [[0, 1]])
    base = Setting(config=loaded.config, dtype="fp32", last_layer_normed=True)
    noisy = Setting(config=loaded.config, dtype="fp32", last_layer_normed=True, noise=((3, 0.05),))
    for row in (0, 1):
        a, b = replayer.features(base, row), replayer.features(noisy, row)
        H = loaded.config.hidden_size
        slot = loaded.config.target_layer_ids.index(3)
        x, y = a[:, slot * H : (slot + 1) * H], b[:, slot * H : (slot + 1) * H]
        assert float((y - x).norm() / x.norm()) == pytest.approx(0.05, rel=0.15)  # Gaussian, T*H draws
        others = [i for i in range(a.shape[1] // H) if i != slot]
        for i in others:  # the other layers are untouched
            assert torch.equal(a[:, i * H : (i + 1) * H], b[:, i * H : (i + 1) * H])


def test_block_sizes_recorded_besides_the_configured_one_are_candidates(tmp_path):
    from scorer.families.dflash.diagnose import recorded_block_sizes

    (tmp_path / "config.json").write_text(json.dumps({"block_size": 16, "dflash_config": {"block_size": 8}}))
    torch.save({"dflash_block_size": 10}, tmp_path / "training_state.pt")
    assert sorted(recorded_block_sizes(tmp_path)) == [8, 10, 16]


def test_a_second_cache_in_bf16_reports_its_drift_and_how_much_noise_explains(
    trained_drafter, fp32_cache, bf16_cache
):
    report = diagnose_checkpoint(
        trained_drafter, [fp32_cache, bf16_cache], DiagnoseConfig(anchors="all", n_boot=200)
    )
    drift = report["drift"]
    assert drift["cache"] == str(bf16_cache)
    # a bf16 forward of this target drifts by 1-3 % relative L2 over the common token prefix
    # (8 significant bits, compounded over layers): never 0, never the 25 % of diverged text
    assert set(drift["per_layer_rel_l2"]) == {"1", "3", "7"}
    assert all(1e-3 < v < 0.1 for v in drift["per_layer_rel_l2"].values()), drift
    rows = {h["value"]: h for h in report["hypotheses"] if h["kind"] == "dtype"}
    assert not rows[f"cache:{bf16_cache}"]["fix"] and not rows["drift-noise"]["fix"]
    assert drift["tau_delta"]["delta"] == rows[f"cache:{bf16_cache}"]["gain"]
    if drift["tau_delta"]["delta"]:
        assert drift["explained_fraction"] == pytest.approx(
            rows["drift-noise"]["gain"] / rows[f"cache:{bf16_cache}"]["gain"]
        )


# ---- the shared pass (issue 26 item 11) ---------------------------------------------------------


def test_the_shared_pass_replays_what_one_independent_pass_per_hypothesis_does(scorer_cache, trained_drafter):
    """Features and context shared across hypotheses change no number: every setting's totals and
    training-log accept length equal scorer eval's all-anchor path run on that setting alone."""
    from scorer.diagnose.run import prepare_diagnosis
    from scorer.families.dflash.score import score_dflash_sequence
    from scorer.metrics import AcceptLen, request_totals

    plan = prepare_diagnosis(trained_drafter, [scorer_cache], DiagnoseConfig(limit=2))
    settings = [plan.base, *plan.settings]
    kinds = {h.kind for h in plan.hypotheses}
    assert {"position_offset", "mask_token_id", "rope_theta", "dtype", "feature_ablation"} <= kinds
    replayer = plan.replayer
    shared = replayer.replay_many(settings, range(2))
    for setting, (totals, accept) in zip(settings, shared):
        drafter, logs, want_accept = replayer.drafter(setting), [], AcceptLen(0, 0)
        for row in replayer.rows[0][:2]:
            cache = replayer.caches[0]
            result = score_dflash_sequence(
                drafter, replayer.features(setting, row), cache.token_ids(row), cache.target_argmax(row),
                cache.index.column("prompt_len")[row].as_py(), anchors="all",
            )  # fmt: skip
            logs.append(result.chain)
            want_accept = want_accept + result.accept_len
        assert np.array_equal(totals, request_totals(logs)) and accept == want_accept, setting


def test_the_default_sample_grows_to_what_the_variance_asks_and_equals_that_limit(
    planted_drafter, diagnose_cache, monkeypatch
):
    """Without --limit the first sample (DEFAULT_SAMPLE, 2 here) grows to ``sample_needed`` (5 here:
    the ranking's estimate is tested on hand-made inputs above), replaying only the new sequences;
    the grown sample is the first N of the same seeded order, so it replays what --limit N does."""
    import scorer.diagnose.run as run

    seen = []

    def ranking(*args, **kwargs):
        seen.append(len(args[0]))
        return {**rank_outcomes(*args, **kwargs), "sample_needed": 5}

    monkeypatch.setattr(run, "DEFAULT_SAMPLE", 2)
    monkeypatch.setattr(run, "rank_outcomes", ranking)
    grown = _diagnose(planted_drafter("layers"), diagnose_cache, n_boot=200)
    sample = grown["sample"]
    assert seen == [2, 5] and sample["first"] == 2 and sample["limit"] is None
    assert sample["sequences"] == 5 and grown["baseline"]["n_requests"] == 5
    fixed = _diagnose(planted_drafter("layers"), diagnose_cache, n_boot=200, limit=sample["sequences"])
    assert fixed["baseline"] == grown["baseline"]
    assert [(h["kind"], h["value"], h["tau_pooled"]) for h in fixed["hypotheses"]] == [
        (h["kind"], h["value"], h["tau_pooled"]) for h in grown["hypotheses"]
    ]


def test_on_too_few_sequences_a_plant_is_inconclusive_never_another_finding(planted_drafter, diagnose_cache):
    """The final-norm plant (fine-tuned 150 steps: +1.96 [+1.20, +2.78] on all 16 sequences, found on
    6) on 4: measured inconclusive between it and the configured setting with --limit 11
    (2026-12-07; at 250 steps, docs/diagnose.md: --limit 8); never a finding for anything else."""
    report = _diagnose(planted_drafter("prenorm"), diagnose_cache, limit=4)
    finding, open_ = report["finding"], report["inconclusive"]
    if finding is not None:
        assert (finding["kind"], finding["value"]) == ("final_norm", "pre"), report["verdict"]
    else:
        assert (open_["between"][0]["kind"], open_["between"][0]["value"]) == ("final_norm", "pre")
        assert open_["limit"] > 4 and f"run with --limit {open_['limit']}" in report["verdict"]
