"""`hexq export --format gguf`: the command's output (the work is hexq.export.gguf.command)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()


def export_gguf_command(artifact: Path, out: Path, experts: str, windows: int, seqlen: int, data: str, check: bool,
                        force: bool, json_out: Path | None, progress) -> None:
    from hexq.base.io import write_json_atomic
    from hexq.base.units import format_bytes
    from hexq.export.gguf.command import export_gguf, gguf_report

    summary = export_gguf(artifact, out, experts, force, windows, seqlen, data, check, progress)
    table = Table(title=f"{out}: routed experts per layer ({summary.plan.family.arch})")
    for column in ("layer", "type", "experts by source", "projected (expert: allocated -> source bits)"):
        table.add_column(column, justify="right" if column == "layer" else "left")
    for layer in summary.plan.layers:
        sources = {}
        for e in layer.experts:
            sources[e.source] = sources.get(e.source, 0) + 1
        listing = ", ".join(f"{e.expert}:{e.allocated}->{e.source} {e.bits}" for e in layer.projected[:8])
        more = f" (+{len(layer.projected) - 8})" if len(layer.projected) > 8 else ""
        table.add_row(str(layer.layer), layer.kind.name, ", ".join(f"{k} {v}" for k, v in sorted(sources.items())),
                      (listing + more) or "-")
    console.print(table)
    for layer in summary.plan.layers:
        if layer.instead_of:
            console.print(f"layer {layer.layer}: {layer.kind.name} instead of {layer.instead_of}", markup=False)
    if summary.plan.inexact:
        console.print(f"re-rounded to Q8_0 (no GGUF type holds their asymmetric codes): "
                      f"{len(summary.plan.inexact)} tensor(s), e.g. {summary.plan.inexact[0]}")
    result = summary.check
    if result is not None and result.llama is not None:
        c = result.llama
        console.print(f"check ({result.note}): logits rel. L2 {c.rel_l2:.3g}, max |delta| {c.max_abs:.3g}, argmax "
                      f"agreement {c.argmax_agreement:.2%}, perplexity llama.cpp {c.ppl_model:.3f} vs hexq "
                      f"{c.ppl_reference:.3f} ({c.ppl_change:+.3%}); limit {result.limit}")
    if result is not None:
        if result.llama is None:
            console.print(result.note, markup=False)
        console.print(f"check (gguf-py): {result.blocks.tensors} tensors decode to the weights hexq serves "
                      f"(worst error {result.blocks.worst:.3g} of its bound)")
    console.print(f"exported {artifact} to {out}: {format_bytes(summary.file_bytes)} in {summary.seconds:.1f}s"
                  + ("" if result is not None else " (not checked)"))
    if json_out is not None:
        write_json_atomic(json_out, json.loads(json.dumps(gguf_report(artifact, summary), default=str)))
        console.print(f"wrote {json_out}")
