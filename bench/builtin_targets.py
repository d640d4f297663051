"""The trained built-in targets' figures (issue 31), measured in one run on held-out bundled prompts.

1. Peakedness: the median top-1 probability at T = 1 of each target over the tokens of held-out
   text (HumanEval problems with their solutions, MT-Bench first turns and the default prompts, chat
   template applied as extraction does); issue target >= 0.5.
2. No loops: distinct 2-grams / all 2-grams of each 64-token greedy continuation of the held-out
   prompts (mean over prompts); issue target >= 0.5.
3. The README quickstart on builtin:tiny-qwen3.5 (`hscache extract --out cache/`, `scorer init
   drafter/ --cache cache/ --train-steps 300`, `scorer eval drafter/ --cache cache/`): the DFlash
   drafter's greedy tau (issue target 2..6), and `scorer eval target:mtp --cache cache/`: the trained
   MTP head's greedy tau (issue target >= 1.5). The quickstart's default prompts were held out of
   training.

    python bench/builtin_targets.py [--skip-quickstart] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch

from hscache.capture import BUILTIN_TARGETS
from hscache.capture.builtin import build_builtin
from hscache.capture.prompt_sets import (
    DEFAULT_PROMPTS,
    PROMPT_SETS,
    held_out,
    load_prompt_set,
    prompt_set_path,
)
from hscache.capture.prompts import iter_records, prompt_token_ids


def held_out_prompts(tokenizer, limit: int | None) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{set: [(prompt ids, full text ids)]} of the held-out records of every bundled set."""
    out: dict[str, list] = {}
    for name in PROMPT_SETS:
        raw = load_prompt_set(name)
        records = list(iter_records(prompt_set_path(name)))
        rows = []
        for i, (rec, parsed) in enumerate(zip(raw, records)):
            if not held_out(name, i):
                continue
            prompt = prompt_token_ids(parsed, tokenizer)
            text = prompt
            if "canonical_solution" in rec:  # HumanEval: the problem and its solution, as raw text
                text = tokenizer(rec["prompt"] + rec["canonical_solution"], add_special_tokens=False)[
                    "input_ids"
                ]
            rows.append((list(prompt), list(text)))
        out[name] = rows[:limit] if limit else rows
    return out


@torch.no_grad()
def top1_probabilities(model, rows) -> list[float]:
    probs: list[float] = []
    for _, text in rows:
        logits = model(torch.tensor([text])).logits[0, :-1].float()
        probs += logits.softmax(-1).max(-1).values.tolist()
    return probs


@torch.no_grad()
def distinct_2gram_ratios(model, tokenizer, rows, new_tokens: int = 64) -> list[float]:
    ratios = []
    for prompt, _ in rows:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # 64 tokens each, as the issue measures
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
        pairs = list(zip(out, out[1:]))
        ratios.append(len(set(pairs)) / len(pairs))
    return ratios


def _run(cmd: list[str], cwd: Path) -> float:
    t0 = time.time()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return time.time() - t0


def quickstart(work: Path) -> dict[str, float]:
    bindir = Path(sys.executable).parent
    hs, sc = str(bindir / "hscache"), str(bindir / "scorer")
    times = {
        "extract_s": _run([hs, "extract", "--out", "cache/"], work),
        "init_s": _run([sc, "init", "drafter/", "--cache", "cache/", "--train-steps", "300"], work),
        "eval_s": _run([sc, "eval", "drafter/", "--cache", "cache/", "--json", "dflash.json"], work),
    }
    _run([sc, "eval", "target:mtp", "--cache", "cache/", "--json", "mtp.json"], work)
    dflash = json.loads((work / "dflash.json").read_text())
    mtp = json.loads((work / "mtp.json").read_text())
    return {"dflash_tau": dflash["tau"]["pooled"], "mtp_tau": mtp["tau"]["pooled"], **times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-quickstart", action="store_true")
    p.add_argument("--limit", type=int, default=None, help="held-out records per set (default: all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in BUILTIN_TARGETS:
        model, tokenizer = build_builtin(name)
        sets = held_out_prompts(tokenizer, args.limit)
        every_p, every_r = [], []
        for set_name, rows in sets.items():
            probs = top1_probabilities(model, rows)
            ratios = distinct_2gram_ratios(model, tokenizer, rows)
            every_p += probs
            every_r += ratios
            print(
                f"{name} {set_name:>15} ({len(rows)} held-out): median top-1 p {statistics.median(probs):.3f}, "
                f"distinct-2 {statistics.mean(ratios):.3f}"
            )
        print(
            f"{name} all held-out: median top-1 p {statistics.median(every_p):.3f} (target >= 0.5), "
            f"distinct-2 {statistics.mean(every_r):.3f} (target >= 0.5)"
        )
    if not args.skip_quickstart:
        with tempfile.TemporaryDirectory() as tmp:
            q = quickstart(Path(tmp))
        print(
            f"quickstart (builtin:tiny-qwen3.5, {DEFAULT_PROMPTS}): DFlash 300 steps greedy tau "
            f"{q['dflash_tau']:.2f} (target 2..6); MTP head greedy tau {q['mtp_tau']:.2f} (target >= 1.5); "
            f"extract {q['extract_s']:.1f} s, init {q['init_s']:.1f} s, eval {q['eval_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
