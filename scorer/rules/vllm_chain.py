"""vLLM's verification round at temperature > 0, transcribed to torch on CPU (spec/sampling.md 1.1, 5).

The reference the online loop runs to validate the offline estimators of scorer/rules/expectation.py.
Batched over B independent rounds; the caller gives the target's PROCESSED probabilities at the
K+1 positions of each round (penalties with the in-round drafted prefix in the history, /T, min_p,
top-k, top-p, renormalise: vLLM's Sampler order, see hscache/capture/sampling.py), so nothing here
depends on the sampling settings.

Transcribed from vLLM v0.33.0 (the PyPI sdist, ``vllm/_version.py`` commit ``g4ba787ec9``; the
whole repository snapshot was over the fetch size limit). The indexed snapshot 02e318bd of the same
file, and a later indexed version, hold the same rule in the same functions.

MRV2, ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``:
- ``_rejection_kernel`` (L503): L598 ``u = tl_rand32(step_seed, pos, includes_zero=False)``; L697
  ``accepted = target_logprob > tl.log(u) + draft_logprob`` with ``draft_log_prob = 0.0`` for a
  one-hot draft (``_compute_global_logprobs_and_logsumexp`` L193), draft logits divided by the
  temperature (L179); L591 a -1 placeholder draft ends verification.
- ``_resample_kernel`` (L804): the bonus row, or a -1 placeholder, samples the target logits
  (L905-908); with draft logits ``log p + log1p(-q/p)`` where q/p < 1, else -inf (L946); one-hot:
  the target logits with the rejected draft set to -inf (L958); then a Gumbel argmax
  (``_seeded_resample_argmax``, L980/L993).
- Noise streams, ``vllm/v1/worker/gpu/sample/gumbel.py``: the acceptance uniform is Philox
  ``tl.rand(seed, pos)`` (``tl_rand32`` L66); the residual Gumbel noise is a murmur3 hash of (seed,
  pos, token) (``gumbel_noised_argmax`` L171, L204-208); the DRAFT's Gumbel noise is offset by
  ``_DRAFT_NOISE_SALT = 1 << 30`` (L18, L199) so that "a proposal and the residual it is resampled
  from must not share a noise vector" (the comment at L14-17; vLLM #54282). Here the streams are
  explicit arguments (``RoundNoise``) and ``draw_round_noise`` refuses one generator for both.

MRV1, ``vllm/v1/sample/rejection_sampler.py`` (for comparison, ``mrv1_verify``):
- ``rejection_random_sample_kernel`` (L896): ``draft_prob = 1`` without draft probs (L939); accept
  iff ``draft_prob > 0 and target_prob / draft_prob >= uniform_prob`` (L951); all accepted: the
  bonus token from the full Sampler (L963); uniforms float64 (``generate_uniform_probs`` L689, L728).
- ``sample_recovered_tokens_kernel`` (L1071): one-hot ``prob`` = target probs with the draft
  masked (L1114), else ``max(p - q, 0)`` (L1128); the token is ``argmax(prob / Exp(1))`` (L1142),
  one exponential vector per request (``sample_recovered_tokens`` L760-769).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TL_RAND_MIN",
    "RoundNoise",
    "VerifiedRounds",
    "check_round",
    "draw_gumbel",
    "emit_rounds",
    "draw_round_noise",
    "gumbel_argmax",
    "mrv1_verify",
    "mrv2_verify",
]

# vLLM's smallest positive fp32 tl.rand value (gumbel.py ``_TL_RAND_MIN``): u is clamped to it.
TL_RAND_MIN = 4.6566127342e-10


@dataclass(frozen=True)
class RoundNoise:
    """The two random streams of a verification round, independent by construction.

    Attributes:
        uniforms: [B, K] float64 in [0, 1): the acceptance coin of each draft slot.
        gumbel: [B, V] float64 standard Gumbel noise of the round's one residual / bonus draw
            (vLLM keys it by (seed, position of the resampled slot, token); a round resamples once).
    """

    uniforms: torch.Tensor
    gumbel: torch.Tensor


@dataclass(frozen=True)
class VerifiedRounds:
    """B verified rounds.

    Attributes:
        accepted: [B] int64, drafts accepted (0..K).
        tokens: [B, K+1] int64: the accepted drafts, then the recovered token (after a rejection)
            or the bonus token (all K accepted), then -1. A round emits ``accepted + 1`` tokens.
    """

    accepted: torch.Tensor
    tokens: torch.Tensor

    def emitted(self, b: int) -> list[int]:
        """The tokens round ``b`` emits."""
        return self.tokens[b, : int(self.accepted[b]) + 1].tolist()


def draw_gumbel(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """float64 standard Gumbel noise -log(-log u), u in (0, 1)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp(min=TL_RAND_MIN)
    return -torch.log(-torch.log(u))


def draw_round_noise(
    batch: int, k: int, vocab: int, *, accept: torch.Generator, residual: torch.Generator
) -> RoundNoise:
    """Draw the acceptance uniforms from ``accept`` and the residual Gumbel noise from ``residual``.

    Raises:
        ValueError: when both streams are one generator. Shared noise between a proposal and the
            residual it is resampled from biases the output toward the drafter (vLLM #54282).
    """
    if accept is residual:
        raise ValueError(
            "accept and residual are the same generator; draw the acceptance uniforms and the residual "
            "noise from two independent generators (a shared stream biases the residual, vLLM #54282)"
        )
    uniforms = torch.rand((batch, k), generator=accept, dtype=torch.float64)
    return RoundNoise(uniforms, draw_gumbel((batch, vocab), residual))


def gumbel_argmax(probs: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis of log probs + Gumbel noise: an exact sample of ``probs`` (zeros never win)."""
    return torch.argmax(torch.log(probs.double()) + gumbel, dim=-1)


def check_round(target_probs: torch.Tensor, drafts: torch.Tensor, rows: int) -> tuple[int, int, int]:
    """Check one batch of rounds' shapes: target_probs [B, ``rows``, V], drafts [B, K] -> (B, K, V).

    Raises:
        ValueError: the shapes do not fit (named).
    """
    if target_probs.ndim != 3 or drafts.ndim != 2 or drafts.shape[0] != target_probs.shape[0]:
        raise ValueError(
            f"target_probs {tuple(target_probs.shape)} must be [B, K+{rows - drafts.shape[-1]}, V] and "
            f"drafts {tuple(drafts.shape)} [B, K]"
        )
    b, k = drafts.shape
    if k < 1:
        raise ValueError("drafts has no slot; a verification round needs K >= 1 drafted tokens")
    if target_probs.shape[1] != rows:
        raise ValueError(
            f"target_probs has {target_probs.shape[1]} positions per round; K = {k} needs {rows}"
        )
    return b, k, target_probs.shape[2]


def _at(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # rows [B, R, ...] -> rows[b, index[b]]
    return rows[torch.arange(rows.shape[0]), index]


def _lead(ok: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(ok.long(), dim=1).sum(dim=1)


def emit_rounds(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> VerifiedRounds:
    """The rounds' tokens: the accepted drafts [B, K], then ``last`` (the residual or bonus token)."""
    b, k = drafts.shape
    tokens = torch.full((b, k + 1), -1, dtype=torch.long)
    keep = torch.arange(k)[None, :] < accepted[:, None]
    tokens[:, :k] = torch.where(keep, drafts, -1)
    tokens[torch.arange(b), accepted] = last
    return VerifiedRounds(accepted, tokens)


def mrv2_verify(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    noise: RoundNoise,
    draft_probs: torch.Tensor | None = None,
) -> VerifiedRounds:
    """One MRV2 verification round per batch row (``_rejection_kernel`` + ``_resample_kernel``).

    Args:
        target_probs: [B, K+1, V] processed target probabilities; row j (0-based) verifies draft
            j+1 given the anchor and drafts 1..j; row K is the bonus position.
        drafts: [B, K] drafted token ids; -1 is vLLM's placeholder (always rejected).
        noise: the round's acceptance uniforms and residual Gumbel noise (``draw_round_noise``).
        draft_probs: [B, K, V] the proposal q of each slot (probabilistic drafting: softmax of the
            draft logits / T over the whole draft vocabulary), or None for one-hot (greedy) drafts.

    Returns:
        VerifiedRounds.
    """
    b, k, v = check_round(target_probs, drafts, drafts.shape[1] + 1)
    if noise.uniforms.shape != (b, k) or noise.gumbel.shape != (b, v):
        raise ValueError(f"noise must hold uniforms [{b}, {k}] and gumbel [{b}, {v}]")
    x = drafts.long()
    xc = x.clamp(min=0)  # vLLM: "Avoid possible OOB ptr access"; -1 stays rejected through `x >= 0`
    logp_x = torch.log(target_probs[:, :k].gather(2, xc[..., None])[..., 0].double())
    if draft_probs is None:
        logq_x = torch.zeros_like(logp_x)  # one-hot: log q = 0 (vLLM L193)
    else:
        logq_x = torch.log(draft_probs.gather(2, xc[..., None])[..., 0].double())
    u = noise.uniforms.clamp(min=TL_RAND_MIN)
    accepted = _lead((logp_x > torch.log(u) + logq_x) & (x >= 0))
    row = torch.log(_at(target_probs, accepted).double())  # [B, V]: first rejected position, or bonus
    stop = accepted.clamp(max=k - 1)  # the rejected slot (unused when all K were accepted)
    rejected = _at(x, stop)
    use_target = (accepted == k) | (rejected < 0)
    if draft_probs is None:
        resid = row.scatter(1, rejected.clamp(min=0)[:, None], -torch.inf)
    else:
        ratio = torch.exp(torch.log(_at(draft_probs, stop).double()) - row)
        resid = torch.where(ratio < 1.0, row + torch.log1p(-ratio.clamp(max=1.0)), -torch.inf)
    residual = torch.where(use_target[:, None], row, resid)
    return emit_rounds(x, accepted, torch.argmax(residual + noise.gumbel, dim=-1))


def mrv1_verify(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    bonus_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> VerifiedRounds:
    """One MRV1 round per batch row (``rejection_random_sample_kernel`` + ``sample_recovered_tokens``).

    Args:
        target_probs: [B, K, V] processed target probabilities at the K draft positions.
        drafts: [B, K] drafted token ids (-1 rejected).
        uniforms: [B, K] float64 acceptance coins.
        exponentials: [B, V] Exp(1) noise of the recovered-token race, one vector per request.
        bonus_tokens: [B] the token the full Sampler drew at position K+1.
        draft_probs: [B, K, V] or None (one-hot drafts).

    Returns:
        VerifiedRounds.
    """
    b, k, v = check_round(target_probs, drafts, drafts.shape[1])
    p = target_probs.double()
    x = drafts.long()
    xc = x.clamp(min=0)
    p_x = p.gather(2, xc[..., None])[..., 0]
    q = None if draft_probs is None else draft_probs.double()
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, xc[..., None])[..., 0]
    ok = (x >= 0) & (q_x > 0) & (p_x / q_x.clamp(min=1e-300) >= uniforms)
    accepted = _lead(ok)
    if q is None:
        prob = p.scatter(2, xc[..., None], 0.0)
    else:
        prob = (p - q).clamp(min=0.0)
    recovered = torch.argmax(prob / exponentials.double()[:, None, :], dim=-1)  # [B, K]
    stop = accepted.clamp(max=k - 1)
    last = torch.where(accepted == k, bonus_tokens.long(), _at(recovered, stop))
    return emit_rounds(x, accepted, last)
