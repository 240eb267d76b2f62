"""Pass B of calibration (hexq.calib.pipeline): Hessians captured on the smoothed layer, then GPTQ (003 eq. 4-6) or
RTN for the dense quantized linears and, chunk by chunk, one replica per width for every routed expert from one
Hessian and one factorization (002 Alg. 1; with experts.down_fit replica the down projection per width,
hexq.calib.down_fit), written to the layer's bank file as soon as they exist."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hexq.algos.gptq import gptq_bank, gptq_replicas, stacked_ranges
from hexq.algos.hessian import HessianFactor, blend_cold_hessian, factorize_hessians
from hexq.algos.kquant import KQUANTS, SUPER, gptq_kquant, kquant_blocks, rtn_kquant
from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.algos.refit import refit_bank
from hexq.base.errors import HexqError
from hexq.base.hidden import HiddenStore
from hexq.calib.block_rounding import kept_widths, round_block
from hexq.calib.capture import (
    RoutingStats,
    SiteStats,
    capture_linears,
    expert_statistics,
    quantized_linears,
)
from hexq.calib.down_fit import FIT_BELOW, fitted_map, output_scale, replica_statistics
from hexq.calib.ranks import SINGLE, Ranks, expert_ranges
from hexq.calib.rounding import round_replicas
from hexq.calib.store import (
    ExpertBank,
    put_packed,
)
from hexq.config.recipe import Recipe, WeightQuant
from hexq.model.adapters import MoEAdapter
from hexq.model.layer_pass import run_layer
from hexq.model.simulate import (
    RoutedTokens,
    expert_intermediate,
)
from hexq.model.streaming import LoadedLayer
from hexq.packed.weight import PROJECTIONS

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(frozen=True)
class BankTuner:
    """What quantize_routed_experts needs from block rounding: the widths to hold in memory, and the call that tunes
    them (held {width: {projection: (codes, scale, zero)}}, cold experts) in place."""

    widths: set[int]
    tune: Callable[[dict, list[int]], None]
# Working memory for one chunk of experts' GPTQ (weights of every width stacked, Hessians and factors, float32).
GPTQ_CHUNK_BYTES = 1 << 30
MOE_SAMPLE_EVERY = 8  # every 8th MoE-input token: the layer-wide sample for cold experts' fallbacks


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
                            damp=setting.damp, act_order=setting.act_order, column_importance=importance,
                            fit_bits=setting.fit_bits, clip_bits=setting.clip_bits)
    out = refit_bank({bits: (r.codes[None], r.meta.scale[None], r.meta.zero[None]) for bits, r in results.items()},
                     weight.detach()[None], hessian[None],
                     torch.tensor([results[bits_list[0]].damp_used], device=hessian.device),
                     refit_specs(setting, results))
    return {bits: (codes[0], QuantMeta(scale[0], zero[0], results[bits].meta.group_size, bits))
            for bits, (codes, scale, zero) in out.items()}


def refit_specs(setting: WeightQuant, widths) -> dict[int, QuantSpec]:
    """The QuantSpecs of the widths (of `widths`) whose grids setting refits to GPTQ's codes (hexq.algos.refit)."""
    return {bits: setting.spec(bits) for bits in widths if bits in setting.refit_bits}


def quantize_expert_chunk(weights: torch.Tensor, hessians: torch.Tensor, setting: WeightQuant,
                          bits_list: tuple[int, ...], channel_max: torch.Tensor, budget: int | None = None,
                          factor: HessianFactor | None = None,
                          ) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict]:
    """Every width of a chunk of experts' weights [n, rows, cols] -> {bits: (codes [n, rows, cols], scale, zero)} and a
    report of the factorization (experts that needed more damping or float64).

    GPTQ (003 eq. 4-6): one factorization per expert for every width, every width and expert of the chunk in one
    column loop (hexq.algos.gptq.gptq_bank). GPTQ's rows are independent once the factor exists, so an expert too
    large for `budget` bytes of stacked widths is quantized in row blocks that give the same result. `factor`: the
    chunk's expert_factor when the caller made it already (to share it with the K-quant replicas)."""
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
    row_block = max(1, min(rows, budget // (4 * 3 * len(stacked_ranges(bits_list, setting.clip_bits)) * cols * n)))
    parts = [gptq_bank(weights[:, start:start + row_block], factor, bits_list, setting.spec(),
                       block_size=setting.block_size, fit_bits=setting.fit_bits, clip_bits=setting.clip_bits)
             for start in range(0, rows, row_block)]
    out = {bits: tuple(torch.cat([getattr(part[bits], name) for part in parts], dim=1)
                       for name in ("codes", "scale", "zero")) for bits in bits_list}
    out = refit_bank(out, weights, hessians, factor.damp_used, refit_specs(setting, out))
    report = {"damp": factor.damp_used.tolist(), "float64": factor.float64_used.tolist()}
    return out, report


def fitted_down(down: torch.Tensor, h_down: torch.Tensor, gate_up: torch.Tensor, gate_up_replicas: dict,
                routed: RoutedTokens, experts: list[int], warm: list[int], act_fn, setting: WeightQuant,
                channel_max: torch.Tensor, budget: int, weighted: bool = False) -> tuple[dict, dict]:
    """experts.down_fit "replica" (hexq.calib.down_fit): the down replicas of a chunk at the widths below FIT_BELOW
    quantized from the map fitted to the intermediate of the same width's gate_up replicas (gate_up_replicas {bits:
    (codes, scale, zero)}), on that intermediate's Hessian, each row's gain then refitted, on every routed token of
    each expert; the `warm` positions only, the cold experts (and the widths from FIT_BELOW up) from the
    full-precision target and h_down as with one Hessian; weighted: the tokens weighted by
    their squared routing weights (experts.token_weights "routing", down_fit.replica_statistics). Returns
    quantize_expert_chunk's ({bits: (codes, scale, zero)}, report), the report the most any width's factorization
    needed."""
    fitted = tuple(b for b in gate_up_replicas if b < FIT_BELOW) if warm else ()
    rest = tuple(b for b in gate_up_replicas if b not in fitted)
    out, report = quantize_expert_chunk(down, h_down, setting, rest, channel_max, budget) if rest else ({}, {})
    report = {"damp": list(report.get("damp", [0.0] * len(experts))),
              "float64": list(report.get("float64", [False] * len(experts)))}

    def weights(bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize(codes, QuantMeta(scale, zero, codes.shape[-1] // scale.shape[-1], bits))

    if fitted:
        hessian, cross, tokens = replica_statistics(
            routed, experts, warm, gate_up, torch.stack([weights(b, *gate_up_replicas[b]) for b in fitted]), act_fn,
            weighted)
    for b, bits in enumerate(fitted):
        target, h = down.clone(), h_down.clone()
        target[warm] = fitted_map(down[warm], cross[b, warm], hessian[b, warm], tokens[warm])
        h[warm] = hessian[b, warm]
        result, factored = quantize_expert_chunk(target, h, setting, (bits,), channel_max, budget)
        codes, scale, zero = result[bits]
        gain = output_scale(down[warm], weights(bits, codes[warm], scale[warm], zero[warm]), cross[b, warm],
                            hessian[b, warm])
        scale[warm] *= gain[..., None].to(scale.dtype)
        out[bits] = (codes, scale, zero)
        for j in range(len(experts)) if factored else ():
            report["damp"][j] = max(report["damp"][j], factored["damp"][j])
            report["float64"][j] = report["float64"][j] or factored["float64"][j]
    return {bits: out[bits] for bits in gate_up_replicas}, report


def expert_factor(hessians: torch.Tensor, setting: WeightQuant, channel_max: torch.Tensor) -> HessianFactor:
    """The HessianFactor of a chunk of experts (shared by every width and export grid made from it)."""
    importance = channel_max if setting.act_order == "max_activation" else None
    return factorize_hessians(hessians, damp=setting.damp, act_order=setting.act_order, column_importance=importance)


def gptq_chunk_bytes(device: torch.device, sharing: int = 1) -> int:
    """Working memory for one chunk of experts' GPTQ: GPTQ_CHUNK_BYTES on the CPU, split between the `sharing` ranks
    of one machine (it bounds calibration's peak RSS, and ranks on one machine share its memory); on a GPU a quarter
    of its free memory, at least GPTQ_CHUNK_BYTES: the column loop's launches, not its arithmetic, bound a GPU
    calibration, so a layer's experts should go through it in one or two chunks, not dozens."""
    if device.type != "cuda":
        return GPTQ_CHUNK_BYTES // max(1, sharing)
    free, _total = torch.cuda.mem_get_info(device)
    return max(GPTQ_CHUNK_BYTES, free // 4)


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


def kquant_kinds(recipe: Recipe, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    """{projection: K-quants} of the GGUF replicas `experts.export_target: gguf` asks the bank to hold ({}
    otherwise): llama.cpp's Q2_K and Q3_K grids for every projection whose rows are a multiple of 256 weights (the
    others get none, and `hexq export --format gguf` gives their layers the 4-bit type)."""
    if recipe.experts.mode != "replicas" or recipe.experts.export_target != "gguf":
        return {}
    return {p: tuple(KQUANTS) for p, (_rows, cols) in shapes.items() if cols % SUPER == 0}


def kquant_replicas(weights: torch.Tensor, hessians: torch.Tensor, factor: HessianFactor | None,
                    setting: WeightQuant, kind: str) -> torch.Tensor:
    """The `kind` replicas of a chunk of experts' weights [n, rows, cols] as GGML blocks [n, rows * row_bytes]:
    GPTQ on the K-quant grid with the bank's factor (round-to-nearest on that grid for an RTN recipe), the Hessian
    diagonal weighting the sub-block fits (hexq.algos.kquant)."""
    importance = torch.diagonal(hessians, dim1=1, dim2=2)
    if setting.method == "rtn" or factor is None:
        result = rtn_kquant(weights, importance, kind)
    else:
        result = gptq_kquant(weights, factor, importance, kind, setting.block_size)
    return kquant_blocks(result).cpu()


# ------------------------------------------------------------------------------------------ pass B: quantization


def compute_experts(loaded: LoadedLayer, expert_scale: torch.Tensor | None, device: torch.device):
    """weights_of for the layer's full-precision experts: a chunk upcast to float32, gate_up's columns multiplied by
    the MoE group's smoothing factor (eq. 1's W s, in float32 like the dense readers)."""

    def weights_of(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = loaded.experts_of(experts)
        gate_up = gate_up.to(device=device, dtype=torch.float32)
        if expert_scale is not None:
            gate_up = gate_up * expert_scale.to(device)
        return gate_up, down.to(device=device, dtype=torch.float32)

    return weights_of


def quantize_dense_linears(layer: torch.nn.Module, adapter: MoEAdapter, stats: dict[str, SiteStats],
                           recipe: Recipe, tensors: dict) -> dict[str, tuple[torch.Tensor, QuantMeta]]:
    """GPTQ (or RTN) of every quantized linear outside the routed experts into `tensors`; returns {name: (codes,
    meta)}, what block rounding starts from."""
    results = {}
    for name, module in quantized_linears(layer, adapter).items():
        site = stats[name]
        (results[name],) = quantize_bank(module.weight, site.hessian, recipe.weights, (recipe.weights.bits,),
                                         site.abs_max).values()
        put_packed(tensors, f"linear.{name}", *results[name])
        tensors[f"act.{name}"] = torch.tensor([site.low, site.high], device="cpu")
    return results


def quantize_routed_experts(loaded: LoadedLayer, routed: RoutedTokens, weights_of, recipe: Recipe, tensors: dict,
                            moe_sample: torch.Tensor, bank_file: Path, progress: Progress | None,
                            ranks: Ranks = SINGLE, tune: BankTuner | None = None) -> tuple[list[int], dict]:
    """Replica banks for every routed expert, chunk by chunk, written to `bank_file` as they are made; returns the
    experts that used the cold fallback and the factorizations that needed more damping or float64. Across ranks,
    each rank quantizes its own experts (Ranks.expert_range) into its rows of the one bank file rank 0 created and
    publishes once every rank has written. tune (block rounding, one process only): given the held widths'
    replicas of every expert and the cold experts, updates them in place before they are written again."""
    setting, bits_list = recipe.expert_weights, expert_bits_list(recipe)
    num_experts, gate_up_shape, down_shape = loaded.shapes
    shapes = {"gate_up": gate_up_shape, "down": down_shape}
    groups = {p: group_size_of(setting, cols) for p, (_rows, cols) in shapes.items()}
    extra = export_spec(recipe, shapes)
    ranges = expert_ranges([routed.count(e) for e in range(num_experts)], ranks.world)
    own = ranges[ranks.rank]
    if ranks.distributed and loaded.read != own:  # this rank's experts alone (smoothing read the same share,
        loaded.read_experts(own)  # unless its routing, before the scales were folded, cut the ranges elsewhere)

    def open_bank(attach=None) -> ExpertBank:
        return ExpertBank(bank_file, num_experts, shapes, bits_list, groups,
                          export=None if extra is None else (extra.bits, extra.group_size),
                          kquants=kquant_kinds(recipe, shapes), attach=attach)

    bank = open_bank() if ranks.leader else None
    temporary = ranks.broadcast(bank.writer.temporary if bank is not None else None)
    try:
        bank = bank or open_bank(temporary)
        keep = tune.widths if tune is not None else set()
        budget = gptq_chunk_bytes(routed.x.device, ranks.local_world)
        *found, held = fill_bank(bank, loaded, routed, weights_of, recipe, moe_sample, shapes, progress, own, keep,
                                 budget)
        if tune is not None:
            tune.tune(held, found[0])
            for bits in recipe.experts.round_bits:
                for projection, (codes, scale, zero) in held[bits].items():
                    bank.put(projection, bits, list(own), codes, scale, zero)
        if not ranks.leader:
            bank.close()  # flushed; rank 0 publishes
        ranks.barrier("writing the replica bank")
        if ranks.leader:
            for other in ranges[1:]:
                bank.accept_rows_of(other)
            bank.close()
    except BaseException:
        bank.abort()
        raise
    fallback, escalated, mid = [], {}, []
    for rank_fallback, rank_escalated, rank_mid in ranks.objects(found):
        fallback += rank_fallback
        escalated |= rank_escalated
        mid.append(rank_mid)
    input_low, input_high = float(routed.x.min()), float(routed.x.max())
    mid_low, mid_high = min(m[0] for m in mid), max(m[1] for m in mid)
    tensors["experts.tokens"] = torch.tensor([routed.count(e) for e in range(num_experts)], dtype=torch.long,
                                             device="cpu")
    tensors["act.experts.input"] = torch.tensor([input_low, input_high], device="cpu")
    tensors["act.experts.mid"] = torch.tensor([mid_low, mid_high], device="cpu")
    return fallback, escalated


def fill_bank(bank: ExpertBank, loaded: LoadedLayer, routed: RoutedTokens, weights_of, recipe: Recipe,
              moe_sample: torch.Tensor, shapes: dict, progress: Progress | None, own: range, keep: set[int],
              budget: int):
    """The GPTQ loop of quantize_routed_experts over the experts `own`: (cold experts, factorization report, the
    experts' intermediate range (low, high), {width: {projection: (codes, scale, zero) [experts, ...]}} of the widths
    in `keep`). With `keep` (block rounding), the round_bits replicas are left for the caller to write. budget: bytes
    of one GPTQ chunk (gptq_chunk_bytes)."""
    setting, bits_list = recipe.expert_weights, expert_bits_list(recipe)
    weighted = recipe.experts.routing_weighted
    moe_input = SiteStats.empty(routed.x.shape[1], routed.x.device)
    moe_input.add(routed.x)
    min_tokens, blend = recipe.experts.min_tokens, recipe.experts.fallback_blend
    fallback: list[int] = []
    mid_low, mid_high = float("inf"), float("-inf")
    extra = export_spec(recipe, shapes)
    kquants = kquant_kinds(recipe, shapes)
    stacked = len(stacked_ranges(bits_list, setting.clip_bits))
    chunk = gptq_chunk_size(shapes, stacked + (extra is not None) + bool(kquants), budget)
    escalated: dict[str, dict] = {}
    kept = {bits: {} for bits in keep}
    deferred = set(recipe.experts.round_bits) if keep else set()  # written once block rounding has tuned them
    for start in range(own.start, own.stop, chunk):
        experts = list(range(start, min(start + chunk, own.stop)))
        gate_up, down = weights_of(experts)
        stats = expert_statistics(routed, experts, gate_up, loaded.act_fn, weighted)
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
        replicas = {}
        warm = [j for j, expert in enumerate(experts) if expert not in fallback]
        for projection, weight, hessian, channel_max in (("gate_up", gate_up, h_in, stats.input_abs_max),
                                                         ("down", down, h_down, stats.mid_abs_max)):
            kinds = kquants.get(projection, ())
            shared = expert_factor(hessian, setting, channel_max) if kinds and setting.method == "gptq" else None
            if projection == "down" and recipe.experts.down_fit == "replica":
                replicas[projection], factor = fitted_down(weight, hessian, gate_up, replicas["gate_up"], routed,
                                                           experts, warm, loaded.act_fn, setting, channel_max, budget,
                                                           weighted)
            else:
                replicas[projection], factor = quantize_expert_chunk(weight, hessian, setting, bits_list, channel_max,
                                                                     budget, shared)
            for kind in kinds:  # llama.cpp's K-quant grids, from the same Hessian and factor
                bank.put_blocks(projection, kind, experts, kquant_replicas(weight, hessian, shared, setting, kind))
            if extra is not None:  # the same Hessian, factorized the same way (deterministic), on the export grid
                export_setting = replace(setting, group_size=extra.group_size, symmetric=extra.symmetric)
                (codes, scale, zero), = quantize_expert_chunk(weight, hessian, export_setting, (extra.bits,),
                                                              channel_max, budget)[0].values()
                bank.put(projection, extra.bits, experts, codes, scale, zero, export=True)
            for j, expert in enumerate(experts):  # record what the Cholesky factorization needed beyond the recipe
                if factor and (factor["float64"][j] or factor["damp"][j] > setting.damp):
                    escalated[f"{projection}.{expert}"] = {"damp": factor["damp"][j], "float64": factor["float64"][j]}
        for bits in recipe.experts.round_bits if recipe.experts.round_scope == "expert" else ():
            round_replicas(replicas, bits, routed, [experts[j] for j in warm], warm, gate_up, down, loaded.act_fn,
                           recipe.experts)
        for bits in kept:  # held for block rounding, which needs every expert of the layer at once
            for projection in PROJECTIONS:
                kept[bits].setdefault(projection, []).append(replicas[projection][bits])
        for projection, results in replicas.items():
            for bits, (codes, scale, zero) in results.items():
                if bits not in deferred:
                    bank.put(projection, bits, experts, codes, scale, zero)
        del gate_up, down, stats, h_in, h_down, replicas
        if progress:
            progress("experts", experts[-1] + 1 - own.start, len(own))
    held = {bits: {p: tuple(torch.cat(parts, dim=0) for parts in zip(*chunks, strict=True))
                   for p, chunks in by_projection.items()} for bits, by_projection in kept.items()}
    return fallback, escalated, (mid_low, mid_high), held


def quantize_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict],
                   recipe: Recipe, weights_of, tensors: dict, bank_file: Path,
                   progress: Progress | None, ranks: Ranks = SINGLE,
                   targets: HiddenStore | None = None) -> tuple[dict, torch.Tensor | None]:
    """Pass B; returns the layer report and a sample of the MoE input (every 8th token; None on a dense layer),
    the inputs a never-routed expert is measured on. targets: the full-precision model's outputs of the layer
    (hexq.calib.block_rounding.model_outputs), given with experts.round_scope block."""
    layer = loaded.module
    with torch.no_grad(), capture_linears(quantized_linears(layer, adapter)) as stats:
        routed = run_layer(loaded, hidden, kwargs, None, experts=None)
    dense = quantize_dense_linears(layer, adapter, stats, recipe, tensors)
    block = recipe.experts.round_scope == "block"
    if block and ranks.distributed:
        raise HexqError("experts.round_scope block tunes a whole layer in one process; run it without torchrun")
    rounding: dict = {}

    def tune(held: dict, cold: list[int]) -> None:
        started = time.perf_counter()
        propagate = default_expert_bits(recipe) if routed is not None else None
        rounding["widths"] = round_block(loaded, hidden, kwargs, weights_of, recipe, dense, held, cold, propagate,
                                         targets)
        rounding["seconds"] = round(time.perf_counter() - started, 2)
        for name, result in dense.items():
            put_packed(tensors, f"linear.{name}", *result)

    if routed is None:
        if block:
            tune({}, [])
        return {"dense": True, **({"block_rounding": rounding} if rounding else {})}, None
    routing = RoutingStats.of(routed)
    tensors["router.counts"], tensors["router.score_sums"] = routing.counts, routing.score_sums
    tensors["router.topk"] = routing.topk
    moe_sample = routed.x[::MOE_SAMPLE_EVERY].float()
    tuner = BankTuner(kept_widths(recipe, default_expert_bits(recipe)), tune) if block else None
    fallback, escalated = quantize_routed_experts(loaded, routed, weights_of, recipe, tensors, moe_sample, bank_file,
                                                  progress, ranks, tuner)
    return {"fallback_experts": fallback, "factorization": escalated,
            "expert_tokens": tensors["experts.tokens"].tolist(), "tokens": int(routed.x.shape[0]),
            **({"block_rounding": rounding} if rounding else {})}, moe_sample
