"""Router statistics captured with forward hooks on each layer's router.

The router of every supported family returns (router_logits, router_scores, router_indices); the hooks read
the chosen expert ids and their scores. Hooks are owned by the context manager and removed in `finally`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hexq.adapters import MoEAdapter


@dataclass
class RouterCounts:
    """Per layer and expert: how many tokens chose the expert, and the sum of their routing scores."""

    counts: torch.Tensor  # [L, E] int64
    score_sums: torch.Tensor  # [L, E] float64

    @property
    def load(self) -> torch.Tensor:
        """Share of each layer's routed (token, slot) pairs that went to each expert; rows sum to 1."""
        return self.counts.double() / self.counts.sum(dim=1, keepdim=True).clamp(min=1)


def add_routing(counts: torch.Tensor, score_sums: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor) -> None:
    """Add one router call's choices (indices [T, k]) and their scores to one layer's counts and score sums [E]."""
    flat = indices.reshape(-1).cpu()
    counts += torch.bincount(flat, minlength=counts.shape[0])[: counts.shape[0]]
    score_sums.index_add_(0, flat, scores.reshape(-1).double().cpu())


def moe_routers(model, adapter: MoEAdapter) -> list[torch.nn.Module]:
    return [getattr(getattr(layer, adapter.moe), adapter.router) for layer in model.model.layers]


@contextmanager
def capture_router_counts(model, adapter: MoEAdapter, num_experts: int):
    """Within the block, every forward pass adds its routing decisions to the yielded RouterCounts."""
    routers = moe_routers(model, adapter)
    stats = RouterCounts(torch.zeros(len(routers), num_experts, dtype=torch.long),
                         torch.zeros(len(routers), num_experts, dtype=torch.float64))

    def hook_for(layer_index: int):
        def hook(_module, _inputs, outputs):
            _logits, scores, indices = outputs
            add_routing(stats.counts[layer_index], stats.score_sums[layer_index], scores, indices)

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_router_topk(model, adapter: MoEAdapter):
    """Within the block, every router call appends its chosen expert ids ([T, k], int16 like the calibration
    store's router.topk) to its layer's list. After the block, `hexq.algos.placement.stack_trace(calls)` is the
    trace [L, T, k]: each forward pass runs every layer's router once on the same tokens in the same order, so row t
    of every layer is the same token and a token's path is read down the layer axis."""
    routers = moe_routers(model, adapter)
    traces: list[list[torch.Tensor]] = [[] for _ in routers]

    def hook_for(layer_index: int):
        def hook(_module, _inputs, outputs):
            _logits, _scores, indices = outputs
            traces[layer_index].append(indices.reshape(-1, indices.shape[-1]).to(torch.int16).cpu())

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield traces
    finally:
        for handle in handles:
            handle.remove()
