"""Statistics of the calibration windows at one decoder layer: Hessians, input ranges, routing.

Per linear input (attention, shared expert, a dense layer's MLP): the Hessian H = 2 sum_t x_t x_t^T (GPTQ eq. 4's
proxy), the token count and the input range (for static activation scales), gathered by forward pre-hooks that are
removed in `finally`. Per routed expert: the Hessians of its gate/up input and of its down input (the
intermediate) from the tokens routed to it only, computed expert by expert from what the experts received
(hexq.model.simulate.RoutedTokens) rather than inside the forward pass, so only one chunk of experts' Hessians exists at
a time. Hessians are accumulated in float32 on the device of the activations (float64 is reserved for a
factorization that fails in float32, hexq.algos.gptq).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hexq.model.adapters import MoEAdapter
from hexq.model.simulate import RoutedTokens, expert_intermediate

# Routed rows multiplied at once when accumulating one expert's Hessians (bounds the [rows, I] intermediate).
TOKEN_CHUNK = 4096


def add_routing(counts: torch.Tensor, score_sums: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor) -> None:
    """Add one router call's choices (indices [T, k]) and their scores to one layer's counts and score sums [E]."""
    flat = indices.reshape(-1).cpu()
    counts += torch.bincount(flat, minlength=counts.shape[0])[: counts.shape[0]]
    score_sums.index_add_(0, flat, scores.reshape(-1).double().cpu())


@dataclass
class SiteStats:
    """Running statistics of one input site (a linear's input)."""

    hessian: torch.Tensor  # [C, C] float32, 2 sum x x^T
    tokens: int = 0
    low: float = float("inf")
    high: float = float("-inf")
    abs_max: torch.Tensor | None = None  # [C] per-channel max |x|

    @classmethod
    def empty(cls, channels: int, device: torch.device) -> SiteStats:
        return cls(torch.zeros(channels, channels, dtype=torch.float32, device=device))

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.hessian.addmm_(x.T, x, alpha=2.0)
        self.tokens += x.shape[0]
        if x.numel():
            self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))
            channel_max = x.abs().amax(dim=0)
            self.abs_max = channel_max if self.abs_max is None else torch.maximum(self.abs_max, channel_max)


def quantized_linears(layer: torch.nn.Module, adapter: MoEAdapter) -> dict[str, torch.nn.Linear]:
    """Every linear hexq quantizes outside the routed experts (names relative to the layer): attention, the shared
    expert, and on a dense layer the MLP in the MoE block's place. Routers and Qwen2-MoE's shared_expert_gate stay in
    full precision."""
    found = {}
    attention = getattr(layer, adapter.attention)
    for name, module in attention.named_modules():
        if isinstance(module, torch.nn.Linear):
            found[f"{adapter.attention}.{name}"] = module
    moe = getattr(layer, adapter.moe)
    if hasattr(moe, adapter.experts):
        if adapter.shared_expert and hasattr(moe, adapter.shared_expert):
            for name, module in getattr(moe, adapter.shared_expert).named_modules():
                if isinstance(module, torch.nn.Linear):
                    found[f"{adapter.moe}.{adapter.shared_expert}.{name}"] = module
    else:  # a dense layer: its whole MLP is quantized like the attention
        for name, module in moe.named_modules():
            if isinstance(module, torch.nn.Linear):
                found[f"{adapter.moe}.{name}"] = module
    return found


@contextmanager
def capture_linears(linears: dict[str, torch.nn.Linear]):
    """Within the block, every call of the given linears adds its input to the yielded {name: SiteStats}."""
    stats: dict[str, SiteStats] = {}
    handles = []

    def hook_for(name: str):
        def hook(module, args):
            x = args[0]
            if name not in stats:
                stats[name] = SiteStats.empty(module.in_features, x.device)
            stats[name].add(x)

        return hook

    for name, module in linears.items():
        handles.append(module.register_forward_pre_hook(hook_for(name)))
    try:
        yield stats
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


@dataclass
class ExpertChunkStats:
    """Per expert of one chunk: Hessians of the gate/up input [n, H, H] and down input [n, I, I] (float32, from
    routed tokens only), routed token counts, per-channel max |x| of both inputs (act_order "max_activation")."""

    gate_up: torch.Tensor
    down: torch.Tensor
    tokens: list[int]
    input_abs_max: torch.Tensor  # [n, H]
    mid_abs_max: torch.Tensor  # [n, I]
    mid_low: float = float("inf")
    mid_high: float = float("-inf")


def expert_statistics(routed: RoutedTokens, experts: list[int], gate_up: torch.Tensor, act_fn,
                      weighted: bool = False) -> ExpertChunkStats:
    """Hessians and ranges of the experts in `experts` from the tokens routed to each; gate_up [n, 2I, H] are those
    experts' (smoothed, full-precision) weights in the compute dtype, used for the intermediate. weighted
    (experts.token_weights "routing"): each token's rows in both Hessians weighted by its squared routing weight
    (RoutedTokens.scales); the ranges stay those of the inputs themselves."""
    n, hidden, inner = len(experts), routed.x.shape[1], gate_up.shape[1] // 2
    device = routed.x.device
    stats = ExpertChunkStats(
        torch.zeros(n, hidden, hidden, dtype=torch.float32, device=device),
        torch.zeros(n, inner, inner, dtype=torch.float32, device=device),
        [routed.count(e) for e in experts],
        torch.zeros(n, hidden, dtype=torch.float32, device=device),
        torch.zeros(n, inner, dtype=torch.float32, device=device))
    low = torch.full((), float("inf"), dtype=torch.float32, device=device)  # kept on the device: no host
    high = torch.full((), float("-inf"), dtype=torch.float32, device=device)  # synchronisation per expert
    for j, expert in enumerate(experts):
        token, slot = routed.rows(expert)
        if not len(token):  # never routed: zero statistics
            continue
        scales = routed.scales(token, slot) if weighted else None
        for start in range(0, len(token), TOKEN_CHUNK):
            x = routed.x[token[start:start + TOKEN_CHUNK]].float()
            stats.input_abs_max[j] = torch.maximum(stats.input_abs_max[j], x.abs().amax(dim=0))
            mid = expert_intermediate(x, gate_up[j], act_fn).float()
            stats.mid_abs_max[j] = torch.maximum(stats.mid_abs_max[j], mid.abs().amax(dim=0))
            low, high = torch.minimum(low, mid.min()), torch.maximum(high, mid.max())
            if scales is not None:
                scale = scales[start:start + TOKEN_CHUNK, None]
                x, mid = x * scale, mid * scale
            stats.gate_up[j].addmm_(x.T, x, alpha=2.0)
            stats.down[j].addmm_(mid.T, mid, alpha=2.0)
    stats.mid_low, stats.mid_high = float(low), float(high)
    return stats


@dataclass
class RoutingStats:
    """Router statistics of one layer: per-expert counts and routing-score sums, every token's top-k ids (the
    activation paths of 003 §III.C.2)."""

    counts: torch.Tensor  # [E] int64
    score_sums: torch.Tensor  # [E] float64
    topk: torch.Tensor  # [T, k] int16
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, routed: RoutedTokens) -> RoutingStats:
        num_experts = routed.num_experts
        counts = torch.zeros(num_experts, dtype=torch.long, device="cpu")
        score_sums = torch.zeros(num_experts, dtype=torch.float64, device="cpu")
        add_routing(counts, score_sums, routed.weights, routed.index)
        return cls(counts, score_sums, routed.index.to(torch.int16).cpu())
