"""`hexq report`: one artifact, and the benchmark results of its model family, as an HTML page of PNG plots.

    DIR/index.html        header (model, size, bits, budget, checksums), one section per plot, tables of numbers
    DIR/hotness.png       routed-token share per layer x expert, fast-tier experts marked
    DIR/loss_tables.png   MSE vs bits of every expert, one panel per layer
    DIR/allocation.png    the artifact's width per layer x expert
    DIR/hit_rates.png     fast-tier hit rate per layer of placement schemes 1/2/3 at K = 25% and 50% of the experts
    DIR/frontier.png      perplexity vs bits: hexq mixed / uniform / importance-blind, hexq GPTQ, llmcompressor

Plots 1-4 come from the artifact alone (stats.safetensors and the manifest). Plot 4 adds held-out hit rates and
plot 5 is drawn from the JSON files the benchmarks write; a missing or non-matching file turns into a note on the
page naming the file and the command that writes it, never an error.

The same inputs give the same bytes: fixed figure sizes and dpi, matplotlib's default style whatever the user's
matplotlibrc says, no software or date stamps in the PNGs, nothing time-dependent in the HTML. The folder is
written through hexq.outputs: into a hidden sibling renamed to DIR once every file is there, so DIR never holds half a
report; an existing DIR is replaced only with force and only when it is a report hexq wrote, and DIR may not be, hold
or lie inside the artifact or the result files being read.
"""

from __future__ import annotations

import html
import io
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import torch
from matplotlib import style
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator, PercentFormatter

from hexq.algos.placement import SCHEMES, hit_rates, place
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.inspect import summarize
from hexq.artifact.reader import Artifact
from hexq.io import write_bytes_atomic
from hexq.outputs import output_folder
from hexq.units import format_bytes

logger = logging.getLogger(__name__)

# The benchmarks write here (their ROOT / "benchmarks" / "results"); found from the package so that the default
# does not depend on the working directory. A missing folder only turns plots into notes.
DEFAULT_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
PRODUCERS = {"placement.json": "python benchmarks/placement.py",
             "pack_quality.json": "python benchmarks/pack_quality.py",
             "calibrate.json": "python benchmarks/calibrate_table.py"}
FRACTIONS = (0.25, 0.5)  # K as a share of a layer's experts, as in benchmarks/placement.py
SCHEME_COLORS = {"1": "tab:blue", "2": "tab:orange", "3": "tab:green"}
# Schemes often pick the same experts; drawing them from thick to thin keeps coinciding lines visible.
SCHEME_WIDTHS = {"1": (4.0, 9), "2": (2.5, 6.5), "3": (1.2, 4)}  # (line width, marker size)
DPI = 100
ANNOTATE_CELLS = 128  # write numbers into heatmap cells only while they stay legible


# ------------------------------------------------------------------------------------------ page model


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Section:
    """One plot on the page: the PNG (None when its inputs are missing), what to look for, notes, numbers."""

    title: str
    image: str | None
    alt: str
    caption: str
    notes: tuple[str, ...] = ()
    table: Table | None = None


@dataclass(frozen=True)
class HitRow:
    """Per-layer hit rates of one placement scheme at one K on one router trace."""

    scheme: str
    K: int
    fraction: float
    trace: str  # "calibration" (the artifact's own trace) or "held-out" (placement.json)
    per_layer: tuple[float, ...]


@dataclass(frozen=True)
class FrontierPoint:
    """One quantized model of a benchmark: average expert bits and perplexity per text, with its run's fp."""

    series: str
    label: str
    bits: float
    source: str
    perplexity: dict[str, float]
    fp: dict[str, float]


# ------------------------------------------------------------------------------------------ result files


def benchmark_name(model_type: str) -> str:
    """The benchmarks name the reference models by model_type without underscores (qwen3_moe -> qwen3moe)."""
    return model_type.replace("_", "")


def missing_note(path: Path) -> str:
    command = PRODUCERS.get(path.name)
    made_by = f"; `{command}` writes it" if command else ""
    if not path.parent.is_dir():  # e.g. an installed hexq: benchmarks/results exists only in a source checkout
        made_by += f" (the folder {path.parent} does not exist: give hexq report --results a folder of result files)"
    return f"{path} not found{made_by}."


def read_results(path: Path) -> tuple[dict | None, str | None]:
    """(content, None) or (None, a note for the page): result files may be absent or still being written."""
    if not path.is_file():
        return None, missing_note(path)
    try:
        return json.loads(path.read_text()), None
    except (OSError, json.JSONDecodeError) as err:
        return None, f"{path} is unreadable ({err}); rerun `{PRODUCERS.get(path.name, 'its benchmark')}`."


# ------------------------------------------------------------------------------------------ numbers


def routed_share(counts: torch.Tensor) -> torch.Tensor:
    """[L, E] share of each layer's routed (token, slot) pairs that went to each expert (rows sum to 1)."""
    counts = counts.double()
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1)


def fraction_k(fraction: float, num_experts: int) -> int:
    return max(1, round(fraction * num_experts))


def calibration_hit_rates(topk: torch.Tensor, counts: torch.Tensor) -> list[HitRow]:
    """Schemes 1/2/3 built from the artifact's calibration trace and scored on that same trace."""
    topk, num_experts = topk.long(), counts.shape[1]
    rows = []
    for fraction in FRACTIONS:
        K = fraction_k(fraction, num_experts)
        masks = {scheme: place(scheme, topk, counts, K) for scheme in SCHEMES}
        for scheme, mask in masks.items():
            rows.append(HitRow(scheme, K, fraction, "calibration", tuple(hit_rates(mask, topk).tolist())))
    return rows


def heldout_hit_rates(results: dict, name: str, num_layers: int, num_experts: int,
                      source: Path) -> tuple[list[HitRow], str | None]:
    """Held-out rows of benchmarks/placement.py for this model, if it measured a model of this artifact's shape."""
    info = results.get("models", {}).get(name)
    if info is None:
        return [], f"{source} has no rows for {name}."
    if (info.get("layers"), info.get("experts")) != (num_layers, num_experts):
        return [], (f"{source} measured the reference {name} ({info.get('layers')} layers x {info.get('experts')} "
                    f"experts), not a model of this artifact's shape ({num_layers} x {num_experts}); held-out hit "
                    f"rates are not shown.")
    rows = [HitRow(row["scheme"], row["K"], row["fraction"], "held-out", tuple(row["per_layer"]))
            for row in results.get("rows", [])
            if row.get("model") == name and row.get("trace") == "heldout" and row.get("scheme") in SCHEMES
            and row.get("fraction") in FRACTIONS]
    return rows, None if rows else f"{source} has no held-out rows for {name}."


def perplexities(row: dict) -> dict[str, float]:
    """The {text: perplexity} entries of a result row (other keys are labels, seeds or timings)."""
    skip = {"model", "setting", "method", "calib_seconds", "seeds"}
    return {key: float(value) for key, value in row.items() if key not in skip and isinstance(value, int | float)}


def pack_quality_points(results: dict, name: str, source: Path) -> tuple[list[FrontierPoint], str | None]:
    """Rows of benchmarks/pack_quality.py: uniform-b, mixed-x and blind-x (the mixed histogram, shuffled)."""
    model = results.get("models", {}).get(name)
    if model is None:
        return [], f"{source} has no rows for {name}."
    rows = model.get("rows", {})
    if "fp" not in rows:
        return [], f"{source} has no full-precision row for {name}."
    fp = perplexities(rows["fp"])
    allocations = model.get("allocation", {})
    series = {"uniform": "hexq uniform", "mixed": "hexq mixed", "blind": "importance-blind"}
    points = []
    for label, row in rows.items():
        kind, _, width = label.partition("-")
        if kind not in series:
            continue
        bits = float(width)
        allocation = allocations.get(width)
        if kind != "uniform" and allocation:  # the average the allocation reached, not only the one asked for
            bits = sum(map(sum, allocation)) / sum(map(len, allocation))
        points.append(FrontierPoint(series[kind], label, bits, source.name, perplexities(row), fp))
    return points, None if points else f"{source} has no quantized rows for {name}."


WEIGHT_ONLY = re.compile(r"^w(\d+)a16$")  # w4a16-g32 is a group-size variant of w4a16, not another width


def calibrate_points(results: dict, name: str, source: Path) -> tuple[list[FrontierPoint], str | None]:
    """Weight-only rows of benchmarks/calibrate_table.py: hexq GPTQ and llmcompressor's GPTQModifier."""
    rows = [row for row in results.get("rows", []) if row.get("model") == name]
    fp_rows = [row for row in rows if row.get("setting") == "fp"]
    if not fp_rows:
        return [], f"{source} has no rows for {name}."
    fp = perplexities(fp_rows[0])
    points = []
    for row in rows:
        match = WEIGHT_ONLY.match(str(row.get("setting")))
        method = str(row.get("method"))
        if match is None or not (method == "hexq gptq" or method.startswith("llmcompressor")):
            continue
        series = "hexq gptq, all linears" if method == "hexq gptq" else "llmcompressor gptq, all linears"
        points.append(FrontierPoint(series, f"{row['setting']} {method}", float(match.group(1)), source.name,
                                    perplexities(row), fp))
    return points, None if points else f"{source} has no weight-only rows for {name}."


# ------------------------------------------------------------------------------------------ plots


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG; without the Software stamp the bytes depend only on what was drawn."""
    buffer = io.BytesIO()
    FigureCanvasAgg(fig)  # Agg whatever backend the process selected: the pixels must not depend on it
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


def integer_ticks(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def layer_ticks(ax, layer_ids: list[int]) -> None:
    """Label the MoE rows of a heatmap with their model layer indices (dense layers take no row)."""
    ax.set_yticks(range(len(layer_ids)), [str(i) for i in layer_ids])


def plot_hotness(share: torch.Tensor, placed: torch.Tensor, scheme: str, layer_ids: list[int]) -> bytes:
    L, E = share.shape
    fig = Figure(figsize=(10, 1.6 + min(0.45 * L, 8)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(share.numpy(), aspect="auto", cmap="magma", interpolation="nearest", vmin=0)
    fig.colorbar(image, ax=ax, label="routed-token share", format=PercentFormatter(1.0, 0))
    box = 2 if L * E <= 4 * ANNOTATE_CELLS else 0.8  # thick boxes would hide the colours of a large grid
    for layer, expert in torch.nonzero(placed).tolist():
        ax.add_patch(Rectangle((expert - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=box))
    if L * E <= ANNOTATE_CELLS:
        for layer in range(L):
            for expert in range(E):
                value = float(share[layer, expert])
                # dark text on the bright end of the colour map, light text on the dark end
                color = "black" if value > 0.6 * float(share.max()) else "white"
                ax.text(expert, layer, f"{value:.0%}", ha="center", va="center", fontsize=8, color=color)
    integer_ticks(ax)
    layer_ticks(ax, layer_ids)
    ax.set(xlabel="expert", ylabel="layer", title=f"routed-token share per expert (uniform routing = {1 / E:.1%})")
    fig.legend(handles=[Patch(fill=False, edgecolor="cyan", linewidth=box, label=f"fast tier ({scheme} placement)")],
               loc="outside lower right", fontsize=8)
    return png_bytes(fig)


def grid(count: int, max_cols: int) -> tuple[int, int]:
    cols = min(max_cols, count)
    return math.ceil(count / cols), cols


def plot_loss_tables(table: torch.Tensor, skip: torch.Tensor, replica_bits: list[int], allocation: list[list[int]],
                     share: torch.Tensor, with_skip: bool, layer_ids: list[int]) -> bytes:
    """One panel per layer: MSE vs width of every expert, coloured by routed share, allocated width dotted."""
    L, E, _ = table.shape
    bits = ([0] if with_skip else []) + list(replica_bits)
    losses = torch.cat([skip[:, :, None], table], dim=2) if with_skip else table
    rows, cols = grid(L, 4)
    fig = Figure(figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).flatten()
    norm = Normalize(0, float(share.max()))
    cmap = matplotlib.colormaps["viridis"]
    for layer in range(L):
        ax = axes[layer]
        for expert in range(E):
            color = cmap(norm(float(share[layer, expert])))
            ax.plot(bits, losses[layer, expert].tolist(), color=color, linewidth=1, alpha=0.8)
            width = allocation[layer][expert]
            if width in bits:
                ax.plot(width, float(losses[layer, expert, bits.index(width)]), "o", color=color,
                        markeredgecolor="black", markersize=4)
        ax.set_yscale("log")
        ax.set_title(f"layer {layer_ids[layer]}", fontsize=9)
        ax.set_xticks(bits)
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[L:]:
        ax.set_visible(False)
    for ax in axes[(rows - 1) * cols:]:
        ax.set_xlabel("bits (0 = skipped)" if with_skip else "bits")
    for ax in axes[::cols]:
        ax.set_ylabel("output MSE")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes[:L]),
                 label="routed-token share", format=PercentFormatter(1.0, 0))
    fig.suptitle("loss table: expert output error vs width (dot = allocated width)", fontsize=10)
    return png_bytes(fig)


def width_color(bits: int):
    """The same width always gets the same colour, so allocation maps of different artifacts compare."""
    return (0.85, 0.85, 0.85, 1.0) if bits == 0 else matplotlib.colormaps["plasma"](min(bits, 8) / 8 * 0.85)


def plot_allocation(allocation: list[list[int]], layer_ids: list[int]) -> bytes:
    grid_bits = torch.tensor(allocation)
    L, E = grid_bits.shape
    widths = sorted(set(grid_bits.flatten().tolist()))
    cmap = ListedColormap([width_color(b) for b in widths])
    index = torch.tensor([[widths.index(b) for b in row] for row in allocation])
    fig = Figure(figsize=(10, 1.2 + min(0.45 * L, 8)), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(index.numpy(), aspect="auto", cmap=cmap, norm=BoundaryNorm(range(len(widths) + 1), len(widths)),
              interpolation="nearest")
    if L * E <= ANNOTATE_CELLS:
        for layer in range(L):
            for expert in range(E):
                ax.text(expert, layer, str(allocation[layer][expert]), ha="center", va="center", fontsize=8)
    counts = {b: int((grid_bits == b).sum()) for b in widths}
    ax.legend(handles=[Patch(color=width_color(b), label=f"{b} bits ({counts[b]} experts)") for b in widths],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="width")
    integer_ticks(ax)
    layer_ticks(ax, layer_ids)
    ax.set(xlabel="expert", ylabel="layer",
           title=f"bit allocation ({float(grid_bits.double().mean()):.3f} bits on average)")
    return png_bytes(fig)


def plot_hit_rates(rows: list[HitRow], layer_ids: list[int], num_experts: int) -> bytes:
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, len(FRACTIONS), sharey=True, squeeze=False)[0]
    layers = list(layer_ids)
    for ax, fraction in zip(axes, FRACTIONS, strict=True):
        K = fraction_k(fraction, num_experts)
        for row in rows:
            if row.fraction != fraction:
                continue
            heldout = row.trace == "held-out"
            width, size = SCHEME_WIDTHS[row.scheme]
            ax.plot(layers, row.per_layer, linestyle="--" if heldout else "-", marker="s" if heldout else "o",
                    color=SCHEME_COLORS[row.scheme], linewidth=width, markersize=size, alpha=0.9)
        ax.axhline(K / num_experts, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"K = {K} of {num_experts} experts ({fraction:.0%})", xlabel="layer", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, 0))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("hit rate (routed pairs served by the fast tier)")
    handles = [Line2D([], [], color=SCHEME_COLORS[s], linewidth=SCHEME_WIDTHS[s][0], label=f"scheme {s}: {name}")
               for s, name in SCHEMES.items()]
    handles += [Line2D([], [], color="black", marker="o", label="calibration trace (artifact)"),
                Line2D([], [], color="black", marker="s", linestyle="--", label="held-out trace (benchmark)"),
                Line2D([], [], color="grey", linestyle=":", label="K/E: placement by chance")]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    return png_bytes(fig)


FRONTIER_STYLE = {"hexq mixed": ("tab:red", "o", "-"), "hexq uniform": ("tab:blue", "s", "-"),
                  "importance-blind": ("tab:grey", "D", ":"), "hexq gptq, all linears": ("tab:purple", "^", "--"),
                  "llmcompressor gptq, all linears": ("tab:green", "v", "--")}


def frontier_texts(points: list[FrontierPoint]) -> list[str]:
    texts: list[str] = []
    for point in points:
        texts += [text for text in point.perplexity if has_text(point, text) and text not in texts]
    return texts


def has_text(point: FrontierPoint, text: str) -> bool:
    return text in point.perplexity and text in point.fp


def relative_change(point: FrontierPoint, text: str) -> float:
    return point.perplexity[text] / point.fp[text] - 1


def plot_frontier(points: list[FrontierPoint], name: str) -> bytes:
    """Perplexity change against the full-precision model of the same benchmark run, one panel per text."""
    texts = frontier_texts(points)
    rows, cols = grid(len(texts), 2)
    fig = Figure(figsize=(5.5 * cols + 2.6, 3.6 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, text in zip(axes, texts, strict=False):
        for series, (color, marker, linestyle) in FRONTIER_STYLE.items():
            mine = sorted((p for p in points if p.series == series and has_text(p, text)), key=lambda p: p.bits)
            if mine:
                ax.plot([p.bits for p in mine], [relative_change(p, text) for p in mine], color=color, marker=marker,
                        linestyle=linestyle)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(title=text, xlabel="average bits per expert weight")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
        ax.grid(True, alpha=0.3)
    for ax in axes[len(texts):]:
        ax.set_visible(False)
    for ax in axes[::cols]:
        ax.set_ylabel("perplexity vs full precision")
    present = [s for s in FRONTIER_STYLE if any(p.series == s for p in points)]
    fig.legend(handles=[Line2D([], [], color=FRONTIER_STYLE[s][0], marker=FRONTIER_STYLE[s][1],
                               linestyle=FRONTIER_STYLE[s][2], label=s) for s in present],
               loc="outside right center", fontsize=8)
    fig.suptitle(f"{name}: quality vs bits (lower is better; 0% = the full-precision model)", fontsize=10)
    return png_bytes(fig)


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


def header_items(info: dict, manifest: dict) -> list[tuple[str, str]]:
    model = info["model"]
    bad = [name for name, ok in info["files"].items() if not ok]
    checks = (f"all {len(info['files'])} files match the manifest's SHA-256" if not bad
              else f"MISMATCH in {', '.join(bad)}")
    provenance = manifest["provenance"]
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
    manifest = artifact.manifest
    stats = artifact.shard_tensors(STATS_SHARD)
    layer_ids, E = artifact.moe_layers, artifact.num_experts  # one row per MoE layer, labelled by its model index
    name = benchmark_name(manifest["model"]["model_type"])
    share = routed_share(stats["router.counts"])
    scheme = manifest["placement"]["scheme"]
    with_skip = 0 in manifest.get("recipe", {}).get("pack", {}).get("bits", [])

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
    page = render_page(f"hexq report: {artifact_path.name}", header_items(info, manifest), sections)
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
