"""The import paths that moved (the scorer regrouped by role, issue 32; its compatibility modules removed,
issue 47) fail naming the new path (scorer.MOVED), and docs/renames.sed rewrites the old module paths to
the new ones (and leaves the new ones alone)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "statement,new",
    [
        ("from scorer.evaluate import EvalConfig, evaluate", "scorer.studies.evaluate"),
        ("import scorer.online_sampled", "scorer.online.sampled"),
        ("from scorer.init import init_drafter", "scorer.make"),
        ("from scorer.train import train_drafter", "scorer.make"),
        ("from scorer.online import OnlineConfig, run_online", "scorer.online.greedy.OnlineConfig"),
    ],
)
def test_an_old_import_path_fails_naming_the_new_one(statement, new):
    """The compatibility modules are gone (issue 47): an old path is an ImportError whose one line says
    where it went, and Python's own message for any other missing name is untouched."""
    with pytest.raises(ImportError) as raised:
        exec(statement, {})
    message = str(raised.value)
    assert "\n" not in message and f"moved to {new} " in message and "docs/renames.sed" in message
    assert message.startswith("No module named 'scorer.")


def test_the_new_paths_and_the_public_api_import_and_other_misses_are_pythons_own():
    import scorer
    import scorer.make
    from scorer.online import greedy, sampled

    assert (scorer.init_drafter, scorer.train_drafter) == (
        scorer.make.init_drafter,
        scorer.make.train_drafter,
    )
    assert (greedy.OnlineConfig.__module__, sampled.SampledOnlineConfig.__module__) == (
        "scorer.online.greedy",
        "scorer.online.sampled",
    )
    assert "OnlineConfig" not in vars(scorer.online)  # refused, never re-exported
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'scorer\.nope'$"):
        import scorer.nope
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        scorer.online.nope  # noqa: B018
    with pytest.raises(ImportError, match=r"^cannot import name 'nope' from 'scorer'"):
        from scorer import nope  # noqa: F401


@pytest.mark.skipif(shutil.which("sed") is None, reason="needs sed")
def test_renames_sed_rewrites_the_old_module_paths_once():
    old = "\n".join(
        [
            "from scorer.online import OnlineConfig",
            "from scorer.online_sampled import run_online_sampled",
            "import scorer.diagnose_run as run",
            "from scorer.diagnose import Hypothesis",
            "from scorer.verification import slot_tokens",
            "from scorer import served",
            "x = scorer.evaluate_module  # scorer/served.py, scorer.cli.online",
            "from scorer.evaluate import evaluate",
            "from scorer.train import train_drafter",
            "monkeypatch.setattr(scorer.init, 'init_drafter', f)  # scorer/init.py",
        ]
    )
    new = "\n".join(
        [
            "from scorer.online.greedy import OnlineConfig",
            "from scorer.online.sampled import run_online_sampled",
            "import scorer.diagnose.run as run",
            "from scorer.diagnose.ranking import Hypothesis",
            "from scorer.rules.expectation import slot_tokens",
            "from scorer.offline import sampled_view as served",
            "x = scorer.evaluate_module  # scorer/offline/sampled_view.py, scorer.cli.online",
            "from scorer.studies.evaluate import evaluate",
            "from scorer import train_drafter",
            "monkeypatch.setattr(scorer.make, 'init_drafter', f)  # scorer/make.py",
        ]
    )

    def sed(text: str) -> str:
        script = str(ROOT / "docs" / "renames.sed")
        return subprocess.run(
            ["sed", "-E", "-f", script], input=text, capture_output=True, text=True, check=True
        ).stdout

    assert sed(old).rstrip("\n") == new
    assert sed(new).rstrip("\n") == new
