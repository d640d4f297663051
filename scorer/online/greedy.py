"""``scorer online``: real greedy speculative decoding, the target verifying every block.

This is the calibration slice: on the same prompts, the offline replay of ``scorer eval``
must give the same tau (spec section 3), which is what makes the offline number the serving
number. For hybrid targets whose recurrent state cannot be cropped after a rejection, each
round re-runs the target over the committed prefix plus the drafted block: slow, exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscache import schemas
from hscache.capture.backend import resolve_backend, use_backend
from hscache.capture.forward import capture_batch
from hscache.capture.prompts import assistant_turn, iter_records, prompt_token_ids, resolve_prompts
from hscache.capture.target import Target, load_target
from hscache.store.fsio import file_sha256
from scorer.documents import run_stamp
from scorer.errors import ScorerError
from scorer.families import family_for, probe_checkpoint
from scorer.families.base import OnlineOptions, Proposer, check_scored_sizes
from scorer.metrics import tau_per_request, tau_pooled
from scorer.rules.onehot_chain import chain_depth
from scorer.target_identity import check_target, loaded_target_identity, recorded_target_identity

__all__ = [
    "ONLINE_SCHEMA_VERSION",
    "OnlineConfig",
    "OnlineRequest",
    "OnlineSession",
    "commit_round",
    "eos_ids",
    "open_online",
    "request_row",
    "run_online",
    "speculative_decode",
    "tau_of_requests",
]

# Version of the result document (schemas/online_report.schema.json); bump on a breaking change.
ONLINE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class OnlineRequest:
    record_id: str
    prompt_len: int
    token_ids: tuple[int, ...]
    tokens_per_round: tuple[int, ...]

    @property
    def tau(self) -> float | None:
        return sum(self.tokens_per_round) / len(self.tokens_per_round) if self.tokens_per_round else None


def eos_ids(target: Target) -> set[int]:
    """The token ids that end a sequence (the generation config's, else the tokenizer's)."""
    eos = target.model.generation_config.eos_token_id
    eos = target.tokenizer.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def commit_round(ids: list[int], new: list[int], p: int, limit: int, eos: set[int]) -> int:
    """Append a round's emitted tokens (accepted drafts + the bonus / recovered token) to ``ids``,
    stopping at EOS or the final length ``limit`` like the cached sequence; returns the round's
    tokens as the offline replay counts them: positions p+1..the new end, capped at T-1."""
    for n, token in enumerate(new):
        if len(ids) >= limit or (n and ids[-1] in eos):
            new = new[:n]
            break
        ids.append(token)
    return len(ids) - 1 - p if (len(ids) >= limit or ids[-1] in eos) else len(new)


def speculative_decode(
    target: Target,
    layer_ids: list[int],
    propose: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    max_length: int,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt with any family's proposer; (token ids, tokens per round).

    Rounds follow spec section 3 exactly as the offline replay counts them: a round commits
    acc drafted tokens plus the target's bonus token, capped at the sequence end (EOS or the
    token budget), so ``sum(tokens) == generated - 1`` as in replay. Each round re-runs the target
    over the committed prefix plus the drafts (a hybrid target's recurrent state cannot be cropped),
    so the drafter always sees features of verified tokens only, as in serving.
    """
    limit = min(len(prompt) + max_new_tokens, max_length)  # final length T
    eos = eos_ids(target)
    prefill = capture_batch(target, [prompt], layer_ids, top_k=1, full_logits=False)[0]
    ids = list(prompt) + [int(prefill.argmax[-1])]  # x_P, the first bonus token
    rounds: list[int] = []
    while len(ids) < limit and ids[-1] not in eos:
        p = len(ids) - 1
        draft = propose(prefill.hidden_states[:p], ids, p)  # d_1..d_K
        verify = capture_batch(target, [ids + draft], layer_ids, top_k=1, full_logits=False)[0]
        greedy = verify.argmax[p:].tolist()  # greedy[j-1] = g_{p+j}
        acc = chain_depth(draft, np.asarray(greedy, dtype=np.int64), 0)  # the one-hot chain rule
        rounds.append(commit_round(ids, draft[:acc] + [greedy[acc]], p, limit, eos))  # acc drafts + the bonus
        prefill = verify
    return ids, rounds


@dataclass(frozen=True)
class OnlineSession:
    """A loaded target and a family's proposer, ready to decode (what `open_online` returns).

    Attributes:
        target: the live target.
        family: the drafter's family.
        layer_ids: target layers the proposer reads.
        propose: the family's Proposer (scorer.families.base).
        report: the checkpoint's LoadReport.
        target_check: the drafter's recorded target against the loaded one.
    """

    target: Target
    family: Any
    layer_ids: list[int]
    propose: Proposer
    report: Any
    target_check: Any


def open_online(
    checkpoint: str | Path,
    model: str,
    dtype: str,
    options: OnlineOptions,
    allow_target_mismatch: bool = False,
) -> OnlineSession:
    """Load the target and the checkpoint's family proposer, checking the drafter's recorded target.

    Raises:
        ScorerError: the family has no online path; a target mismatch (unless allowed); what the
            family's loader refuses.
    """
    target = load_target(model, dtype, options.device)
    family = family_for(probe_checkpoint(checkpoint, options.config_path))
    if family.online is None:
        raise ScorerError(f"{checkpoint}: scorer online does not run the {family.name} family yet")
    # A target head (target:mtp) is the target's own: it matches by construction.
    identity = loaded_target_identity(target)
    target_check = check_target(
        identity if family.bound_to_target else recorded_target_identity(checkpoint, options.config_path),
        identity,
        allow_mismatch=allow_target_mismatch,
        where=model,
        against="model",
    )
    layer_ids, propose, report = family.online(checkpoint, target, options)
    return OnlineSession(target, family, layer_ids, propose, report, target_check)


def tau_of_requests(requests: list[OnlineRequest]) -> dict[str, Any]:
    """The online report's ``tau`` (per request, pooled; None without a round) and ``rounds``."""
    with_rounds = [list(r.tokens_per_round) for r in requests if r.tokens_per_round]
    return {
        "tau": {
            "per_request": tau_per_request(with_rounds) if with_rounds else None,
            "pooled": tau_pooled(with_rounds) if with_rounds else None,
        },
        "rounds": sum(len(r) for r in with_rounds),
    }


def request_row(request: OnlineRequest) -> dict[str, Any]:
    """One request of the online report's ``per_request``."""
    return {
        "record_id": request.record_id,
        "prompt_len": request.prompt_len,
        "tau": request.tau,
        "tokens_per_round": list(request.tokens_per_round),
        "generated": len(request.token_ids) - request.prompt_len,
    }


@dataclass(frozen=True)
class OnlineConfig:
    """Everything ``scorer online`` (greedy) takes besides the checkpoint; flags mirror the names.

    Attributes:
        model: the target, a local HF directory or ``builtin:...``.
        prompts: a JSONL prompts file or ``builtin:default``.
        max_new_tokens: tokens decoded per prompt; max_length: the longest sequence.
        dtype, device: of the target and the drafter; backend: the target's linear-attention kernels.
        limit: only the first N prompts.
        overrides: drafter config overrides (target_layer_ids, mask_token_id, rope_theta, block_size,
            a family's own settings such as n-gram's prompt_lookup_min / _max).
        trust_checkpoint, config_path: as ``scorer eval``'s --trust-checkpoint / --config.
        num_speculative_tokens: a chain drafter's K (default: its config's, else the engines').
        id_from_line: number prompts without an "id" by their line (default: refuse them).
        allow_target_mismatch: run a drafter that records another target than ``model``.
    """

    model: str = "builtin:tiny-qwen3.5"
    prompts: str = "builtin:default"
    max_new_tokens: int = 64
    max_length: int = 4096
    dtype: str = "fp32"
    device: str = "cpu"
    backend: str = "auto"
    limit: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    trust_checkpoint: bool = False
    config_path: str | None = None
    num_speculative_tokens: int | None = None
    id_from_line: bool = False
    allow_target_mismatch: bool = False

    def open(self, checkpoint: str | Path) -> OnlineSession:
        """``open_online`` at this config's target, dtype, device and drafter settings."""
        options = OnlineOptions(
            overrides=dict(self.overrides),
            trust_checkpoint=self.trust_checkpoint,
            config_path=self.config_path,
            num_speculative_tokens=self.num_speculative_tokens,
            device=self.device,
        )
        return open_online(checkpoint, self.model, self.dtype, options, self.allow_target_mismatch)

    def records(self) -> list[Any]:
        """The first ``limit`` prompt records, checked without a tokenizer (before the model loads).

        Raises:
            PromptFileError / ScorerError: a record that does not parse, an id used before (runs and
                reports pair requests by id, as hscache extract refuses), or a chat ending with an
                assistant turn (its answer, which online decoding would drop silently).
        """
        seen: dict[str, int] = {}
        records = []
        for n, record in enumerate(
            iter_records(resolve_prompts(self.prompts), id_from_line=self.id_from_line)
        ):
            if self.limit is not None and n >= self.limit:
                break
            if record.record_id in seen:
                raise ScorerError(
                    f"--prompts {self.prompts}: record id {record.record_id!r} (line {record.line_no}) is used "
                    f"before, on line {seen[record.record_id]}; the report pairs requests by id: give every "
                    "record its own id"
                )
            if (turn := assistant_turn(record)) is not None:
                raise ScorerError(
                    f"--prompts {self.prompts}: record {record.record_id!r} (line {record.line_no}) ends with an "
                    f"assistant turn ({turn}); scorer online decodes the target's own answer, so that turn "
                    "would be dropped: drop the record's last turn"
                )
            seen[record.record_id] = record.line_no
            records.append(record)
        return records

    def check_sizes(self, ddtree: int | None = None) -> None:
        """Bound the drafting sizes before the model loads (as ``scorer eval`` bounds them by its
        cache): a chain of K, the n-gram proposer's longest n-gram and a block by --max-length, a
        DDTree by the target's context."""
        from hscache.capture.preflight import target_context

        check_scored_sizes(
            self.max_length,
            "--max-length",
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_max=self.overrides.get("prompt_lookup_max"),
            block_size=self.overrides.get("block_size"),
            ddtree=() if ddtree is None else (ddtree,),
            context=target_context(self.model),
        )

    def prompts_of(self, tokenizer: Any) -> list[tuple[str, list[int]]]:
        """(record id, prompt token ids) of the first ``limit`` prompts (``records``), tokenized by
        ``tokenizer``."""
        return [(record.record_id, prompt_token_ids(record, tokenizer)) for record in self.records()]

    def describe(self, session: OnlineSession, backend: str) -> dict[str, Any]:
        """The online report's fields that say what ran: the drafter, the target and the prompts (with
        their hashes), and this config's decoding settings (``backend``: the resolved kernels)."""
        return {
            "checkpoint": session.report.to_dict(),
            "family": session.family.name,
            "target_check": session.target_check.to_dict(),
            "model": self.model,
            "model_weights_sha256": session.target.weights_sha256,
            "prompts": self.prompts,
            "prompts_sha256": file_sha256(resolve_prompts(self.prompts)),
            "dtype": self.dtype,
            "device": self.device,
            "backend": backend,
            "max_new_tokens": self.max_new_tokens,
            "max_length": self.max_length,
            "limit": self.limit,
        }


def run_online(
    checkpoint: str | Path,
    config: OnlineConfig = OnlineConfig(),
    on_request: Callable[[OnlineRequest], None] | None = None,
) -> dict[str, Any]:
    """Speculative decoding of every prompt; per-request and pooled online tau. ``on_request`` is
    called with each request as it ends (progress). The prompts and the drafting sizes are checked
    before the model loads.

    Returns the result document (schemas/online_report.schema.json): the numbers, the settings, and
    what identifies the run like an eval report does: checkpoint and target weight hashes, the
    prompts' hash, package versions and the git commit.
    """
    t0 = time.perf_counter()
    config.records()
    config.check_sizes()
    backend = resolve_backend(config.backend, config.device)
    session = config.open(checkpoint)
    requests = []
    with use_backend(session.target.model, backend):
        for record_id, prompt in config.prompts_of(session.target.tokenizer):
            ids, rounds = speculative_decode(
                session.target,
                session.layer_ids,
                session.propose,
                prompt,
                config.max_new_tokens,
                config.max_length,
            )
            requests.append(OnlineRequest(record_id, len(prompt), tuple(ids), tuple(rounds)))
            if on_request is not None:
                on_request(requests[-1])
    result = {
        "schema_version": ONLINE_SCHEMA_VERSION,
        **tau_of_requests(requests),
        "per_request": [request_row(r) for r in requests],
        **config.describe(session, backend),
        **run_stamp(time.perf_counter() - t0),
    }
    schemas.validate(result, "online_report")
    return result
