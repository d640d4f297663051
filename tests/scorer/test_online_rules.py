"""Online verification kernels (vLLM MRV2/MRV1, SGLang target-only, z-lab) against hand-made rounds and
their exact output distributions (spec/sampling.md 4.1: every lossless rule emits p)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scorer.rules.sglang_tree import sglang_target_only_verify, zlab_verify
from scorer.rules.vllm_chain import (
    RoundNoise,
    draw_gumbel,
    draw_round_noise,
    gumbel_argmax,
    mrv1_verify,
    mrv2_verify,
)
from tests.scorer.sampling_stats import chi_square_pvalue, mean_and_se

B = 20_000  # rounds per distribution check; 5-token vocabularies keep each check a few ms


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _noise(u, gumbel) -> RoundNoise:
    return RoundNoise(torch.tensor(u, dtype=torch.float64), torch.tensor(gumbel, dtype=torch.float64))


def test_mrv2_one_hot_round_by_hand() -> None:
    rows = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p = rows[None].expand(4, 3, 4)
    drafts = torch.tensor([[0, 1], [0, 1], [3, 1], [-1, 0]])
    gumbel = np.zeros((4, 4))
    gumbel[1, 3] = 5.0  # the bonus draw of round 1 lands on token 3
    got = mrv2_verify(p, drafts, _noise([[0.4, 0.7], [0.4, 0.5], [1e-12, 0.5], [0.1, 0.1]], gumbel))
    # 0: slot 1 accepted (0.5 > 0.4), slot 2 rejected (0.6 < 0.7): residual row 1 without token 1 -> 2.
    # 1: both accepted -> bonus. 2: p(3) = 0 is rejected whatever u. 3: a -1 placeholder is rejected
    # and the target row itself is sampled (vLLM _resample_kernel).
    assert got.accepted.tolist() == [1, 2, 0, 0]
    assert [got.emitted(b) for b in range(4)] == [[0, 2], [0, 1, 3], [0], [0]]
    assert got.tokens[0].tolist() == [0, 2, -1]


def test_mrv2_probabilistic_residual_by_hand() -> None:
    p = torch.tensor([[[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[0.1, 0.6, 0.3]]])
    # u q(1) = 0.6 u < p(1) = 0.3 fails for u = 0.9: rejected; residual max(p - q, 0) = [0.4, 0, 0].
    got = mrv2_verify(p, torch.tensor([[1]]), _noise([[0.9]], np.zeros((1, 3))), q)
    assert got.emitted(0) == [0]
    got = mrv2_verify(p, torch.tensor([[1]]), _noise([[0.4]], np.zeros((1, 3))), q)  # 0.24 < 0.3
    assert got.accepted.tolist() == [1]


@pytest.mark.parametrize("probabilistic", [False, True])
def test_mrv1_and_mrv2_agree_given_the_same_noise(probabilistic: bool) -> None:
    g = _gen(0)
    b, k, v = 500, 3, 6
    logits = torch.randn(b, k + 1, v, generator=g, dtype=torch.float64) * 2
    logits[..., -2:] = -torch.inf  # a truncated p (top-4 of 6)
    p = torch.softmax(logits, dim=-1)
    q = (
        torch.softmax(torch.randn(b, k, v, generator=g, dtype=torch.float64), dim=-1)
        if probabilistic
        else None
    )
    drafts = torch.randint(0, v, (b, k), generator=g)
    drafts[: b // 2] = torch.argmax(p[: b // 2, :k], dim=-1)  # half the rounds accept often
    u = torch.rand(b, k, generator=g, dtype=torch.float64)
    exp = torch.empty(b, v, dtype=torch.float64).exponential_(generator=g)
    gumbel = -torch.log(exp)  # argmax(p / E) == argmax(log p - log E)
    bonus = torch.argmax(torch.log(p[:, k]) + gumbel, dim=-1)
    v2 = mrv2_verify(p, drafts, RoundNoise(u, gumbel), q)
    v1 = mrv1_verify(p[:, :k], drafts, u, exp, bonus, q)
    assert torch.equal(v1.accepted, v2.accepted) and torch.equal(v1.tokens, v2.tokens)
    assert 0 < int((v2.accepted == k).sum()) < b  # both bonus and recovered tokens were compared


def _chain_round() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor(
        [
            [0.5, 0.2, 0.2, 0.1, 0.0],
            [0.1, 0.6, 0.0, 0.3, 0.0],
            [0.3, 0.3, 0.4, 0.0, 0.0],
            [0.2, 0.2, 0.2, 0.2, 0.2],
        ],
        dtype=torch.float64,
    )
    return rows, torch.tensor([0, 1, 2])


def _exact_one_hot_outcomes(rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """P(acc = n, last token = y) of the one-hot rule, written from spec 4.1 (B): [K+1, V]."""
    k, v = len(drafts), rows.shape[1]
    out = np.zeros((k + 1, v))
    reach = 1.0
    for n in range(k + 1):
        last = rows[n].copy()
        if n < k:
            last[drafts[n]] = 0.0
        out[n] = reach * last
        if n < k:
            reach *= rows[n, drafts[n]]
    return out


def _outcome_counts(accepted: torch.Tensor, last: torch.Tensor, k: int, v: int) -> np.ndarray:
    return np.bincount((accepted * v + last).numpy(), minlength=(k + 1) * v)


def test_one_hot_readings_have_the_exact_round_distribution() -> None:
    rows, drafts = _chain_round()
    k, v = len(drafts), rows.shape[1]
    exact = _exact_one_hot_outcomes(rows.numpy(), drafts.numpy()).reshape(-1)
    assert exact.sum() == pytest.approx(1.0)
    p = rows[None].expand(B, k + 1, v)
    x = drafts[None].expand(B, k)
    readings = {}
    r = mrv2_verify(p, x, draw_round_noise(B, k, v, accept=_gen(1), residual=_gen(2)))
    readings["vllm mrv2"] = r
    exp = torch.empty(B, v, dtype=torch.float64).exponential_(generator=_gen(3))
    bonus = torch.multinomial(rows[k], B, replacement=True, generator=_gen(4))
    readings["vllm mrv1"] = mrv1_verify(
        p[:, :k], x, torch.rand(B, k, generator=_gen(5), dtype=torch.float64), exp, bonus
    )
    samples = torch.stack(
        [torch.multinomial(rows[j], B, replacement=True, generator=_gen(6 + j)) for j in range(k + 1)], 1
    )
    readings["z-lab"] = zlab_verify(x, samples)
    chain = sglang_target_only_verify(
        p, torch.tensor([-1, 0, 1]), x, torch.rand(B, k + 1, generator=_gen(20), dtype=torch.float64),
        torch.rand(B, generator=_gen(21), dtype=torch.float64),
    )  # fmt: skip
    readings["sglang chain"] = chain
    for name, got in readings.items():
        last = got.tokens[torch.arange(B), got.accepted]
        pval = chi_square_pvalue(_outcome_counts(got.accepted, last, k, v), exact)
        assert pval > 1e-3, f"{name}: p-value {pval}"


def _probabilistic_setup():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.05, 0.15, 0.3, 0.3, 0.2]], dtype=torch.float64)
    draft_noise = draw_gumbel((B, 1, 5), _gen(7))  # the drafter's own stream (vLLM: salted by 1 << 30)
    drafts = gumbel_argmax(q[None].expand(B, 1, 5), draft_noise)
    return p, q, draft_noise, drafts


def test_probabilistic_round_is_lossless_and_accepts_sum_min_p_q() -> None:
    p, q, _, drafts = _probabilistic_setup()
    noise = draw_round_noise(B, 1, 5, accept=_gen(8), residual=_gen(9))
    got = mrv2_verify(p[None].expand(B, 2, 5), drafts, noise, q[None].expand(B, 1, 5))
    assert chi_square_pvalue(np.bincount(got.tokens[:, 0].numpy(), minlength=5), p[0].numpy()) > 1e-3
    mean, se = mean_and_se(got.accepted.double().numpy())
    assert abs(mean - float(torch.minimum(p[0], q[0]).sum())) < 4 * se  # sum min(p, q) = 0.5


def test_a_shared_noise_stream_biases_the_residual() -> None:
    """vLLM #54282: the residual drawn with the draft's own Gumbel noise is no longer p."""
    p, q, draft_noise, drafts = _probabilistic_setup()
    uniforms = torch.rand(B, 1, generator=_gen(10), dtype=torch.float64)
    gumbel = draw_gumbel((B, 5), _gen(11))
    first = {}
    for shared in (False, True):
        g = draft_noise[:, 0] if shared else gumbel  # K = 1: the residual is drawn at slot 1
        got = mrv2_verify(p[None].expand(B, 2, 5), drafts, RoundNoise(uniforms, g), q[None].expand(B, 1, 5))
        first[shared] = chi_square_pvalue(np.bincount(got.tokens[:, 0].numpy(), minlength=5), p[0].numpy())
    assert first[False] > 1e-3
    assert first[True] < 1e-8


def test_one_generator_for_both_streams_is_refused() -> None:
    g = _gen(0)
    with pytest.raises(
        ValueError, match=r"^accept and residual are the same generator; draw the acceptance uniforms"
    ):
        draw_round_noise(2, 3, 4, accept=g, residual=g)


def _tree():
    # Root children: node 0 (token 1), node 1 (token 3); node 0's children: node 2 (token 0), node 3 (token 2).
    parents = torch.tensor([-1, -1, 0, 0])
    tokens = torch.tensor([1, 3, 0, 2])
    rows = torch.tensor(
        [[0.1, 0.5, 0.1, 0.3, 0.0], [0.4, 0.1, 0.4, 0.1, 0.0], [0.2] * 5, [0.2] * 5, [0.2] * 5],
        dtype=torch.float64,
    )
    return parents, tokens, rows


def test_sglang_tree_round_by_hand() -> None:
    parents, tokens, rows = _tree()
    coins = torch.tensor([[0.7, 0.45, 0, 0, 0], [0.05, 0, 0, 0, 0]], dtype=torch.float64)
    got = sglang_target_only_verify(
        rows[None].expand(2, 5, 5), parents, tokens[None].expand(2, 4), coins, torch.tensor([0.5, 0.99])
    )
    # Round 0: root coin 0.7 > p(1) = 0.5, <= 0.5 + p(3) = 0.8: node 1 (a leaf) -> bonus from row 2 with
    # coin 0.5 -> token 2. Round 1: coin 0.05 <= 0.5: node 0; then coin 0 <= p(0 | node 0) = 0.4:
    # node 2 accepted, a leaf: final from row 3 with coin 0.99 -> token 4.
    assert got.accepted.tolist() == [1, 2]
    assert got.path.tolist() == [[1, -1], [0, 2]]
    assert [got.emitted(0), got.emitted(1)] == [[3, 2], [1, 0, 4]]


def test_sglang_tree_rejection_samples_p_without_the_tried_siblings() -> None:
    parents, tokens, rows = _tree()
    coins = torch.tensor([[0.95, 0, 0, 0, 0]], dtype=torch.float64)  # above p(1) + p(3): both rejected
    got = sglang_target_only_verify(rows[None], parents, tokens[None], coins, torch.tensor([0.6]))
    # relu(p - tried) = [0.1, 0, 0.1, 0, 0]; coin 0.6 of 0.2 -> 0.12 > 0.1 -> token 2
    assert got.accepted.tolist() == [0] and got.emitted(0) == [2]


@pytest.mark.parametrize(("threshold_acc", "lossless"), [(1.0, True), (0.5, False)])
def test_sglang_tree_emits_p_only_with_thresholds_one(threshold_acc: float, lossless: bool) -> None:
    parents, tokens, rows = _tree()
    coins = torch.rand(B, 5, generator=_gen(12), dtype=torch.float64)
    final = torch.rand(B, generator=_gen(13), dtype=torch.float64)
    got = sglang_target_only_verify(
        rows[None].expand(B, 5, 5),
        parents,
        tokens[None].expand(B, 4),
        coins,
        final,
        threshold_acc=threshold_acc,
    )
    pval = chi_square_pvalue(np.bincount(got.tokens[:, 0].numpy(), minlength=5), rows[0].numpy())
    if lossless:
        assert pval > 1e-3
        mean, se = mean_and_se((got.accepted >= 1).double().numpy())
        assert abs(mean - 0.8) < 4 * se  # P(continue) = p(children) = p(1) + p(3)
    else:
        assert pval < 1e-8
