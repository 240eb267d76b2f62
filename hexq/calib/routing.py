"""Router statistics captured with forward hooks on each layer's router.

The router of every supported family returns (router_logits, router_scores, router_indices); the hooks read
the chosen expert ids and their scores. Hooks are owned by the context manager and removed in `finally`.
"""

from __future__ import annotations

from collections.abc import Callable
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
def on_router_calls(model, adapter: MoEAdapter, record: Callable[[int, torch.Tensor, torch.Tensor], None]):
    """Within the block, every router call runs record(layer_index, scores, indices); hooks removed in `finally`."""

    def hook_for(layer_index: int):
        def hook(_module, _inputs, outputs):
            _logits, scores, indices = outputs
            record(layer_index, scores, indices)

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(moe_routers(model, adapter))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_router_counts(model, adapter: MoEAdapter, num_experts: int):
    """Within the block, every forward pass adds its routing decisions to the yielded RouterCounts."""
    layers = len(moe_routers(model, adapter))
    stats = RouterCounts(torch.zeros(layers, num_experts, dtype=torch.long, device="cpu"),
                         torch.zeros(layers, num_experts, dtype=torch.float64, device="cpu"))

    def record(layer: int, scores: torch.Tensor, indices: torch.Tensor) -> None:
        add_routing(stats.counts[layer], stats.score_sums[layer], scores, indices)

    with on_router_calls(model, adapter, record):
        yield stats


@contextmanager
def capture_router_topk(model, adapter: MoEAdapter):
    """Within the block, every router call appends its chosen expert ids ([T, k], int16 like the calibration
    store's router.topk) to its layer's list. After the block, `hexq.algos.placement.stack_trace(calls)` is the
    trace [L, T, k]: each forward pass runs every layer's router once on the same tokens in the same order, so row t
    of every layer is the same token and a token's path is read down the layer axis."""
    traces: list[list[torch.Tensor]] = [[] for _ in moe_routers(model, adapter)]

    def record(layer: int, _scores: torch.Tensor, indices: torch.Tensor) -> None:
        traces[layer].append(indices.reshape(-1, indices.shape[-1]).to(torch.int16).cpu())

    with on_router_calls(model, adapter, record):
        yield traces
