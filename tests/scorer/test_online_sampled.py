"""``scorer online`` at temperature > 0 (scorer/online/sampled.py): the target verifying by vLLM's
MRV2 rule. Checked against independent computations: greedy online at a one-token top-k, a
vLLM-order processor written here from a plain transformers forward, the pure kernel on the
recorded noise, and the distribution of the emitted tokens."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from hscache import schemas
from hscache.capture.target import load_target
from hscache.store.sampling import SamplingSetting
from scorer.families.base import OnlineOptions
from scorer.online.greedy import open_online, speculative_decode
from scorer.online.sampled import DecodeSettings, RunResult, decode_runs, summarise_runs
from scorer.rules.vllm_chain import mrv2_verify
from tests.scorer.sampling_stats import chi_square_pvalue

MODEL = "builtin:tiny-qwen3.5"
FAMILIES = ["dflash", "dflash2", "eagle3", "mtp"]
# The built-in records decoded here: merge_sort (32 tokens) and valid_parentheses (45), the shortest
# two of the six the session's drafters were trained on (``scorer_cache``). Every round is a full
# target forward over the prompt and what is decoded so far: the first two (83 and 74 tokens) cost
# twice the CPU for the same checks.
RECORDS = (4, 5)


@pytest.fixture(autouse=True)
def one_thread():
    # Two shared cores: several torch threads per process spin against each other (20x slower here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _checkpoint(family, trained_drafter, eagle3_drafter, tmp_path) -> str:
    if family == "dflash":
        return str(trained_drafter)
    if family == "dflash2":  # NeMo's identity start of the trained DFlash drafter
        from scorer.families.dflash2.init import init_from_dflash

        return str(init_from_dflash(trained_drafter, tmp_path / "dflash2", selector_rank=8))
    return str(eagle3_drafter) if family == "eagle3" else "target:mtp"


def _prompts(target, n):
    """(record id, prompt token ids) of the first ``n`` of RECORDS."""
    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts

    every = list(iter_records(resolve_prompts("builtin:default")))
    records = [every[i] for i in RECORDS[:n]]
    return [(r.record_id, prompt_token_ids(r, target.tokenizer)) for r in records]


def _vllm_processed(logits, prompt, generated, s: SamplingSetting) -> torch.Tensor:
    """vLLM's Sampler order on one row of float32 logits, written independently of hscache's processor:
    repetition (prompt + generated), frequency, presence (generated), /T, min_p, top-k, top-p, softmax."""
    x = logits.double().clone()
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(x)).double()
    seen = counts > 0
    hit = seen.clone()
    hit[torch.tensor(prompt, dtype=torch.long)] = True
    if s.repetition_penalty != 1.0:
        x = torch.where(hit, torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty), x)
    x = x - s.frequency_penalty * counts - s.presence_penalty * seen.double()
    x = x / s.temperature
    if s.min_p > 0:
        probs = torch.softmax(x, -1)
        x = torch.where(probs < s.min_p * probs.max(), -torch.inf, x)
    kth = torch.sort(x, descending=True).values[s.top_k - 1]
    x = torch.where(x < kth, -torch.inf, x)
    ascending, order = torch.sort(x)
    drop = torch.cumsum(torch.softmax(ascending, -1), -1) <= 1 - s.top_p
    drop[-1] = False
    x[order[drop]] = -torch.inf
    return torch.softmax(x, -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_top_k_equals_greedy_online_exactly(family, trained_drafter, eagle3_drafter, tmp_path):
    """top_k 1 leaves p one-hot at the target's argmax: vLLM's rule then accepts exactly the greedy
    matches and resamples the argmax, so every run decodes the greedy online rounds, token for token."""
    ckpt = _checkpoint(family, trained_drafter, eagle3_drafter, tmp_path)
    session = open_online(ckpt, MODEL, "fp32", OnlineOptions(overrides={}))
    prompts = _prompts(session.target, 2)
    greedy = [
        speculative_decode(session.target, session.layer_ids, session.propose, prompt, 12, 4096)
        for _, prompt in prompts
    ]
    setting = SamplingSetting(temperature=0.8, top_k=1, presence_penalty=0.0, seed=5)
    for lanes in (1, 64) if family == "dflash" else (1,):
        settings = DecodeSettings(setting, "greedy", 12, 4096, lanes_per_forward=lanes)
        runs = decode_runs(session.target, session.layer_ids, session.propose, prompts, settings, [0, 1])
        for run in runs:
            assert [list(r.token_ids) for r in run.requests] == [ids for ids, _ in greedy]
            assert [list(r.tokens_per_round) for r in run.requests] == [rounds for _, rounds in greedy]
            assert run.tau == sum(map(sum, (r for _, r in greedy))) / sum(len(r) for _, r in greedy)
    if family == "dflash":  # the drafter is trained on this greedy path: the check covers accepted drafts
        # (on the trained built-in target it accepts little: tau 1.29, 2026-12-03; the looping random
        # target's tau > 2 is gone, so the check is that some round accepted a draft at all)
        assert runs[0].tau > 1
        assert any(n > 1 for r in runs[0].requests for n in r.tokens_per_round)


@pytest.mark.parametrize(
    "family,draft_sampling",
    [
        ("dflash", "greedy"),
        ("dflash", "probabilistic"),
        ("dflash2", "probabilistic"),
        ("eagle3", "probabilistic"),
        ("mtp", "probabilistic"),
    ],
)
def test_rounds_equal_an_independent_processor_and_the_kernel(
    family, draft_sampling, trained_drafter, eagle3_drafter, tmp_path
):
    """Every round: the target distribution the kernel got equals vLLM's processing (written here) of
    a plain transformers forward over committed tokens + drafts, with the drafts before each row in
    the penalty history; the kernel on the recorded noise and that distribution emits what the loop
    committed; probabilistic q rows are distributions that can draw the drafted token."""
    ckpt = _checkpoint(family, trained_drafter, eagle3_drafter, tmp_path)
    session = open_online(ckpt, MODEL, "fp32", OnlineOptions(overrides={}))
    target = session.target
    prompts = _prompts(target, 1)
    s = SamplingSetting(
        temperature=0.05, top_p=0.9, top_k=8, min_p=0.02, presence_penalty=1.5, frequency_penalty=0.3,
        repetition_penalty=1.2, seed=11,
    )  # fmt: skip
    records = []
    settings = DecodeSettings(s, draft_sampling, 8, 4096)
    (run,) = decode_runs(target, session.layer_ids, session.propose, prompts, settings, [0], records.append)
    prompt = prompts[0][1]
    assert records and len(records) == len(run.requests[0].tokens_per_round)
    for n, rec in enumerate(records):
        ids, drafts = list(rec.token_ids), rec.drafts.tolist()
        p = len(ids) - 1
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + drafts])).logits[0, p:].float()
        expected = torch.stack(
            [
                _vllm_processed(logits[j], prompt, ids[len(prompt) :] + drafts[:j], s)
                for j in range(len(drafts) + 1)
            ]
        )
        # fp32 logits from two forwards agree to ~1e-6; /T = 0.05 scales that by 20 inside the softmax
        torch.testing.assert_close(rec.target_probs.double(), expected, atol=1e-4, rtol=0)
        assert (rec.target_probs > 0).sum(-1).max() <= s.top_k
        q = rec.draft_probs
        if draft_sampling == "greedy":
            assert q is None
            # spec 4.1 B: given the emitted tokens the round is deterministic, the matched prefix of the
            # drafts (the recovered token never equals the rejected draft): what the offline replay counts
            acc = int(rec.verified.accepted[0])
            assert rec.verified.emitted(0)[:acc] == drafts[:acc]
            assert acc == len(drafts) or rec.verified.emitted(0)[acc] != drafts[acc]
        else:
            torch.testing.assert_close(q.double().sum(-1), torch.ones(len(drafts), dtype=torch.float64))
            assert bool((q[torch.arange(len(drafts)), rec.drafts] > 0).all())
            if family == "dflash2":  # the selector walk samples among its top-k candidates only
                assert int((q > 0).sum(-1).max()) <= 16  # init_from_dflash's selector_top_k
        again = mrv2_verify(expected[None], rec.drafts[None], rec.noise, None if q is None else q[None])
        assert again.emitted(0) == rec.verified.emitted(0)
        following = (
            list(records[n + 1].token_ids) if n + 1 < len(records) else list(run.requests[0].token_ids)
        )
        emitted = rec.verified.emitted(0)
        assert following[len(ids) :] == emitted[: len(following) - len(ids)]


def test_proposers_draw_hook_with_argmax_equals_their_greedy_drafts(
    trained_drafter, eagle3_drafter, tmp_path
):
    """A draw that returns the argmax of the logits it is given reproduces each family's own drafts:
    the hook hands over every slot's logits in the target's vocabulary and feeds the drawn token on."""
    for family in ("dflash", "dflash2", "eagle3", "mtp"):
        session = open_online(
            _checkpoint(family, trained_drafter, eagle3_drafter, tmp_path), MODEL, "fp32", OnlineOptions({})
        )
        ((_, prompt),) = _prompts(session.target, 1)
        from hscache.capture.forward import capture_batch

        hidden = capture_batch(session.target, [prompt], session.layer_ids, 1, False)[0].hidden_states
        p = len(prompt) - 1
        seen: list[int] = []

        def argmax(logits, seen=seen):
            seen.append(logits.shape[-1])
            return int(logits.argmax())

        with torch.no_grad():
            assert session.propose(hidden[:p], prompt, p, draw=argmax) == session.propose(
                hidden[:p], prompt, p
            )
        assert seen and set(seen) == {session.target.vocab_size}


def test_emitted_tokens_follow_the_processed_target_distribution():
    """Lossless: whatever the drafts, the token a round emits is distributed as the processed p of its
    position. One round after a 5-token prompt, 400 runs, both drafting rules, against p computed here
    (the presence penalty applied to the first generated token); also the first token against p0."""
    target = load_target("builtin:tiny-qwen3", "fp32")  # attention only: short batched forwards are cheap
    prompt = [11, 12, 13, 14, 15]
    # T 1: at T 0.1 (until 2026-12-04) a longer-trained target's top 4 collapse to one token, and
    # neither the chi-square tests nor the other-seed check below have anything to see
    s = SamplingSetting(temperature=1.0, top_k=4, presence_penalty=1.5, seed=21)
    with torch.no_grad():
        p0 = _vllm_processed(target.model(torch.tensor([prompt])).logits[0, -1], prompt, [], s)
        support = p0.nonzero()[:, 0].tolist()
        batch = torch.tensor([prompt + [x] for x in support])
        p1 = {
            x: _vllm_processed(row, prompt, [x], s)
            for x, row in zip(support, target.model(batch).logits[:, -1])
        }

    def onehot(hidden, ids, p, draw=None):
        best = int(p1[ids[p]].argmax())
        return [best, best]

    def probabilistic(hidden, ids, p, draw=None):
        ranked = p1[ids[p]].argsort(descending=True).tolist()
        logits = torch.full((target.vocab_size,), -torch.inf)
        for token, q in zip((ranked[0], ranked[1], ranked[-1]), (0.5, 0.3, 0.2)):  # ranked[-1]: p = 0
            logits[token] = s.temperature * np.log(q)
        return [draw(logits), draw(logits)]

    for rule, propose in (("greedy", onehot), ("probabilistic", probabilistic)):
        settings = DecodeSettings(s, rule, max_new_tokens=2, max_length=64, lanes_per_forward=200)
        runs = decode_runs(target, [1], propose, [("p", prompt)], settings, range(400))
        first = np.array([r.requests[0].token_ids[5] for r in runs])
        second = np.array([r.requests[0].token_ids[6] for r in runs])
        assert chi_square_pvalue(np.bincount(first, minlength=target.vocab_size), p0.numpy()) > 1e-3
        stat, df = 0.0, 0
        for x in support:
            got = second[first == x]
            if len(got) == 0:
                continue
            expected = p1[x].numpy() * len(got)
            counts = np.bincount(got, minlength=target.vocab_size)
            assert counts[expected == 0].sum() == 0, f"{rule}: a token outside the processed support"
            live = expected > 0
            stat += float((((counts - expected) ** 2)[live] / expected[live]).sum())
            df += int(live.sum()) - 1
        pvalue = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
        assert pvalue > 1e-3, (rule, stat, df)
        # The same seed gives the same runs, whatever else is batched with them; another seed differs.
        again = decode_runs(
            target, [1], propose, [("p", prompt)], replace(settings, lanes_per_forward=3), [7, 8, 9]
        )
        assert [r.requests for r in again] == [r.requests for r in runs[7:10]]
        other = replace(settings, sampling=replace(s, seed=22))
        moved = decode_runs(target, [1], propose, [("p", prompt)], other, range(10))
        assert [r.requests for r in moved] != [r.requests for r in runs[:10]]


def test_summary_over_runs_is_the_mean_its_standard_error_and_a_bootstrap_interval():
    from scorer.online.greedy import OnlineRequest

    runs = [
        RunResult(i, (OnlineRequest("a", 3, (1, 2, 3, 4), rounds),))
        for i, rounds in enumerate([(1, 2), (3,), (1, 1, 1), (2, 2)])
    ]
    taus = np.array([1.5, 3.0, 1.0, 2.0])
    summary = summarise_runs(runs, n_boot=200, seed=4)
    assert [r.tau for r in runs] == taus.tolist()
    assert summary["mean"] == pytest.approx(taus.mean(), abs=1e-15)
    assert summary["se"] == pytest.approx(taus.std(ddof=1) / 2, abs=1e-15)
    assert summary["pooled"] == pytest.approx(13 / 8, abs=1e-15)  # tokens 3 + 3 + 3 + 4 over 8 rounds
    # the ratio estimator's delta-method SE, written out: sqrt(sum (T_i - r R_i)^2 / (n (n-1))) / mean R
    tokens, rounds = np.array([3, 3, 3, 4]), np.array([2, 1, 3, 2])
    expected_se = np.sqrt(((tokens - 13 / 8 * rounds) ** 2).sum() / 12) / rounds.mean()
    assert summary["pooled_se"] == pytest.approx(expected_se, abs=1e-15)
    plo, phi = summary["pooled_interval"]
    assert plo <= summary["pooled"] <= phi
    lo, hi = summary["interval"]
    assert taus.min() <= lo <= taus.mean() <= hi <= taus.max()
    assert summarise_runs(runs[:1])["se"] is None


@pytest.mark.parametrize(
    "args,message",
    [
        (["--runs", "4"], "--runs applies to sampled decoding only"),
        (["--draft-sampling", "probabilistic"], "--draft-sampling applies to sampled decoding only"),
        (["--seed", "3"], "--seed 3 does nothing at temperature 0"),
        (["--temperature", "0.7", "--top-k", "0"], "--top-k 0 must be -1"),
        (["--temperature", "0.7"], "pass --top-k K"),
        (
            ["--temperature", "0.7", "--top-k", "5", "--runs", "0"],
            "'--runs': 0 is not in the range x>=1",
        ),
        (["--sampling", "qwen-thinking", "--draft-sampling", "sometimes"], "'--draft-sampling': 'sometimes'"),
        (["--sampling", "hot"], "--sampling 'hot' is not a preset"),
        (["--tree", "2,2,4"], "--tree: scorer online verifies SGLang's tree at temperature > 0"),
        (
            ["--ddtree", "4"],
            "--ddtree: scorer online verifies DDTree by SGLang's tree rule at temperature > 0",
        ),
        (
            ["--temperature", "0.7", "--top-k", "5", "--ddtree", "0"],
            "'--ddtree': 0 is not in the range",
        ),
        (
            ["--temperature", "0.7", "--top-k", "5", "--ddtree", "4", "--tree", "2,2,4"],
            "--tree is SGLang's EAGLE tree (EAGLE-3, MTP) and --ddtree DFlash's DDTree: pass one of them",
        ),
        (
            [
                "--temperature",
                "0.7",
                "--top-k",
                "5",
                "--ddtree",
                "4",
                "--draft-sampling",
                "probabilistic",
            ],
            "--draft-sampling probabilistic with --ddtree: no engine verifies a tree with probabilistic drafts",
        ),
        (
            [
                "--temperature",
                "0.7",
                "--top-k",
                "5",
                "--tree",
                "2,2,4",
                "--draft-sampling",
                "probabilistic",
            ],
            "no engine verifies a tree with probabilistic drafts",
        ),
        (
            ["--temperature", "0.7", "--top-k", "5", "--tree", "2,2,4", "--repetition-penalty", "1.2"],
            "--repetition-penalty 1.2 is not part of it",
        ),
        (
            ["--temperature", "0.7", "--top-k", "5", "--ddtree", "4", "--min-p", "0.1"],
            "--ddtree runs SGLang's rule, and --min-p 0.1 is not transcribed",
        ),
    ],
)
def test_bad_sampling_flags_are_one_line_exit_2(args, message, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "online.json"
    result = CliRunner().invoke(main, ["online", "target:mtp", "--json", str(out), *args])
    assert result.exit_code == 2, result.output
    # One error line: ours alone, or click's usage error (its usage lines, then the error) for a value
    # outside a flag's declared range or choices.
    lines = result.output.strip().splitlines()
    last = lines[-1]
    ours = len(lines) == 1 and last.startswith("error: ")
    assert (ours or last.startswith("Error: Invalid value")) and message in last, result.output
    assert not out.exists()


def test_cli_sampled_run_writes_a_valid_report(trained_drafter, tmp_path):
    from click.testing import CliRunner

    from scorer.cli import main

    out = tmp_path / "online.json"
    args = [
        "online",
        str(trained_drafter),
        "--sampling",
        "qwen-thinking-coding",
        "--seed",
        "9",
        "--runs",
        "3",
    ]
    result = CliRunner().invoke(main, [*args, "--limit", "1", "--max-new-tokens", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    sampled = document["sampled"]
    assert sampled["seed"] == 9 and sampled["runs"] == 3 and len(sampled["per_run"]) == 3
    assert sampled["rule"]["name"] == "vllm-mrv2" and sampled["rule"]["draft_sampling"] == "greedy"
    assert sampled["rule"]["penalties"] == "vllm-in-round"
    assert (
        sampled["sampling"]["temperature"] == 0.6 and sampled["sampling"]["preset"] == "qwen-thinking-coding"
    )
    taus = [r["tau"] for r in sampled["per_run"]]
    assert sampled["tau"]["mean"] == pytest.approx(np.mean(taus), abs=1e-12)
    assert f"mean over 3 runs {np.mean(taus):.4f}" in result.output
    assert f"pooled {sampled['tau']['pooled']:.4f}" in result.output
    with pytest.raises(schemas.SchemaError):
        schemas.validate({**document, "sampled": {**sampled, "runs": 0}}, "online_report")


def test_sampled_online_reports_progress_while_it_decodes(trained_drafter):
    """Issue 35.6: `scorer online --sampling qwen-instruct --runs 64` printed nothing for 15 minutes.
    Every lockstep step now reports the tokens committed, out of every lane's budget."""
    import io
    import re

    from hscache.progress import StepProgress
    from scorer.online.greedy import OnlineConfig
    from scorer.online.sampled import SampledOnlineConfig, run_online_sampled

    stream = io.StringIO()
    setting = SamplingSetting.from_flags("qwen-instruct", seed=3)
    config = SampledOnlineConfig(
        str(trained_drafter), setting, 2, online=OnlineConfig(limit=1, max_new_tokens=6)
    )
    with StepProgress("online", "tokens", every_s=0, stream=stream, terminal=False) as progress:
        document = run_online_sampled(config, progress=progress)
    lines = stream.getvalue().splitlines()
    assert (
        lines[0] == "online: 12 tokens (2 runs x 1 prompts decoded in lockstep, 64 lanes per target forward)"
    ), lines
    assert lines[1].startswith("online: 2/12 tokens") and "prefill" in lines[1], lines
    pattern = r"online: (\d+)/12 tokens, .* (\d)/2 sequences done, tau so far"
    steps = [re.match(pattern, line) for line in lines[2:]]
    assert len(steps) >= 2 and all(steps), lines
    generated = sum(r["generated"] for r in document["per_request"])
    assert int(steps[-1].group(1)) == generated and steps[-1].group(2) == "2", lines
