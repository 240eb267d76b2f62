"""The report's PNG plots: fixed sizes and dpi, matplotlib's default style, no stamps, so the same inputs give the same
bytes."""

from __future__ import annotations

import io
import math

import matplotlib
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator, PercentFormatter

from hexq.algos.placement import SCHEMES
from hexq.report.numbers import FRACTIONS, FrontierPoint, HitRow, fraction_k

SCHEME_COLORS = {"1": "tab:blue", "2": "tab:orange", "3": "tab:green"}
# Schemes often pick the same experts; drawing them from thick to thin keeps coinciding lines visible.
SCHEME_WIDTHS = {"1": (4.0, 9), "2": (2.5, 6.5), "3": (1.2, 4)}  # (line width, marker size)
DPI = 100
ANNOTATE_CELLS = 128  # write numbers into heatmap cells only while they stay legible


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
