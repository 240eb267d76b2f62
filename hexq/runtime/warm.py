"""The warm start of the expert cache: which experts `hexq run` loads before serving, in which order."""

from __future__ import annotations

import torch

from hexq.algos.placement import place, ranked
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact


def warm_order(artifact: Artifact, scheme: str, slots: int) -> list[tuple[int, int]]:
    """The experts a warm start loads, at most `slots`, least valuable first (so LRU evicts them first): K = slots //
    layers per layer by 003 Algorithm 2 scheme `scheme` (3: the manifest's two-stage placement when pack computed it
    for the same K, else recomputed from the router traces; 1: paths; 2: frequency), then the remaining slots to the
    most frequently routed experts left (calibration counts). Skipped experts (allocation 0) are never loaded."""
    if scheme == "none" or slots <= 0:
        return []
    L, E = len(artifact.moe_layers), artifact.num_experts
    counts = artifact.tensor(STATS_SHARD, "router.counts").long()
    K = min(E, slots // L)
    placement = artifact.placement
    if scheme == "3" and placement.get("scheme") == "two_stage" and placement.get("hot_per_layer") == K:
        mask = torch.zeros(L, E, dtype=torch.bool, device=counts.device)
        for row, hot in enumerate(placement["hot"]):
            mask[row, hot] = True
    else:
        topk = artifact.tensor(STATS_SHARD, "router.topk").long()
        mask = place(scheme, topk, counts, K)
    artifact.release()
    allowed = torch.tensor(artifact.allocation, dtype=torch.long, device=counts.device) > 0
    chosen = mask & allowed
    order = ranked(counts)  # [L, E] by frequency, best first
    picks = [(int(counts[row, e]), row, e) for row in range(L) for e in order[row].tolist() if chosen[row, e]]
    rest = sorted(((int(counts[row, e]), row, e) for row in range(L) for e in range(E)
                   if allowed[row, e] and not chosen[row, e]), key=lambda t: (-t[0], t[1], t[2]))
    picks += rest[:max(0, slots - len(picks))]
    picks.sort(key=lambda t: (t[0], t[1], t[2]))  # least frequent first
    return [(row, e) for _, row, e in picks[-slots:]]
