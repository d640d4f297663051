"""What ``hscache extract`` refuses before it imports torch or loads a model: bad flags, a ``--out``
it may not write, a cache another process is writing, a prompts file that does not parse.

Importing torch takes 6-25 s on a busy machine and loading a real target a minute; every refusal
that needs neither comes first, in one line. Torch-free by design (tests/test_lazy_imports.py):
the CLI runs ``check_extract_request`` before it imports the extraction, and ``extract()`` runs it
again for API callers (the prompts file is then parsed once per process, not twice). What needs
the model (``--logits-top-k`` against the vocabulary, layer ids against its depth, token counts) is checked
right after the load, still before anything is written (capture/extract.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Protocol

from hscache.capture import BUILTIN_CONTEXT, BUILTIN_LAYERS, BUILTIN_TARGETS
from hscache.capture.layers import check_layer_syntax, parse_layer_spec
from hscache.capture.model_config import config_int, read_model_config
from hscache.capture.prompts import (
    DEFAULT_PROMPTS,
    assistant_turn,
    first_records,
    iter_records,
    resolve_prompts,
    unique_ids,
)
from hscache.errors import InputError, ModelNotFoundError, PromptFileError, ResumeMismatchError
from hscache.store.cache_dir import check_out_dir
from hscache.store.layout import COMPRESSIONS
from hscache.store.lock import check_no_writer
from hscache.store.marks import check_connector_dir
from hscache.store.paths import enclosing_cache
from hscache.store.reader import read_manifest
from hscache.store.sampling import SamplingSetting
from hscache.store.shards import shard_path
from hscache.store.urls import is_url

__all__ = ["ExtractRequest", "check_extract_request", "check_model_name", "target_context", "target_depth"]

# Prompt files parsed in this process, by identity and selection: the CLI's early check and
# extract()'s own then parse a file once. Keyed by (path, inode, size, mtime_ns, selection).
_PARSED: set[tuple] = set()


class ExtractRequest(Protocol):
    """The fields of ``ExtractConfig`` checked here (the CLI passes its options before building one)."""

    out: str
    overwrite: bool
    model: str
    layers: str
    prompts: str
    tokens_from: str | None
    max_new_tokens: int
    max_length: int
    top_k: int
    full_logits: bool
    device: str
    dtype: str
    limit: int | None
    shard: tuple[int, int] | None
    id_from_line: bool
    suffix_duplicate_ids: bool
    compression: str
    generate_batch: int
    memory_gb: float
    sampling: SamplingSetting
    responses_from: str | None
    engine: str
    backend: str
    full_logits: bool


def check_extract_request(config: ExtractRequest) -> None:
    """Refuse ``config`` now if it can be refused without a model (``config.out`` before any
    ``--shard`` suffix: the shard's own directory is derived here).

    Raises:
        InputError / PromptFileError / LayerSpecError / ModelNotFoundError / CacheNotFoundError /
        CacheLockedError: one line naming the flag and the fix.
    """
    _check_options(config)
    _check_engine(config)
    check_model_name(config.model)
    check_layer_syntax(config.layers)
    depth = target_depth(config.model)
    # the range against the target's config.json, before the load (checked again after it)
    layer_ids = parse_layer_spec(config.layers, depth) if depth else None
    if not is_url(config.out):
        out = shard_path(config.out, *config.shard) if config.shard else Path(config.out)
        _check_out(out, config.overwrite)
        if getattr(config, "connector_dir", None):
            check_connector_dir(Path(config.connector_dir), out)
        if out.is_dir() and not config.overwrite:
            _check_resume_settings(out, config, layer_ids)
    if config.tokens_from:
        _check_tokens_from(config.tokens_from)
    elif not config.responses_from:  # a responses file is parsed whole where its setting is read
        _check_prompt_file(config)


def check_model_name(name: str) -> None:
    """``--model`` names a built-in target or a local Hugging Face directory (nothing is downloaded).

    Raises:
        ModelNotFoundError: neither.
    """
    if name.startswith("builtin:"):
        if name not in BUILTIN_TARGETS:
            raise ModelNotFoundError(
                f"unknown built-in target {name!r}; choose one of {', '.join(BUILTIN_TARGETS)}"
            )
    elif not (Path(name) / "config.json").is_file():
        raise ModelNotFoundError(
            f"--model {name!r} is neither a built-in target ({', '.join(BUILTIN_TARGETS)}) "
            "nor a local Hugging Face directory with config.json; nothing is downloaded"
        )
    else:
        read_model_config(name, "--model")  # not JSON, not an object: one line before any load


def target_depth(model: str) -> int | None:
    """The target's decoder layers from its config.json (a built-in's from ``BUILTIN_LAYERS``),
    without torch; None when the file does not say (the load checks then)."""
    return BUILTIN_LAYERS[model] if model in BUILTIN_LAYERS else _config_int(model, "num_hidden_layers")


def target_context(model: str) -> int | None:
    """The target's context (``max_position_embeddings``) from its config.json, without torch; None
    when the file does not say."""
    return (
        BUILTIN_CONTEXT[model] if model in BUILTIN_CONTEXT else _config_int(model, "max_position_embeddings")
    )


def _config_int(model: str, key: str) -> int | None:
    """A positive integer field of ``model``'s config.json (its text_config's for a multimodal one)."""
    try:
        config = read_model_config(model, "--model")
    except InputError:
        return None  # check_model_name says what is wrong with it
    return config_int(config, key)


# Settings of an existing cache a resume must match that are known before the model loads (the
# rest, weights and tokenizer digests, the prompts' content, are compared after the load).
_EARLY_RESUME = {
    "model": "--model",
    "max_new_tokens": "--max-new-tokens",
    "max_length": "--max-length",
    "top_k": "--logits-top-k",
    "full_logits": "--full-logits",
    "device": "--device",
}


def _check_resume_settings(out: Path, config: ExtractRequest, layer_ids: list[int] | None) -> None:
    """A cache at ``out`` built with other settings: refused now, not after the load."""
    try:
        existing = read_manifest(out)["settings"]
    except Exception:  # not a cache (yet), or a damaged one: extract itself says so
        return
    if not isinstance(existing, dict):
        return
    wanted = {key: getattr(config, key) for key in _EARLY_RESUME}
    diffs = [
        (flag, existing.get(key), wanted[key])
        for key, flag in _EARLY_RESUME.items()
        if key in existing and existing[key] != wanted[key]
    ]
    if config.dtype != "auto" and "dtype" in existing and existing["dtype"] != config.dtype:
        diffs.append(("--dtype", existing["dtype"], config.dtype))
    stored = existing.get("layer_ids")
    # the cache may hold one more layer than asked: the last one the target's MTP head reads
    if (
        layer_ids is not None
        and isinstance(stored, list)
        and (stored[: len(layer_ids)] != layer_ids or len(stored) > len(layer_ids) + 1)
    ):
        diffs.insert(0, ("--layers", ",".join(map(str, stored)), ",".join(map(str, layer_ids))))
    if diffs:
        flag, was, now = diffs[0]

        def shown(value: object) -> str:
            return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

        more = f" (and {len(diffs) - 1} more: {', '.join(d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
        raise ResumeMismatchError(
            f"{out} was built with {flag} {shown(was)} but this run has {flag} {shown(now)}{more}; "
            "re-run with the original settings to resume, or pass --overwrite to start over"
        )


def _check_options(config: ExtractRequest) -> None:
    if config.tokens_from and config.max_new_tokens != 0:
        raise InputError(
            f"--tokens-from replays {config.tokens_from}'s tokens as they are; pass --max-new-tokens 0"
        )
    if config.tokens_from and config.prompts != DEFAULT_PROMPTS:
        raise InputError("--tokens-from takes the prompts from the cache; drop --prompts")
    if config.generate_batch < 0 or not (math.isfinite(config.memory_gb) and config.memory_gb > 0):
        raise InputError(
            f"--generate-batch {config.generate_batch} / --memory-gb {config.memory_gb}: "
            "pass a batch >= 1 (0: by device) and a positive budget in GB"
        )
    if config.compression not in COMPRESSIONS:
        raise InputError(f"--compression {config.compression!r}; choose one of {', '.join(COMPRESSIONS)}")
    _check_sampling_options(config)


ENGINES = ("transformers", "vllm")


def _check_engine(config: ExtractRequest) -> None:
    """``--engine vllm``: vLLM importable here, and only the flags it implements."""
    engine = getattr(config, "engine", "transformers")
    if engine not in ENGINES:
        raise InputError(f"--engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "transformers":
        if getattr(config, "connector_dir", None):
            raise InputError("--connector-dir keeps vLLM's files: it needs --engine vllm")
        return
    from hscache.engines.vllm.runtime import vllm_python

    vllm_python(getattr(config, "vllm_python", None))  # this interpreter, --vllm-python or the env: one line
    refused = [
        ("--dtype fp16 (vLLM CPU runs bf16 or fp32 here)", getattr(config, "dtype", "auto") == "fp16"),
        ("--full-logits (vLLM returns the top-k only)", getattr(config, "full_logits", False)),
        ("--backend (vLLM chooses its own kernels)", getattr(config, "backend", "auto") != "auto"),
    ]
    for what, given in refused:
        if given:
            raise InputError(
                f"--engine vllm with {what} is not implemented; drop it or use --engine transformers"
            )
    s = config.sampling
    if not s.greedy and s.min_p > 0 and not config.responses_from:
        # vLLM's hidden-state extraction is a speculative method, and vLLM refuses min_p with one
        # (vllm/sampling_params.py:1189-1194 _validate_spec_decode, vllm 0.32.0): refused here, before
        # the engine starts, rather than by vLLM in the middle of the run.
        raise InputError(
            f"--engine vllm with --min-p {s.min_p:g}: vLLM extracts hidden states through a speculative-"
            "decoding method and refuses min_p with speculative decoding (vllm/sampling_params.py:1189); "
            "pass --min-p 0 or use --engine transformers"
        )


def _check_sampling_options(config: ExtractRequest) -> None:
    """The sampling setting against the other flags (its values were checked when it was built;
    top-k against the vocabulary waits for the model)."""
    if config.responses_from:
        if config.max_new_tokens != 0 or config.tokens_from or config.prompts != DEFAULT_PROMPTS:
            raise InputError(
                f"--responses-from {config.responses_from} holds the prompts and their completions; drop "
                "--prompts/--tokens-from and pass --max-new-tokens 0"
            )
        return
    if config.sampling.greedy:
        return
    if config.max_new_tokens == 0 or config.tokens_from:
        raise InputError(
            "sampling draws new tokens, and --max-new-tokens 0 / --tokens-from cache given text as it is: "
            "raise --max-new-tokens, or drop the sampling flags"
        )
    drawn_by = config.sampling.drawn_by
    if drawn_by == "vllm" and getattr(config, "engine", "transformers") != "vllm":
        raise InputError("a sampling setting drawn by vLLM's sampler needs --engine vllm")
    if drawn_by not in ("hscache", "vllm"):
        raise InputError("a sampling setting drawn by a server needs --responses-from FILE")


def _check_out(out: Path, overwrite: bool) -> None:
    """``--out`` can become (or already is) the cache: no file in the way, not inside another cache,
    not a directory of other files, writable, and nobody else writing it."""
    if blocker := next((p for p in out.parents if p.exists() and not p.is_dir()), None):
        raise InputError(
            f"--out {out}: {blocker} is a file, not a directory, so the cache directory cannot be "
            "created; choose another path"
        )
    if out.exists() and not out.is_dir():
        raise InputError(
            f"--out {out} is a file, not a directory; a cache is a directory: choose a new directory path "
            "(extract creates it)"
        )
    inside = enclosing_cache(out)
    if inside is not None:
        raise InputError(f"--out {out} is inside the cache {inside}; choose a directory outside it")
    check_out_dir(out, overwrite)
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} is not writable by this user; choose another path")
    if out.is_dir():
        check_no_writer(out)


def _check_tokens_from(cache: str) -> None:
    manifest = read_manifest(Path(cache))  # a missing or non-cache path, said as what it is
    if int(manifest["committed"]["sequences"]) == 0:
        raise PromptFileError(f"--tokens-from {cache} holds no committed sequences")


def _check_prompt_file(config: ExtractRequest) -> None:
    """Every record this run selects parses and has its own id (one streaming pass, no tokenizer)."""
    path = resolve_prompts(config.prompts)
    st = path.stat()
    key = (
        str(path.resolve()),
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        config.limit,
        config.id_from_line,
        config.suffix_duplicate_ids,
        config.max_new_tokens > 0,
    )
    if key in _PARSED:
        return
    records = iter_records(path, id_from_line=config.id_from_line)
    for record in first_records(unique_ids(records, config.suffix_duplicate_ids), config.limit):
        if config.max_new_tokens > 0 and (turn := assistant_turn(record)) is not None:
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}): its chat ends with an assistant turn "
                f"({turn}), the dataset's answer, which is cached as is only with --max-new-tokens 0; with "
                f"--max-new-tokens {config.max_new_tokens} the target would answer instead and the turn "
                "would be dropped: pass --max-new-tokens 0, or drop the record's last turn"
            )
    _PARSED.add(key)
