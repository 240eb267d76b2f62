"""What a report shows, as numbers: the page model, the benchmark result files it reads, hit rates and frontier
points."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.algos.placement import SCHEMES, hit_rates, place

# The benchmarks write here (their ROOT / "benchmarks" / "results"); found from the package so that the default
# does not depend on the working directory. A missing folder only turns plots into notes.
DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PRODUCERS = {"placement.json": "python benchmarks/placement.py",
             "pack_quality.json": "python benchmarks/pack_quality.py",
             "calibrate.json": "python benchmarks/calibrate_table.py"}
FRACTIONS = (0.25, 0.5)  # K as a share of a layer's experts, as in benchmarks/placement.py


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
