"""Distributed scoring gives exactly the single-process report; drafters load once per worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from scorer import init_drafter
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.studies.distributed import TaskSpec, evaluate_distributed, plan_tasks, score_task, submit_scoring
from scorer.studies.evaluate import EvalConfig, evaluate

_TIMINGS = ("seconds", "created_at")


def _numbers(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in _TIMINGS}


@pytest.fixture(scope="module")
def drafter(scale_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("drafter") / "d"
    init_drafter(scale_cache, out, seed=3)
    return out


@pytest.fixture(scope="module")
def single(drafter: Path, scale_cache: Path) -> dict:
    """The single-process reference, on one torch thread like the workers (see test below)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return evaluate(drafter, scale_cache, EvalConfig(samples=2))
    finally:
        torch.set_num_threads(before)


def test_plan_tasks_cuts_contiguous_ranges_by_tokens():
    assert plan_tasks([5, 5, 5, 5], 10) == [range(2), range(2, 4)]
    assert plan_tasks([30, 1, 1], 10) == [range(1), range(1, 3)]  # a long sequence is never split
    assert plan_tasks([], 10) == []
    with pytest.raises(ValueError, match="tokens_per_task 0 must be at least 1"):
        plan_tasks([1], 0)


def test_two_workers_give_exactly_the_single_process_report(dask_client, drafter, scale_cache, single):
    report = evaluate_distributed(
        drafter, scale_cache, EvalConfig(samples=2), dask_client, tokens_per_task=40
    )
    assert _numbers(report) == _numbers(single)


def test_each_worker_loads_the_drafter_once(dask_client, drafter, scale_cache):
    config = EvalConfig(ddtree=(8,), n_boot=10)
    job = submit_scoring(dask_client, drafter, scale_cache, config, tokens_per_task=1)
    first = job.outputs()
    assert len(first) == 4 and {o.pid for o in first} <= set(dask_client.run(os.getpid).values())
    loads = [o for o in first if o.loaded_drafter]
    assert 1 <= len(loads) <= 2 and len({o.pid for o in loads}) == len(loads)  # once per worker process
    again = submit_scoring(dask_client, drafter, scale_cache, config, tokens_per_task=1).outputs()
    assert not any(o.loaded_drafter for o in again)


def test_eval_cli_on_a_running_scheduler(dask_client, drafter, scale_cache, single, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        main,
        [
            "eval",
            str(drafter),
            "--cache",
            str(scale_cache),
            "--samples",
            "2",
            "--scheduler",
            dask_client.scheduler.address,
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert _numbers(json.loads(out.read_text())) == json.loads(json.dumps(_numbers(single)))


def test_worker_errors_reach_the_client(dask_client, scale_cache, tmp_path):
    with pytest.raises(ScorerError, match="needs a dask client"):
        evaluate_distributed(tmp_path / "x", scale_cache, EvalConfig(), None)
    spec = TaskSpec(str(tmp_path / "missing"), (), str(scale_cache), 0, EvalConfig(), 0, 1)
    with pytest.raises(FileNotFoundError):
        dask_client.submit(score_task, spec, pure=False).result()


@pytest.fixture
def workers_elsewhere(dask_client, bf16_cache, tmp_path):
    """The workers' working directory holds ANOTHER cache at ``cache`` (the bf16 twin of scale_cache:
    same layers, other numbers), as on a cluster whose nodes each have a ``cache/`` of their own."""
    other = tmp_path / "worker"
    other.mkdir()
    (other / "cache").symlink_to(bf16_cache)
    before = dask_client.run(os.getcwd)
    dask_client.run(os.chdir, str(other))
    yield other
    for address, directory in before.items():
        dask_client.run(os.chdir, directory, workers=[address])


def test_a_relative_cache_path_scores_the_clients_cache(
    dask_client, workers_elsewhere, drafter, scale_cache, single, tmp_path, monkeypatch
):
    """``scorer eval D --cache cache/ --scheduler ADDR`` made each worker open its own ``cache/``
    (issue 35.10: tau 7.750 printed, 6.359 true): paths leave the client absolute."""
    (tmp_path / "cache").symlink_to(scale_cache)
    monkeypatch.chdir(tmp_path)
    report = evaluate_distributed(drafter, "cache", EvalConfig(samples=2), dask_client, tokens_per_task=40)
    assert report["tau"] == single["tau"] and report["per_request"] == single["per_request"]


def test_a_worker_refuses_a_cache_other_than_the_clients(
    dask_client, workers_elsewhere, drafter, scale_cache
):
    """What absolute paths cannot catch (another machine's copy at the same path): each worker checks
    the digest of the cache it opened against the client's."""
    import hscache
    from hscache.store.integrity import cache_digest

    cache = hscache.open_cache(scale_cache)
    spec = TaskSpec(str(drafter), (), "cache", cache.num_tokens, EvalConfig(), 0, 1, cache_digest(cache))
    with pytest.raises(
        ScorerError, match=r"opened cache with digest .* but the client's cache there has digest"
    ):
        dask_client.submit(score_task, spec, pure=False).result()
    score_task(
        TaskSpec(
            str(drafter), (), str(scale_cache), cache.num_tokens, EvalConfig(), 0, 1, cache_digest(cache)
        )
    )


def test_a_worker_checks_the_rows_of_arrays_no_drafter_reads(drafter, scale_cache, tmp_path):
    """As in-process eval does: a damaged top-k chunk under the scored rows is refused, so a report
    that carries the cache's digest vouches for them (hscache.store.row_ranges.check_other_arrays)."""
    import shutil

    import hscache

    root = tmp_path / "c"
    shutil.copytree(scale_cache, root)
    chunk = root / "arrays" / "target_topk_values" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[16] ^= 0x01  # inside the first committed rows
    chunk.write_bytes(bytes(data))
    cache = hscache.open_cache(root)
    spec = TaskSpec(str(drafter), (), str(root), cache.num_tokens, EvalConfig(), 0, len(cache))
    with pytest.raises(hscache.CacheFormatError, match="target_topk_values"):
        score_task(spec)
