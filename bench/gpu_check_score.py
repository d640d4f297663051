"""Drift and scoring steps of bench/gpu_check.py: diff, drafter, eval per cache and device, flex vs
SDPA, throughput."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from gpu_check_steps import Plan, extract_cache, skipped


def diff_pair(a: Path, b: Path, out: Path) -> dict[str, Any]:
    """``hscache diff A B``: per-layer relative drift and next-token argmax agreement."""
    from hscache.diff.compare import diff_caches
    from hscache.diff.report import save_json

    report = diff_caches(a, b)
    save_json(report, out)
    nt = report.next_token
    worst = report.worst_layer()
    return {
        "json": str(out),
        "sequences": report.sequences.compared,
        "tokens": report.sequences.tokens,
        "layers": [
            {
                "layer_id": x.layer_id,
                "layer_type": x.layer_type,
                "rel_l2": x.rel_l2,
                "cosine_min": x.cosine_min,
                "max_abs": x.max_abs,
            }
            for x in report.hidden_states
        ],
        "worst_layer": worst.layer_id if worst else None,
        "worst_rel_l2": worst.rel_l2 if worst else None,
        "argmax_agreement": nt.argmax_agreement,
        "argmax_flips": nt.argmax_flips,
        "topk_overlap": nt.topk_overlap,
        "kl_mean": nt.kl_mean,
    }


def make_drafter(plan: Plan, target: str, cache: Path, out: Path) -> dict[str, Any]:
    """The built-in target's drafter is trained on the reference cache (CPU); the shape-real one is
    random: training at a 248k vocabulary on a CPU does not fit the run's minutes."""
    if target == "builtin":
        from scorer import train_drafter

        result = train_drafter(
            cache, out, steps=plan.train_steps, block_size=plan.block_size, log_every=0, overwrite=True
        )
        return {
            "kind": f"trained {plan.train_steps} steps",
            "final_loss": result["final_loss"],
            "path": str(out),
        }
    from scorer.families.dflash.init import init_dflash

    config, _ = init_dflash(cache, out, block_size=plan.block_size, overwrite=True)
    return {"kind": "random init", "hidden_size": config.hidden_size, "path": str(out)}


def eval_cache(plan: Plan, target: str, drafter: Path, cache: Path, device: str, out: Path) -> dict[str, Any]:
    """``scorer eval`` in fp32 on ``device``: tau, tokens/s and every round's accepted length."""
    from scorer.studies.evaluate import EvalConfig, evaluate

    config = EvalConfig(
        device=device,
        dtype="fp32",
        ddtree=plan.ddtree,
        n_boot=200,
        limit=plan.real_eval_limit if target == "real" else None,
    )
    report = evaluate(drafter, cache, config)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return {
        "json": str(out),
        "device": device,
        "tau_per_request": report["tau"]["per_request"],
        "tau_pooled": report["tau"]["pooled"],
        "ddtree": report["ddtree"],
        "rounds": report["rounds"],
        "tokens": report["tokens"],
        "seconds": report["seconds"],
        "tokens_per_s": round(report["tokens"] / max(report["seconds"], 1e-9), 1),
        "attention_backend": report["drafter"].get("attention_backend"),
        "accepted": [r["accepted"] for r in report["per_request"]],
    }


def tau_summary(evals: dict[tuple[str, str], dict[str, Any] | None], reference: str) -> dict[str, Any]:
    """Per cache: tau on CPU and CUDA, deltas against the reference cache, CPU-vs-CUDA agreement.

    ``evals`` maps (cache label, "cpu"|"gpu") to an eval step's result (None when it failed).
    """
    rows = {}
    for label in sorted({k[0] for k in evals}):
        cpu, gpu = evals.get((label, "cpu")), evals.get((label, "gpu"))
        row: dict[str, Any] = {}
        for side, res in (("cpu", cpu), ("gpu", gpu)):
            ref = evals.get((reference, side))
            row[f"tau_{side}"] = res["tau_pooled"] if res else None
            row[f"delta_vs_reference_{side}"] = (
                res["tau_pooled"] - ref["tau_pooled"]
                if res and ref and None not in (res["tau_pooled"], ref["tau_pooled"])
                else None
            )
        if cpu and gpu:
            pairs = [(a, b) for ra, rb in zip(cpu["accepted"], gpu["accepted"]) for a, b in zip(ra, rb)]
            same_shape = [len(a) for a in cpu["accepted"]] == [len(b) for b in gpu["accepted"]]
            row["cpu_gpu_same_rounds"] = same_shape
            row["cpu_gpu_round_agreement"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            row["cpu_gpu_tau_diff"] = (
                gpu["tau_pooled"] - cpu["tau_pooled"]
                if None not in (gpu["tau_pooled"], cpu["tau_pooled"])
                else None
            )
        rows[label] = row
    return {"reference": reference, "caches": rows}


def flex_vs_sdpa(plan: Plan, drafter: Path, cache_path: Path) -> dict[str, Any]:
    """The drafter's block states on the same blocks with flex_attention and with SDPA, per dtype."""
    import torch

    import hscache
    from scorer.families.dflash.features import feature_index
    from scorer.offline.sequences import sequence_features
    from scorer.studies.evaluate import EvalConfig, load_drafter

    cache = hscache.open_cache(cache_path)
    result = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model, _ = load_drafter(drafter, cache, EvalConfig(device=plan.gpu, dtype=dtype_name))
        index = feature_index(model.config, cache.layer_ids)
        B = model.config.block_size
        num = den = 0.0
        max_abs, agree, total = 0.0, 0, 0
        for row in range(min(plan.flex_rows, len(cache))):
            tokens = cache.token_ids(row)
            features = sequence_features(cache.hidden_states(row), index, dtype, plan.gpu)
            anchors = torch.arange(1, len(tokens) - 1, device=plan.gpu)[: plan.flex_anchors]
            blocks = torch.full(
                (len(anchors), B), model.config.mask_token_id, dtype=torch.long, device=plan.gpu
            )
            blocks[:, 0] = tokens.to(plan.gpu)[anchors]
            flex = model.block_hidden(features, anchors, blocks, backend="flex").float()
            sdpa = model.block_hidden(features, anchors, blocks, backend="sdpa").float()
            num += float(((flex - sdpa) ** 2).sum())
            den += float((sdpa**2).sum())
            max_abs = max(max_abs, float((flex - sdpa).abs().max()))
            a = model.head(flex.to(dtype)).argmax(-1)
            b = model.head(sdpa.to(dtype)).argmax(-1)
            agree += int((a == b).sum())
            total += a.numel()
        result[dtype_name] = {
            "rel_l2": (num / den) ** 0.5 if den else None,
            "max_abs": max_abs,
            "argmax_agreement": agree / total if total else None,
            "drafted_positions": total,
        }
    return result


def prompts_file(path: Path, count: int) -> Path:
    """``count`` prompts: the built-in ones, cycled, with unique ids."""
    lines = resources.files("hscache.data").joinpath("default_prompts.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if x.strip()]
    with path.open("w") as f:
        for i in range(count):
            record = dict(records[i % len(records)])
            record["id"] = f"{record['id']}-{i}"
            f.write(json.dumps(record) + "\n")
    return path


def extract_throughput(
    plan: Plan, model: str, layers: str, batch: int | None, work: Path, batch_param: str | None
) -> dict[str, Any]:
    """Extract tokens/s with fla on the GPU at generate batch ``batch`` (None: the default path)."""
    if batch is not None and batch_param is None:
        return skipped("not available: hscache extract has no --generate-batch in this checkout")
    work.mkdir(parents=True, exist_ok=True)
    n = max(plan.throughput_min_prompts, 2 * (batch or 1))
    prompts = prompts_file(work / f"throughput-{n}.jsonl", n)
    sizes: dict[str, Any] = {"prompts": str(prompts), "max_new_tokens": plan.throughput_new_tokens}
    if batch is not None:
        sizes[batch_param] = batch
    name = f"throughput-b{batch or 'default'}"
    result = extract_cache(plan, model, work / name, plan.fla_backend, plan.gpu, layers, None, **sizes)
    return {"generate_batch": batch, "prompts": n, **result}


def extract_sampled(
    plan: Plan, model: str, layers: str, sizes: dict[str, Any], work: Path, greedy: dict[str, Any] | None
) -> dict[str, Any]:
    """A sampled extraction (Qwen's thinking preset, 2 samples per prompt) with fla on the GPU: its speed
    against the greedy reference of the same prompts, and how many drawn tokens the teacher-forced
    (stored) distribution misses (bf16 generation and capture forwards can differ at a cut)."""
    import hscache
    from hscache.store.sampling import SamplingSetting

    sampling = SamplingSetting.from_flags("qwen-thinking", samples_per_prompt=2, seed=0)
    out = work / "sampled-fla-cuda"
    result = extract_cache(
        plan, model, out, plan.fla_backend, plan.gpu, layers, None, sampling=sampling, **sizes
    )
    cache = hscache.open_cache(out)
    counts = cache.provenance["sampling"]
    support = max(int((cache.sampled_support(r)[0] >= 0).sum(-1).max()) for r in range(len(cache)))
    greedy_speed = (greedy or {}).get("generated_tokens_per_s")
    return {
        **result,
        "setting": sampling.describe(),
        "sampled_positions": counts["sampled_positions"],
        "realised_outside_support": counts["realised_outside_support"],
        "largest_support": support,
        "support_width": sampling.support_width,
        "greedy_generated_tokens_per_s": greedy_speed,
        # generated tokens per second, greedy over sampled (2 samples per prompt: twice the sequences)
        "slowdown_vs_greedy": round(greedy_speed / result["generated_tokens_per_s"], 3)
        if greedy_speed
        else None,
    }
