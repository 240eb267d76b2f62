"""What every `hexq` command shares: the Typer app, the consoles, the option aliases, one-line errors, progress bars.

hexq modules are imported inside each command, not here: importing torch and transformers takes seconds, and
`hexq --help` or a mistyped option should not wait for them."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hexq.base.errors import HexqError

app = typer.Typer(help="Quantize, calibrate and serve Mixture-of-Experts language models.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console()
err_console = Console(stderr=True)

DEFAULT_EVAL_DATA = ["wikitext2", "austen", "pydocs", "foldoc"]

ModelArg = Annotated[Path, typer.Argument(help="HuggingFace MoE model: a local folder, or a hub id (owner/name: the "
                                          "local hub cache first, else downloaded).", show_default=False)]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit of a hub id.")]
EvalTargetArg = Annotated[Path, typer.Argument(help="HuggingFace MoE model (folder or hub id), or a hexq calibration "
                                               "folder (evaluated as its quantized model).", show_default=False)]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", "-L", help="Window length in tokens.", min=2)]
WindowsOpt = Annotated[int | None, typer.Option("--windows", "-n", help="Evaluate at most this many windows "
                                                "per text (default: all).", min=1)]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="Windows per forward pass.", min=1)]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or auto (cuda when present, else "
                                        "cpu).")]
ActivationsOpt = Annotated[str, typer.Option("--activation-memory", help="Memory for activations between two layers, "
                                             "e.g. 2GiB; the rest spills to disk.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder (only one hexq wrote, of "
                                        "the same kind; never an input).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")]


def handle_errors(command):
    """Turn known errors into one red line and exit code 1; HEXQ_DEBUG=1 shows the traceback instead."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (HexqError, ValueError, OSError) as exc:  # OSError: disk full, permissions, missing files
            if os.environ.get("HEXQ_DEBUG"):
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None
        except RuntimeError as exc:
            import torch

            if not isinstance(exc, torch.OutOfMemoryError) or os.environ.get("HEXQ_DEBUG"):
                raise
            from hexq.base.devices import out_of_memory_message

            message = out_of_memory_message(exc, command.__name__.removesuffix("_command"))
            err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)


def staged(bar: Progress, title: str):
    """A progress callback (what, done, total) for layer-by-layer work: one bar for the layers, with its ETA, and one
    for the stage inside the current layer (expert groups, loss table), reset when the stage changes."""
    layers = bar.add_task(title, total=None)
    inner: dict[str, int] = {}

    def report(what: str, done: int, total: int) -> None:
        if what == "layers" or what not in inner:
            for task in inner.values():
                bar.remove_task(task)
            inner.clear()
        if what == "layers":
            bar.update(layers, completed=done, total=total)
            return
        if what not in inner:
            inner[what] = bar.add_task(f"  {what}", total=total)
        bar.update(inner[what], completed=done, total=total)

    return report
