"""Arctic Inference's suffix tree in pure Python: what vLLM's suffix decoding drafts from.

A transcription of ``csrc/suffix_decoding/suffix_tree.cc`` of arctic-inference 0.3.0 (the C++ vLLM 0.32.0
runs through ``arctic_inference.suffix_decoding.SuffixDecodingCache``); ``suffix_tree.cc:N`` below cites
that file's lines. The tree holds every suffix, at most ``max_depth`` tokens long, of each sequence added
to it; a node counts the suffixes that end at or pass through it, and keeps its children in order of
non-increasing count. A draft follows the FIRST child at each step (``head_child``), so the order among
children of equal count decides drafts, and it is the C++ linked list's order, which depends on the
history of increments and decrements (``_increment`` / ``_decrement``): kept here as a Python list.

What is left out changes no draft: the C++ keeps each node's tokens as a (sequence, index) reference into
the stored sequences and tracks per-node endpoints to re-point references when a sequence is removed
(suffix_tree.cc:561-587); here a node holds its own tokens. ``use_tree_spec`` (a tree of drafts,
suffix_tree.cc:873-905) is not transcribed: vLLM 0.32.0 never asks for it (its proposer calls
``speculate`` without it: vllm/v1/spec_decode/suffix_decoding.py:82-90), so vLLM verifies a chain.

Probabilities are float32, as in the C++ (``float prob``, suffix_tree.cc:829), so the scores compared
between match lengths and between the prompt and global trees tie and order exactly as there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

__all__ = ["Draft", "SuffixTree"]

_F32 = np.float32
_ZERO = _F32(0.0)


class _Node:
    __slots__ = ("children", "count", "order", "parent", "tokens")

    def __init__(self, count: int, tokens: list[int], parent: _Node | None) -> None:
        self.count = count  # suffixes that end at or pass through this node
        self.tokens = tokens  # this node's tokens (path compression: one or more)
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token -> child
        self.order: list[_Node] = []  # the children, non-increasing count (the C++ sibling list)


class Draft:
    """``Draft`` of suffix_tree.h:102-117: the drafted chain, each token's estimated probability, their
    float32 sum (``score``) and the matched context length."""

    __slots__ = ("match_len", "probs", "score", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.probs: list[float] = []
        self.score = _ZERO
        self.match_len = 0

    def __repr__(self) -> str:
        return f"Draft(token_ids={self.token_ids}, probs={self.probs}, score={self.score}, match_len={self.match_len})"


@lru_cache(maxsize=64)
def _max_tokens(max_spec_tokens: int, factor: float, offset: float, longest: int) -> tuple[int, ...]:
    """Per match length 1..longest, the draft's length bound (suffix_tree.cc:606-609): int(match_len *
    factor + offset + 1e-6) with the product and sum in float32 and the 1e-6 added in double, as the C++
    evaluates it, at most ``max_spec_tokens`` and at least 0 (entry 0 is unused)."""
    lengths = np.arange(longest + 1, dtype=np.float32)
    bound = (lengths * np.float32(factor) + np.float32(offset)).astype(np.float64) + 1e-6
    return tuple(max(min(max_spec_tokens, int(b)), 0) for b in bound)


def _group_head(order: list[_Node], i: int) -> int:
    """Index of the first sibling with the count of ``order[i]`` (its C++ group's head)."""
    count = order[i].count
    while i > 0 and order[i - 1].count == count:
        i -= 1
    return i


def _increment(node: _Node) -> None:
    """``_increment_count`` (suffix_tree.cc:188-228): +1, and the node moves before the head of its
    previous sibling's group when that sibling's count is at most the new count."""
    if node.parent is None:
        node.count += 1
        return
    order = node.parent.order
    i = order.index(node)
    if i == 0 or order[i - 1].count > node.count + 1:  # stays (suffix_tree.cc:196-219)
        node.count += 1
        return
    head = _group_head(order, i - 1)  # suffix_tree.cc:223
    del order[i]
    node.count += 1
    order.insert(head, node)  # _insert_into_siblings_before(node, other_node)


def _decrement(node: _Node) -> None:
    """``_decrement_count`` (suffix_tree.cc:230-291): -1, and a node whose next sibling had its count moves
    to the end of that group (before the next group's head, or last)."""
    if node.parent is None:
        node.count -= 1
        return
    order = node.parent.order
    i = order.index(node)
    old = node.count
    if i + 1 == len(order) or order[i + 1].count < old:  # stays (suffix_tree.cc:239-276)
        node.count -= 1
        return
    j = i + 1  # suffix_tree.cc:280: the next group (first sibling of a lower count), or none
    while j < len(order) and order[j].count == old:
        j += 1
    del order[i]
    node.count -= 1
    order.insert(j - 1, node)  # before the next group's head, or at the end (suffix_tree.cc:283-289)


def _replace(old: _Node, new: _Node) -> None:
    """``_replace_in_siblings`` (suffix_tree.cc:161-186): ``new`` takes ``old``'s place in the order."""
    order = old.parent.order
    order[order.index(old)] = new


class SuffixTree:
    """``SuffixTree`` of suffix_tree.h:119-179 (``extend``, ``remove``, ``speculate`` without a tree)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._root = _Node(0, [], None)
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # per sequence, the nodes its last suffixes end at

    def num_seqs(self) -> int:
        return len(self._seqs)

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (suffix_tree.cc:507-511), created when new."""
        for token in tokens:
            self.append(seq_id, int(token))

    def append(self, seq_id: int, token: int) -> None:
        """``append`` (suffix_tree.cc:294-504): every active suffix of the sequence grows by ``token``."""
        root = self._root
        if seq_id not in self._seqs:
            self._seqs[seq_id] = []
            self._active[seq_id] = []
        seq, active = self._seqs[seq_id], self._active[seq_id]
        active.append(root)  # suffix_tree.cc:307-309: a new empty suffix at the root
        root.count += 1
        if len(active) > self.max_depth:  # suffix_tree.cc:312-314
            active.pop(0)
        seq.append(token)
        for n, node in enumerate(active):
            child = node.children.get(token)
            if child is None:
                if node.count == 1 and node is not root:  # Case 1a (suffix_tree.cc:332-340): extend the leaf
                    node.tokens.append(token)
                else:  # Case 1b (suffix_tree.cc:341-376): a new leaf, last among its siblings
                    leaf = _Node(1, [token], node)
                    node.children[token] = leaf
                    node.order.append(leaf)
                    active[n] = leaf
            elif node.count == child.count + 1 and node is not root:
                if len(child.tokens) == 1:  # Case 2a (suffix_tree.cc:384-411): fuse node into its child
                    child.count += 1
                    child.tokens = node.tokens + [token]
                    child.parent = node.parent
                    _replace(node, child)
                    del node.parent.children[node.tokens[0]]
                    node.parent.children[child.tokens[0]] = child
                    active[n] = child
                else:  # Case 2b (suffix_tree.cc:412-438): the node takes the child's first token
                    node.tokens.append(token)
                    del node.children[token]
                    child.tokens = child.tokens[1:]
                    node.children[child.tokens[0]] = child
            elif len(child.tokens) == 1:  # Case 3a (suffix_tree.cc:442-454): move into the child
                _increment(child)
                active[n] = child
            else:  # Case 3b (suffix_tree.cc:455-501): split the child after its first token
                middle = _Node(child.count, [token], node)
                _replace(child, middle)
                node.children[token] = middle
                child.tokens = child.tokens[1:]
                child.parent = middle
                middle.children[child.tokens[0]] = child
                middle.order = [child]
                _increment(middle)
                active[n] = middle

    def remove(self, seq_id: int) -> None:
        """``remove`` (suffix_tree.cc:514-591): every suffix of the sequence leaves the tree."""
        seq = self._seqs[seq_id]
        root = self._root
        for start in range(len(seq)):
            node = root
            node.count -= 1
            idx = start
            while idx < len(seq):
                child = node.children.get(seq[idx])
                if child is None:
                    break
                if child.count > 1:
                    _decrement(child)
                else:  # suffix_tree.cc:532-537: the child and its subtree held only this suffix
                    node.order.remove(child)
                    del node.children[seq[idx]]
                    break
                idx += len(child.tokens)
                node = child
            if node is not root and len(node.children) == 1:  # suffix_tree.cc:547-560: merge
                only = next(iter(node.children.values()))
                if node.count == only.count:
                    only.tokens = node.tokens + only.tokens
                    only.parent = node.parent
                    _replace(node, only)
                    node.parent.children[only.tokens[0]] = only
        del self._seqs[seq_id]
        del self._active[seq_id]

    def _match(self, context: Sequence[int]) -> tuple[_Node, int] | None:
        """``_match_context`` (suffix_tree.cc:800-823): the node and offset where ``context`` ends."""
        node, idx = self._root, 0
        for token in context:
            if idx >= len(node.tokens):
                node = node.children.get(token)
                if node is None:
                    return None
                idx = 0
            if node.tokens[idx] != token:
                return None
            idx += 1
        return node, idx

    def _path(self, node: _Node, idx: int, max_tokens: int, min_token_prob: np.float32) -> Draft:
        """``_speculate_path`` (suffix_tree.cc:825-853): follow the most counted child while the
        estimated probability (float32 product of count ratios) stays at least ``min_token_prob``."""
        draft = Draft()
        prob = _F32(1.0)
        while len(draft.token_ids) < max_tokens and prob >= min_token_prob:
            if idx < len(node.tokens):
                draft.token_ids.append(node.tokens[idx])
                draft.probs.append(float(prob))
                draft.score = _F32(draft.score + prob)
                idx += 1
            else:
                if not node.order:
                    break
                child = node.order[0]
                prob = _F32(prob * (_F32(child.count) / _F32(node.count)))
                node, idx = child, 0
        return draft

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ) -> Draft:
        """``speculate`` (suffix_tree.cc:593-622) without a tree: for match lengths 1 .. len(context) - 1
        (the whole context is never matched), until one no longer occurs, the path draft of at most
        min(max_spec_tokens, int(match_len * factor + offset + 1e-6)) tokens; the highest score wins,
        a tie going to the longer match (``>=``)."""
        context = [int(t) for t in context]
        best = Draft()
        threshold = _F32(min_token_prob)
        limits = _max_tokens(
            int(max_spec_tokens), float(max_spec_factor), float(max_spec_offset), max(len(context) - 1, 0)
        )
        for match_len in range(1, len(context)):
            found = self._match(context[len(context) - match_len :])
            if found is None:
                break
            draft = self._path(found[0], found[1], limits[match_len], threshold)
            if draft.score >= best.score:
                best = draft
                best.match_len = match_len
        return best
