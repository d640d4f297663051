"""Issue 51.5: a run that skips the vLLM, peer, browser (...) tests says at its end how to run them."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import pytest_terminal_summary, skip_summary

# The reasons the suite's own skips give (tests/conftest.py, tests/judge/, tests/scorer/test_eagle3_peers.py,
# test_dflash2.py, tests/chromium.py, tests/hscache/test_remote.py, the GPU checks), and one of no group.
VLLM = "no vLLM environment at /x/.vllm/bin/python: `bash .ci/vllm-env.sh` builds it (CI always does)"
PEERS = "peer oracle not installed: pip install --no-deps --target .peers nemo-automodel==0.7.0 hs-connectors==0.9.0"
CHROMIUM = "chromium not installed (apt-get install chromium); the HTML report was not rendered"
MOTO = "could not import 'moto.server': pip install 'moto[server]' to test s3:// caches"
GPU = "needs CUDA and flash-linear-attention (GPU machine)"
OTHER = "fp32 and bf16 greedy continuations happened to agree on every prompt"


def test_skips_are_counted_by_what_runs_them_in_the_readme_order():
    reasons = [VLLM, OTHER, PEERS, VLLM, CHROMIUM, GPU, MOTO, VLLM, PEERS]
    assert skip_summary(reasons) == [
        "3 tests skipped (vLLM): run `bash .ci/vllm-env.sh` to run them",
        "2 tests skipped (peer oracles): run `.venv/bin/pip install -q --no-deps --target .peers "
        "speculators==0.9.0 specforge==0.2.0 nemo-automodel==0.7.0 hs-connectors==0.9.0` to run them",
        "1 test skipped (browser): run `apt-get install chromium` to run them",
        '1 test skipped (dev extras): run `.venv/bin/pip install -e ".[dev]"` to run them',
        "1 test skipped (GPU): they run on a CUDA machine (`pytest -m gpu` there)",
        "1 test skipped (other): `pytest -rs` lists why",
    ]
    assert skip_summary([]) == []


def _finish(reporter) -> None:
    """Run the hook as pluggy runs a wrapper: up to its yield (pytest's own summary), then past it."""
    hook = pytest_terminal_summary(reporter, 0, None)
    next(hook)
    try:
        hook.send(None)
    except StopIteration:
        return
    raise AssertionError("the hook yields once")


def test_the_end_of_a_run_names_the_commands():
    """The hook reads pytest's skip reports (longrepr (path, line, "Skipped: reason")) and writes after
    pytest's own summary, under a separator; a run with no skips writes nothing."""
    written: list[str] = []
    reporter = SimpleNamespace(
        stats={"skipped": [SimpleNamespace(longrepr=("t.py", 3, f"Skipped: {VLLM}")) for _ in range(2)]},
        write_sep=lambda sep, title: written.append(f"{sep} {title}"),
        write_line=written.append,
    )
    _finish(reporter)
    assert written == [
        "- skipped tests, and how to run them",
        "2 tests skipped (vLLM): run `bash .ci/vllm-env.sh` to run them",
    ]
    written.clear()
    reporter.stats = {"passed": [object()]}
    _finish(reporter)
    assert written == []
