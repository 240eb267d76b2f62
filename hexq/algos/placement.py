"""Hot-expert placement: which K experts of each layer live in the fast tier (paper 003 §III.C.2, Algorithm 2).

Input is a router trace topk [L, T, k]: the expert ids that token t chose at layer l. The same T tokens pass
through all L layers, so a token's activation path is its column read down the layer axis. Every scheme returns a
bool mask [L, E] with exactly K True per layer; ties go to the more frequent expert, then the lower expert id.
Schemes are numbered as in 003's Table IV:

1. `path_placement`: experts on the most frequent activation paths.
2. `frequency_placement`: the K most frequently routed experts of each layer.
3. `two_stage_placement`: Algorithm 2. Stage I takes `path_k` experts per layer from the hottest paths, stage II
   fills each layer to K with its most frequent experts not yet chosen.

What a path is here. 003 counts complete paths, the sequence of experts a token traverses from the first layer to
the last ("each path includes 2L experts" for top-2 Mixtral), and fills each layer from the most frequent ones.
With top-k routing a complete path is a sequence of k-sets, and such sequences rarely repeat once E or L grows:
on the 4-layer reference models 19% (Mixtral, 8 experts top-2) and 88% (Qwen3-MoE, 32 experts top-4) of
calibration tokens have a complete path no other token shares, so the ranking is mostly ties, and on held-out
text placements from complete paths hit far less than any scheme below (Mixtral, K = 2 of 8: 26% against 36-39%).
hexq uses the shortest segments that still tie layers together: layer-to-layer transitions. A token routed to set A
at layer l and set B at layer l+1 adds one count to each of the k*k transitions (l, a -> b), a in A, b in B; with E^2
possible transitions per layer pair they are counted well from a few thousand tokens. Segments of 3 or 4 layers
(k^s combinations per token) did no better on held-out text of the reference models (mean hit rate within 0.3
points of transitions, averaged over both models and K = 25%, 50%). Algorithm 2 walks paths by falling
frequency and adds each path's experts to their layers while a layer has room; walking transitions the same way
fills each layer independently, so it equals ranking a layer's experts by the count of the hottest transition they
lie on (into or out of the layer). That rank is `path_scores`. With one layer there are no transitions and the
schemes fall back to frequency.

Why every scheme has a per-layer K. 003's Scheme 2 is a global budget: the most frequent experts of the whole
model, so the number per layer varies, and Table IV's large spread across layers for Scheme 2 comes from that.
`global_frequency_placement` (in benchmarks/placement.py, which reports it) is that baseline. With the same K in
every layer, scheme 2 maximizes every layer's hit rate on the trace it was built from; what paths aim at is joint
coverage of a token's consecutive choices (`path_coverage`, there too: tokens served by the fast tier on every
layer). Whether that pays off is a measurement
(benchmarks/placement.py), not an assumption.
"""

from __future__ import annotations

import torch


def check_trace(topk: torch.Tensor, num_experts: int) -> None:
    if topk.ndim != 3:
        raise ValueError(f"topk must be a router trace [L, T, k], got shape {tuple(topk.shape)}")
    if topk.numel() == 0:
        raise ValueError(f"router trace {tuple(topk.shape)} holds no routed tokens")
    if int(topk.min()) < 0 or int(topk.max()) >= num_experts:
        raise ValueError(f"expert ids must be in [0, {num_experts}), found {int(topk.min())}..{int(topk.max())}")


def expert_counts(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] int64: routed (token, slot) pairs per expert and layer (the calibration store's router.counts)."""
    check_trace(topk, num_experts)
    return torch.stack([torch.bincount(layer.reshape(-1).long(), minlength=num_experts) for layer in topk])


def transition_counts(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L-1, E, E] int64: entry (l, a, b) counts tokens routed to expert a at layer l and to expert b at layer l+1."""
    check_trace(topk, num_experts)
    E = num_experts
    ids = topk.long()
    out = torch.zeros(ids.shape[0] - 1, E, E, dtype=torch.long, device=ids.device)
    for layer in range(ids.shape[0] - 1):
        pairs = ids[layer][:, :, None] * E + ids[layer + 1][:, None, :]  # [T, k, k]: every (a, b) pair of a token
        out[layer] = torch.bincount(pairs.reshape(-1), minlength=E * E).view(E, E)
    return out


def path_scores(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] int64: count of the hottest transition each expert lies on, into or out of its layer."""
    trans = transition_counts(topk, num_experts)
    scores = torch.zeros(topk.shape[0], num_experts, dtype=torch.long, device=topk.device)
    if trans.shape[0]:
        scores[:-1] = trans.amax(dim=2)  # out of layer l
        scores[1:] = torch.maximum(scores[1:], trans.amax(dim=1))  # into layer l+1
    return scores


def ranked(*keys: torch.Tensor) -> torch.Tensor:
    """[L, E] expert ids of each layer, best first, by the [L, E] keys (most significant first, larger is better),
    remaining ties by ascending id: stable sorts from the least significant key up."""
    L, E = keys[0].shape
    order = torch.arange(E, device=keys[0].device).expand(L, E)
    for key in reversed(keys):
        order = order.gather(1, torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices)
    return order


def first_k_mask(order: torch.Tensor, K: int) -> torch.Tensor:
    return torch.zeros(order.shape, dtype=torch.bool, device=order.device).scatter_(1, order[:, :K], True)


def check_k(K: int, num_experts: int) -> None:
    if not 0 <= K <= num_experts:
        raise ValueError(f"K must be between 0 and the number of experts {num_experts}, got {K}")


def frequency_placement(counts: torch.Tensor, K: int) -> torch.Tensor:
    """Scheme 2: the K most frequently routed experts of each layer, from counts [L, E] -> mask [L, E]."""
    check_k(K, counts.shape[1])
    return first_k_mask(ranked(counts), K)


def path_placement(topk: torch.Tensor, num_experts: int, K: int) -> torch.Tensor:
    """Scheme 1: each layer's K experts on the hottest layer-to-layer transitions -> mask [L, E]."""
    return two_stage_placement(topk, num_experts, K, path_k=K)


def two_stage_placement(topk: torch.Tensor, num_experts: int, K: int, path_k: int | None = None) -> torch.Tensor:
    """Scheme 3 (Algorithm 2): path_k experts per layer from the hottest transitions, then each layer filled to K
    by frequency. path_k defaults to min(k, K), one hot path's worth as in 003 (2 of 4 per layer for top-2)."""
    check_k(K, num_experts)
    path_k = min(topk.shape[-1], K) if path_k is None else path_k
    if not 0 <= path_k <= K:
        raise ValueError(f"path_k must be between 0 and K={K}, got {path_k}")
    counts = expert_counts(topk, num_experts)
    stage1 = first_k_mask(ranked(path_scores(topk, num_experts), counts), path_k)
    return first_k_mask(ranked(stage1.long(), counts), K)


SCHEMES = {"1": "paths", "2": "frequency", "3": "two_stage"}  # 003 Table IV's numbers -> the names recipes use


def place(scheme: str, topk: torch.Tensor, counts: torch.Tensor, K: int) -> torch.Tensor:
    """[L, E] bool: each layer's K fast-tier experts by `scheme`, a name (paths, frequency, two_stage) or its 003
    number (1, 2, 3); topk [L, T, k] is the router trace, counts [L, E] the routed counts frequency ranks by."""
    name = SCHEMES.get(scheme, scheme)
    if name == "paths":
        return path_placement(topk, counts.shape[1], K)
    if name == "frequency":
        return frequency_placement(counts, K)
    if name == "two_stage":
        return two_stage_placement(topk, counts.shape[1], K)
    raise ValueError(f"unknown placement scheme {scheme!r}; choose one of {', '.join(SCHEMES.values())} "
                     f"(or {', '.join(SCHEMES)})")


def hit_rates(mask: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """[L] float64: share of each layer's routed (token, slot) pairs whose expert is in the fast set."""
    check_trace(topk, mask.shape[1])
    if mask.shape[0] != topk.shape[0]:
        raise ValueError(f"mask has {mask.shape[0]} layers, trace has {topk.shape[0]}")
    return mask.gather(1, topk.reshape(topk.shape[0], -1).long()).double().mean(dim=1)
