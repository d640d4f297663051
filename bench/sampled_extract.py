"""Sampled extraction against greedy on the same prompts: ratios measured in one run.

Prints:
  1. extract time sampled / greedy (Qwen's thinking preset, 1 sample a prompt, the same prompts and
     token budget; model load excluded; runs interleaved, best of --repeats): generation draws each
     token through the processor, and the capture forward computes the processed distribution;
  2. the capture head at the real vocabulary (V = 248,320): next_token_stats' row chunk with the
     processor observing it / without (what a sampled cache adds per teacher-forced row).

    python bench/sampled_extract.py [--prompts 8] [--new-tokens 32] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import hscache
from hscache.capture.forward import next_token_stats
from hscache.capture.logit_rows import head_rows
from hscache.capture.sampling import SupportBuilder
from hscache.store.sampling import SamplingSetting


class _Timer:
    """Progress hooks: the time from the first batch to the last (model load excluded)."""

    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None:
        self.t0 = time.perf_counter()

    def advance(self, sequences: int, tokens: int) -> None:
        self.t1 = time.perf_counter()

    def finish(self) -> None:
        self.t1 = time.perf_counter()


def _extract_s(out: Path, sampling: SamplingSetting, args: argparse.Namespace) -> float:
    shutil.rmtree(out, ignore_errors=True)
    config = hscache.ExtractConfig(
        out=str(out), model=args.model, device=args.device, dtype="auto", layers="1,3", mtp=False,
        max_new_tokens=args.new_tokens, limit=args.prompts, sampling=sampling,
    )  # fmt: skip
    timer = _Timer()
    hscache.extract(config, timer)
    return timer.t1 - timer.t0


def _head_s(rows: int, vocab: int, hidden: int, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of one head chunk without and with the processor, interleaved."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="meta")  # no default init of V x H weights
    head.weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen) * 0.02)
    final = torch.randn(rows, hidden, generator=gen)
    tokens = torch.randint(0, vocab, (rows + 1,), generator=gen)
    setting = SamplingSetting.from_flags("qwen-thinking")
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for _ in range(repeats):
            for sampled in (False, True):
                builder = SupportBuilder(setting, tokens, 1, "bench") if sampled else None
                t0 = time.perf_counter()
                next_token_stats(head, final, 64, False, head_rows(vocab, 2.0), builder)
                best[sampled] = min(best[sampled], time.perf_counter() - t0)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny-qwen3.5")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--head-rows", type=int, default=624, help="rows of one head chunk (624: V = 248,320, 2 GB)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite runs it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.head_rows = 2, 6, 1, 48
    sampling = SamplingSetting.from_flags("qwen-thinking", seed=0)
    work = Path(tempfile.mkdtemp(prefix="hscache-sampled-bench-"))
    try:
        greedy, sampled = float("inf"), float("inf")
        for _ in range(args.repeats):  # interleaved: a shared machine's load moves both alike
            greedy = min(greedy, _extract_s(work / "greedy", hscache.SamplingSetting(), args))
            sampled = min(sampled, _extract_s(work / "sampled", sampling, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"extract sampled / greedy = {sampled / greedy:.2f} ({args.prompts} prompts x {args.new_tokens} tokens, "
        f"{args.model} on {args.device}; {sampled:.2f} s / {greedy:.2f} s, best of {args.repeats})"
    )
    # quick: a 16k vocabulary; the real 248,320 x 64 head took ~1 CPU-s to draw and run twice.
    hidden, vocab = (64, 16_384) if args.quick else (256, 248_320)
    plain, with_processor = _head_s(args.head_rows, vocab, hidden, max(args.repeats, 2))
    print(
        f"capture head with the processor / without = {with_processor / plain:.2f} ({args.head_rows} rows x "
        f"H {hidden} x V {vocab:,}; {with_processor * 1e3:.0f} ms / {plain * 1e3:.0f} ms)"
    )


if __name__ == "__main__":
    main()
