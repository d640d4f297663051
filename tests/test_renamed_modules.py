"""The Python API names that README.md and docs/python-api.md showed before the scorer was regrouped by
role (issue 32) still import, as the very objects of their new modules, and docs/renames.sed rewrites
the old module paths to the new ones (and leaves the new ones alone)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_old_import_paths_are_the_new_objects():
    from scorer.evaluate import EvalConfig, evaluate
    from scorer.online import OnlineConfig, greedy, run_online, sampled
    from scorer.online_sampled import SampledOnlineConfig, run_online_sampled
    from scorer.studies import evaluate as studies_evaluate

    assert (EvalConfig, evaluate) == (studies_evaluate.EvalConfig, studies_evaluate.evaluate)
    assert (OnlineConfig, run_online) == (greedy.OnlineConfig, greedy.run_online)
    assert (SampledOnlineConfig, run_online_sampled) == (
        sampled.SampledOnlineConfig,
        sampled.run_online_sampled,
    )


def test_the_online_package_re_exports_exactly_the_greedy_loops_names():
    import scorer.online
    from scorer.online import greedy

    assert all(getattr(scorer.online, name) is getattr(greedy, name) for name in greedy.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        scorer.online.nope  # noqa: B018


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
        ]
    )

    def sed(text: str) -> str:
        script = str(ROOT / "docs" / "renames.sed")
        return subprocess.run(
            ["sed", "-E", "-f", script], input=text, capture_output=True, text=True, check=True
        ).stdout

    assert sed(old).rstrip("\n") == new
    assert sed(new).rstrip("\n") == new
