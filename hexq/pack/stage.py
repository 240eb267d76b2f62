"""`hexq pack`: a calibration folder -> one packed artifact (see hexq.artifact.format for the layout).

Per layer, from the calibration's router statistics and loss table:
  importance  S = alpha*norm(P) + (1-alpha)*norm(W)                        (002 §4.1; hexq.algos.importance)
  allocation  prefix-structured widths minimising the summed loss table     (002 §4.2; hexq.algos.allocation)
              under an average-bit budget per layer, or one byte budget split across layers uniformly or by
              004's cosine depth schedule (§4.3); or any width per expert (pack.order "free"), the table
              weighted by routing mass (pack.loss "layer")
  placement   the hot experts for the fast tier, 003 Algorithm 2 scheme 1, 2 or 3 (hexq.algos.placement)
Every expert is stored at its allocated width, plus the `bank` widths the run policies that will serve it need
(`hexq run --policy online|context|depth` changes precision at run time), so a 3-bit artifact's experts take about
3/16 of their bf16 size plus scales instead of every replica of the calibration.

Streamed: the statistics of every MoE layer are read first (small); then one layer at a time, its dense part is
materialized from the source checkpoint (hexq.model.streaming), smoothing folded in, and written with the calibration's
quantized codes; its experts' stored widths are sliced from the calibration's packed bank without reading the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hexq.algos.allocation import (
    allocate,
    allocate_avg_bits,
    allocate_free,
    allocate_model,
    assignment_loss,
    avg_bit_budget,
    cosine_retention,
    layer_budgets,
    loss_columns,
)
from hexq.algos.importance import importance, importance_order
from hexq.algos.placement import place
from hexq.algos.policy_widths import POLICIES, policy_widths
from hexq.artifact.format import (
    HEAD_WEIGHT,
    MODEL_FILES,
    STATS_SHARD,
    TOP_SHARD,
    ArtifactWriter,
    dense_shard,
    expert_shard,
    export_shard,
)
from hexq.base.errors import HexqError
from hexq.base.outputs import output_folder
from hexq.calib.fold import fold_calibrated
from hexq.calib.head import HEAD_PREFIX
from hexq.calib.store import (
    CalibrationManifest,
    calibration_source,
    load_head,
    load_layer,
    open_bank,
    open_layer,
    read_manifest,
)
from hexq.config.recipe import Pack, recipe_to_dict
from hexq.model.streaming import open_model
from hexq.pack.tensors import (
    dense_layer_tensors,
    export_grid,
    export_replica_experts,
    layer_expert_tensors,
    layer_export_tensors,
    layer_kquant_tensors,
    stored_tensor,
)
from hexq.packed.grids import EXPORT_BITS
from hexq.packed.weight import PROJECTIONS, packed_weight_nbytes

Progress = Callable[[str, int, int], None]

@dataclass(frozen=True)
class Budget:
    """What the allocation must fit: an average width per layer, or one byte total for all routed experts.
    allow_skipping: accept a budget below every expert at the smallest non-zero width, which only skipping experts
    (0 bits) can meet (a recipe's own pack.avg_bits is taken as meant; `hexq pack --bits` must say so)."""

    avg_bits: float | None = None
    total_bytes: int | None = None
    allow_skipping: bool = False


@dataclass(frozen=True)
class PackSummary:
    out: Path
    layers: int
    experts: int
    average_bits: float
    allocated_bytes: int
    artifact_bytes: int
    seconds: float
    empty_layers: tuple[int, ...] = ()  # MoE layers whose allocation skips every routed expert
    # experts stored above 4 bits with no 4-bit form kept: a GGUF export of their layers as 4-bit blocks needs one
    # (hexq.export.gguf.plan), which `--bank export` keeps
    without_4bit: int = 0


# ------------------------------------------------------------------------------------------ pure decisions


def expert_costs(shapes: dict[str, tuple[int, int]], bits: tuple[int, ...], group_size: int | None) -> list[int]:
    """Stored bytes of one expert (gate_up + down) at each width; 0 bits (skipped) costs nothing. group_size None:
    one grid per row (the group is the projection's input width)."""
    return [0 if b == 0 else sum(packed_weight_nbytes(shapes[p], b, group_size or shapes[p][1]) for p in PROJECTIONS)
            for b in bits]


def allocate_layers(losses: list[torch.Tensor], orders: list[list[int]], settings: Pack, budget: Budget,
                    costs: list[int]) -> list[list[int]]:
    """Widths [L][E] by expert id: avg_bits per layer, or the byte total split by the recipe's schedule (schedule
    "model": either budget for all layers at once)."""
    bits = settings.widths
    smallest = min((b for b in bits if b), default=0)
    skipping = ("only skipping experts meets it (a layer may lose every routed expert); pass --allow-skipping to "
                "pack it anyway")
    if budget.total_bytes is None:
        avg = settings.avg_bits if budget.avg_bits is None else budget.avg_bits
        if not min(bits) <= avg <= max(bits):
            raise HexqError(f"average-bit budget {avg} is outside the allowed widths {list(bits)}: pass --bits from "
                            f"{min(bits)} to {max(bits)}")
        if 0 in bits and avg < smallest and not budget.allow_skipping:
            raise HexqError(f"average-bit budget {avg} is below the smallest stored width ({smallest} bits): "
                            + skipping)
        if settings.schedule == "model":
            return allocate_model(losses, bits, bits, avg_bit_budget(avg, sum(loss.shape[0] for loss in losses)))
        if settings.order == "free":
            return [allocate_free(loss, bits, bits, avg_bit_budget(avg, loss.shape[0])) for loss in losses]
        return [allocate_avg_bits(loss, bits, order, avg) for loss, order in zip(losses, orders, strict=True)]
    num_layers, num_experts = len(losses), losses[0].shape[0]
    weights = ([1.0] * num_layers if settings.schedule == "uniform"
               else cosine_retention(num_layers, settings.cosine_lambda))
    minimum = num_layers * num_experts * costs[0]
    fitting = num_layers * num_experts * costs[bits.index(smallest)] if smallest else 0
    if 0 in bits and budget.total_bytes < fitting and not budget.allow_skipping:
        raise HexqError(f"byte budget {budget.total_bytes} is below every expert at {smallest} bits ({fitting} "
                        "bytes): " + skipping)
    if budget.total_bytes < minimum:
        raise HexqError(f"byte budget {budget.total_bytes} is infeasible: the minimum that fits is {minimum} bytes "
                        f"(every expert at {bits[0]} bits)")
    if settings.schedule == "model":
        return allocate_model(losses, bits, costs, budget.total_bytes)
    shares = layer_budgets(budget.total_bytes, weights, [num_experts * costs[0]] * num_layers)
    if settings.order == "free":
        return [allocate_free(loss, bits, costs, share) for loss, share in zip(losses, shares, strict=True)]
    return [allocate(loss, bits, order, costs, share)
            for loss, order, share in zip(losses, orders, shares, strict=True)]


def allocated_bytes(allocation: list[list[int]], costs_by_bits: dict[int, int]) -> int:
    return sum(costs_by_bits[b] for row in allocation for b in row)


# ------------------------------------------------------------------------------------------ the command


def check_calibration(manifest: CalibrationManifest, calib_dir: Path, settings: Pack) -> Path:
    """The source model folder, after checking the calibration is complete, has replica banks for the requested
    widths, and the source model has not changed since."""
    model_path = calibration_source(calib_dir, manifest)
    missing = [b for b in settings.widths if b != 0 and b not in manifest.expert_bits]
    if missing:
        raise HexqError(f"pack widths {list(settings.widths)} need replicas at {missing} bits; {calib_dir} has "
                        f"{manifest.expert_bits} (calibrate with a replicas recipe, e.g. experts-mixed)")
    return model_path


STATS_KEYS = ("loss_table", "loss_table.skip", "loss_table.tokens", "router.counts", "router.score_sums", "router.topk")
LATER_STATS_KEYS = ("loss_table.mass",)  # read when the calibration has them (older ones do not)


@dataclass(frozen=True)
class Plan:
    """Every decision `hexq pack` makes, before anything is written."""

    scores: torch.Tensor  # [L, E] importance
    orders: list[list[int]]  # per layer, expert ids most important first
    losses: list[torch.Tensor]  # per layer [E, len(bits)] loss table restricted to the allowed widths
    costs: list[int]  # bytes of one expert at each allowed width
    allocation: list[list[int]]  # [L][E] widths
    hot: int  # fast-tier experts per layer
    placement: torch.Tensor  # [L, E] bool

    @property
    def average_bits(self) -> float:
        return sum(map(sum, self.allocation)) / (len(self.allocation) * len(self.allocation[0]))


def read_stats(calib_dir: Path, moe_layers: list[int], progress: Progress | None) -> dict:
    """The statistics of every MoE layer stacked over layers ([L_moe, ...] per key), read without the banks."""
    stats: dict[str, list] = {key: [] for key in STATS_KEYS + LATER_STATS_KEYS}
    for position, index in enumerate(moe_layers):
        with open_layer(calib_dir, index) as handle:
            for key in STATS_KEYS + tuple(key for key in LATER_STATS_KEYS if key in handle.keys()):
                stats[key].append(handle.get_tensor(key))
        if progress:
            progress("read", position + 1, len(moe_layers))
    return {key: torch.stack(values) for key, values in stats.items() if len(values) == len(moe_layers)}


def table_losses(stats: dict, table_bits: list[int], settings: Pack) -> list[torch.Tensor]:
    """Per layer, the loss table restricted to the allowed widths [E, len(bits)] (0 bits: the skip entry), as the
    allocation minimises it: per expert (pack.loss "expert", 002 §4.2), or each expert's entry times its squared
    routing mass per layer token (pack.loss "layer"): the expert's share of the layer output's MSE, so that
    experts add up as the layer does."""
    losses = [loss_columns(table, skip, table_bits, settings.widths)
              for table, skip in zip(stats["loss_table"], stats["loss_table.skip"], strict=True)]
    if settings.loss == "expert":
        return losses
    if "loss_table.mass" not in stats:
        raise HexqError("pack.loss 'layer' needs each expert's routing mass (loss_table.mass), which this calibration "
                        "predates; calibrate again, or pack with pack.loss: expert")
    return [loss * mass.double()[:, None] for loss, mass in zip(losses, stats["loss_table.mass"], strict=True)]


def make_plan(stats: dict, table_bits: list[int], settings: Pack, budget: Budget,
              shapes: dict[str, tuple[int, int]], group_size: int | None) -> Plan:
    """Importance (002 §4.1), allocation (002 §4.2) and placement (003 Algorithm 2) from the statistics."""
    scores = importance(stats["router.counts"], stats["router.score_sums"], settings.alpha)
    orders = [importance_order(row) for row in scores]
    losses = table_losses(stats, table_bits, settings)
    costs = expert_costs(shapes, settings.widths, group_size)
    allocation = allocate_layers(losses, orders, settings, budget, costs)
    hot = max(1, round(settings.hot_fraction * scores.shape[1]))
    placement = place(settings.placement, stats["router.topk"].long(), stats["router.counts"], hot)
    return Plan(scores, orders, losses, costs, allocation, hot, placement)


def bank_widths(requested: tuple[str, ...], allocation: list[list[int]], table_bits: list[int]) -> list[int]:
    """The widths stored for every expert besides its allocated one: each --bank item is a width, "all" (every
    calibrated width) or a run policy (the widths `hexq run --policy NAME` may ask for with its defaults)."""
    widths: set[int] = set()
    for item in requested:
        if item == "all":
            widths |= set(table_bits)
        elif item in POLICIES:
            wanted = policy_widths(item, allocation, table_bits)
            missing = sorted(wanted - set(table_bits))
            if missing:
                raise HexqError(f"--bank {item}: the policy asks for widths {missing}, the calibration has replicas "
                                f"at {table_bits} bits only")
            widths |= wanted
        else:
            try:
                bits = int(item)
            except ValueError:
                raise HexqError(f"--bank {item!r} is neither a width, 'all', nor a policy "
                                f"({', '.join(POLICIES)})") from None
            if bits not in table_bits:
                raise HexqError(f"--bank {bits}: the calibration has replicas at {table_bits} bits only")
            widths.add(bits)
    return sorted(widths - {0})


def pack(calib_dir: str | Path, out: str | Path, settings: Pack | None = None, budget: Budget | None = None,
         overwrite: bool = False, progress: Progress | None = None, bank: tuple[str, ...] = ()) -> PackSummary:
    """Pack the calibration in `calib_dir` into the artifact folder `out` (atomically; see module docstring), one
    layer at a time. settings: the pack section to use (default: the calibration's recipe's); budget: overrides
    settings.avg_bits; bank: widths kept for every expert besides its allocated one (see `bank_widths`)."""
    started = time.time()
    calib_dir, out = Path(calib_dir), Path(out)
    manifest = read_manifest(calib_dir)
    recipe = manifest.recipe
    settings = settings or recipe.pack
    recipe = replace(recipe, pack=settings)  # the artifact records the pack settings it was made with
    budget = budget or Budget(avg_bits=settings.avg_bits, allow_skipping=True)  # the recipe's own choice
    model_path = check_calibration(manifest, calib_dir, settings)
    keep_export = settings.export_replicas or "export" in bank
    bank = tuple(item for item in bank if item != "export")

    if keep_export and EXPORT_BITS not in manifest.expert_bits:
        raise HexqError(f"export replicas need {EXPORT_BITS}-bit replicas; {calib_dir} has {manifest.expert_bits} bits")

    streamed, _tokenizer = open_model(model_path, torch.device("cpu"))
    adapter = streamed.adapter
    num_layers, num_experts, moe_layers = manifest.num_layers, manifest.num_experts, manifest.moe_layers
    table_bits = manifest.expert_bits
    group_size = recipe.expert_weights.group_size
    _num, gate_up_shape, down_shape = streamed.expert_shapes(moe_layers[0])
    shapes = {"gate_up": gate_up_shape, "down": down_shape}
    own_group, own_symmetric = recipe.expert_weights.group_size, recipe.expert_weights.symmetric
    export_group, export_symmetric, own_grid = (
        export_grid(calib_dir, moe_layers[0], gate_up_shape[1], own_group, own_symmetric) if keep_export
        else (own_group, own_symmetric, True))
    stats = read_stats(calib_dir, moe_layers, progress)
    plan = make_plan(stats, table_bits, settings, budget, shapes, group_size)
    bytes_by_bits = dict(zip(settings.widths, plan.costs, strict=True))
    used = allocated_bytes(plan.allocation, bytes_by_bits)
    banked = bank_widths(bank, plan.allocation, table_bits)
    bf16_bytes = len(moe_layers) * num_experts * sum(rows * cols for rows, cols in shapes.values()) * 2

    with output_folder(out, kind="artifact", force=overwrite, inputs=[calib_dir, model_path]) as folder:
        writer = ArtifactWriter(folder)
        quantized: dict[str, int] = {}
        export_kept: dict[str, list[int]] = {}
        gguf_kept: dict[str, dict[str, list[int]]] = {}  # layer -> {K-quant: experts} (layer_kquant_tensors)
        stored_bytes: dict[int, int] = {}
        dense_bytes = without_4bit = 0
        for index in range(num_layers):
            tensors, _ = load_layer(calib_dir, index)  # the layer's bank is a file of its own, read below
            with streamed.layer(index, experts=False) as loaded:
                fold_calibrated(loaded.module, adapter, tensors)
                dense, names = dense_layer_tensors(loaded, adapter, tensors, f"model.layers.{index}.",
                                                   recipe.weights.bits)
            quantized |= names
            writer.add_tensors(dense_shard(index), dense)
            dense_bytes += writer.files[dense_shard(index)]["bytes"]
            if index in moe_layers:
                row = plan.allocation[moe_layers.index(index)]
                widths_of = [{b for b in (row[e], *banked) if b} for e in range(num_experts)]
                with open_bank(calib_dir, index) as bank, open_layer(calib_dir, index) as layer:
                    experts, nbytes = layer_expert_tensors(bank, layer, widths_of)
                writer.add_tensors(expert_shard(index), experts)
                if not keep_export:
                    needs = []
                elif own_grid:  # only the experts whose own width has no exact 4-bit form, unless stored anyway
                    weights = recipe.expert_weights
                    needs = [e for e in export_replica_experts(row, weights.symmetric, weights.float_zero_bits)
                             if EXPORT_BITS not in widths_of[e]]
                else:  # another grid: every expert that is not skipped takes its export replica
                    needs = [e for e, bits in enumerate(row) if bits]
                extra: dict[str, torch.Tensor] = {}
                if keep_export:
                    with open_bank(calib_dir, index) as bank_file:
                        if needs:
                            extra = layer_export_tensors(bank_file, needs, EXPORT_BITS, own_grid)
                            export_kept[str(index)] = needs
                        kquants, kept = layer_kquant_tensors(bank_file, row, recipe.expert_weights.symmetric)
                    extra |= kquants
                    if kept:
                        gguf_kept[str(index)] = kept
                without_4bit += sum(1 for e, bits in enumerate(row) if bits > EXPORT_BITS
                                    and EXPORT_BITS not in widths_of[e] and e not in needs)
                if extra:
                    writer.add_tensors(export_shard(index), extra)
                for b, n in nbytes.items():
                    stored_bytes[b] = stored_bytes.get(b, 0) + n
            if progress:
                progress("pack", index + 1, num_layers)
        head = load_head(calib_dir, recipe)
        top, aliases = top_tensors(streamed, head)
        if head is not None:
            quantized[HEAD_WEIGHT] = recipe.head.bits
        writer.add_tensors(TOP_SHARD, top)
        dense_bytes += writer.files[TOP_SHARD]["bytes"]
        writer.add_tensors(STATS_SHARD, {**stats, "importance": plan.scores.float(), "placement": plan.placement})
        for name in MODEL_FILES:
            if name == "config.json" and head is not None:
                writer.add_json(name, untied_config(model_path / name))
            elif (model_path / name).is_file():
                writer.add_file(name, model_path / name)
        writer.finish({
            "model": {"model_type": manifest.model_type, "num_layers": num_layers,
                      "moe_layers": moe_layers, "num_experts": num_experts, "top_k": manifest.top_k,
                      "moe": adapter.moe, "experts": adapter.experts},
            "provenance": {"model_sha256": manifest.fingerprint["model"], "model_path": str(model_path.resolve()),
                           "data_sha256": manifest.fingerprint["data"],
                           "calibration_recipe_sha256": manifest.fingerprint["recipe"],
                           "calibration_data": manifest.data, "calibrated_with": manifest.hexq_version},
            "recipe": recipe_to_dict(recipe),
            "dense": {"quantized_linears": quantized, "aliases": aliases},
            "experts": {"replica_bits": table_bits, "bank_bits": banked,
                        "shapes": {p: list(s) for p, s in shapes.items()},
                        "group_size": group_size, "symmetric": recipe.expert_weights.symmetric,
                        "scale_dtype": "float16"},
            "allocation": {
                "bits": plan.allocation, "average_bits": plan.average_bits,
                "budget": {"avg_bits": budget.avg_bits, "total_bytes": budget.total_bytes,
                           "schedule": settings.schedule},
                "table_loss": [assignment_loss(loss, settings.widths, row)
                               for loss, row in zip(plan.losses, plan.allocation, strict=True)],
                "importance_order": plan.orders},
            "export": {"bits": EXPORT_BITS, "group_size": export_group, "symmetric": export_symmetric,
                       "own_grid": own_grid, "replicas": export_kept} if keep_export else None,
            **({"gguf": {"replicas": gguf_kept}} if gguf_kept else {}),
            "placement": {"scheme": settings.placement, "hot_per_layer": plan.hot,
                          "hot": [torch.where(row)[0].tolist() for row in plan.placement]},
            "accounting": {"dense_bytes": dense_bytes,
                           "stored_expert_bytes_by_bits": {str(b): n for b, n in sorted(stored_bytes.items())},
                           "stored_expert_bytes": sum(stored_bytes.values()),
                           "expert_bytes_by_bits": {str(b): n for b, n in bytes_by_bits.items()},
                           "allocated_expert_bytes": used,
                           "bf16_expert_bytes": bf16_bytes,
                           "files_bytes": sum(f["bytes"] for f in writer.files.values())},
        })
    empty = tuple(layer for layer, row in zip(moe_layers, plan.allocation, strict=True) if not any(row))
    return PackSummary(out, num_layers, num_experts, plan.average_bits, used,
                       sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), time.time() - started, empty,
                       without_4bit)


def top_tensors(streamed, head: dict[str, torch.Tensor] | None) -> tuple[dict, dict[str, str]]:
    """Embeddings, final norm and head as stored in the source checkpoint, a tied head as an alias; or, with `head`
    (the calibration's quantized head, hexq.calib.head), the head as its codes, scale and zero."""
    source, out, aliases = streamed.source, {}, {}
    for name, param in streamed.model.named_parameters():
        if name.startswith("model.layers."):
            continue
        if name == HEAD_WEIGHT and head is not None:
            out |= {f"{name}.{part}": head[f"{HEAD_PREFIX}.{part}"] for part in ("codes", "scale", "zero")}
            continue
        if name == HEAD_WEIGHT and getattr(streamed.config, "tie_word_embeddings", False):
            aliases[name] = "model.embed_tokens.weight"
            continue
        out[name] = stored_tensor(source.read_param(name, tuple(param.shape)))
    return out, aliases


def untied_config(path: Path) -> dict:
    """The source's config.json for an artifact whose head is quantized: a head of its own, whatever the source tied
    (the embeddings stay as stored)."""
    config = json.loads(path.read_text())
    config["tie_word_embeddings"] = False
    return config
