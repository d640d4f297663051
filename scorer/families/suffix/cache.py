"""Arctic Inference's ``SuffixDecodingCache`` in pure Python: the prompt tree of each active request and the
global tree of past responses, as vLLM's suffix decoding drives them.

A transcription of ``arctic_inference/suffix_decoding/cache.py`` of arctic-inference 0.3.0 (``cache.py:N``
below cites its lines): each active request has a tree of its prompt and the tokens it generated
(``start_request``, ``add_active_response``); one global tree holds the responses (generated tokens only)
of up to ``max_cached_requests`` requests, the active ones included, each under a sequence id; when a new
request's id would exceed the limit, the oldest cached response is evicted first (FIFO, cache.py:335-347).
A draft is the better scoring of the two trees' (the prompt tree's on a tie, cache.py:308), each matched
on the last ``max_tree_depth`` tokens of the context.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from scorer.families.suffix.tree import Draft, SuffixTree

__all__ = ["SuffixCache"]


class SuffixCache:
    """``SuffixDecodingCache`` (cache.py:59-356): the same methods and bookkeeping."""

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1) -> None:
        if max_cached_requests > 0x7FFFFFFF:
            raise ValueError("max_cached_requests must be at most 2^31")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._global_tree = SuffixTree(max_tree_depth)
        self._local_trees: dict[Hashable, SuffixTree] = {}
        self._req_to_seq_id: dict[Hashable, int] = {}  # insertion order: the FIFO eviction order
        self._seq_to_req_id: dict[int, Hashable] = {}
        self._next_seq_id = 0

    @property
    def active_requests(self) -> Any:
        return self._local_trees.keys()

    @property
    def cached_requests(self) -> Any:
        return self._req_to_seq_id.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        """cache.py:120-161: the request's prompt tree; with a global cache, a new sequence id for its
        response (evicting the oldest cached response beyond ``max_cached_requests``)."""
        if req_id in self._local_trees:
            raise ValueError(f"Request '{req_id}' is already active")
        self._local_trees[req_id] = SuffixTree(self.max_tree_depth)
        self._local_trees[req_id].extend(0, prompt_token_ids)
        if self.max_cached_requests != 0:
            if req_id in self._req_to_seq_id:
                self.evict_cached_response(req_id)
            self._generate_seq_id(req_id)

    def stop_request(self, req_id: Hashable) -> None:
        """cache.py:163-178: drop the prompt tree; the response stays cached until evicted."""
        if req_id not in self._local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        del self._local_trees[req_id]

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """cache.py:180-215: the tokens go to the request's own tree and, while cached, its response."""
        if req_id not in self._local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        self._local_trees[req_id].extend(0, token_ids)
        if req_id in self._req_to_seq_id:
            self._global_tree.extend(self._req_to_seq_id[req_id], token_ids)

    def evict_cached_response(self, req_id: Hashable) -> None:
        """cache.py:217-233."""
        if req_id not in self._req_to_seq_id:
            raise ValueError(f"Request '{req_id}' is not cached")
        seq_id = self._req_to_seq_id.pop(req_id)
        self._seq_to_req_id.pop(seq_id)
        self._global_tree.remove(seq_id)

    def speculate(
        self,
        req_id: Hashable,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> Draft:
        """cache.py:235-310 (without ``use_tree_spec``, which vLLM never sets): the prompt tree's draft
        unless the global tree's scores strictly higher."""
        if req_id not in self._local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        if len(context) > self.max_tree_depth:
            context = context[-self.max_tree_depth :]
        args = (context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob)
        local = self._local_trees[req_id].speculate(*args)
        shared = self._global_tree.speculate(*args)
        return local if local.score >= shared.score else shared

    def _generate_seq_id(self, req_id: Hashable) -> int:
        """cache.py:312-333: the next sequence id no active request holds (wrapping at 2^31)."""
        while True:
            seq_id = self._next_seq_id
            self._next_seq_id = (self._next_seq_id + 1) & 0x7FFFFFFF
            if seq_id not in self._seq_to_req_id or self._seq_to_req_id[seq_id] not in self._local_trees:
                break
        if seq_id in self._seq_to_req_id:  # a wrapped id still cached for a finished request
            del self._req_to_seq_id[self._seq_to_req_id[seq_id]]
            del self._seq_to_req_id[seq_id]
            self._global_tree.remove(seq_id)
        self._req_to_seq_id[req_id] = seq_id
        self._seq_to_req_id[seq_id] = req_id
        self._maybe_evict_requests(seq_id)
        return seq_id

    def _maybe_evict_requests(self, new_seq_id: int) -> None:
        """cache.py:335-347: evict in insertion order, never the id just allocated."""
        if self.max_cached_requests < 0:
            return
        while len(self._req_to_seq_id) > self.max_cached_requests:
            for req_id, seq_id in self._req_to_seq_id.items():
                if seq_id != new_seq_id:
                    self.evict_cached_response(req_id)
                    break
