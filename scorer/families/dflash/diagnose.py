"""``scorer diagnose`` for DFlash drafters: every DFlash-specific part of the diagnosis.

`Setting` is one way to replay the drafter (its config plus the knobs a trainer may have set
differently: block RoPE offset, last layer before/after the final norm, dtype, a layer ablated,
drift noise, the second cache, a variant's own knob). `candidates` turns the baseline setting and
what the cache knows into the hypotheses of the family's ``diagnose_kinds``; `DFlashReplayer`
replays every setting on the sampled sequences, sharing one drafter pass (features, context) among
the hypotheses that keep the drafter's inputs, and returns per-request totals. `diagnose` is the
family's hook (``Family.diagnose``): a family built on DFlash (DFlash2) calls it with its own
drafter builder, weights, block drafting and extra hypotheses, and DFlash names none of its members.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import head_rows, row_chunks
from hscache.store import jsonio
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.diagnose.ranking import (
    DiagnosisInputs,
    FamilyDiagnosis,
    Hypothesis,
    final_norm_alternative,
    shifted_layer_ids,
)
from scorer.families.dflash import DFLASH_KINDS
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.features import check_compatible, context_norm, feature_index
from scorer.families.dflash.model import DFlashDrafter
from scorer.families.dflash.score import score_dflash_sequences_chain
from scorer.formats.files import read_training_state_contract
from scorer.metrics import AcceptLen, request_totals, train_accept_len
from scorer.offline.replay import RoundLog, replay_chain
from scorer.offline.sequences import sequence_features

__all__ = [
    "COMMON_ROPE_THETAS",
    "DFLASH_KINDS",
    "DFlashReplayer",
    "Setting",
    "candidates",
    "diagnose",
    "recorded_block_sizes",
    "special_token_ids",
]

COMMON_ROPE_THETAS = (10_000.0, 1_000_000.0)  # Llama/Qwen2 and Qwen3 defaults
POSITION_SHIFTS = (-2, -1, 1, 2)
LAYER_SHIFTS = (-1, 1)  # z-lab ids vs vLLM/speculators ids (+1)
MAX_MASK_CANDIDATES = 32
_TOKENS_PER_GROUP = 2048  # sequences scored in lockstep per forward group (memory bound)


@dataclass(frozen=True)
class Setting:
    """How to replay: the drafter config and the knobs no config records.

    ``last_layer_normed``: the last target layer read after (True) or before (False) the target's
    final norm; None when the drafter does not read the last layer. ``noise``: (target layer id,
    relative L2) pairs of Gaussian noise added to the cached states (the drift hypothesis).
    ``variant``: a family built on DFlash, its own knob (DFlash2: the selector), read by the build
    and block-drafting functions it hands `DFlashReplayer`; it must change only how a block's drafts
    are read off its hidden rows (no sharing key includes it).
    """

    config: DFlashConfig
    dtype: str
    block_position_offset: int = 0
    last_layer_normed: bool | None = None
    ablate_layer: int | None = None
    noise: tuple[tuple[int, float], ...] = ()
    cache: int = 0
    variant: Any = None


def special_token_ids(tokenizer: Any, vocab_size: int) -> dict[int, str]:
    """The tokenizer's special tokens (id -> text) inside the vocabulary: the mask id candidates."""
    out: dict[int, str] = {}
    for token_id, token in zip(
        getattr(tokenizer, "all_special_ids", []), getattr(tokenizer, "all_special_tokens", [])
    ):
        out[int(token_id)] = str(token)
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            out.setdefault(int(token_id), str(added))
    return {i: t for i, t in sorted(out.items()) if 0 <= i < vocab_size}


def _shift_label(n: int, what: str) -> str:
    return f"{what} shifted by {n:+d}"


def candidates(
    base: Setting,
    cache: CacheView,
    kinds: Sequence[str],
    *,
    mask_ids: dict[int, str],
    block_sizes: Sequence[int] = (),
    second_cache: str | None = None,
    drift: tuple[tuple[int, float], ...] = (),
) -> Iterator[tuple[Hypothesis, Setting | str]]:
    """The hypotheses of ``kinds`` for this drafter and cache, each with its Setting, or with a
    sentence saying why it cannot be tested here (and what would test it).

    Args:
        mask_ids: id -> token text of the mask candidates (special tokens, recorded ids).
        block_sizes: block sizes recorded somewhere other than where the configured one came from.
        second_cache: the ``--cache C2`` path, if any; ``drift`` its measured per-layer relative L2.
    """
    c = base.config
    n_layers = cache.target_config.get("num_hidden_layers")
    replace = dataclasses.replace
    if "position_offset" in kinds:
        for k in POSITION_SHIFTS:
            hyp = Hypothesis("position_offset", k, _shift_label(k, "block positions"))
            yield hyp, replace(base, block_position_offset=base.block_position_offset + k)
    if "layer_ids" in kinds:
        for k in LAYER_SHIFTS:
            ids = shifted_layer_ids(c.target_layer_ids, k, cache)
            shown = [i + k for i in c.target_layer_ids]
            hyp = Hypothesis("layer_ids", k, _shift_label(k, "target layer ids") + f" ({shown})")
            if isinstance(ids, str):
                yield hyp, ids
            else:
                normed = base.last_layer_normed if n_layers is None or n_layers - 1 in ids else None
                if normed is None and n_layers is not None and n_layers - 1 in ids:
                    normed = True
                yield hyp, replace(base, config=replace(c, target_layer_ids=ids), last_layer_normed=normed)
    if "final_norm" in kinds:
        if base.last_layer_normed is None:
            hyp = Hypothesis("final_norm", None, "last target layer before/after the final norm")
            yield hyp, f"the drafter does not read the last target layer ({(n_layers or 0) - 1})"
        else:
            hyp, alt = final_norm_alternative(base.last_layer_normed, cache, "last target layer")
            yield hyp, alt if isinstance(alt, str) else replace(base, last_layer_normed=alt)
    if "mask_token_id" in kinds:
        others = [i for i in mask_ids if i != c.mask_token_id][:MAX_MASK_CANDIDATES]
        if not others:
            yield (
                Hypothesis("mask_token_id", None, "another mask token id"),
                "the tokenizer has no other special token",
            )
        for i in others:
            yield (
                Hypothesis("mask_token_id", i, f"mask token id {i} ({mask_ids[i]})"),
                replace(base, config=replace(c, mask_token_id=i)),
            )
    if "rope_theta" in kinds:
        target = cache.target_config.get(
            "rope_theta", (cache.target_config.get("rope_parameters") or {}).get("rope_theta")
        )
        thetas = sorted(
            {float(t) for t in (target, *COMMON_ROPE_THETAS) if t is not None} - {float(c.rope_theta)}
        )
        for theta in thetas:
            hyp = Hypothesis(
                "rope_theta", theta, f"rope_theta {theta:g}" + (" (the target's)" if theta == target else "")
            )
            yield hyp, replace(base, config=replace(c, rope_theta=theta))
    if "block_size" in kinds:
        sizes = sorted({int(b) for b in block_sizes} - {c.block_size})
        if not sizes:
            hyp = Hypothesis("block_size", None, "another block size")
            yield hyp, "no other block size is recorded (config, dflash_config and training_state agree)"
        for b in sizes:
            yield (
                Hypothesis("block_size", b, f"block size {b}"),
                replace(base, config=replace(c, block_size=b)),
            )
    if "dtype" in kinds:
        other = "bf16" if base.dtype != "bf16" else "fp32"
        yield Hypothesis("dtype", other, f"replayed in {other}"), replace(base, dtype=other)
        if second_cache is not None:
            yield (
                Hypothesis(
                    "dtype", f"cache:{second_cache}", "the same drafter on the second cache", fix=False
                ),
                replace(base, cache=1),
            )
            yield (
                Hypothesis("dtype", "drift-noise", "the second cache's measured drift as noise", fix=False),
                replace(base, noise=drift),
            )
    if "feature_ablation" in kinds:
        for layer in c.target_layer_ids:
            hyp = Hypothesis(
                "feature_ablation", layer, f"target layer {layer} replaced by its mean", fix=False
            )
            yield hyp, replace(base, ablate_layer=layer)


class DFlashReplayer:
    """Replays Settings over fixed sequences of one or two caches (rows aligned by record id).

    ``rows[c]`` lists the candidate rows of cache ``c`` in sampling order; a replay names the
    positions in those lists it covers, so a sample can grow without replaying what it has.

    ``anchors="all"`` (the default) is one drafter pass per distinct drafter input, shared by
    every hypothesis that does not change it: sequence by sequence, the features are built once
    per feature variant (layer ids, final norm, ablation, noise, dtype, cache), the context's
    keys and values once per context variant (those and the RoPE settings: the position-offset,
    mask-id and block-size hypotheses reuse the baseline's), then each setting drafts every anchor
    in a few large forwards and both the chain replay and the training-log accept length are read
    off those drafts. ``anchors="chain"`` drafts only where each replay goes, one small forward per
    sequence per round (``scorer eval --anchors chain``): 1/tau of the block work, but thousands of
    calls whose fixed cost dominates on CPU (docs/diagnose.md, bench/diagnose.py).
    The target head and the drafter weights are held once per dtype and shared by every drafter.
    """

    def __init__(
        self,
        loaded: Any,
        caches: Sequence[CacheView],
        rows: Sequence[Sequence[int]],
        *,
        device: str = "cpu",
        memory_gb: float = 2.0,
        max_blocks_per_forward: int = 64,
        seed: int = 0,
        anchors: str = "all",
        build: Callable[[Setting], DFlashDrafter] | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        draft_blocks: Callable[[Setting, DFlashDrafter, torch.Tensor, torch.Tensor], torch.Tensor]
        | None = None,
    ) -> None:
        if anchors not in ("all", "chain"):
            raise ValueError(f"anchors {anchors!r}; choose 'all' or 'chain'")
        self.anchors = anchors
        self.loaded, self.caches, self.rows = loaded, list(caches), [list(r) for r in rows]
        self.device, self.memory_gb, self.max_blocks, self.seed = (
            device,
            memory_gb,
            max_blocks_per_forward,
            seed,
        )
        # setting -> an unloaded drafter (a family built on DFlash: its own class around the backbone)
        self.build = build or (lambda setting: DFlashDrafter(setting.config))
        # (setting, drafter, block hidden rows [n, B-1, H], slot-0 tokens [n]) -> drafts [n, B-1]; None:
        # the per-slot argmax (DFlash), in head chunks as scorer eval drafts it
        self.draft_blocks = draft_blocks
        self.weights = loaded.state_dict if weights is None else weights
        self._heads: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._weights: dict[str, dict[str, torch.Tensor]] = {}

    def _head(self, dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if dtype not in self._heads:
            own = self.loaded.head
            head = self.caches[0].target_head() if {"embed_tokens", "lm_head"} - own.keys() else {}
            head = {**head, **own}
            torch_dtype = DTYPES[dtype]
            embed = head["embed_tokens"].to(device=self.device, dtype=torch_dtype)
            lm_head = (
                embed
                if head["lm_head"] is head["embed_tokens"]
                else head["lm_head"].to(device=self.device, dtype=torch_dtype)
            )
            d2t = head.get("d2t")
            self._heads[dtype] = (embed, lm_head, None if d2t is None else d2t.to(self.device))
        return self._heads[dtype]

    def _state_dict(self, dtype: str) -> dict[str, torch.Tensor]:
        # Cast once per dtype; every drafter of that dtype holds these tensors (load_state_dict
        # with assign=True), so a dozen hypotheses cost one copy of the weights, not a dozen.
        if dtype not in self._weights:
            torch_dtype = DTYPES[dtype]
            self._weights[dtype] = {
                k: v.to(device=self.device, dtype=torch_dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in self.weights.items()
            }
        return self._weights[dtype]

    def drafter(self, setting: Setting) -> DFlashDrafter:
        """The drafter of ``setting``: the loaded weights under its config, head attached."""
        drafter = self.build(setting)
        drafter.load_state_dict(self._state_dict(setting.dtype), assign=True)
        drafter = drafter.to(device=self.device, dtype=DTYPES[setting.dtype]).eval()
        drafter.attach_target(*self._head(setting.dtype))
        drafter.block_position_offset = setting.block_position_offset
        cache = self.caches[setting.cache]
        drafter.context_norm = context_norm(setting.config, cache) if setting.last_layer_normed else None
        return drafter

    def features(self, setting: Setting, row: int) -> torch.Tensor:
        """``[T, K*H]`` features of one sampled row under ``setting`` (noise, ablation applied)."""
        cache = self.caches[setting.cache]
        states = cache.hidden_states(row)
        if setting.noise:
            stored_dtype, states = states.dtype, states.float().clone()
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
            for layer, rel in setting.noise:
                if layer in cache.layer_ids:
                    slot = cache.layer_ids.index(layer)
                    x = states[:, slot]
                    scale = rel * x.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5
                    states[:, slot] = x + scale * torch.randn(x.shape, generator=gen)
            states = states.to(stored_dtype)
        index = feature_index(setting.config, cache.layer_ids)
        norm = context_norm(setting.config, cache) if setting.last_layer_normed else None
        feats = sequence_features(states, index, DTYPES[setting.dtype], self.device, norm)
        if setting.ablate_layer is not None:
            k = setting.config.num_features
            slot = setting.config.target_layer_ids.index(setting.ablate_layer)
            view = feats.view(feats.shape[0], k, -1)
            view[:, slot] = view[:, slot].mean(dim=0, keepdim=True)
        return feats

    def replay(self, setting: Setting, *, all_anchors: bool | None = None) -> tuple[np.ndarray, float | None]:
        """Per-request (tokens, rounds) ``[R, 2]`` over every row, and with all anchors drafted
        the training-log accept length (else None). ``all_anchors`` overrides ``anchors``."""
        anchors = self.anchors if all_anchors is None else ("all" if all_anchors else "chain")
        ((totals, accept),) = self.replay_many(
            [setting], range(len(self.rows[setting.cache])), anchors=anchors
        )
        return totals, None if accept is None else accept.mean

    def replay_many(
        self,
        settings: Sequence[Setting],
        positions: Sequence[int],
        *,
        anchors: str | None = None,
        on_sequence: Callable[[int, int], None] | None = None,
    ) -> list[tuple[np.ndarray, AcceptLen | None]]:
        """Replay every setting on the rows at ``positions`` (of each setting's cache row list).

        Returns:
            per setting, ``([len(positions), 2]`` (tokens, rounds) per request in position order,
            the training-log AcceptLen summed over them, or None with chain anchors).
        """
        anchors = anchors or self.anchors
        positions = list(positions)
        if anchors == "chain" and self.draft_blocks is None:  # a variant's drafting: every anchor
            return [(self._replay_chain(s, positions), None) for s in settings]
        drafters = [self.drafter(s) for s in settings]
        logs: list[list[RoundLog]] = [[] for _ in settings]
        accept = [AcceptLen(0, 0) for _ in settings]
        by_features: dict[tuple, list[int]] = {}
        for j, s in enumerate(settings):
            by_features.setdefault(_features_key(s), []).append(j)
        for n, i in enumerate(positions):
            if on_sequence:
                on_sequence(n, len(positions))
            for members in by_features.values():
                first = settings[members[0]]
                cache, row = self.caches[first.cache], self.rows[first.cache][i]
                token_ids = cache.token_ids(row)
                x, a = token_ids.numpy(), cache.target_argmax(row).numpy()
                prompt_len = cache.index.column("prompt_len")[row].as_py()
                feats = self.features(first, row)
                by_context: dict[tuple, list[int]] = {}
                for j in members:
                    by_context.setdefault(_context_key(settings[j]), []).append(j)
                for group in by_context.values():
                    context = None
                    for j in group:
                        if len(x) - 1 - prompt_len > 0 and context is None:
                            # rows 0..T-3 are all any anchor (<= T-2) sees; as score.py's _Drafts
                            context = drafters[j].context_kv(feats[: max(len(x) - 2, 1)])
                        draft = self._draft_every_anchor(
                            drafters[j], feats, token_ids, prompt_len, context, settings[j]
                        )
                        B = settings[j].config.block_size
                        logs[j].append(replay_chain(draft, x, a, prompt_len, B))
                        accept[j] = accept[j] + train_accept_len(draft, x, a, prompt_len)
        return [(request_totals(log), acc) for log, acc in zip(logs, accept)]

    def _draft_every_anchor(
        self,
        drafter: DFlashDrafter,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        prompt_len: int,
        context: list[tuple[torch.Tensor, torch.Tensor]] | None,
        setting: Setting | None = None,
    ) -> np.ndarray:
        """Drafts ``[A, B-1]`` at anchors P..T-2, grouped and head-chunked exactly as
        ``scorer.score.draft_all_anchors`` does (so the numbers are scorer eval's), from a context
        computed once per context variant."""
        c = drafter.config
        B = c.block_size
        anchors = np.arange(prompt_len, len(token_ids) - 1)
        if len(anchors) == 0:
            return np.zeros((0, B - 1), dtype=np.int64)
        rows = head_rows(c.vocab_size, self.memory_gb)
        group = self.max_blocks * max(1, rows // ((B - 1) * self.max_blocks))
        ids = token_ids.to(features.device)
        parts = []
        for lo in range(0, len(anchors), group):
            at = torch.as_tensor(anchors[lo : lo + group], dtype=torch.long, device=features.device)
            blocks = torch.full((len(at), B), c.mask_token_id, dtype=torch.long, device=features.device)
            blocks[:, 0] = ids[at]
            hidden = drafter.block_hidden(
                features, at, blocks, max_blocks_per_forward=self.max_blocks, context=context
            )
            if self.draft_blocks is not None:  # a variant's own drafting (DFlash2: its selector)
                parts.append(self.draft_blocks(setting, drafter, hidden, blocks[:, 0]).reshape(-1))
                continue
            flat = hidden.reshape(-1, hidden.shape[-1])
            for start, stop, new in row_chunks(flat.shape[0], rows):
                parts.append(drafter.head(flat[start:stop])[new - start :].float().argmax(-1))
        return torch.cat(parts).reshape(len(anchors), B - 1).cpu().numpy()

    def _replay_chain(self, setting: Setting, positions: list[int]) -> np.ndarray:
        drafter = self.drafter(setting)
        cache = self.caches[setting.cache]
        prompt_lens = cache.index.column("prompt_len")
        logs: list[RoundLog] = []
        group: list[dict] = []
        tokens = 0
        for n, i in enumerate(positions):
            row = self.rows[setting.cache][i]
            group.append(
                {
                    "features": self.features(setting, row),
                    "token_ids": cache.token_ids(row),
                    "target_argmax": cache.target_argmax(row),
                    "prompt_len": prompt_lens[row].as_py(),
                    "row": row,
                }
            )
            tokens += len(group[-1]["token_ids"])
            if tokens >= _TOKENS_PER_GROUP or n == len(positions) - 1:
                results = score_dflash_sequences_chain(
                    drafter, group, max_blocks_per_forward=self.max_blocks, memory_gb=self.memory_gb
                )
                logs.extend(r.chain for r in results)
                group, tokens = [], 0
        return request_totals(logs)


def _checkpoint_dir(checkpoint: str | Path) -> Path:
    root = Path(checkpoint)
    return root if root.is_dir() else root.parent


def recorded_block_sizes(checkpoint: str | Path, contract: dict | None = None) -> list[int]:
    """Block sizes a checkpoint records besides the configured one: config.json's top-level and
    ``dflash_config`` values and a SpecForge training_state.pt contract (read here unless given)."""
    root = _checkpoint_dir(checkpoint)
    sizes = []
    config_file = root / "config.json"
    if config_file.is_file():
        try:
            config = jsonio.loads(config_file.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = {}
        for value in (config.get("block_size"), (config.get("dflash_config") or {}).get("block_size")):
            if isinstance(value, int) and value >= 2:
                sizes.append(value)
    if contract is None:
        contract, _ = read_training_state_contract(root, trust=False)
    if contract and contract.get("block_size"):
        sizes.append(int(contract["block_size"]))
    return sizes


def diagnose(
    inputs: DiagnosisInputs,
    *,
    kinds: Sequence[str] = DFLASH_KINDS,
    build: Callable[[Setting], DFlashDrafter] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    draft_blocks: Callable[[Setting, DFlashDrafter, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    variant_candidates: Callable[[Setting], Iterator[tuple[Hypothesis, Setting | str]]] | None = None,
) -> FamilyDiagnosis:
    """``Family.diagnose`` of DFlash; a family built on it passes its ``kinds``, ``build``,
    ``weights``, ``draft_blocks`` (see `DFlashReplayer`) and ``variant_candidates`` (its own
    hypotheses, from the configured setting). The drafter as loaded, the mask ids the tokenizer and
    a training state suggest, the block sizes recorded elsewhere, and the replayer over the rows.

    Raises:
        IncompatibleCacheError: the second cache does not fit the drafter.
    """
    loaded, options, cache = inputs.loaded, inputs.options, inputs.caches[0]
    if inputs.second_cache is not None:
        check_compatible(loaded.config, inputs.caches[1], inputs.second_cache)
    last_layer = inputs.last_layer
    base = Setting(
        config=loaded.config,
        dtype=options.dtype,
        last_layer_normed=(inputs.drafter.context_norm is not None)
        if last_layer in loaded.config.target_layer_ids
        else None,
    )
    replayer = DFlashReplayer(
        loaded,
        inputs.caches,
        inputs.rows,
        device=options.device,
        memory_gb=options.memory_gb,
        max_blocks_per_forward=options.max_blocks_per_forward,
        seed=options.seed,
        anchors=options.anchors,
        build=build,
        weights=weights,
        draft_blocks=draft_blocks,
    )
    contract = (
        read_training_state_contract(_checkpoint_dir(inputs.checkpoint), options.trust_checkpoint)[0] or {}
    )
    mask_ids = special_token_ids(cache.tokenizer(), loaded.config.vocab_size)
    for extra, why in (
        (cache.mask_token_id, "the cache's mask"),
        (contract.get("mask_token_id"), "training_state.pt"),
    ):
        if extra is not None and 0 <= int(extra) < loaded.config.vocab_size:
            mask_ids.setdefault(int(extra), why)
    found = candidates(
        base,
        cache,
        kinds,
        mask_ids=mask_ids,
        block_sizes=recorded_block_sizes(inputs.checkpoint, contract),
        second_cache=inputs.second_cache,
        drift=inputs.drift,
    )
    more = list(variant_candidates(base)) if variant_candidates is not None else []
    return FamilyDiagnosis(base, [*found, *more], replayer.replay_many, replayer)


def _features_key(s: Setting) -> tuple:
    """What the drafter's input features depend on: settings with equal keys share them."""
    return (s.cache, tuple(s.config.target_layer_ids), s.last_layer_normed, s.ablate_layer, s.noise, s.dtype)


def _context_key(s: Setting) -> tuple:
    """What the context keys/values depend on besides the features: every config field but the
    mask id and block size (block-only inputs); the RoPE offset applies to the block alone."""
    fields = [(f.name, repr(getattr(s.config, f.name))) for f in dataclasses.fields(s.config)]
    return (_features_key(s), tuple(kv for kv in fields if kv[0] not in ("mask_token_id", "block_size")))
