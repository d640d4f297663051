"""``runs.json``: what each run that wrote a cache did, kept beside the content and outside its digest.

A cache's digest (store/integrity.py ``cache_digest``) pins what the cache holds: the rows, the
index, the target files, the settings and ``provenance.json`` (how the rows were computed: model,
weights and tokenizer hashes, layers, kernels, prompts hash). What a run did (when it started and
finished, the host, the installed versions, the command line, the paths it read) changes from run to
run without changing a single row, so it lives here, one entry per run (schemas/run_log.schema.json):
a re-run that adds nothing writes nothing, and two runs that write the same rows give the same digest.

Protection: the manifest records this file's sha256 and size under ``run_log``, inside its seal
(``content_sha256``) but left out of the digest. Opening or verifying a cache therefore refuses a
``runs.json`` edited without resealing, like any other file; a resealed edit (anyone can reseal) keeps
the digest, because nothing a reader scores depends on it. docs/faults.md says the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hscache import schemas
from hscache.errors import CacheFormatError
from hscache.store import fsio, jsonio
from hscache.store.layout import RUN_LOG

__all__ = ["RUN_LOG_SCHEMA_VERSION", "encode_run_log", "provenance_with_runs", "read_run_log"]

RUN_LOG_SCHEMA_VERSION = 1


def read_run_log(root: str | Path) -> list[dict[str, Any]]:
    """The runs recorded in the cache at ``root``, oldest first; ``[]`` where there is no run log
    (a cache written before it, a directory of shards: each shard has its own).

    Raises:
        CacheFormatError: the file is not a valid run log.
    """
    path = Path(root) / RUN_LOG
    if not path.is_file():
        return []
    try:
        document = jsonio.loads(bytes(fsio.read_regular(path)))
        schemas.validate(document, "run_log")
    except (json.JSONDecodeError, UnicodeDecodeError, schemas.SchemaError, OSError) as exc:
        raise CacheFormatError(f"{path} is not a valid run log ({exc}); the cache is damaged") from exc
    return list(document["runs"])


def encode_run_log(runs: list[dict[str, Any]]) -> bytes:
    """The bytes of ``runs.json`` holding ``runs``, validated against schemas/run_log.schema.json."""
    document = {"schema_version": RUN_LOG_SCHEMA_VERSION, "runs": runs}
    schemas.validate(document, "run_log")
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def provenance_with_runs(provenance: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``provenance`` with the run facts of ``runs`` under the keys provenance.json held before the run
    log existed (``versions``, ``hardware``, ``command_line``, ``hscache_git_commit``, ``timestamps``,
    ``model.path``, ``prompts.path``), so that a diff lays old and new caches side by side the same way.
    A provenance that holds them already (written before the run log) is returned as it is."""
    if not runs or "timestamps" in provenance:
        return provenance
    first, last = runs[0], runs[-1]
    merged = {
        **provenance,
        "hscache_git_commit": first["hscache_git_commit"],
        "versions": first["versions"],
        "hardware": first["hardware"],
        "command_line": first["command_line"],
        "timestamps": {
            "started_at": first["started_at"],
            "finished_at": last["finished_at"],
            "resumed_at": [run["started_at"] for run in runs[1:]],
        },
    }
    for section, key in (("model", "model"), ("prompts", "prompts")):
        if isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], "path": first["inputs"].get(key)}
    return merged
