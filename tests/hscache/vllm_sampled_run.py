"""One process in vLLM's interpreter for tests/hscache/test_vllm_sampled.py (vLLM is imported once):

``python tests/hscache/vllm_sampled_run.py JOB B RESULT [GREEDY_JOB GREEDY_RESULT]``: extract GREEDY_JOB
(tests/hscache/test_vllm_engine.py's greedy extraction) through the worker's own ``main``; extract JOB (a
sampled ``--engine vllm`` job, ``hscache.capture.extract.worker_job``) the same way into its ``out``; then
the same job into B, stopped after its first 3 sequences were committed, then resumed. RESULT receives
what each run returned. One process for both test files: vLLM's import (~20 CPU-s) is paid once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from hscache.capture.extract import Progress, extract
from hscache.engines.vllm.extract_worker import config_of, main

STOP_AFTER = 3


class Stopped(Exception):
    """The interruption of the second run (its committed part is what a crash leaves)."""


class StopAfter(Progress):
    def __init__(self, sequences: int) -> None:
        self.sequences, self.seen = sequences, 0

    def advance(self, sequences: int, tokens: int) -> None:
        self.seen += sequences
        if self.seen >= self.sequences:
            raise Stopped


def run(job_path: str, second: str, result_path: str, greedy_job: str = "", greedy_result: str = "") -> int:
    if greedy_job and main(greedy_job, greedy_result) != 0:
        return 2
    first = Path(result_path).with_suffix(".first.json")
    status = main(job_path, str(first))
    config = replace(config_of(json.loads(Path(job_path).read_text())), out=second, connector_dir=None)
    config = replace(config, commit_every_s=0.0)
    try:
        extract(config, StopAfter(STOP_AFTER))
        stopped = False
    except Stopped:
        stopped = True
    resumed = extract(config)
    document = {
        "first_status": status,
        "first": json.loads(first.read_text()),
        "stopped": stopped,
        "resumed_from": resumed.resumed_from,
        "sequences": resumed.sequences,
    }
    Path(result_path).write_text(json.dumps(document))
    return 0


if __name__ == "__main__":
    sys.exit(run(*sys.argv[1:6]))
