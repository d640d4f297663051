"""``scorer compare D1 D2 ... --cache greedy/ --cache t07/``: each drafter's tau per sampling setting.

A drafter, a K or a tree budget chosen at temperature 0 can be the wrong choice at the temperature
a server runs (issue 25). One cache per sampling setting, all of the same prompts: every drafter is
scored on each (``scorer.studies.compare.compare_drafters``, so each cache's own setting and the rule of
``--draft-sampling`` apply), and the table sets the taus side by side with the ranking at each
setting. tau is the pooled one (tokens / rounds, vLLM's convention); on a sampled cache tau as
served (``report["sampling"]``) with its interval over prompts; on a greedy cache the replay's
pooled tau with its interval over requests (one per prompt).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hscache import schemas
from hscache.store.sampling import sampling_setting
from scorer.documents import run_stamp
from scorer.errors import ScorerError
from scorer.offline.scoring import EvalConfig
from scorer.report.served import render_settings, settings_table
from scorer.studies.compare import compare_drafters

__all__ = ["COMPARE_SETTINGS_SCHEMA_VERSION", "compare_settings", "render_settings", "settings_table"]

COMPARE_SETTINGS_SCHEMA_VERSION = 2  # 2: settings[].sequences -> requests (issue 32)


def _served_tau(report: dict[str, Any]) -> dict[str, Any]:
    """(tau, lo, hi, interval unit) of one drafter's report on one cache."""
    sampling = report.get("sampling")
    if sampling is not None:
        chain = sampling["modes"].get("chain") or {}
        return {
            "tau": chain.get("tau"),
            "lo": chain.get("lo"),
            "hi": chain.get("hi"),
            "over": "prompts",
            "rule": sampling["rule"],
        }
    tau = report["tau"]
    ci = tau["pooled_ci95"] or [None, None]
    return {"tau": tau["pooled"], "lo": ci[0], "hi": ci[1], "over": "requests", "rule": "greedy"}


def _prompts(report: dict[str, Any]) -> list[str]:
    return sorted({row["record_id"] for row in report["per_request"]})


def compare_settings(
    checkpoints: Sequence[str | Path], cache_paths: Sequence[str | Path], config: EvalConfig = EvalConfig()
) -> dict[str, Any]:
    """Score every checkpoint on every cache; per drafter its tau at each cache's sampling setting.

    Returns:
        The document (schemas/compare_settings_report.schema.json): ``settings`` (per cache: path,
        setting, rule, prompts, requests), ``drafters`` (per drafter: tau per setting and its rank
        there), ``ranking`` (per setting: the drafters best first), ``warnings`` and ``compares``
        (the per-cache compare documents, reports included).

    Raises:
        ScorerError: fewer than two caches or no checkpoint (and every refusal of ``compare_drafters``).
    """
    if len(cache_paths) < 2:
        raise ScorerError("scorer compare across settings needs at least two --cache (e.g. greedy/ and t07/)")
    t0 = time.perf_counter()
    compares = [compare_drafters(checkpoints, path, config) for path in cache_paths]
    settings, warnings = [], []
    for path, document in zip(cache_paths, compares):
        setting = sampling_setting(document["cache"]["settings"])
        report = document["reports"][0]
        settings.append(
            {
                "cache": str(path),
                "digest": document["cache"]["digest"],
                "setting": setting.to_dict(),
                "described": setting.describe(),
                "rule": _served_tau(report)["rule"],
                "prompts": len(_prompts(report)),
                "requests": report["requests"],
            }
        )
    base = _prompts(compares[0]["reports"][0])
    for s, document in zip(settings[1:], compares[1:]):
        if _prompts(document["reports"][0]) != base:
            warnings.append(
                f"{s['cache']} holds other prompts than {settings[0]['cache']}: the taus side by side are not "
                "over the same prompts (extract both from one prompts file; --limit counts sequences, and a "
                "sampled cache has several per prompt)"
            )
    drafters = []
    for i, checkpoint in enumerate(checkpoints):
        row = compares[0]["drafters"][i]
        drafters.append(
            {
                "checkpoint": str(checkpoint),
                "family": row["family"],
                "taus": [_served_tau(document["reports"][i]) for document in compares],
            }
        )
    ranking = []
    for column in range(len(compares)):
        order = sorted(
            range(len(drafters)),
            key=lambda d: -(drafters[d]["taus"][column]["tau"] or 0.0),
        )
        for rank, d in enumerate(order, 1):
            drafters[d]["taus"][column]["rank"] = rank
        ranking.append([drafters[d]["checkpoint"] for d in order])
    document = {
        "schema_version": COMPARE_SETTINGS_SCHEMA_VERSION,
        "settings": settings,
        "drafters": drafters,
        "ranking": ranking,
        "definitions": {
            "tau": "pooled tokens per round incl. the bonus token; on a sampled cache tau as served at its setting "
            "(the rule in settings[].rule) with a 95% bootstrap interval over prompts, on a greedy cache over "
            "requests",
            "rank": "1 = the highest tau at that setting",
        },
        "warnings": warnings,
        "compares": compares,
        **run_stamp(time.perf_counter() - t0),
    }
    schemas.validate(document, "compare_settings_report")
    return document
