"""Pass A of calibration (hexq.calib.pipeline): each smoothing group's factor s chosen (003 §III.B.1, eq. 1-3: HAQ
grid search of e in s = max|X|^e, SmoothQuant's fixed alpha, or none) and folded into the layer (hexq.calib.fold)."""

from __future__ import annotations

import torch

from hexq.algos.smoothing import (
    SmoothingSearch,
    pick_exponent,
    search_exponent,
    search_exponent_routed,
    smoothquant_scales,
)
from hexq.base.hidden import HiddenStore
from hexq.calib.capture import (
    capture_norm_outputs,
)
from hexq.calib.fold import MOE_IN, fold_scales, smoothing_groups
from hexq.calib.quantize import default_expert_bits
from hexq.calib.ranks import SINGLE, Ranks
from hexq.config.recipe import Recipe
from hexq.model.adapters import MoEAdapter
from hexq.model.layer_pass import run_layer
from hexq.model.streaming import LoadedLayer

# Working memory for one chunk of experts' GPTQ (weights of every width stacked, Hessians and factors, float32).

# ------------------------------------------------------------------------------------------ pass A: smoothing


def smooth_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict], recipe: Recipe,
                 seed: int, tensors: dict, ranks: Ranks = SINGLE) -> tuple[dict, torch.Tensor | None]:
    """Choose and fold smoothing factors for the recipe's groups; returns the per-group report (every group of the
    layer: what was chosen, or why it was skipped) and the column scale the routed experts' gate_up must take (None
    when the MoE group is not smoothed or the layer is dense).

    Each group is scored with the setting its quantized readers get: the attention groups and a dense layer's MLP
    with `weights`/`activations`, a MoE layer's post-attention group with the experts' settings. The MoE group's HAQ
    objective (003 eq. 1) scores each routed expert on the tokens routed to it (the router's top-k of the same
    sampled tokens), the router and shared expert on all of them (`smoothing.moe_objective: routed`); `all` scores
    every expert on every token, as if each were routed everything. Across ranks each rank scores its own experts
    (`routed_search`)."""
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
                search = routed_search(loaded, routed, sample, picked, act_max, weights, quantized, recipe, ranks,
                                       common)
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


def routed_search(loaded: LoadedLayer, routed, sample: torch.Tensor, picked: torch.Tensor, act_max: torch.Tensor,
                  weights: list, quantized: list, recipe: Recipe, ranks: Ranks, common: dict) -> SmoothingSearch:
    """The routed HAQ search of the MoE group (search_exponent_routed). Across ranks, each rank reads and scores only
    its own experts (the ranges pass B uses: Ranks.expert_range of the same routing), rank 0 adds the router's and
    shared expert's error, and every rank sums the ranks' errors per exponent in rank order (the same choice on
    every rank, whatever their timing): a layer's expert weights are then never all in one process. The sum's
    grouping differs from one process's, so the chosen e can differ only where two exponents' errors tie within
    float64 rounding."""
    own = ranks.expert_range([routed.count(e) for e in range(loaded.shapes[0])])  # every expert in one process
    index = routed.index[picked.to(routed.index.device)]
    # other ranks' experts out of range (ignored by the search), this rank's counted from 0
    index = torch.where((index >= own.start) & (index < own.stop), index - own.start, -1)
    dense = list(zip(weights, quantized, strict=True)) if ranks.leader else []
    search = search_exponent_routed(sample, index, act_max, recipe.smoothing.grid_step, experts=loaded.share(own),
                                    dense=dense, **common)
    if not ranks.distributed:
        return search
    errors = [sum(column) for column in zip(*ranks.objects(search.errors), strict=True)]
    return pick_exponent(search.grid, errors, act_max)
