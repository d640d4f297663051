"""Score one cached sequence: draft at its anchors, then the replays.

``anchors="all"`` drafts once per anchor p in [P, T-2] (all anchors of the generated region),
a group of blocks per forward. Every metric is a pure function of those drafts (spec 3-4): the
chain replay visits a subset of anchors, per-position acceptance and the training-log metric
use all of them, DDTree replays from the per-slot top-K log-probs.

``anchors="chain"`` advances the chain and every DDTree replay in lockstep (replay.RoundLoop) and
drafts only the anchors one of them visits: about 1/tau of the work when tau is all a user wants.
Acceptance per slot and ``train_accept_len`` need every anchor and are left out (None).

Memory: the context is projected once per sequence; the vocabulary projection (the target head,
248,320 columns at real scale) runs in row chunks sized by ``memory_gb`` (hscache head_rows).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import DEFAULT_MEMORY_GB, head_rows, row_chunks
from scorer.families.dflash.ddtree import Tree, build_tree, replay_ddtree, surrogate_tau, tree_depth
from scorer.families.dflash.model import DFlashDrafter
from scorer.metrics import acceptance_counts, train_accept_len
from scorer.offline.replay import replay_chain, round_loop
from scorer.offline.sequences import ANCHOR_MODES, SequenceResult, result_from_parts
from scorer.rules.onehot_chain import chain_depth

__all__ = [
    "block_drafts",
    "block_tree",
    "draft_all_anchors",
    "score_dflash_sequence",
    "score_dflash_sequences_chain",
]


class _Drafts:
    """Drafts of one sequence at any set of anchors: block forward, then the head in row chunks."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        tree_k: int,
        max_blocks_per_forward: int,
        memory_gb: float,
    ) -> None:
        self.drafter, self.features, self.tree_k = drafter, features, tree_k
        self.token_ids = token_ids.to(features.device)
        self.max_blocks = max_blocks_per_forward
        self.rows = head_rows(drafter.config.vocab_size, memory_gb)
        # Anchors reach T-2, so context rows 0..T-3 are all any block sees; projected once.
        self.context = drafter.context_kv(features[: max(len(token_ids) - 2, 1)])

    def hidden(self, anchors: np.ndarray) -> torch.Tensor:
        """Anchors ``[n]`` (sorted) -> final normed block rows ``[n*(B-1), H]``."""
        drafter, device = self.drafter, self.features.device
        B = drafter.config.block_size
        at = torch.as_tensor(anchors, dtype=torch.long, device=device)
        blocks = torch.full((len(at), B), drafter.config.mask_token_id, dtype=torch.long, device=device)
        blocks[:, 0] = self.token_ids[at]
        hidden = drafter.block_hidden(
            self.features, at, blocks, max_blocks_per_forward=self.max_blocks, context=self.context
        )
        return hidden.reshape(-1, hidden.shape[-1])

    def __call__(self, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Anchors ``[n]`` (sorted) -> argmax ``[n, B-1]`` and top-K log-probs ``[n, B-1, K]`` or None."""
        anchor_tokens = self.token_ids[
            torch.as_tensor(anchors, dtype=torch.long, device=self.token_ids.device)
        ]
        return _project(self.drafter, self.hidden(anchors), self.rows, self.tree_k, anchor_tokens)


def block_drafts(drafter: DFlashDrafter, hidden: torch.Tensor, anchor_tokens: torch.Tensor) -> np.ndarray:
    """The drafted tokens ``[n, B-1]`` of blocks whose final normed rows are ``hidden``
    ``[n, B-1, H]`` and whose slot-0 tokens are ``anchor_tokens`` ``[n]`` (``DFlashDrafter.path``)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _project(drafter, flat, max(1, flat.shape[0]), 0, anchor_tokens)[0]


def block_tree(drafter: DFlashDrafter, hidden: torch.Tensor, anchor_token: int, budget: int) -> Tree:
    """The DDTree of ``budget`` nodes of ONE block whose final normed rows are ``hidden`` [1, B-1, H]
    and whose slot-0 token is ``anchor_token`` (``scorer online --ddtree``): the per-slot top-K
    log-probs of the head exactly as the offline replay takes them (``draft_all_anchors`` with
    ``tree_k``), then ``build_tree``."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    anchor = torch.tensor([int(anchor_token)], device=flat.device)
    _, vals, ids = _project(drafter, flat, max(1, flat.shape[0]), budget, anchor)
    return build_tree(vals[0], ids[0], budget)


def _project(
    drafter: DFlashDrafter,
    flat: torch.Tensor,
    rows: int,
    tree_k: int,
    anchor_tokens: torch.Tensor,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Head rows ``[n*(B-1), H]`` -> drafts ``[n, B-1]`` (+ top-K log-probs), in row chunks of ``rows``.

    The drafts are the drafter's ``path`` through the ``slot_candidates`` of each chunk (DFlash: the
    per-slot argmax) from ``anchor_tokens`` [n] (the blocks' slot-0 tokens).
    """
    candidates, vals, ids = [], [], []
    for lo, hi, new in row_chunks(flat.shape[0], rows):
        logits = drafter.head(flat[lo:hi])[new - lo :].float()
        candidates.append(drafter.slot_candidates(logits, flat.dtype))
        if tree_k:
            top = torch.topk(torch.log_softmax(logits, dim=-1), k=min(tree_k, logits.shape[-1]), dim=-1)
            vals.append(top.values)
            ids.append(top.indices)
    shape = (flat.shape[0] // (drafter.config.block_size - 1), drafter.config.block_size - 1)
    draft = drafter.path(flat.reshape(*shape, -1), candidates, anchor_tokens.to(flat.device)).cpu().numpy()
    if not tree_k:
        return draft, None, None
    return (
        draft,
        torch.cat(vals).reshape(*shape, -1).cpu().numpy(),
        torch.cat(ids).reshape(*shape, -1).cpu().numpy(),
    )


def draft_all_anchors(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    tree_k: int,
    max_blocks_per_forward: int = 64,
    memory_gb: float = DEFAULT_MEMORY_GB,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Drafts for anchors P..T-2: argmax ``[A, B-1]`` and, when ``tree_k`` > 0, top-K log-probs.

    Anchors go through the drafter in groups of whole forwards (``max_blocks_per_forward``
    blocks), enough to fill one head chunk, so hidden states and logits never exist for the
    whole sequence at once.

    Args:
        features: ``[T, K*H]`` drafter-ordered target features on the drafter's device.
        token_ids: ``[T]`` cached token ids (CPU).
        tree_k: K of the per-slot top-K log-probs kept for DDTree (0: none).

    Returns:
        (draft int64 ``[A, B-1]``, lp_vals float32 ``[A, B-1, K]`` or None, lp_ids or None).
    """
    drafts = _Drafts(drafter, features, token_ids, tree_k, max_blocks_per_forward, memory_gb)
    return _draft_every_anchor(drafts, prompt_len, len(token_ids))


def _draft_every_anchor(
    drafts: _Drafts, prompt_len: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    # Groups are whole forwards (the chunks block_hidden would form for all anchors at once),
    # sized to fill about one head chunk: the same numbers as one call, in bounded memory.
    anchors = np.arange(prompt_len, seq_len - 1)
    B = drafts.drafter.config.block_size
    group = drafts.max_blocks * max(1, drafts.rows // ((B - 1) * drafts.max_blocks))
    parts = [drafts(anchors[i : i + group]) for i in range(0, len(anchors), group)]
    draft = np.concatenate([p[0] for p in parts])
    if not drafts.tree_k:
        return draft, None, None
    return draft, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def _score_all(
    drafts: _Drafts, x: np.ndarray, a: np.ndarray, prompt_len: int, B: int, budgets: tuple[int, ...]
) -> tuple:
    draft, lp_vals, lp_ids = _draft_every_anchor(drafts, prompt_len, len(x))
    chain = replay_chain(draft, x, a, prompt_len, B)
    ddtree, surrogate = {}, {}
    for budget in budgets:
        trees: dict[int, Any] = {}  # the trees the replay built, one per visited anchor
        ddtree[budget] = replay_ddtree(lp_vals, lp_ids, x, a, prompt_len, budget, built=trees)
        surrogate[budget] = (float(sum(surrogate_tau(t) for t in trees.values())), len(trees))
    visited = np.asarray([p - prompt_len for p in chain.anchors], dtype=np.int64)
    chain_drafts = draft[visited] if len(visited) else np.zeros((0, B - 1), dtype=np.int64)
    acceptance = acceptance_counts(draft, x, a, prompt_len)
    accept_len = train_accept_len(draft, x, a, prompt_len)
    return chain, ddtree, surrogate, chain_drafts, acceptance, accept_len, len(draft)


class _ChainState:
    """One sequence's lockstep replays (chain + each DDTree budget) and the drafts they used."""

    def __init__(
        self, drafts: _Drafts, x: np.ndarray, a: np.ndarray, prompt_len: int, budgets: tuple
    ) -> None:
        self.drafts, self.a = drafts, a
        self.loops = {0: round_loop(x, a, prompt_len), **{b: round_loop(x, a, prompt_len) for b in budgets}}
        self.surrogate = {b: [0.0, 0] for b in budgets}
        self.have: dict[int, tuple[Any, Any, Any]] = {}
        self.chain_drafts: list[np.ndarray] = []

    def need(self) -> list[int]:
        return sorted({loop.p for loop in self.loops.values() if not loop.done} - self.have.keys())

    def advance(self) -> None:
        for k, loop in self.loops.items():
            if loop.done:
                continue
            row, vals, ids = self.have[loop.p]
            if k == 0:
                self.chain_drafts.append(row)
                loop.step(chain_depth(row, self.a, loop.p))
            else:
                tree = build_tree(vals, ids, k)
                self.surrogate[k][0] += surrogate_tau(tree)
                self.surrogate[k][1] += 1
                loop.step(tree_depth(tree, self.a, loop.p, loop.avail))

    def parts(self, B: int) -> tuple:
        stacked = np.stack(self.chain_drafts) if self.chain_drafts else np.zeros((0, B - 1), dtype=np.int64)
        ddtree = {b: loop.log() for b, loop in self.loops.items() if b}
        surrogate = {b: (v[0], v[1]) for b, v in self.surrogate.items()}
        return self.loops[0].log(), ddtree, surrogate, stacked, None, None, len(self.have)


def _run_chains(states: list[_ChainState]) -> None:
    """Advance every sequence's replays in lockstep. Each step drafts the anchors they newly need,
    all sequences' block rows through ONE head projection: a head call per anchor would read the
    [V, H] head for 15 rows, which is weight-bandwidth bound on CPU and GPU alike."""
    while True:
        needs = [(state, state.need()) for state in states]
        needs = [(state, need) for state, need in needs if need]
        if not needs:
            if all(loop.done for state in states for loop in state.loops.values()):
                return
        else:
            hidden = torch.cat([state.drafts.hidden(np.asarray(need)) for state, need in needs])
            first = needs[0][0].drafts
            anchor_tokens = torch.cat(
                [
                    state.drafts.token_ids[torch.as_tensor(need, device=state.drafts.token_ids.device)]
                    for state, need in needs
                ]
            )
            draft, vals, ids = _project(first.drafter, hidden, first.rows, first.tree_k, anchor_tokens)
            row = 0
            for state, need in needs:
                for p in need:
                    state.have[p] = (
                        draft[row],
                        None if vals is None else vals[row],
                        None if ids is None else ids[row],
                    )
                    row += 1
        for state in states:
            state.advance()


def _score_chain(
    drafts: _Drafts, x: np.ndarray, a: np.ndarray, prompt_len: int, B: int, budgets: tuple[int, ...]
) -> tuple:
    state = _ChainState(drafts, x, a, prompt_len, budgets)
    _run_chains([state])
    return state.parts(B)


def score_dflash_sequence(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    prompt_len: int,
    *,
    row: int = 0,
    record_id: str = "",
    category: str | None = None,
    ddtree_budgets: tuple[int, ...] = (),
    max_blocks_per_forward: int = 64,
    anchors: str = "all",
    memory_gb: float = DEFAULT_MEMORY_GB,
) -> SequenceResult:
    """Draft (at every anchor, or with ``anchors="chain"`` only where a replay goes), then replay.

    Raises:
        ValueError: ``anchors`` is not "all" or "chain".
    """
    if anchors not in ANCHOR_MODES:
        raise ValueError(f"anchors {anchors!r}; choose 'all' or 'chain'")
    B = drafter.config.block_size
    x, a = token_ids.cpu().numpy(), target_argmax.cpu().numpy()
    budgets = tuple(ddtree_budgets)
    if len(x) - 1 - prompt_len <= 0:  # no generated region: nothing to draft
        empty = np.zeros((0, B - 1), dtype=np.int64)
        lp = np.zeros((0, B - 1, max(budgets, default=1)), dtype=np.float32)
        chain = replay_chain(empty, x, a, prompt_len, B)
        ddtree = {b: replay_ddtree(lp, lp.astype(np.int64), x, a, prompt_len, b) for b in budgets}
        acc = acceptance_counts(empty, x, a, prompt_len) if anchors == "all" else None
        length = train_accept_len(empty, x, a, prompt_len) if anchors == "all" else None
        parts: tuple = (chain, ddtree, {b: (0.0, 0) for b in budgets}, empty, acc, length, 0)
    else:
        drafts = _Drafts(
            drafter, features, token_ids, max(budgets, default=0), max_blocks_per_forward, memory_gb
        )
        parts = (_score_all if anchors == "all" else _score_chain)(drafts, x, a, prompt_len, B, budgets)
    return result_from_parts(row, record_id, category, parts)


def score_dflash_sequences_chain(
    drafter: DFlashDrafter,
    sequences: list[dict[str, Any]],
    *,
    ddtree_budgets: tuple[int, ...] = (),
    max_blocks_per_forward: int = 64,
    memory_gb: float = DEFAULT_MEMORY_GB,
) -> list[SequenceResult]:
    """``anchors="chain"`` over several sequences at once: their replays advance in lockstep so
    each step's head projection covers every sequence's new blocks (same numbers as one by one).

    Args:
        sequences: dicts with ``features``, ``token_ids``, ``target_argmax``, ``prompt_len`` and
            optionally ``row``, ``record_id``, ``category`` (as ``score_dflash_sequence`` takes them).
    """
    budgets = tuple(ddtree_budgets)
    B = drafter.config.block_size
    states: list[_ChainState | None] = []
    for seq in sequences:
        x, a = seq["token_ids"].cpu().numpy(), seq["target_argmax"].cpu().numpy()
        if len(x) - 1 - seq["prompt_len"] <= 0:
            states.append(None)
            continue
        drafts = _Drafts(
            drafter,
            seq["features"],
            seq["token_ids"],
            max(budgets, default=0),
            max_blocks_per_forward,
            memory_gb,
        )
        states.append(_ChainState(drafts, x, a, seq["prompt_len"], budgets))
    _run_chains([s for s in states if s is not None])
    results = []
    for seq, state in zip(sequences, states):
        if state is None:  # nothing to draft: the one-sequence path handles the empty replay
            results.append(
                score_dflash_sequence(
                    drafter,
                    seq["features"],
                    seq["token_ids"],
                    seq["target_argmax"],
                    seq["prompt_len"],
                    row=seq.get("row", 0),
                    record_id=seq.get("record_id", ""),
                    category=seq.get("category"),
                    ddtree_budgets=budgets,
                    anchors="chain",
                )
            )
            continue
        results.append(
            result_from_parts(
                seq.get("row", 0), seq.get("record_id", ""), seq.get("category"), state.parts(B)
            )
        )
    return results
