"""The `hexq` command. One function per command; rich output lives here only."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from hexq import __version__
from hexq.errors import HexqError

app = typer.Typer(help="Quantize, calibrate and serve Mixture-of-Experts language models.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console()
err_console = Console(stderr=True)

DEFAULT_EVAL_DATA = ["wikitext2", "austen", "pydocs", "foldoc"]

ModelArg = Annotated[Path, typer.Argument(help="Local HuggingFace MoE model folder.", show_default=False)]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", "-L", help="Window length in tokens.", min=2)]
WindowsOpt = Annotated[int | None, typer.Option("--windows", "-n", help="Evaluate at most this many windows "
                                                "per text (default: all).", min=1)]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="Windows per forward pass.", min=1)]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="torch device (default: cuda if present, else cpu).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")]


def handle_errors(command):
    """Turn known errors into one red line and exit code 1; HEXQ_DEBUG=1 shows the traceback instead."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (HexqError, ValueError, FileNotFoundError) as exc:
            if os.environ.get("HEXQ_DEBUG"):
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)


@app.command()
def version() -> None:
    """Print hexq's version."""
    console.print(f"hexq {__version__}")


@app.command("eval")
@handle_errors
def eval_command(
    model: ModelArg,
    data: Annotated[list[str] | None, typer.Option("--data", "-d", help="Corpus name (wikitext2, austen, pydocs, "
                                                  "foldoc: held-out parts) or a text/jsonl/parquet file; "
                                                  "repeat for several.")] = None,
    seqlen: SeqlenOpt = 256,
    windows: WindowsOpt = None,
    batch_size: BatchOpt = 8,
    device: DeviceOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Perplexity with the GPTQ protocol (non-overlapping windows, exp of mean token NLL)."""
    from hexq.eval.run import evaluate_model
    from hexq.io import write_json_atomic

    sources = data or DEFAULT_EVAL_DATA
    with progress_bar() as bar:
        tasks: dict[str, int] = {}

        def report(source: str, done: int, total: int) -> None:
            if source not in tasks:
                tasks[source] = bar.add_task(f"eval {source}", total=total)
            bar.update(tasks[source], completed=done)

        rows = evaluate_model(model, sources, seqlen, windows, batch_size, device, report)
    table = Table(title=f"perplexity of {model.name} (window {seqlen})")
    for column in ("data", "perplexity", "windows", "tokens scored"):
        table.add_column(column, justify="left" if column == "data" else "right")
    for row in rows:
        r = row.result
        table.add_row(row.data, f"{r.perplexity:.3f}", str(r.windows), f"{r.tokens_scored:,}")
    console.print(table)
    if json_out is not None:
        write_json_atomic(json_out, {"model": str(model), "results": [row.as_dict() for row in rows]})
        console.print(f"wrote {json_out}")


def main() -> None:
    app()
