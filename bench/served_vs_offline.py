"""Judging one more checkpoint: offline (``scorer eval`` on a cache) vs serving it in vLLM on the same
requests (``scorer served``'s engine side: vLLM imported, the engine started, the requests decoded).

Setup (not timed): a greedy cache of the built-in plain Qwen3 target (fp32) and a DFlash drafter trained
briefly on it. Timed, as CPU seconds (user + system, so a busy machine does not inflate them):
  1. offline: ``scorer.studies.evaluate.evaluate`` of the drafter on the cache, in this process (torch and
     the scorer already imported: what one more checkpoint costs);
  2. vLLM: the worker process of ``scorer.studies.vllm_judge.serve`` (the children's CPU time: vLLM's
     import, the engine with the drafter, the requests), and this process's share of ``serve`` (the
     target written as an HF directory, the served cache extracted from vLLM's text).
One run each; the ratio is printed. Needs the vLLM environment (``bash .ci/vllm-env.sh``, or
``--vllm-python PATH``).

``--vocab N`` widens the target's vocabulary to N rows (Qwen3.6's 248,320: the real vocabulary's share of
both sides): the built-in's trained rows first, the added ones N(0, 0.02) from seed 0 (logits far below
the trained rows': the text stays the built-in's), hidden size and layers unchanged.

``--real-dims`` serves bench/real_dims.py's target instead: Qwen3.6-27B's vocabulary (248,320), head dims
and layer pattern (Gated DeltaNet x 3 + full attention, attention head_dim 256, linear key/value head dims
128, untied head), hidden ``--hidden`` (default 512) and 4 layers, random weights from seed 0, bf16 (vLLM
CPU runs Gated DeltaNet in bf16 only); the DFlash drafter is ``scorer init``'s (random weights: training
it at this vocabulary costs minutes a step on CPU), reading layers 0-2 (not the last, which vLLM feeds
raw).

    python bench/served_vs_offline.py [--prompts 8] [--tokens 32] [--vocab 248320 | --real-dims [--hidden 512]]
                                      [--vllm-python .vllm/bin/python]
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


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def wide_target(directory: Path, vocab: int) -> Path:
    """builtin:tiny-qwen3 written as a Hugging Face directory with ``vocab`` embedding rows (tied head)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from hscache.capture.builtin import save_builtin

    save_builtin("builtin:tiny-qwen3", directory)
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]:
        rows = weights[key]
        extra = torch.randn(vocab - rows.shape[0], rows.shape[1], generator=generator) * 0.02
        weights[key] = torch.cat([rows, extra.to(rows.dtype)]).contiguous()
    config["vocab_size"] = vocab
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _real_dims_target(directory: Path, hidden: int) -> Path:
    """bench/real_dims.py's shape-real Qwen3.5 text target (its ``build_target``), saved at ``directory``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_dims", ROOT / "bench" / "real_dims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_target(directory, 248_320, hidden)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=None, help="widen the target's vocabulary to N rows")
    parser.add_argument("--real-dims", action="store_true", help="serve bench/real_dims.py's target")
    parser.add_argument("--hidden", type=int, default=512, help="--real-dims: the target's hidden size")
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm" / "bin" / "python"))
    args = parser.parse_args(argv)
    if args.real_dims and args.vocab:
        parser.error("--vocab widens the built-in target; --real-dims has the real vocabulary already")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import hscache
    from scorer import train_drafter
    from scorer.studies.evaluate import EvalConfig, evaluate
    from scorer.studies.vllm_judge import ServedConfig, score_served, serve

    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        cache, drafter = Path(tmp) / "cache", Path(tmp) / "dflash"
        if args.real_dims:
            target, layers, dtype = str(_real_dims_target(Path(tmp) / "target", args.hidden)), "0,1,2", "bf16"
        elif args.vocab:
            target, layers, dtype = str(wide_target(Path(tmp) / "target", args.vocab)), "1,3,7", "fp32"
        else:
            target, layers, dtype = "builtin:tiny-qwen3", "1,3,7", "fp32"
        hscache.extract(hscache.ExtractConfig(
            out=str(cache), model=target, layers=layers, max_new_tokens=args.tokens,
            dtype=dtype, limit=args.prompts, mtp=False,
        ))  # fmt: skip
        if args.real_dims:
            from scorer import init_drafter

            init_drafter(cache, drafter, block_size=6)
        else:
            train_drafter(cache, drafter, steps=150, block_size=6, log_every=0)
        evaluate(
            drafter, cache, EvalConfig(ddtree=())
        )  # warm: imports and first-call costs are not "one more"

        start = _cpu(resource.RUSAGE_SELF)
        offline = evaluate(drafter, cache, EvalConfig(ddtree=()))
        offline_cpu = _cpu(resource.RUSAGE_SELF) - start

        self0, children0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        served = serve([drafter], [cache], Path(tmp) / "served", ServedConfig(vllm_python=args.vllm_python))[
            0
        ][0]
        vllm_cpu = _cpu(resource.RUSAGE_CHILDREN) - children0
        serve_self = _cpu(resource.RUSAGE_SELF) - self0
        report = score_served(served)

    if args.real_dims:
        what = f"bench/real_dims.py's target (vocabulary 248,320, hidden {args.hidden}, 4 layers) bf16"
    else:
        what = "builtin:tiny-qwen3 fp32" + (f" widened to vocabulary {args.vocab:,}" if args.vocab else "")
    print(f"requests: {args.prompts} prompts x {args.tokens} greedy tokens, {what}, DFlash K 5")
    print(f"tau offline (cache) {offline['tau']['pooled']:.4f}; on vLLM's text: offline "
          f"{report['tau']['offline_report']['pooled']:.4f}, vLLM {report['tau']['vllm']['pooled']:.4f}, "
          f"equal round for round: {report['equal']}")  # fmt: skip
    print(f"offline scorer eval, one more checkpoint: {offline_cpu:.2f} CPU-s")
    print(f"vLLM {report['vllm']['version']} process (import + engine start + requests): {vllm_cpu:.2f} CPU-s "
          f"(+ {serve_self:.2f} CPU-s here: target written, served cache extracted)")  # fmt: skip
    print(f"served in vLLM / offline CPU-s ratio: {vllm_cpu / offline_cpu:.1f}x "
          f"(with this process's share: {(vllm_cpu + serve_self) / offline_cpu:.1f}x)")  # fmt: skip
    return {"offline_cpu": offline_cpu, "vllm_cpu": vllm_cpu, "serve_self_cpu": serve_self}


if __name__ == "__main__":
    main()
