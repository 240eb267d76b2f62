"""The report page: its sections, the HTML and writing the folder (hexq.base.outputs rules)."""

from __future__ import annotations

import html
import logging
from pathlib import Path

import torch
from matplotlib import style

from hexq.algos.placement import SCHEMES
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.inspect import summarize
from hexq.artifact.reader import Artifact
from hexq.base.io import write_bytes_atomic
from hexq.base.outputs import output_folder
from hexq.base.units import format_bytes
from hexq.report.numbers import (
    DEFAULT_RESULTS,
    FrontierPoint,
    HitRow,
    Section,
    Table,
    benchmark_name,
    calibrate_points,
    calibration_hit_rates,
    heldout_hit_rates,
    pack_quality_points,
    read_results,
    routed_share,
)
from hexq.report.plots import (
    frontier_texts,
    has_text,
    plot_allocation,
    plot_frontier,
    plot_hit_rates,
    plot_hotness,
    plot_loss_tables,
    relative_change,
)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ sections


def percent(value: float) -> str:
    return f"{value:.1%}"


def hit_rate_table(rows: list[HitRow], layer_ids: list[int]) -> Table:
    per_layer = len(layer_ids) <= 12  # beyond that the plot carries the per-layer story
    header = ("K", "scheme", "trace", *([f"layer {i}" for i in layer_ids] if per_layer else []),
              "mean", "min", "max")
    body = []
    for row in sorted(rows, key=lambda r: (r.fraction, r.scheme, r.trace)):
        values = list(row.per_layer)
        body.append((f"{row.K} ({row.fraction:.0%})", f"{row.scheme} {SCHEMES[row.scheme]}", row.trace,
                     *(map(percent, values) if per_layer else ()), percent(sum(values) / len(values)),
                     percent(min(values)), percent(max(values))))
    return Table(header, tuple(body))


def frontier_table(points: list[FrontierPoint]) -> Table:
    texts = frontier_texts(points)
    body = []
    sources = sorted({p.source for p in points})
    for source in sources:
        fp = next(p.fp for p in points if p.source == source)
        body.append(("full precision", "-", source, *(f"{fp[t]:.3f}" if t in fp else "-" for t in texts)))
        for point in sorted((p for p in points if p.source == source), key=lambda p: (p.series, p.bits)):
            cells = [f"{point.perplexity[t]:.3f} ({relative_change(point, t):+.1%})" if has_text(point, t)
                     else "-" for t in texts]
            body.append((f"{point.series}: {point.label}", f"{point.bits:.3f}", source, *cells))
    return Table(("model", "avg bits", "file", *texts), tuple(body))


def hit_rate_section(stats: dict[str, torch.Tensor], placement_json: Path, name: str, layer_ids: list[int],
                     num_experts: int) -> tuple[Section, bytes]:
    rows = calibration_hit_rates(stats["router.topk"], stats["router.counts"])
    notes: list[str] = []
    results, note = read_results(placement_json)
    if results is not None:
        heldout, note = heldout_hit_rates(results, name, len(layer_ids), num_experts, placement_json)
        rows += heldout
    if note:
        notes.append(note)
    tokens = stats["router.topk"].shape[1]
    caption = (f"Solid: schemes built from and scored on the artifact's calibration trace ({tokens} tokens), where "
               f"scheme 2 is best per layer by construction. Dashed: benchmarks/placement.py's placements scored on "
               f"held-out text, shown when its model has this artifact's shape. Look for lines well above the dotted "
               f"K/E line and for layers where every scheme drops (routing there is spread out).")
    section = Section("Fast-tier hit rate per layer", "hit_rates.png",
                      "hit rate per layer for placement schemes 1, 2 and 3 at K = 25% and 50% of the experts",
                      caption, tuple(notes), hit_rate_table(rows, layer_ids))
    return section, plot_hit_rates(rows, layer_ids, num_experts)


def frontier_section(results_dir: Path, name: str) -> tuple[Section, bytes | None]:
    points: list[FrontierPoint] = []
    notes: list[str] = []
    for file, reader in (("pack_quality.json", pack_quality_points), ("calibrate.json", calibrate_points)):
        path = results_dir / file
        results, note = read_results(path)
        if results is not None:
            found, note = reader(results, name, path)
            points += found
        if note:
            notes.append(note)
    title, alt = "Perplexity vs average bits", f"perplexity change vs average bits for {name}"
    if not points:
        return Section(title, None, alt, "No benchmark results for this model family yet.", tuple(notes)), None
    caption = (f"Benchmark runs on the reference {name} model, each point relative to the full-precision model of "
               f"its own run. Look for hexq mixed below hexq uniform and importance-blind at equal bits. "
               f"pack_quality.json quantizes the experts (attention W8A8); calibrate.json quantizes every linear at "
               f"the width with 16-bit activations and other evaluation windows, so compare its two methods with "
               f"each other.")
    return Section(title, "frontier.png", alt, caption, tuple(notes), frontier_table(points)), plot_frontier(points,
                                                                                                           name)


# ------------------------------------------------------------------------------------------ page


CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
img{max-width:100%;height:auto;border:1px solid #eee}.caption{color:#444}.note{color:#a33}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:right}td:first-child,th:first-child{text-align:left}dl{display:grid;grid-template-columns:max-content auto;
gap:2px 1em}dt{font-weight:600}dd{margin:0;font-family:monospace}.bad{color:#b00;font-weight:700}"""


def render_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_section(section: Section) -> str:
    parts = [f"<section><h2>{html.escape(section.title)}</h2>"]
    if section.image:
        parts.append(f'<img src="{html.escape(section.image)}" alt="{html.escape(section.alt)}">')
    parts.append(f'<p class="caption">{html.escape(section.caption)}</p>')
    parts += [f'<p class="note">{html.escape(note)}</p>' for note in section.notes]
    if section.table:
        parts.append(render_table(section.table))
    return "\n".join(parts) + "</section>"


def header_items(info: dict, artifact: Artifact) -> list[tuple[str, str]]:
    model = info["model"]
    bad = [name for name, ok in info["files"].items() if not ok]
    checks = (f"all {len(info['files'])} files match the manifest's SHA-256" if not bad
              else f"MISMATCH in {', '.join(bad)}")
    provenance = artifact.provenance
    data = provenance.get("calibration_data", {})
    return [
        ("model", f"{model['model_type']}: {model['num_layers']} layers x {model['num_experts']} experts, "
                  f"top-{model.get('top_k', '?')}"),
        ("artifact size", f"{format_bytes(info['accounting']['files'])} (experts stored "
                          f"{format_bytes(info['accounting']['stored_experts'])} = "
                          f"{info['accounting']['experts_vs_bf16']:.1%} of their bf16 size; at the allocation "
                          f"{format_bytes(info['allocation']['bytes'])})"),
        ("average bits", f"{info['allocation']['average_bits']:.3f} (widths {info['allocation']['bits_set']})"),
        ("budget", info["allocation"]["budget"]),
        ("placement", f"{info['placement']['scheme']}, {info['placement']['hot_per_layer']} hot experts per layer"),
        ("calibration", f"{data.get('source', '?')}, {data.get('num_samples', '?')} windows of "
                        f"{data.get('seqlen', '?')} tokens, seed {data.get('seed', '?')}"),
        ("checksums", checks),
        ("model sha256", provenance["model_sha256"]),
        ("data sha256", provenance["data_sha256"]),
        ("format", f"hexq artifact v{info['format_version']}, hexq {info['hexq_version']}"),
    ]


def render_page(title: str, items: list[tuple[str, str]], sections: list[Section]) -> str:
    rows = "".join(f"<dt>{html.escape(k)}</dt><dd{' class=bad' if v.startswith('MISMATCH') else ''}>"
                   f"{html.escape(v)}</dd>" for k, v in items)
    body = "\n".join(render_section(s) for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n<h1>{html.escape(title)}</h1><dl>{rows}</dl>\n{body}\n"
            f"</body></html>\n")


def report_files(artifact_path: Path, results_dir: Path, placement_json: Path) -> dict[str, bytes]:
    """{file name: bytes} of the report: the PNG plots and index.html (see module docstring)."""
    info = summarize(artifact_path)
    artifact = Artifact(artifact_path)
    stats = artifact.shard_tensors(STATS_SHARD)
    layer_ids, E = artifact.moe_layers, artifact.num_experts  # one row per MoE layer, labelled by its model index
    name = benchmark_name(artifact.model_type)
    share = routed_share(stats["router.counts"])
    scheme = artifact.placement["scheme"]
    with_skip = 0 in artifact.recipe.pack.widths

    images: dict[str, bytes] = {}
    # Matplotlib's defaults, not the user's matplotlibrc: the same artifact must give the same PNG bytes anywhere.
    with style.context("default"):
        images["hotness.png"] = plot_hotness(share, stats["placement"].bool(), scheme, layer_ids)
        images["loss_tables.png"] = plot_loss_tables(stats["loss_table"], stats["loss_table.skip"],
                                                     artifact.replica_bits, artifact.allocation, share, with_skip,
                                                     layer_ids)
        images["allocation.png"] = plot_allocation(artifact.allocation, layer_ids)
        hits, images["hit_rates.png"] = hit_rate_section(stats, placement_json, name, layer_ids, E)
        frontier, frontier_png = frontier_section(results_dir, name)
        if frontier_png is not None:
            images["frontier.png"] = frontier_png
    sections = [
        Section("Expert hotness", "hotness.png", "heatmap of routed-token share per layer and expert",
                "Share of each layer's routed tokens per expert on the calibration text; cyan boxes mark the experts "
                "the artifact places in the fast tier. Look for a few bright cells per row (a cache pays off) and "
                "dark columns (experts the calibration text hardly used, whose loss tables rest on few tokens)."),
        Section("Loss tables", "loss_tables.png", "expert output MSE against bits, one panel per layer",
                "Output MSE of every expert's replica at each width (log scale), coloured by routed share; the dot "
                "is the width the artifact chose. Look for hot (yellow) experts kept at wider widths and for "
                "curves that flatten, where more bits buy little."),
        Section("Bit allocation", "allocation.png", "heatmap of the allocated bits per layer and expert",
                f"The width each expert is stored at under the budget ({info['allocation']['budget']}). Look for the "
                f"wide experts matching the bright cells of the hotness map."),
        hits,
        frontier,
    ]
    page = render_page(f"hexq report: {artifact_path.name}", header_items(info, artifact), sections)
    return {**images, "index.html": page.encode()}


def write_report(artifact_path: str | Path, out_dir: str | Path, results_dir: str | Path | None = None,
                 placement_json: str | Path | None = None, force: bool = False) -> Path:
    """Write DIR/index.html and its PNG plots for the artifact (see module docstring); returns index.html's path.

    results_dir: where pack_quality.json and calibrate.json are looked for (default: the checkout's
    benchmarks/results); placement_json: held-out placement results (default: results_dir/placement.json);
    force: replace a report hexq wrote earlier in out_dir. Every checksum of the artifact is verified; a mismatch
    is shown in the header, not raised."""
    artifact_path, out_dir = Path(artifact_path), Path(out_dir)
    results_dir = DEFAULT_RESULTS if results_dir is None else Path(results_dir)
    placement_json = results_dir / "placement.json" if placement_json is None else Path(placement_json)
    # The destination is checked (and locked) before the plots are drawn, so a refused folder costs nothing.
    with output_folder(out_dir, kind="report", force=force,
                       inputs=[artifact_path, results_dir, placement_json]) as tmp:
        files = report_files(artifact_path, results_dir, placement_json)
        for file, data in files.items():
            write_bytes_atomic(tmp / file, data)
    index = out_dir / "index.html"
    logger.info("wrote %s with %d plots", index, len(files) - 1)
    return index
