"""The README's "Judged by vLLM" table: every family vLLM CPU serves, at T 0 and at a seeded T 0.7, scored
offline and counted by vLLM on the same requests, in ONE vLLM process (scorer.studies.vllm_judge.serve_plans).

Setup: the built-in plain Qwen3 (fp32) and hybrid Qwen3.5 (bf16, vLLM CPU's Gated DeltaNet kernel; its
MTP head), each with a greedy cache and a T 0.7 / top-p 0.9 / top-k 20 cache (seed 5, 2 samples per
prompt); DFlash (block 6, trained on the greedy cache with its last layer raw, as vLLM feeds it) and
EAGLE-3 (layers 1,3,7) drafters; n-gram (K 3, lookup 2-3). Prints per family and setting: pooled tau on
both sides, rounds, requests equal round for round, the report's verdict (a request that parts only
where vLLM's own draft logits tie at the served dtype: "equal except ties") with every differing round
and vLLM's own two best drafts at a request's first difference; then the CPU seconds of the whole run (this process
and the vLLM worker). Needs the vLLM environment (``bash .ci/vllm-env.sh``).

    python bench/judged_families.py [--prompts 6] [--tokens 24] [--dflash-steps 150] [--vllm-python .vllm/bin/python]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> float:
    return sum(
        u.ru_utime + u.ru_stime
        for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def _caches(root: Path, model: str, dtype: str, prompts: int, tokens: int) -> list[Path]:
    import hscache
    from hscache.store.sampling import GREEDY, SamplingSetting

    sampled = SamplingSetting.from_flags(temperature=0.7, top_p=0.9, top_k=20, seed=5, samples_per_prompt=2)
    out = []
    for name, sampling in (("t0", GREEDY), ("t0.7", sampled)):
        path = root / name
        hscache.extract(hscache.ExtractConfig(
            out=str(path), model=model, layers="1,3,7", max_new_tokens=tokens, dtype=dtype, limit=prompts,
            sampling=sampling, mtp=model == "builtin:tiny-qwen3.5",
        ))  # fmt: skip
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--dflash-steps", type=int, default=150)
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm" / "bin" / "python"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from scorer import train_drafter
    from scorer.families.eagle3.train import train_eagle3
    from scorer.studies.vllm_judge import ServedConfig, plan_served, score_served, serve_plans

    t0 = _cpu()
    with tempfile.TemporaryDirectory(prefix="bench-judged-") as tmp:
        root = Path(tmp)
        qwen3 = _caches(root / "qwen3", "builtin:tiny-qwen3", "fp32", args.prompts, args.tokens)
        hybrid = _caches(root / "qwen3.5", "builtin:tiny-qwen3.5", "bf16", args.prompts, args.tokens)
        dflash, eagle3 = root / "dflash", root / "eagle3"
        train_drafter(
            qwen3[0], dflash, steps=args.dflash_steps, block_size=6, log_every=0, last_layer_normed=False
        )
        train_eagle3(qwen3[0], eagle3, steps=25, layer_ids=[1, 3, 7])
        python = args.vllm_python
        ngram = {"num_speculative_tokens": 3, "overrides": {"prompt_lookup_min": 2, "prompt_lookup_max": 3}}
        plans = [
            plan_served(
                [dflash, eagle3, "ngram"], qwen3, root / "served-qwen3",
                [ServedConfig(vllm_python=python), ServedConfig(vllm_python=python),
                 ServedConfig(vllm_python=python, **ngram)],
            ),
            plan_served(["target:mtp"], hybrid, root / "served-hybrid", ServedConfig(vllm_python=python)),
        ]  # fmt: skip
        rows = []
        names = [
            ["DFlash (K 5)", "EAGLE-3 (K 3)", "n-gram (K 3, lookup 2-3)"],
            ["MTP head (K 1, hybrid bf16)"],
        ]
        for plan_rows, plan_names in zip(serve_plans(plans, root), names):
            for name, per_cache in zip(plan_names, plan_rows):
                row = {"drafter": name}
                for setting, served in zip(("t0", "t0.7"), per_cache):
                    report = score_served(served)
                    equal = sum(r["equal"] for r in report["per_request"])
                    row[setting] = (report["tau"]["offline_report"]["pooled"], report["tau"]["vllm"]["pooled"],
                                    report["tau"]["vllm"]["rounds"], equal, len(report["per_request"]))  # fmt: skip
                    row[setting + " differences"] = report["differences"]
                    row[setting + " verdict"] = report["verdict"]
                rows.append(row)
    seconds = _cpu() - t0
    print(
        "| drafter | T 0: offline / vLLM pooled tau (rounds) | T 0.7: offline / vLLM (rounds) | equal requests (T 0, T 0.7) |"
    )
    print("|---|---|---|---|")
    for row in rows:
        (a0, b0, r0, e0, n0), (a7, b7, r7, e7, n7) = row["t0"], row["t0.7"]
        print(
            f"| {row['drafter']} | {a0:.4f} / {b0:.4f} ({r0}) | {a7:.4f} / {b7:.4f} ({r7}) | {e0}/{n0}, {e7}/{n7} |"
        )
    for row in rows:  # the verdict, and every round where the two sides differ with vLLM's own draft there
        for setting in ("t0", "t0.7"):
            print(f"{row['drafter']} {setting}: {row[setting + ' verdict']}")
            for d in row[setting + " differences"]:
                print(f"differs: {row['drafter']} {setting} {d}")
    print(f"whole run: {seconds:.0f} CPU-s (setup, one vLLM process for both targets, scoring)")
    return rows


if __name__ == "__main__":
    main()
