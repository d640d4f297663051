"""``hscache extract``: run the target once and write a cache (resuming when one exists).

Named steps: resolve settings -> check prompts (one streaming pass) -> open or resume the
store -> capture batches on the main thread while a writer thread compresses, writes and
commits -> finish (compact index) -> the run log. Refusals that need no model come first
(capture/preflight.py), then the writer lock, then the model; a re-run on a complete cache of the
same settings writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscache.capture.backend import resolve_backend, use_backend
from hscache.capture.device import check_device
from hscache.capture.forward import (
    DEFAULT_MEMORY_GB,
    CapturedSequence,
    capture_batch,
    greedy_continuations,
    to_host_async,
)
from hscache.capture.layers import parse_layer_spec
from hscache.capture.mtp import mtp_layer_id, target_mtp_weights
from hscache.capture.preflight import check_extract_request
from hscache.capture.prompts import (
    DEFAULT_PROMPTS,
    PromptRecord,
    cache_records,
    cache_records_sha256,
    first_records,
    iter_records,
    prompt_token_ids,
    resolve_prompts,
    response_token_ids,
    unique_ids,
)
from hscache.capture.provenance import build_provenance, model_path, run_record, tokenizer_sha256, utc_now
from hscache.capture.responses import (
    ServedRecord,
    expand_samples,
    iter_responses,
    responses_sampling,
    with_choice,
)
from hscache.capture.sampling import (
    SAMPLING_BYTES_PER_LOGIT,
    SupportBuilder,
    attach,
    realised_counts,
    sampled_arrays,
    sampled_continuations,
)
from hscache.capture.target import Target, load_target
from hscache.capture.writer_thread import WriterThread
from hscache.engines.vllm.requests import sequence_seed
from hscache.errors import HscacheError, InputError, PromptFileError, ResumeMismatchError
from hscache.store.cache_dir import clear_for_overwrite, prepare_fresh_dir, read_provenance, write_provenance
from hscache.store.dtypes import LOGICAL_DTYPES
from hscache.store.fsio import file_sha256
from hscache.store.layout import (
    DEFAULT_COMPRESSION,
    MANIFEST,
    MAX_CHUNK_TOKENS,
    array_specs,
    sampled_array_specs,
)
from hscache.store.lock import writer_lock
from hscache.store.marks import write_connector_mark
from hscache.store.reader import read_manifest
from hscache.store.run_log import encode_run_log, read_run_log
from hscache.store.sampling import GREEDY, SAMPLING_PARAMETERS, SamplingSetting
from hscache.store.shards import shard_path
from hscache.store.target_files import write_target_dir
from hscache.store.urls import is_url
from hscache.store.writer import SequenceRows, StoreWriter, write_error

__all__ = [
    "ExtractConfig",
    "ExtractResult",
    "Progress",
    "auto_dtype",
    "extract",
    "worker_job",
    "write_target_of",
]

# Settings that change what the cache holds; a resume must match all of them.
_RESUME_KEYS = (
    "model",
    "weights_sha256",
    "layer_ids",
    "dtype",
    "engine",  # absent: transformers (named before --backend, which follows from it)
    "backend",
    "device",
    "tokenizer_sha256",
    "prompts_sha256",
    "limit",
    "max_new_tokens",
    "max_length",
    "top_k",
    "full_logits",
    "batch_tokens",
    "generate_batch",
    "shard",
    "mtp",
    "sampling",  # absent in a greedy cache (every cache written before sampling existed)
)
# Caches written before a setting existed were made as its value here says.
_LEGACY = {"generate_batch": 1, "mtp": False, "engine": "transformers"}


@dataclass(frozen=True)
class ExtractConfig:
    """Everything ``hscache extract`` takes; CLI flags mirror these names."""

    out: str
    model: str = "builtin:tiny-qwen3.5"
    prompts: str = "builtin:default"
    layers: str = "dflash:3"
    max_new_tokens: int = 64
    dtype: str = "bf16"  # or "auto": bf16 on CUDA, fp32 on CPU (where bf16 is 2-3x slower); the CLI default
    backend: str = "auto"
    device: str = "cpu"
    max_length: int = 4096
    top_k: int = 64
    batch_tokens: int = 0  # 0: one sequence per forward on CPU, 16384 tokens on CUDA
    full_logits: bool = False
    generate_batch: int = 0  # prompts per batched generate; 0: 8 on CPU, 64 on CUDA
    memory_gb: float = DEFAULT_MEMORY_GB  # [rows, V] logits working set (layout of work, not content)
    compression: str = DEFAULT_COMPRESSION  # layout.COMPRESSIONS; measured choice in docs/storage.md
    chunk_bytes: int = 8 << 20
    commit_every_s: float = 30.0
    overwrite: bool = False
    limit: int | None = None
    # (I, N): extract records n % N == I (after --limit) into OUT/shard-IIIII-of-NNNNN; see store/shards.py
    shard: tuple[int, int] | None = None
    # Records sharing an id are refused; True renames the later ones "<id>#2", "<id>#3", ...
    suffix_duplicate_ids: bool = False
    # A record without "id" is refused; True numbers such records by their line in the file.
    id_from_line: bool = False
    # Another cache whose token ids (split at its prompt_len), record ids and metadata are the
    # prompts, replayed as they are (max_new_tokens 0): two caches on identical tokens.
    tokens_from: str | None = None
    # Store the target's own MTP head (mtp.* weights) when its checkpoint has one, and add the last
    # layer (what MTP reads) to the layers; False: neither (--no-mtp).
    mtp: bool = True
    # How continuations are drawn (hscache/store/sampling.py): greedy by default; a sampled setting
    # stores the processed distribution per generated position (docs/extract.md "Sampled extraction").
    sampling: SamplingSetting = GREEDY
    # A server's sampled completions (capture/responses.py), teacher-forced as they are (--max-new-tokens 0).
    responses_from: str | None = None
    # What runs the target: "transformers" (hooks on its decoder layers) or "vllm" (the serving engine's
    # own kernels and sampler, states through its hidden-states connector: hscache/engines/vllm/).
    engine: str = "transformers"
    # --engine vllm: also keep the connector's per-request files here, as speculators names them
    # (hs_<sequence>.safetensors); layout, not content (not a resume setting).
    connector_dir: str | None = None
    # --engine vllm from an interpreter without vLLM: the one that has it (else $HSCACHE_VLLM_PYTHON);
    # the whole extraction then runs there (engines/vllm/extract_worker.py). Not a content setting.
    vllm_python: str | None = None
    # "fp8": once the run is complete, store the hidden states as fp8 e4m3fn bits + a scale per token
    # and layer, in place (store/compact_convert.py); "source" (the default): the dtype as extracted.
    states: str = "source"


@dataclass
class ExtractResult:
    path: Path | str  # str: the URL of an --out s3://... run
    sequences: int
    tokens: int
    resumed_from: int  # sequences already committed when this run started
    seconds: float
    provenance: dict[str, Any] = field(repr=False, default_factory=dict)
    mtp: bool = False  # the target's MTP head stored in target/ (and its last layer among the layers)
    unchanged: bool = False  # the cache was complete with these settings: nothing written at all
    engine_start_s: float = 0.0  # --engine vllm: seconds its engine took to start (within ``seconds``)


class Progress:
    """Progress callbacks; the CLI renders them, the API default ignores them.

    ``step``: a step without a count begins (loading the target, checking the prompts), one line
    each; ``status``: what the counted step does now (generating continuations, capturing).
    """

    def step(self, text: str) -> None: ...
    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None: ...
    def status(self, text: str) -> None: ...
    def advance(self, sequences: int, tokens: int) -> None: ...
    def finish(self) -> None: ...


class _Callbacks(Progress):
    """A caller's progress object with the callbacks it lacks as no-ops: one written before ``step``
    and ``status`` existed (start/advance/finish only) still works."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def _call(self, name: str, *args: Any) -> None:
        callback = getattr(self.inner, name, None)
        if callback is not None:
            callback(*args)

    def step(self, text: str) -> None:
        self._call("step", text)

    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None:
        self._call("start", total_sequences, total_prompt_tokens, done_sequences)

    def status(self, text: str) -> None:
        self._call("status", text)

    def advance(self, sequences: int, tokens: int) -> None:
        self._call("advance", sequences, tokens)

    def finish(self) -> None:
        self._call("finish")


@dataclass(frozen=True)
class _PromptSummary:
    path: Path
    sha256: str
    records: int
    prompt_tokens: int
    # At least the tokens the whole selection writes (every shard's records: shards share chunk shapes),
    # counted up to MAX_CHUNK_TOKENS: it caps the chunk length of a small cache (store/layout.py).
    token_bound: int


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (byte-level entries: bytes), at least 1."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def record_chars(record: Any) -> int:
    """An upper bound on what tokenizing ``record`` reads: characters of its text (or its id count)."""

    def size(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, list):
            return len(value) if all(isinstance(v, int) for v in value) else sum(size(v) for v in value)
        return 0

    return size(record.content) + size(record.response)


def _check_prompts(config: ExtractConfig, target: Target) -> _PromptSummary:
    """Stream the prompts once: every line parses, tokenizes, and fits --max-length; ids are unique."""
    path = _prompts_path(config)
    records = prompt_tokens = bound = 0
    max_chars = config.max_length * longest_token_chars(target.tokenizer)
    for n, record in enumerate(_limited(config)):
        if config.shard is not None and n % config.shard[1] != config.shard[0]:
            if bound < MAX_CHUNK_TOKENS:  # another shard's record: counted for the bound only
                bound += _other_shards_tokens(config, target, record, max_chars)
            continue
        chars = record_chars(record)
        if chars > max_chars:
            # Tokenizing a 42 MB line whole needs gigabytes: no token is longer than the vocabulary's
            # longest entry, so this many characters cannot fit --max-length tokens.
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}) holds {chars} characters, more than "
                f"--max-length {config.max_length} tokens can hold (at most {max_chars // config.max_length} "
                "characters a token); shorten it or raise --max-length"
            )
        length = len(prompt_token_ids(record, target.tokenizer, target.vocab_size))
        if length > config.max_length:
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}) has {length} prompt tokens, more than "
                f"--max-length {config.max_length}; shorten it or raise --max-length"
            )
        response = response_token_ids(record, target.tokenizer) if config.max_new_tokens == 0 else []
        if length + len(response) > config.max_length:
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}): prompt + response is longer than "
                f"--max-length {config.max_length}; shorten it or raise --max-length"
            )
        if isinstance(record, ServedRecord):
            _check_served(record, length, config.max_length, target.vocab_size)
        records += 1
        prompt_tokens += length
        bound += _tokens_written(config, record, length, len(response))
    sha256 = cache_records_sha256(path) if config.tokens_from else file_sha256(path)
    return _PromptSummary(path, sha256, records, prompt_tokens, bound)


def _tokens_written(config: ExtractConfig, record: PromptRecord, prompt_len: int, response_len: int) -> int:
    """At least the tokens ``record``'s sequences (one per sample) add to the cache."""
    new = max(config.max_new_tokens, response_len)  # generated: at most max_new_tokens; else the response
    if isinstance(record, ServedRecord):  # one sequence per served choice, its completion teacher-forced
        return sum(prompt_len + max(new, len(c.token_ids)) for c in record.choices) or prompt_len + new
    return config.sampling.samples_per_prompt * (prompt_len + new)


def _other_shards_tokens(config: ExtractConfig, target: Target, record: PromptRecord, max_chars: int) -> int:
    """``_tokens_written`` of a record another shard extracts (and checks: a bad one is its to refuse)."""
    samples = len(getattr(record, "choices", ())) or config.sampling.samples_per_prompt
    if record_chars(record) > max_chars:
        return samples * config.max_length  # refused by its shard; at most this many if it were not
    try:
        length = len(prompt_token_ids(record, target.tokenizer, target.vocab_size))
        response = response_token_ids(record, target.tokenizer) if config.max_new_tokens == 0 else []
    except PromptFileError:
        return samples * config.max_length
    return _tokens_written(config, record, length, len(response))


def _prompts_path(config: ExtractConfig) -> Path:
    if config.responses_from:
        return Path(config.responses_from)
    return Path(config.tokens_from) if config.tokens_from else resolve_prompts(config.prompts)


def _check_served(record: ServedRecord, prompt_len: int, max_length: int, vocab_size: int) -> None:
    for choice in record.choices:
        too_big = [t for t in choice.token_ids if t >= vocab_size]
        too_big += [t for position in choice.support for t, _ in position if t >= vocab_size]
        if too_big:
            what = f"token id {too_big[0]} is outside the model's vocabulary of {vocab_size}"
        elif prompt_len + len(choice.token_ids) > max_length:
            what = f"prompt + completion is longer than --max-length {max_length}; raise --max-length"
        else:
            continue
        raise PromptFileError(f"record {record.record_id!r} (line {record.line_no}): {what}")


def _limited(config: ExtractConfig) -> Iterator[PromptRecord]:
    """The records of every shard of this run: the first --limit (all when None)."""
    if config.responses_from:
        source = iter_responses(config.responses_from, config.sampling)
    elif config.tokens_from:
        source = cache_records(config.tokens_from)
    else:
        source = iter_records(resolve_prompts(config.prompts), id_from_line=config.id_from_line)
    return first_records(unique_ids(source, config.suffix_duplicate_ids), config.limit)


def _selected(config: ExtractConfig) -> Iterator[PromptRecord]:
    """The records this run extracts: the first --limit, then with --shard I/N every N-th from I."""
    records = _limited(config)
    if config.shard is None:
        return records
    index, count = config.shard
    return (record for n, record in enumerate(records) if n % count == index)


def _settings(
    config: ExtractConfig,
    target: Target,
    layer_ids: list[int],
    backend: str,
    prompts: _PromptSummary,
    mtp: bool,
) -> dict[str, Any]:
    batch_tokens = config.batch_tokens or (16384 if config.device.startswith("cuda") else 0)
    generate_batch = config.generate_batch or (64 if config.device.startswith("cuda") else 8)
    return {
        "model": config.model,
        "weights_sha256": target.weights_sha256,
        "layer_ids": layer_ids,
        "dtype": config.dtype,
        "backend_requested": config.backend,
        "backend": backend,
        "device": config.device,
        "tokenizer_sha256": tokenizer_sha256(target.tokenizer),
        "prompts_sha256": prompts.sha256,
        "max_new_tokens": config.max_new_tokens,
        "max_length": config.max_length,
        "top_k": config.top_k,
        "full_logits": config.full_logits,
        "batch_tokens": batch_tokens,
        "generate_batch": generate_batch,
        "mask_token_id": target.mask_token_id,
        "limit": config.limit,
        "mtp": mtp,
        **({"shard": {"index": config.shard[0], "count": config.shard[1]}} if config.shard else {}),
        # Greedy records nothing, so a greedy cache's manifest (and digest) is what it always was.
        **({} if config.sampling.greedy else {"sampling": config.sampling.to_dict()}),
        **({} if config.engine == "transformers" else {"engine": config.engine}),  # likewise
    }


def _check_resume(existing: dict[str, Any], settings: dict[str, Any], out: Path) -> None:
    diffs = [k for k in _RESUME_KEYS if existing.get(k, _LEGACY.get(k)) != settings.get(k, _LEGACY.get(k))]
    if diffs:
        key = diffs[0]
        more = (
            f" (and {len(diffs) - 1} more: {', '.join(_flag(k) for k in diffs[1:])})"
            if len(diffs) > 1
            else ""
        )
        raise ResumeMismatchError(
            f"{out} was built with {_flag(key)} {_shown(existing.get(key, _LEGACY.get(key)), key)} but this run "
            f"has {_flag(key)} {_shown(settings.get(key, _LEGACY.get(key)), key)}{more}; "
            "re-run with the original settings to resume, or pass --overwrite to start over"
        )


# Settings named as the user set them: flags, not Python field names.
_FLAGS = {
    "layer_ids": "--layers",
    "top_k": "--logits-top-k",
    "weights_sha256": "model weights sha256",
    "tokenizer_sha256": "tokenizer sha256",
    "prompts_sha256": "--prompts content sha256",
    "mtp": "--mtp/--no-mtp (the target's MTP head stored)",
}


def _flag(key: str) -> str:
    return _FLAGS.get(key, "--" + key.replace("_", "-"))


def _shown(value: Any, key: str = "") -> str:
    if key == "sampling":
        return SamplingSetting.from_dict(value).describe() if isinstance(value, dict) else "greedy"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):  # --shard
        return f"{value.get('index')}/{value.get('count')}"
    if isinstance(value, str) and len(value) == 64:
        return value[:12] + "..."
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def write_target_of(out: Path, target: Target, mtp: dict[str, torch.Tensor] | None = None) -> None:
    """The target's config, tokenizer and embedding/output head: the scorer never needs the model."""
    from hscache.capture.final_norm import describe_final_norm, final_norm_module

    # For readers that need transformers hidden_states[L] of the last layer (final_norm.py).
    final_norm = describe_final_norm(final_norm_module(target.model))
    write_target_dir(
        out,
        target.text_config.to_dict(),
        target.tokenizer,
        target.model.get_input_embeddings().weight.detach().cpu(),
        target.model.get_output_embeddings().weight.detach().cpu(),
        extra=final_norm,
        mtp=mtp,
    )


@contextlib.contextmanager
def _disk_errors(out: Path, committed: int) -> Iterator[None]:
    """Any OSError while writing the cache becomes a one-line StoreWriteError (disk full, permissions)."""
    try:
        yield
    except HscacheError:
        raise
    except OSError as exc:
        raise write_error(out, committed, exc) from exc


def _open_store(
    config: ExtractConfig,
    target: Target,
    settings: dict[str, Any],
    mtp: dict[str, torch.Tensor],
    max_tokens: int,
) -> tuple[StoreWriter, int]:
    out = Path(config.out)
    if config.overwrite:
        clear_for_overwrite(out)
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        _check_resume(manifest["settings"], settings, out)
        # The chunk shapes are the manifest's: the ones the first run chose from the same selection.
        return StoreWriter.resume(out, manifest), int(manifest["committed"]["sequences"])
    text = target.text_config
    specs = array_specs(
        len(settings["layer_ids"]),
        int(text.hidden_size),
        LOGICAL_DTYPES[config.dtype],
        config.top_k,
        int(text.vocab_size) if config.full_logits else None,
        config.chunk_bytes,
        max_tokens,
    )
    if not config.sampling.greedy:
        specs.update(sampled_array_specs(config.sampling.support_width, config.chunk_bytes, max_tokens))
    with _disk_errors(out, 0):
        prepare_fresh_dir(out)
        write_target_of(out, target, mtp)
    return StoreWriter.create(out, specs, config.compression, settings), 0


def _stored(t: torch.Tensor, dtype: str | None = None) -> np.ndarray:
    """Host numpy rows in the stored dtype (``None``: the tensor's own, as for hidden states)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bits: bit-exact round trip
    return t.numpy() if dtype is None else t.numpy().astype(dtype, copy=False)


def _to_rows(
    captured: CapturedSequence, record: PromptRecord, prompt_len: int, stop_reason: str
) -> SequenceRows:
    token_ids = _stored(captured.token_ids, "int32")
    arrays = {
        "hidden_states": _stored(captured.hidden_states),
        "token_ids": token_ids,
        "target_argmax": _stored(captured.argmax, "int32"),
        "target_topk_values": _stored(captured.topk_values, "float32"),
        "target_topk_ids": _stored(captured.topk_ids, "int32"),
        "target_logsumexp": _stored(captured.logsumexp, "float32"),
    }
    if captured.logits is not None:
        arrays["target_logits"] = _stored(captured.logits, "float32")
    if captured.support_ids is not None or isinstance(record, ServedRecord):
        arrays.update(sampled_arrays(captured, record, prompt_len))
    return SequenceRows(
        arrays=arrays,
        record_id=record.record_id,
        prompt_len=prompt_len,
        stop_reason=stop_reason,
        token_sha256=hashlib.sha256(token_ids.astype("<i4").tobytes()).hexdigest(),
        metadata_json=json.dumps(record.metadata, sort_keys=True),
    )


def _rows_when_copied(captured: list[CapturedSequence], batch: list, copied: Any) -> list[SequenceRows]:
    if copied is not None:
        copied.synchronize()
    return [_to_rows(cap, rec, plen, stop) for cap, (rec, _ids, plen, stop) in zip(captured, batch)]


_Sequence = tuple[PromptRecord, list[int], int, str]  # record, prompt + continuation, prompt_len, stop


def _sequences(
    config: ExtractConfig,
    target: Target,
    generate_batch: int,
    skip: int,
    progress: Progress | None = None,
    engine: Any = None,
) -> Iterator[_Sequence]:
    """Every selected record with its continuation, from record ``skip`` on, in prompt order.

    Continuations are generated ``generate_batch`` prompts at a time, grouped by record number
    (records kN .. kN+N-1), never by where a run started: a resume regenerates the group it
    restarts inside and drops the records already committed, so every sequence sees exactly the
    batch companions it had in an uninterrupted run (in bf16 they can move a near-tie).
    """
    group: list[tuple[int, PromptRecord]] = []
    # A sampled run: one sequence per (record, sample), each its own item of the grouping.
    for n, record in enumerate(expand_samples(_selected(config), config.sampling)):
        group.append((n, record))
        if len(group) == generate_batch:
            yield from _continued(config, target, group, skip, progress, engine)
            group = []
    if group:
        yield from _continued(config, target, group, skip, progress, engine)


def _continued(
    config: ExtractConfig,
    target: Target,
    group: list[tuple[int, PromptRecord]],
    skip: int,
    progress: Progress | None = None,
    engine: Any = None,
) -> Iterator[_Sequence]:
    if group[-1][0] < skip:  # committed already: no model work
        return
    prompts = [prompt_token_ids(record, target.tokenizer, target.vocab_size) for _, record in group]
    if config.max_new_tokens == 0:  # dataset text after the prompt, cached as is; scoring starts at its end
        done = []
        for (_, record), prompt in zip(group, prompts):
            response = response_token_ids(record, target.tokenizer)
            stop = record.choice.stop_reason if isinstance(record, ServedRecord) else "dataset"
            done.append((prompt + response, stop) if response else (prompt, "none"))
    elif not config.sampling.greedy and engine is not None:  # drawn by vLLM's sampler, seeded per request
        if progress is not None:
            progress.status(
                f"sampling {len(group)} continuations of up to {config.max_new_tokens} tokens in vLLM"
            )
        seeds = [sequence_seed(config.sampling, n, config.shard) for n, _ in group]
        names = [f"record {record.record_id!r} sample {record.metadata['sample']}" for _, record in group]
        drawn = engine.sampled_continuations(prompts, seeds, config.max_new_tokens, target.vocab_size, names)
        # each sample's completion rides with its record: its sampled arrays are vLLM's distribution
        group = [(n, with_choice(record, choice)) for (n, record), (_, _, choice) in zip(group, drawn)]
        done = [(ids, stop) for ids, stop, _ in drawn]
    elif not config.sampling.greedy:
        keys = [(record.record_id, int(record.metadata["sample"])) for _, record in group]
        args = (config.sampling, config.max_new_tokens, config.max_length)
        done = sampled_continuations(target, prompts, keys, *args)
    else:
        if progress is not None:
            progress.status(f"generating {len(group)} continuations of up to {config.max_new_tokens} tokens")
        if engine is not None:  # the serving engine's own greedy decode
            done = engine.continuations(prompts, config.max_new_tokens)
        else:
            done = greedy_continuations(target, prompts, config.max_new_tokens, config.max_length)
    for (n, record), prompt, (ids, stop) in zip(group, prompts, done):
        if n >= skip:
            yield record, ids, len(prompt), stop


def _batches(
    config: ExtractConfig,
    target: Target,
    settings: dict[str, Any],
    skip: int,
    progress: Progress | None = None,
    engine: Any = None,
) -> Iterator[list[_Sequence]]:
    """Group sequences greedily up to ``batch_tokens`` padded tokens per capture forward.

    Grouping depends only on the sequence order, so a resume (which starts at a committed batch
    boundary) forms the same batches as an uninterrupted run.
    """
    batch: list[_Sequence] = []
    for item in _sequences(config, target, settings["generate_batch"], skip, progress, engine):
        width = max([len(item[1])] + [len(b[1]) for b in batch])
        if batch and width * (len(batch) + 1) > settings["batch_tokens"]:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def extract(config: ExtractConfig, progress: Progress | None = None) -> ExtractResult:
    """Run the target over the prompts and write (or resume) the cache at ``config.out``.

    Raises:
        HscacheError subclasses for bad input, before any model work where possible;
        StoreWriteError when the disk fails (the committed part stays intact and resumable).
    """
    if config.states != "source":
        return _extract_compact(config, progress)
    if is_url(config.out):
        return _extract_to_url(config, progress)
    if config.engine == "vllm" and _elsewhere(config):
        return _extract_in_vllm_python(config, progress)
    progress = _Callbacks(progress) if progress is not None else Progress()
    t0 = time.perf_counter()
    check_extract_request(config)  # flags, --out, a live writer, the prompts' syntax: before torch work
    if config.shard is not None:
        config = replace(config, out=str(shard_path(config.out, *config.shard)))
    if config.responses_from:  # the setting is the file's requests' (fields a given setting adds must agree)
        flags = {} if config.sampling.greedy else config.sampling.to_dict()
        config = replace(config, sampling=responses_sampling(config.responses_from, _parameters(flags)))
    if config.engine == "vllm" and not config.sampling.greedy and not config.responses_from:
        config = replace(config, sampling=replace(config.sampling, drawn_by="vllm"))  # its sampler draws
    if config.dtype == "auto":  # resolved before anything is recorded: settings hold bf16/fp32
        config = replace(config, dtype=auto_dtype(config.device))
    # From before the model loads (a second writer is refused in a second, not after the load) and
    # before --overwrite empties the directory, until the last commit: one writer per cache.
    with writer_lock(Path(config.out), "hscache extract"):
        check_device(config.device)
        backend = "vllm" if config.engine == "vllm" else resolve_backend(config.backend, config.device)
        progress.step(f"loading the target {config.model} ({config.dtype} on {config.device})")
        # With --engine vllm, transformers' copy gives the tokenizer, target/ and the checks, on the CPU.
        target = load_target(config.model, config.dtype, "cpu" if config.engine == "vllm" else config.device)
        if config.engine == "vllm":
            from hscache.engines.vllm.runtime import preflight_target

            preflight_target(target.text_config.to_dict(), config.dtype, config.device)
        layer_ids = parse_layer_spec(config.layers, target.num_layers)
        _check_flags(config, target)
        progress.step("checking the prompts against the tokenizer and --max-length")
        prompts = _check_prompts(config, target)
        if prompts.records == 0 and config.shard is not None:  # before anything is written (issue 36)
            index, count = config.shard
            raise InputError(
                f"--shard {index}/{count} selects no record: the records this run reads"
                f"{f' (--limit {config.limit})' if config.limit is not None else ''} are fewer than {index + 1}, "
                "and shard I takes records I, I + N, ...; use fewer shards (N at most the number of records)"
            )
        mtp = target_mtp_weights(target.name, target.model, target.text_config) if _wants_mtp(config) else {}
        if mtp and mtp_layer_id(target.num_layers) not in layer_ids:  # what MTP reads, unasked
            layer_ids = [*layer_ids, mtp_layer_id(target.num_layers)]
        settings = _settings(config, target, layer_ids, backend, prompts, bool(mtp))
        return _extract_locked(config, target, settings, mtp, backend, prompts, progress, t0)


def _extract_compact(config: ExtractConfig, progress: Progress | None) -> ExtractResult:
    """``--states fp8``: the extraction at the source dtype, then its states converted in place (a
    re-run resumes either step; a compact cache is complete and left as it is)."""
    from hscache.store.compact import STATES
    from hscache.store.compact_convert import convert_states

    if config.states not in STATES:
        raise InputError(f"--states {config.states!r}: choose one of {', '.join(STATES)}")
    if is_url(config.out):
        raise InputError(
            f"--states {config.states} with --out {config.out}: convert a local cache, then upload it "
            "(extract to a directory, then `hscache recompress DIR --states fp8`, then copy it up)"
        )
    result = extract(replace(config, states="source"), progress)
    convert_states(result.path, config.states, progress=(progress or Progress()).step)
    return result


def _extract_locked(
    config: ExtractConfig,
    target: Target,
    settings: dict[str, Any],
    mtp: dict[str, Any],
    backend: str,
    prompts: _PromptSummary,
    progress: Progress,
    t0: float,
) -> ExtractResult:
    out = Path(config.out)
    complete = _complete_with(config, settings)
    if complete is not None:  # a re-run that has nothing to add writes nothing (the digest stays)
        committed = complete["committed"]
        return ExtractResult(
            out,
            int(committed["sequences"]),
            int(committed["tokens"]),
            int(committed["sequences"]),
            time.perf_counter() - t0,
            read_provenance(out),
            mtp=bool(settings["mtp"]),
            unchanged=True,
        )
    with _engine_for(config, target, settings) as engine:  # an engine that fails to start writes nothing
        writer, done = _open_store(config, target, settings, mtp, prompts.token_bound)
        return _capture_all(config, target, settings, engine, writer, done, prompts, progress, t0)


def _engine_for(config: ExtractConfig, target: Target, settings: dict[str, Any]) -> Any:
    """The vLLM engine of an ``--engine vllm`` run (a context manager), else a null context (None)."""
    if config.engine != "vllm":
        return contextlib.nullcontext()
    from hscache.capture.forward import eos_token_ids
    from hscache.engines.vllm.capture import VllmCapture, model_directory

    directory = model_directory(config.model, target.weights_sha256)
    if config.connector_dir:  # checked in preflight: new, empty, or this cache's own files
        write_connector_mark(Path(config.connector_dir), Path(config.out))
    return VllmCapture(
        directory,
        config.dtype,
        settings["layer_ids"],
        config.top_k,
        config.max_length,
        eos_token_ids(target),
        keep_files=Path(config.connector_dir) if config.connector_dir else None,
        sampling=config.sampling,
    )


def _capture_all(
    config: ExtractConfig,
    target: Target,
    settings: dict[str, Any],
    engine: Any,
    writer: StoreWriter,
    done: int,
    prompts: _PromptSummary,
    progress: Progress,
    t0: float,
) -> ExtractResult:
    out = Path(config.out)
    bound = use_backend(target.model, settings["backend"]) if engine is None else None
    with bound if bound is not None else contextlib.nullcontext(engine.kernel_bindings()) as kernels:
        with _disk_errors(out, done):
            provenance, runs = _start_run(config, writer, target, settings, kernels, prompts, engine)
        progress.start(prompts.records * config.sampling.samples_per_prompt, prompts.prompt_tokens, done)
        first = done
        with WriterThread(writer, config.commit_every_s) as background:
            for batch in _batches(config, target, settings, skip=done, progress=progress, engine=engine):
                progress.status("capturing hidden states")
                captured, copied = _captured(config, target, settings, engine, batch, first)
                background.submit(lambda c=captured, b=batch, e=copied: _rows_when_copied(c, b, e))
                progress.advance(len(batch), sum(len(b[1]) for b in batch))
                first += len(batch)
        if "sampling" in provenance:  # counted over the whole cache, a resumed run's first part included
            with _disk_errors(out, writer.committed_sequences):
                writer.commit()
                provenance["sampling"].update(realised_counts(writer))
                write_provenance(writer, provenance)
        writer.finish()
    # The run log last: it is outside the digest, so the finished cache's digest is already final.
    runs[-1].update(finished_at=utc_now(), sequences_at_finish=writer.committed_sequences)
    with _disk_errors(out, writer.committed_sequences):
        writer.write_run_log(encode_run_log(runs))
    progress.finish()
    return ExtractResult(
        out,
        writer.committed_sequences,
        writer.committed_tokens,
        done,
        time.perf_counter() - t0,
        provenance,
        mtp=bool(settings["mtp"]),
        engine_start_s=engine.seconds_engine if engine is not None else 0.0,
    )


def _captured(
    config: ExtractConfig,
    target: Target,
    settings: dict[str, Any],
    engine: Any,
    batch: list[_Sequence],
    first: int,
) -> tuple[list[CapturedSequence], Any]:
    """One batch's captured sequences, on the host or being copied there (the CUDA event to wait for);
    ``first``: the cache's sequence number of the batch's first."""
    if engine is not None:  # the serving engine: states from its connector, next-token data from logprobs
        return engine.capture([b[1] for b in batch], target.vocab_size, first=first), None
    builders = _support_builders(config, target, batch)
    captured = capture_batch(
        target,
        [b[1] for b in batch],
        settings["layer_ids"],
        config.top_k,
        config.full_logits,
        memory_gb=config.memory_gb,
        on_logits=builders,
        extra_bytes_per_logit=SAMPLING_BYTES_PER_LOGIT if builders else 0,
    )
    if builders:
        captured = [attach(c, b) for c, b in zip(captured, builders)]
    # On CUDA the copies to pinned host memory are queued now, before the next forward, and
    # the writer thread waits for them alone: the GPU never waits for the disk.
    return to_host_async(captured)


def _complete_with(config: ExtractConfig, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of a complete cache at ``--out`` made with these settings, else None.

    Raises:
        ResumeMismatchError: the cache there was made with other settings.
    """
    out = Path(config.out)
    if config.overwrite or not (out / MANIFEST).is_file():
        return None
    manifest = read_manifest(out)
    _check_resume(manifest["settings"], settings, out)
    return manifest if manifest.get("complete") else None


def _support_builders(config: ExtractConfig, target: Target, batch: list[_Sequence]) -> list | None:
    """Per sequence, the observer that stores the processed distribution of a sampled run (None:
    greedy, or served completions whose distribution comes from the server)."""
    if config.sampling.greedy or config.responses_from:
        return None
    device = next(target.model.parameters()).device
    return [
        SupportBuilder(config.sampling, torch.tensor(ids, device=device), plen, record.record_id)
        for record, ids, plen, _stop in batch
    ]


def _wants_mtp(config: ExtractConfig) -> bool:
    """``--mtp``, except that a resume follows the cache it resumes: one started before MTP heads
    were stored (or with --no-mtp) goes on without, so its layers stay what they were."""
    out = Path(config.out)
    if config.overwrite or not (out / MANIFEST).is_file():
        return config.mtp
    try:
        return bool(read_manifest(out)["settings"].get("mtp", _LEGACY["mtp"]))
    except (OSError, ValueError, KeyError, TypeError):
        return config.mtp  # _open_store reports a damaged manifest in its own words


def _parameters(setting: dict[str, Any]) -> dict[str, Any]:
    return {k: setting[k] for k in (*SAMPLING_PARAMETERS, "seed") if k in setting}


def auto_dtype(device: str) -> str:
    """``--dtype auto``: bf16 on CUDA; fp32 on CPU, where bf16 runs 2-3x slower (measured on
    the quickstart) and fp32 is also the exact reference."""
    return "bf16" if device.startswith("cuda") else "fp32"


def _check_flags(config: ExtractConfig, target: Target) -> None:
    """The flags that need the model, before anything is written: a cache is never left unresumable
    (the others were checked before the load: capture/preflight.py)."""
    _check_sampling_flags(config, target)
    if not 1 <= config.top_k <= target.vocab_size:
        raise InputError(
            f"--logits-top-k {config.top_k} must be between 1 and the model's vocabulary of {target.vocab_size}"
        )


def _check_sampling_flags(config: ExtractConfig, target: Target) -> None:
    """The sampling setting against the model (what needs no model was refused by preflight)."""
    config.sampling.validate(target.vocab_size)


def _elsewhere(config: ExtractConfig) -> bool:
    """Whether vLLM runs in another interpreter than this one (this one cannot import it)."""
    import importlib.util
    import sys

    from hscache.engines.vllm.runtime import vllm_python

    check_extract_request(config)  # one line, before another interpreter starts, for every refusal
    return importlib.util.find_spec("vllm") is None and vllm_python(config.vllm_python) != sys.executable


_WORKER_PATHS = ("out", "model", "prompts", "tokens_from", "responses_from", "connector_dir")


def worker_job(config: ExtractConfig) -> dict[str, Any]:
    """``config`` as the JSON job of the extraction worker in vLLM's interpreter
    (engines/vllm/extract_worker.py ``config_of`` reads it back): its fields but ``vllm_python``, the
    sampling setting as ``SamplingSetting.to_dict``, and paths made absolute (the worker runs in a
    folder of its own)."""
    job = {
        k: getattr(config, k)
        for k in ExtractConfig.__dataclass_fields__
        if k not in ("sampling", "vllm_python")
    }
    job["sampling"] = config.sampling.to_dict()
    for key in _WORKER_PATHS:
        value = job[key]
        if (
            value
            and not str(value).startswith("builtin:")
            and (key in ("out", "connector_dir") or Path(value).exists())
        ):
            job[key] = str(Path(value).absolute())
    return job


def _extract_in_vllm_python(config: ExtractConfig, progress: Progress | None) -> ExtractResult:
    """The whole extraction in the interpreter that has vLLM (``run_worker``: a JSON job, a JSON result)."""
    import shutil
    import tempfile

    from hscache.engines.vllm.runtime import VllmWorkerError, interpreter_version, run_worker, vllm_python

    python = vllm_python(config.vllm_python)
    interpreter_version(python)  # its vLLM's version, from its metadata: one line when it is not 0.32
    _preflight_vllm_target(
        config
    )  # a target vLLM CPU cannot run: refused here, before vLLM's interpreter starts
    if progress is not None and hasattr(progress, "step"):
        progress.step(f"running the extraction in {python} (vLLM's interpreter)")
    workdir = Path(tempfile.mkdtemp(prefix="hscache-vllm-extract-"))
    job = worker_job(config)
    try:
        result = run_worker("hscache.engines.vllm.extract_worker", job, workdir, python=python)
    except VllmWorkerError:
        raise  # the workdir is kept: the error names its worker.log
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)  # a refusal the worker named in one line: nothing to read
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    return ExtractResult(**{**result, "path": Path(result["path"])})


def _preflight_vllm_target(config: ExtractConfig) -> None:
    """The target's config against vLLM's limits on ``config.device`` (runtime.preflight_target): the
    config.json of a directory, or a built-in target's (tiny: built here)."""
    from hscache.engines.vllm.runtime import preflight_target

    dtype = auto_dtype(config.device) if config.dtype == "auto" else config.dtype
    if config.model.startswith("builtin:"):
        text_config = load_target(config.model, "fp32", "cpu").text_config.to_dict()
    else:
        path = Path(config.model) / "config.json"
        if not path.is_file():
            return  # the worker names a missing model in its own line
        whole = json.loads(path.read_text())
        text_config = whole.get("text_config") or whole
    preflight_target(text_config, dtype, config.device)


def _extract_to_url(config: ExtractConfig, progress: Progress | None) -> ExtractResult:
    """``--out s3://...``: extract into a local staging directory, then upload (store/remote.py)."""
    from hscache.store.remote import staging_dir, upload_cache

    staging = staging_dir(config.out)
    result = extract(replace(config, out=str(staging)), progress)
    url = (
        config.out.rstrip("/") + "/" + result.path.relative_to(staging).as_posix()
        if config.shard
        else config.out
    )
    upload_cache(result.path, url.rstrip("/"), remove_local=True)
    return replace(result, path=url)


def _start_run(
    config: ExtractConfig,
    writer: StoreWriter,
    target: Target,
    settings: dict[str, Any],
    kernels: dict,
    prompts: _PromptSummary,
    engine: Any = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Write provenance.json once (a resume keeps it: the same settings make the same content) and
    add this run to the run log; return both (the run's entry is the log's last)."""
    provenance = read_provenance(writer.root)
    if not provenance:
        provenance = build_provenance(
            target=target, settings=settings, kernels=kernels, num_records=prompts.records
        )
        if engine is not None:  # what served the target is vLLM's, not transformers' (its copy only checks)
            provenance["capture"]["engine"] = engine.describe()
            provenance["capture"]["attn_implementation"] = "vllm"
        if "sampling" in settings:  # the realised-token counts are filled in when the cache is complete
            provenance["sampling"] = {
                **settings["sampling"],
                "sampled_positions": None,
                "realised_outside_support": None,
            }
            if engine is not None and config.sampling.drawn_by == "vllm":  # whose sampler, which seeds
                provenance["sampling"]["sampler"] = engine.sampler()
        write_provenance(writer, provenance)
    source = (
        config.responses_from
        or config.tokens_from
        or (str(prompts.path) if config.prompts != DEFAULT_PROMPTS else DEFAULT_PROMPTS)
    )
    runs = read_run_log(writer.root)
    runs.append(
        run_record(
            command="hscache extract",
            device=settings["device"],
            sequences_at_start=writer.committed_sequences,
            inputs={"model": model_path(target.name), "prompts": source},
        )
    )
    writer.write_run_log(encode_run_log(runs))
    return provenance, runs
