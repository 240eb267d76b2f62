"""`experts.round_scope: block`: the rounding of a whole decoder layer's quantized matrices optimised against the
full-precision model's output on the calibration batches (hexq.algos.rounding.optimize_block_rounding: AutoRound's
signed-gradient rounding and scale tuning on GPTQ's grids), the calibration's side of it.

The objective is AutoRound's: the quantized layer on its own inputs (the outputs of the layers below as quantized,
what the layer will see when served) against the full-precision layer on the full-precision model's inputs
(`model_outputs`, a second activation stream the calibration carries beside the quantized one). A layer tuned so
also corrects what the layers below it got wrong, instead of reproducing the full-precision layer's answer to
inputs that are already off.

One tuning pass per expert width w in `experts.round_bits`, with every routed expert at its w replica, the dense
linears (attention, shared expert, a dense layer's MLP) at their recipe width and the router in full precision:
the pass tunes the experts' w replicas and, in the pass at the width the next layer is calibrated on
(`propagate_bits`), the dense linears too when they are weight-only (quantized activations would need their
quantizers inside the differentiated forward; their linears stay at GPTQ's rounding). Layer outputs are computed
without activation fake quantization. Cold experts (fewer than min_tokens routed tokens) keep GPTQ's rounding."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.func import functional_call

from hexq.algos.quant import QuantMeta, dequantize
from hexq.algos.rounding import BlockRounding, Replica, optimize_block_rounding
from hexq.base.hidden import HiddenStore
from hexq.config.recipe import Recipe
from hexq.model.layer_pass import ExpertCompute, expert_chunk, run_layer
from hexq.model.streaming import LoadedLayer
from hexq.packed.weight import PROJECTIONS

Replicas = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # projection -> (codes, scale, zero) [E, ...]


class RoutedExperts(torch.nn.Module):
    """Stands in for a layer's experts module (the ExpertTap's place and signature) with every routed expert
    computed from the weights in `gate_up` [E, 2I, H] and `down` [E, H, I], differentiably: the (token, slot)
    pairs grouped by expert into one padded batch [E, longest, H], one batched product per projection."""

    def __init__(self, act_fn) -> None:
        super().__init__()
        self.act_fn = act_fn
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x, (num_experts, _rows, width) = hidden_states.float(), self.gate_up.shape
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        keyed = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
        order = torch.argsort(keyed, stable=True)
        counts = torch.bincount(keyed, minlength=num_experts + 1)
        expert = keyed[order]
        order, expert = order[expert < num_experts], expert[expert < num_experts]
        slot = torch.arange(len(order), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
        token = order // k
        padded = x.new_zeros(num_experts, int(counts[:num_experts].max()), width)
        # index_select, not x[token]: a token appears once per routed slot, and the gradient of an indexing gather
        # with repeated indices is an accumulating index_put that adds with atomics across threads on CPU, in an
        # order that changes run to run (the tuned rounding then differs between runs); index_select's gradient
        # (index_add) adds in index order
        padded = padded.index_put((expert, slot), x.index_select(0, token))
        gate, up = (padded @ self.gate_up.mT).chunk(2, dim=-1)
        y = ((self.act_fn(gate) * up) @ self.down.mT)[expert, slot]
        weights = top_k_weights.reshape(-1)[order, None].float()
        return x.new_zeros(x.shape).index_add(0, token, y * weights).to(hidden_states.dtype)


@contextmanager
def experts_replaced(loaded: LoadedLayer, stand_in: torch.nn.Module):
    """The layer's ExpertTap swapped for `stand_in` while the block runs."""
    parent, name = next((module, child) for module in loaded.module.modules()
                        for child, sub in module.named_children() if sub is loaded.tap)
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, loaded.tap)


def dense_tunable(recipe: Recipe) -> bool:
    """Whether block rounding tunes the dense linears: only weight-only ones (see the module docstring)."""
    return recipe.activations.bits is None


def tuned_widths(recipe: Recipe, propagate: int | None) -> list[int | None]:
    """The tuning passes in order: the propagated width first when the dense linears are tuned there, then the other
    widths of round_bits; on a dense layer (propagate None) one pass when its linears are tuned, else none."""
    widths = list(recipe.experts.round_bits) if propagate is not None else []
    if propagate in widths or dense_tunable(recipe):
        widths = [propagate] + [w for w in widths if w != propagate]
    return widths


def kept_widths(recipe: Recipe, propagate: int) -> set[int]:
    """The expert widths round_block needs in memory: the ones it tunes and the one the dense linears are tuned with."""
    return {w for w in tuned_widths(recipe, propagate) if w is not None}


def model_outputs(loaded: LoadedLayer, reference: HiddenStore, kwargs: list[dict], weights_of) -> HiddenStore:
    """The full-precision model's outputs of this layer on every batch: the layer as read from the checkpoint (call it
    before smoothing folds anything into it, so that a resumed calibration computes the same numbers), the routed
    experts from weights_of (unsmoothed), on `reference`, the full-precision model's inputs to the layer; kept under
    the same memory limit and spill folder as `reference`."""
    outputs = HiddenStore(reference.limit, reference.parent)
    compute = None
    if loaded.is_moe:
        _num, gate_up_shape, down_shape = loaded.shapes
        compute = ExpertCompute(weights_of, chunk=expert_chunk(gate_up_shape, down_shape, torch.float32),
                                accumulate=torch.float32)
    run_layer(loaded, reference, kwargs, outputs, compute)
    return outputs


def round_block(loaded: LoadedLayer, hidden: HiddenStore, kwargs: list[dict], weights_of, recipe: Recipe,
                dense: dict[str, tuple[torch.Tensor, QuantMeta]], bank: dict[int, Replicas], cold: list[int],
                propagate: int | None, targets: HiddenStore) -> dict:
    """Tune the layer (module docstring) on its inputs `hidden` against `targets` (model_outputs): `dense` {linear
    name: (codes, meta)} and `bank` {width: replicas of every routed expert} are replaced by their tuned versions in
    place. Returns {width: {"before", "after"}} (the mean squared output error over every batch; width "dense" on a
    dense layer)."""
    widths = tuned_widths(recipe, propagate)
    if not widths:  # a dense layer whose linears are not weight-only: nothing to tune
        return {}
    device = next(loaded.module.parameters()).device
    stand_in = RoutedExperts(loaded.act_fn) if loaded.is_moe else None
    frozen = torch.zeros(loaded.shapes[0], dtype=torch.bool, device=device) if loaded.is_moe else None
    if frozen is not None and cold:
        frozen[cold] = True
    dense_names = list(dense)
    linears = {name: loaded.module.get_submodule(name) for name in dense_names}

    def objective(weights: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
        parameters = {f"{name}.weight": weights[name][0] for name in dense_names}
        if stand_in is not None:
            stand_in.gate_up, stand_in.down = weights["gate_up"], weights["down"]
        out = functional_call(loaded.module, parameters, (hidden[batch].to(device),), kwargs[batch])
        out = out[0] if isinstance(out, tuple) else out
        return (out.float() - targets[batch].to(device).float()).square().mean()

    report = {}
    steps = recipe.experts.round_steps
    context = experts_replaced(loaded, stand_in) if stand_in is not None else nullcontext()
    with context:
        for width in widths:
            tuned: dict[str, Replica] = {}
            qmax: dict[str, int] = {}
            if dense_tunable(recipe) and width == propagate:
                for name, (codes, meta) in dense.items():
                    tuned[name] = Replica(codes[None].to(device), meta.scale[None].to(device),
                                          meta.zero[None].to(device))
                    qmax[name] = 2 ** meta.bits - 1
            if stand_in is not None and width in recipe.experts.round_bits:
                for projection in PROJECTIONS:
                    tuned[projection] = Replica(*(t.to(device) for t in bank[width][projection]))
                    qmax[projection] = 2 ** width - 1
            if not tuned:
                continue
            full = {name: module.weight.detach()[None] for name, module in linears.items() if name in tuned}
            if "gate_up" in tuned:
                full["gate_up"], full["down"] = weights_of(list(range(loaded.shapes[0])))
            fixed = fixed_weights(dense, bank.get(width) if stand_in is not None else None, tuned, device)
            result = optimize_block_rounding(
                full, tuned, qmax, lambda weights, batch, fixed=fixed: objective(fixed | weights, batch), len(hidden),
                steps, {p: frozen for p in PROJECTIONS if p in tuned}, moving_zero(recipe, tuned, qmax))
            keep_tuned(result, dense, bank.get(width))
            report[str(width if width is not None else "dense")] = {"before": result.before, "after": result.after}
    return report


def moving_zero(recipe: Recipe, tuned: dict, qmax: dict[str, int]) -> frozenset[str]:
    """The tuned matrices on asymmetric grids of 2 bits or more, whose zero points may move
    (hexq.algos.rounding.tuned_grid)."""
    symmetric = {name: (recipe.expert_weights if name in PROJECTIONS else recipe.weights).symmetric
                 for name in tuned}
    return frozenset(name for name in tuned if not symmetric[name] and qmax[name] >= 3)


def fixed_weights(dense: dict, replicas: Replicas | None, tuned: dict, device) -> dict[str, torch.Tensor]:
    """The dequantized weights [1 or E, rows, cols] of every matrix the pass does not tune."""
    fixed = {name: dequantize(codes, meta)[None].to(device) for name, (codes, meta) in dense.items()
             if name not in tuned}
    for projection in PROJECTIONS if replicas is not None else ():
        if projection not in tuned:
            fixed[projection] = Replica(*replicas[projection]).weight().to(device)
    return fixed


def keep_tuned(result: BlockRounding, dense: dict, replicas: Replicas | None) -> None:
    for name, replica in result.replicas.items():
        if name in PROJECTIONS:
            replicas[name] = (replica.codes, replica.scale, replica.zero)
        else:
            meta = dense[name][1]
            dense[name] = (replica.codes[0], QuantMeta(replica.scale[0], replica.zero[0], meta.group_size, meta.bits))
