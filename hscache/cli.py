"""The ``hscache`` command line: a thin layer over the Python API.

Each command parses flags into a config, calls one public function, and prints the result.
Errors hscache raises on purpose print as one line (``error: ...``) with exit code 2.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from hscache.errors import HscacheError

__all__ = ["main"]


def friendly_errors(fn: Callable) -> Callable:
    """Turn expected errors into one line on stderr and exit code 2; keep tracebacks for bugs."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HscacheError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted: committed sequences are kept; re-run the same command to resume", err=True)
            sys.exit(130)

    return wrapper


class _RichProgress:
    """Sequences done/total, tokens/s and ETA on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]extract"), BarColumn(), MofNCompleteColumn(), TextColumn("seqs"),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False,
        )
        self.task = None
        self.tokens = 0
        self.t0 = 0.0

    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None:
        import time

        self.t0 = time.perf_counter()
        self.progress.start()
        self.task = self.progress.add_task("extract", total=total_sequences, completed=done_sequences, rate="")
        if done_sequences:
            self.progress.console.print(f"resuming: {done_sequences}/{total_sequences} sequences already committed")

    def advance(self, sequences: int, tokens: int) -> None:
        import time

        self.tokens += tokens
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self.progress.update(self.task, advance=sequences, rate=f"{rate:,.0f} tok/s")

    def finish(self) -> None:
        self.progress.stop()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hscache")
def main() -> None:
    """Extract a target model's hidden states once; score drafters against them offline."""


@main.command()
@click.option("--model", default="builtin:tiny-qwen3.5", show_default=True,
              help="Local Hugging Face directory, or builtin:tiny-qwen3.5 / builtin:tiny-qwen3.")
@click.option("--prompts", default="builtin:default", show_default=True,
              help="JSONL file ({id, prompt|messages|input_ids, ...metadata}) or builtin:default.")
@click.option("--layers", default="dflash:3", show_default=True,
              help="0-based decoder-layer ids (1,9,17) or dflash:N for the DFlash rule.")
@click.option("--out", required=True, help="Cache directory (created, or resumed when it holds a cache).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=0),
              help="Greedy continuation length per prompt (0: cache the prompt text as is).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--backend", type=click.Choice(["auto", "fla", "torch"]), default="auto", show_default=True,
              help="Linear-attention kernels: fla (CUDA), torch fallback, or auto.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--max-length", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--top-k", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="Padded tokens per forward (0: one sequence on CPU, 16384 on CUDA).")
@click.option("--full-logits", is_flag=True, help="Also store full [T, V] logits (small vocabularies).")
@click.option("--compression", type=click.Choice(["balanced", "fast", "none"]), default="balanced",
              show_default=True)
@click.option("--chunk-mb", default=8.0, show_default=True, type=click.FloatRange(min=0.001))
@click.option("--commit-every-s", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between durable commits (0: after every batch).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--overwrite", is_flag=True, help="Delete an existing cache at --out and start over.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@friendly_errors
def extract(quiet: bool, chunk_mb: float, **options: Any) -> None:
    """Run the target once and write hidden states, token ids and target logits to a cache."""
    from hscache.extract import ExtractConfig, extract as run_extract

    config = ExtractConfig(chunk_bytes=int(chunk_mb * (1 << 20)), **options)
    progress = None if quiet else _RichProgress()
    result = run_extract(config, progress)
    resumed = f" (resumed after {result.resumed_from})" if result.resumed_from else ""
    click.echo(f"wrote {result.sequences} sequences, {result.tokens} tokens to {result.path}{resumed} "
               f"in {result.seconds:.1f} s; backend={result.provenance['capture']['backend']}")


@main.command()
@click.argument("cache_dir")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@friendly_errors
def info(cache_dir: str, as_json: bool) -> None:
    """Summarise a cache: sequences, tokens, layers, dtype, backend, sizes."""
    from hscache.info import cache_summary, format_summary

    summary = cache_summary(cache_dir)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


if __name__ == "__main__":
    main()
