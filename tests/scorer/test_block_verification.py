"""Block verification (scorer/rules/block_verify.py, vLLM ``rejection_sample_method="block"``) on toy
rounds: what makes the one-hot replay exact for it, and why the probabilistic case is refused offline.

Toy: K = 3 drafts over V = 6 tokens, the target's rows fixed (a target whose next-token distribution
does not depend on the drafted prefix is still a target), 40,000 rounds: tolerances are 5 standard
errors of the frequencies compared. CPU: well under a second.
"""

from __future__ import annotations

import pytest
import torch

from scorer.rules.block_verify import block_verify
from scorer.rules.vllm_chain import RoundNoise, draw_gumbel, mrv2_verify

B, K, V = 40_000, 3, 6


def _toy(seed: int, probabilistic: bool):
    gen = torch.Generator().manual_seed(seed)
    # Dirichlet draws from the global generator: seeded here, or the toy would depend on the tests run before
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        p = torch.distributions.Dirichlet(torch.full((V,), 0.6)).sample((K + 1,))  # [K+1, V]
        q = torch.distributions.Dirichlet(torch.full((V,), 0.6)).sample((K,))
    q = 0.5 * q + 0.5 * p[:K]  # a drafter that is partly right
    if probabilistic:
        drafts = torch.stack(
            [torch.multinomial(q[j], B, replacement=True, generator=gen) for j in range(K)], 1
        )
    else:
        drafts = q.argmax(-1).expand(B, K).clone()  # greedy drafts: each slot's argmax
    uniforms = torch.rand((B, K), generator=gen, dtype=torch.float64)
    gumbel = draw_gumbel((B, V), torch.Generator().manual_seed(seed + 1))
    target = p.expand(B, K + 1, V)
    return p, q, drafts, uniforms, gumbel, target, (q.expand(B, K, V) if probabilistic else None)


def _leading_match(tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return torch.cumprod((tokens[:, :K] == drafts).long(), dim=1).sum(dim=1)


def _close(freq: torch.Tensor, prob: torch.Tensor) -> None:
    se = (prob * (1 - prob) / B).sqrt().clamp(min=1e-4)
    assert ((freq - prob).abs() <= 5 * se).all(), (freq, prob)


def test_at_t0_block_is_the_standard_greedy_rule():
    """vLLM's kernel takes the greedy branch before the block branch (rejection_sampler_utils.py:573-598)."""
    p, _, _, uniforms, gumbel, target, _ = _toy(0, probabilistic=False)
    argmax = p.argmax(-1)
    drafts = argmax[:K].expand(B, K).clone()
    drafts[: B // 2, 1] = (argmax[1] + 1) % V  # half the rounds miss at slot 2
    out = block_verify(target, drafts, uniforms, gumbel, greedy=True)
    assert out.accepted[: B // 2].eq(1).all() and out.accepted[B // 2 :].eq(K).all()
    assert out.tokens[0, 1] == argmax[1] and out.tokens[-1, K] == argmax[K]


def test_onehot_block_accepts_the_leading_match_of_what_it_emits():
    """With greedy drafts a block round that accepts tau emits a token other than draft tau+1 next
    (the one-hot residual, L878-897), so accepted == the leading match of the emitted text with the
    drafts: the one-hot replay of a served text is exact under block verification. It is lossless (the
    first token's frequencies are the target's) and accepts what the standard rule accepts."""
    p, _, drafts, uniforms, gumbel, target, _ = _toy(1, probabilistic=False)
    out = block_verify(target, drafts, uniforms, gumbel)
    assert torch.equal(out.accepted, _leading_match(out.tokens, drafts))
    first = out.tokens[:, 0]
    _close(torch.bincount(first, minlength=V).double() / B, p[0].double())
    standard = mrv2_verify(target, drafts, RoundNoise(uniforms, gumbel))
    mean, se = out.accepted.double().mean(), out.accepted.double().std() / B**0.5
    assert abs(mean - standard.accepted.double().mean()) < 5 * se
    assert 0.3 < mean < K - 0.3  # neither rule trivially accepts all or nothing on this toy


def test_probabilistic_block_is_lossless_and_accepts_more_than_the_standard_rule():
    """With probabilistic drafts block verification stays lossless and accepts more than the standard
    rule on the same drafts (Sun et al.'s optimality: scoring it with the standard rule's expectation is
    a swapped rule, and shows). Its residual never emits the draft it rejected (were r(x) > 0 there,
    p_{tau+1} = 1 and h_{tau+1} = 1 would have accepted it), so the count is still the leading match of
    the text with the drafts; but whether a round passes slot i depends on the drafts after it and on the
    target at prefixes the text never took, which no cache holds (scorer eval refuses it)."""
    p, _, drafts, uniforms, gumbel, target, q = _toy(2, probabilistic=True)
    out = block_verify(target, drafts, uniforms, gumbel, q)
    _close(torch.bincount(out.tokens[:, 0], minlength=V).double() / B, p[0].double())
    standard = mrv2_verify(target, drafts, RoundNoise(uniforms, gumbel), q)
    gain = out.accepted.double().mean() - standard.accepted.double().mean()
    assert gain > 5 * out.accepted.double().std() / B**0.5
    assert torch.equal(out.accepted, _leading_match(out.tokens, drafts))
    # where the rounds part: the same drafts, block accepting more than the standard rule would
    assert (out.accepted > standard.accepted).any()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_probs"):
        block_verify(
            torch.rand(2, K, V), torch.zeros(2, K, dtype=torch.long), torch.rand(2, K), torch.rand(2, V)
        )


def test_scorer_eval_block_scores_greedy_drafts_as_the_standard_rule(
    trained_drafter, scorer_cache, sampled_scorer_cache
):
    """``--rejection-sample-method block``: at T 0 (vLLM's greedy branch) and on a sampled cache with
    greedy drafts the rounds are the standard rule's, request for request; the report says which rule;
    with probabilistic drafts it is refused by name, before anything is scored."""
    from click.testing import CliRunner

    from scorer.cli import main
    from scorer.errors import ScorerError
    from scorer.studies.evaluate import EvalConfig, evaluate

    for cache in (scorer_cache, sampled_scorer_cache):
        standard = evaluate(trained_drafter, cache, EvalConfig(ddtree=(), n_boot=10, limit=2))
        block = evaluate(
            trained_drafter, cache, EvalConfig(ddtree=(), n_boot=10, limit=2, rejection_sample_method="block")
        )
        assert block["config"]["rejection_sample_method"] == "block"
        assert "rejection_sample_method" not in standard["config"]
        for a, b in zip(standard["per_request"], block["per_request"], strict=True):
            assert a["accepted"] == b["accepted"] and a["anchors"] == b["anchors"]
    with pytest.raises(ScorerError, match="no cache holds"):
        evaluate(
            trained_drafter,
            sampled_scorer_cache,
            EvalConfig(ddtree=(), rejection_sample_method="block", draft_sampling="probabilistic"),
        )
    args = [
        "eval",
        str(trained_drafter),
        "--cache",
        str(sampled_scorer_cache),
        "--draft-sampling",
        "probabilistic",
    ]
    result = CliRunner().invoke(main, [*args, "--rejection-sample-method", "block"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "--rejection-sample-method block with --draft-sampling probabilistic" in result.output
    result = CliRunner().invoke(main, [*args, "--rejection-sample-method", "synthetic"])
    assert result.exit_code == 2 and "synthetic" in result.output


def test_online_block_verification_runs_the_block_kernel(trained_drafter, tmp_path):
    """``scorer online --rejection-sample-method block``: every chain round is block verification
    (scorer.rules.block_verify on the round's recorded target rows, drafts, q and noise emits what the loop
    committed), with probabilistic drafts too (the one way to score that), and the report names the rule."""
    import json

    from click.testing import CliRunner

    from hscache import schemas
    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
    from hscache.store.sampling import SamplingSetting
    from scorer.cli import main
    from scorer.families.base import OnlineOptions
    from scorer.online.greedy import open_online
    from scorer.online.sampled import DecodeSettings, decode_runs

    session = open_online(str(trained_drafter), "builtin:tiny-qwen3.5", "fp32", OnlineOptions(overrides={}))
    record = list(iter_records(resolve_prompts("builtin:default")))[4]
    prompts = [(record.record_id, prompt_token_ids(record, session.target.tokenizer))]
    setting = SamplingSetting(temperature=0.7, top_k=8, seed=3)
    records = []
    settings = DecodeSettings(setting, "probabilistic", 8, 4096, rejection_sample_method="block")
    decode_runs(session.target, session.layer_ids, session.propose, prompts, settings, [0], records.append)
    assert records
    for rec in records:
        again = block_verify(
            rec.target_probs[None],
            rec.drafts[None],
            rec.noise.uniforms,
            rec.noise.gumbel,
            rec.draft_probs[None],
        )
        assert again.emitted(0) == rec.verified.emitted(0)
    out = tmp_path / "online.json"
    args = ["online", str(trained_drafter), "--temperature", "0.7", "--top-k", "8", "--runs", "2"]
    args += [
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--rejection-sample-method",
        "block",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    assert document["sampled"]["rule"]["name"] == "vllm-mrv2-block"
