"""The quantized model as it computes: dequantized weights plus fake-quantized activations (shared by calibration
and the runtime).

Activation quantization is attached in two places only: a forward pre-hook on each quantized attention /
shared-expert linear (`attach_input_quant`), and `quantized_expert_output`, the one definition of a quantized
routed expert, which quantizes the expert's input and the down projection's input (the intermediate) per token or
with static per-tensor ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hexq.algos.quant import QuantSpec, fake_quantize_activations, grid_params, quantize_to_grid


def expert_intermediate(x: torch.Tensor, gate_up: torch.Tensor, act_fn) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) for one expert's fused gate_up [2I, H]: the down projection's input."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return act_fn(gate) * up


def expert_output(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> torch.Tensor:
    """One expert's gated MLP on x [n, H] -> [n, H]."""
    return torch.nn.functional.linear(expert_intermediate(x, gate_up, act_fn), down)


def quantized_expert_output(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn,
                            input_quant: ActQuantizer | None, mid_quant: ActQuantizer | None) -> torch.Tensor:
    """expert_output with the expert's input and the down projection's input fake-quantized when configured: the
    one definition of a quantized expert, shared by calibration, the streamed passes and the runtime."""
    if input_quant is not None:
        x = input_quant(x)
    mid = expert_intermediate(x, gate_up, act_fn)
    if mid_quant is not None:
        mid = mid_quant(mid)
    return torch.nn.functional.linear(mid, down)


@dataclass(frozen=True)
class ActQuantizer:
    """Fake quantization of activations: dynamic per token, or static per tensor from a calibrated range."""

    bits: int
    symmetric: bool
    dynamic: bool
    low: float = 0.0  # static range (calibration minimum / maximum of the input)
    high: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic:
            return fake_quantize_activations(x, self.bits, per_token=True, symmetric=self.symmetric)
        scale, zero = self.static_grid(x.device)
        return ((quantize_to_grid(x.float(), scale, zero, (1 << self.bits) - 1) - zero) * scale).to(x.dtype)

    def static_grid(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) [1] of the static range on `device` (grid_params of [low, high]). The range is made by fill
        kernels, not copied from host memory: a CUDA graph can capture it (hexq.runtime.graph)."""
        bounds = torch.full((1, 2), self.low, dtype=torch.float32, device=device)
        bounds[:, 1:].fill_(self.high)
        return grid_params(bounds, QuantSpec(bits=self.bits, symmetric=self.symmetric))


def renormalized_weights(top_k_weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Routing weights [T, k] when the slots where kept [T, k] is False are skipped (004's 0-bit experts): the
    skipped slots get 0 and the kept ones share the token's whole mass, w_j S / S_kept with S the token's summed
    weights and S_kept the kept ones'; a token with no kept slot gets zeros (its experts add nothing).

    Skipping expert e of token t is then the same as replacing e's output y_e by the kept experts' weighted mean
    sum_{j kept} w_j y_j / S_kept: the loss table measures the 0-bit entry that way."""
    weights = top_k_weights.masked_fill(~kept, 0)
    kept_mass = weights.sum(dim=-1, keepdim=True)
    total = top_k_weights.sum(dim=-1, keepdim=True)
    scale = torch.where(kept_mass > 0, total / kept_mass.masked_fill(kept_mass == 0, 1), torch.zeros_like(total))
    return weights * scale


def served_weights(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, kept: torch.Tensor,
                   num_experts: int) -> torch.Tensor:
    """The weights [T, k] a layer's routed outputs are summed with when the slots where kept [T, k] is False are
    skipped: the one rule `hexq eval` (routed_outputs) and `hexq run` (hexq.runtime) share. Slots the family itself
    dropped (an out-of-range id) weigh 0 and stay out of the renormalisation; a skipped slot's weight goes to the
    token's kept experts (renormalized_weights). Where nothing is skipped every weight is returned unchanged (the
    scale is S / S = 1 exactly). Elementwise on the routing's device: no host synchronisation."""
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    return renormalized_weights(top_k_weights.masked_fill(~valid, 0), valid & kept)


def skipped_output(total: torch.Tensor, token_mass: torch.Tensor, slot_weights: torch.Tensor, token: torch.Tensor,
                   slot: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What stands in for an expert's output y [n, H] on its routed (token, slot) pairs when it is skipped: the
    weighted mean of the token's other experts, (total_t - w y) / (S_t - w), from the full-precision combined output
    total [T, H], the tokens' routing mass S [T] and slot weights [T, k] (renormalized_weights); zero
    where the token has no other expert. No routed pair (a never-routed expert measured on a sample): zero."""
    if not len(token):
        return torch.zeros_like(y)
    w = slot_weights[token, slot]
    rest = token_mass[token] - w
    others = total[token] - w[:, None] * y
    return torch.where(rest[:, None] > 0, others / rest.masked_fill(rest <= 0, 1)[:, None], torch.zeros_like(y))


def act_quantizer(setting, low_high: torch.Tensor | None) -> ActQuantizer | None:
    """The ActQuantizer of a recipe's ActivationQuant setting (None when activations stay in full precision);
    low_high [2] is the calibrated static range, unused for dynamic quantization."""
    if setting.bits is None:
        return None
    low, high = (0.0, 0.0) if low_high is None else (float(low_high[0]), float(low_high[1]))
    return ActQuantizer(setting.bits, setting.symmetric, setting.dynamic, low, high)


def attach_input_quant(module: torch.nn.Module, quantizer: ActQuantizer):
    """Quantize a linear's input on every call; returns the hook handle (the model owns it from then on)."""
    return module.register_forward_pre_hook(lambda _m, args: (quantizer(args[0]), *args[1:]))


# ------------------------------------------------------------------------------------------ expert by expert


class ExpertTap(torch.nn.Module):
    """Stands in for a layer's routed experts while a streamed layer runs: records what the experts receive
    (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) and returns zeros.

    Every supported family's MoE block adds the routed experts' output to the rest of the block (shared expert,
    residual) without transforming it, so the layer's output is the output with zeros here plus the experts' output,
    which `routed_outputs` computes expert by expert over all recorded batches: each expert's weights are
    materialized once per layer instead of once per batch."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, hidden_states, top_k_index, top_k_weights):
        self.records.append((hidden_states.detach(), top_k_index.detach(), top_k_weights.detach()))
        return torch.zeros_like(hidden_states)

    def take(self) -> RoutedTokens:
        """Everything recorded since the last take, as one RoutedTokens (the records are released)."""
        records, self.records = self.records, []
        return RoutedTokens.from_batches(records, self.num_experts)


@dataclass
class RoutedTokens:
    """The routed experts' inputs of one layer over every batch: x [T, H], top-k ids and weights [T, k], with the
    (token, slot) pairs grouped by expert once (a stable sort), so each expert's rows are found without a scan."""

    x: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    batch_rows: list[int]  # rows of x contributed by each recorded batch, in order
    order: torch.Tensor  # flat (token * k + slot) positions sorted by expert
    offsets: list[int]  # order[offsets[e]:offsets[e + 1]] are expert e's positions

    @classmethod
    def from_batches(cls, records, num_experts: int) -> RoutedTokens:
        x = torch.cat([r[0] for r in records])
        index = torch.cat([r[1] for r in records])
        weights = torch.cat([r[2] for r in records])
        flat = index.reshape(-1)
        # ids outside [0, E) mark dropped slots in some families: sort them past the last expert
        valid = (flat >= 0) & (flat < num_experts)
        keyed = torch.where(valid, flat, torch.full_like(flat, num_experts))
        order = torch.argsort(keyed, stable=True)
        counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
        offsets = [0, *torch.cumsum(counts, 0).tolist()]
        return cls(x, index, weights, [r[0].shape[0] for r in records], order, offsets)

    @property
    def num_experts(self) -> int:
        return len(self.offsets) - 1

    def count(self, expert: int) -> int:
        return self.offsets[expert + 1] - self.offsets[expert]

    def rows(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows, slots) routed to `expert`, tokens ascending."""
        positions = self.order[self.offsets[expert]:self.offsets[expert + 1]]
        k = self.index.shape[1]
        return positions // k, positions % k

    def sampled_rows(self, expert: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows(expert) cut to at most `limit` pairs, evenly strided (loss_sample): the tokens an expert's loss
        table and rounding are measured on."""
        token, slot = self.rows(expert)
        return loss_sample(token, limit), loss_sample(slot, limit)

    def scales(self, token: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """experts.token_weights "routing": the routing weights of these (token, slot) pairs of one expert over their
        root mean square, [n] float32. The layer adds w_t y_t, so an expert's error on token t is w_t times its error
        in the layer's output: rows multiplied by these make a sum of squares (a Hessian, a squared error) weigh each
        token by w_t^2, and the root mean square keeps the sum's scale (a Hessian still blends with the layer's for
        cold experts, the loss table stays a mean per token)."""
        weights = self.weights[token, slot].float()
        rms = weights.square().mean().sqrt()  # kept on the device: no host synchronisation per expert
        return torch.where(rms > 0, weights / rms.clamp_min(torch.finfo(torch.float32).tiny), 1.0)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A per-token tensor [T, ...] cut back into the recorded batches."""
        return list(tensor.split(self.batch_rows))


def loss_sample(x: torch.Tensor, limit: int) -> torch.Tensor:
    """At most `limit` rows of x, evenly strided (calibration windows are in order, so a stride spans them all): the
    tokens an expert's loss table and rounding optimisation are measured on."""
    return x[::-(-x.shape[0] // limit)] if x.shape[0] > limit else x


ExpertWeightsFn = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]


def routed_outputs(routed: RoutedTokens, weights_of: ExpertWeightsFn, act_fn, input_quant: ActQuantizer | None,
                   mid_quant: ActQuantizer | None, chunk: int,
                   progress: Callable[[int, int], None] | None = None,
                   kept: torch.Tensor | None = None, only: range | None = None,
                   accumulate: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts' combined output [T, H] (what the family's experts module would return), expert by
    expert: weights_of(experts) gives (gate_up [n, 2I, H], down [n, H, I]) ready to compute with for `chunk`
    experts at a time; experts are visited in ascending order, like transformers' own experts module.
    kept [E] bool (None: every expert): the experts that are computed; the others are skipped, their routing weight
    renormalised onto the token's kept experts (renormalized_weights). only: the contribution of these experts
    alone (one rank's share, hexq.calib.ranks; None: all). accumulate: the dtype the sum is kept in (None: the
    input's); float64 makes the sum of a token's few float32 terms exact, so independent of their order."""
    out = torch.zeros_like(routed.x, dtype=accumulate or routed.x.dtype)
    num_experts = routed.num_experts
    weights = routed.weights
    if kept is not None and not bool(kept.all()):
        kept_slots = kept.to(routed.index.device)[routed.index.clamp(0, num_experts - 1)]
        weights = served_weights(routed.index, weights, kept_slots, num_experts)
    span = only if only is not None else range(num_experts)
    for start in range(span.start, span.stop, chunk):
        experts = [e for e in range(start, min(start + chunk, span.stop))
                   if routed.count(e) and (kept is None or bool(kept[e]))]
        if experts:
            gate_up, down = weights_of(experts)
            for j, expert in enumerate(experts):
                token, slot = routed.rows(expert)
                y = quantized_expert_output(routed.x[token], gate_up[j], down[j], act_fn, input_quant, mid_quant)
                out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
            del gate_up, down
        if progress is not None:
            progress(min(start + chunk, span.stop) - span.start, len(span))
    return out
