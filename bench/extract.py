"""Extraction benchmark: ratios measured in one run, never absolute times.

Prints:
  1. writer overhead: extract() wall time / a bare forward loop over the same tokens
     (same model, same hooks' worth of work: base forward + lm_head + top-k), target <= 1.15
  2. compression: stored bytes per token / raw bytes per token, per --compression setting
  3. write speed: our store's MB/s / a raw sequential file write of the same bytes

    python bench/extract.py [--sequences 16] [--seq-len 1024] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hscache
from hscache.capture import next_token_stats
from hscache.store.layout import array_specs
from hscache.store.writer import SequenceRows, StoreWriter
from hscache.target import load_target


def _prompts(path: Path, sequences: int, seq_len: int) -> Path:
    gen = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(sequences):
            f.write(json.dumps({"id": i, "input_ids": gen.integers(4, 500, seq_len).tolist()}) + "\n")
    return path


def _bare_forward_s(prompts: Path, layers: list[int], dtype: str) -> float:
    t0 = time.perf_counter()
    target = load_target("builtin:tiny-qwen3.5", dtype)
    lm_head = target.model.get_output_embeddings()
    with torch.no_grad():
        for line in prompts.read_text().splitlines():
            ids = torch.tensor([json.loads(line)["input_ids"]])
            out = target.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            hidden = torch.stack([out.hidden_states[i + 1][0] for i in layers], dim=1)
            next_token_stats(lm_head, out.last_hidden_state[0], 64, False)
            hidden.contiguous()
    return time.perf_counter() - t0


def writer_overhead(tmp: Path, sequences: int, seq_len: int, dtype: str) -> dict:
    prompts = _prompts(tmp / "p.jsonl", sequences, seq_len)
    layers = [1, 3, 5]
    config = hscache.ExtractConfig(out=str(tmp / "c"), prompts=str(prompts), layers="1,3,5", max_new_tokens=0,
                                   dtype=dtype, max_length=seq_len + 1)
    hscache.extract(hscache.ExtractConfig(**{**config.__dict__, "out": str(tmp / "warm"), "limit": 1}))
    bare = _bare_forward_s(prompts, layers, dtype)
    t0 = time.perf_counter()
    hscache.extract(config)
    ours = time.perf_counter() - t0
    return {"tokens": sequences * seq_len, "bare_forward_s": bare, "extract_s": ours,
            "writer_overhead_ratio": ours / bare}


def _hidden_like(tokens: int, layers: int, hidden: int) -> torch.Tensor:
    """bf16 states with per-channel scales and a few massive channels, like real targets."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(hidden, generator=gen))
    scale[:3] *= 50
    x = torch.randn(tokens, layers, hidden, generator=gen) * scale
    return x.to(torch.bfloat16)


def store_speed(tmp: Path, tokens: int, layers: int, hidden: int) -> list[dict]:
    states = _hidden_like(tokens, layers, hidden)
    raw = states.view(torch.int16).numpy().view(np.uint16)
    raw_path = tmp / "raw.bin"
    t0 = time.perf_counter()
    with raw_path.open("wb") as f:
        f.write(raw.tobytes())
        f.flush()
        os.fsync(f.fileno())
    raw_s = time.perf_counter() - t0
    results = []
    for compression in ("none", "fast", "balanced"):
        root = tmp / f"store-{compression}"
        specs = array_specs(layers, hidden, "bfloat16", 8, None, 8 << 20)
        writer = StoreWriter.create(root, specs, compression, {"layer_ids": list(range(layers))})
        seq_len = 1024
        t0 = time.perf_counter()
        for start in range(0, tokens, seq_len):
            n = min(seq_len, tokens - start)
            writer.append(SequenceRows({
                "hidden_states": raw[start:start + n],
                "token_ids": np.zeros(n, np.int32), "target_argmax": np.zeros(n, np.int32),
                "target_topk_values": np.zeros((n, 8), np.float32), "target_topk_ids": np.zeros((n, 8), np.int32),
                "target_logsumexp": np.zeros(n, np.float32)}, str(start), 0, "none", "0" * 64, "{}"))
        writer.finish()
        ours_s = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in (root / "arrays" / "hidden_states").rglob("*") if f.is_file())
        results.append({"compression": compression, "hidden_compression_ratio": raw.nbytes / stored,
                        "write_MBps_ratio_vs_raw_file": (raw_s / ours_s)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--store-tokens", type=int, default=65536)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that the benchmark runs")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.seq_len, args.store_tokens = 2, 128, 4096
    tmp = Path(tempfile.mkdtemp(prefix="hscache-bench-"))
    try:
        overhead = writer_overhead(tmp, args.sequences, args.seq_len, "fp32")
        print(f"writer overhead: extract / bare forward = {overhead['writer_overhead_ratio']:.3f} "
              f"(target <= 1.15) over {overhead['tokens']} tokens")
        for row in store_speed(tmp, args.store_tokens, 5, 1024):
            print(f"store {row['compression']:>8}: hidden states compression x{row['hidden_compression_ratio']:.3f}, "
                  f"write speed {row['write_MBps_ratio_vs_raw_file']:.2f} x raw sequential file")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
