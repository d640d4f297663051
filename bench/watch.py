"""scorer watch: what scoring a checkpoint costs beside training, and when a planted training bug shows.

1. Cost: CPU-s of scoring one checkpoint on an eval cache of ``--eval-prompts`` prompts at the watch's
   defaults (``scorer.watch.run.WatchConfig().eval``: DDTree-8, every anchor) against one step of the
   project's DFlash trainer (scorer/families/dflash/train.py at its defaults: 64 anchors per step),
   and the overhead of scoring every checkpoint when one is saved every ``--save-every`` steps.
2. The gap: the same trainer, clean and with each planted bug, scored every ``--eval-every`` steps
   in memory on the held-out eval cache (``scorer.evaluate_module``: scorer eval's values); printed,
   per plant, the first step at which its pooled tau is below the clean run's 95% interval. The
   plants are the issue's three bugs as far as this trainer can carry them without a change to it
   (each plants by wrapping the batch the trainer draws, or by one of its settings):
   - ``noise``: Gaussian noise (``--noise`` x each feature's RMS) on the target features the drafter
     trains on, never on what it is served (the bug: noise on the hidden states before the target's
     last layer was taken);
   - ``shortcut``: the drafter's context rows carry the states of positions p .. p + B - 2, the ones
     whose last layer produced the block's loss targets (the bug: fc fed the layer that made the
     target); serving feeds the true rows;
   - ``gamma10``: the slot decay gamma 10 of the bug's loss, not block / 2 (its soft-KL part needs
     the target's distribution in the loss, which this trainer does not compute).

Train cache: HumanEval's odd records; eval cache: its even records (held out). Every run trains with
``prompt_anchors`` (the families recipe's setting: the drafter then reads its anchor token). CPU seconds of
this process (``resource.getrusage``); the machine is shared, so the ratio is what to read.

    python bench/watch.py [--train-prompts 96] [--eval-prompts 64] [--tokens 48] [--steps 600]
                          [--eval-every 50] [--save-every 500] [--svg docs/watch_planted.svg] [--json F] [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

PLANTS = ("clean", "noise", "shortcut", "gamma10")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _extract(out: Path, prompts: str, limit: int, tokens: int) -> str:
    import hscache

    out.parent.mkdir(parents=True, exist_ok=True)
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), prompts=prompts, layers="1,3,7", max_new_tokens=tokens, dtype="fp32", limit=limit
        )
    )
    return str(out)


def _split_humaneval(root: Path) -> tuple[str, str]:
    """HumanEval's odd records (to train on) and even records (to score on), as two prompt files."""
    import json

    from hscache.capture.prompt_sets import load_prompt_set

    records = load_prompt_set("humaneval")
    paths = (root / "train.jsonl", root / "eval.jsonl")
    for path, part in zip(paths, (records[1::2], records[0::2])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return str(paths[0]), str(paths[1])


def _planted_batches(plant: str, noise: float):
    """A wrapper of train.py's ``training_batch`` that plants ``plant`` in what the drafter trains on."""
    import torch

    from scorer.families.dflash import train as dflash_train

    real = dflash_train.training_batch
    own = torch.Generator().manual_seed(1)  # the plant's draws leave the trainer's own untouched

    def batch(data, rows, index, drafter, anchors_per_step, gen, memo, prompt_anchors=False):
        features, anchors, blocks, targets = real(
            data, rows, index, drafter, anchors_per_step, gen, memo, prompt_anchors
        )
        if plant == "noise":
            rms = features.pow(2).mean(0, keepdim=True).sqrt()
            features = features + noise * rms * torch.randn(features.shape, generator=own)
        elif plant == "shortcut":  # row t carries position t + B - 1: the states behind the targets
            shift = drafter.config.block_size - 1
            features = torch.cat([features[shift:], features[-1:].expand(shift, -1)])
        return features, anchors, blocks, targets

    return real, batch


def train_run(plant: str, train_cache: str, eval_view, out: Path, args) -> list[tuple[int, dict]]:
    """One training run with ``plant``: [(step, tau block of the eval report)] every ``--eval-every`` steps."""
    from scorer.families import family_named
    from scorer.families.dflash import train as dflash_train
    from scorer.studies.evaluate import EvalConfig, evaluate_module

    eval_config = EvalConfig(ddtree=(), anchors="chain", n_boot=args.n_boot)
    history: list[tuple[int, dict]] = []

    def scored(drafter, _cache, limit=None):  # the trainer's eval hook, on the held-out cache
        return evaluate_module(drafter, eval_view, eval_config=eval_config)

    real, planted = _planted_batches(plant, args.noise)
    dflash_train.training_batch = planted
    try:
        family_named("dflash").train(
            train_cache,
            out,
            steps=args.steps,
            seed=args.seed,
            eval_every=args.eval_every,
            evaluate=scored,
            on_eval=lambda step, report: history.append((step, report["tau"])),
            log_every=0,
            prompt_anchors=True,
            **({"loss_decay_gamma": 10.0} if plant == "gamma10" else {}),
        )
    finally:
        dflash_train.training_batch = real
    return history


def first_visible_step(clean: list[tuple[int, dict]], planted: list[tuple[int, dict]]) -> int | None:
    """The first step where the planted run's pooled tau lies below the clean run's 95% interval."""
    for (step, ref), (_, tau) in zip(clean, planted):
        if ref["pooled_ci95"] and tau["pooled"] is not None and tau["pooled"] < ref["pooled_ci95"][0]:
            return step
    return None


def cost(train_cache: str, eval_cache: str, root: Path, args) -> dict[str, float]:
    """CPU-s of one training step and of scoring one checkpoint at the watch's defaults."""
    from scorer import train_drafter
    from scorer.studies.evaluate import evaluate
    from scorer.watch.run import WatchConfig

    few, many = 2, 2 + args.cost_steps
    c0 = _cpu()
    train_drafter(train_cache, root / "cost_few", steps=few, log_every=0)
    c1 = _cpu()
    train_drafter(train_cache, root / "cost_many", steps=many, log_every=0)
    c2 = _cpu()
    step_s = ((c2 - c1) - (c1 - c0)) / (many - few)  # the set-up cancels
    evaluate(root / "cost_many", eval_cache, WatchConfig().eval)  # warm: the first call imports
    c3 = _cpu()
    evaluate(root / "cost_many", eval_cache, WatchConfig().eval)
    score_s = _cpu() - c3
    return {"step_s": step_s, "score_s": score_s}


def _svg(runs: dict[str, list[tuple[int, dict]]], path: Path) -> None:
    from hscache.report.svg import Series, line_chart

    steps = [str(s) for s, _ in runs["clean"]]
    colors = {"clean": "#08519c", "noise": "#e6550d", "shortcut": "#31a354", "gamma10": "#756bb1"}
    series = {
        name: Series(
            [t["pooled"] for _, t in history],
            colors[name],
            dashed=name != "clean",
            band=[tuple(t["pooled_ci95"]) for _, t in history] if name == "clean" else None,
        )
        for name, history in runs.items()
    }
    path.write_text(
        line_chart(
            steps,
            series,
            title="Held-out tau (pooled) while training: clean (95% band) and each planted bug",
            y_label="tau",
            x_label="training step",
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-cache", help="a cache to train on (default: HumanEval, built here)")
    parser.add_argument("--eval-cache", help="a cache to score on (default: MT-Bench, built here)")
    parser.add_argument("--train-prompts", type=int, default=96)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt of both caches")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=500, help="checkpoint interval for the overhead")
    parser.add_argument("--cost-steps", type=int, default=40, help="training steps timed for the cost")
    parser.add_argument("--noise", type=float, default=1.0, help="noise plant: std as a multiple of RMS")
    parser.add_argument("--n-boot", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--svg", help="write the planted-bug figure here")
    parser.add_argument("--json", help="write the cost, every run's tau by step and the visible steps here")
    parser.add_argument("--quick", action="store_true", help="tiny: 4 steps, eval every 2, no figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.cost_steps, args.n_boot = 4, 2, 2, 50
    import torch

    import hscache

    torch.set_num_threads(1)  # the tiny models: a second thread only waits on a shared machine
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train_cache = args.train_cache or _extract(
            root / "train", "humaneval", args.train_prompts, args.tokens
        )
        eval_cache = args.eval_cache or _extract(root / "eval", "mt-bench", args.eval_prompts, args.tokens)
        view = hscache.open_cache(eval_cache)
        spent = cost(train_cache, eval_cache, root, args)
        ratio = spent["score_s"] / spent["step_s"]
        print(f"eval cache: {len(view)} prompts, {view.num_tokens} tokens")
        print(
            f"one training step: {spent['step_s'] * 1000:.1f} CPU-ms; scoring one checkpoint: {spent['score_s']:.2f} CPU-s"
        )
        print(f"score one checkpoint / one training step: {ratio:.0f}")
        print(f"overhead at a checkpoint every {args.save_every} steps: {100 * ratio / args.save_every:.1f}%")
        runs = {plant: train_run(plant, train_cache, view, root / plant, args) for plant in PLANTS}
    for plant in PLANTS:
        taus = " ".join(f"{t['pooled']:.3f}" for _, t in runs[plant])
        print(f"{plant:>9}: tau pooled by step {taus}")
    visible = {plant: first_visible_step(runs["clean"], runs[plant]) for plant in PLANTS[1:]}
    for plant, step in visible.items():
        print(
            f"{plant} visible at step: {step if step is not None else 'never'} (below the clean run's 95% interval)"
        )
    result = {"cost": spent, "ratio": ratio, "runs": runs, "visible": visible}
    if args.svg and not args.quick:
        _svg(runs, Path(args.svg))
        print(f"wrote {args.svg}")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
