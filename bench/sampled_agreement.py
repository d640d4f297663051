"""Offline tau as served equals ``scorer online``'s (issue 25, first "Done when"): every family x rule.

For each family (DFlash, DFlash2, EAGLE-3, the target's MTP head) and each verification rule
(one-hot: argmax drafts, every engine's default at T > 0; probabilistic: drafts ~ softmax(logits / T),
min(1, p/q)), in chain mode:
  offline: ``scorer.studies.tau_as_served.tau_as_served`` on a cache SAMPLED at the setting, several
           trajectories per prompt; SE by the delta method over sample indices (sample s of every
           prompt is one unit, like one online run: the prompts are fixed on both sides);
  online:  ``scorer.online.sampled.decode_runs``, >= 64 runs over the same prompts, the POOLED tau
           (total tokens / total rounds) and its delta-method SE over runs (``summarise_runs``);
  z = (offline - online) / sqrt(SE_off^2 + SE_on^2), and the swapped z: the OTHER rule's offline tau
  against this rule's online runs (|z| > 3 there shows the check tells the rules apart).

Drafters: DFlash (and DFlash2 started from it, NeMo's identity start) and EAGLE-3 trained briefly on
a greedy cache of the same prompts (the tests' recipe), then TEMPERED (``--temper``: DFlash's final
norm, EAGLE-3's lm_head x 0.001, so logits / 1000 with the same argmax and the same one-hot drafts);
MTP: the built-in target's (random) head, as it is.
The setting: T 0.03, top-k 2 on the built-in target, whose distributions are nearly flat (top-1 logit
gaps ~0.05-0.4): at T 0.03 p(greedy token) is ~0.8-1, so sampled trajectories stay long on the greedy
path the drafters learned (one-hot tau well above 1), while the tempered drafters' q = softmax(logits
/ T) is nearly flat over the vocabulary (the probabilistic rule accepts almost nothing): the two rules
differ by many SE. Untempered at a high temperature (``--temper 1 --temperature 3``) acceptance is
rare (tau ~1.03-1.06): there the delta-method SE of a low draw is itself low, and z leans negative.

Tree mode (``--tree STEPS,TOPK,TOKENS``, default 1,3,4; off with ``--tree none``): SGLang's EAGLE tree,
for the families that draft it online (EAGLE-3, MTP), and DFlash's DDTree of ``--ddtree N`` nodes
(default 2; ``scorer online --ddtree``), one-hot rule only (no engine verifies a tree with probabilistic
drafts; DFlash2 drafts its selector's walk, a chain, and has no DDTree). On a second cache
sampled at ``--tree-temperature`` (default 0.01, top-k as above): offline ``tau_as_served(mode="tree")``
against ``decode_runs(..., tree=...)`` (SGLang's target-only rule), and the swapped z: the offline CHAIN
of the tree's depth (K = STEPS, the chain rule) against the same online tree runs. The EAGLE-3 drafter
is the trained one UNTEMPERED (SGLang ranks candidates by cumulative softmax scores: tempering would
flatten them into a breadth-first tree); at T 0.01 its trajectories stay near the greedy path it
learned, where its top-1 is often wrong and its 2nd or 3rd choice right, so the tree differs from the
chain by many SE. DFlash's row: offline ``tau_as_served(mode="ddtree-N")`` against ``decode_runs(...,
ddtree=N)``; the swap is the offline DFlash BLOCK (``mode="chain"``, the block the tree is drafted from),
the drafter the trained one untempered (DDTree ranks prefixes by product probability).

    python bench/sampled_agreement.py [--runs 64] [--samples 64] [--prompts 2] [--new-tokens 12]
        [--temperature 0.03] [--top-k 2] [--temper 0.001] [--seed 11] [--families dflash,dflash2,eagle3,mtp] [--quick]
        [--tree 1,3,4 | none] [--ddtree 2] [--tree-temperature 0.01] [--modes chain,tree]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# bench/scorer.py would shadow the scorer package when this file runs as a script
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np
import torch

import hscache
from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
from hscache.store.sampling import SamplingSetting
from scorer.families.base import OnlineOptions
from scorer.offline.scoring import EvalConfig
from scorer.online.greedy import open_online
from scorer.online.sampled import DecodeSettings, decode_runs, summarise_runs
from scorer.studies.tau_as_served import tau_as_served

FAMILIES = ("dflash", "dflash2", "eagle3", "mtp")
RULES = {"one-hot": "greedy", "probabilistic": "probabilistic"}  # offline rule -> online draft_sampling
MODEL = "builtin:tiny-qwen3.5"
PROMPTS = "builtin:default"


def pooled_with_se(tokens: np.ndarray, rounds: np.ndarray) -> tuple[float, float]:
    """sum tokens / sum rounds over units, and the ratio estimator's delta-method SE (as
    ``summarise_runs``' ``pooled_se``)."""
    tokens, rounds = np.asarray(tokens, np.float64), np.asarray(rounds, np.float64)
    n = len(tokens)
    tau = float(tokens.sum() / rounds.sum())
    residual = tokens - tau * rounds
    return tau, float(np.sqrt((residual**2).sum() / (n * (n - 1))) / rounds.mean())


def z_score(a: tuple[float, float], b: tuple[float, float]) -> float:
    """(a - b) / sqrt(se_a^2 + se_b^2); two exact equal numbers (both SEs 0: a drafter that never
    drafts right) give 0, two exact different ones +-inf."""
    diff, se = a[0] - b[0], float(np.hypot(a[1], b[1]))
    if se > 0:
        return diff / se
    return 0.0 if diff == 0 else float(np.copysign(np.inf, diff))


def offline_tau(
    checkpoint: str, cache: Path, rule: str, mode: str = "chain", config: EvalConfig | None = None
) -> tuple[float, float]:
    """tau as served on the sampled cache (``mode``: chain or tree) and its SE over sample indices."""
    config = config or EvalConfig(ddtree=(), n_boot=50)
    served = tau_as_served(checkpoint, cache, rule=rule, mode=mode, config=config)
    units: dict[int, list[float]] = {}
    for s in served.sequences:
        unit = units.setdefault(s.sample, [0.0, 0.0])
        unit[0] += s.rounds.tokens
        unit[1] += s.rounds.expected_rounds
    tokens, rounds = np.asarray(list(units.values())).T
    tau, se = pooled_with_se(tokens, rounds)
    assert abs(tau - served.tau.tau) < 1e-9, (tau, served.tau.tau)  # the same pooled estimand
    return tau, se


def tempered(checkpoint: Path, out: Path, tensor: str, scale: float) -> Path:
    """A copy of ``checkpoint`` with ``tensor`` (a final norm or lm_head: logits are linear in it) x ``scale``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    weights[tensor] = weights[tensor] * scale
    save_file(weights, out / "model.safetensors")
    return out


def drafters(
    work: Path, prompts: int, quick: bool, scale: float, greedy: Path | None = None
) -> dict[str, str]:
    """The tests' recipe (tests/scorer/conftest.py) on a greedy cache of the same prompts (or
    ``greedy``, one of layers 1,3,7 already built), tempered."""
    from scorer import train_drafter
    from scorer.families.dflash2.init import init_from_dflash
    from scorer.families.eagle3.train import train_eagle3

    # quick: the drafter only has to exist (its logits are tempered x 0.001 anyway), so one (or a given
    # cache's few) sequence trained 10 steps stands in for the recipe's 6 trained 150.
    if greedy is None:
        greedy = work / "greedy"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(greedy),
                layers="1,3,7",
                max_new_tokens=24,
                dtype="fp32",
                limit=prompts if quick else max(prompts, 6),
            )
        )
    train_drafter(greedy, work / "trained-dflash", steps=10 if quick else 150, block_size=6, log_every=0)
    dflash = tempered(work / "trained-dflash", work / "dflash", "norm.weight", scale)
    out = {"dflash": str(dflash), "mtp": "target:mtp"}
    if not quick:
        train_eagle3(greedy, work / "trained-eagle3", steps=25, layer_ids=[1, 3, 7])
        out["eagle3"] = str(tempered(work / "trained-eagle3", work / "eagle3", "lm_head.weight", scale))
        out["eagle3-tree"] = str(work / "trained-eagle3")  # untempered: SGLang's tree scores need its softmax
        out["dflash-tree"] = str(work / "trained-dflash")  # untempered: DDTree ranks by product probability
        out["dflash2"] = str(init_from_dflash(dflash, work / "dflash2", selector_rank=8))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument(
        "--samples", type=int, default=64, help="trajectories per prompt in the offline cache"
    )
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.03)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument(
        "--temper", type=float, default=1e-3, help="scale of the drafters' logits (1: as trained)"
    )
    parser.add_argument("--seed", type=int, default=11, help="the sampled cache's seed (online: seed + 1)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument(
        "--quick", action="store_true", help="DFlash only, tiny sizes (the test suite runs it)"
    )
    parser.add_argument("--tree", default="1,3,4", help="SGLang's EAGLE tree STEPS,TOPK,TOKENS, or none")
    parser.add_argument("--ddtree", type=int, default=2, help="DFlash's DDTree node budget (tree mode)")
    parser.add_argument("--tree-temperature", type=float, default=0.01)
    parser.add_argument("--modes", default="chain,tree", help="chain, tree or both (comma-separated)")
    parser.add_argument(
        "--greedy-cache",
        default=None,
        help="train the drafters on this greedy cache of the built-in target (layers 1,3,7) instead of "
        "extracting one: the test suite passes its session cache",
    )
    args = parser.parse_args(argv)
    if args.greedy_cache and (layers := hscache.open_cache(args.greedy_cache).layer_ids) != [1, 3, 7]:
        parser.error(
            f"--greedy-cache {args.greedy_cache} holds layers {layers}: extract one with --layers 1,3,7"
        )
    if args.quick:
        args.runs, args.samples, args.prompts, args.new_tokens, args.families = 4, 4, 1, 4, "dflash"
    families = args.families.split(",")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more torch threads spin against each other
    work = Path(tempfile.mkdtemp(prefix="hscache-sampled-agreement-"))
    try:
        t0 = time.process_time()
        greedy = Path(args.greedy_cache) if args.greedy_cache else None
        checkpoints = drafters(work, args.prompts, args.quick, args.temper, greedy)
        setting = dict(temperature=args.temperature, top_k=args.top_k, top_p=1.0)
        sampling = SamplingSetting.from_flags(**setting, samples_per_prompt=args.samples, seed=args.seed)
        cache = work / "sampled"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(cache), layers="1,3,7", max_new_tokens=args.new_tokens, dtype="fp32",
                limit=args.prompts, prompts=PROMPTS, sampling=sampling,
            )
        )  # fmt: skip
        online_sampling = SamplingSetting.from_flags(
            **setting, seed=args.seed + 1
        )  # streams unlike the cache's
        print(
            f"setting T {args.temperature} top-k {args.top_k}, drafters' logits x {args.temper:g}, seed {args.seed}, "
            f"{args.prompts} prompts x {args.new_tokens} tokens, "
            f"offline {args.samples} trajectories per prompt, online {args.runs} runs; "
            f"drafters and caches {time.process_time() - t0:.1f} CPU-s"
        )
        print(
            f"{'family':8s} {'rule':13s} {'offline':>15s} {'online':>15s} {'z':>6s} {'swapped z':>9s} {'CPU-s':>6s}"
        )
        for family in families if "chain" in args.modes.split(",") else []:
            session = open_online(checkpoints[family], MODEL, "fp32", OnlineOptions(overrides={}))
            records = list(iter_records(resolve_prompts(PROMPTS)))[: args.prompts]
            prompts = [(r.record_id, prompt_token_ids(r, session.target.tokenizer)) for r in records]
            offline = {rule: offline_tau(checkpoints[family], cache, rule) for rule in RULES}
            for rule, other in (("one-hot", "probabilistic"), ("probabilistic", "one-hot")):
                t0 = time.process_time()
                settings = DecodeSettings(online_sampling, RULES[rule], max_new_tokens=args.new_tokens)
                runs = decode_runs(
                    session.target, session.layer_ids, session.propose, prompts, settings, range(args.runs)
                )
                summary = summarise_runs(runs, n_boot=10)
                on, se_on = summary["pooled"], summary["pooled_se"]
                off, se_off = offline[rule]
                z, swapped = z_score(offline[rule], (on, se_on)), z_score(offline[other], (on, se_on))
                print(
                    f"{family:8s} {rule:13s} {off:7.4f}±{se_off:.4f}  {on:7.4f}±{se_on:.4f} {z:+6.2f} "
                    f"{swapped:+9.2f} {time.process_time() - t0:6.1f}",
                    flush=True,
                )
        if "tree" in args.modes.split(",") and args.tree != "none" and not args.quick:
            tree_rows(args, work, checkpoints, [f for f in families if f in TREE_FAMILIES])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(threads)


# family -> its tree drafter in ``drafters``
TREE_FAMILIES = {"eagle3": "eagle3-tree", "mtp": "mtp", "dflash": "dflash-tree"}


def tree_rows(args: argparse.Namespace, work: Path, checkpoints: dict[str, str], families: list[str]) -> None:
    """SGLang's EAGLE tree (DFlash: DDTree), one-hot: offline tree tau vs the online tree runs; swapped:
    the chain of the tree's depth offline (DFlash: its block)."""
    tree = tuple(int(v) for v in args.tree.split(","))
    setting = dict(temperature=args.tree_temperature, top_k=args.top_k, top_p=1.0)
    cache = work / "sampled-tree"
    t0 = time.process_time()
    hscache.extract(
        hscache.ExtractConfig(
            out=str(cache), layers="1,3,7", max_new_tokens=args.new_tokens, dtype="fp32", limit=args.prompts,
            prompts=PROMPTS,
            sampling=SamplingSetting.from_flags(**setting, samples_per_prompt=args.samples, seed=args.seed),
        )
    )  # fmt: skip
    print(
        f"tree {args.tree} at T {args.tree_temperature} top-k {args.top_k} (drafters untempered), "
        f"cache {time.process_time() - t0:.1f} CPU-s"
    )
    print(
        f"{'family':8s} {'mode':13s} {'offline':>15s} {'online':>15s} {'z':>6s} {'chain z':>9s} {'CPU-s':>6s}"
    )
    online_sampling = SamplingSetting.from_flags(**setting, seed=args.seed + 1)
    for family in families:
        checkpoint = checkpoints[TREE_FAMILIES[family]]
        t0 = time.process_time()
        if family == "dflash":
            label, shape, swap = f"ddtree {args.ddtree}", {"ddtree": args.ddtree}, "block"
            off = offline_tau(checkpoint, cache, "one-hot", f"ddtree-{args.ddtree}")
            chain = offline_tau(checkpoint, cache, "one-hot")
        else:
            label, shape, swap = "tree " + args.tree, {"tree": tree}, f"chain K={tree[0]}"
            off = offline_tau(
                checkpoint, cache, "one-hot", "tree", EvalConfig(ddtree=(), n_boot=50, tree=tree)
            )
            chain = offline_tau(
                checkpoint,
                cache,
                "one-hot",
                config=EvalConfig(ddtree=(), n_boot=50, num_speculative_tokens=tree[0]),
            )
        session = open_online(checkpoint, MODEL, "fp32", OnlineOptions(overrides={}))
        records = list(iter_records(resolve_prompts(PROMPTS)))[: args.prompts]
        prompts = [(r.record_id, prompt_token_ids(r, session.target.tokenizer)) for r in records]
        settings = DecodeSettings(online_sampling, "greedy", max_new_tokens=args.new_tokens, **shape)
        runs = decode_runs(
            session.target, session.layer_ids, session.propose, prompts, settings, range(args.runs)
        )
        summary = summarise_runs(runs, n_boot=10)
        on = (summary["pooled"], summary["pooled_se"])
        print(
            f"{family:8s} {label:13s} {off[0]:7.4f}±{off[1]:.4f}  {on[0]:7.4f}±{on[1]:.4f} "
            f"{z_score(off, on):+6.2f} {z_score(chain, on):+9.2f} {time.process_time() - t0:6.1f}   "
            f"({swap} offline {chain[0]:.4f}±{chain[1]:.4f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
