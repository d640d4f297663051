"""The seam owns what is per family (issue 24): the order of the registry does not decide a
checkpoint's family, ``scorer init`` refuses another family's flag by name, a family's row alone
declares its command-line flags, and a loaded drafter of every family says its family (no fallback
to DFlash)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from click.testing import CliRunner

import scorer.families as registry
from scorer.cli import main
from scorer.errors import CheckpointError
from scorer.families import FAMILIES, display_name, family_for, probe_checkpoint
from scorer.families.base import CheckpointProbe, Drafter, Family, FamilyFlag, target_head_name


def _probes(trained_drafter, eagle3_drafter) -> list[CheckpointProbe]:
    return [
        probe_checkpoint(trained_drafter),
        probe_checkpoint(eagle3_drafter),
        probe_checkpoint("target:mtp"),
        probe_checkpoint("ngram"),
        CheckpointProbe("x.safetensors", {"dflash_config": {"conv_group_size": 16}}, None),  # DFlash2
    ]


def test_the_registry_order_does_not_decide_the_family(trained_drafter, eagle3_drafter, monkeypatch):
    probes = _probes(trained_drafter, eagle3_drafter)
    expected = ["dflash", "eagle3", "mtp", "ngram", "dflash2"]
    assert [family_for(p).name for p in probes] == expected
    monkeypatch.setattr(registry, "FAMILIES", tuple(reversed(FAMILIES)))  # DFlash, the fallback, first
    assert [family_for(p).name for p in probes] == expected


def test_target_heads_are_parsed_in_one_place():
    assert target_head_name("target:mtp-prenorm") == "mtp-prenorm"
    assert target_head_name("drafter/") is None
    assert display_name("eagle3") == "EAGLE-3" and display_name("mtp") == "MTP head"
    assert display_name("not-a-family") == "not-a-family"  # an old report's name, as written


@pytest.mark.parametrize(
    ("family", "flag", "value"),
    [
        ("eagle3", "--block-size", "4"),  # DFlash's block: silently ignored before the seam owned it
        ("eagle3", "--eval-every", "2"),
        ("dflash", "--num-speculative-tokens", "2"),
        ("dflash", "--layout", "specforge"),
        ("dflash2", "--draft-layers", "2"),
    ],
)
def test_scorer_init_refuses_another_familys_flag_by_name(scorer_cache, tmp_path, family, flag, value):
    out = tmp_path / "drafter"
    args = ["init", str(out), "--cache", str(scorer_cache), "--family", family, flag, value]
    if family == "dflash2":
        args += ["--from", "d"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and f"{flag} does not apply to --family {family}" in line
    assert not out.exists()  # refused before anything was written


def test_scorer_init_of_a_family_without_weights_is_refused(scorer_cache, tmp_path):
    for family in ("mtp", "ngram"):
        result = CliRunner().invoke(
            main, ["init", str(tmp_path / family), "--cache", str(scorer_cache), "--family", family]
        )
        assert result.exit_code == 2 and "has no weights of its own to write" in result.output
    unknown = CliRunner().invoke(
        main, ["init", str(tmp_path / "x"), "--cache", str(scorer_cache), "--family", "medusa"]
    )
    assert (
        unknown.exit_code == 2
        and "known families: mtp, eagle3, dflash2, dspark, dflash, ngram" in unknown.output
    )


def test_scorer_init_eagle3_through_the_seam_says_what_it_wrote(diagnose_cache, tmp_path):
    out = tmp_path / "eagle3"
    args = [
        "init",
        str(out),
        "--cache",
        str(diagnose_cache),  # every layer: the engines' default [1, 3, 4] included
        "--family",
        "eagle3",
        "--num-speculative-tokens",
        "2",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "saved a random EAGLE-3 drafter" in result.output and "drafting 2 tokens a round" in result.output
    assert (
        json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
            "speculative_tokens"
        ]
        == 2
    )


def test_every_loaded_drafter_is_a_drafter_of_its_family(scorer_cache, trained_drafter, eagle3_drafter):
    from hscache import open_cache
    from scorer.studies.evaluate import EvalConfig, load_drafter

    cache = open_cache(scorer_cache)
    for checkpoint, family, config in (
        (trained_drafter, "dflash", EvalConfig()),
        (eagle3_drafter, "eagle3", EvalConfig()),
        ("target:mtp", "mtp", EvalConfig(ddtree=())),
        ("ngram", "ngram", EvalConfig(ddtree=(), num_speculative_tokens=2)),
    ):
        drafter, _ = load_drafter(checkpoint, cache, config)
        assert isinstance(drafter, Drafter) and drafter.family == family
        assert isinstance(drafter.config.to_hf_config(), dict) and drafter.config.block_size >= 2


def _throwaway_family(overrides_seen: list[dict]) -> Family:
    """A family registered by a test only: the checkpoint ``throwaway``, one flag ``--draft-width``;
    its loader records the overrides it was given and stops the run."""

    def load(checkpoint, cache, config):
        overrides_seen.append(dict(config.overrides))
        raise CheckpointError("throwaway: loaded, stopping here")

    return Family(
        name="throwaway",
        layouts=("the word throwaway",),
        claims=lambda probe: probe.path == "throwaway",
        load=load,
        score_rows=lambda *args, **kwargs: [],
        display_name="Throwaway",
        flags=(FamilyFlag("draft_width", int, "Throwaway: how wide it drafts.", minimum=2),),
    )


def test_a_familys_flags_come_from_its_row_alone(scorer_cache, monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, _throwaway_family(seen)))
    for command in ("eval", "compare", "online"):  # every scoring command takes it
        shown = CliRunner().invoke(main, [command, "--help"]).output
        assert "--draft-width" in shown and "Throwaway: how wide it drafts." in shown, command
    run = ["eval", "throwaway", "--cache", str(scorer_cache), "--ddtree", ""]
    result = CliRunner().invoke(main, [*run, "--draft-width", "3"])
    assert result.exit_code == 2 and "throwaway: loaded, stopping here" in result.output, result.output
    assert seen == [{"draft_width": 3}]  # the value reached the family as an override
    low = CliRunner().invoke(main, [*run, "--draft-width", "1"])  # its declared minimum
    assert low.exit_code == 2 and "--draft-width" in low.output and seen == [{"draft_width": 3}]
    # another family refuses it by name, before anything is read
    other = CliRunner().invoke(main, ["eval", "ngram", "--cache", "/nonexistent", "--draft-width", "3"])
    lines = other.output.strip().splitlines()
    assert other.exit_code == 2 and len(lines) == 1, other.output
    assert lines[0].startswith("error: --draft-width does not apply to ngram: the n-gram")
    monkeypatch.setattr(registry, "FAMILIES", FAMILIES)  # without its row, the flag is gone
    assert "--draft-width" not in CliRunner().invoke(main, ["eval", "--help"]).output


def test_a_rows_functions_are_bound_lazily_under_their_own_names():
    from scorer.families.ngram import NGRAM, drafter

    assert (NGRAM.load.__module__, NGRAM.load.__name__) == ("scorer.families.ngram.drafter", "load")
    assert NGRAM.load.__wrapped__ is drafter.load and NGRAM.load.__doc__ == drafter.load.__doc__
    assert pickle.loads(pickle.dumps(NGRAM.load)).__wrapped__ is drafter.load
    assert {"prompt_lookup_min", "prompt_lookup_max"} <= NGRAM.eval_options  # a family reads its flags


def test_two_families_declaring_one_flag_differently_is_refused(monkeypatch):
    from scorer.cli.shared import registered_flags

    one = _throwaway_family([])
    other = dataclasses.replace(one, name="other", flags=(FamilyFlag("draft_width", float, "Other."),))
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, one, dataclasses.replace(one, name="same")))
    every = [f.name for family in FAMILIES for f in family.flags]  # the registry's own flags, in its order
    assert {"prompt_lookup_min", "prompt_lookup_max"} <= set(every)
    assert [f.name for f in registered_flags()] == [*every, "draft_width"]
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, one, other))
    with pytest.raises(ValueError, match="--draft-width is declared differently by the throwaway and other"):
        registered_flags()
