"""Train the built-in targets: ``python -m pipelines.train_builtin [--out DIR] [--steps N]``.

Makes, on the CPU and deterministically on one torch version, what ``hscache/data/builtin/``
ships: the byte-level BPE tokenizer (``tokenizer.json``), ``tiny-qwen3.5.safetensors`` (a
``Qwen3_5ForCausalLM`` and its MTP head ``mtp.*``), ``tiny-qwen3.safetensors`` (a
``Qwen3ForCausalLM``) and ``training.json`` (settings, corpus digest, losses, weights' sha256).

The corpus (see `corpus_documents`) is text whose licence allows shipping what is derived from
it: a fixed list of the running interpreter's standard-library modules (PSF licence), the bundled
HumanEval (MIT) and MT-Bench (Apache-2.0) prompt sets less their held-out records (see
`hscache.capture.prompt_sets.held_out`), and ``hscache/data/tokenizer_corpus.txt`` (this project's).
The bundled default prompts are held out as well: the quickstart extracts from them.

The MTP head is trained as Qwen3.5's is, jointly with the model: from the model's last hidden
state at position i (after the final norm, what vLLM feeds it) and the embedding of token i + 1,
it predicts token i + 2 through the target's own lm_head (loss weight ``MTP_WEIGHT``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hscache.capture import builtin
from hscache.capture.prompt_sets import held_out, load_prompt_set

__all__ = [
    "STDLIB_MODULES",
    "SETTINGS",
    "corpus_documents",
    "corpus_sha256",
    "train_target",
    "token_stream",
    "train_tokenizer",
    "main",
]

# A fixed selection of plain, well-documented pure-Python standard-library modules (Python 3.11).
STDLIB_MODULES = (
    "abc.py",
    "argparse.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "graphlib.py",
    "heapq.py",
    "hmac.py",
    "ipaddress.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "numbers.py",
    "operator.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "reprlib.py",
    "sched.py",
    "secrets.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "collections/__init__.py",
    "datetime.py",
    "shutil.py",
    "tempfile.py",
)

SETTINGS = {
    # 320 pieces: a vocabulary these few-million-parameter models learn to predict peakedly
    # (512 at the same budget gave median top-1 p 0.4 on held-out text, under the 0.5 target).
    "vocab_size": 320,
    "seq_len": 128,
    "batch_size": 4,
    # Pure attention (tiny-qwen3) needs more steps than the hybrid, whose short convolutions give it
    # local context from the start; it is also a third of the cost per step. These counts are
    # where both reach median top-1 p >= 0.5 on held-out prompts (bench/builtin_targets.py).
    "steps": {"builtin:tiny-qwen3.5": 6000, "builtin:tiny-qwen3": 16000},
    "lr": 4e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 20,
    "weight_decay": 0.01,
    "betas": (0.9, 0.95),
    "grad_clip": 1.0,
    "mtp_weight": 0.3,
    "data_seed": 1234,
    "init_seed": builtin.SEED,
    "threads": 1,  # 2 threads on a shared 2-core machine ran 3x slower
}
MTP_WEIGHT = SETTINGS["mtp_weight"]


def _stdlib_documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(f"stdlib/{m}", (root / m).read_text(encoding="utf-8")) for m in STDLIB_MODULES]


def corpus_documents() -> list[tuple[str, str]]:
    """``(name, text)`` of every training document, in a fixed order."""
    from importlib import resources

    docs = _stdlib_documents()
    for i, rec in enumerate(load_prompt_set("humaneval")):
        if not held_out("humaneval", i):
            docs.append((f"humaneval/{rec['id']}", rec["prompt"] + rec["canonical_solution"]))
            docs.append(
                (
                    f"humaneval-chat/{rec['id']}",
                    _chat(rec["prompt"], rec["prompt"] + rec["canonical_solution"]),
                )
            )
    for i, rec in enumerate(load_prompt_set("mt-bench")):
        if not held_out("mt-bench", i):
            docs.append((f"mt-bench/{rec['id']}", "\n\n".join(rec["turns"])))
    text = resources.files("hscache.data").joinpath("tokenizer_corpus.txt").read_text()
    docs.append(("hscache/tokenizer_corpus.txt", text))
    return docs


def _chat(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def corpus_sha256(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def train_tokenizer(docs: list[tuple[str, str]], vocab_size: int) -> str:
    """The byte-level BPE tokenizer (JSON) trained on the corpus, the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=builtin.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text for _, text in docs], trainer=trainer)
    return tok.to_str()


def token_stream(docs, tokenizer) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for _, text in docs:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


class MtpTrainHead(nn.Module):
    """Qwen3.5's MTP head with the checkpoint's parameter names (less ``mtp.``): fc over
    [norm(embed(token i+1)), norm(hidden i)], the target's full-attention decoder layer, a norm."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        H = config.hidden_size
        full = list(config.layer_types).index("full_attention")
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, full) for _ in range(config.mtp_num_hidden_layers)
        )
        self.norm = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, model, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, n, H] (post-norm, positions 0..n-1), next_ids [B, n] -> normed [B, n, H]."""
        embeds = model.get_input_embeddings()(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        B, n = next_ids.shape
        pos = torch.arange(n).view(1, 1, -1).expand(3, B, -1)
        pe = model.model.rotary_emb(x, pos)
        for layer in self.layers:
            x = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos[0])
        return self.norm(x)


def _init_weights(module: nn.Module, std: float, gen: torch.Generator) -> None:
    for _name, p in sorted(module.named_parameters()):
        if p.ndim >= 2:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _lr(step: int, s: dict) -> float:
    if step < s["warmup_steps"]:
        return s["lr"] * (step + 1) / s["warmup_steps"]
    t = (step - s["warmup_steps"]) / max(1, s["steps"] - s["warmup_steps"])
    ratio = s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * t))
    return s["lr"] * ratio


def train_target(
    name: str, stream: torch.Tensor, tokenizer, settings: dict, steps: int | None = None, log=None
):
    """Train ``name`` on ``stream``; returns (state dict with ``mtp.*`` for 3.5, per-step losses)."""
    s = dict(settings)
    if isinstance(s["steps"], dict):
        s["steps"] = s["steps"][name]
    steps = s["steps"] if steps is None else steps
    config = builtin.builtin_config(name, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
    if name == "builtin:tiny-qwen3.5":
        from transformers import Qwen3_5ForCausalLM as model_cls
    else:
        from transformers import Qwen3ForCausalLM as model_cls
    torch.manual_seed(s["init_seed"])
    model = model_cls(config)
    gen = torch.Generator().manual_seed(s["init_seed"])
    _init_weights(model, config.initializer_range, gen)
    mtp = None
    if getattr(config, "mtp_num_hidden_layers", 0):
        mtp = MtpTrainHead(config)
        _init_weights(mtp, config.initializer_range, gen)
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp else [])
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s["lr"],
        betas=tuple(s["betas"]),
    )
    data_gen = torch.Generator().manual_seed(s["data_seed"])
    L, B = s["seq_len"], s["batch_size"]
    losses: list[list[float]] = []
    model.train()
    t0 = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - L - 1, (B,), generator=data_gen)
        batch = torch.stack([stream[a : a + L] for a in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = _lr(step, s)
        out = model.model(input_ids=batch)
        hidden = out.last_hidden_state  # after the final norm
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        record = [loss.item()]
        if mtp is not None:
            normed = mtp(model, hidden[:, :-2], batch[:, 1:-1])
            mtp_loss = F.cross_entropy(
                model.lm_head(normed).reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1)
            )
            loss = loss + MTP_WEIGHT * mtp_loss
            record.append(mtp_loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s["grad_clip"])
        opt.step()
        losses.append([round(x, 6) for x in record])
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"{name} step {step}/{steps} loss {record} {time.time() - t0:.0f}s")
    model.eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if mtp is not None:
        state.update({f"mtp.{k}": v.detach().clone() for k, v in mtp.state_dict().items()})
    return state, losses


def _safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())})


def _train_job(job):
    name, stream, tok_json, s = job
    torch.set_num_threads(s["threads"])
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    state, losses = train_target(
        name, stream, builtin.tokenizer_from_json(tok_json), s, log=lambda m: print(m, flush=True)
    )
    blob = _safetensors_bytes(state)
    return name, blob, losses, sum(v.numel() for v in state.values()), round(time.time() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(builtin.data_dir()), help="where to write (default: the package's)")
    p.add_argument("--steps", type=int, default=None, help="override every target's number of steps")
    p.add_argument(
        "--only",
        action="append",
        choices=builtin.BUILTIN_TARGETS,
        help="train only this target (repeatable), keeping the others' files and record in --out "
        "(which must have been made from the same corpus and tokenizer)",
    )
    args = p.parse_args(argv)
    s = dict(SETTINGS)
    if args.steps is not None:
        s["steps"] = {name: args.steps for name in builtin.BUILTIN_TARGETS}
    torch.set_num_threads(s["threads"])
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    docs = corpus_documents()
    tok_json = train_tokenizer(docs, s["vocab_size"])
    (out / builtin.TOKENIZER_FILE).write_text(tok_json)
    tokenizer = builtin.tokenizer_from_json(tok_json)
    stream = token_stream(docs, tokenizer)
    record = {
        "settings": s,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "corpus": {
            "sha256": corpus_sha256(docs),
            "documents": len(docs),
            "tokens": len(stream),
            "stdlib_modules": list(STDLIB_MODULES),
        },
        "tokenizer_sha256": hashlib.sha256(tok_json.encode()).hexdigest(),
        "targets": {},
    }
    names = list(args.only or builtin.BUILTIN_TARGETS)
    if args.only:
        old = json.loads((out / builtin.RECORD_FILE).read_text())
        same = ("corpus", "tokenizer_sha256", "torch", "python")
        if any(old[k] != record[k] for k in same) or {**old["settings"], "steps": 0} != {
            **json.loads(json.dumps(s)),
            "steps": 0,
        }:
            raise SystemExit(f"--only: {out / builtin.RECORD_FILE} was made from another corpus or settings")
        record["targets"] = {k: v for k, v in old["targets"].items() if k not in names}
        s["steps"] = {**old["settings"]["steps"], **{k: s["steps"][k] for k in names}}
    print(f"corpus: {len(docs)} documents, {len(stream)} tokens", flush=True)
    # One process per target, one thread each: on a shared 2-core machine this is 2x the throughput
    # of one process with 2 threads (which ran 3x slower than 1 thread), and stays deterministic.
    jobs = [(name, stream, tok_json, s) for name in names]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        results = pool.map(_train_job, jobs)
    for name, blob, losses, parameters, seconds in results:
        fname = builtin.weights_file(name)
        (out / fname).write_bytes(blob)
        record["targets"][name] = {
            "file": fname,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "steps": len(losses),
            "parameters": parameters,
            "seconds": seconds,
            "losses": losses,
        }
    record["targets"] = dict(sorted(record["targets"].items()))
    record["seconds"] = round(time.time() - t0, 1)
    (out / builtin.RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"done in {record['seconds']}s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
