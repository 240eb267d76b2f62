"""`hexq pack`: a calibration folder -> one packed artifact (see hexq.artifact.format for the layout).

Per layer, from the calibration's router statistics and loss table:
  importance  S = alpha*norm(P) + (1-alpha)*norm(W)                        (002 §4.1; hexq.algos.importance)
  allocation  prefix-structured widths minimising the summed loss table     (002 §4.2; hexq.algos.allocation)
              under an average-bit budget per layer, or one byte budget split across layers uniformly or by
              004's cosine depth schedule (§4.3)
  placement   the hot experts for the fast tier, 003 Algorithm 2 scheme 1, 2 or 3 (hexq.algos.placement)
and every expert's whole replica bank is stored, so the runtime can change an expert's precision later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hexq.algos.allocation import (
    allocate,
    allocate_avg_bits,
    assignment_loss,
    cosine_retention,
    layer_budgets,
    loss_columns,
)
from hexq.algos.importance import importance, importance_order
from hexq.algos.placement import frequency_placement, path_placement, two_stage_placement
from hexq.algos.quant import QuantMeta
from hexq.artifact.format import (
    DENSE_SHARD,
    PROJECTIONS,
    STATS_SHARD,
    ArtifactWriter,
    expert_shard,
    pack_weight,
    packed_weight_nbytes,
    replica_key,
)
from hexq.calib.capture import quantized_linears
from hexq.calib.smooth import fold_scales, smoothing_groups
from hexq.calib.store import load_layer, model_fingerprint, read_manifest
from hexq.errors import HexqError
from hexq.models import load_model
from hexq.recipe import Pack, Recipe, recipe_from_dict, recipe_to_dict

Progress = Callable[[str, int, int], None]
# Files of the source model folder copied into the artifact (config and tokenizer; weights are re-packed).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclass(frozen=True)
class Budget:
    """What the allocation must fit: an average width per layer, or one byte total for all routed experts."""

    avg_bits: float | None = None
    total_bytes: int | None = None


@dataclass(frozen=True)
class PackSummary:
    out: Path
    layers: int
    experts: int
    average_bits: float
    allocated_bytes: int
    artifact_bytes: int
    seconds: float


# ------------------------------------------------------------------------------------------ pure decisions


def expert_costs(shapes: dict[str, tuple[int, int]], bits: tuple[int, ...], group_size: int | None) -> list[int]:
    """Stored bytes of one expert (gate_up + down) at each width; 0 bits (skipped) costs nothing. group_size None:
    one grid per row (the group is the projection's input width)."""
    return [0 if b == 0 else sum(packed_weight_nbytes(shapes[p], b, group_size or shapes[p][1]) for p in PROJECTIONS)
            for b in bits]


def allocate_layers(losses: list[torch.Tensor], orders: list[list[int]], settings: Pack, budget: Budget,
                    costs: list[int]) -> list[list[int]]:
    """Widths [L][E] by expert id: avg_bits per layer, or the byte total split by the recipe's schedule."""
    bits = settings.bits
    if budget.total_bytes is None:
        avg = settings.avg_bits if budget.avg_bits is None else budget.avg_bits
        if not min(bits) <= avg <= max(bits):
            raise HexqError(f"average-bit budget {avg} is outside the allowed widths {list(bits)}; the minimum that "
                            f"fits is {min(bits)}")
        return [allocate_avg_bits(loss, bits, order, avg) for loss, order in zip(losses, orders, strict=True)]
    num_layers, num_experts = len(losses), losses[0].shape[0]
    weights = ([1.0] * num_layers if settings.schedule == "uniform"
               else cosine_retention(num_layers, settings.cosine_lambda))
    minimum = num_layers * num_experts * costs[0]
    if budget.total_bytes < minimum:
        raise HexqError(f"byte budget {budget.total_bytes} is infeasible: the minimum that fits is {minimum} bytes "
                        f"(every expert at {bits[0]} bits)")
    shares = layer_budgets(budget.total_bytes, weights, [num_experts * costs[0]] * num_layers)
    return [allocate(loss, bits, order, costs, share)
            for loss, order, share in zip(losses, orders, shares, strict=True)]


def place_hot_experts(scheme: str, topk: torch.Tensor, counts: torch.Tensor, hot: int) -> torch.Tensor:
    """[L, E] bool: the `hot` fast-tier experts of each layer by 003 Algorithm 2 scheme 1, 2 or 3."""
    if scheme == "paths":
        return path_placement(topk, counts.shape[1], hot)
    if scheme == "frequency":
        return frequency_placement(counts, hot)
    return two_stage_placement(topk, counts.shape[1], hot)


# ------------------------------------------------------------------------------------------ tensors


def dense_tensors(model, adapter, layer_tensors: list[dict], recipe: Recipe) -> tuple[dict, dict]:
    """Every non-expert tensor of the calibrated model (smoothing folded) and the names of the quantized linears.

    Quantized linears are stored as their calibration codes ("<name>.weight.codes/.scale/.zero") plus static
    activation ranges ("<name>.act_range"); other tensors in bfloat16 when that is exact, else float32. Tied
    tensors (embeddings shared with lm_head) are stored once: the model built from the config ties them again.
    """
    quantized: dict[str, int] = {}
    packed: dict[str, torch.Tensor] = {}
    expert_params = set()
    for index, layer in enumerate(model.model.layers):
        tensors = layer_tensors[index]
        for group in smoothing_groups(layer, adapter):
            fold_scales(group, tensors[f"smooth.{group.name}"])
        prefix = f"model.layers.{index}."
        experts = f"{prefix}{adapter.moe}.{adapter.experts}."
        expert_params |= {experts + "gate_up_proj", experts + "down_proj"}
        for name in quantized_linears(layer, adapter):
            codes, scale = tensors[f"linear.{name}.codes"], tensors[f"linear.{name}.scale"]
            meta = QuantMeta(scale, tensors[f"linear.{name}.zero"], codes.shape[1] // scale.shape[1],
                             recipe.weights.bits)
            packed.update(pack_weight(codes, meta).tensors(f"{prefix}{name}.weight"))
            quantized[f"{prefix}{name}.weight"] = recipe.weights.bits
            if f"act.{name}" in tensors:
                packed[f"{prefix}{name}.act_range"] = tensors[f"act.{name}"].float()
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in model.state_dict(keep_vars=False).items():
        if key in expert_params or key in quantized:
            continue
        if tensor.data_ptr() in seen:
            aliases[key] = seen[tensor.data_ptr()]
            continue
        seen[tensor.data_ptr()] = key
        as_bf16 = tensor.detach().to(torch.bfloat16)
        packed[key] = as_bf16 if torch.equal(as_bf16.float(), tensor.detach().float()) else tensor.detach().float()
    return packed, {"quantized_linears": quantized, "aliases": aliases}


def layer_expert_tensors(tensors: dict, bits_list: list[int], num_experts: int) -> tuple[dict, dict[int, int]]:
    """One layer's replica banks as stored tensors, and the stored bytes per width (all experts)."""
    out: dict[str, torch.Tensor] = {}
    nbytes: dict[int, int] = {b: 0 for b in bits_list}
    for bits in bits_list:
        for projection in PROJECTIONS:
            prefix = f"experts.{projection}.b{bits}"
            codes, scale, zero = tensors[f"{prefix}.codes"], tensors[f"{prefix}.scale"], tensors[f"{prefix}.zero"]
            group = codes.shape[-1] // scale.shape[-1]
            for expert in range(num_experts):
                weight = pack_weight(codes[expert], QuantMeta(scale[expert], zero[expert], group, bits))
                out.update(weight.tensors(replica_key(expert, bits, projection)))
                nbytes[bits] += weight.nbytes
    for name, key in (("input", "act.experts.input"), ("mid", "act.experts.mid")):
        if key in tensors:
            out[f"act.{name}"] = tensors[key].float()
    return out, nbytes


def allocated_bytes(allocation: list[list[int]], costs_by_bits: dict[int, int]) -> int:
    return sum(costs_by_bits[b] for row in allocation for b in row)


# ------------------------------------------------------------------------------------------ the command


def check_calibration(manifest: dict, calib_dir: Path, settings: Pack) -> Path:
    """The source model folder, after checking the calibration is complete, has replica banks for the requested
    widths, and the source model has not changed since."""
    model_path = Path(manifest["model"]["path"])
    if not model_path.is_dir():
        raise HexqError(f"the source model of {calib_dir} is gone: {model_path}")
    if model_fingerprint(model_path) != manifest["fingerprint"]["model"]:
        raise HexqError(f"the model at {model_path} changed since {calib_dir} was calibrated (weights hash differs)")
    missing = [b for b in settings.bits if b != 0 and b not in manifest["expert_bits"]]
    if missing:
        raise HexqError(f"pack bits {list(settings.bits)} need replicas at {missing} bits; {calib_dir} has "
                        f"{manifest['expert_bits']} (calibrate with a replicas recipe, e.g. experts-mixed)")
    return model_path


STATS_KEYS = ("loss_table", "loss_table.skip", "loss_table.tokens", "router.counts", "router.score_sums", "router.topk")


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


def read_layers(calib_dir: Path, num_layers: int, progress: Progress | None) -> tuple[list[dict], dict]:
    """Every layer's calibration tensors, and the statistics stacked over layers ([L, ...] per key)."""
    layer_tensors, stats = [], {key: [] for key in STATS_KEYS}
    for index in range(num_layers):
        tensors, _ = load_layer(calib_dir, index)
        layer_tensors.append(tensors)
        for key in STATS_KEYS:
            stats[key].append(tensors[key])
        if progress:
            progress("read", index + 1, num_layers)
    return layer_tensors, {key: torch.stack(values) for key, values in stats.items()}


def make_plan(stats: dict, table_bits: list[int], settings: Pack, budget: Budget,
              shapes: dict[str, tuple[int, int]], group_size: int | None) -> Plan:
    """Importance (002 §4.1), allocation (002 §4.2) and placement (003 Algorithm 2) from the statistics."""
    scores = importance(stats["router.counts"], stats["router.score_sums"], settings.alpha)
    orders = [importance_order(row) for row in scores]
    losses = [loss_columns(table, skip, table_bits, settings.bits)
              for table, skip in zip(stats["loss_table"], stats["loss_table.skip"], strict=True)]
    costs = expert_costs(shapes, settings.bits, group_size)
    allocation = allocate_layers(losses, orders, settings, budget, costs)
    hot = max(1, round(settings.hot_fraction * scores.shape[1]))
    placement = place_hot_experts(settings.placement, stats["router.topk"].long(), stats["router.counts"], hot)
    return Plan(scores, orders, losses, costs, allocation, hot, placement)


def pack(calib_dir: str | Path, out: str | Path, settings: Pack | None = None, budget: Budget | None = None,
         overwrite: bool = False, progress: Progress | None = None) -> PackSummary:
    """Pack the calibration in `calib_dir` into the artifact folder `out` (atomically; see module docstring).
    settings: the pack section to use (default: the calibration recipe's); budget: overrides settings.avg_bits."""
    started = time.time()
    calib_dir, out = Path(calib_dir), Path(out)
    manifest = read_manifest(calib_dir)
    recipe = recipe_from_dict(manifest["recipe"])
    settings = settings or recipe.pack
    recipe = replace(recipe, pack=settings)  # the artifact records the pack settings it was made with
    budget = budget or Budget(avg_bits=settings.avg_bits)
    model_path = check_calibration(manifest, calib_dir, settings)
    model, _tokenizer, adapter = load_model(model_path, "cpu")
    num_layers, num_experts = manifest["model"]["layers"], manifest["model"]["num_experts"]
    table_bits = manifest["expert_bits"]
    group_size = recipe.expert_weights.group_size
    experts = getattr(getattr(model.model.layers[0], adapter.moe), adapter.experts)
    shapes = {"gate_up": tuple(experts.gate_up_proj.shape[1:]), "down": tuple(experts.down_proj.shape[1:])}
    layer_tensors, stats = read_layers(calib_dir, num_layers, progress)
    plan = make_plan(stats, table_bits, settings, budget, shapes, group_size)
    bytes_by_bits = dict(zip(settings.bits, plan.costs, strict=True))
    used = allocated_bytes(plan.allocation, bytes_by_bits)

    with ArtifactWriter(out, overwrite) as writer:
        dense, dense_meta = dense_tensors(model, adapter, layer_tensors, recipe)
        writer.add_tensors(DENSE_SHARD, dense)
        bank_bytes = {b: 0 for b in table_bits}
        for index in range(num_layers):
            tensors, nbytes = layer_expert_tensors(layer_tensors[index], table_bits, num_experts)
            writer.add_tensors(expert_shard(index), tensors)
            for b, n in nbytes.items():
                bank_bytes[b] += n
            if progress:
                progress("pack", index + 1, num_layers)
        writer.add_tensors(STATS_SHARD, {**stats, "importance": plan.scores.float(), "placement": plan.placement})
        for name in MODEL_FILES:
            if (model_path / name).is_file():
                writer.add_file(name, model_path / name)
        writer.finish({
            "model": {"model_type": manifest["model"]["model_type"], "num_layers": num_layers,
                      "num_experts": num_experts, "top_k": manifest["model"]["top_k"],
                      "moe": adapter.moe, "experts": adapter.experts},
            "provenance": {"model_sha256": manifest["fingerprint"]["model"],
                           "data_sha256": manifest["fingerprint"]["data"],
                           "calibration_recipe_sha256": manifest["fingerprint"]["recipe"],
                           "calibration_data": manifest["data"], "calibrated_with": manifest["hexq_version"]},
            "recipe": recipe_to_dict(recipe),
            "dense": dense_meta,
            "experts": {"replica_bits": table_bits, "shapes": {p: list(s) for p, s in shapes.items()},
                        "group_size": group_size, "symmetric": recipe.expert_weights.symmetric,
                        "scale_dtype": "float16"},
            "allocation": {
                "bits": plan.allocation, "average_bits": plan.average_bits,
                "budget": {"avg_bits": budget.avg_bits, "total_bytes": budget.total_bytes,
                           "schedule": settings.schedule},
                "table_loss": [assignment_loss(loss, settings.bits, row)
                               for loss, row in zip(plan.losses, plan.allocation, strict=True)],
                "importance_order": plan.orders},
            "placement": {"scheme": settings.placement, "hot_per_layer": plan.hot,
                          "hot": [torch.where(row)[0].tolist() for row in plan.placement]},
            "accounting": {"dense_bytes": writer.files[DENSE_SHARD]["bytes"],
                           "bank_bytes_by_bits": {str(b): n for b, n in bank_bytes.items()},
                           "expert_bytes_by_bits": {str(b): n for b, n in bytes_by_bits.items()},
                           "allocated_expert_bytes": used,
                           "files_bytes": sum(f["bytes"] for f in writer.files.values())},
        })
    return PackSummary(out, num_layers, num_experts, plan.average_bits, used,
                       sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), time.time() - started)
