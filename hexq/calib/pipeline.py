"""`hexq calibrate`: calibration windows through an MoE model layer by layer, streamed from its checkpoint (the GPTQ
schedule: layer l is calibrated on the outputs of the already-quantized layers below it).

Only one decoder layer is ever materialized (hexq.streaming.StreamedModel): its dense part in float32, its routed
experts in the checkpoint's dtype, upcast one chunk of experts at a time. Per layer, three passes over the
calibration windows, the experts stood in for by an ExpertTap that records what they receive:
  A. smoothing (003 §III.B.1, eq. 1-3): the norms' outputs and the experts' routing give each smoothing group its s
     (HAQ grid search of e in s = max|X|^e, SmoothQuant's fixed alpha, or none); s is folded into the norm and its
     dense readers, and kept as a column scale for the routed experts (applied when a chunk is upcast);
  B. capture on the smoothed layer: Hessians of every quantized linear's input (attention, shared expert, a dense
     layer's MLP) and router statistics; then GPTQ (eq. 4-6) or RTN for those linears, and for the routed experts,
     chunk by chunk, per-expert Hessians from the tokens routed to each and one replica per width from one Hessian
     and one factorization (002 Alg. 1), bit-packed as soon as they exist;
  C. the quantized layer (dequantized weights + activation fake quantization) runs again; what the experts received
     gives, chunk by chunk, the loss table L(l, e, b) (MSE of each replica against the full-precision expert on the
     tokens routed to it, 002 §4.2) and the experts' output at `propagate_bits`, which makes the next layer's inputs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hexq import __version__
from hexq.adapters import MoEAdapter, check_moe_layers
from hexq.algos.gptq import factorize_hessians, gptq_bank, gptq_replicas
from hexq.algos.hessian import blend_cold_hessian
from hexq.algos.quant import QuantMeta, QuantSpec, quantize
from hexq.algos.smoothing import search_exponent, search_exponent_routed, smoothquant_scales
from hexq.artifact.format import dequantize_packed
from hexq.calib.capture import (
    RoutingStats,
    SiteStats,
    capture_linears,
    capture_norm_outputs,
    expert_statistics,
    quantized_linears,
)
from hexq.calib.smooth import MOE_IN, fold_calibrated, fold_scales, smoothing_groups, unsmoothed_linears
from hexq.calib.store import (
    FORMAT,
    FORMAT_VERSION,
    ExpertBank,
    bank_path,
    bank_weights,
    differing_inputs,
    is_finished,
    layer_file_records,
    layer_meta,
    layers_done,
    load_layer,
    model_fingerprint,
    open_bank,
    packed_matrix,
    progress_files,
    put_packed,
    read_json,
    read_manifest,
    save_layer,
    tensor_fingerprint,
    write_progress,
)
from hexq.checkpoint import Checkpoint
from hexq.data import calibration_windows
from hexq.errors import HexqError
from hexq.gguf.calibrate import kquant_kinds, kquant_replicas
from hexq.io import write_json_atomic, write_sealed_json
from hexq.recipe import Recipe, WeightQuant, calibration_hash, recipe_from_dict, recipe_to_dict, validate_for_model
from hexq.simulate import (
    RoutedTokens,
    act_quantizer,
    attach_input_quant,
    expert_intermediate,
    expert_output,
    quantized_expert_output,
)
from hexq.streaming import (
    ExpertCompute,
    HiddenStore,
    LoadedLayer,
    StreamedModel,
    expert_chunk,
    run_layer,
)

PROJECTIONS = ("gate_up", "down")
Progress = Callable[[str, int, int], None]  # (what, done, total)
# Working memory for one chunk of experts' GPTQ (weights of every width stacked, Hessians and factors, float32).
GPTQ_CHUNK_BYTES = 1 << 30
MOE_SAMPLE_EVERY = 8  # every 8th MoE-input token: the layer-wide sample for cold experts' fallbacks
# Intermediate activations of one expert computed at once for the loss table and the propagated output.
LOSS_TABLE_BYTES = 256 << 20


@dataclass(frozen=True)
class CalibrationSummary:
    out: Path
    layers: int
    resumed_from: int  # layers found finished at start (-1: the run was already complete)
    fallback_experts: int
    seconds: float


def expert_bits_list(recipe: Recipe) -> tuple[int, ...]:
    if recipe.experts.mode == "replicas":
        return recipe.experts.replica_bits
    return (recipe.expert_weights.bits,)


def default_expert_bits(recipe: Recipe) -> int:
    return recipe.experts.propagate_bits if recipe.experts.mode == "replicas" else recipe.expert_weights.bits


def group_size_of(setting: WeightQuant, cols: int) -> int:
    return setting.group_size or cols


# ------------------------------------------------------------------------------------------ quantizing weights


def quantize_bank(weight: torch.Tensor, hessian: torch.Tensor, setting: WeightQuant, bits_list: tuple[int, ...],
                  channel_max: torch.Tensor | None) -> dict[int, tuple[torch.Tensor, QuantMeta]]:
    """One weight [out, in] at every width of bits_list: GPTQ from one Cholesky factor, or RTN."""
    if setting.method == "rtn":
        return {bits: quantize(weight, setting.spec(bits)) for bits in bits_list}
    importance = channel_max if setting.act_order == "max_activation" else None
    results = gptq_replicas(weight.detach().float(), hessian, bits_list, setting.spec(), block_size=setting.block_size,
                            damp=setting.damp, act_order=setting.act_order, column_importance=importance)
    return {bits: (r.codes, r.meta) for bits, r in results.items()}


def quantize_expert_chunk(weights: torch.Tensor, hessians: torch.Tensor, setting: WeightQuant,
                          bits_list: tuple[int, ...], channel_max: torch.Tensor, budget: int | None = None,
                          factor=None) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict]:
    """Every width of a chunk of experts' weights [n, rows, cols] -> {bits: (codes [n, rows, cols], scale, zero)} and a
    report of the factorization (experts that needed more damping or float64).

    GPTQ (003 eq. 4-6): one factorization per expert for every width, every width and expert of the chunk in one
    column loop (hexq.algos.gptq.gptq_bank). GPTQ's rows are independent once the factor exists, so an expert too
    large for `budget` bytes of stacked widths is quantized in row blocks that give the same result."""
    n, rows, cols = weights.shape
    if setting.method == "rtn":  # per-row grids: the chunk flattened to rows is the same quantization
        flat = weights.reshape(n * rows, cols)
        out = {}
        for bits in bits_list:
            codes, meta = quantize(flat, setting.spec(bits))
            out[bits] = (codes.reshape(n, rows, cols), meta.scale.reshape(n, rows, -1), meta.zero.reshape(n, rows, -1))
        return out, {}
    factor = factor or expert_factor(hessians, setting, channel_max)
    budget = GPTQ_CHUNK_BYTES if budget is None else budget
    row_block = max(1, min(rows, budget // (4 * 3 * len(bits_list) * cols * n)))
    parts = [gptq_bank(weights[:, start:start + row_block], factor, bits_list, setting.spec(),
                       block_size=setting.block_size) for start in range(0, rows, row_block)]
    out = {bits: tuple(torch.cat([getattr(part[bits], name) for part in parts], dim=1)
                       for name in ("codes", "scale", "zero")) for bits in bits_list}
    report = {"damp": factor.damp_used.tolist(), "float64": factor.float64_used.tolist()}
    return out, report


def expert_factor(hessians: torch.Tensor, setting: WeightQuant, channel_max: torch.Tensor):
    """The HessianFactor of a chunk of experts (shared by every width and export grid made from it)."""
    importance = channel_max if setting.act_order == "max_activation" else None
    return factorize_hessians(hessians, damp=setting.damp, act_order=setting.act_order, column_importance=importance)


def gptq_chunk_size(shapes: dict[str, tuple[int, int]], widths: int, budget: int = GPTQ_CHUNK_BYTES) -> int:
    """Experts per chunk so that every width's weights (stacked, gptq_bank keeps ~2 copies alive), the float32
    weights and the Hessians with their factors fit `budget` bytes for the larger projection; an expert larger than
    that is split into row blocks by quantize_expert_chunk."""
    per_expert = max(4 * (3 * widths * rows * cols + 3 * cols * cols) for rows, cols in shapes.values())
    return max(1, budget // per_expert)


def export_spec(recipe: Recipe, shapes: dict[str, tuple[int, int]]) -> QuantSpec | None:
    """The grid of the extra replica `experts.export_target` asks for, or None (no target, or the recipe's expert grid
    already is that grid, so its own replica at that width serves). vllm: 4-bit symmetric in groups of 128, the
    fused-MoE W4A16 layout; 64 or 32 when 128 does not divide every expert input width (vLLM's Marlin MoE kernel
    takes 32, 64 and 128)."""
    if recipe.experts.mode != "replicas" or recipe.experts.export_target != "vllm":
        return None
    widths = [cols for _rows, cols in shapes.values()]
    group = next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise HexqError(f"experts.export_target vllm needs expert input widths {widths} divisible by 32")
    setting = recipe.expert_weights
    if 4 in recipe.experts.replica_bits and setting.symmetric and setting.group_size == group:
        return None
    return QuantSpec(bits=4, group_size=group, symmetric=True)


# ------------------------------------------------------------------------------------------ pass A: smoothing


def smooth_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict], recipe: Recipe,
                 seed: int, tensors: dict) -> tuple[dict, torch.Tensor | None]:
    """Choose and fold smoothing factors for the recipe's groups; returns the per-group report (every group of the
    layer: what was chosen, or why it was skipped) and the column scale the routed experts' gate_up must take (None
    when the MoE group is not smoothed or the layer is dense).

    Each group is scored with the setting its quantized readers get: the attention groups and a dense layer's MLP
    with `weights`/`activations`, a MoE layer's post-attention group with the experts' settings. The MoE group's HAQ
    objective (003 eq. 1) scores each routed expert on the tokens routed to it (the router's top-k of the same
    sampled tokens), the router and shared expert on all of them (`smoothing.moe_objective: routed`); `all` scores
    every expert on every token, as if each were routed everything."""
    layer = loaded.module
    groups = {group.name: group for group in smoothing_groups(layer, adapter)}
    for group in groups.values():
        tensors[f"smooth.{group.name}"] = torch.ones(group.channels, device="cpu")
    method = recipe.smoothing.method
    if method == "none":
        return {name: {"skipped": "smoothing.method is none"} for name in groups}, None
    report: dict = {name: {"skipped": f"smoothing.groups does not list {group.section!r}"}
                    for name, group in groups.items() if group.section not in recipe.smoothing.groups}
    selected = [name for name in groups if name not in report]
    with capture_norm_outputs({name: groups[name].norm for name in selected}) as outputs:
        routed = run_layer(loaded, hidden, kwargs, None, experts=None)
    expert_scale = None
    generator = torch.Generator().manual_seed(seed)
    for name in selected:
        group, x = groups[name], torch.cat(outputs.pop(name))
        act_max = x.abs().amax(dim=0)
        median = float(act_max.median().clamp(min=1e-12))
        entry = {"method": method, "act_max_over_median": round(float(act_max.max()) / median, 3)}
        routed_experts = name == MOE_IN and loaded.is_moe  # the experts are read from their stored copy
        w_setting, a_setting = ((recipe.expert_weights, recipe.expert_activations) if routed_experts
                                else (recipe.weights, recipe.activations))
        weights, quantized = group.weights(), group.quantized()
        if method == "smoothquant":
            if routed_experts:
                weights.append(loaded.gate_up.reshape(-1, loaded.gate_up.shape[-1]))
            s = smoothquant_scales(act_max, weights, recipe.smoothing.alpha)
            entry["alpha"] = recipe.smoothing.alpha
        elif not a_setting.enabled:
            report[name] = {"skipped": "activations of this group are not quantized: the W8A8 objective has "
                                       "nothing to fix"}
            continue
        else:
            picked = torch.randperm(x.shape[0], generator=generator, device="cpu")[: recipe.smoothing.max_tokens]
            sample = x[picked.to(x.device)]
            bits = default_expert_bits(recipe) if routed_experts else None
            common = dict(w_spec=w_setting.spec(bits), a_bits=a_setting.bits, a_symmetric=a_setting.symmetric)
            if routed_experts and recipe.smoothing.moe_objective == "routed":
                search = search_exponent_routed(sample, routed.index[picked.to(routed.index.device)], act_max,
                                                recipe.smoothing.grid_step, experts=loaded.gate_up,
                                                dense=list(zip(weights, quantized, strict=True)), **common)
            else:
                if routed_experts:  # every expert on every token (the objective before routing was considered)
                    weights.insert(1, loaded.gate_up.reshape(-1, loaded.gate_up.shape[-1]))
                    quantized.insert(1, True)
                search = search_exponent(weights, sample, act_max, recipe.smoothing.grid_step,
                                         quantize_weights=quantized, **common)
            s = search.scales
            entry.update(exponent=search.exponent, error=search.error, error_without_smoothing=search.baseline_error)
            if routed_experts:
                entry["objective"] = recipe.smoothing.moe_objective
        fold_scales(group, s)
        if routed_experts:
            expert_scale = s.float()
        tensors[f"smooth.{name}"] = s.float().cpu()
        report[name] = entry
    return {name: report[name] for name in groups}, expert_scale


# ------------------------------------------------------------------------------------------ pass B: quantization


def compute_experts(loaded: LoadedLayer, expert_scale: torch.Tensor | None, device: torch.device):
    """weights_of for the layer's full-precision experts: a chunk upcast to float32, gate_up's columns multiplied by
    the MoE group's smoothing factor (eq. 1's W s, in float32 like the dense readers)."""

    def weights_of(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = loaded.gate_up[experts].to(device=device, dtype=torch.float32)
        if expert_scale is not None:
            gate_up = gate_up * expert_scale.to(device)
        return gate_up, loaded.down[experts].to(device=device, dtype=torch.float32)

    return weights_of


def quantize_dense_linears(layer: torch.nn.Module, adapter: MoEAdapter, stats: dict[str, SiteStats],
                           recipe: Recipe, tensors: dict) -> None:
    for name, module in quantized_linears(layer, adapter).items():
        site = stats[name]
        (result,) = quantize_bank(module.weight, site.hessian, recipe.weights, (recipe.weights.bits,),
                                  site.abs_max).values()
        put_packed(tensors, f"linear.{name}", *result)
        tensors[f"act.{name}"] = torch.tensor([site.low, site.high], device="cpu")


def quantize_routed_experts(loaded: LoadedLayer, routed: RoutedTokens, weights_of, recipe: Recipe, tensors: dict,
                            moe_sample: torch.Tensor, bank_file: Path,
                            progress: Progress | None) -> tuple[list[int], dict]:
    """Replica banks for every routed expert, chunk by chunk, written to `bank_file` as they are made; returns the
    experts that used the cold fallback and the factorizations that needed more damping or float64."""
    setting, bits_list = recipe.expert_weights, expert_bits_list(recipe)
    num_experts = loaded.gate_up.shape[0]
    shapes = {"gate_up": tuple(loaded.gate_up.shape[1:]), "down": tuple(loaded.down.shape[1:])}
    groups = {p: group_size_of(setting, cols) for p, (_rows, cols) in shapes.items()}
    extra = export_spec(recipe, shapes)
    bank = ExpertBank(bank_file, num_experts, shapes, bits_list, groups,
                      export=None if extra is None else (extra.bits, extra.group_size),
                      kquants=kquant_kinds(recipe, shapes))
    try:
        fallback, escalated, ranges = fill_bank(bank, loaded, routed, weights_of, recipe, moe_sample, shapes,
                                                progress)
    except BaseException:
        bank.abort()
        raise
    bank.close()
    (input_low, input_high), (mid_low, mid_high) = ranges
    tensors["experts.tokens"] = torch.tensor([routed.count(e) for e in range(num_experts)], dtype=torch.long,
                                             device="cpu")
    tensors["act.experts.input"] = torch.tensor([input_low, input_high], device="cpu")
    tensors["act.experts.mid"] = torch.tensor([mid_low, mid_high], device="cpu")
    return fallback, escalated


def fill_bank(bank: ExpertBank, loaded: LoadedLayer, routed: RoutedTokens, weights_of, recipe: Recipe,
              moe_sample: torch.Tensor, shapes: dict, progress: Progress | None):
    """The GPTQ loop of quantize_routed_experts: (cold experts, factorization report, (input range, mid range))."""
    setting, bits_list = recipe.expert_weights, expert_bits_list(recipe)
    num_experts = loaded.gate_up.shape[0]
    moe_input = SiteStats.empty(routed.x.shape[1], routed.x.device)
    moe_input.add(routed.x)
    min_tokens, blend = recipe.experts.min_tokens, recipe.experts.fallback_blend
    fallback: list[int] = []
    input_low, input_high = float(routed.x.min()), float(routed.x.max())
    mid_low, mid_high = float("inf"), float("-inf")
    extra = export_spec(recipe, shapes)
    kquants = kquant_kinds(recipe, shapes)
    chunk = gptq_chunk_size(shapes, len(bits_list) + (extra is not None) + bool(kquants))
    escalated: dict[str, dict] = {}
    for start in range(0, num_experts, chunk):
        experts = list(range(start, min(start + chunk, num_experts)))
        gate_up, down = weights_of(experts)
        stats = expert_statistics(routed, experts, gate_up, loaded.act_fn)
        mid_low, mid_high = min(mid_low, stats.mid_low), max(mid_high, stats.mid_high)
        h_in, h_down = torch.empty_like(stats.gate_up), torch.empty_like(stats.down)
        for j, expert in enumerate(experts):
            n = stats.tokens[j]
            h_in[j], cold = blend_cold_hessian(stats.gate_up[j], n, moe_input.hessian, moe_input.tokens, min_tokens,
                                               blend)
            h_down[j] = stats.down[j] / max(n, 1)
            if cold:
                fallback.append(expert)
                sample_mid = expert_intermediate(moe_sample, gate_up[j], loaded.act_fn).float()
                h_layer_down = 2 * sample_mid.T @ sample_mid
                h_down[j], _ = blend_cold_hessian(stats.down[j], n, h_layer_down, moe_sample.shape[0], min_tokens,
                                                  blend)
        for projection, weight, hessian, channel_max in (("gate_up", gate_up, h_in, stats.input_abs_max),
                                                         ("down", down, h_down, stats.mid_abs_max)):
            kinds = kquants.get(projection, ())
            shared = expert_factor(hessian, setting, channel_max) if kinds and setting.method == "gptq" else None
            results, factor = quantize_expert_chunk(weight, hessian, setting, bits_list, channel_max, factor=shared)
            for bits, (codes, scale, zero) in results.items():
                bank.put(projection, bits, experts, codes, scale, zero)
            for kind in kinds:  # llama.cpp's K-quant grids, from the same Hessian and factor
                bank.put_blocks(projection, kind, experts, kquant_replicas(weight, hessian, shared, setting, kind))
            if extra is not None:  # the same Hessian, factorized the same way (deterministic), on the export grid
                export_setting = replace(setting, group_size=extra.group_size, symmetric=extra.symmetric)
                (codes, scale, zero), = quantize_expert_chunk(weight, hessian, export_setting, (extra.bits,),
                                                              channel_max)[0].values()
                bank.put(projection, extra.bits, experts, codes, scale, zero, export=True)
            for j, expert in enumerate(experts):  # record what the Cholesky factorization needed beyond the recipe
                if factor and (factor["float64"][j] or factor["damp"][j] > setting.damp):
                    escalated[f"{projection}.{expert}"] = {"damp": factor["damp"][j], "float64": factor["float64"][j]}
        del gate_up, down, stats, h_in, h_down
        if progress:
            progress("experts", experts[-1] + 1, num_experts)
    return fallback, escalated, ((input_low, input_high), (mid_low, mid_high))


def quantize_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict],
                   recipe: Recipe, weights_of, tensors: dict, bank_file: Path,
                   progress: Progress | None) -> tuple[dict, torch.Tensor | None]:
    """Pass B; returns the layer report and a sample of the MoE input (every 8th token; None on a dense layer),
    the inputs a never-routed expert is measured on."""
    layer = loaded.module
    with torch.no_grad(), capture_linears(quantized_linears(layer, adapter)) as stats:
        routed = run_layer(loaded, hidden, kwargs, None, experts=None)
    quantize_dense_linears(layer, adapter, stats, recipe, tensors)
    if routed is None:
        return {"dense": True}, None
    routing = RoutingStats.of(routed)
    tensors["router.counts"], tensors["router.score_sums"] = routing.counts, routing.score_sums
    tensors["router.topk"] = routing.topk
    moe_sample = routed.x[::MOE_SAMPLE_EVERY].float()
    fallback, escalated = quantize_routed_experts(loaded, routed, weights_of, recipe, tensors, moe_sample, bank_file,
                                                  progress)
    return {"fallback_experts": fallback, "factorization": escalated,
            "expert_tokens": tensors["experts.tokens"].tolist(), "tokens": int(routed.x.shape[0])}, moe_sample


# ------------------------------------------------------------------------------------------ applying a layer


@torch.no_grad()
def apply_dense_part(loaded: LoadedLayer, adapter: MoEAdapter, tensors: dict, recipe: Recipe, fold: bool) -> None:
    """Make the materialized layer's dense part compute as quantized: (fold the smoothing factors,) dequantized
    weights and activation fake quantization on every quantized linear."""
    layer = loaded.module
    if fold:
        fold_calibrated(layer, adapter, tensors)
    for name, module in quantized_linears(layer, adapter).items():
        weight = dequantize_packed(packed_matrix(tensors, f"linear.{name}", tuple(module.weight.shape),
                                                 recipe.weights.bits))
        module.weight.copy_(weight.to(module.weight.dtype))
        quantizer = act_quantizer(recipe.activations, tensors.get(f"act.{name}"))
        if quantizer is not None:
            loaded.hooks.append(attach_input_quant(module, quantizer))


def calibrated_experts(loaded: LoadedLayer, tensors: dict, recipe: Recipe, bits: int, device: torch.device,
                       folder: Path) -> ExpertCompute:
    """The layer's routed experts as calibrated: the replica at `bits` read chunk by chunk from the layer's bank file
    in `folder`, with the recipe's activation quantization."""
    _num, gate_up_shape, down_shape = loaded.shapes
    shapes = {"gate_up": gate_up_shape, "down": down_shape}

    def weights_of(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with open_bank(folder, loaded.index) as bank:
            return tuple(bank_weights(bank, p, bits, experts, shapes[p], torch.float32, device) for p in PROJECTIONS)

    setting = recipe.expert_activations
    return ExpertCompute(weights_of, act_quantizer(setting, tensors.get("act.experts.input")),
                         act_quantizer(setting, tensors.get("act.experts.mid")),
                         expert_chunk(gate_up_shape, down_shape, torch.float32))


# ------------------------------------------------------------------------------------------ pass C: loss table


def loss_sample(x: torch.Tensor, limit: int) -> torch.Tensor:
    """At most `limit` rows of x, evenly strided (calibration windows are in order, so a stride spans them all)."""
    return x[::-(-x.shape[0] // limit)] if x.shape[0] > limit else x


@torch.no_grad()
def loss_table(routed: RoutedTokens, weights_of, tensors: dict, bank, bits_list: tuple[int, ...],
               propagate_bits: int, quantizers: tuple, moe_sample: torch.Tensor, act_fn, chunk: int,
               loss_tokens: int, progress: Progress | None) -> torch.Tensor:
    """Fill tensors["loss_table"] [E, len(bits_list)] with the output MSE of each replica against the
    full-precision expert on (at most loss_tokens of) the tokens routed to it (002 §4.2), tensors["loss_table.skip"]
    [E] with the MSE of skipping the expert (output 0); return the experts' combined output [T, H] at the propagated
    width, computed on every routed token.

    Working set: a chunk of full-precision experts, one expert's replica at one width (read from the bank when
    needed, so a bank of five widths is never dequantized at once) and a bounded number of token rows."""
    num_experts = routed.num_experts
    sse = torch.zeros(num_experts, len(bits_list), dtype=torch.float64, device="cpu")
    skip_sse = torch.zeros(num_experts, dtype=torch.float64, device="cpu")
    tokens = torch.tensor([routed.count(e) for e in range(num_experts)], dtype=torch.long, device="cpu")
    measured = torch.zeros(num_experts, dtype=torch.long, device="cpu")  # rows each MSE is averaged over
    out = torch.zeros_like(routed.x)
    for start in range(0, num_experts, chunk):
        experts = list(range(start, min(start + chunk, num_experts)))
        fp_gate_up, fp_down = weights_of(experts)
        rows = max(1, LOSS_TABLE_BYTES // (4 * max(fp_gate_up.shape[1], fp_down.shape[1])))
        for j, expert in enumerate(experts):
            token, slot = routed.rows(expert)
            x = routed.x[token] if len(token) else moe_sample  # never routed: measure on the layer's sample
            measure = loss_sample(x, loss_tokens)
            measured[expert] = measure.shape[0]
            reference = torch.cat([expert_output(part, fp_gate_up[j], fp_down[j], act_fn)
                                   for part in measure.split(rows)])
            skip_sse[expert] = reference.pow(2).sum(dtype=torch.float64).cpu()
            for b, bits in enumerate(bits_list):
                gate_up = propagate_bank(bank, "gate_up", bits, [expert], fp_gate_up)[0]
                down = propagate_bank(bank, "down", bits, [expert], fp_down)[0]
                sse[expert, b] = sum((expert_output(part, gate_up, down, act_fn) - ref).pow(2).sum(dtype=torch.float64)
                                     for part, ref in zip(measure.split(rows), reference.split(rows), strict=True))
                if bits == propagate_bits and len(token):
                    for rows_of, slots, part in zip(token.split(rows), slot.split(rows), x.split(rows), strict=True):
                        y = quantized_expert_output(part, gate_up, down, act_fn, *quantizers)
                        out.index_add_(0, rows_of, (y * routed.weights[rows_of, slots, None]).to(out.dtype))
        del fp_gate_up, fp_down
        if progress:
            progress("loss table", experts[-1] + 1, num_experts)
    elements = measured.double() * routed.x.shape[1]
    tensors["loss_table"] = sse / elements[:, None]
    tensors["loss_table.skip"] = skip_sse / elements  # 004's "0 bits": the MSE of dropping the expert
    tensors["loss_table.tokens"] = tokens
    tensors["loss_table.bits"] = torch.tensor(bits_list, dtype=torch.int64, device="cpu")
    return out


def propagate_bank(bank, projection: str, bits: int, experts: list[int], like: torch.Tensor) -> torch.Tensor:
    return bank_weights(bank, projection, bits, experts, tuple(like.shape[1:]), like.dtype, like.device)


# ------------------------------------------------------------------------------------------ one layer, whole run


def calibrate_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict],
                    recipe: Recipe, index: int, device: torch.device, activation_limit: int | None,
                    folder: Path, progress: Progress | None) -> tuple[dict, dict, HiddenStore]:
    """Passes A-C of one layer (see the module docstring); the bank goes to `folder` (the calibration being written,
    which also takes spilled activations). Returns the layer's other tensors, its report and its outputs."""
    tensors: dict[str, torch.Tensor] = {}
    smoothing, expert_scale = smooth_layer(loaded, adapter, hidden, kwargs, recipe, recipe.calibration.seed + index,
                                           tensors)
    weights_of = compute_experts(loaded, expert_scale, device) if loaded.is_moe else None
    report, moe_sample = quantize_layer(loaded, adapter, hidden, kwargs, recipe, weights_of, tensors,
                                        bank_path(folder, index), progress)
    apply_dense_part(loaded, adapter, tensors, recipe, fold=False)
    outputs = HiddenStore(activation_limit, folder)
    routed = run_layer(loaded, hidden, kwargs, outputs, experts=None)
    if routed is not None:
        propagate = calibrated_experts(loaded, tensors, recipe, default_expert_bits(recipe), device, folder)
        widths = expert_bits_list(recipe)
        with open_bank(folder, index) as bank:
            experts_out = loss_table(routed, weights_of, tensors, bank, widths, default_expert_bits(recipe),
                                     (propagate.input_quant, propagate.mid_quant), moe_sample, loaded.act_fn,
                                     propagate.chunk, recipe.experts.loss_tokens, progress)
        add_expert_outputs(outputs, routed, experts_out)
    meta = {"layer": index, "smoothing": smoothing, "unsmoothed": unsmoothed_linears(loaded.module, adapter),
            **report}
    return tensors, meta, outputs


def add_expert_outputs(outputs: HiddenStore, routed: RoutedTokens, experts_out: torch.Tensor) -> None:
    """The layer's outputs with the experts stood in for by zeros, plus the experts' output (one batch at a time)."""
    for index, part in enumerate(routed.split(experts_out)):
        current = outputs[index]
        outputs[index] = current + part.reshape(current.shape)


def model_widths(streamed: StreamedModel) -> dict[str, int]:
    """Every quantized input width of the model, named, for the recipe's group-size check."""
    widths = {}
    for index in range(streamed.num_layers):
        shapes = streamed.expert_shapes(index)
        if shapes is not None:
            widths["expert intermediate size"] = shapes[2][1]
        for name, module in quantized_linears(streamed.layers[index], streamed.adapter).items():
            widths[f"{name.split('.', 1)[-1]} input"] = module.in_features
    return widths


def open_model(model_path: Path, device: torch.device) -> tuple[StreamedModel, object]:
    """(streamed model, tokenizer) of a local Hugging Face checkpoint folder."""
    from transformers import AutoConfig, AutoTokenizer

    from hexq.models import check_moe_folder

    check_moe_folder(model_path)
    checkpoint = Checkpoint(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HexqError(f"cannot load model from {model_path}: {str(exc).splitlines()[0]}") from None
    streamed = StreamedModel(config, checkpoint, device)
    check_moe_layers(streamed.adapter, config, [i for i in range(streamed.num_layers) if streamed.is_moe(i)])
    return streamed, tokenizer


def calibrate(model_path: str | Path, recipe: Recipe, data: str, out: str | Path, device: str | None = None,
              batch_size: int = 8, progress: Progress | None = None, activation_limit: int | None = None,
              force: bool = False) -> CalibrationSummary:
    """Calibrate `model_path` with `recipe` on `data` into the folder `out`.

    The work goes into the hidden sibling `.OUT.partial` (hexq.outputs.resumable_output_folder), one layer file at a
    time; a rerun after a kill resumes after the last finished layer, and the folder becomes OUT when the manifest
    is written. An existing OUT holding this very calibration is left as it is ("nothing to do"); any other
    non-empty OUT is replaced only with `force` and only if hexq wrote it. activation_limit: bytes of activations
    kept in memory per layer boundary (the rest spills to disk inside the partial folder)."""
    from hexq.devices import resolve_device
    from hexq.outputs import resumable_output_folder

    started = time.time()
    model_path, out = Path(model_path), Path(out)
    device = resolve_device(device)
    streamed, tokenizer = open_model(model_path, device)
    config = streamed.config
    validate_for_model(recipe, config.hidden_size, model_widths(streamed))
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context and recipe.calibration.seqlen > context:
        raise HexqError(f"calibration seqlen {recipe.calibration.seqlen} exceeds the model's context of {context}")
    cal = recipe.calibration
    windows = calibration_windows(tokenizer, data, cal.num_samples, cal.seqlen, cal.seed)
    fingerprint = {"model": model_fingerprint(model_path), "data": tensor_fingerprint(windows.ids),
                   "recipe": calibration_hash(recipe)}
    num_layers = streamed.num_layers
    if is_finished(out, fingerprint):
        return CalibrationSummary(out, num_layers, -1, 0, time.time() - started)
    inputs = [model_path] + ([Path(data)] if Path(data).exists() else [])
    with resumable_output_folder(out, kind="calibration", force=force, inputs=inputs) as work:
        done = layers_done(work.path, fingerprint) if work.resumed else 0
        if done is None:
            if not force:
                raise HexqError(f"{work.path} holds an unfinished calibration of a different "
                                f"{differing_inputs(work.path, fingerprint)}; pass --force to discard it and start "
                                "over, or pick another output folder")
            work.clear()
            done = 0
        write_progress(work.path, fingerprint, done, progress_files(work.path))
        manifest = run_layers(streamed, tokenizer, recipe, windows, work.path, fingerprint, done, device,
                              batch_size, activation_limit, progress)
        manifest["model"]["path"] = str(model_path.resolve())
        manifest["data"]["source"] = data
        write_sealed_json(work.path / "manifest.json", manifest)
    return CalibrationSummary(out, num_layers, done, manifest["fallback_experts"], time.time() - started)


def run_layers(streamed: StreamedModel, tokenizer, recipe: Recipe, windows, folder: Path, fingerprint: dict,
               done: int, device: torch.device, batch_size: int, activation_limit: int | None,
               progress: Progress | None) -> dict:
    """Calibrate layers done.. into `folder` (rebuilding layers ..done from their saved results); returns the
    manifest."""
    config, adapter, num_layers = streamed.config, streamed.adapter, streamed.num_layers
    cal = recipe.calibration
    for stale in folder.glob(".hexq-activations-*"):  # a killed run's spilled activations
        shutil.rmtree(stale, ignore_errors=True)
    hidden = HiddenStore(activation_limit, folder)
    kwargs = streamed.layer_inputs(windows.ids, batch_size, hidden)
    timings = read_json(folder / "timings.json") or {}
    files = {name: record for name, record in progress_files(folder).items()
             if int(name[len("layer_"):len("layer_") + 3]) < done}
    for index in range(num_layers):
        layer_started = time.time()
        with streamed.layer(index, experts=index >= done) as loaded:
            if index < done:  # resume: rebuild the quantized layer below from its saved results
                tensors, _ = load_layer(folder, index)
                apply_dense_part(loaded, adapter, tensors, recipe, fold=True)
                outputs = HiddenStore(activation_limit, folder)
                experts = (calibrated_experts(loaded, tensors, recipe, default_expert_bits(recipe), device, folder)
                           if loaded.is_moe else None)
                run_layer(loaded, hidden, kwargs, outputs, experts)
            else:
                tensors, meta, outputs = calibrate_layer(loaded, adapter, hidden, kwargs, recipe, index, device,
                                                         activation_limit, folder, progress)
                save_layer(folder, index, tensors, meta)
                files |= layer_file_records(folder, index)
                timings[f"layer_{index:03d}"] = round(time.time() - layer_started, 2)
                write_json_atomic(folder / "timings.json", timings)
                write_progress(folder, fingerprint, index + 1, files)
        hidden.close()
        hidden = outputs
        if progress:
            progress("layers", index + 1, num_layers)
    hidden.close()
    summaries = [layer_meta(folder, index) for index in range(num_layers)]
    num_experts = next(shape[0] for shape in streamed.moe_shapes if shape is not None)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "hexq_version": __version__, "fingerprint": fingerprint,
        "model": {"path": "", "model_type": config.model_type, "layers": num_layers,
                  "moe_layers": [index for index in range(num_layers) if streamed.is_moe(index)],
                  "num_experts": num_experts, "top_k": config.num_experts_per_tok},
        "data": {"source": "", "num_samples": cal.num_samples, "seqlen": cal.seqlen, "seed": cal.seed,
                 "tokens_available": windows.tokens_available},
        "recipe": recipe_to_dict(recipe),
        "expert_bits": list(expert_bits_list(recipe)),
        "fallback_experts": sum(len(meta.get("fallback_experts", [])) for meta in summaries),
        "layers": summaries,
        "files": dict(sorted(files.items())),
    }


def calibration_plan(calib_dir: Path, expert_bits: int | None) -> tuple[dict, Recipe, int]:
    """(manifest, recipe, expert width) of a finished calibration, after checking the source model is unchanged."""
    manifest = read_manifest(calib_dir)
    model_path = Path(manifest["model"]["path"])
    if not model_path.is_dir():
        raise HexqError(f"the source model of {calib_dir} is gone: {model_path}")
    if model_fingerprint(model_path) != manifest["fingerprint"]["model"]:
        raise HexqError(f"the model at {model_path} changed since {calib_dir} was calibrated (weights hash differs)")
    recipe = recipe_from_dict(manifest["recipe"])
    bits = default_expert_bits(recipe) if expert_bits is None else expert_bits
    if bits not in manifest["expert_bits"]:
        raise HexqError(f"{calib_dir} has expert replicas at {manifest['expert_bits']} bits, not {bits}")
    return manifest, recipe, bits


def calibrated_model(calib_dir: str | Path, device: torch.device, expert_bits: int | None = None):
    """(streamed source model, tokenizer, prepare): the calibration's quantized model, layer by layer (smoothing
    folded, dequantized dense weights with activation quantization, experts at `expert_bits`)."""
    calib_dir = Path(calib_dir)
    manifest, recipe, bits = calibration_plan(calib_dir, expert_bits)
    streamed, tokenizer = open_model(Path(manifest["model"]["path"]), device)

    def prepare(loaded: LoadedLayer) -> ExpertCompute | None:
        tensors, _ = load_layer(calib_dir, loaded.index)
        apply_dense_part(loaded, streamed.adapter, tensors, recipe, fold=True)
        return calibrated_experts(loaded, tensors, recipe, bits, device, calib_dir) if loaded.is_moe else None

    return streamed, tokenizer, prepare
