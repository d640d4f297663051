"""What a drafter family plugs into the scorer: the seam shared by every family.

The scorer owns ONE replay loop (scorer.offline.replay: rounds, tau, off-greedy cuts), ONE report
(scorer.report.build) and ONE loader entry point (scorer.offline.scoring.load_drafter). A family owns the
rest, in its own module under scorer/families/: how a checkpoint of its layouts is recognised
(`claims`), its config mapping and model (`load`), and how it drafts a cached sequence
(`score_rows`, which hands per-anchor drafts to the shared replay).

A loaded drafter is a `Drafter`: it carries ``family`` (the family's name) so the shared code can
dispatch, and a ``config`` (`DrafterSettings`) with ``block_size`` (drafted slots + 1: DFlash's
block, or K + 1 for a chain of K speculative tokens), ``target_layer_ids`` (this project's
convention: the OUTPUT of decoder layer i) and ``to_hf_config()`` (written into the report as
``drafter``).

A family also owns how a drafter of it is made (``init`` / ``train``: what ``scorer init --family
F`` runs, with the family's own ``init_options``), its name on screen (``display_name``), the
``scorer eval`` settings it reads (``eval_options``: a flag outside them is refused by name), the
command-line settings only it reads (``flags``: the scoring commands take them from the registry) and
its ``scorer diagnose`` hypotheses (``diagnose_kinds`` and the ``diagnose`` hook).

A family's package (``scorer/families/<name>/__init__.py``) declares its row with plain data and binds
its functions with `lazy`, so importing the registry imports no torch (``scorer --help`` reads the
rows' flags without loading a model library).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hscache.store import jsonio

__all__ = [
    "CheckpointProbe",
    "DecoderDims",
    "check_new_drafter_sizes",
    "check_scored_sizes",
    "longest_sequence",
    "DraftDraw",
    "Drafter",
    "DrafterSettings",
    "Family",
    "FamilyFlag",
    "LazyFunction",
    "Loaded",
    "OnlineOptions",
    "Proposer",
    "TARGET_PREFIX",
    "VllmServing",
    "attention_flops",
    "checkpoint_model",
    "lazy",
    "lazy_functions",
    "linear_params",
    "target_head_name",
]

# A CKPT naming a head that ships inside the cache's target (e.g. "target:mtp").
TARGET_PREFIX = "target:"


def target_head_name(checkpoint: str | Path) -> str | None:
    """The head a ``target:<head>`` CKPT names (``"mtp"`` for ``target:mtp``), else None: the one
    place that form is parsed."""
    text = str(checkpoint)
    return text[len(TARGET_PREFIX) :] if text.startswith(TARGET_PREFIX) else None


@runtime_checkable
class DrafterSettings(Protocol):
    """What the shared code reads off any family's drafter config."""

    block_size: int  # drafted slots + 1
    target_layer_ids: tuple[int, ...]

    def to_hf_config(self) -> dict[str, Any]: ...


@runtime_checkable
class Drafter(Protocol):
    """A loaded drafter of any family, as the shared code (report, compare, eval) sees it."""

    family: str
    config: DrafterSettings


@dataclass(frozen=True)
class Loaded:
    """What a family's ``load`` returns beside the drafter, for the shared report: the drafter's config as
    it was resolved and its ``LoadReport`` (files, digests, where each field came from)."""

    config: Any
    report: Any


@dataclass(frozen=True)
class DecoderDims:
    """The decoder dimensions every transformer drafter's config starts with, as HF ``config.json``
    names them; a family's config dataclass adds its own fields after them."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int

    def check_attention_heads(self) -> None:
        """Refuse query heads that the key/value heads do not divide into equal groups (GQA)."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )


@dataclass(frozen=True)
class CheckpointProbe:
    """What families look at to claim a checkpoint, read once and cheaply (no weights loaded).

    Attributes:
        path: the checkpoint as given (a path, or ``target:<head>``).
        config: the parsed ``config.json`` beside the weights, or the ``--config`` file, or None.
        weight_keys: tensor names of a safetensors checkpoint (from the headers), else None.
    """

    path: str
    config: dict[str, Any] | None
    weight_keys: frozenset[str] | None


# draw(logits [V] of one draft slot over the TARGET's vocabulary, float32, -inf outside a reduced
# draft vocabulary) -> the drafted token id. ``scorer online`` at T > 0 with probabilistic drafting
# passes one (scorer.online.sampled: a sample of softmax(logits / T), q recorded for the verifier).
DraftDraw = Callable[[Any], int]

# propose(hidden [p, K, H] raw target layer outputs in the drafter's layer order for positions
# 0..p-1, token ids 0..p, anchor p, draw: DraftDraw | None = None) -> the drafted token ids d_1..d_k
# (``scorer online``). Without ``draw`` each slot is the argmax; with it, each slot's token is
# ``draw(slot logits)`` and a chain drafter feeds THAT token to its next step (vLLM's probabilistic
# ``draft_sample_method``). A proposer that cannot draw this way raises ScorerError when given one.
# A proposer that takes ``tree`` (steps, topk, tokens) returns SGLang's EAGLE tree at p instead
# (``scorer.families.autoregressive.EagleTree``, ``scorer online --tree``): EAGLE-3 and MTP.
Proposer = Callable[..., Any]


@dataclass(frozen=True)
class OnlineOptions:
    """What ``scorer online`` passes a family's online loader besides the checkpoint and target."""

    overrides: dict[str, Any]
    trust_checkpoint: bool = False
    config_path: str | None = None
    num_speculative_tokens: int | None = None
    device: str = "cpu"


class LazyFunction:
    """A family's function named by module and attribute, imported on its first call.

    It keeps the function's name (``__name__``, ``__qualname__``, ``__module__``) without importing
    it; its docstring and signature (``__doc__``, ``__wrapped__``) import it when asked for.
    """

    def __init__(self, module: str, name: str) -> None:
        self.__module__, self.__name__, self.__qualname__ = module, name, name
        self._function: Callable[..., Any] | None = None

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # functools.wraps' name: inspect.signature follows it
        if self._function is None:
            self._function = getattr(importlib.import_module(self.__module__), self.__name__)
        return self._function

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__wrapped__.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # pickled by its name, never its module
        return (LazyFunction, (self.__module__, self.__name__))

    def __repr__(self) -> str:
        return f"lazy({self.__module__!r}, {self.__name__!r})"


def lazy(module: str, name: str) -> LazyFunction:
    """``module``'s function ``name``, imported when first called: how a family's row binds the
    functions of its heavy modules (torch and the model code) without importing them."""
    return LazyFunction(module, name)


def lazy_functions(module: str, *names: str) -> dict[str, LazyFunction]:
    """The row fields ``name=lazy(module, name)`` for each of ``names``: how a row binds, in one line,
    the functions of its seam that bear the fields' own names (``claims``, ``load``, ``cost``...)."""
    return {name: lazy(module, name) for name in names}


@dataclass(frozen=True)
class FamilyFlag:
    """A command-line setting that one family reads (the n-gram proposer's ``--prompt-lookup-min``).

    The scoring commands (eval, compare, online) take it as ``--<name with dashes>``, default None (not
    given), and pass a value given to the family as ``EvalConfig.overrides[name]``; a family that does
    not list it refuses it by name. Plain data: the CLI makes the click option (scorer.cli.shared).

    Attributes:
        name: the setting's name, an ``EvalConfig.overrides`` key (``prompt_lookup_min``).
        type: ``int``, ``float`` or ``str``.
        help: the option's help text.
        minimum: the smallest value allowed (numbers only), None for no bound.
    """

    name: str
    type: type
    help: str
    minimum: int | float | None = None

    @property
    def flag(self) -> str:
        """The option as typed on the command line (``--prompt-lookup-min``)."""
        return "--" + self.name.replace("_", "-")


def checkpoint_model(checkpoint: str | Path, drafter: Any) -> dict[str, Any]:
    """``VllmServing.settings`` of a drafter vLLM loads from its checkpoint: ``{"model": its absolute path}``."""
    return {"model": str(Path(checkpoint).resolve())}


@dataclass(frozen=True)
class VllmServing:
    """How vLLM 0.32.0 serves a family's drafters: all that ``scorer served`` (scorer.studies.vllm_judge)
    and the engine worker (hscache/engines/vllm/worker.py, run in vLLM's interpreter) need, so that
    neither names a family. The worker imports nothing of the scorer: what it must do differently for a
    family reaches it as data in its job's engine entry (``unrecorded_steps``, ``start_rank``, ``max_num_seqs``,
    ``engine_per_run``, ``unrecorded_from_proposals``).

    Attributes:
        method: vLLM's speculative method (``speculative_config["method"]``).
        settings: (checkpoint, drafter) -> the ``speculative_config`` keys besides ``method`` and
            ``num_speculative_tokens``: ``checkpoint_model`` for a drafter vLLM loads from the
            checkpoint, a proposer's own settings for one without weights; None: none.
        k_sets_block: vLLM drafts a block of K + 1 (K its ``num_speculative_tokens``): a K given
            reloads the drafter with ``block_size`` K + 1, so both sides draft the same block; without
            it, K is the drafter's block size - 1 either way.
        drafter_attention: the drafter's own attention runs in vLLM CPU's kernels: its config
            (``to_hf_config()``) meets the limits a target does (hscache.engines.vllm.runtime
            .preflight_target), checked before vLLM starts.
        unrecorded_steps: (speculative_config, max_model_len) -> the worker's ``unrecorded_steps``
            entry ``{"proposer": "module:function", "args": [...]}``: vLLM takes a plain decode step,
            and records none, where ``function(context as int32 array, *args)`` proposes no token;
            None: vLLM records every step.
        start_rank: the worker builds its engines in ascending rank (ties in the job's order); a
            family whose engine leaves the process unable to build another one ranks after the rest.
        sequential_requests: its proposer keeps state across requests (what one drafts depends on those
            served before it): the worker serves its requests one at a time in the cache's row order
            (vLLM's ``max_num_seqs`` 1), each run (one cache's requests) in an engine of its own, as the
            family's offline replay assumes.
        proposals_recorded: the steps vLLM takes without recording them (its proposer drafted nothing) are
            placed from the proposer's own drafts, which the worker records per request and step
            (hscache/engines/vllm/draft_record.py), not from a function of the context (``unrecorded_steps``).
        cpu_refusal: why vLLM CPU 0.32.0 (the judge's build) will not build this family's engine, in one
            line with vLLM's own error and where it is raised (file:line); ``scorer served`` says it by
            name before vLLM starts. None: vLLM CPU serves it. ``method`` and ``settings`` still say how
            a vLLM that runs it (a GPU build) is configured.
    """

    method: str
    settings: Callable[[str, Any], dict[str, Any]] | None = None
    k_sets_block: bool = False
    drafter_attention: bool = False
    unrecorded_steps: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    start_rank: int = 0
    sequential_requests: bool = False
    proposals_recorded: bool = False
    cpu_refusal: str | None = None


@dataclass(frozen=True)
class Family:
    """One drafter family.

    Attributes:
        name: short name, written into reports (``drafter.family``).
        layouts: human-readable names of the checkpoint layouts it reads (docs, errors).
        claims: probe -> True when this family reads the checkpoint.
        load: (checkpoint, cache, eval config) -> (drafter, loaded checkpoint with ``.report``).
        score_rows: (drafter, cache, rows, eval config, on_sequence) -> list of SequenceResult.
        effective_config: eval config -> the config this family actually scores with (e.g. an
            autoregressive family drops DDTree budgets, which are a block-family mode).
        autoregressive: drafts one token per forward (chain K / tree modes apply).
        online: (checkpoint, target, OnlineOptions) -> (target layer ids, Proposer, LoadReport) for
            ``scorer online`` (the target verifying); None when the family has no online path yet.
        online_trees: the trees its online proposer drafts at T > 0, each a keyword of the proposer
            (``propose(..., tree=(steps, topk, tokens))``: SGLang's EAGLE tree; ``ddtree=N``: DFlash's
            DDTree); ``scorer online --tree`` / ``--ddtree`` refuses a family without it by name.
        cost: (drafter, tau, mean context length) -> {"draft_forwards_per_round",
            "flops_per_round"}: the serving work of one round, estimated from the shapes.
        time_round: (drafter, features [T, K*H], token ids [T], anchor p, tau) -> (seconds, drafts):
            one served round's drafter work at p, its context already cached (what a serving engine
            keeps between rounds) and timed from the newly verified tokens to the last draft.
        proposals: (drafter, cache, row, eval config, temperature) -> (drafts [A, K] target ids,
            log q [A, K]) along the cached (sampled) path y, every anchor a in [P, T-2]: slot j fed
            y's tokens, q_{a,j} = softmax(draft logits / T) over the drafter's whole vocabulary,
            log q of y_{a+j} (-inf outside it). The probabilistic rule (scorer/offline/sampled_view.py); None: the
            family is scored with the one-hot rule only.
        display_name: the family's name on screen and in reports' titles ("EAGLE-3").
        eval_options: the family's own EvalConfig settings: fields (``num_speculative_tokens``) and
            ``EvalConfig.overrides`` keys (``scorer compare`` passes a family only its own overrides);
            the names of its ``flags`` are added to them.
        flags: the command-line settings only this family reads (`FamilyFlag`): options of the scoring
            commands, their values passed as ``EvalConfig.overrides``; another family refuses them.
        vllm: how vLLM 0.32.0 serves its drafters (`VllmServing`, ``scorer served``); None: vLLM does
            not serve them as the scorer scores them, and ``scorer served`` refuses the family by name.
        vllm_refusal: why vLLM 0.32.0 does not serve them (``vllm`` None), citing the engine's
            file:line: ``scorer served``'s refusal says it; empty: the refusal names the family only.
        init: (cache path, out, **options) -> the written drafter's config: a fresh drafter sized
            for the cache's target (``scorer init --family F``); None when there is nothing to
            write (the head ships inside the target, or the family has no weights).
        train: (cache path, out, steps=N, on_step=..., **options) -> {"final_loss", "config", ...}:
            a drafter trained N steps on the cache (``scorer init --train-steps N``); None: untrained only.
        init_options: the keyword options of ``init`` / ``train`` besides seed and overwrite;
            ``scorer init`` refuses a flag outside them by name.
        from_module: (module or state_dict, cache, config, EvalConfig) -> (drafter, loaded):
            an in-memory drafter readied like a loaded one (``scorer.evaluate_module``).
        summarize: (list of SequenceResult) -> {metric name: {"label", "value", "definition"}}: the
            family's own numbers beside tau, from what its score_rows put in the results' extras
            (the report's ``family_metrics``, a line each on the terminal); None: none.
        bound_to_target: its drafter is the cache's target's own (a head shipped inside it) or reads
            nothing of it (n-gram): the target identity matches by construction, nothing recorded.
        fallback: asked only when no other family claims a checkpoint (DFlash, whose loader names
            what is wrong with any other file); the registry holds one.
        diagnose_kinds: the ``scorer diagnose`` hypothesis kinds that apply to this family (names
            from ``scorer.diagnose.ranking.HYPOTHESIS_KINDS``); kinds it does not list are never tried.
        diagnose: (``scorer.diagnose.ranking.DiagnosisInputs``) -> ``scorer.diagnose.ranking.FamilyDiagnosis``: the
            configured setting, the hypotheses of ``diagnose_kinds`` with their settings (or why
            each is untested) and the replayer; ranking, verdict and report are shared. None:
            ``scorer diagnose`` refuses the family by name.
    """

    name: str
    layouts: tuple[str, ...]
    claims: Callable[[CheckpointProbe], bool]
    load: Callable[..., tuple[Any, Any]]
    score_rows: Callable[..., list[Any]]
    effective_config: Callable[[Any], Any] = lambda config: config
    autoregressive: bool = False
    online: Callable[..., tuple[list[int], Proposer, Any]] | None = None
    online_trees: frozenset[str] = frozenset()
    cost: Callable[..., dict[str, Any]] | None = None
    time_round: Callable[..., tuple[float, list[int]]] | None = None
    proposals: Callable[..., tuple[Any, Any]] | None = None
    display_name: str = ""
    eval_options: frozenset[str] = frozenset()
    init: Callable[..., Any] | None = None
    train: Callable[..., dict[str, Any]] | None = None
    init_options: tuple[str, ...] = ()
    from_module: Callable[..., tuple[Any, Any]] | None = None
    summarize: Callable[[list[Any]], dict[str, dict[str, Any]]] | None = None
    bound_to_target: bool = False
    fallback: bool = False
    diagnose_kinds: tuple[str, ...] = ()
    diagnose: Callable[[Any], Any] | None = None
    flags: tuple[FamilyFlag, ...] = ()
    vllm: VllmServing | None = None
    vllm_refusal: str = ""

    def __post_init__(self) -> None:
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)
        # a family reads the settings it declares flags for
        object.__setattr__(self, "eval_options", self.eval_options | {f.name for f in self.flags})


def longest_sequence(cache: Any) -> int:
    """The longest sequence the cache holds, in tokens (its index's ``length`` column)."""
    return int(cache.index.column("length").to_numpy().max())


def check_new_drafter_sizes(
    cache: Any,
    *,
    num_layers: int | None = None,
    block_size: int | None = None,
    num_speculative_tokens: int | None = None,
) -> None:
    """Bound the sizes of a drafter ``scorer init`` writes for ``cache`` before anything is allocated
    (the bounds ``scorer eval`` applies, so init never writes a drafter eval refuses): its depth at most
    the target's (``num_layers``), a block (``block_size``) or a chain of K drafts plus the bonus
    token (``num_speculative_tokens``) no longer than the cache's longest sequence.

    Raises:
        ScorerError: naming the flag, the bound and where it comes from (one line).
    """
    from scorer.errors import ScorerError

    depth = int((cache.target_config or {}).get("num_hidden_layers") or 0)
    if num_layers is not None and depth and not 1 <= num_layers <= depth:
        raise ScorerError(
            f"--draft-layers {num_layers}: a drafter of {num_layers} layers is deeper than its target "
            f"({depth} layers); drafters use 1-5: pass at most {depth}"
        )
    longest = longest_sequence(cache)
    if block_size is not None and block_size > longest:
        raise ScorerError(
            f"--block-size {block_size} is longer than the longest sequence in {cache.path} ({longest} "
            f"tokens), so no block could ever be drafted (scorer eval refuses it): pass at most {longest} "
            "(drafters use 4-16)"
        )
    if num_speculative_tokens is not None and num_speculative_tokens + 1 > longest:
        raise ScorerError(
            f"--num-speculative-tokens {num_speculative_tokens}: a chain of {num_speculative_tokens} drafts "
            f"and the bonus token is longer than the longest sequence in {cache.path} ({longest} tokens), "
            f"so it could never be accepted whole (scorer eval refuses it): pass at most {longest - 1} "
            "(engines use 1-8)"
        )


def check_scored_sizes(
    longest: int,
    where: str,
    *,
    num_speculative_tokens: int | None = None,
    prompt_lookup_max: int | None = None,
    block_size: int | None = None,
    ddtree: tuple[int, ...] = (),
    context: int | None = None,
    k_source: str = "--num-speculative-tokens",
) -> None:
    """Bound the sizes a drafter is scored or run at before anything is allocated: a chain of K
    drafts plus the bonus token, and the n-gram proposer's longest n-gram, no longer than the longest
    sequence (``longest`` tokens, in ``where``: a cache, or --max-length when decoding); a DDTree of N
    nodes, verified in one target forward of N + 1 tokens, within the target's ``context``
    (max_position_embeddings).

    Raises:
        ScorerError: naming the flag (``k_source`` for K: a flag or a config field) and the bound.
    """
    from scorer.errors import ScorerError

    if num_speculative_tokens is not None and num_speculative_tokens + 1 > longest:
        raise ScorerError(
            f"{k_source} {num_speculative_tokens}: a chain of {num_speculative_tokens} drafts and the bonus "
            f"token is longer than the longest sequence in {where} ({longest} tokens), so it could never be "
            f"accepted whole: pass at most {longest - 1} (engines use 1-8)"
        )
    if prompt_lookup_max is not None and prompt_lookup_max > longest:
        raise ScorerError(
            f"--prompt-lookup-max {prompt_lookup_max} is longer than the longest sequence in {where} "
            f"({longest} tokens), so no such n-gram can occur: pass at most {longest} (vLLM's default 5)"
        )
    if block_size is not None and block_size > longest:
        raise ScorerError(
            f"--block-size {block_size} is longer than the longest sequence in {where} ({longest} tokens), "
            f"so no block could ever be drafted: pass at most {longest} (drafters use 4-16)"
        )
    big = [n for n in ddtree if context and n + 1 > context]
    if big:
        raise ScorerError(
            f"--ddtree {big[0]}: a tree of {big[0]} nodes is verified in one target forward of {big[0] + 1} "
            f"tokens, more than the target's context of {context} (max_position_embeddings): pass budgets "
            f"of at most {context - 1} (DDTree's are 8-256)"
        )


def linear_params(module: Any) -> int:
    """Weights of the nn.Linear layers under ``module`` (the matmul parameters a token passes through)."""
    from torch import nn

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def attention_flops(config: Any, tokens: float, context: float) -> float:
    """QK^T and PV of ``tokens`` queries over ``context`` keys, every layer: 4 * heads * D * ctx each."""
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context * tokens


def probe_checkpoint(path: str | Path, config_path: str | None = None) -> CheckpointProbe:
    """Read the config (beside the weights, or ``config_path``) and safetensors key names, if any.

    Malformed files are left for the family's loader to report (it names the file and the fix).
    """

    text = str(path)
    if target_head_name(text) is not None:
        return CheckpointProbe(text, None, None)
    root = Path(path)
    config: dict[str, Any] | None = None
    source = Path(config_path) if config_path else root / "config.json"
    if source.is_file():
        try:
            loaded = jsonio.loads(source.read_bytes())
            config = loaded if isinstance(loaded, dict) else None
        except (OSError, ValueError):
            config = None
    return CheckpointProbe(text, config, _safetensors_keys(root))


def _safetensors_keys(root: Path) -> frozenset[str] | None:
    files = [root] if root.is_file() and root.suffix == ".safetensors" else []
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    keys: set[str] = set()
    from hscache.errors import CacheFormatError
    from hscache.store.target_files import check_safetensors

    read = False
    for f in files:
        try:
            # Its header only, from a regular file opened without blocking (check_safetensors): a
            # FIFO named *.safetensors made safe_open wait forever, deaf to Ctrl-C (issue 52).
            header = check_safetensors(f)
        except CacheFormatError:  # not a regular file, or corrupt: the loader names what it reads
            continue
        read = True
        keys.update(k for k in header if k != "__metadata__")
    return frozenset(keys) if read else None
