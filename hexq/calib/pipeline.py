"""`hexq calibrate`: calibration windows through an MoE model layer by layer (the GPTQ schedule: layer l is
calibrated on the outputs of the already-quantized layers below it; only one layer's activations are held).

Per layer, three passes over the calibration windows:
  A. smoothing (003 §III.B.1, eq. 1-3): collect the two norms' outputs, choose s per smoothing group (HAQ grid
     search of e in s = max|X|^e, SmoothQuant's fixed alpha, or none) and fold s into the norm and its readers;
  B. capture on the smoothed layer: Hessians of every quantized linear's input, per-expert Hessians from the tokens
     routed to each expert, router statistics; then GPTQ (eq. 4-6) or RTN for attention / shared-expert linears
     and, for every routed expert, one replica per bit width from one Hessian and one Cholesky factor (002 Alg. 1);
  C. the quantized layer (dequantized weights + activation fake quantization, experts at `propagate_bits`)
     produces the next layer's inputs, while a hook measures the loss table L(l, e, b): MSE between each replica's
     expert output and the full-precision expert output on the tokens routed to that expert (002 §4.2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq import __version__
from hexq.adapters import MoEAdapter
from hexq.algos.gptq import gptq_replicas
from hexq.algos.hessian import blend_cold_hessian
from hexq.algos.quant import QuantMeta, dequantize, quantize
from hexq.algos.smoothing import search_exponent, smoothquant_scales
from hexq.calib.capture import ExpertStats, capture_layer, capture_norm_outputs, quantized_linears
from hexq.calib.layer_io import LayerBatch, layer_inputs, run_layer
from hexq.calib.smooth import ATTN_IN, MOE_IN, fold_scales, smoothing_groups
from hexq.calib.store import (
    FORMAT,
    FORMAT_VERSION,
    check_output_folder,
    load_layer,
    model_fingerprint,
    read_manifest,
    save_layer,
    tensor_fingerprint,
    write_progress,
)
from hexq.data import calibration_windows
from hexq.errors import HexqError
from hexq.io import write_json_atomic
from hexq.models import load_model
from hexq.recipe import (
    Recipe,
    WeightQuant,
    calibration_hash,
    recipe_from_dict,
    recipe_to_dict,
    validate_for_model,
)
from hexq.simulate import (
    SimulatedExperts,
    act_quantizer,
    attach_input_quant,
    expert_intermediate,
    expert_output,
)

GROUP_OF_SECTION = {"attention": ATTN_IN, "moe": MOE_IN}
Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(frozen=True)
class CalibrationSummary:
    out: Path
    layers: int
    resumed_from: int  # layers found finished at start (-1: the run was already complete)
    fallback_experts: int
    seconds: float


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


def put_quantized(tensors: dict, prefix: str, codes: torch.Tensor, meta: QuantMeta) -> None:
    tensors[f"{prefix}.codes"] = codes
    tensors[f"{prefix}.scale"] = meta.scale.float()
    tensors[f"{prefix}.zero"] = meta.zero.float()


def get_dequantized(tensors: dict, prefix: str, bits: int) -> torch.Tensor:
    codes, scale = tensors[f"{prefix}.codes"], tensors[f"{prefix}.scale"]
    group = codes.shape[-1] // scale.shape[-1]
    if codes.ndim == 3:  # a fused expert tensor [E, out, in]
        return torch.stack([dequantize(c, QuantMeta(s, z, group, bits))
                            for c, s, z in zip(codes, scale, tensors[f"{prefix}.zero"], strict=True)])
    return dequantize(codes, QuantMeta(scale, tensors[f"{prefix}.zero"], group, bits))


def expert_bits_list(recipe: Recipe) -> tuple[int, ...]:
    if recipe.experts.mode == "replicas":
        return recipe.experts.replica_bits
    return (recipe.expert_weights.bits,)


def default_expert_bits(recipe: Recipe) -> int:
    return recipe.experts.propagate_bits if recipe.experts.mode == "replicas" else recipe.expert_weights.bits


# ------------------------------------------------------------------------------------------ pass A: smoothing


def smooth_layer(layer, adapter: MoEAdapter, batches: list[LayerBatch], recipe: Recipe, seed: int,
                 tensors: dict) -> dict:
    """Choose and fold smoothing factors for the recipe's groups; returns the per-group report."""
    groups = {group.name: group for group in smoothing_groups(layer, adapter)}
    for group in groups.values():
        tensors[f"smooth.{group.name}"] = torch.ones(group.channels)
    method = recipe.smoothing.method
    if method == "none":
        return {}
    selected = [GROUP_OF_SECTION[section] for section in recipe.smoothing.groups]
    with capture_norm_outputs({name: groups[name].norm for name in selected}) as outputs:
        run_layer(layer, batches)
    report = {}
    generator = torch.Generator().manual_seed(seed)
    for name in selected:
        group, x = groups[name], torch.cat(outputs[name])
        act_max = x.abs().amax(dim=0)
        median = float(act_max.median().clamp(min=1e-12))
        entry = {"method": method, "act_max_over_median": round(float(act_max.max()) / median, 3)}
        w_setting, a_setting = ((recipe.weights, recipe.activations) if name == ATTN_IN
                                else (recipe.expert_weights, recipe.expert_activations))
        if method == "smoothquant":
            s = smoothquant_scales(act_max, group.weights(), recipe.smoothing.alpha)
            entry["alpha"] = recipe.smoothing.alpha
        elif not a_setting.enabled:
            entry["skipped"] = "activations of this group are not quantized: the W8A8 objective has nothing to fix"
            continue
        else:
            sample = x[torch.randperm(x.shape[0], generator=generator)[: recipe.smoothing.max_tokens]]
            bits = default_expert_bits(recipe) if name == MOE_IN else None
            search = search_exponent(group.weights(), sample, act_max, recipe.smoothing.grid_step,
                                     w_spec=w_setting.spec(bits), a_bits=a_setting.bits,
                                     a_symmetric=a_setting.symmetric, quantize_weights=group.quantized())
            s = search.scales
            entry.update(exponent=search.exponent, error=search.error, error_without_smoothing=search.baseline_error)
        fold_scales(group, s)
        tensors[f"smooth.{name}"] = s.float()
        report[name] = entry
    return report


# ------------------------------------------------------------------------------------------ pass B: quantization


def down_hessian_fallback(sample: torch.Tensor, gate_up: torch.Tensor, act_fn) -> torch.Tensor:
    """Layer-wide Hessian of one expert's down input: the MoE-input sample pushed through that expert's gate/up."""
    mid = expert_intermediate(sample, gate_up, act_fn).double()
    return 2 * mid.T @ mid


def quantize_experts(experts, stats: ExpertStats, moe_input, moe_sample: torch.Tensor, recipe: Recipe,
                     tensors: dict) -> list[int]:
    """Replica banks for every routed expert; returns the experts that used the cold-expert fallback."""
    setting, bits_list = recipe.expert_weights, expert_bits_list(recipe)
    banks: dict[str, dict[int, list]] = {"gate_up": {b: [] for b in bits_list}, "down": {b: [] for b in bits_list}}
    fallback = []
    min_tokens, blend = recipe.experts.min_tokens, recipe.experts.fallback_blend
    for expert in range(experts.gate_up_proj.shape[0]):
        n = int(stats.tokens[expert])
        gate_up, down = experts.gate_up_proj[expert].detach(), experts.down_proj[expert].detach()
        h_in, cold = blend_cold_hessian(stats.gate_up[expert], n, moe_input.hessian, moe_input.tokens,
                                        min_tokens, blend)
        h_down = stats.down[expert] / max(n, 1)
        if cold:
            fallback.append(expert)
            h_layer_down = down_hessian_fallback(moe_sample, gate_up, experts.act_fn)
            h_down, _ = blend_cold_hessian(stats.down[expert], n, h_layer_down, moe_sample.shape[0], min_tokens, blend)
        for part, weight, hessian, channel_max in (("gate_up", gate_up, h_in, stats.input_abs_max[expert]),
                                                   ("down", down, h_down, stats.mid_abs_max[expert])):
            for bits, result in quantize_bank(weight, hessian, setting, bits_list, channel_max).items():
                banks[part][bits].append(result)
    for part, by_bits in banks.items():
        for bits, results in by_bits.items():
            prefix = f"experts.{part}.b{bits}"
            tensors[f"{prefix}.codes"] = torch.stack([codes for codes, _ in results])
            tensors[f"{prefix}.scale"] = torch.stack([meta.scale.float() for _, meta in results])
            tensors[f"{prefix}.zero"] = torch.stack([meta.zero.float() for _, meta in results])
    tensors["experts.tokens"] = stats.tokens.clone()
    tensors["act.experts.input"] = torch.tensor([stats.input_low, stats.input_high])
    tensors["act.experts.mid"] = torch.tensor([stats.mid_low, stats.mid_high])
    return fallback


def quantize_layer(layer, adapter: MoEAdapter, batches: list[LayerBatch], recipe: Recipe,
                   tensors: dict) -> tuple[dict, torch.Tensor]:
    """Pass B; returns the layer report and a token sample of the MoE input (every 8th token)."""
    with torch.no_grad(), capture_layer(layer, adapter) as capture:
        run_layer(layer, batches)
    for name, module in quantized_linears(layer, adapter).items():
        stats = capture.linears[name]
        (result,) = quantize_bank(module.weight, stats.hessian, recipe.weights, (recipe.weights.bits,),
                                  stats.abs_max).values()
        put_quantized(tensors, f"linear.{name}", *result)
        tensors[f"act.{name}"] = torch.tensor([stats.low, stats.high])
    experts = getattr(getattr(layer, adapter.moe), adapter.experts)
    moe_sample = torch.cat(capture.moe_sample)
    fallback = quantize_experts(experts, capture.experts, capture.moe_input, moe_sample, recipe, tensors)
    tensors["router.counts"] = capture.router_counts
    tensors["router.score_sums"] = capture.router_score_sums
    tensors["router.topk"] = torch.cat(capture.router_topk)
    report = {"fallback_experts": fallback, "expert_tokens": capture.experts.tokens.tolist(),
              "tokens": int(capture.moe_input.tokens)}
    return report, moe_sample


# ------------------------------------------------------------------------------------------ applying a layer


@torch.no_grad()
def apply_layer(layer, adapter: MoEAdapter, tensors: dict, recipe: Recipe, expert_bits: int,
                fold: bool) -> None:
    """Make `layer` compute as quantized: (fold the smoothing factors,) dequantized weights, activation fake
    quantization, and routed experts at `expert_bits` through SimulatedExperts."""
    if fold:
        for group in smoothing_groups(layer, adapter):
            fold_scales(group, tensors[f"smooth.{group.name}"])
    for name, module in quantized_linears(layer, adapter).items():
        module.weight.copy_(get_dequantized(tensors, f"linear.{name}", recipe.weights.bits).to(module.weight.dtype))
        quantizer = act_quantizer(recipe.activations, tensors.get(f"act.{name}"))
        if quantizer is not None:
            attach_input_quant(module, quantizer)
    moe = getattr(layer, adapter.moe)
    experts = getattr(moe, adapter.experts)
    dtype = experts.gate_up_proj.dtype
    setattr(moe, adapter.experts, SimulatedExperts(
        get_dequantized(tensors, f"experts.gate_up.b{expert_bits}", expert_bits).to(dtype),
        get_dequantized(tensors, f"experts.down.b{expert_bits}", expert_bits).to(dtype),
        experts.act_fn,
        act_quantizer(recipe.expert_activations, tensors.get("act.experts.input")),
        act_quantizer(recipe.expert_activations, tensors.get("act.experts.mid")),
    ))


# ------------------------------------------------------------------------------------------ pass C: loss table


@torch.no_grad()
def propagate_with_loss_table(layer, adapter: MoEAdapter, batches: list[LayerBatch], fp_gate_up: torch.Tensor,
                              fp_down: torch.Tensor, tensors: dict, bits_list: tuple[int, ...],
                              moe_sample: torch.Tensor) -> list[LayerBatch]:
    """Run the quantized layer (next layer's inputs) and fill tensors["loss_table"] [E, len(bits_list)] with the
    output MSE of each replica against the full-precision expert on the tokens routed to it (002 §4.2), and
    tensors["loss_table.skip"] [E] with the MSE of skipping the expert (output 0)."""
    experts = getattr(getattr(layer, adapter.moe), adapter.experts)
    num_experts = fp_gate_up.shape[0]
    replicas = {b: (get_dequantized(tensors, f"experts.gate_up.b{b}", b),
                    get_dequantized(tensors, f"experts.down.b{b}", b)) for b in bits_list}
    sse = torch.zeros(num_experts, len(bits_list), dtype=torch.float64)
    skip_sse = torch.zeros(num_experts, dtype=torch.float64)  # the expert left out (0 bits): output 0
    tokens = torch.zeros(num_experts, dtype=torch.long)

    def add(expert: int, x: torch.Tensor, counts: bool) -> None:
        reference = expert_output(x, fp_gate_up[expert], fp_down[expert], experts.act_fn)
        for column, bits in enumerate(bits_list):
            gate_up, down = replicas[bits]
            diff = expert_output(x, gate_up[expert], down[expert], experts.act_fn) - reference
            sse[expert, column] += float(diff.double().pow(2).sum())
        skip_sse[expert] += float(reference.double().pow(2).sum())
        if counts:
            tokens[expert] += x.shape[0]

    def hook(_module, args):
        hidden, top_k_index = args[0], args[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        for expert in top_k_index.unique().tolist():
            if 0 <= expert < num_experts:
                add(expert, flat[torch.where(top_k_index == expert)[0]], counts=True)

    handle = experts.register_forward_pre_hook(hook)
    try:
        outputs = run_layer(layer, batches)
    finally:
        handle.remove()
    for expert in torch.where(tokens == 0)[0].tolist():  # never routed: measure on the layer's MoE-input sample
        add(expert, moe_sample, counts=False)
    elements = torch.where(tokens > 0, tokens, moe_sample.shape[0]).double() * fp_down.shape[1]
    tensors["loss_table"] = sse / elements[:, None]
    tensors["loss_table.skip"] = skip_sse / elements  # 004's "0 bits": the MSE of dropping the expert
    tensors["loss_table.tokens"] = tokens
    tensors["loss_table.bits"] = torch.tensor(bits_list, dtype=torch.int64)
    return outputs


# ------------------------------------------------------------------------------------------ one layer, whole run


def calibrate_layer(layer, adapter: MoEAdapter, batches: list[LayerBatch], recipe: Recipe,
                    index: int) -> tuple[dict, dict, list[LayerBatch]]:
    tensors: dict[str, torch.Tensor] = {}
    smoothing = smooth_layer(layer, adapter, batches, recipe, recipe.calibration.seed + index, tensors)
    experts = getattr(getattr(layer, adapter.moe), adapter.experts)
    fp_gate_up, fp_down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    quant_report, moe_sample = quantize_layer(layer, adapter, batches, recipe, tensors)
    apply_layer(layer, adapter, tensors, recipe, default_expert_bits(recipe), fold=False)
    outputs = propagate_with_loss_table(layer, adapter, batches, fp_gate_up, fp_down, tensors,
                                        expert_bits_list(recipe), moe_sample)
    meta = {"layer": index, "smoothing": smoothing, **quant_report}
    return tensors, meta, outputs


def intermediate_widths(model, adapter: MoEAdapter) -> dict[str, int]:
    layer = model.model.layers[0]
    widths = {"expert intermediate size": getattr(getattr(layer, adapter.moe), adapter.experts).down_proj.shape[2]}
    for name, module in quantized_linears(layer, adapter).items():
        widths[f"{name} input"] = module.in_features
    return widths


def calibrate(model_path: str | Path, recipe: Recipe, data: str, out: str | Path, device: str | None = None,
              batch_size: int = 8, progress: Progress | None = None) -> CalibrationSummary:
    """Calibrate `model_path` with `recipe` on `data` into the folder `out`; resumes an interrupted run."""
    started = time.time()
    model_path, out = Path(model_path), Path(out)
    model, tokenizer, adapter = load_model(model_path, device)
    config = model.config
    validate_for_model(recipe, config.hidden_size, intermediate_widths(model, adapter))
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context and recipe.calibration.seqlen > context:
        raise HexqError(f"calibration seqlen {recipe.calibration.seqlen} exceeds the model's context of {context}")
    cal = recipe.calibration
    windows = calibration_windows(tokenizer, data, cal.num_samples, cal.seqlen, cal.seed)
    fingerprint = {"model": model_fingerprint(model_path), "data": tensor_fingerprint(windows.ids),
                   "recipe": calibration_hash(recipe)}
    done = check_output_folder(out, fingerprint)
    layers = model.model.layers
    if done == -1:
        return CalibrationSummary(out, len(layers), -1, 0, time.time() - started)
    out.mkdir(parents=True, exist_ok=True)
    write_progress(out, fingerprint, done)
    batches = layer_inputs(model, windows.ids, batch_size)
    timings = {}
    for index in range(done):  # resume: rebuild the quantized layers below from their saved results
        tensors, _ = load_layer(out, index)
        apply_layer(layers[index], adapter, tensors, recipe, default_expert_bits(recipe), fold=True)
        batches = run_layer(layers[index], batches)
        if progress:
            progress("layers", index + 1, len(layers))
    for index in range(done, len(layers)):
        layer_started = time.time()
        tensors, meta, batches = calibrate_layer(layers[index], adapter, batches, recipe, index)
        save_layer(out, index, tensors, meta)
        write_progress(out, fingerprint, index + 1)
        timings[f"layer_{index:03d}"] = round(time.time() - layer_started, 2)
        if progress:
            progress("layers", index + 1, len(layers))
    summaries = [load_layer(out, index)[1] for index in range(len(layers))]
    fallback = sum(len(meta["fallback_experts"]) for meta in summaries)
    write_json_atomic(out / "timings.json", timings)
    write_json_atomic(out / "manifest.json", {
        "format": FORMAT, "format_version": FORMAT_VERSION, "hexq_version": __version__, "fingerprint": fingerprint,
        "model": {"path": str(model_path.resolve()), "model_type": config.model_type, "layers": len(layers),
                  "num_experts": getattr(config, adapter.num_experts_attr), "top_k": config.num_experts_per_tok},
        "data": {"source": data, "num_samples": cal.num_samples, "seqlen": cal.seqlen, "seed": cal.seed,
                 "tokens_available": windows.tokens_available},
        "recipe": recipe_to_dict(recipe),
        "expert_bits": list(expert_bits_list(recipe)),
        "fallback_experts": fallback,
        "layers": summaries,
    })
    return CalibrationSummary(out, len(layers), done, fallback, time.time() - started)


def load_calibrated(calib_dir: str | Path, device: str | None = None, expert_bits: int | None = None):
    """(model, tokenizer, manifest): the source model made to compute as the calibration's quantized model."""
    calib_dir = Path(calib_dir)
    manifest = read_manifest(calib_dir)
    model_path = Path(manifest["model"]["path"])
    if model_fingerprint(model_path) != manifest["fingerprint"]["model"]:
        raise HexqError(f"the model at {model_path} changed since {calib_dir} was calibrated (weights hash differs)")
    recipe = recipe_from_dict(manifest["recipe"])
    bits = default_expert_bits(recipe) if expert_bits is None else expert_bits
    if bits not in manifest["expert_bits"]:
        raise HexqError(f"{calib_dir} has expert replicas at {manifest['expert_bits']} bits, not {bits}")
    model, tokenizer, adapter = load_model(model_path, device)
    for index, layer in enumerate(model.model.layers):
        tensors, _ = load_layer(calib_dir, index)
        apply_layer(layer, adapter, tensors, recipe, bits, fold=True)
    return model, tokenizer, manifest
