"""Compact states (``--states fp8``, issue 50) measured: bytes, the training read, and the drift on tau.

Three parts, each in one run (``--parts bytes,read,families``):

  bytes     bytes per token at Qwen3.6-27B's drafter dimensions (hidden 5120, 4 stored layers, the last
            one of a 64-layer target among them), from files the code writes: hscache fp32/bf16 with codec
            none and balanced, each converted to fp8 (``convert_states``), and the peers' formats written
            by ``hscache export`` from the bf16 cache: speculators (bf16, and fp8 as hs-connectors writes
            it) and SpecForge (4 non-last layers: the layers it stores). Synthetic bf16 states with
            per-channel scales, a few massive channels and attention-sink tokens; 8 x 512 tokens.
            Every array's bytes on disk / tokens (the next-token data included, the exact slice apart).
  read      the training read, ``PackedWindows`` (one window per sequence, no shuffle, in-process) over
            the bf16 codec-none cache and its fp8 copy, dequantised to bf16 on the CPU and as stored
            (``dequantise=False``: fp8 + scales, for a device to dequantise), warm and cold, the median of
            ``--repeats`` interleaved: the ratio to none of the bf16 states' bytes delivered per second.
  families  the built-in trained target and the README's families recipe (a HumanEval training
            cache, an 8-prompt scoring cache, DFlash 600 steps with --prompt-anchors, EAGLE-3 1000
            steps, the target's MTP head): the scoring cache converted to fp8 with every sequence in
            its exact slice, each family scored on it (``scorer eval``'s exact-slice report: the paired
            delta tau fp8 - exact, 95% bootstrap interval); and a DFlash drafter trained on an fp8
            copy of the training cache against the one trained on the source, both scored on the
            source scoring cache (tau with intervals, the paired delta).

    python bench/compact_states.py [--work DIR] [--parts bytes,read,families] [--repeats 3] [--json F]

``--work`` keeps the families' caches and drafters between runs (skipped when present).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as `python bench/compact_states.py`, bench/ is sys.path[0], and bench/scorer.py would shadow the
# scorer package: import the packages, never the sibling scripts.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import torch

from hscache.data import PackedWindows
from hscache.interop.specforge import export_specforge
from hscache.interop.speculators import export_speculators
from hscache.store.chunks import VERIFIED
from hscache.store.compact_convert import convert_states
from hscache.store.fsio import drop_page_cache
from hscache.store.layout import TARGET_DIR, array_specs
from hscache.store.writer import SequenceRows, StoreWriter

HIDDEN, LAYERS, TOTAL_LAYERS = 5120, 4, 64


def _states(rng: np.random.Generator, length: int, scale: np.ndarray) -> np.ndarray:
    """bf16 bits [T, K, H]: normal x per-channel scales (massive channels), token 0 an attention sink."""
    values = rng.standard_normal((length, LAYERS, HIDDEN), dtype=np.float32) * scale
    values[0] *= 40.0  # sink token: values past e4m3's 448 (a plain cast saturates them)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def write_cache(out: Path, dtype: str, codec: str, layer_ids: list[int], sequences: int, length: int) -> None:
    """A cache through ``StoreWriter`` with 64 top-k ids (the 524 B/token of next-token data)."""
    rng = np.random.default_rng(0)
    scale = np.exp(rng.normal(0.0, 0.7, (LAYERS, HIDDEN))).astype(np.float32)
    scale[:, rng.choice(HIDDEN, HIDDEN // 1000, replace=False)] *= 60.0
    (out / TARGET_DIR).mkdir(parents=True)
    (out / TARGET_DIR / "config.json").write_text(json.dumps({"num_hidden_layers": TOTAL_LAYERS}))
    specs = array_specs(LAYERS, HIDDEN, dtype, 64, None, 8 << 20, max_tokens=sequences * length)
    writer = StoreWriter.create(out, specs, codec, {"layer_ids": layer_ids})
    for i in range(sequences):
        bits = _states(rng, length, scale)
        states = bits if dtype == "bfloat16" else (bits.astype(np.uint32) << 16).view(np.float32)
        tokens = rng.integers(0, 248_320, length, dtype=np.int32)
        arrays = {
            "hidden_states": states,
            "token_ids": tokens,
            "target_argmax": tokens,
            "target_topk_values": rng.standard_normal((length, 64), dtype=np.float32),
            "target_topk_ids": rng.integers(0, 248_320, (length, 64), dtype=np.int32),
            "target_logsumexp": rng.standard_normal(length, dtype=np.float32),
        }
        digest = hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
        writer.append(SequenceRows(arrays, f"s{i}", length // 4, "length", digest, "{}"))
    writer.finish()


def _bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for root in paths for p in Path(root).rglob("*") if p.is_file())


def part_bytes(tmp: Path, sequences: int, length: int) -> dict:
    tokens = sequences * length
    last, no_last = [15, 31, 47, 63], [15, 31, 47, 62]
    rows: dict[str, dict] = {}

    def cache_row(name: str, root: Path, states_only: list[str]) -> None:
        arrays = _bytes([root / "arrays"])
        states = _bytes([root / "arrays" / a for a in states_only])
        exact = _bytes([root / "exact"]) if (root / "exact").exists() else 0
        rows[name] = {
            "bytes_per_token": arrays / tokens,
            "states_per_token": states / tokens,
            "exact_slice": exact,
        }

    for dtype, codec in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "balanced")):
        name = f"hscache {dtype} {codec}"
        root = tmp / name.replace(" ", "-")
        write_cache(root, dtype, codec, last, sequences, length)
        cache_row(name, root, ["hidden_states"])
        fp8 = tmp / f"{root.name}-fp8"
        shutil.copytree(root, fp8)
        convert_states(fp8)
        cache_row(f"{name} -> fp8", fp8, ["hidden_states", "hidden_states_scale"])
    source = tmp / "hscache-bfloat16-none"
    for states in ("source", "fp8"):
        out = tmp / f"speculators-{states}"
        export_speculators(source, out, states=states)
        rows[f"speculators 0.9 ({'bf16' if states == 'source' else 'hs-connectors fp8'})"] = {
            "bytes_per_token": _bytes([out]) / tokens,
            "states_per_token": _bytes([out / "hidden_states"]) / tokens,
        }
    sf_cache = tmp / "hscache-bf16-specforge-layers"
    write_cache(sf_cache, "bfloat16", "none", no_last, sequences, length)
    export_specforge(sf_cache, tmp / "specforge")
    rows["SpecForge 0.2 (4 non-last layers)"] = {
        "bytes_per_token": _bytes([tmp / "specforge"]) / tokens,
        "states_per_token": None,
    }
    bf16, fp32 = rows["hscache bfloat16 none"], rows["hscache float32 none"]
    fp8 = rows["hscache bfloat16 none -> fp8"]
    ratios = {
        "fp8_states_vs_bf16_none": fp8["states_per_token"] / bf16["states_per_token"],
        "fp8_states_vs_fp32_none": fp8["states_per_token"] / fp32["states_per_token"],
        "fp8_cache_vs_bf16_none": fp8["bytes_per_token"] / bf16["bytes_per_token"],
    }
    print(
        f"bytes per token, hidden {HIDDEN}, {LAYERS} layers, {tokens} tokens (states = hidden states + scales):"
    )
    for name, row in rows.items():
        states = "" if row["states_per_token"] is None else f"  states {row['states_per_token']:9,.0f}"
        exact = f"  exact slice {row['exact_slice']:,} B" if row.get("exact_slice") else ""
        print(f"  {name:<40} {row['bytes_per_token']:9,.0f}{states}{exact}")
    for key, value in ratios.items():
        print(f"  ratio {key}: {value:.3f}")
    return {"tokens": tokens, "rows": rows, "ratios": ratios}


def _make_cold(root: Path) -> None:
    files = [p for p in root.rglob("*") if p.is_file()]
    now = time.time_ns()
    for path in files:
        if "/c/" in path.as_posix():
            os.utime(path, ns=(now, now))  # no verified-chunk record vouches for them: checked again
    VERIFIED.clear()
    drop_page_cache(files)


def part_read(tmp: Path, sequences: int, length: int, repeats: int) -> dict:
    none = tmp / "read-none"
    if not none.exists():
        write_cache(none, "bfloat16", "none", [15, 31, 47, 63], sequences, length)
    fp8 = tmp / "read-fp8"
    if not fp8.exists():
        shutil.copytree(none, fp8)
        convert_states(fp8)

    def epoch(root: Path, dequantise: bool = True) -> int:
        """Seconds' worth of work: the bf16 bytes the epoch stands for (fp8 raw: its [W, K, H] in bf16)."""
        windows = PackedWindows(root, window=length, shuffle=False, dequantise=dequantise)
        return sum(w["hidden_states"].numel() * 2 for w in windows)

    paths = {"none": (none, True), "fp8": (fp8, True), "fp8_raw": (fp8, False)}
    runs: dict[str, dict[str, list[float]]] = {"warm": {n: [] for n in paths}, "cold": {n: [] for n in paths}}
    load = [os.getloadavg()[0]]
    for root, dequantise in paths.values():
        epoch(root, dequantise)  # page cache, chunk checks
    for label in ("warm", "cold"):
        for _ in range(repeats):  # the paths alternate: load shifts hit each about alike
            for name, (root, dequantise) in paths.items():
                if label == "cold":
                    _make_cold(root)
                t0 = time.perf_counter()
                nbytes = epoch(root, dequantise)
                runs[label][name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    load.append(os.getloadavg()[0])
    median = {label: {n: statistics.median(v) for n, v in by.items()} for label, by in runs.items()}
    ratios = {
        f"{name}_{label}": median[label][name] / median[label]["none"] for label in median for name in paths
    }
    for label in median:
        print(
            f"training read ({label}), PackedWindows, median of {repeats}, GB/s of bf16 states: codec none "
            f"{median[label]['none']:.2f}, fp8 dequantised on the CPU {median[label]['fp8']:.2f} (ratio "
            f"{ratios['fp8_' + label]:.2f}), fp8 as stored (dequantise=False: the device dequantises) "
            f"{median[label]['fp8_raw']:.2f} (ratio {ratios['fp8_raw_' + label]:.2f}); torch threads "
            f"{torch.get_num_threads()}, load {load[0]:.1f} -> {load[1]:.1f}"
        )
    return {
        "gb_per_s": median,
        "runs": runs,
        "ratios_vs_none": ratios,
        "threads": torch.get_num_threads(),
        "load": load,
    }


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"  {' '.join(args)}: {time.perf_counter() - t0:.0f} s", flush=True)


def _totals(report: dict, ids: list[str]) -> np.ndarray:
    by_id = {r["record_id"]: r for r in report["per_request"]}
    return np.array([[by_id[i]["tokens"], by_id[i]["rounds"]] for i in ids], dtype=float)


def part_families(work: Path, train_limit: int | None, eagle3_steps: int, dflash_steps: int) -> dict:
    from scorer.metrics import paired_bootstrap_delta, tau_per_request_from_totals
    from scorer.studies.evaluate import EvalConfig, evaluate

    work.mkdir(parents=True, exist_ok=True)
    train, cache = work / "train", work / "cache"
    steps = [
        (train, ("hscache.cli", "extract", "--out", str(train), "--prompts", "humaneval", "--layers", "1,3,4,7",
                 "--max-new-tokens", "64", "--quiet", *(("--limit", str(train_limit)) if train_limit else ()))),
        (cache, ("hscache.cli", "extract", "--out", str(cache), "--layers", "1,3,4,7", "--limit", "8",
                 "--max-new-tokens", "32", "--quiet")),
        (work / "dflash", ("scorer.cli", "init", str(work / "dflash"), "--cache", str(train), "--train-steps",
                           str(dflash_steps), "--prompt-anchors")),
        (work / "eagle3", ("scorer.cli", "init", str(work / "eagle3"), "--cache", str(train), "--family",
                           "eagle3", "--train-steps", str(eagle3_steps))),
    ]  # fmt: skip
    for done, args in steps:
        if not (done / ("manifest.json" if done in (train, cache) else "config.json")).exists():
            _run(*args)
    for src in (cache, train):
        fp8 = work / f"{src.name}-fp8"
        if not fp8.exists():
            shutil.copytree(src, fp8)
            convert_states(fp8, every=1 if src is cache else 32)  # the scoring cache: every sequence exact
    if not (work / "dflash-fp8" / "config.json").exists():
        _run("scorer.cli", "init", str(work / "dflash-fp8"), "--cache", str(work / "train-fp8"), "--train-steps",
             str(dflash_steps), "--prompt-anchors")  # fmt: skip
    config = EvalConfig(ddtree=())
    drift = {}
    print("paired delta tau per request, fp8 - exact, on the scoring cache's 8 sequences [95%]:")
    for name, ckpt in (("DFlash", work / "dflash"), ("EAGLE-3", work / "eagle3"), ("MTP head", "target:mtp")):
        fp8_report = evaluate(ckpt, work / "cache-fp8", config)
        exact_report = evaluate(ckpt, cache, config)
        d = fp8_report["exact_slice"]
        # The exact slice is the source cache bit for bit: its scores are the source cache's.
        want = tau_per_request_from_totals(_totals(exact_report, d["record_ids"]))
        if abs(want - d["tau"]["exact"]["per_request"]) > 1e-9:
            raise RuntimeError(
                f"{name}: the exact slice scores {d['tau']['exact']} but the source cache {want}"
            )
        drift[name] = {"tau_source": exact_report["tau"], "tau_fp8": fp8_report["tau"], "exact_slice": d}
        p = d["delta"]["per_request"]
        print(
            f"  {name:<9} tau {d['tau']['exact']['per_request']:.3f} -> {d['tau']['compact']['per_request']:.3f}, "
            f"delta {p['delta']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}]"
            + (" EXCLUDES 0" if d["interval_excludes_zero"] else " (contains 0)")
        )
    source = evaluate(work / "dflash", cache, config)
    trained_fp8 = evaluate(work / "dflash-fp8", cache, config)
    ids = [r["record_id"] for r in source["per_request"]]
    delta = paired_bootstrap_delta(
        _totals(source, ids),
        _totals(trained_fp8, ids),
        tau_per_request_from_totals,
        config.n_boot,
        config.seed,
    ).to_dict()
    tau_s, tau_f = source["tau"], trained_fp8["tau"]
    print(
        f"DFlash trained on the source cache: tau {tau_s['per_request']:.3f} [{tau_s['per_request_ci95'][0]:.2f}, "
        f"{tau_s['per_request_ci95'][1]:.2f}]; on its fp8 copy: {tau_f['per_request']:.3f} "
        f"[{tau_f['per_request_ci95'][0]:.2f}, {tau_f['per_request_ci95'][1]:.2f}]; paired delta "
        f"{delta['delta']:+.4f} [{delta['lo']:+.4f}, {delta['hi']:+.4f}]"
    )
    return {"drift": drift, "trained_on_fp8": {"source": tau_s, "fp8": tau_f, "delta_per_request": delta}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="bytes,read,families")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None, help="Keep the families' caches and drafters here.")
    parser.add_argument(
        "--train-limit", type=int, default=None, help="HumanEval prompts to train on (all: 164)."
    )
    parser.add_argument("--eagle3-steps", type=int, default=1000)
    parser.add_argument("--dflash-steps", type=int, default=600)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    document: dict = {"bench": "compact_states", "load_average_at_start": os.getloadavg()[0]}
    os.environ["HSCACHE_VERIFIED_DIR"] = "off"  # every process checks its chunks itself
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if "bytes" in parts:
            document["bytes"] = part_bytes(tmp / "bytes", args.sequences, args.length)
        if "read" in parts:
            document["read"] = part_read(tmp / "read", args.sequences, args.length, args.repeats)
        if "families" in parts:
            work = Path(args.work) if args.work else tmp / "families"
            document["families"] = part_families(work, args.train_limit, args.eagle3_steps, args.dflash_steps)
    document["load_average_at_end"] = os.getloadavg()[0]
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(document, indent=2, default=str) + "\n")
    return document


if __name__ == "__main__":
    main()
