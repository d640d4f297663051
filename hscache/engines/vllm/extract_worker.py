"""``hscache extract --engine vllm`` run in vLLM's own interpreter: ``python -m
hscache.engines.vllm.extract_worker JOB OUT`` (``runtime.run_worker`` starts it).

JOB is the ``ExtractConfig`` as JSON (``capture/extract.py`` ``worker_job``; read back by ``config_of``), OUT
receives the ``ExtractResult`` as JSON, or ``{"error": one line, "kind": ...}`` and exit 2 on a refusal.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["config_of", "main"]


def config_of(job: dict[str, Any]) -> Any:
    """The ``ExtractConfig`` of a job ``hscache.capture.extract.worker_job`` wrote."""
    from hscache.capture.extract import ExtractConfig
    from hscache.store.sampling import SamplingSetting

    values = dict(job)
    if values.get("shard") is not None:
        values["shard"] = tuple(values["shard"])
    if values.get("sampling") is not None:
        values["sampling"] = SamplingSetting.from_dict(values["sampling"])
    return ExtractConfig(**values)


def main(job_path: str, out_path: str) -> int:
    from hscache.capture.extract import extract
    from hscache.engines.vllm.runtime import VllmTargetError, VllmUnavailableError, VllmVersionError
    from hscache.errors import HscacheError

    job = json.loads(Path(job_path).read_text())
    try:
        result = extract(config_of(job))
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
