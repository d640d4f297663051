"""vLLM's n-gram (prompt lookup) proposer: one context (``propose``) and many anchors of a cached
sequence at once (``NgramIndex`` / ``propose_at``). No weights: a draft is a function of the tokens.

The contract is vLLM's ``_find_longest_matched_ngram_and_propose_tokens``
(vllm/v1/spec_decode/ngram_proposer.py lines 198-285 at commit
adce4e9a528d7f79328075e195c855d28732ef13; the body is unchanged since at least 016e8ede), a KMP
scan over the reversed context. What it computes, for a context c_0..c_{T-1}:

- the context is the prompt and every token generated so far, the last sampled (bonus) token
  included (vLLM passes ``token_ids_cpu[req, :num_tokens_no_spec]``, lines 182-184); on a cached
  sequence the context at anchor p is x_0..x_p;
- k' = min(k, max_model_len - T) (line 218); no draft when T < min_n (line 214) or k' <= 0;
- n* = the largest n in [min_n, max_n] such that the suffix c[T-n:] also occurs at a start s with
  s + n <= T - 1: an earlier occurrence, which may overlap the suffix but ends before the last
  token (the KMP border at reversed index i >= 1 is at most i long);
- s* = the EARLIEST such start for n* (line 253: ``>=`` keeps the last reversed position);
- the draft is c[s*+n* : s*+n*+k'], fewer than k' tokens when the context ends first (line 284),
  never empty once a match exists; no match: an empty draft (line 275).

Existence is monotone in n (an occurrence of the n-gram suffix at s holds the (n-1)-gram suffix at
s+1), so "longest n with an earlier occurrence" is exactly the KMP maximum. vLLM validates
1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens >= 1
(vllm/config/speculative.py, SpeculativeConfig.__post_init__ at f19b16d9); so does NgramConfig.

SGLang's "NGRAM" speculative mode is a different algorithm (python/sglang/srt/speculative/
cpp_ngram at 574f6d7c): a trie shared across requests (prompts and outputs of every request, up
to ``capacity`` tokens) matched BFS or by frequency into a TREE of ``draft_token_num`` tokens
verified with a tree mask. It is not this chain proposer, and it is not what this module scores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scorer.errors import ScorerError

__all__ = ["NgramConfig", "NgramConfigError", "NgramIndex", "propose", "propose_at"]

# vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is given (speculative.py).
DEFAULT_PROMPT_LOOKUP = 5


class NgramConfigError(ScorerError, ValueError):
    """An n-gram proposer setting or input that vLLM would refuse, or that cannot be drafted."""


def _check_settings(min_n: int, max_n: int, k: int, max_model_len: int | None) -> None:
    if min_n < 1:
        raise NgramConfigError(
            f"--prompt-lookup-min {min_n} must be >= 1 (vLLM's rule); pass a positive n-gram length"
        )
    if max_n < min_n:
        raise NgramConfigError(
            f"--prompt-lookup-min {min_n} must be <= --prompt-lookup-max {max_n} (vLLM's rule); "
            "raise --prompt-lookup-max or lower --prompt-lookup-min"
        )
    if k < 1:
        raise NgramConfigError(f"--num-speculative-tokens {k} must be >= 1 (vLLM's rule)")
    if max_model_len is not None and max_model_len < 1:
        raise NgramConfigError(f"max_model_len {max_model_len} must be >= 1, or None for no cap")


@dataclass(frozen=True)
class NgramConfig:
    """The proposer's settings under vLLM's names (``--speculative-config``).

    Attributes:
        num_speculative_tokens: K, the most tokens drafted per round.
        prompt_lookup_min: shortest suffix n-gram that may match.
        prompt_lookup_max: longest suffix n-gram tried (the longest matching one wins).
        max_model_len: vLLM's cap (k' = min(K, max_model_len - context length)); None: no cap.
    """

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_settings(
            self.prompt_lookup_min, self.prompt_lookup_max, self.num_speculative_tokens, self.max_model_len
        )

    @classmethod
    def resolve(
        cls,
        num_speculative_tokens: int,
        prompt_lookup_min: int | None = None,
        prompt_lookup_max: int | None = None,
        max_model_len: int | None = None,
    ) -> NgramConfig:
        """vLLM's defaults: neither bound given -> both 5; one given -> the other equals it."""
        if prompt_lookup_min is None and prompt_lookup_max is None:
            prompt_lookup_min = prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
        elif prompt_lookup_min is None:
            prompt_lookup_min = prompt_lookup_max
        elif prompt_lookup_max is None:
            prompt_lookup_max = prompt_lookup_min
        return cls(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, max_model_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_tokens(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor -> numpy without importing torch here
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int64).reshape(-1)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise NgramConfigError(
            f"{name} must be a 1-D integer array of token ids, got shape {arr.shape} {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def _capped_k(k: int, context_len: Any, max_model_len: int | None) -> Any:
    return k if max_model_len is None else np.minimum(k, max_model_len - context_len)


def propose(
    context_token_ids: Any, min_n: int, max_n: int, k: int, max_model_len: int | None = None
) -> list[int]:
    """vLLM's n-gram draft for one context (tokens 0..p, the anchor token included).

    Compares every end position e <= T-2 with the context's last token backwards, one offset at
    a time: run[e] = length of the common suffix of c[:e+1] and c, capped at max_n. The longest
    run >= min_n wins, at its first end e*; the draft is c[e*+1 : e*+1+k'].

    Args:
        context_token_ids: [T] token ids (numpy, list or torch).
        min_n, max_n: prompt_lookup_min / prompt_lookup_max.
        k: num_speculative_tokens.
        max_model_len: vLLM's model-length cap on k, None for none.

    Returns:
        The drafted token ids, between 0 and k of them (0: no match, a plain decode step).
        Time O(T * max_n), memory O(T).

    Raises:
        NgramConfigError: settings vLLM refuses, or a context that is not 1-D integer.
    """
    _check_settings(min_n, max_n, k, max_model_len)
    c = _as_tokens(context_token_ids, "context_token_ids")
    total = len(c)
    k_eff = int(_capped_k(k, total, max_model_len))
    if total < min_n or k_eff <= 0:
        return []
    run = np.zeros(total - 1, dtype=np.int64)  # ends e = 0..T-2
    alive = np.ones(total - 1, dtype=bool)
    for t in range(min(max_n, total - 1)):
        same = np.zeros(total - 1, dtype=bool)
        same[t:] = c[: total - 1 - t] == c[total - 1 - t]  # c[e - t] == c[T-1-t]
        alive &= same
        if not alive.any():
            break
        run += alive
    longest = int(run.max()) if len(run) else 0
    if longest < min_n:
        return []
    start = int(np.argmax(run == longest)) + 1  # the earliest end of a longest match, plus one
    return c[start : start + min(k_eff, total - start)].tolist()


class NgramIndex:
    """First occurrences of every n-gram of one cached sequence, for drafting at any anchor.

    For n in [min_n, max_n], ``first[n][j]`` is the earliest start of the n-gram x[j:j+n] in x.
    The context at anchor p is x[:p+1]; its suffix n-gram starts at j = p-n+1 and occurred earlier
    exactly when first[n][j] < j (its earliest start is then s* = first[n][j], and s* + n <= p).
    The earliest occurrence in x is the earliest in the context because it is at most j.

    Build: O(max_n * T log T) time (one stable ``np.unique`` per n over dense n-gram ids),
    O(T * (max_n - min_n + 1)) memory. A draft: O(max_n - min_n + 1 + k) per anchor.
    """

    def __init__(self, token_ids: Any, min_n: int, max_n: int) -> None:
        _check_settings(min_n, max_n, 1, None)
        self.tokens = _as_tokens(token_ids, "token_ids")
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[int, np.ndarray] = {}
        total = len(self.tokens)
        if total == 0:
            return
        _, token_rank = np.unique(self.tokens, return_inverse=True)  # dense ids < T
        gram_ids = token_rank.astype(np.int64)  # ids of the n-grams starting at 0..T-n
        for n in range(1, min(max_n, total) + 1):
            if n > 1:  # the n-gram at j is the (n-1)-gram at j followed by token j+n-1
                keys = gram_ids[: total - n + 1] * total + token_rank[n - 1 :]
                _, firsts, gram_ids = np.unique(keys, return_index=True, return_inverse=True)
            else:
                _, firsts = np.unique(gram_ids, return_index=True)
            if n >= min_n:
                self.first[n] = firsts[gram_ids]

    def _match(self, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n*, s*) per anchor, n* = 0 where nothing matches."""
        best_n = np.zeros(len(anchors), dtype=np.int64)
        best_s = np.zeros(len(anchors), dtype=np.int64)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n not in self.first:  # n-grams longer than the sequence
                continue
            starts = anchors - n + 1
            inside = starts >= 0
            earliest = self.first[n][np.maximum(starts, 0)]
            hit = inside & (best_n == 0) & (earliest < starts)
            best_n[hit], best_s[hit] = n, earliest[hit]
        return best_n, best_s

    def propose_at(
        self, anchors: Any, k: int, max_model_len: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts at many anchors; see ``propose_at`` (the module function)."""
        _check_settings(self.min_n, self.max_n, k, max_model_len)
        p = _as_tokens(anchors, "anchors")
        if len(p) and (p.min() < 0 or p.max() >= len(self.tokens)):
            raise NgramConfigError(
                f"anchors must lie in [0, {len(self.tokens) - 1}] for a sequence of {len(self.tokens)} "
                f"tokens, got {int(p.min())}..{int(p.max())}"
            )
        best_n, best_s = self._match(p)
        start = best_s + best_n
        lengths = np.minimum(_capped_k(k, p + 1, max_model_len), p + 1 - start)
        lengths = np.where(best_n > 0, np.maximum(lengths, 0), 0)
        cols = np.arange(k)
        take = cols[None, :] < lengths[:, None]
        drafts = np.full((len(p), k), -1, dtype=np.int64)
        drafts[take] = self.tokens[(start[:, None] + cols[None, :])[take]]
        return drafts, lengths

    def draft(self, anchor: int, k: int, max_model_len: int | None = None) -> list[int]:
        """The draft at one anchor, ``propose(x[:anchor+1], ...)``, in scalar steps: the replay's
        lazy path, where building arrays for one anchor would cost more than the lookup."""
        _check_settings(self.min_n, self.max_n, k, max_model_len)
        if not 0 <= anchor < len(self.tokens):
            raise NgramConfigError(f"anchor {anchor} outside [0, {len(self.tokens) - 1}]")
        k_eff = int(_capped_k(k, anchor + 1, max_model_len))
        for n in range(min(self.max_n, anchor + 1), self.min_n - 1, -1):
            start = anchor - n + 1  # where the context's suffix n-gram starts
            earliest = int(self.first[n][start])
            if earliest < start:
                begin = earliest + n
                return (
                    self.tokens[begin : begin + min(k_eff, anchor + 1 - begin)].tolist() if k_eff > 0 else []
                )
        return []


def propose_at(
    token_ids: Any, anchors: Any, min_n: int, max_n: int, k: int, max_model_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's n-gram drafts at many anchors of one sequence, all at once.

    Args:
        token_ids: [T] the cached sequence x.
        anchors: [A] anchor positions p in [0, T-1]; the context at p is x[:p+1].
        min_n, max_n: prompt_lookup_min / prompt_lookup_max.
        k: num_speculative_tokens.
        max_model_len: vLLM's cap k' = min(k, max_model_len - (p+1)); None for none.

    Returns:
        (drafts int64 [A, k] padded with -1, lengths int64 [A]); row r equals
        ``propose(x[:anchors[r]+1], min_n, max_n, k, max_model_len)`` padded.
        Time O(max_n * T log T + A * (max_n - min_n + 1 + k)), memory O(T * (max_n - min_n + 1) + A * k).

    Raises:
        NgramConfigError: settings vLLM refuses, non-integer input, or an anchor outside the sequence.
    """
    return NgramIndex(token_ids, min_n, max_n).propose_at(anchors, k, max_model_len)
