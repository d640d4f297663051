"""Scoring at the temperature a cache was sampled at: tau as served (docs/sampling.md).

A cache records the sampling setting its continuations were drawn at (``hscache.sampling_setting``;
greedy when it records none). On a SAMPLED cache every family is scored under the engines' rules at
that setting, without a family knowing about it:

- one-hot (``draft_sampling="greedy"``, every engine's default; spec/sampling.md 4.1 B, C): the
  family's own replays (chains, DFlash blocks, DDTree, SGLang trees) run on ``SampledView``, a view
  of the cache whose ``target_argmax`` is the cached SAMPLED next token
  (``verification.sampled_match_targets``). Drafts are computed along the cached path, a round
  accepts the longest prefix whose drafts equal the sampled tokens (a tree: whose walk stays in the
  child sets), and no round is ever cut off-greedy. The round counts are then E[rounds | y] exactly.
- probabilistic (``draft_sampling="probabilistic"``; spec 4.1 A, 4.4): a family's ``proposals``
  gives, per anchor and slot, its draft along y and log q(y) with q = softmax(draft logits / T)
  over its whole vocabulary (0 outside a reduced vocabulary). Slot acceptance min(1, q/p) with the
  cache's realised p, then E[rounds | y] by the DP (``verification.sequence_rounds``).

Per sequence the rounds go into ``SequenceResult.extras["served"]`` (mode -> ``SequenceRounds``,
modes "chain", "ddtree-N", "tree"), and ``served_section`` makes the report's ``sampling`` block:
the rule, the setting, the trajectories, tau with a bootstrap interval over PROMPTS
(``sampled_tau``), and acceptance over the rounds a server runs (not over all anchors).

The rule is chosen once per run, here only: ``served_rule(cache, config)`` returns a ``ServedRule``
(greedy, one-hot or probabilistic: the view the families read, how rows are scored, what it adds to
the report) that ``scorer.studies.evaluate`` hands to ``score_rows`` and ``build_report``. A greedy
cache takes none of these paths: its scores are what they always were, unless its text is a serving
engine's own greedy output (``greedy_reference="text"``, ``GREEDY_ON_TEXT_RULE``): then the families read
it through ``SampledView`` too, the engine's tokens being its decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hscache.store.sampling import GREEDY, PRESETS, SAMPLING_PARAMETERS, sampling_setting
from hscache.store.view import CacheView
from scorer.errors import ScorerError
from scorer.metrics import acceptance_counts, bootstrap_ci, train_accept_len
from scorer.offline.replay import replay_chain
from scorer.offline.sampled_tau import prompt_totals, sampled_tau
from scorer.offline.sequences import SequenceResult, score_each
from scorer.rules import DRAFT_SAMPLE_METHODS
from scorer.rules.expectation import (
    SequenceRounds,
    all_anchor_acceptance,
    probabilistic_rounds,
    rounds_from_log,
    sampled_match_targets,
)

__all__ = [
    "DRAFT_SAMPLING",
    "RULE_DEFINITIONS",
    "GREEDY_ON_TEXT_RULE",
    "GREEDY_RULE",
    "ONEHOT_RULE",
    "PROBABILISTIC_RULE",
    "SampledView",
    "RowsToScore",
    "ServedRule",
    "check_rejection_method",
    "check_request",
    "effective_config",
    "head_log_q",
    "is_sampled",
    "probabilistic_request",
    "probabilistic_rounds",
    "probabilistic_tau_block",
    "proposal_arrays",
    "score_rows",
    "served_rule",
    "served_section",
    "target_logp",
]

# --draft-sampling: vLLM's draft_sample_method names.
DRAFT_SAMPLING = DRAFT_SAMPLE_METHODS
RULE_DEFINITIONS = {
    "one-hot": "drafts are the drafter's argmax along the cached sampled trajectory y; a round accepts the "
    "longest prefix of drafts equal to y (a tree: whose walk along y stays in the child sets), plus one "
    "token: every engine's default at T > 0 (vLLM draft_sample_method=greedy, SGLang, the z-lab "
    'reference), exact given y (docs/sampling.md "Why the one-hot rule is exact")',
    "probabilistic": "drafts x ~ q = softmax(draft logits / T) over the drafter's whole vocabulary, accepted "
    "with min(1, p/q): given y, slot j continues with probability min(1, q(y_j) / p(y_j)) and E[rounds | y] "
    "comes from the dynamic programme over round starts (vLLM draft_sample_method=probabilistic, SGLang "
    '--speculative-use-rejection-sampling; docs/sampling.md "Why the probabilistic rule is exact")',
}
# SamplingSetting fields an eval flag may name (checked against the cache, never applied).
SAMPLING_FIELDS = SAMPLING_PARAMETERS
_FLAG = {name: "--" + name.replace("_", "-") for name in SAMPLING_FIELDS}


def is_sampled(cache: CacheView) -> bool:
    """True when the cache's continuations were sampled (temperature > 0)."""
    return not sampling_setting(cache).greedy


def _requested(config: Any) -> dict[str, Any]:
    """The setting fields the eval flags name (``config.sampling``: a ``preset`` and/or fields):
    the preset's values, then each field given over it. Only these are checked against the cache."""
    given = dict(getattr(config, "sampling", None) or {})
    preset = given.pop("preset", None)
    unknown = sorted(set(given) - set(SAMPLING_FIELDS))
    if unknown:
        raise ScorerError(f"sampling field {unknown[0]!r} is not one of {', '.join(SAMPLING_FIELDS)}")
    if preset is None:
        return given
    if preset == "greedy":
        return {"temperature": 0.0, **given}
    if preset not in PRESETS:
        raise ScorerError(
            f"--sampling {preset!r}: choose greedy or one of {', '.join(PRESETS)} (the cache records its own "
            "setting: the flag only checks it)"
        )
    return {**PRESETS[preset], **given}


def check_request(cache: CacheView, config: Any, family: Any, where: str) -> None:
    """Refuse, in one line and before anything is scored, what cannot be scored from this cache.

    - a sampling flag on eval that differs from the cache's setting (a cache cannot be reweighted
      to another setting: spec 4.6.1);
    - ``--draft-sampling probabilistic`` on a greedy cache (q/p needs the sampled p), with
      ``--tree`` (SGLang's rejection sampling drafts chains, topk 1), or for a family that gives
      no proposal probabilities;
    - SGLang's rule (``--tree``) on a cache sampled with a penalty (SGLang's in-round penalties are
      not lossless: spec 4.6.4; measure it online, ``scorer online --tree``) or with min_p (SGLang applies it after top-k/top-p,
      the cache's vLLM order before them: spec 1.2).

    Raises:
        ScorerError: naming the flag, the cache's value and the fix.
    """
    setting = sampling_setting(cache)
    for name, want in _requested(config).items():
        have = getattr(setting, name)
        if setting.greedy and name != "temperature" and want == getattr(GREEDY, name):
            continue  # a greedy cache's unused fields are at their defaults
        if want != have:
            raise ScorerError(
                f"{_FLAG[name]} {want:g} differs from the cache's {have:g} ({where} was drawn at "
                f"{setting.describe()}); a cache cannot be reweighted to another setting: score a cache "
                "extracted at that setting (hscache extract with the same sampling flags), or drop the flag"
            )
    reference = getattr(config, "greedy_reference", "argmax")
    if reference not in ("argmax", "text"):
        raise ScorerError(f"--greedy-reference {reference!r}; choose argmax or text")
    if reference == "text" and not setting.greedy:
        raise ScorerError(
            f"--greedy-reference text is for a greedy cache ({where} was drawn at {setting.describe()}, and a "
            "sampled cache is always verified against its own sampled text): drop the flag"
        )
    draft_sampling = getattr(config, "draft_sampling", "greedy")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ScorerError(f"--draft-sampling {draft_sampling!r}; choose {' or '.join(DRAFT_SAMPLING)}")
    check_rejection_method(getattr(config, "rejection_sample_method", "standard"), draft_sampling)
    if draft_sampling == "probabilistic":
        if setting.greedy:
            raise ScorerError(
                f"--draft-sampling probabilistic needs a sampled cache ({where} is greedy, temperature 0: "
                "drafts are argmax there); extract one at the served setting (hscache extract --sampling "
                "PRESET or --temperature T ...)"
            )
        if getattr(config, "tree", None) is not None:
            raise ScorerError(
                "--draft-sampling probabilistic scores chains (SGLang's --speculative-use-rejection-sampling "
                "takes speculative_eagle_topk 1, vLLM drafts chains): drop --tree"
            )
        if getattr(family, "proposals", None) is None:
            raise ScorerError(
                f"--draft-sampling probabilistic: the {family.name} family gives no proposal probabilities "
                "yet; score it with the one-hot rule (drop --draft-sampling)"
            )
    penalties = [
        f"{_FLAG[n]} {getattr(setting, n):g}"
        for n, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
        if getattr(setting, n) != neutral
    ]
    if getattr(config, "tree", None) is not None and setting.min_p > 0:
        raise ScorerError(
            f"--tree is SGLang's rule, and {where} was sampled with {_FLAG['min_p']} {setting.min_p:g}: SGLang "
            "applies min_p after top-k and top-p (min_p_renorm_prob), vLLM (the cache's order) before them, so "
            "the cache's trajectories are not SGLang's; score a cache sampled without --min-p"
        )
    if getattr(config, "tree", None) is not None and penalties:
        # the online tree this family drafts (Family.online_trees): EAGLE-3 / MTP --tree, DFlash --ddtree
        trees = getattr(family, "online_trees", frozenset())
        online = "--tree ..." if "tree" in trees else "--ddtree N" if "ddtree" in trees else None
        if setting.repetition_penalty != 1.0:
            advice = (
                "SGLang's tree verification never applies --repetition-penalty (scorer online refuses it "
                "with a tree): measure it on the SGLang server"
            )
        elif online is None:
            advice = f"the {family.name} family drafts no tree online: measure it on the SGLang server"
        else:
            advice = (
                f"measure it online (scorer online {online} with the same sampling flags: it runs SGLang's "
                "relaxed penalties)"
            )
        raise ScorerError(
            f"--tree is SGLang's rule, and {where} was sampled with {', '.join(penalties)}: SGLang applies "
            "penalties from the history before each round to every slot of it, which is not lossless, so no "
            f"cache gives its tau: {advice}, or score a cache sampled without penalties"
        )


def check_rejection_method(method: str, draft_sampling: str) -> None:
    """vLLM's ``rejection_sample_method`` as the offline replay can score it (scorer/rules/block_verify.py):
    "block" with greedy drafts accepts what "standard" accepts given the text (a rejected round emits a
    token other than its draft), so the one-hot replay scores it; with probabilistic drafts it does not.

    Raises:
        ScorerError: an unknown method, or block verification with probabilistic drafts (named).
    """
    from scorer.rules import REJECTION_SAMPLE_METHODS

    if method not in REJECTION_SAMPLE_METHODS:
        raise ScorerError(
            f"--rejection-sample-method {method!r}; choose {' or '.join(REJECTION_SAMPLE_METHODS)} (vLLM's "
            "'synthetic' accepts at configured rates whatever the drafts: a benchmark, not a drafter's tau)"
        )
    if method == "block" and draft_sampling == "probabilistic":
        raise ScorerError(
            "--rejection-sample-method block with --draft-sampling probabilistic: whether a block round passes "
            "a slot depends on the drafts after it and on the target at prefixes the served text never took "
            "(spec/sampling.md 4.5, scorer/rules/block_verify.py), which no cache holds; score it online "
            "(scorer online --rejection-sample-method block --draft-sampling probabilistic), or offline with "
            "greedy drafts"
        )


def effective_config(config: Any) -> Any:
    """The probabilistic rule needs every anchor (the DP) and scores chains: DDTree is dropped."""
    if getattr(config, "draft_sampling", "greedy") != "probabilistic":
        return config
    return dataclasses.replace(config, anchors="all", ddtree=())


class SampledView:
    """A cache whose ``target_argmax(i)`` is the SAMPLED next token: a'[t] = y[t+1].

    Every family's replay compares drafts with ``target_argmax``; through this view it scores the
    one-hot rule along the sampled trajectory, and the data never leaves that path (no off-greedy
    cut). Everything else is the wrapped view's.
    """

    def __init__(self, cache: CacheView) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __len__(self) -> int:
        return len(self._cache)

    def target_argmax(self, i: int) -> Any:
        import torch

        return torch.from_numpy(sampled_match_targets(self._cache.token_ids(i)))


def _tree_depth(config: Any) -> int:
    return int(config.tree[0]) if getattr(config, "tree", None) is not None else 0


def _onehot_rounds(result: SequenceResult, k: int, config: Any) -> dict[str, SequenceRounds]:
    served = {"chain": rounds_from_log(result.chain, k)}
    for budget, log in result.ddtree.items():
        served[f"ddtree-{budget}"] = rounds_from_log(log, k)
    if result.extras.get("tree") is not None:
        served["tree"] = rounds_from_log(result.extras["tree"], max(1, _tree_depth(config)))
    return served


def target_logp(cache: CacheView, row: int) -> np.ndarray:
    """[T] float64 log p(y_t | y_<t) of the served p at every position (entries t <= P unused).

    The cache stores p(token t + 1) at row t (``realised_prob``); position 0 has none.
    """
    prob = cache.realised_prob(row).double().numpy()
    out = np.zeros(len(prob), dtype=np.float64)
    with np.errstate(divide="ignore"):
        out[1:] = np.log(prob[:-1])
    return out


def _category(cache: CacheView, row: int) -> str | None:
    if "category" not in cache.index.column_names:
        return None
    value = cache.index.column("category")[row].as_py()
    return None if value is None else str(value)


def _probabilistic_result(
    family: Any, drafter: Any, cache: CacheView, row: int, config: Any, temperature: float, where: str
) -> SequenceResult:
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    x = cache.token_ids(row).numpy()
    k = drafter.config.block_size - 1
    a = sampled_match_targets(x)
    if len(x) - 1 - prompt_len > 0:
        draft, log_q = family.proposals(drafter, cache, row, config, temperature)
    else:
        draft, log_q = np.zeros((0, k), dtype=np.int64), np.zeros((0, k))
    try:
        rounds, alpha = probabilistic_rounds(draft, log_q, x, target_logp(cache, row), prompt_len)
    except ValueError as exc:
        raise ScorerError(f"{where} row {row}: {exc}") from None
    # The one-hot rounds of the same drafts (teacher-forced along y: equal to the served drafts on
    # every matched prefix, spec 4.3), for the per-request lists and the all-anchor diagnostics.
    chain = replay_chain(draft, x, a, prompt_len, k + 1)
    visited = np.asarray([p - prompt_len for p in chain.anchors], dtype=np.int64)
    sums, counts = all_anchor_acceptance(alpha, prompt_len, len(x))
    return SequenceResult(
        row=row,
        record_id=cache.index.column("record_id")[row].as_py(),
        category=_category(cache, row),
        chain=chain,
        ddtree={},
        ddtree_surrogate={},
        acceptance=acceptance_counts(draft, x, a, prompt_len),
        accept_len=train_accept_len(draft, x, a, prompt_len),
        chain_drafts=draft[visited] if len(visited) else np.zeros((0, k), dtype=np.int64),
        drafted_anchors=len(draft),
        extras={"served": {"chain": rounds}, "all_anchor": (sums, counts)},
    )


@dataclass(frozen=True)
class RowsToScore:
    """One call's work: score ``rows`` of ``cache`` with ``family``'s ``drafter`` under ``config``."""

    family: Any
    drafter: Any
    cache: CacheView
    rows: Sequence[int]
    config: Any
    on_sequence: Callable[[SequenceResult], None] | None = None


def _score_greedy(job: RowsToScore) -> list[SequenceResult]:
    return job.family.score_rows(job.drafter, job.cache, job.rows, job.config, job.on_sequence)


def _score_onehot(job: RowsToScore) -> list[SequenceResult]:
    k = job.drafter.config.block_size - 1
    results = _score_greedy(dataclasses.replace(job, cache=SampledView(job.cache)))
    for result in results:
        result.extras["served"] = _onehot_rounds(result, k, job.config)
    return results


def _score_probabilistic(job: RowsToScore) -> list[SequenceResult]:
    temperature = sampling_setting(job.cache).temperature
    where = str(getattr(job.cache, "url", job.cache.path))
    return score_each(
        job.cache,
        job.rows,
        lambda seq: _probabilistic_result(
            job.family, job.drafter, job.cache, seq.row, job.config, temperature, where
        ),
        job.on_sequence,
    )


def _add_nothing(
    report: dict[str, Any], results: Sequence[SequenceResult], cache: CacheView, config: Any
) -> None:
    return None


def _add_onehot(
    report: dict[str, Any], results: Sequence[SequenceResult], cache: CacheView, config: Any
) -> None:
    report["sampling"] = served_section(results, cache, config, "one-hot")


def _add_probabilistic(
    report: dict[str, Any], results: Sequence[SequenceResult], cache: CacheView, config: Any
) -> None:
    """Under the probabilistic rule tau and rounds are E[rounds | y] (the one-hot rounds along y stay
    in the per-request lists)."""
    report["sampling"] = served_section(results, cache, config, "probabilistic")
    report["tau"], report["rounds"] = probabilistic_tau_block(results, config)
    report["per_request"] = [probabilistic_request(row, r) for row, r in zip(report["per_request"], results)]


def _same_cache(cache: Any) -> Any:
    return cache


@dataclass(frozen=True)
class ServedRule:
    """The rule a cache is scored under, chosen once at the top of a run (``served_rule``).

    Attributes:
        name: "greedy" (a greedy cache: drafts matched against the target's argmax), "one-hot" or
            "probabilistic" (a sampled cache, ``RULE_DEFINITIONS``).
        view: cache -> what the families' replays read (``SampledView`` under the one-hot rule: the
            target's token is the sampled one).
        score: RowsToScore -> the rows' SequenceResults.
        add_to_report: (report, results, cache, eval config) -> None: the rule's part of the eval
            report (the ``sampling`` block; under the probabilistic rule tau and rounds as E[rounds | y]).
    """

    name: str
    view: Callable[[Any], Any]
    score: Callable[[RowsToScore], list[SequenceResult]]
    add_to_report: Callable[[dict[str, Any], Sequence[SequenceResult], CacheView, Any], None]


def _score_greedy_on_text(job: RowsToScore) -> list[SequenceResult]:
    return _score_greedy(dataclasses.replace(job, cache=SampledView(job.cache)))


def _add_text_reference(
    report: dict[str, Any], results: Sequence[SequenceResult], cache: CacheView, config: Any
) -> None:
    differs = positions = 0
    for result in results:
        x, a = cache.token_ids(result.row).numpy(), cache.target_argmax(result.row).numpy()
        p = int(cache.index.column("prompt_len")[result.row].as_py())
        differs += int(np.count_nonzero(x[p + 1 :] != a[p : len(x) - 1]))
        positions += max(len(x) - 1 - p, 0)
    report["greedy_reference"] = {"reference": "text", "argmax_differs": differs, "positions": positions}
    report["notes"].append(
        f"verified against the text's own next token (--greedy-reference text: the text is a serving "
        f"engine's greedy output); this cache's argmax differs from it at {differs} of {positions} positions"
    )


GREEDY_RULE = ServedRule("greedy", _same_cache, _score_greedy, _add_nothing)
# A greedy cache whose text after the prompt is a serving engine's own greedy output (scorer served's
# served cache): that engine's decisions ARE the text, as a sampled trajectory's are (issue 33: "compare
# on the trajectory vLLM produced"). The families read it through SampledView (a'[t] = x[t+1]); the
# cache's own argmax (another engine's states) is only counted, in the report.
GREEDY_ON_TEXT_RULE = ServedRule("greedy", SampledView, _score_greedy_on_text, _add_text_reference)
ONEHOT_RULE = ServedRule("one-hot", SampledView, _score_onehot, _add_onehot)
PROBABILISTIC_RULE = ServedRule("probabilistic", SampledView, _score_probabilistic, _add_probabilistic)


def served_rule(cache: CacheView, config: Any) -> ServedRule:
    """The one place that reads whether ``cache`` was sampled and which rule ``config.draft_sampling``
    names (checked by ``check_request``): every layer below takes the rule it returns."""
    if sampling_setting(cache).greedy:
        return GREEDY_ON_TEXT_RULE if getattr(config, "greedy_reference", "argmax") == "text" else GREEDY_RULE
    return (
        PROBABILISTIC_RULE if getattr(config, "draft_sampling", "greedy") == "probabilistic" else ONEHOT_RULE
    )


def score_rows(
    family: Any,
    drafter: Any,
    cache: CacheView,
    rows: Sequence[int],
    config: Any,
    on_sequence: Callable[[SequenceResult], None] | None = None,
) -> list[SequenceResult]:
    """Score ``rows`` of a cache under its rule (``served_rule``; module docstring)."""
    return served_rule(cache, config).score(RowsToScore(family, drafter, cache, rows, config, on_sequence))


def proposal_arrays(prompt_len: int, seq_len: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a family's ``proposals`` fills in: (anchors [A] int64 = P..T-2, drafts [A, K] int64
    zeros, log q [A, K] float64 -inf); A = 0 for a sequence with nothing generated to draft."""
    anchors = np.arange(prompt_len, seq_len - 1)
    return anchors, np.zeros((len(anchors), k), dtype=np.int64), np.full((len(anchors), k), -np.inf)


def head_log_q(
    head: Callable[[Any], Any], hidden: Any, columns: Any, temperature: float, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Argmax column and log q at ``columns`` of head rows, the vocabulary projected ``rows`` at a time.

    What a family's ``proposals`` needs from its head: ``head(hidden[lo:hi])`` gives [n, Vd] logits
    (never all of [N, Vd] at once), q = softmax(logits / T) over the whole Vd
    (``verification.draft_log_q``); a column -1 (a token outside the draft vocabulary, or past the
    sequence end) gives -inf.

    Returns:
        (argmax int64 [N] draft columns, log q float64 [N]).
    """
    import torch

    from hscache.capture.logit_rows import row_chunks
    from scorer.rules.expectation import draft_log_q

    n = hidden.shape[0]
    arg, lq = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float64)
    cols = torch.as_tensor(columns, dtype=torch.long)
    with torch.no_grad():
        for lo, hi, new in row_chunks(n, max(1, rows)):
            logits = head(hidden[lo:hi])[new - lo :]
            arg[new:hi] = logits.float().argmax(-1).cpu().numpy()
            lq[new:hi] = (
                draft_log_q(logits, cols[new:hi].to(logits.device), temperature).double().cpu().numpy()
            )
    return arg, lq


# ---------------------------------------------------------------- the report


def _tau_dict(prompt_ids: list[str], rounds: list[SequenceRounds], config: Any) -> dict[str, Any] | None:
    if not rounds or sum(r.expected_rounds for r in rounds) <= 0:
        return None
    return sampled_tau(prompt_ids, rounds, n_boot=config.n_boot, seed=config.seed).to_dict()


def served_section(
    results: Sequence[SequenceResult], cache: CacheView, config: Any, rule: str | None = None
) -> dict[str, Any]:
    """The report's ``sampling`` block (schemas/eval_report.schema.json): the rule, the setting, the
    trajectories and, per mode, tau with its interval over prompts and the served acceptance.
    ``rule``: "one-hot" or "probabilistic" (default: ``served_rule``'s for the cache and config)."""
    setting = sampling_setting(cache)
    draft_sampling = getattr(config, "draft_sampling", "greedy")
    rule = served_rule(cache, config).name if rule is None else rule
    prompt_ids = [r.record_id for r in results]
    modes: dict[str, Any] = {}
    names = sorted({m for r in results for m in r.extras.get("served", {})})
    for mode in names:
        kept = [
            (p, r.extras["served"][mode]) for p, r in zip(prompt_ids, results) if mode in r.extras["served"]
        ]
        modes[mode] = _tau_dict([p for p, _ in kept], [s for _, s in kept], config)
    section: dict[str, Any] = {
        "setting": setting.to_dict(),
        "described": setting.describe(),
        "rule": rule,
        "draft_sampling": draft_sampling,
        "definition": RULE_DEFINITIONS[rule],
        "draft_temperature": setting.temperature if rule == "probabilistic" else None,
        "trajectories": len(results),
        "prompts": len(set(prompt_ids)),
        "interval": "95% percentile bootstrap over prompts (a prompt's trajectories resampled together)",
        "served_acceptance_definition": "per slot i: expected rounds accepting at least i drafted tokens / "
        "expected rounds, over the rounds a server runs along y (not the all-anchor average)",
        "modes": modes,
    }
    alls = [r.extras["all_anchor"] for r in results if "all_anchor" in r.extras]
    if alls:
        sums = np.sum([s for s, _ in alls], axis=0)
        counts = np.sum([c for _, c in alls], axis=0)
        section["all_anchor_acceptance"] = [float(s / c) if c else None for s, c in zip(sums, counts)]
    return section


def _per_request_tau(totals: np.ndarray) -> float:
    keep = totals[:, 1] > 0
    return float(np.mean(totals[keep, 0] / totals[keep, 1]))


def _pooled_tau(totals: np.ndarray) -> float:
    return float(totals[:, 0].sum() / totals[:, 1].sum())


def probabilistic_tau_block(results: Sequence[SequenceResult], config: Any) -> tuple[dict[str, Any], float]:
    """The report's ``tau`` block under the probabilistic rule (tokens / E[rounds | y]; intervals over
    requests as the greedy block's) and sum E[rounds]."""
    _, totals = prompt_totals(
        [str(i) for i in range(len(results))], [r.extras["served"]["chain"] for r in results]
    )
    totals = totals[:, :2][totals[:, 1] > 0]
    if not len(totals):
        return {"per_request": None, "pooled": None, "per_request_ci95": None, "pooled_ci95": None}, 0.0
    block = {
        "per_request": _per_request_tau(totals),
        "pooled": _pooled_tau(totals),
        "per_request_ci95": list(bootstrap_ci(totals, _per_request_tau, config.n_boot, config.seed)),
        "pooled_ci95": list(bootstrap_ci(totals, _pooled_tau, config.n_boot, config.seed)),
    }
    return block, float(totals[:, 1].sum())


def probabilistic_request(summary: dict[str, Any], result: SequenceResult) -> dict[str, Any]:
    """A per-request line with the probabilistic rule's E[rounds | y] and tau in place of the one-hot's."""
    served = result.extras["served"]["chain"]
    rounds = served.expected_rounds
    return {**summary, "rounds": rounds, "tau": served.tokens / rounds if rounds > 0 else None}
