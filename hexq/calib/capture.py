"""Statistics captured while calibration windows run through one decoder layer (hooks removed in `finally`).

Per linear input: the Hessian H = 2 sum_t x_t x_t^T (GPTQ eq. 4's proxy), the token count, and the input range
(for static activation scales). Per routed expert: the Hessians of its gate/up input and of its down input
(the intermediate), from the tokens routed to it only. Per layer: router counts, routing-score sums and every
token's top-k ids (the activation paths of 003 §III.C.2), the MoE-input Hessian over all tokens (the fallback for
cold experts) and a token subsample of the MoE input.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hexq.adapters import MoEAdapter
from hexq.calib.routing import add_routing
from hexq.simulate import expert_intermediate


@dataclass
class SiteStats:
    """Running statistics of one input site (a linear's input)."""

    hessian: torch.Tensor  # [C, C] float64, 2 sum x x^T
    tokens: int = 0
    low: float = float("inf")
    high: float = float("-inf")
    abs_max: torch.Tensor | None = None  # [C] per-channel max |x|

    @classmethod
    def empty(cls, channels: int) -> SiteStats:
        return cls(torch.zeros(channels, channels, dtype=torch.float64))

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        self.hessian += 2 * x.T @ x
        self.tokens += x.shape[0]
        if x.numel():
            self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))
            channel_max = x.abs().amax(dim=0).float()
            self.abs_max = channel_max if self.abs_max is None else torch.maximum(self.abs_max, channel_max)


@dataclass
class ExpertStats:
    """Per routed expert: Hessians of the gate/up input [E, H, H] and down input [E, I, I], tokens routed."""

    gate_up: torch.Tensor
    down: torch.Tensor
    tokens: torch.Tensor  # [E] int64
    input_abs_max: torch.Tensor  # [E, H] per-channel max |x| of routed tokens (act_order "max_activation")
    mid_abs_max: torch.Tensor  # [E, I]
    input_low: float = float("inf")
    input_high: float = float("-inf")
    mid_low: float = float("inf")
    mid_high: float = float("-inf")


@dataclass
class LayerCapture:
    linears: dict[str, SiteStats] = field(default_factory=dict)  # name relative to the layer -> stats
    experts: ExpertStats | None = None
    moe_input: SiteStats | None = None  # every token reaching the MoE block (cold-expert fallback)
    moe_sample: list[torch.Tensor] = field(default_factory=list)
    router_counts: torch.Tensor | None = None  # [E]
    router_score_sums: torch.Tensor | None = None  # [E]
    router_topk: list[torch.Tensor] = field(default_factory=list)  # [T, k] per batch


def quantized_linears(layer: torch.nn.Module, adapter: MoEAdapter) -> dict[str, torch.nn.Linear]:
    """Every linear hexq quantizes outside the routed experts: attention and shared expert (names relative to the
    layer). Routers and Qwen2-MoE's shared_expert_gate stay in full precision."""
    found = {}
    attention = getattr(layer, adapter.attention)
    for name, module in attention.named_modules():
        if isinstance(module, torch.nn.Linear):
            found[f"{adapter.attention}.{name}"] = module
    moe = getattr(layer, adapter.moe)
    if adapter.shared_expert and hasattr(moe, adapter.shared_expert):
        for name, module in getattr(moe, adapter.shared_expert).named_modules():
            if isinstance(module, torch.nn.Linear):
                found[f"{adapter.moe}.{adapter.shared_expert}.{name}"] = module
    return found


@contextmanager
def capture_layer(layer: torch.nn.Module, adapter: MoEAdapter, moe_sample_every: int = 8):
    """Within the block, every forward of `layer` adds to the yielded LayerCapture."""
    capture = LayerCapture()
    handles = []

    def linear_hook(name: str):
        def hook(module, args):
            stats = capture.linears.setdefault(name, SiteStats.empty(module.in_features))
            stats.add(args[0])

        return hook

    for name, module in quantized_linears(layer, adapter).items():
        handles.append(module.register_forward_pre_hook(linear_hook(name)))

    moe = getattr(layer, adapter.moe)
    experts = getattr(moe, adapter.experts)
    router = getattr(moe, adapter.router)
    num_experts = experts.gate_up_proj.shape[0]

    def experts_hook(module, args):
        hidden, top_k_index = args[0].detach(), args[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if capture.experts is None:
            capture.experts = ExpertStats(
                torch.zeros(num_experts, flat.shape[1], flat.shape[1], dtype=torch.float64),
                torch.zeros(num_experts, module.down_proj.shape[2], module.down_proj.shape[2], dtype=torch.float64),
                torch.zeros(num_experts, dtype=torch.long),
                torch.zeros(num_experts, flat.shape[1]), torch.zeros(num_experts, module.down_proj.shape[2]))
            capture.moe_input = SiteStats.empty(flat.shape[1])
        stats = capture.experts
        capture.moe_input.add(flat)
        capture.moe_sample.append(flat[::moe_sample_every].float().cpu())
        stats.input_low, stats.input_high = min(stats.input_low, float(flat.min())), max(stats.input_high,
                                                                                          float(flat.max()))
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < num_experts:
                continue
            token = torch.where(top_k_index == expert)[0]
            x = flat[token].double()
            stats.gate_up[expert] += 2 * x.T @ x
            stats.tokens[expert] += x.shape[0]
            stats.input_abs_max[expert] = torch.maximum(stats.input_abs_max[expert], x.abs().amax(dim=0).float())
            mid = expert_intermediate(flat[token], module.gate_up_proj[expert], module.act_fn).double()
            stats.down[expert] += 2 * mid.T @ mid
            stats.mid_abs_max[expert] = torch.maximum(stats.mid_abs_max[expert], mid.abs().amax(dim=0).float())
            stats.mid_low, stats.mid_high = min(stats.mid_low, float(mid.min())), max(stats.mid_high,
                                                                                      float(mid.max()))

    def router_hook(_module, _args, outputs):
        _logits, scores, indices = outputs
        if capture.router_counts is None:
            capture.router_counts = torch.zeros(num_experts, dtype=torch.long)
            capture.router_score_sums = torch.zeros(num_experts, dtype=torch.float64)
        add_routing(capture.router_counts, capture.router_score_sums, scores, indices)
        capture.router_topk.append(indices.reshape(-1, indices.shape[-1]).to(torch.int16).cpu())

    handles.append(experts.register_forward_pre_hook(experts_hook))
    handles.append(router.register_forward_hook(router_hook))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_norm_outputs(norms: dict[str, torch.nn.Module]):
    """Within the block, collect every output of the given norms: {name: [tensors [T, C]]}."""
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in norms}
    handles = [
        norm.register_forward_hook(
            lambda _m, _a, out, name=name: outputs[name].append(out.detach().reshape(-1, out.shape[-1]).float())
        )
        for name, norm in norms.items()
    ]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()
