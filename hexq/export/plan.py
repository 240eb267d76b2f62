"""Which compressed-tensors scheme each part of an artifact is written in, and where every routed expert's codes
come from (exact, zero, an export or bank replica, round-to-nearest): decided before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.export.codec import (
    ActSpec,
    CtScheme,
)
from hexq.packed.grids import scheme_fits

EXPERT_MODES = ("auto", "w4", "w8", "vllm")


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class ExpertChoice:
    """How one routed expert is written: `source` exact | replica | export-replica | rtn, at `bits`."""

    expert: int
    allocated: int
    source: str
    bits: int
    mse_allocated: float | None = None  # loss-table MSE of the allocated replica
    mse_used: float | None = None  # loss-table MSE of the replica written (None: not in the table)


@dataclass(frozen=True)
class LayerExport:
    layer: int
    scheme: CtScheme
    choices: tuple[ExpertChoice, ...]

    @property
    def projected(self) -> list[ExpertChoice]:
        return [c for c in self.choices if c.source != "exact"]


def activation_spec(setting, what: str) -> ActSpec | None:
    if setting.bits is None:
        return None
    if not setting.dynamic:
        raise HexqError(f"the artifact's {what} use static activation ranges, which hexq does not export; "
                        "calibrate with dynamic activations (activations.dynamic: true)")
    return ActSpec(setting.bits, setting.symmetric)


def dense_scheme(artifact: Artifact) -> CtScheme:
    recipe = artifact.recipe
    w = recipe.weights
    bits = 2 if (w.symmetric and w.bits == 1) else w.bits  # 1-bit symmetric is written as +-1 codes
    return CtScheme(bits, w.group_size, w.symmetric, activation_spec(recipe.activations, "attention inputs"))


def plan_layer(artifact: Artifact, row: int, target: int, table: torch.Tensor | None, acts: ActSpec | None,
               grid: tuple[int | None, bool] | None = None) -> LayerExport:
    """Every expert's source in a T-bit layer on `grid` (group size, symmetric; default the artifact's own expert
    grid): exact when the allocated code fits, else a GPTQ replica in the layer's scheme (the artifact's export
    replica, or the widest stored replica that fits), else RTN."""
    own = (artifact.group_size, artifact.symmetric)
    grid = own if grid is None else grid
    scheme = CtScheme(target, grid[0], grid[1], acts)
    layer = artifact.moe_layers[row]
    extra = artifact.export_section
    same_grid = (extra.get("bits"), extra.get("group_size"), extra.get("symmetric")) == (target, *grid)
    extra_here = set(extra.get("replicas", {}).get(str(layer), [])) if same_grid else set()
    columns = {b: i for i, b in enumerate(artifact.replica_bits)}
    # the stored widths whose zero points are floats have no exact form on the own grid
    float_zero_bits = artifact.recipe.expert_weights.float_zero_bits if grid == own else ()

    def mse(e: int, bits: int) -> float | None:
        if table is None or bits not in columns:
            return None
        return float(table[e, columns[bits]])

    choices = []
    for e, b in enumerate(artifact.allocation[row]):
        fitting = [w for w in artifact.stored_bits(row, e)
                   if w != b and scheme_fits(w, grid[1], target, float_zero_bits)]
        if grid == own and scheme_fits(b, grid[1], target, float_zero_bits):
            choices.append(ExpertChoice(e, b, "exact", b, mse(e, b), mse(e, b)))
        elif e in extra_here:  # the loss table measured the export replica only when it is on the own grid
            choices.append(ExpertChoice(e, b, "export-replica", target, mse(e, b),
                                        mse(e, target) if grid == own else None))
        elif grid == own and fitting:
            choices.append(ExpertChoice(e, b, "replica", max(fitting), mse(e, b), mse(e, max(fitting))))
        else:
            choices.append(ExpertChoice(e, b, "rtn", target, mse(e, b), None))
    return LayerExport(layer, scheme, tuple(choices))


def vllm_grid(artifact: Artifact) -> tuple[int | None, bool]:
    """The expert grid of a vLLM export: the artifact's own when vLLM's fused MoE takes it (symmetric; groups of 32,
    64, 128 or channels), else its export replicas' (calibrate --export-target vllm, then pack)."""
    if artifact.symmetric and artifact.group_size in (None, 32, 64, 128):
        return artifact.group_size, True
    extra = artifact.export_section
    if not extra or extra.get("own_grid", True):
        raise HexqError(f"{artifact.path}: its experts are on a grid vLLM's fused MoE does not take (group "
                        f"{artifact.group_size}, {'symmetric' if artifact.symmetric else 'asymmetric'}) and it "
                        "keeps no vLLM replicas; calibrate with --export-target vllm (or recipe experts-vllm) and "
                        "pack with --bank export")
    return extra["group_size"], extra["symmetric"]


def refuse_skipped_experts(artifact: Artifact, format_name: str, engine: str) -> None:
    """Raise when the artifact skips experts (0 bits): hexq serves a skipped expert by renormalising its routing
    weight onto each token's kept experts (hexq.model.simulate.renormalized_weights), which neither export format can
    say; the engine would run it as a zero expert whose weight is lost, a model other than the one hexq checked."""
    skipped = sum(bits == 0 for row in artifact.allocation for bits in row)
    if skipped:
        raise HexqError(f"{artifact.path} skips {skipped} routed expert(s) (0 bits), which hexq serves by "
                        f"renormalising their routing weight onto each token's kept experts; {format_name} has no "
                        f"way to say so ({engine} would run them as zero experts, their weight lost); pack with widths "
                        "from 1 bit up (pack.widths without 0) to export")


def plan_export(artifact: Artifact, experts: str = "auto") -> list[LayerExport]:
    """One LayerExport per MoE layer; experts: auto | w4 | w8 on the artifact's own grid, or vllm (4 bits on the
    grid vLLM's fused MoE takes; see vllm_grid)."""
    if experts not in EXPERT_MODES:
        raise HexqError(f"unknown experts scheme {experts!r}; choose one of {', '.join(EXPERT_MODES)}")
    refuse_skipped_experts(artifact, "compressed-tensors", "vLLM")
    recipe = artifact.recipe
    acts = activation_spec(recipe.expert_activations, "routed experts")
    table = artifact.tensor(STATS_SHARD, "loss_table").float() if "loss_table" in artifact.keys(STATS_SHARD) \
        else None
    grid = vllm_grid(artifact) if experts == "vllm" else None
    plans = []
    for row in range(len(artifact.moe_layers)):
        rows_table = None if table is None else table[row]
        if experts == "w8":
            plans.append(plan_layer(artifact, row, 8, rows_table, acts))
            continue
        four = plan_layer(artifact, row, 4, rows_table, acts, grid)
        if experts == "auto" and any(c.source == "rtn" for c in four.choices):
            four = plan_layer(artifact, row, 8, rows_table, acts)
        plans.append(four)
    return plans
