"""The ``hscache`` command line: a thin layer over the Python API.

Each command parses flags into a config, calls one public function, and prints the result.
Errors hscache raises on purpose print as one line (``error: ...``) with exit code 2.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from hscache.capture import BACKENDS
from hscache.cli_options import (
    allow_unsealed_option,
    apply_options,
    backend_option,
    compression_option,
    id_from_line_option,
    layers_option,
    model_option,
    number_option,
    print_json_option,
    prompt_limit_option,
    prompts_option,
    renamed_sample_top_k,
    report_outputs,
    states_option,
)
from hscache.errors import HscacheError
from hscache.store.dtypes import DTYPE_NAMES
from hscache.store.layout import COMPRESSIONS

__all__ = ["error_boundary", "main"]


def error_boundary(
    *error_types: type[BaseException], on_interrupt: str | None = None
) -> Callable[[Callable], Callable]:
    """Decorator for CLI commands: ``error_types`` print as one ``error: ...`` line with exit 2
    (tracebacks are kept for bugs); with ``on_interrupt``, Ctrl-C prints it and exits 130."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except error_types as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
            except KeyboardInterrupt:
                if on_interrupt is None:
                    raise
                click.echo(on_interrupt, err=True)
                sys.exit(130)

        return wrapper

    return decorate


friendly_errors = error_boundary(
    HscacheError, on_interrupt="interrupted: committed sequences are kept; re-run the same command to resume"
)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Pre-empted nodes get SIGTERM before SIGKILL: treat it like Ctrl-C, so the batches already
    captured are committed on the way out (see writer_thread) instead of being lost."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _ExtractProgress:
    """extract's Progress callbacks (hscache.capture.extract.Progress) on the shared reporter."""

    def __init__(self) -> None:
        from hscache.progress import StepProgress

        self.reporter = StepProgress("extract", "sequences", secondary_unit="tok", eager=True)

    def step(self, text: str) -> None:
        self.reporter.note(text)

    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None:
        note = f"resuming: {done_sequences} already committed" if done_sequences else None
        self.reporter.start(total_sequences, done_sequences, note)

    def status(self, text: str) -> None:
        self.reporter.set_status(text)
        self.reporter.advance(0, 0)

    def advance(self, sequences: int, tokens: int) -> None:
        self.reporter.advance(sequences, tokens)

    def finish(self) -> None:
        self.reporter.set_status("")  # what it was doing last is over
        self.reporter.finish()


# ----------------------------------------------------------------------------- extract's sampling flags

# Flags -> SamplingSetting fields (--top-k samples, as in the engines; the stored logits are --logits-top-k).
_SAMPLING_FLAGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "sample_top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "samples_per_prompt": "samples_per_prompt",
}


# The sampling flags of ``hscache extract`` (docs/extract.md "Sampled extraction").
sampling_options = apply_options(
    [
        click.option(
            "--sampling",
            default=None,
            metavar="PRESET",
            help="greedy (the default), qwen-thinking (T 1.0, top-p 0.95, top-k 20, presence 1.5), "
            "qwen-thinking-coding (T 0.6, top-p 0.95, top-k 20), qwen-instruct (T 0.7, top-p 0.8, top-k 20, "
            "presence 1.5), or generation-config (the --model directory's generation_config.json). "
            "Explicit flags below override a preset's field.",
        ),
        click.option("--temperature", type=float, default=None, help="0: greedy (default); else >= 1e-5."),
        click.option("--top-p", type=float, default=None, help="In (0, 1] (default 1)."),
        click.option(
            "--top-k",
            "sample_top_k",
            type=int,
            default=None,
            help="Sampling top-k, >= 1 (required when sampling: the stored distribution is exact), as "
            "vLLM's --top-k. The target logits the cache keeps are --logits-top-k.",
        ),
        renamed_sample_top_k,
        click.option("--min-p", type=float, default=None, help="In [0, 1] (default 0)."),
        click.option("--presence-penalty", type=float, default=None, help="In [-2, 2] (default 0)."),
        click.option("--frequency-penalty", type=float, default=None, help="In [-2, 2] (default 0)."),
        click.option("--repetition-penalty", type=float, default=None, help="In (0, 2] (default 1)."),
        click.option("--seed", type=int, default=None, help="Keys every draw (default 0 when sampling)."),
        click.option(
            "--samples-per-prompt",
            type=int,
            default=None,
            help="Sampled trajectories per prompt, each its own sequence (index column 'sample').",
        ),
        click.option(
            "--responses-from",
            default=None,
            metavar="FILE",
            help="A vLLM server's sampled completions (JSON lines of request + response with token ids and "
            "processed top logprobs), teacher-forced as they are; the sampling setting is read from the requests.",
        ),
    ]
)


def _sampling_setting(options: dict[str, Any]) -> Any:
    """Pop the sampling flags from ``options`` and validate them into a ``SamplingSetting``, before
    torch is imported; says what ``--sampling generation-config`` and ``--responses-from`` took."""
    from hscache.errors import InputError
    from hscache.store.sampling import SamplingSetting, generation_config_values

    preset = options.pop("sampling")
    flags = {field: options.pop(flag) for flag, field in _SAMPLING_FLAGS.items()}
    if options["responses_from"]:
        from hscache.capture.responses import iter_responses, responses_sampling

        if preset is not None:
            raise InputError(
                "--responses-from reads the sampling setting from the file's requests; drop --sampling"
            )
        setting = responses_sampling(options["responses_from"], flags)
        for _record in iter_responses(options["responses_from"], setting):  # every record's logprobs, now
            pass
        click.echo(f"sampling: {setting.describe()} (from {options['responses_from']}'s requests)")
        return setting
    if flags["top_k"] is not None and preset is None and not flags["temperature"]:
        # --top-k meant the stored logits until 2026-12-03: said once, for one release
        raise InputError(
            f"--top-k {flags['top_k']} is the sampling top-k (as in vLLM), which does nothing at temperature "
            f"0: to keep {flags['top_k']} target logits per token pass --logits-top-k {flags['top_k']} "
            "(renamed from --top-k); to sample, add --temperature T or --sampling PRESET"
        )
    setting = SamplingSetting.from_flags(preset, model=options["model"], **flags)
    if preset == "generation-config":
        path, values = generation_config_values(options["model"])
        took = ", ".join(f"{k} {v}" for k, v in values.items()) or "nothing (vLLM's defaults apply)"
        click.echo(f"sampling: took {took} from {path}; now {setting.describe()}")
    return setting


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hscache")
def main() -> None:
    """Extract a target model's hidden states once; score drafters against them offline."""


@main.command()
@model_option
@prompts_option
@layers_option
@click.option("--out", required=True, help="Cache directory (created, or resumed when it holds a cache).")
@number_option(
    "--max-new-tokens", 64, "Greedy continuation length per prompt (0: cache the prompt text as is)."
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPE_NAMES]),
    default="auto",
    show_default=True,
    help="auto: bf16 on CUDA, fp32 on CPU (bf16 is 2-3x slower there).",
)
@backend_option
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@number_option(
    "--max-length",
    4096,
    "Longest sequence, prompt + generated tokens (longer prompts are refused by name).",
    minimum=1,
)
@number_option(
    "--logits-top-k",
    64,
    "Target logits kept per token (sorted), with the exact log-sum-exp over the vocabulary "
    "(--top-k until 2026-12-03; --top-k is now sampling's).",
    minimum=1,
    name="top_k",
)
@number_option("--batch-tokens", 0, "Padded tokens per forward (0: one sequence on CPU, 16384 on CUDA).")
@number_option(
    "--generate-batch", 0, "Prompts per batched greedy generate, left-padded (0: 8 on CPU, 64 on CUDA)."
)
@number_option(
    "--memory-gb",
    2.0,
    "Working set for [rows, vocab] logits beyond the weights; the head is projected in row chunks.",
    min_open=True,
)
@click.option("--full-logits", is_flag=True, help="Also store full [T, V] logits (small vocabularies).")
@compression_option(
    "none: memory-speed reads (training); fast: blosc lz4+bitshuffle, 13% smaller; balanced: blosc "
    "zstd-1+shuffle, 20% smaller, slow to decode (docs/storage.md). `hscache recompress` converts later.",
)
@states_option(
    "source: hidden states at --dtype (lossless); fp8: float8 e4m3 bits + a scale per token and "
    "layer, about half of bf16, converted once the run completes (docs/storage.md)."
)
@number_option(
    "--chunk-mb",
    8.0,
    "Target size of a stored chunk; lower it for random access to short sequences.",
    minimum=0.001,
)
@number_option("--commit-every-s", 30.0, "Seconds between durable commits (0: after every batch).")
@prompt_limit_option
@click.option(
    "--shard",
    default=None,
    help="I/N: extract every N-th prompt from I into OUT/shard-IIIII-of-NNNNN "
    "(run N of these; open_cache(OUT) reads them as one).",
)
@click.option(
    "--tokens-from",
    default=None,
    metavar="CACHE",
    help="Take the prompts from another cache's token ids, record ids and metadata, replayed as they "
    "are (--max-new-tokens 0): two caches on identical tokens, e.g. to compare kernels.",
)
@click.option(
    "--suffix-duplicate-ids",
    is_flag=True,
    help="Rename a repeated record id to ID#2, ID#3, ... (default: refuse the prompts file).",
)
@id_from_line_option
@click.option(
    "--mtp/--no-mtp",
    default=True,
    show_default=True,
    help="Store the target's own MTP head (mtp.* weights) when its checkpoint has one, and the last "
    "layer it reads, so `scorer eval target:mtp` can score it (a resume follows the cache's choice).",
)
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="What runs the target: transformers, or vLLM (its own kernels and sampler, as served; needs vLLM "
    'importable: docs/extract.md "Extracting with vLLM").',
)
@click.option(
    "--connector-dir",
    default=None,
    metavar="DIR",
    help="With --engine vllm: also keep vLLM's own per-request hidden-state files in DIR "
    "(hs_<sequence>.safetensors, as speculators names them; `hscache import --format vllm` reads them).",
)
@click.option(
    "--vllm-python",
    default=None,
    metavar="PATH",
    help="With --engine vllm from a Python without vLLM: the interpreter that has it (default "
    "$HSCACHE_VLLM_PYTHON); the extraction runs there.",
)
@click.option("--overwrite", is_flag=True, help="Delete an existing cache at --out and start over.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@sampling_options
@click.pass_context
@friendly_errors
def extract(ctx: click.Context, quiet: bool, chunk_mb: float, shard: str | None, **options: Any) -> None:
    """Run the target once and write hidden states, token ids and target logits to a cache.

    \b
    Example:
      hscache extract --model builtin:tiny-qwen3.5 --prompts builtin:default --layers 1,3,5 --out cache/
    """
    from types import SimpleNamespace

    from hscache.capture.preflight import check_extract_request
    from hscache.store.shards import parse_shard

    sampling = _sampling_setting(options)  # flags and a responses file checked before torch is imported
    if (options["tokens_from"] or options["responses_from"]) and ctx.get_parameter_source(
        "max_new_tokens"
    ) is click.core.ParameterSource.DEFAULT:
        options["max_new_tokens"] = 0  # a replay of given tokens generates nothing
    options["shard"] = parse_shard(shard) if shard else None
    # Bad flags, an --out that cannot be written, a second writer, a prompts file that does not parse:
    # refused here, before torch is imported (seconds) and the model loaded (a minute).
    check_extract_request(SimpleNamespace(**options, sampling=sampling))
    from hscache.capture.extract import ExtractConfig
    from hscache.capture.extract import extract as run_extract

    config = ExtractConfig(chunk_bytes=int(chunk_mb * (1 << 20)), sampling=sampling, **options)
    # rich draws nothing until the end when stderr is not a terminal (a log file, a batch job).
    progress = None if quiet else _ExtractProgress()
    with _sigterm_as_interrupt():
        result = run_extract(config, progress)
    if result.unchanged:
        from hscache.store.integrity import manifest_digest
        from hscache.store.reader import read_manifest

        click.echo(
            f"{result.path} is already complete with these settings ({result.sequences} sequences, "
            f"{result.tokens} tokens): nothing to do, nothing written; digest "
            f"{manifest_digest(read_manifest(Path(result.path)))}"
        )
        return
    resumed = f" (resumed after {result.resumed_from})" if result.resumed_from else ""
    click.echo(
        f"wrote {result.sequences} sequences, {result.tokens} tokens to {result.path}{resumed} "
        f"in {result.seconds:.1f} s; backend={result.provenance['capture']['backend']}"
    )
    if result.mtp:
        layers = result.provenance["capture"]["layer_ids"]
        click.echo(
            f"stored the target's MTP head (layers {','.join(map(str, layers))} include the last one it reads; "
            f"--no-mtp skips both); score it with `scorer eval target:mtp --cache {result.path}`"
        )


@main.command()
@click.argument("cache_dir")
@print_json_option("the summary")
@allow_unsealed_option("Summarise")
@friendly_errors
def info(cache_dir: str, as_json: bool, allow_unsealed: bool) -> None:
    """Summarise a cache: sequences, tokens, layers, dtype, backend, sizes, and its digest.

    \b
    Example:
      hscache info cache/ --json
    """
    from hscache.store.info import cache_summary, format_summary

    summary = cache_summary(cache_dir, allow_unsealed=allow_unsealed)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


def _position_buckets(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        starts = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of integers, e.g. 0,16,64,256"
        ) from None
    from hscache.diff.buckets import check_bucket_starts

    try:
        check_bucket_starts(starts)
    except ValueError as exc:
        raise click.BadParameter(f"{value[:80]!r}: {exc}, e.g. 0,16,64,256") from None
    return starts


@main.command()
@click.argument("cache_a")
@click.argument("cache_b", required=False)
@report_outputs("the full report")
@click.option(
    "--intersect", is_flag=True, help="Compare only the sequences both caches hold with identical token ids."
)
@click.option(
    "--position-buckets",
    default="0,16,32,64,128,256,512,1024,2048,4096",
    show_default=True,
    callback=_position_buckets,
    help="Token-position bucket starts, from 0; the last bucket is open.",
)
@click.option(
    "--allow-target-mismatch",
    is_flag=True,
    help="Compare caches of different targets anyway (refused by default: their distance is not drift); "
    "the report says so.",
)
@click.option(
    "--exact-slice",
    is_flag=True,
    help="CACHE_A is a compact cache (fp8 states), no CACHE_B: its codec's error per layer (relative L2) "
    "against the sequences it keeps exact.",
)
@friendly_errors
def diff(
    cache_a: str,
    cache_b: str | None,
    json_out: str | None,
    report_out: str | None,
    intersect: bool,
    position_buckets: tuple[int, ...],
    allow_target_mismatch: bool,
    exact_slice: bool,
) -> None:
    """Measure drift between two caches of the same tokens (A is the reference), layer by layer.

    \b
    Example:
      hscache diff cache_fp32/ cache_bf16/ --report drift.html --json drift.json
      hscache diff cache_fp8/ --exact-slice
    """
    from hscache.errors import InputError
    from hscache.store.open import check_cache_path
    from hscache.store.output_paths import check_output_path

    if exact_slice:
        if cache_b is not None or json_out or report_out:
            raise InputError(
                "--exact-slice takes one cache and prints its table: drop CACHE_B, --json, --report"
            )
        check_cache_path(cache_a)
        from hscache.diff.codec import exact_slice_error, format_exact_slice_error

        click.echo(format_exact_slice_error(exact_slice_error(cache_a)))
        return
    if cache_b is None:
        raise InputError("hscache diff needs CACHE_A and CACHE_B (or one compact cache with --exact-slice)")

    for path in (cache_a, cache_b):
        check_cache_path(path)  # before torch is imported
    for flag, path, kind in (("--json", json_out, "json"), ("--report", report_out, "html")):
        if path is not None:
            check_output_path(path, flag, kind=kind)  # before the diff, not after it
    from hscache.diff.compare import diff_caches
    from hscache.diff.report import format_report, save_json
    from hscache.progress import StepProgress
    from hscache.report.html import write_report

    with StepProgress("diff", "sequences", secondary_unit="tok") as progress:
        result = diff_caches(
            cache_a,
            cache_b,
            intersect=intersect,
            position_buckets=position_buckets,
            progress=progress,
            allow_target_mismatch=allow_target_mismatch,
        )
    click.echo(format_report(result))
    if json_out:
        click.echo(f"wrote {save_json(result, json_out)}")
    if report_out:
        click.echo(f"wrote {write_report(result, report_out)}")


@main.command()
@click.argument("cache_dir")
@click.option("--deep", is_flag=True, help="Also decode every stored chunk of every array (checksums).")
@number_option("--recompute", 0, "Re-run N sampled sequences through the target and compare with the cache.")
@click.option("--model", help="Target for --recompute (default: the cache's --model).")
@click.option("--device", help="Device for --recompute (default: the cache's).")
@click.option(
    "--backend", type=click.Choice(BACKENDS), help="Backend for --recompute (default: the cache's)."
)
@click.option(
    "--tolerance",
    type=click.FloatRange(min=0),
    help="Max relative error for --recompute (default: 0 when the re-run must be exact, else 0.02).",
)
@click.option("--seed", default=0, show_default=True, help="Which sequences --recompute samples.")
@click.option(
    "--expect-digest",
    default=None,
    help="The cache's digest as pinned (printed by `hscache info`): any other digest is a problem.",
)
@allow_unsealed_option("Check", " with a warning instead of failing")
@print_json_option("the report", "schemas/verify_report")
@friendly_errors
def verify(cache_dir: str, as_json: bool, **options: Any) -> None:
    """Check a cache: index, checksums, token hashes, NaN/Inf, zeros, norms; exit 1 if anything is wrong.

    \b
    Example:
      hscache verify cache/ --deep --recompute 4
    """
    from hscache.store.shards import has_shards, shard_dirs
    from hscache.verify import Problem, VerifyConfig, format_report, verify_cache

    # A sharded cache is verified shard by shard: each is an ordinary cache with its own commits.
    sharded = "://" not in cache_dir and has_shards(cache_dir)
    if "://" in cache_dir:  # a remote cache: verified through its URL (store/remote.py)
        roots: list[Any] = [cache_dir]
    else:
        roots = shard_dirs(Path(cache_dir)) if sharded else [Path(cache_dir)]
    # A directory of shards has one digest over its shards' (hscache info prints it): checked below.
    expected = options.pop("expect_digest") if sharded else None
    from hscache.progress import StepProgress

    with StepProgress("verify", "tokens") as progress:
        reports = [verify_cache(root, VerifyConfig(**options), progress) for root in roots]
    if expected is not None:
        from hscache.store.integrity import combined_digest

        digest = combined_digest([r.digest or "" for r in reports])
        if digest != expected.strip().lower():
            reports[0].add(
                Problem("manifest", f"the shards' digest is {digest}, not the expected {expected}")
            )
    if as_json:
        docs = [r.to_dict() for r in reports]
        click.echo(json.dumps(docs[0] if len(docs) == 1 else {"shards": docs}, indent=2))
    else:
        click.echo(
            "\n\n".join(
                f"{root}:\n{format_report(r)}" if len(roots) > 1 else format_report(r)
                for root, r in zip(roots, reports)
            )
        )
    if not all(r.ok for r in reports):
        sys.exit(1)


@main.command()
@click.argument("out")
@click.option(
    "--into", default=None, help="Also write one ordinary cache holding every shard's sequences here."
)
@friendly_errors
def merge(out: str, into: str | None) -> None:
    """Check the shards under OUT (same settings, none missing) and write OUT/shards.json.

    \b
    Example:
      hscache merge out/ --into merged/
    """
    from hscache.store.shards import merge_shards

    document = merge_shards(out, into)
    state = "complete" if document["complete"] else "still running"
    click.echo(
        f"{document['shards']} shards, {document['sequences']} sequences, {document['tokens']} tokens "
        f"({state}); wrote {out}/shards.json" + (f" and the merged cache {into}" if into else "")
    )


@main.command()
@click.argument("cache_dir")
@click.option(
    "--compression",
    type=click.Choice(list(COMPRESSIONS)),
    help="The codec to convert every array to: none (training: memory-speed reads), fast, balanced.",
)
@states_option(
    "fp8: store the hidden states as float8 e4m3 bits + a scale per token and layer (about half "
    "of bf16; lossy, one way), keeping an exact slice at the source dtype.",
    required_default=False,
)
@friendly_errors
def recompress(cache_dir: str, compression: str | None, states: str | None) -> None:
    """Convert CACHE_DIR's arrays to another codec, or its states to fp8, in place (crash-safe; re-run
    to resume).

    \b
    Example:
      hscache recompress cache/ --compression none
      hscache recompress cache/ --states fp8
    """
    from hscache.errors import InputError

    if compression is None and states is None:
        raise InputError("say what to convert: --compression none|fast|balanced and/or --states fp8")
    if states is not None:
        from hscache.store.compact_convert import convert_states

        convert_states(cache_dir, states, progress=click.echo)
        click.echo(f"{cache_dir} now stores its hidden states as {states}")
    if compression is not None:
        from hscache.store.recompress import recompress_cache

        recompress_cache(cache_dir, compression, progress=click.echo)
        click.echo(f"{cache_dir} now stores every array with compression {compression}")


_INTEROP_FORMATS = ("speculators", "specforge")
# import also reads vLLM's own hidden-state files (its extract_hidden_states connector's, one per request).
_IMPORT_FORMATS = (*_INTEROP_FORMATS, "vllm")


def _interop_options(
    formats: tuple[str, ...], format_help: str, out_help: str
) -> Callable[[Callable], Callable]:
    """export's and import's ``--format`` (``fmt``, one of ``formats``) and ``--out``, both required."""
    return apply_options(
        [
            click.option("--format", "fmt", type=click.Choice(formats), required=True, help=format_help),
            click.option("--out", required=True, help=out_help),
        ]
    )


@main.command("export")
@click.argument("cache_dir")
@_interop_options(
    _INTEROP_FORMATS, "The peer tool's offline format.", "New or empty directory for the exported files."
)
@click.option("--layers", default=None, help="Export only these cached layers, in this order (default: all).")
@click.option(
    "--allow-incomplete",
    is_flag=True,
    help="Export a cache whose extraction has not finished (its committed sequences only; refused by default).",
)
@states_option(
    "speculators only: fp8 writes hs-connectors' fp8 files (float8 hidden_states + hidden_states_scales "
    "per token), what speculators' fp8 hidden-states backend reads."
)
@friendly_errors
def export_cmd(
    cache_dir: str, fmt: str, out: str, layers: str | None, allow_incomplete: bool, states: str
) -> None:
    """Write CACHE_DIR in speculators' or SpecForge's offline training format (hscache/interop/).

    \b
    Example:
      hscache export cache/ --format speculators --out spec/
    """
    from hscache.store.open import check_cache_path
    from hscache.store.paths import check_empty_out

    check_cache_path(cache_dir)  # before torch is imported
    if states != "source" and fmt != "speculators":
        from hscache.errors import InputError

        raise InputError(f"--states {states} is implemented for --format speculators only, not {fmt}")
    _check_complete(cache_dir, allow_incomplete)
    check_empty_out(out)
    if fmt == "speculators":
        from functools import partial

        from hscache.interop.speculators import export_speculators

        export = partial(export_speculators, states=states)
    else:
        from hscache.interop.specforge import export_specforge as export
    from hscache.interop.common import parse_layer_ids
    from hscache.progress import StepProgress

    with StepProgress("export", "sequences") as progress:
        count = export(cache_dir, out, parse_layer_ids(layers, "--layers"), progress=progress)
    click.echo(f"exported {count} sequences from {cache_dir} to {out} ({fmt} format)")


def _check_complete(cache_dir: str, allow_incomplete: bool) -> None:
    """An export of a cache whose extraction is unfinished (killed, or still running) writes only the
    sequences committed so far: refused unless ``--allow-incomplete``, and said either way."""
    from hscache.errors import InputError
    from hscache.store.info import cache_completeness
    from hscache.store.open import open_cache

    state = cache_completeness(open_cache(cache_dir))
    if state["complete"]:
        return
    of = f" of {state['expected_sequences']}" if state["expected_sequences"] else ""
    held = f"{cache_dir} is incomplete: {state['committed_sequences']}{of} sequences committed"
    if not allow_incomplete:
        how = (
            "wait for its writer to finish" if state["writer"] else "resume its extraction (the same command)"
        )
        raise InputError(f"{held}; {how}, or pass --allow-incomplete to export only those")
    click.echo(f"warning: {held}; exporting only those (--allow-incomplete)", err=True)


@main.command("import")
@click.argument("source_dir")
@_interop_options(
    _IMPORT_FORMATS,
    "The peer tool's offline format, or vllm: the files of vLLM's hidden-states connector.",
    "New or empty directory for the cache.",
)
@click.option(
    "--layer-ids",
    default=None,
    help="Layers in the source's own convention (speculators: vLLM aux ids incl. the last; SpecForge: "
    "dflash_config.target_layer_ids; vllm: the engine's eagle_aux_hidden_state_layer_ids, required). Not "
    "needed for a folder written by hscache export.",
)
@compression_option("Hidden-state codec, as for extract (docs/storage.md).")
@click.option(
    "--target",
    default=None,
    help="The model that produced the files (builtin:... or a local HF dir): adds target/ and, for "
    "speculators (whose last slot is the last layer), computes target_argmax/top-k/logsumexp.",
)
@states_option(
    "fp8: store the imported states compact (float8 e4m3 + a scale per token and layer, converted once the "
    "import completes; fp8 files are requantised with those scales, not kept bit for bit)."
)
@friendly_errors
def import_cmd(
    source_dir: str,
    fmt: str,
    out: str,
    layer_ids: str | None,
    compression: str,
    target: str | None,
    states: str,
) -> None:
    """Turn SOURCE_DIR (speculators or SpecForge offline data, or vLLM's hidden-state files) into a cache.

    \b
    Example:
      hscache import --format speculators spec/ --out from-spec/
    """
    from hscache.store.layout import IMPORTING_MARK
    from hscache.store.paths import check_empty_out, check_source_dir

    check_source_dir(source_dir, fmt)  # before torch is imported
    check_empty_out(out, restart_mark=IMPORTING_MARK)
    from hscache.interop.common import parse_layer_ids

    if fmt == "speculators":
        from hscache.interop.speculators import import_speculators as load
    elif fmt == "vllm":
        from hscache.interop.vllm import import_vllm as load
    else:
        from hscache.interop.specforge import import_specforge as load
    from hscache.progress import StepProgress

    with StepProgress("import", "sequences", secondary_unit="tok") as progress:
        count, tokens = load(
            source_dir, out, parse_layer_ids(layer_ids), compression, target, progress=progress
        )
    if states != "source":
        from hscache.store.compact_convert import convert_states

        convert_states(out, states, progress=click.echo)
    from hscache.store.open import open_cache

    scorable = "target_argmax" in open_cache(out).specs
    click.echo(
        f"imported {count} sequences ({tokens} tokens) from {source_dir} ({fmt}) into {out}; "
        + (
            "target arrays computed from the last layer with --target"
            if scorable
            else "it holds no target logits (target_argmax, top-k, logsumexp): scorer eval cannot score it"
        )
    )


if __name__ == "__main__":
    main()
