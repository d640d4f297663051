"""Real-scale benchmark: a Qwen3.6-27B-shaped target and drafter; ratios measured in one run.

The target has the real vocabulary (248,320), head dims and layer pattern of Qwen3.6-27B
(24 query / 4 KV heads of 256, Gated DeltaNet 16 key / 48 value heads of 128, conv 4, layers
[linear, linear, linear, full], untied head); hidden size and depth are reduced to what a
2-core CPU holds (--hidden, default 512; 4 layers). The drafter: 5 layers (--drafter-layers), block 16, the
target's head dims and vocabulary (scorer.init_drafter, random weights).

Prints, each a ratio of two sides measured in this run:
  1. extract tokens/s vs a bare forward of the same model (hooks + chunked head + top-k)
  2. generate: batch 16 vs batch 1, end to end, on builtin:tiny-qwen3.5 (CPU)
  3. scorer --anchors chain vs all on sequences planted to give tau = 3 (with and without DDTree)
  4. scorer eval vs a bare drafter forward (every anchor, head argmax)
  5. peak RSS beyond the weights of extract and of eval, against --memory-gb
  6. opening a 1,000,000-sequence index: seconds and RSS

    python bench/real_dims.py [--hidden 512] [--sequences 2] [--seq-len 160] [--drafter-layers 5] [--quick]
"""

from __future__ import annotations

import os
import sys

# Named like nothing it imports, but keep bench/ off the path for `import scorer` all the same.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hscache
from hscache.capture.forward import greedy_continuation, greedy_continuations
from hscache.capture.logit_rows import head_rows, row_chunks
from scorer.families.dflash.features import feature_index
from scorer.families.dflash.score import score_dflash_sequence, score_dflash_sequences_chain
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, evaluate, load_drafter

ROOT = Path(__file__).resolve().parents[1]
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _synthetic_index(src: Path, out: Path, n: int) -> Path:
    import importlib.util

    # By file path: bench/ on sys.path would shadow the scorer package with bench/scorer.py.
    spec = importlib.util.spec_from_file_location("synthetic_index", ROOT / "bench" / "synthetic_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_index(src, out, n)


# Qwen3.6-27B's head counts: attention query / KV heads, Gated DeltaNet key / value heads.
REAL_HEADS = (24, 4, 16, 48)
QUICK_HEADS = (4, 2, 2, 6)  # --quick: the same head dims, fewer heads (queries still shared per KV head)


def build_target(out: Path, vocab: int, hidden: int, heads: tuple[int, int, int, int] = REAL_HEADS) -> Path:
    """Save a seeded shape-real Qwen3.5 text model (bf16) with the built-in tokenizer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hscache.capture.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    attention, kv, linear_key, linear_value = heads
    config = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=max(64, round(17408 * hidden / 5120 / 64) * 64),
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        num_attention_heads=attention,
        num_key_value_heads=kv,
        head_dim=256,
        linear_num_key_heads=linear_key,
        linear_num_value_heads=linear_value,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _prompts(path: Path, sequences: int, seq_len: int, vocab: int) -> Path:
    gen = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(sequences):
            ids = gen.integers(4, 500, seq_len).tolist()  # tokenizer ids; the model's rows go past them
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "prompt_len": seq_len // 5}) + "\n")
    return path


def _extract_config(model: Path, prompts: Path, out: Path, memory_gb: float) -> hscache.ExtractConfig:
    return hscache.ExtractConfig(
        out=str(out),
        model=str(model),
        prompts=str(prompts),
        layers="0,1,2,3",
        max_new_tokens=0,
        dtype="bf16",
        memory_gb=memory_gb,
        overwrite=True,
    )


def _bare_forward_s(model: Path, prompts: Path, memory_gb: float) -> float:
    from hscache.capture.forward import next_token_stats
    from hscache.capture.target import load_target

    target = load_target(str(model), "bf16")
    lm_head = target.model.get_output_embeddings()
    rows = head_rows(lm_head.weight.shape[0], memory_gb)
    t0 = time.perf_counter()
    with torch.no_grad():
        for line in prompts.read_text().splitlines():
            ids = torch.tensor([json.loads(line)["input_ids"]])
            out = target.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            torch.stack([out.hidden_states[i + 1][0] for i in range(4)], dim=1).contiguous()
            next_token_stats(lm_head, out.last_hidden_state[0], 64, False, rows)
    return time.perf_counter() - t0


# One interpreter imports torch, hscache and the scorer once, then forks a child per measurement:
# each child starts with the parent's resident set (its peak RSS counter starts there too), so its
# peak minus its starting RSS is what a fresh interpreter would add after the same imports, at the
# cost of one import instead of one per measurement. The parent never runs a torch op before a fork
# (a forked OpenMP pool would hang). Linux only, as /proc is.
_PROBE_SERVER = r"""
import json, os, sys, traceback
import torch, hscache, scorer.studies.evaluate

def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096

def peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024

for line in sys.stdin:
    code = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stdout carries the replies
        try:
            scope = {'rss': rss, 'hscache': hscache, 'torch': torch, 'base': rss()}
            exec(code, scope)
            reply = {**scope['out'], 'base': scope['base'], 'peak': peak()}
        except BaseException:
            reply = {'error': traceback.format_exc()[-3000:]}
        with os.fdopen(w, 'w') as f:
            f.write(json.dumps(reply))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        reply = f.read()
    os.waitpid(pid, 0)
    print(reply or json.dumps({'error': 'the measurement child died'}), flush=True)
"""


class _InlineProbe:
    """--quick's stand-in for `_RssProbe`: the same code run in this process, its RSS figures this
    process's (meaningless at quick sizes, as every quick figure is). The server's interpreter
    would cost ~9 CPU-s of imports (torch, transformers, hscache, scorer) for three tiny runs."""

    def peak(self, code: str) -> dict:
        scope = {"rss": _rss, "hscache": hscache, "torch": torch, "base": _rss()}
        exec(code, scope)
        return {**scope["out"], "base": scope["base"], "peak": max(_peak_rss(), _rss())}

    def close(self) -> None:
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class _RssProbe:
    """Peak RSS of code run after ``import torch, hscache, scorer.studies.evaluate``, one fork each."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.server = subprocess.Popen(
            [sys.executable, "-c", _PROBE_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def peak(self, code: str) -> dict:
        """Run ``code`` (it sets ``out``, a dict; ``base = rss()`` moves the start) in a forked child;
        ``out`` plus its starting RSS (``base``) and peak RSS (``peak``), bytes."""
        self.server.stdin.write(json.dumps(code) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise RuntimeError(self.stderr.read().decode()[-3000:])
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait()
        self.stderr.close()


def _planted(drafter, features: torch.Tensor, x0: torch.Tensor, P: int, accept: int) -> tuple:
    """Token ids / argmax on the greedy path where the chain accepts exactly ``accept`` per round."""
    B, V = drafter.config.block_size, drafter.config.vocab_size
    x, T = x0.clone(), len(x0)
    context = drafter.context_kv(features[: T - 2])
    p = P
    while p < T - 1:
        block = torch.full((1, B), drafter.config.mask_token_id)
        block[0, 0] = x[p]
        h = drafter.block_hidden(features, torch.tensor([p]), block, context=context)
        d = drafter.head(h[0]).float().argmax(-1)
        n = min(accept, T - 1 - p)
        x[p + 1 : p + 1 + n] = d[:n]
        if p + 1 + n <= T - 1:
            x[p + 1 + n] = (d[n] + 1) % V
        p += n + 1
    a = torch.cat([x[1:], torch.zeros(1, dtype=x.dtype)])
    return x, a


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=160)
    parser.add_argument("--gen-prompts", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--index-rows", type=int, default=1_000_000)
    parser.add_argument("--memory-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument(
        "--parts",
        default="extract,generate,scorer,index",
        help="which measurements (the cache is always built)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (fewer heads too), RSS measured in this process: checks that the benchmark runs",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.sequences, args.seq_len = 4096, 128, 1, 24
        # index: 2,000 rows open through the same code as 1M (20,000 cost ~0.5 CPU-s more to build)
        args.gen_prompts, args.gen_tokens, args.index_rows = 4, 3, 2_000
        args.drafter_layers = 1  # every line is printed with one layer as with five
    args.heads = QUICK_HEADS if args.quick else REAL_HEADS  # quick: ~3 CPU-s less, mostly the drafter
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="hscache-real-"))
    parts = set(args.parts.split(","))
    probe = None
    if parts & {"extract", "scorer", "index"}:
        probe = _InlineProbe() if args.quick else _RssProbe()  # the server imports while we build
    try:
        model = build_target(tmp / "target", args.vocab, args.hidden, args.heads)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        prompts = _prompts(tmp / "p.jsonl", args.sequences, args.seq_len, args.vocab)
        cache_dir = tmp / "cache"
        tokens = args.sequences * args.seq_len
        # The first extract also builds the cache every later part uses.
        ours = _best(
            lambda: hscache.extract(_extract_config(model, prompts, cache_dir, args.memory_gb)),
            args.repeats,
        )
        if "extract" in parts:
            _extract_part(args, model, prompts, tmp, tokens, ours, weights, probe)
        if "generate" in parts:
            _generate_part(args)
        if "scorer" in parts:
            _scorer_part(args, cache_dir, tmp, probe)
        if "index" in parts:
            _index_part(args, cache_dir, tmp, probe)
    finally:
        if probe is not None:
            probe.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _extract_part(
    args,
    model: Path,
    prompts: Path,
    tmp: Path,
    tokens: int,
    ours: float,
    weights: int,
    probe: _RssProbe | _InlineProbe,
) -> None:
    """1. extract vs a bare forward; 5a. extract's peak RSS beyond the weights."""
    bare = _best(lambda: _bare_forward_s(model, prompts, args.memory_gb), args.repeats)
    print(
        f"extract: {tokens / ours:,.1f} tokens/s; bare forward {tokens / bare:,.1f} tokens/s; "
        f"extract / bare time = {ours / bare:.3f} (V={args.vocab}, hidden {args.hidden}, bf16, {tokens} tokens; "
        "the bare side excludes loading the model)"
    )
    cfg = _extract_config(model, prompts, tmp / "cache-rss", args.memory_gb)
    rss = probe.peak(  # the config's repr names SamplingSetting (its sampling field)
        f"from hscache import SamplingSetting\nout = {{}}; hscache.extract(hscache.ExtractConfig(**{cfg.__dict__!r}))"
    )
    print(
        f"extract peak RSS - weights - interpreter: {(rss['peak'] - rss['base'] - weights) / 1e9:.2f} GB "
        f"(budget --memory-gb {args.memory_gb}; weights {weights / 1e9:.2f} GB)"
    )


def _generate_part(args) -> None:
    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
    from hscache.capture.target import load_target

    tiny = load_target("builtin:tiny-qwen3.5", "fp32")
    records = list(iter_records(resolve_prompts("builtin:default")))[: args.gen_prompts]
    gen_prompts = [prompt_token_ids(r, tiny.tokenizer) for r in records]
    one = _best(lambda: [greedy_continuation(tiny, p, args.gen_tokens, 4096) for p in gen_prompts], 1)
    batch = _best(lambda: greedy_continuations(tiny, gen_prompts, args.gen_tokens, 4096), 1)
    print(
        f"generate batch {len(gen_prompts)} vs batch 1: {one / batch:.2f}x faster "
        f"({len(gen_prompts)} prompts x {args.gen_tokens} tokens, builtin:tiny-qwen3.5 fp32 CPU; target >= 4)"
    )


def _scorer_part(args, cache_dir, tmp, probe: _RssProbe | _InlineProbe) -> None:
    from scorer.families.dflash.init import init_dflash

    ckpt = tmp / "drafter"
    init_dflash(cache_dir, ckpt, num_layers=args.drafter_layers, block_size=16)
    cache = hscache.open_cache(cache_dir)
    config = EvalConfig(ddtree=(), dtype="bf16", n_boot=20, memory_gb=args.memory_gb)
    drafter, _ = load_drafter(ckpt, cache, config)
    index = feature_index(drafter.config, cache.layer_ids)
    seqs = []
    for i in range(len(cache)):
        feats = sequence_features(cache.hidden_states(i), index, torch.bfloat16, "cpu")
        P = cache.index.column("prompt_len")[i].as_py()
        x, a = _planted(drafter, feats, cache.token_ids(i), P, accept=2)
        seqs.append((feats, x, a, P))
    for budgets in ((), (8,)):

        def run(mode: str, budgets=budgets) -> list:
            if mode == "chain":  # what score_rows does: every sequence of a block in lockstep
                items = [
                    {"features": f, "token_ids": x, "target_argmax": a, "prompt_len": P}
                    for f, x, a, P in seqs
                ]
                return score_dflash_sequences_chain(
                    drafter, items, ddtree_budgets=budgets, memory_gb=args.memory_gb
                )
            return [
                score_dflash_sequence(
                    drafter, f, x, a, P, ddtree_budgets=budgets, anchors=mode, memory_gb=args.memory_gb
                )
                for f, x, a, P in seqs
            ]

        t_all = _best(lambda: run("all"), args.repeats)
        t_chain = _best(lambda: run("chain"), args.repeats)
        res = run("chain")
        tau = sum(r.chain.n_tokens for r in res) / sum(r.chain.n_rounds for r in res)
        print(
            f"scorer --anchors chain vs all, DDTree {list(budgets) or 'off'}: {t_all / t_chain:.2f}x faster "
            f"(pooled tau {tau:.2f}; drafted {sum(r.drafted_anchors for r in res)} of "
            f"{sum(len(x) - 1 - P for _, x, _, P in seqs)} anchors; target >= 2 where tau >= 2.5)"
        )
    ours = _best(lambda: evaluate(ckpt, cache_dir, config), args.repeats)

    def bare_drafter() -> None:
        rows = head_rows(drafter.config.vocab_size, args.memory_gb)
        for f, x, _, P in seqs:
            anchors = torch.arange(P, len(x) - 1)
            blocks = torch.full((len(anchors), 16), drafter.config.mask_token_id)
            blocks[:, 0] = x[anchors]
            flat = drafter.block_hidden(f, anchors, blocks).reshape(-1, drafter.config.hidden_size)
            for lo, hi, _new in row_chunks(flat.shape[0], rows):
                drafter.head(flat[lo:hi]).argmax(-1)

    bare = _best(bare_drafter, args.repeats)
    print(
        f"scorer eval / bare drafter forward (every anchor, head argmax) = {ours / bare:.3f} (bf16, DDTree off)"
    )
    drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    head_bytes = sum(f.stat().st_size for f in (cache_dir / "target").glob("head.safetensors"))
    rss = probe.peak(
        f"from scorer.studies.evaluate import EvalConfig, evaluate\n"
        f"evaluate({str(ckpt)!r}, {str(cache_dir)!r}, EvalConfig(ddtree=(8,), dtype='bf16', n_boot=20, "
        f"memory_gb={args.memory_gb}))\nout = {{}}"
    )
    print(
        f"eval peak RSS - weights - interpreter: {(rss['peak'] - rss['base'] - drafter_bytes - head_bytes) / 1e9:.2f} GB "
        f"(budget --memory-gb {args.memory_gb}; drafter {drafter_bytes / 1e9:.2f} GB + target head "
        f"{head_bytes / 1e9:.2f} GB)"
    )


def _index_part(args, cache_dir, tmp, probe: _RssProbe | _InlineProbe) -> None:
    big = _synthetic_index(cache_dir, tmp / "big", args.index_rows)
    rss = probe.peak(
        f"import time\nhscache.open_cache({str(cache_dir)!r})\nbase = rss()\n"  # imports warm
        f"t0 = time.perf_counter()\nc = hscache.open_cache({str(big)!r})\n"
        "out = {'s': time.perf_counter() - t0, 'n': len(c)}"
    )
    print(
        f"open a {rss['n']:,}-sequence index: {rss['s']:.2f} s, RSS +{(rss['peak'] - rss['base']) / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    main()
