"""The commands that read an artifact: `hexq inspect`, `hexq export` and `hexq report` (registered by hexq_cli.main;
hexq modules imported inside each, for start-up time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hexq.base.errors import HexqError
from hexq_cli.common import ForceOpt, JsonOpt, SeqlenOpt, console, err_console, handle_errors, progress_bar, staged


@handle_errors
def inspect(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder made by hexq pack.", show_default=False)],
    json_out: JsonOpt = None,
) -> None:
    """Sizes per part, bits per layer, budget use and checksums of an artifact."""
    from hexq.artifact.inspect import summarize
    from hexq.base.io import write_json_atomic
    from hexq.base.units import format_bytes

    info = summarize(artifact)
    parts = Table(title=f"{artifact.name}: {info['model']['model_type']}, {info['model']['num_layers']} layers x "
                        f"{info['model']['num_experts']} experts (format v{info['format_version']})")
    for column in ("part", "files", "bytes", "checksums"):
        parts.add_column(column, justify="left" if column == "part" else "right")
    for part in info["parts"]:
        parts.add_row(part["part"], str(part["files"]), format_bytes(part["bytes"]),
                      "ok" if part["ok"] else "[bold red]BAD[/]")
    console.print(parts)
    layers = Table(title=f"allocation ({info['allocation']['budget']}), placement {info['placement']['scheme']}")
    widths = info["allocation"]["bits_set"]
    for column in ("layer", *[f"{b}-bit" for b in widths], "avg bits", "expert bytes", "hot experts"):
        layers.add_column(column, justify="right")
    for row in info["allocation"]["layers"]:
        layers.add_row(str(row["layer"]), *[str(row["histogram"].get(str(b), 0)) for b in widths],
                       f"{row['average_bits']:.3f}", format_bytes(row["bytes"]), " ".join(map(str, row["hot"])))
    console.print(layers)
    accounting = info["accounting"]
    banked = (f" + every expert at {', '.join(map(str, accounting['bank_bits']))} bits"
              if accounting["bank_bits"] else "")
    console.print(f"experts stored (allocation{banked}): {format_bytes(accounting['stored_experts'])} = "
                  f"{accounting['experts_vs_bf16']:.1%} of their bf16 size {format_bytes(accounting['bf16_experts'])}"
                  f"; dense part {format_bytes(accounting['dense'])} (head {accounting['head']}); artifact "
                  f"{format_bytes(accounting['files'])}"
                  f"; checksums {'ok' if info['checksums_ok'] else 'FAILED'}")
    if json_out is not None:
        write_json_atomic(json_out, info)
        console.print(f"wrote {json_out}")
    if not info["checksums_ok"]:
        bad = ", ".join(name for name, ok in info["files"].items() if not ok)
        raise HexqError(f"checksum mismatch in {artifact}: {bad}")


@handle_errors
def export(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder made by hexq pack.", show_default=False)],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Checkpoint folder (compressed-tensors) or .gguf "
                                             "file to write [default: model-ct or model.gguf].")] = None,
    format_: Annotated[str, typer.Option("--format", help="compressed-tensors (vLLM) or gguf (llama.cpp).")
                       ] = "compressed-tensors",
    experts: Annotated[str, typer.Option("--experts", help="Routed experts' scheme per layer. compressed-tensors: "
                                         "auto (4-bit unless a projection would need round-to-nearest, then 8-bit), "
                                         "w4, w8, or vllm (4-bit on the grid vLLM's fused MoE takes). gguf: auto "
                                         "(each layer's type from its allocation), q4, q3_k, q2_k or q8_0.")
                         ] = "auto",
    source: Annotated[Path | None, typer.Option("--source", help="The full-precision checkpoint the artifact was "
                                                "made from, a folder or a hub id (default: the path the artifact "
                                                "records).")] = None,
    windows: Annotated[int, typer.Option("--windows", "-n", help="Held-out windows the check compares logits "
                                         "on.", min=1)] = 8,
    seqlen: SeqlenOpt = 256,
    data: Annotated[str, typer.Option("--data", "-d", help="Held-out text for the check (corpus name or "
                                      "file).")] = "austen",
    shard_size: Annotated[str, typer.Option("--shard-size", help="Largest safetensors shard, e.g. 5GB.")] = "5GB",
    check: Annotated[bool, typer.Option("--check/--no-check", help="Reload the export and compare its logits with "
                                        "the served model (the folder is published only if it passes).")] = True,
    force: ForceOpt = False,
    json_out: JsonOpt = None,
) -> None:
    """Write a compressed-tensors checkpoint (or a GGUF file) one layer at a time, keeping every calibrated code it
    can express, and check it against the model hexq run serves."""
    from hexq.base.io import write_json_atomic
    from hexq.base.units import format_bytes, parse_bytes
    from hexq.export.command import export_artifact
    from hexq.model.folder import resolve_model

    source = None if source is None else resolve_model(source)

    if format_ not in ("compressed-tensors", "gguf"):
        raise HexqError(f"unknown --format {format_!r}; choose compressed-tensors or gguf")
    if format_ == "gguf":
        from hexq_cli.gguf import export_gguf_command

        with progress_bar() as bar:
            export_gguf_command(artifact, out or Path("model.gguf"), experts, windows, seqlen, data, check, force,
                                json_out, staged(bar, f"export {artifact.name} (gguf)"))
        return
    out = out or Path("model-ct")

    with progress_bar() as bar:
        report = staged(bar, f"export {artifact.name}: layers")
        summary = export_artifact(artifact, out, experts, force, source, windows, seqlen, data, check,
                                  parse_bytes(shard_size), report)
    from hexq.export.codec import vllm_support

    table = Table(title=f"{out}: routed experts per layer (dense: {summary.dense.name}, vLLM: "
                        f"{vllm_support(summary.dense, experts=False)})")
    for column in ("layer", "scheme", "exact", "zero", "projected", "table MSE allocated -> written", "vLLM"):
        table.add_column(column, justify="left" if column in ("scheme", "projected", "vLLM") else "right")
    for layer in summary.layers:
        projected = layer.projected
        listing = ", ".join(f"{c.expert}:{c.allocated}->{c.source} {c.bits}" for c in projected) or "-"
        known = [c for c in projected if c.mse_allocated is not None and c.mse_used is not None]
        cost = (f"{sum(c.mse_allocated for c in known):.3g} -> {sum(c.mse_used for c in known):.3g}"
                if known else ("n/a" if projected else "-"))
        table.add_row(str(layer.layer), layer.scheme.name, str(sum(c.source == "exact" for c in layer.choices)),
                      str(sum(c.source == "zero" for c in layer.choices)), listing, cost,
                      vllm_support(layer.scheme, experts=True))
    console.print(table)
    result = summary.check
    if result is not None:
        checks = Table(title=f"check: {result.windows} windows x {result.seqlen} of {data}, "
                             f"{result.tokens_scored:,} tokens scored; limit vs served {result.limit}")
        for column in ("export vs", "rel. L2 of logits", "max |delta logit|", "argmax agreement", "ppl export",
                       "ppl reference", "ppl change"):
            checks.add_column(column, justify="left" if column == "export vs" else "right")
        for c in (result.vs_served, result.vs_full_precision):
            if c is not None:
                checks.add_row(c.reference, f"{c.rel_l2:.3g}", f"{c.max_abs:.3g}", f"{c.argmax_agreement:.2%}",
                               f"{c.ppl_model:.3f}", f"{c.ppl_reference:.3f}", f"{c.ppl_change:+.3%}")
        console.print(checks)
        if result.vs_full_precision is None:
            console.print(f"full precision: not compared ({result.full_precision_note})")
    console.print(f"exported {artifact} to {out}: {format_bytes(summary.files_bytes)} in {summary.seconds:.1f}s"
                  + ("" if result is not None else " (not checked)"))
    if json_out is not None:
        write_json_atomic(json_out, json.loads((out / "hexq_export.json").read_text()))
        console.print(f"wrote {json_out}")


@handle_errors
def report(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder made by hexq pack.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for index.html and its PNG plots.")] = Path(
        "report"),
    results: Annotated[Path | None, typer.Option("--results", help="Folder of benchmark result JSONs "
                                                 "(pack_quality.json, calibrate.json; default: the checkout's "
                                                 "benchmarks/results).")] = None,
    placement_json: Annotated[Path | None, typer.Option("--placement-json", help="Held-out hit rates written by "
                                                        "benchmarks/placement.py (default: placement.json in the "
                                                        "results folder).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a report hexq wrote earlier in the output "
                                        "folder.")] = False,
) -> None:
    """An HTML page of plots: expert hotness, loss tables, bit allocation, hit rates, perplexity vs bits."""
    from hexq.report.page import write_report

    with err_console.status(f"report {artifact.name}"):
        index = write_report(artifact, out, results, placement_json, force)
    console.print(str(index), highlight=False, soft_wrap=True)  # the bare path, unwrapped, for scripts
