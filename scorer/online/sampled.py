"""``scorer online`` at temperature > 0: speculative decoding with the target verifying by vLLM's rule.

The online reference of spec/sampling.md section 5 for the offline T > 0 scorer: real rounds, real
random coins, many seeded runs. Each round at anchor p (tokens 0..p committed):

1. the family's proposer drafts d_1..d_K: its argmax (vLLM's default ``draft_sample_method=greedy``,
   q one-hot), or with ``draft_sampling="probabilistic"`` each slot sampled from q = softmax(draft
   logits / T) over the drafter's whole vocabulary (no top-k / top-p / penalties: vLLM's
   ``compute_probs_and_sample_next_token``, spec 1.1), a chain drafter fed its own sampled token;
2. the target runs over the committed tokens plus the drafts (re-run from scratch each round, as
   ``scorer online`` at T = 0 does: a hybrid target's recurrent state cannot be cropped); row j of
   the round (j = 0..K) is processed in vLLM's order by hscache.capture.sampling's processor
   (``penalise_dense`` then ``processed_support``) with the penalty history = the generated tokens
   plus the drafts d_1..d_j (vLLM counts the in-round draft prefix, spec 1.1 / 4.6.4);
3. ``scorer.rules.vllm_chain.mrv2_verify`` (vLLM MRV2 ``_rejection_kernel`` + ``_resample_kernel``,
   cited there file + line) accepts or rejects, with the acceptance uniforms and the residual /
   bonus Gumbel noise from TWO generators (vLLM #54282), and a third for the drafts' samples.

With ``tree`` (SGLang's EAGLE tree, ``--tree STEPS,TOPK,TOKENS``; EAGLE-3 and MTP) a round instead
drafts the family's tree (``scorer.families.autoregressive.eagle_tree``: the construction the offline
tree replay uses), runs the target over every root-to-leaf path as its own sequence (a hybrid target's
recurrent state rules out a tree attention mask; each path's rows are exact), processes every row with
SGLang's relaxed penalties (``SGLANG_PENALTY``: one pre-round vector for every node and the bonus row,
from the tokens SGLang's penalizers were fed, ``sglang_penalty_history``) and verifies by SGLang's
target-only tree rule (``scorer.rules.sglang_tree.sglang_target_only_verify``, thresholds 1): one coin per
node from the ``accept`` stream, the final token's coin from ``residual``. Only the one-hot drafts exist
there: SGLang's rejection sampling takes topk 1 (a chain), and vLLM's rejection samplers verify a flat
chain of drafts (no tree parents), so no engine runs a probabilistic tree rule.

With ``ddtree`` (``--ddtree N``, DFlash) the round is the same tree round with DFlash's DDTree of N
nodes in place of the EAGLE tree: the proposer builds it from the block's per-slot top-K exactly as the
offline DDTree replay does (``scorer.families.dflash.score.block_tree``) and returns (tokens, parents).

Every (run, record) has its own three generators, keyed by the seed, the run and the record id, so
a run's result does not depend on the other runs or on how lanes are batched into target forwards
beyond the forward's last-bit numerics. tau of a run is pooled over its requests (tokens / rounds);
the report gives the mean over runs, its standard error and a bootstrap interval over runs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hscache import schemas
from hscache.capture.backend import resolve_backend, use_backend
from hscache.capture.forward import capture_batch
from hscache.capture.sampling import SAMPLING_BYTES_PER_LOGIT
from hscache.capture.target import Target
from hscache.progress import NO_PROGRESS
from hscache.store.sampling import SamplingSetting
from scorer.documents import run_stamp
from scorer.errors import ScorerError
from scorer.families.base import Proposer
from scorer.metrics import bootstrap_ci, tau_pooled_from_totals
from scorer.online.greedy import (
    ONLINE_SCHEMA_VERSION,
    OnlineConfig,
    OnlineRequest,
    commit_round,
    eos_ids,
    request_row,
    tau_of_requests,
)
from scorer.rules import DRAFT_SAMPLE_METHODS, REJECTION_SAMPLE_METHODS
from scorer.rules.block_verify import block_verify
from scorer.rules.penalties import (
    SGLANG_PENALTY,
    VLLM_PENALTY,
    RowBlock,
    processed_rows,
    sglang_penalty_history,
)
from scorer.rules.sglang_tree import TreeRounds, sglang_target_only_verify
from scorer.rules.vllm_chain import (
    RoundNoise,
    VerifiedRounds,
    draw_gumbel,
    draw_round_noise,
    gumbel_argmax,
    mrv2_verify,
)

__all__ = [
    "DRAFT_SAMPLING",
    "BLOCK_RULE",
    "RULE",
    "TREE_RULE",
    "DecodeSettings",
    "RoundRecord",
    "RunResult",
    "TreeRoundRecord",
    "SampledOnlineConfig",
    "decode_runs",
    "run_online_sampled",
    "check_runs_fit",
    "check_tree_request",
    "run_streams",
    "RowBlock",
    "SGLANG_PENALTY",
    "VLLM_PENALTY",
    "processed_rows",
    "sglang_penalty_history",
    "summarise_runs",
]

DRAFT_SAMPLING = DRAFT_SAMPLE_METHODS  # as --draft-sampling (vLLM draft_sample_method)
RULE = "vllm-mrv2"  # scorer.rules.vllm_chain.mrv2_verify
BLOCK_RULE = "vllm-mrv2-block"  # scorer.rules.block_verify.block_verify (--rejection-sample-method block)
TREE_RULE = "sglang-target-only"  # scorer.rules.sglang_tree.sglang_target_only_verify (--tree)
_STREAM_DOMAIN = "hscache-online-v1"


@dataclass(frozen=True)
class SampledOnlineConfig:
    """One ``scorer online`` run at temperature > 0 (``run_online_sampled``).

    Attributes:
        checkpoint: the drafter (any family with an online loader), or ``target:mtp``.
        sampling: the served setting, temperature > 0 (``SamplingSetting.from_flags``); its ``seed``
            keys every run's random streams.
        runs: independent decodings of every prompt (the interval is over runs).
        draft_sampling: ``greedy`` (the drafter's argmax: the one-hot rule, vLLM's default) or ``probabilistic``.
        tree: (steps, topk, tokens): SGLang's EAGLE tree verified by SGLang's target-only rule instead
            of a chain by vLLM's (EAGLE-3, MTP; one-hot drafts only; presence / frequency penalties by SGLang's
            relaxed rule, no repetition penalty, no min_p: ``check_tree_request``).
        ddtree: N: DFlash's DDTree of N nodes verified by the same SGLang target-only rule (as ``tree``).
        online: what greedy ``scorer online`` takes too (``OnlineConfig``: the target, the prompts,
            the lengths, dtype, device, backend, limit and the drafter's settings), decoded alike.
        lanes_per_forward: (run, prompt) sequences verified in one batched target forward; 1 runs
            each alone (the exact forward ``scorer online`` at T = 0 makes).
        n_boot: bootstrap resamples of the interval over runs.
        rejection_sample_method: vLLM's; "block" verifies each chain round by block verification
            (scorer.rules.block_verify, vLLM's V2 runner: the same noise streams), the one way to score it
            with probabilistic drafts (no cache gives that: scorer/offline/sampled_view.py).
    """

    checkpoint: str
    sampling: SamplingSetting
    runs: int = 64
    draft_sampling: str = "greedy"
    tree: tuple[int, int, int] | None = None
    ddtree: int | None = None
    online: OnlineConfig = field(default_factory=OnlineConfig)
    lanes_per_forward: int = 64
    n_boot: int = 1000
    rejection_sample_method: str = "standard"

    def validate(self) -> SampledOnlineConfig:
        """Refuse what cannot run, in one line each; return ``self``.

        Raises:
            ScorerError: naming the field and the fix.
        """
        if self.sampling.greedy:
            raise ScorerError(
                "the sampled online reference needs temperature > 0 (--temperature T or --sampling PRESET); "
                "at temperature 0 run scorer online without --runs / --draft-sampling"
            )
        self.sampling.validate()
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ScorerError(
                f"--draft-sampling {self.draft_sampling!r}: choose one of {', '.join(DRAFT_SAMPLING)}"
            )
        for name, value, low in (("runs", self.runs, 1), ("lanes_per_forward", self.lanes_per_forward, 1)):
            if not isinstance(value, int) or value < low:
                raise ScorerError(f"--{name.replace('_', '-')} {value!r} must be an integer >= {low}")
        if self.n_boot < 1:
            raise ScorerError(f"n_boot {self.n_boot} must be at least 1")
        check_tree_request(self.tree, self.draft_sampling, self.sampling, self.ddtree)
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ScorerError(
                f"--rejection-sample-method {self.rejection_sample_method!r}: choose one of "
                f"{', '.join(REJECTION_SAMPLE_METHODS)}"
            )
        if self.rejection_sample_method == "block" and (self.tree is not None or self.ddtree is not None):
            raise ScorerError(
                "--rejection-sample-method block verifies vLLM's chains; a tree is SGLang's rule: drop one of them"
            )
        return self


def check_tree_request(
    tree: tuple[int, int, int] | None,
    draft_sampling: str,
    sampling: SamplingSetting,
    ddtree: int | None = None,
) -> None:
    """Refuse, in one line, a tree round no engine serves or this loop does not transcribe
    (``tree``: SGLang's EAGLE tree; ``ddtree``: DFlash's DDTree of that many nodes, the same rule).

    - probabilistic drafting: SGLang's ``--speculative-use-rejection-sampling`` requires
      ``speculative_eagle_topk == 1`` (a chain) and vLLM's rejection samplers verify a flat chain
      (no tree parents), so no engine verifies a tree with min(1, p/q);
    - ``--repetition-penalty``: SGLang's tree verification builds its penalty as one additive vector
      from zeros (``SGLANG_PENALTY``'s sources), so it never applies the multiplicative repetition
      penalty; presence and frequency penalties run SGLang's relaxed rule (``processed_rows``);
    - min_p: SGLang's verify of the commit transcribed applies none (newer ones after top-p), this
      loop's processor (vLLM's order) before top-k.

    Raises:
        ScorerError: naming the flag and the fix.
    """
    if tree is not None and ddtree is not None:
        raise ScorerError(
            "--tree is SGLang's EAGLE tree (EAGLE-3, MTP) and --ddtree DFlash's DDTree: pass one of them"
        )
    if ddtree is not None and (not isinstance(ddtree, int) or ddtree < 1):
        raise ScorerError(f"--ddtree {ddtree!r} must be an integer >= 1 (the tree's node budget)")
    if tree is None and ddtree is None:
        return
    flag = "--tree" if ddtree is None else "--ddtree"
    if draft_sampling == "probabilistic":
        raise ScorerError(
            f"--draft-sampling probabilistic with {flag}: no engine verifies a tree with probabilistic drafts "
            "(SGLang's --speculative-use-rejection-sampling takes speculative_eagle_topk 1, vLLM verifies chains); "
            f"drop {flag} or --draft-sampling"
        )
    if sampling.repetition_penalty != 1.0:
        raise ScorerError(
            f"{flag} runs SGLang's rule, and --repetition-penalty {sampling.repetition_penalty:g} is not part of "
            "it (SGLang's tree verification adds one additive penalty vector built from zeros, which a "
            "multiplicative penalty leaves at zero): drop --repetition-penalty (presence and frequency "
            "penalties are applied)"
        )
    if sampling.min_p != 0.0:
        raise ScorerError(
            f"{flag} runs SGLang's rule, and --min-p {sampling.min_p:g} is not transcribed for it (SGLang's "
            "tree verification applies min_p after top-p or not at all, this loop's processor before top-k): "
            "drop --min-p"
        )


@dataclass(frozen=True)
class DecodeSettings:
    """What ``decode_runs`` needs besides the target and the proposer."""

    sampling: SamplingSetting
    draft_sampling: str = "greedy"
    max_new_tokens: int = 64
    max_length: int = 4096
    lanes_per_forward: int = 64
    tree: tuple[int, int, int] | None = None
    ddtree: int | None = None
    rejection_sample_method: str = "standard"


@dataclass(frozen=True)
class RoundRecord:
    """One verified round, as the kernel saw it (``decode_runs``' ``on_round``; tests check it).

    Attributes:
        run, record_id: which lane.
        token_ids: the committed tokens 0..p before the round (p = anchor).
        drafts: [K] drafted ids.
        target_probs: [K+1, V] float32 processed target distribution of each round position.
        draft_probs: [K, V] float32 q of each slot, or None (one-hot drafts).
        noise: the round's acceptance uniforms and residual noise.
        verified: what ``mrv2_verify`` returned (one row).
    """

    run: int
    record_id: str
    token_ids: tuple[int, ...]
    drafts: torch.Tensor
    target_probs: torch.Tensor
    draft_probs: torch.Tensor | None
    noise: RoundNoise
    verified: VerifiedRounds


@dataclass(frozen=True)
class TreeRoundRecord:
    """One verified tree round (``decode_runs``' ``on_round`` with ``settings.tree``).

    Attributes:
        run, record_id: which lane.
        token_ids: the committed tokens 0..p before the round.
        tree: the drafted ``EagleTree`` (tokens, parents; a parent precedes its children): SGLang's EAGLE
            tree, or with ``settings.ddtree`` DFlash's DDTree.
        target_probs: [M+1, V] float32 processed target distribution at the root and at each node.
        coins: [M+1] float64 the acceptance coin among the root's children (0) and node i's (i + 1).
        final_coin: [1] float64 the final (recovered or bonus) token's coin.
        verified: what ``sglang_target_only_verify`` returned (one row).
    """

    run: int
    record_id: str
    token_ids: tuple[int, ...]
    tree: Any
    target_probs: torch.Tensor
    coins: torch.Tensor
    final_coin: torch.Tensor
    verified: TreeRounds


@dataclass(frozen=True)
class RunResult:
    """One run: every prompt decoded once.

    Attributes:
        run: the run index (its streams are keyed by it).
        requests: per prompt, the decoded tokens and the tokens per round.
    """

    run: int
    requests: tuple[OnlineRequest, ...]

    @property
    def tokens(self) -> int:
        return sum(sum(r.tokens_per_round) for r in self.requests)

    @property
    def rounds(self) -> int:
        return sum(len(r.tokens_per_round) for r in self.requests)

    @property
    def tau(self) -> float | None:
        """Pooled over the run's requests: tokens / rounds (None without a round)."""
        return self.tokens / self.rounds if self.rounds else None


def run_streams(seed: int, run: int, record_id: str) -> dict[str, torch.Generator]:
    """The three independent CPU generators of one (run, record): ``accept`` (acceptance uniforms),
    ``residual`` (the recovered / bonus token's Gumbel noise, and the first token after the prompt)
    and ``draft`` (probabilistic drafts). Each is seeded from BLAKE2b-64 of
    ``hscache-online-v1|seed|run|len:record_id|stream``."""
    out = {}
    for stream in ("accept", "residual", "draft"):
        text = f"{_STREAM_DOMAIN}|{seed}|{run}|{len(record_id)}:{record_id}|{stream}"
        key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
        out[stream] = torch.Generator().manual_seed(key)
    return out


class _ProposalDraw:
    """vLLM's probabilistic draft of one slot: a sample of q = softmax(logits / T) (float32, the whole
    vocabulary), by Gumbel-max on the lane's ``draft`` stream; q is kept for the verifier."""

    def __init__(self, temperature: float, generator: torch.Generator) -> None:
        self.temperature, self.generator = temperature, generator
        self.probs: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> int:
        q = torch.softmax(logits.detach().float().cpu() / self.temperature, dim=-1)
        self.probs.append(q)
        return int(gumbel_argmax(q, draw_gumbel(tuple(q.shape), self.generator)))


class _Rows:
    """A ``capture_batch`` logits observer keeping rows [start, start + n) of one sequence (float32)."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n
        self.parts: list[torch.Tensor] = []

    def __call__(self, first: int, logits: torch.Tensor) -> None:
        lo, hi = max(self.start, first), min(self.start + self.n, first + len(logits))
        if lo < hi:
            self.parts.append(logits[lo - first : hi - first].clone())

    def rows(self) -> torch.Tensor:
        return torch.cat(self.parts)


@dataclass
class _Lane:
    run: int
    record_id: str
    prompt_len: int
    limit: int
    ids: list[int]
    streams: dict[str, torch.Generator]
    hidden: torch.Tensor | None = None
    rounds: list[int] = field(default_factory=list)

    def done(self, eos: set[int]) -> bool:
        return len(self.ids) >= self.limit or self.ids[-1] in eos

    def block(self, extra: list[int], in_round: bool) -> RowBlock:
        """This lane's round rows over ``extra``: vLLM's history (every generated token, the extras
        in-round) or SGLang's (``sglang_penalty_history``, the same for every row)."""
        prompt = self.ids[: self.prompt_len]
        if in_round:
            return RowBlock(self.ids[self.prompt_len :], prompt, extra, True)
        return RowBlock(sglang_penalty_history(self.ids, self.prompt_len, self.rounds), prompt, extra, False)


def _forward(
    target: Target, layer_ids: list[int], lanes: Sequence[_Lane], extras: Sequence[list[int]], width: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batched forward per ``width`` lanes over tokens + extras: per lane (hidden states, the
    float32 logits of its last committed position and every extra token's position)."""
    out = []
    for lo in range(0, len(lanes), width):
        group, more = lanes[lo : lo + width], extras[lo : lo + width]
        observers = [_Rows(len(lane.ids) - 1, len(x) + 1) for lane, x in zip(group, more)]
        captured = capture_batch(
            target,
            [lane.ids + x for lane, x in zip(group, more)],
            layer_ids,
            top_k=1,
            full_logits=False,
            on_logits=observers,
            extra_bytes_per_logit=SAMPLING_BYTES_PER_LOGIT,
        )
        out += [(c.hidden_states, o.rows()) for c, o in zip(captured, observers)]
    return out


@torch.no_grad()
def decode_runs(
    target: Target,
    layer_ids: list[int],
    propose: Proposer,
    prompts: Sequence[tuple[str, list[int]]],
    settings: DecodeSettings,
    runs: Sequence[int],
    on_round: Any = None,
    progress: Any = NO_PROGRESS,
) -> list[RunResult]:
    """Decode every prompt once per run with sampled verification; the runs advance in lockstep, one
    round per (run, prompt) lane per step, their target forwards batched ``lanes_per_forward`` at a time.

    Args:
        target: the live target.
        layer_ids, propose: the family's online proposer (``open_online``).
        prompts: (record id, prompt token ids).
        settings: the sampling setting (its seed keys the streams), the drafting rule, the budget, and
            ``tree`` (SGLang's EAGLE tree and target-only rule, module docstring) or None (chains).
        runs: the run indices to decode (run r draws from ``run_streams(seed, r, record id)``).
        on_round: called with a ``RoundRecord`` (with ``settings.tree``: a ``TreeRoundRecord``) after
            every verified round (tests), or None.
        progress: hears of the tokens committed after every step of the lockstep (hscache/progress.py),
            out of every lane's budget (lanes that stop at EOS leave the total unreached).

    Returns:
        One RunResult per run, in ``runs`` order, requests in ``prompts`` order.

    Raises:
        ScorerError: a proposer refuses probabilistic drafting, the processed support overflows, or
            ``check_tree_request`` refuses the tree request.
    """
    s = settings.sampling
    check_tree_request(settings.tree, settings.draft_sampling, s, settings.ddtree)
    eos = eos_ids(target)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    lanes = [
        _Lane(
            run,
            rid,
            len(prompt),
            min(len(prompt) + settings.max_new_tokens, settings.max_length),
            list(prompt),
            run_streams(int(s.seed or 0), run, rid),
        )
        for run in runs
        for rid, prompt in prompts
    ]
    width = settings.lanes_per_forward
    if not lanes:
        return [RunResult(run, ()) for run in runs]
    budget = sum(lane.limit - lane.prompt_len for lane in lanes)
    note = f"{len(runs)} runs x {len(prompts)} prompts decoded in lockstep, {width} lanes per target forward"
    progress.start(budget, note=note, unit="tokens")
    # Prefill: the first token after the prompt, drawn from the processed distribution at P - 1
    # (empty penalty history). Every run of a prompt shares that forward: one per prompt.
    heads = lanes[: len(prompts)]  # run runs[0]'s lanes, one per prompt, in prompts order
    first = _forward(target, layer_ids, heads, [[] for _ in heads], width)
    p0 = processed_rows(
        torch.cat([rows for _, rows in first]), [lane.block([], True) for lane in heads], s, vocab
    )
    for n, lane in enumerate(lanes):
        k = n % len(prompts)
        lane.hidden = first[k][0]
        lane.ids.append(int(gumbel_argmax(p0[k], draw_gumbel((vocab,), lane.streams["residual"]))))
    progress.advance(len(lanes), status="prefill: each lane's first token")
    while active := [lane for lane in lanes if not lane.done(eos)]:
        before = sum(len(lane.ids) for lane in active)
        _step(target, layer_ids, propose, active, settings, vocab, eos, on_round)
        rounds = sum(len(lane.rounds) for lane in lanes)
        committed = sum(len(lane.ids) - lane.prompt_len - 1 for lane in lanes)
        status = f"{len(lanes) - sum(not lane.done(eos) for lane in lanes)}/{len(lanes)} sequences done"
        progress.advance(
            sum(len(lane.ids) for lane in active) - before,
            status=(f"{status}, tau so far {committed / max(1, rounds):.2f}"),
        )
    progress.finish()
    by_run: dict[int, list[OnlineRequest]] = {run: [] for run in runs}
    for lane in lanes:
        by_run[lane.run].append(
            OnlineRequest(lane.record_id, lane.prompt_len, tuple(lane.ids), tuple(lane.rounds))
        )
    return [RunResult(run, tuple(by_run[run])) for run in runs]


def _step(
    target: Target,
    layer_ids: list[int],
    propose: Proposer,
    active: list[_Lane],
    settings: DecodeSettings,
    vocab: int,
    eos: set[int],
    on_round: Any,
) -> None:
    """One round of every active lane: draft, one batched verification forward per
    ``lanes_per_forward`` lanes, the sampled rule, commit (trees: ``_tree_rounds``)."""
    s, width = settings.sampling, settings.lanes_per_forward
    if settings.tree is not None or settings.ddtree is not None:
        _tree_rounds(target, layer_ids, propose, active, settings, vocab, eos, on_round)
        return
    drafts, qs = [], []
    for lane in active:
        p = len(lane.ids) - 1
        if settings.draft_sampling == "probabilistic":
            draw = _ProposalDraw(s.temperature, lane.streams["draft"])
            drafts.append([int(t) for t in propose(lane.hidden[:p], lane.ids, p, draw=draw)])
            qs.append(torch.stack(draw.probs))
        else:
            drafts.append([int(t) for t in propose(lane.hidden[:p], lane.ids, p)])
            qs.append(None)
    verify = _forward(target, layer_ids, active, drafts, width)
    target_probs: list[torch.Tensor] = []
    for lo in range(0, len(active), width):  # [rows, V] temporaries of one forward's lanes at a time
        rows = torch.cat([r for _, r in verify[lo : lo + width]])
        part = [lane.block(d, True) for lane, d in zip(active[lo : lo + width], drafts[lo : lo + width])]
        target_probs += processed_rows(rows, part, s, vocab).split([len(b.extra) + 1 for b in part])
    for lane, draft, q, probs, (hidden, _) in zip(active, drafts, qs, target_probs, verify):
        x = torch.tensor([draft], dtype=torch.long)
        noise = draw_round_noise(
            1, len(draft), vocab, accept=lane.streams["accept"], residual=lane.streams["residual"]
        )
        if settings.rejection_sample_method == "block":
            verified = block_verify(
                probs[None], x, noise.uniforms, noise.gumbel, None if q is None else q[None]
            )
        else:
            verified = mrv2_verify(probs[None], x, noise, None if q is None else q[None])
        if on_round is not None:
            on_round(RoundRecord(lane.run, lane.record_id, tuple(lane.ids), x[0], probs, q, noise, verified))
        p = len(lane.ids) - 1
        lane.rounds.append(commit_round(lane.ids, verified.emitted(0), p, lane.limit, eos))
        lane.hidden = hidden


def _tree_paths(parents: np.ndarray) -> list[list[int]]:
    """Every root-to-leaf path of a tree (node indices, root's child first); [[]] for an empty tree."""
    inner = {int(q) for q in parents if q >= 0}
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in inner):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        paths.append(path[::-1])
    return paths or [[]]


def _tree_rounds(
    target: Target,
    layer_ids: list[int],
    propose: Proposer,
    active: Sequence[_Lane],
    settings: DecodeSettings,
    vocab: int,
    eos: set[int],
    on_round: Any,
) -> None:
    """One SGLang tree round of every active lane (module docstring): the family's tree, one target
    sequence per root-to-leaf path (batched ``lanes_per_forward`` sequences a forward), the target-only
    rule, the emitted tokens committed and the next round's states taken from the path it accepted."""
    s, width = settings.sampling, settings.lanes_per_forward
    trees, owners, extras, paths_of = [], [], [], []
    for lane in active:
        p = len(lane.ids) - 1
        shape = {"tree": settings.tree} if settings.ddtree is None else {"ddtree": settings.ddtree}
        tree = propose(lane.hidden[:p], lane.ids, p, **shape)
        trees.append(tree)
        paths_of.append(_tree_paths(tree.parents))
        for path in paths_of[-1]:
            owners.append(lane)
            extras.append([int(tree.tokens[i]) for i in path])
    verify = _forward(target, layer_ids, owners, extras, width)
    path_probs: list[torch.Tensor] = []
    for lo in range(0, len(owners), width):
        rows = torch.cat([r for _, r in verify[lo : lo + width]])
        # SGLang's relaxed penalties: one pre-round vector for the root row and every node (SGLANG_PENALTY)
        part = [lane.block(x, False) for lane, x in zip(owners[lo : lo + width], extras[lo : lo + width])]
        path_probs += processed_rows(rows, part, s, vocab).split([len(b.extra) + 1 for b in part])
    first = 0
    for lane, tree, paths in zip(active, trees, paths_of):
        m = len(tree.tokens)
        probs = torch.zeros((m + 1, vocab), dtype=torch.float32)
        state_of = {-1: first}  # node -> a path sequence through it (its states hold the node's position)
        for n, path in enumerate(paths):
            probs[0] = path_probs[first + n][0]
            for depth, node in enumerate(path):
                probs[node + 1] = path_probs[first + n][depth + 1]
                state_of[node] = first + n
        coins = torch.rand(m + 1, generator=lane.streams["accept"], dtype=torch.float64)
        final = torch.rand(1, generator=lane.streams["residual"], dtype=torch.float64)
        verified = sglang_target_only_verify(
            probs[None],
            torch.as_tensor(tree.parents, dtype=torch.long)[None],
            torch.as_tensor(tree.tokens, dtype=torch.long)[None],
            coins[None],
            final,
        )
        if on_round is not None:
            on_round(
                TreeRoundRecord(
                    lane.run, lane.record_id, tuple(lane.ids), tree, probs, coins, final, verified
                )
            )
        accepted = int(verified.accepted[0])
        last = int(verified.path[0, accepted - 1]) if accepted else -1
        p = len(lane.ids) - 1
        lane.rounds.append(commit_round(lane.ids, verified.emitted(0), p, lane.limit, eos))
        lane.hidden = verify[state_of[last]][0]
        first += len(paths)


def summarise_runs(results: Sequence[RunResult], n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """tau over runs, two ways, each with a standard error and a 95% percentile bootstrap over runs.

    ``mean``: the mean of each run's pooled tau, ``se`` its sample sd / sqrt(runs). ``pooled``: every
    run's tokens / every run's rounds, the estimand of the offline scorer (sum of tokens / sum of
    E[rounds | y], docs/sampling.md): a run's tau is a ratio, so with few rounds per run the mean of
    ratios is biased upward (Jensen) and ``pooled`` is the one to compare with offline tau;
    ``pooled_se`` is the ratio estimator's delta-method standard error over runs.
    """
    with_rounds = [r for r in results if r.rounds]
    if not with_rounds:
        return dict.fromkeys(("mean", "se", "interval", "pooled", "pooled_se", "pooled_interval")) | {
            "runs_with_rounds": 0
        }
    taus = np.asarray([r.tau for r in with_rounds], dtype=np.float64)
    totals = np.asarray([(r.tokens, r.rounds) for r in with_rounds], dtype=np.float64)
    n = len(taus)
    pooled = float(totals[:, 0].sum() / totals[:, 1].sum())
    se = pooled_se = None
    if n > 1:
        se = float(taus.std(ddof=1) / np.sqrt(n))
        residual = totals[:, 0] - pooled * totals[:, 1]
        pooled_se = float(np.sqrt((residual**2).sum() / (n * (n - 1))) / totals[:, 1].mean())
    lo, hi = bootstrap_ci(taus, np.mean, n_boot=n_boot, seed=seed)
    plo, phi = bootstrap_ci(totals, tau_pooled_from_totals, n_boot=n_boot, seed=seed)
    return {
        "mean": float(taus.mean()),
        "se": se,
        "interval": [lo, hi],
        "pooled": pooled,
        "pooled_se": pooled_se,
        "pooled_interval": [plo, phi],
        "runs_with_rounds": n,
    }


def check_runs_fit(runs: int, prompts: int, max_length: int) -> None:
    """Bound ``--runs`` by memory before anything is allocated: the runs x prompts sequences decode
    in lockstep, each holding its three random streams (torch CPU generators, ~5 KB of state each)
    and up to ``max_length`` token ids, and together they must fit half of this machine's memory
    (``--runs 1e9`` allocated 9 GiB and then failed in C++).

    Raises:
        ScorerError: naming --runs, the bound and where it comes from.
    """
    import os

    per_sequence = 3 * 5056 + 1024 + 8 * max_length  # streams' states, the lane, its token ids
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 << 30
    most = max(1, memory // 2 // (per_sequence * max(1, prompts)))
    if runs > most:
        raise ScorerError(
            f"--runs {runs}: {runs} runs x {prompts} prompts decode together, each holding its random streams "
            f"and up to --max-length {max_length} tokens (~{per_sequence / 1024:.0f} KB), more than half of this "
            f"machine's {memory / 2**30:.0f} GB: pass at most {most} (64 gives a 95% interval)"
        )


def run_online_sampled(
    config: SampledOnlineConfig, on_round: Any = None, progress: Any = NO_PROGRESS
) -> dict[str, Any]:
    """``scorer online`` at temperature > 0: ``config.runs`` seeded runs over the prompts; the result
    document (schemas/online_report.schema.json, with its ``sampled`` section). ``on_round`` is
    called after every verified round (progress; ``decode_runs``). The prompts, ``--runs`` and the
    drafting sizes are checked before the model loads. ``progress`` (hscache/progress.py) hears of
    the tokens committed out of every lane's budget (``decode_runs``).

    Raises:
        ScorerError: an invalid config (``SampledOnlineConfig.validate``), or what loading refuses.
    """
    config.validate()
    online = config.online
    t0 = time.perf_counter()
    check_runs_fit(config.runs, len(online.records()), online.max_length)
    online.check_sizes(config.ddtree)
    backend = resolve_backend(online.backend, online.device)
    session = online.open(config.checkpoint)
    config.sampling.validate(session.target.vocab_size)  # top_k against the vocabulary, now it is known
    prompts = online.prompts_of(session.target.tokenizer)
    settings = DecodeSettings(
        config.sampling,
        config.draft_sampling,
        online.max_new_tokens,
        online.max_length,
        config.lanes_per_forward,
        config.tree,
        config.ddtree,
        config.rejection_sample_method,
    )
    if config.tree is not None and "tree" not in session.family.online_trees:
        raise ScorerError(
            f"--tree is SGLang's EAGLE tree, drafted online by the EAGLE-3 and MTP families; the "
            f"{session.family.name} family's online proposer drafts none: drop --tree"
        )
    if config.ddtree is not None and "ddtree" not in session.family.online_trees:
        raise ScorerError(
            f"--ddtree is DFlash's DDTree, drafted online by the DFlash family; the {session.family.name} "
            "family's online proposer drafts none: drop --ddtree"
        )
    with use_backend(session.target.model, backend):
        results = decode_runs(
            session.target,
            session.layer_ids,
            session.propose,
            prompts,
            settings,
            range(config.runs),
            on_round,
            progress=progress,
        )
    requests = [r for run in results for r in run.requests]
    seed = int(config.sampling.seed or 0)
    document = {
        "schema_version": ONLINE_SCHEMA_VERSION,
        **tau_of_requests(requests),
        "per_request": [{"run": run.run, **request_row(r)} for run in results for r in run.requests],
        "sampled": {
            "sampling": config.sampling.to_dict(),
            "rule": {
                "name": (BLOCK_RULE if config.rejection_sample_method == "block" else RULE)
                if config.tree is None and config.ddtree is None
                else TREE_RULE,
                "draft_sampling": config.draft_sampling,
                "description": _describe_rule(
                    config.draft_sampling, config.tree, config.ddtree, config.sampling
                ),
                "penalties": VLLM_PENALTY
                if config.tree is None and config.ddtree is None
                else SGLANG_PENALTY,
                **({} if config.tree is None else {"tree": list(config.tree)}),
                **({} if config.ddtree is None else {"ddtree": config.ddtree}),
            },
            "seed": seed,
            "runs": config.runs,
            "tau": {
                **summarise_runs(results, config.n_boot, seed),
                "interval_level": 0.95,
                "n_boot": config.n_boot,
            },
            "per_run": [
                {"run": r.run, "tau": r.tau, "tokens": r.tokens, "rounds": r.rounds} for r in results
            ],
            "lanes_per_forward": config.lanes_per_forward,
        },
        **online.describe(session, backend),
        **run_stamp(time.perf_counter() - t0),
    }
    schemas.validate(document, "online_report")
    return document


def _describe_rule(
    draft_sampling: str,
    tree: tuple[int, int, int] | None = None,
    ddtree: int | None = None,
    sampling: SamplingSetting | None = None,
) -> str:
    penalised = sampling is not None and (
        sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0
    )
    if tree is not None or ddtree is not None:
        penalties = (
            f"; penalties SGLang's relaxed way (presence {sampling.presence_penalty:g}, frequency "
            f"{sampling.frequency_penalty:g}): one vector from the tokens SGLang's penalizers were fed before "
            "the round (every round's anchor token: accepted drafts never count) added to every node's and "
            "the bonus row's logits"
            if penalised
            else ""
        )
        if ddtree is not None:
            shape = f"DFlash DDTree of {ddtree} nodes (the block's per-slot top-K, best-first by product probability)"
        else:
            steps, topk, tokens = tree
            shape = f"SGLang EAGLE tree (steps {steps}, topk {topk}, {tokens} draft tokens) of the drafter's top-k"
        return (
            f"{shape}, "
            "verified by SGLang's TreeSpeculativeSamplingTargetOnly (scorer.rules.sglang_tree."
            "sglang_target_only_verify, thresholds 1): one coin per node, the first child c with coin <= "
            "sum of tried p, else the final token from p minus the tried siblings; all accepted: bonus ~ p; "
            "the target run over every root-to-leaf path; node coins and the final coin from separate seeded "
            f"streams per (run, record){penalties}"
        )
    drafts = (
        "drafts = the drafter's argmax (q one-hot): accept d_j iff u_j < p(d_j), else sample p without d_j"
        if draft_sampling == "greedy"
        else "drafts ~ q = softmax(draft logits / T), full draft vocabulary: accept iff u_j * q(d_j) < p(d_j), "
        "else sample norm(max(p - q, 0))"
    )
    return (
        f"vLLM MRV2 _rejection_kernel + _resample_kernel (scorer.rules.vllm_chain.mrv2_verify); {drafts}; "
        "all accepted: bonus ~ p; acceptance uniforms, residual noise and draft samples from separate "
        "seeded streams per (run, record)"
    )
