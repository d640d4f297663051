"""A tiny DFlash training helper: a few hundred CPU steps on a cache, for quickstarts and tests.

Not a training framework: it exists so a newcomer can see a drafter whose tau is clearly
above 1 without downloads. Loss: cross-entropy of slot j against x_{p+j} at random anchors,
weighted by exp(-(j-1)/gamma), gamma = B/2 by default, like DFlash training (early slots matter most
for acceptance).
Run it as ``scorer init OUT --cache C --train-steps N`` or ``scorer.train_drafter``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import hscache
from hscache.data import SequenceDataset
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.errors import ScorerError
from scorer.families.dflash.checkpoint import load_checkpoint, save_hf_checkpoint
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.features import attach_cache_head, context_norm, feature_index
from scorer.families.dflash.init import dflash_config_for_cache
from scorer.families.dflash.model import DFlashDrafter
from scorer.offline.sequences import sequence_features
from scorer.target_identity import IDENTITY_KEY, cache_target_identity
from scorer.training_stop import TrainingInterrupted, stop_on_interrupt, trained_steps

__all__ = ["DFlashTrainConfig", "train_dflash", "training_batch"]


_MEMO_BYTES = 256 * 2**20  # features kept across steps (a small cache's every row), read again past it


def training_batch(
    data: SequenceDataset,
    rows,
    index,
    drafter,
    anchors_per_step: int,
    gen: torch.Generator,
    memo: dict,
    prompt_anchors: bool = True,
):
    """One random sequence, ``anchors_per_step`` random anchors, blocks and targets. A row's token
    ids, target argmax, first generated position and features (the fixed final norm applied) are the
    same at every step: ``memo`` keeps them while they fit in ``_MEMO_BYTES``.

    Anchors lie in the generated region (``loss_mask``; the whole sequence without one), every slot
    against the text, the target's own continuation. With ``prompt_anchors`` they lie anywhere from
    position 1 on, and an anchor inside the prompt trains slot 1 only, against the target's argmax
    there (the token the target would commit next; the prompt's own next token is not it, and the
    target's continuation from there is not cached)."""
    row = rows[int(torch.randint(len(rows), (1,), generator=gen))]
    if row in memo:
        ids, argmax, first, features = memo[row]
    else:
        item = data[row]
        ids, argmax = item["token_ids"], item.get("target_argmax")
        T = len(ids)
        generated = torch.nonzero(item["loss_mask"]).flatten()
        first = int(generated[0]) if len(generated) else T
        first = first if first < T - 1 else 1
        norm = drafter.context_norm  # the drafter reads hidden_states[L] for the last layer (features.py)
        features = sequence_features(item["hidden_states"], index, torch.float32, "cpu", norm)
        held = sum(f.nbytes for *_, f in memo.values())
        if held + features.nbytes <= _MEMO_BYTES:
            memo[row] = (ids, argmax, first, features)
    T, B = len(ids), drafter.config.block_size
    low = 1 if prompt_anchors else first
    anchors = torch.randint(low, T - 1, (anchors_per_step,), generator=gen).unique()
    blocks = torch.full((len(anchors), B), drafter.config.mask_token_id, dtype=torch.long)
    blocks[:, 0] = ids[anchors]
    offsets = anchors[:, None] + torch.arange(1, B)  # [N, B-1] positions p+j
    valid = offsets < T
    targets = torch.where(valid, ids[offsets.clamp(max=T - 1)], torch.full_like(offsets, -100))
    in_prompt = anchors < first
    if in_prompt.any():
        targets[in_prompt, 0] = argmax[anchors[in_prompt]]
        targets[in_prompt, 1:] = -100
    return features, anchors, blocks, targets


# Conventions a fine-tuning run may change (the plants of scorer diagnose's tests); every other
# field, and the number of target layers read, shapes the weights and must match the start's.
_CONVENTIONS = ("mask_token_id", "block_size", "target_layer_ids", "rope_theta", "rope_scaling")


def _start_weights(path: str | Path, want: DFlashConfig, cache) -> dict[str, torch.Tensor]:
    """The weights of the drafter at ``path`` (``init_from``), whose shapes must be ``want``'s."""
    start = load_checkpoint(path, fallbacks={"mask_token_id": cache.mask_token_id})
    differ = [
        f"{f.name} {getattr(start.config, f.name)!r} (this run: {getattr(want, f.name)!r})"
        for f in dataclasses.fields(want)
        if getattr(start.config, f.name) != getattr(want, f.name)
        and (f.name not in _CONVENTIONS or f.name == "target_layer_ids")
        and not (
            f.name == "target_layer_ids" and len(start.config.target_layer_ids) == len(want.target_layer_ids)
        )
    ]
    if differ:
        raise ScorerError(
            f"init_from {path}: its weights do not fit the drafter this run trains: {'; '.join(differ)}; "
            "train the same shape (layer_ids of the same length), or start from random weights"
        )
    return start.state_dict


@dataclass(frozen=True)
class DFlashTrainConfig:
    """The settings of one ``train_dflash`` run (``scorer init --train-steps N``).

    Attributes:
        steps: optimizer steps; lr: AdamW's learning rate; anchors_per_step: random anchors of one
            random sequence per step; seed: of the weights and of the sampling.
        loss_decay_gamma: slot j (1-based) of a block weighs exp(-(j - 1) / gamma) in the loss
            (SpecForge's ``loss_decay_gamma``, specforge/algorithms/common/dflash_family_model.py);
            default block_size / 2: 4 at block 8, NVIDIA Model-Optimizer's ``dflash_loss_decay_factor``
            default for its block 8; 0: every slot weighs 1 (no decay, as in both). Measured on the
            quickstart cache (300 steps, seeds 0/1/2): tau 2.70/2.02/2.18 at gamma 4 against
            1.72/1.67/1.82 at gamma 8 (this trainer's weight before).
        num_layers, block_size: the drafter's shape (its other sizes are the cache's target's).
        log_every: print the loss every N steps (0: never).
        overwrite: replace a non-empty ``out``.
        eval_every: every N steps score the drafter in memory on the cache's first ``eval_limit``
            sequences (0: never; needs ``train_dflash``'s ``evaluate``).
        layer_ids, mask_token_id, block_position_offset, last_layer_normed: train under another
            convention than the spec's (what other trainers do by mistake), for `scorer diagnose`'s
            tests: ``layer_ids`` (default: every cached layer), ``mask_token_id`` (default: the
            cache's), ``block_position_offset`` (added to the block's RoPE positions),
            ``last_layer_normed=False`` (feed the last target layer before the final norm). The saved
            config.json records layer_ids and mask_token_id as trained; the other two have no config
            field, as in the trainers that get them wrong.
        init_from: a DFlash drafter directory to start from instead of random weights (fine-tuning,
            e.g. under another convention: its mask id, block size, layer ids or RoPE may differ
            from this run's; its shapes may not).
        prompt_anchors: also train at anchors inside the prompt, slot 1 against the target's argmax
            there (``training_batch``; needs a cache with target_argmax), as EAGLE-3's trainer trains every
            position. The default since 2026-12-07 (``scorer init --no-prompt-anchors``: generated anchors
            only, as before). Measured on the families recipe (HumanEval 164 x 64 tokens, 600 steps, scored on
            8 held-out prompts, 2026-12-04): without it the drafter ignores its anchor token (slot 1
            right 13% held out, 13% with the anchor token randomised: bench/dflash_anchor.py) and
            tau is 1.148; with it slot 1 is right 33.5% (12.5% randomised) and tau 1.285; at 2,000
            steps 1.540 against 1.13.
    """

    steps: int = 300
    num_layers: int = 1
    block_size: int = 8
    lr: float = 3e-3
    loss_decay_gamma: float | None = None
    anchors_per_step: int = 64
    seed: int = 0
    log_every: int = 50
    overwrite: bool = False
    eval_every: int = 0
    eval_limit: int | None = 64
    layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    block_position_offset: int = 0
    last_layer_normed: bool = True
    init_from: str | Path | None = None
    prompt_anchors: bool = True


def train_dflash(
    cache_path: str | Path,
    out: str | Path,
    config: DFlashTrainConfig = DFlashTrainConfig(),
    *,
    on_step: Callable[[int, float], None] | None = None,
    on_eval: Callable[[int, dict], None] | None = None,
    evaluate: Callable[..., dict] | None = None,
    make: Callable[[DFlashConfig], DFlashDrafter] = DFlashDrafter,
    save: Callable[[Path, DFlashDrafter, dict], None] | None = None,
) -> dict:
    """Train a small drafter on the cache's sequences and save it as an HF directory at ``out``.

    ``make`` builds the drafter from its DFlash config and ``save(staging dir, drafter, extra config)``
    writes it (default: DFlash's HF layout): a later variant (its own heads, its loss terms through the
    drafter's ``training_logits`` / ``auxiliary_loss``) trains with this loop.

    ``out`` is written whole (scorer/drafter_dir.py): a non-empty directory needs
    ``config.overwrite``, and its config records the cache's target (scorer/target_identity.py).
    ``on_step(step, loss)`` is called after every step (progress). With ``config.eval_every`` N > 0,
    every N steps the drafter in memory is scored with ``evaluate`` (``scorer.evaluate_module``,
    which ``scorer.train_drafter`` passes: no file written; chain anchors, no DDTree) and
    ``on_eval(step, report)`` gets the eval report.

    A first Ctrl-C stops after the step in progress and saves the drafter of that step
    (scorer/training_stop.py); its config.json, as every trained one's, records the steps done and
    requested.

    Returns:
        {"config", "steps", "final_loss", "seconds", "tau_history": [(step, pooled tau), ...]}.

    Raises:
        TrainingInterrupted: after saving, when Ctrl-C stopped the training early.
    """
    check_drafter_dir(out, config.overwrite)  # before the training, not after it
    if config.loss_decay_gamma is not None and config.loss_decay_gamma < 0:
        raise ScorerError(
            f"loss_decay_gamma {config.loss_decay_gamma} is negative: pass a positive decay, 0 for none, "
            "or leave it unset (block size / 2)"
        )
    if config.eval_every and evaluate is None:
        raise ScorerError("eval_every needs the evaluate function (scorer.train_drafter passes it)")
    cache = hscache.open_cache(cache_path)
    drafter_config = dflash_config_for_cache(
        cache,
        num_layers=config.num_layers,
        block_size=config.block_size,
        layer_ids=config.layer_ids,
        mask_token_id=config.mask_token_id,
    )  # a cache without target/ is refused here, before what prompt anchors need
    if config.prompt_anchors and "target_argmax" not in cache.specs:
        raise ScorerError(
            f"--prompt-anchors trains slot 1 against the target's argmax, which {cache_path} does not hold: "
            "extract the cache again without dropping target_argmax, or pass --no-prompt-anchors "
            "(prompt_anchors=False: generated anchors only)"
        )
    torch.manual_seed(config.seed)
    drafter = make(drafter_config)
    # Fan-in init (std 1/sqrt(hidden)). At N(0, 0.02), 4.4x smaller at hidden 128, the drafter sat
    # for hundreds of steps on a saddle where it drafts one constant token at every anchor (tau ~1.2
    # on a trained target); at fan-in it leaves it within 300 steps on every seed measured.
    for param in drafter.parameters():
        if param.ndim == 2:
            torch.nn.init.normal_(param, std=drafter_config.hidden_size**-0.5)
    if config.init_from is not None:
        drafter.load_state_dict(_start_weights(config.init_from, drafter_config, cache))
    attach_cache_head(drafter, cache, torch.float32, "cpu")
    drafter.context_norm = context_norm(drafter_config, cache) if config.last_layer_normed else None
    drafter.block_position_offset = config.block_position_offset
    index = feature_index(drafter_config, cache.layer_ids)
    # Training reads through hscache.data, the same bytes (and reader) the scorer reads.
    data = SequenceDataset(cache_path)
    rows = [i for i in range(len(cache)) if cache.index.column("length")[i].as_py() > 2]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=0.0, foreach=True)
    gamma = config.block_size / 2 if config.loss_decay_gamma is None else config.loss_decay_gamma
    slots = torch.arange(config.block_size - 1)
    slot_weight = torch.exp(-slots / gamma) if gamma else torch.ones(len(slots))  # 0: no decay
    gen = torch.Generator().manual_seed(config.seed)
    t0, loss, tau_history = time.perf_counter(), torch.tensor(0.0), []
    memo: dict = {}
    done = 0
    with stop_on_interrupt() as stop:  # Ctrl-C: finish the step in progress, save, say so
        for step in range(1, config.steps + 1):
            features, anchors, blocks, targets = training_batch(
                data, rows, index, drafter, config.anchors_per_step, gen, memo, config.prompt_anchors
            )
            hidden = drafter(features, anchors, blocks)  # [N, B-1, H]
            logits = drafter.training_logits(hidden, blocks[:, 0], targets)  # [N, B-1, V]
            per_slot = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
            weights = slot_weight[None] * (targets != -100)
            loss = (per_slot * weights).sum() / weights.sum()
            extra_loss = drafter.auxiliary_loss(hidden, blocks[:, 0], targets, logits)
            if extra_loss is not None:
                loss = loss + extra_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if config.log_every and step % config.log_every == 0:
                print(f"step {step}/{config.steps} loss {loss.item():.3f}", flush=True)
            if on_step is not None:
                on_step(step, float(loss.detach()))
            if config.eval_every and step % config.eval_every == 0:
                report = evaluate(drafter, cache, limit=config.eval_limit)  # a copy, in eval mode
                tau_history.append((step, report["tau"]["pooled"]))
                if on_eval is not None:
                    on_eval(step, report)
            done = step
            if stop.requested:
                break
    weights = {k: v.detach() for k, v in drafter.state_dict().items()}
    extra = {IDENTITY_KEY: cache_target_identity(cache), **trained_steps(done, config.steps)}
    with staged_drafter_dir(out, config.overwrite) as staging:
        if save is None:
            save_hf_checkpoint(staging, drafter_config, weights, extra_config=extra)
        else:
            save(staging, drafter, extra)
    if done < config.steps:
        raise TrainingInterrupted(done, config.steps, out)
    return {
        "config": drafter.config,
        "steps": config.steps,
        "final_loss": float(loss.detach()),
        "seconds": time.perf_counter() - t0,
        "tau_history": tau_history,
    }
