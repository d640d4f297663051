"""``hscache extract --engine vllm`` run in vLLM's own interpreter: ``python -m
hscache.engines.vllm.extract_worker JOB OUT`` (``runtime.run_worker`` starts it).

JOB is the ``ExtractConfig`` as JSON (its ``sampling`` as ``SamplingSetting.to_dict``), OUT
receives the ``ExtractResult`` as JSON, or ``{"error": one line, "kind": ...}`` and exit 2 on a refusal.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(job_path: str, out_path: str) -> int:
    from hscache.capture.extract import ExtractConfig, extract
    from hscache.engines.vllm.runtime import VllmTargetError, VllmUnavailableError, VllmVersionError
    from hscache.errors import HscacheError
    from hscache.store.sampling import SamplingSetting

    job = json.loads(Path(job_path).read_text())
    if job.get("shard") is not None:
        job["shard"] = tuple(job["shard"])
    if job.get("sampling") is not None:
        job["sampling"] = SamplingSetting.from_dict(job["sampling"])
    try:
        result = extract(ExtractConfig(**job))
    except HscacheError as exc:
        kinds = {VllmTargetError: "target", VllmVersionError: "version", VllmUnavailableError: "unavailable"}
        kind = next((name for cls, name in kinds.items() if isinstance(exc, cls)), "input")
        Path(out_path).write_text(json.dumps({"error": str(exc), "kind": kind}))
        return 2
    document = dataclasses.asdict(result)
    document["path"] = str(result.path)
    Path(out_path).write_text(json.dumps(document))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
