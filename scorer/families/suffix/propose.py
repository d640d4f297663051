"""vLLM's suffix decoding proposer over a cache's sequences: its settings and how it feeds the suffix trees.

vLLM 0.32.0's ``SuffixDecodingProposer`` (vllm/v1/spec_decode/suffix_decoding.py) after every step of a
request (lines 50-99): on the request's first step it starts the request with its prompt (line 70,
``start_request``: the prompt tree, and a slot for its response in the global tree, evicting the oldest
beyond ``suffix_decoding_max_cached_requests``); it appends the tokens the step sampled (line 73,
``add_active_response``: to the prompt tree and the response); it drafts from the last
``suffix_decoding_max_tree_depth`` tokens of prompt + output (lines 77-90), at most
min(num_speculative_tokens, max_model_len - tokens - 1) of them, ``max_spec_factor`` x the matched length
and while the path's estimated probability stays >= ``min_token_prob`` (scorer/families/suffix/tree.py);
a request gone from the batch is stopped (lines 94-97: its prompt tree dropped, its response kept).

The draft returned is a CHAIN: vLLM passes no ``use_tree_spec`` (so arctic's default False, a path draft)
and keeps only ``draft.token_ids`` (line 92), which the scheduler verifies as a chain of speculative tokens.

On a cache, the requests are served one at a time in row order (``ServedProposer``): row r is drafted
with the responses of rows 0..r-1 in the global tree (the last ``max_cached_requests`` of them), and its
own response as far as it has gone. The draft at anchor p depends only on those tokens (a tree is the
same whether its tokens came in one call or many), so the drafts at every anchor come from one pass.
Under concurrent serving the global tree would also hold the partial responses of the requests in flight;
that interleaving is the scheduler's and is not modelled here (the judge serves one request at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from scorer.errors import ScorerError
from scorer.families.suffix.cache import SuffixCache

__all__ = ["SETTINGS", "ServedProposer", "SuffixConfig", "SuffixConfigError"]

# vLLM's speculative_config keys (vllm/config/speculative.py:505-520) and their defaults there.
SETTINGS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


class SuffixConfigError(ScorerError, ValueError):
    """A suffix decoding setting vLLM refuses."""


@dataclass(frozen=True)
class SuffixConfig:
    """The proposer's settings under vLLM's names, validated as vLLM does
    (vllm/config/speculative.py:1596-1630, ``_validate_suffix_decoding``).

    Attributes:
        num_speculative_tokens: K, the most tokens drafted a round (vLLM's default: the tree depth).
        suffix_decoding_max_tree_depth: the longest suffix stored, and the context matched.
        suffix_decoding_max_cached_requests: responses kept in the global tree (0: no global tree).
        suffix_decoding_max_spec_factor: at most factor x matched length tokens drafted.
        suffix_decoding_min_token_prob: drafting stops below this estimated probability.
        max_model_len: vLLM's cap (K' = min(K, max_model_len - tokens - 1)); None: no cap.
    """

    num_speculative_tokens: int
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise SuffixConfigError(f"--num-speculative-tokens {self.num_speculative_tokens} must be >= 1")
        rules = (
            ("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth >= 1, ">= 1"),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0, ">= 0"),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor >= 0, ">= 0"),
            ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1, "in [0, 1]"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise SuffixConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} must be {rule} (vLLM's rule, "
                    "vllm/config/speculative.py:1611-1630)"
                )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise SuffixConfigError(f"max_model_len {self.max_model_len} must be >= 1, or None for no cap")

    @classmethod
    def resolve(cls, num_speculative_tokens: int | None, **settings: Any) -> SuffixConfig:
        """vLLM's defaults for what is not given; K defaults to the tree depth (speculative.py:1600-1609)."""
        given = {k: v for k, v in settings.items() if v is not None}
        depth = given.get("suffix_decoding_max_tree_depth", SETTINGS["suffix_decoding_max_tree_depth"])
        k = depth if num_speculative_tokens is None else num_speculative_tokens
        return cls(k, **given)

    def to_dict(self) -> dict[str, Any]:
        """vLLM's ``speculative_config`` keys (without ``method``)."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            **{k: getattr(self, k) for k in SETTINGS},
        }


class ServedProposer:
    """vLLM's proposer over a cache's sequences served one at a time in row order (module docstring).

    ``drafts(row, ...)`` must be asked for the rows in order; asking for an earlier row again (a re-score)
    rebuilds the state from the responses already seen. A row past one not yet seen is refused: the
    global tree would lack that row's response.
    """

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self._responses: list[np.ndarray] = []  # row -> its generated tokens, as fed (int64: 8 bytes a token)
        self._cache = self._fresh()

    def _fresh(self) -> SuffixCache:
        c = self.config
        return SuffixCache(c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests)

    def _rewind(self, row: int) -> None:
        """The state before ``row``: the responses of rows 0..row-1 fed again (prompt trees are dropped
        when a request stops, so only the responses and the eviction order matter)."""
        self._cache = self._fresh()
        for seen, response in enumerate(self._responses[:row]):
            self._cache.start_request(seen, [])
            self._cache.add_active_response(seen, response.tolist())
            self._cache.stop_request(seen)
        del self._responses[row:]

    def drafts(self, row: int, token_ids: Any, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafts at every anchor p in [P, T-2] of cached row ``row`` (its context: x[:p+1]).

        Returns:
            (drafts int64 [A, K] padded with -1, lengths int64 [A]), A = T - 1 - P (0 when nothing was
            generated after the first token).

        Raises:
            ScorerError: ``row`` comes after a row not yet drafted.
        """
        if row > len(self._responses):
            raise ScorerError(
                f"suffix decoding drafts row {row} with every earlier row's response in its global tree, "
                f"but rows {len(self._responses)}..{row - 1} were not scored first: score the cache's rows "
                "in order from row 0 (no distributed or sliced scoring)"
            )
        if row < len(self._responses):
            self._rewind(row)
        c = self.config
        x = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        depth, k = c.suffix_decoding_max_tree_depth, c.num_speculative_tokens
        anchors = max(len(x) - 1 - prompt_len, 0)
        out = np.full((anchors, k), -1, dtype=np.int64)
        lengths = np.zeros(anchors, dtype=np.int64)
        cache = self._cache
        cache.start_request(row, x[:prompt_len])
        for n, p in enumerate(range(prompt_len, len(x) - 1)):
            cache.add_active_response(row, x[p : p + 1])  # the token the step at p-1 committed
            budget = k if c.max_model_len is None else min(k, c.max_model_len - (p + 1) - 1)
            draft = cache.speculate(
                row,
                x[max(0, p + 1 - depth) : p + 1],
                budget,
                c.suffix_decoding_max_spec_factor,
                0.0,  # max_spec_offset: vLLM passes none (arctic's default 0)
                c.suffix_decoding_min_token_prob,
            ).token_ids
            out[n, : len(draft)] = draft
            lengths[n] = len(draft)
        cache.add_active_response(row, x[max(prompt_len, len(x) - 1) :])  # the response's last token
        cache.stop_request(row)
        self._responses.append(np.asarray(x[prompt_len:], dtype=np.int64))
        return out, lengths
