"""Each family's routing computed from its adapter's contract (hexq.model.adapters.Routing): what the adapter tests
check against transformers' own routers, so that the registry's routing data says what the families really do."""

from __future__ import annotations

import torch

from hexq.base.errors import HexqError
from hexq.model.adapters import SIGMOID_BIAS_GROUP_TOPK, SOFTMAX_GROUP_TOPK, SPARSEMIXER, Routing, _config_value


def route(routing: Routing, config, logits: torch.Tensor,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k] float32, top-k ids [T, k]) the family's router gives for router logits [T, E] at
    inference, computed from the adapter's contract (what tests check against transformers' routers; the ids come
    in the router's own order only where that order is defined: compare them as sets)."""
    k = int(_config_value(config, "num_experts_per_tok"))
    scores = logits.float()
    if routing.kind == SPARSEMIXER:
        return sparsemixer(scores, float(_config_value(config, "router_jitter_noise", 0.0)), k)
    if routing.kind == SIGMOID_BIAS_GROUP_TOPK:
        probs = scores.sigmoid()
        choice = probs if bias is None else probs + bias.to(device=probs.device, dtype=probs.dtype)
        # a group's score is the sum of its two best (biased) experts (DeepSeek-V3 noaux_tc)
        keep = _group_mask(choice, config, lambda g: g.topk(2, dim=-1).values.sum(dim=-1))
        ids = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices
    elif routing.kind == SOFTMAX_GROUP_TOPK and _config_value(config, "topk_method") == "group_limited_greedy":
        probs = scores.softmax(dim=-1)
        keep = _group_mask(probs, config, lambda g: g.amax(dim=-1))  # a group's score is its best expert's
        probs = probs.masked_fill(~keep, 0.0)
        ids = probs.topk(k, dim=-1).indices
    else:
        probs = scores.softmax(dim=-1)
        ids = probs.topk(k, dim=-1).indices
    weights = probs.gather(1, ids)
    norm_topk = bool(_config_value(config, "norm_topk_prob", False))
    if routing.normalize == "always" or (routing.normalize == "config" and norm_topk):
        # DeepSeek-V3 guards the sum of sigmoids with 1e-20; the softmax families divide by the plain sum
        eps = 1e-20 if routing.kind == SIGMOID_BIAS_GROUP_TOPK else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if routing.scaled:
        weights = weights * float(_config_value(config, "routed_scaling_factor", 1.0))
    return weights, ids


def _group_mask(scores: torch.Tensor, config, group_score) -> torch.Tensor:
    """[T, E] bool: the experts of the config.topk_group groups (of n_group consecutive experts) scoring highest."""
    groups, keep_groups = int(_config_value(config, "n_group")), int(_config_value(config, "topk_group"))
    per_group = scores.unflatten(-1, (groups, -1))
    chosen = group_score(per_group).topk(keep_groups, dim=-1).indices
    mask = torch.zeros(scores.shape[0], groups, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, chosen, True)
    return mask.repeat_interleave(scores.shape[-1] // groups, dim=-1)


def sparsemixer(scores: torch.Tensor, jitter_eps: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's SparseMixer-v2 at inference (top-2): expert 1 = arg-max; its weight = the softmax, over the experts
    whose logit lies within a relative 2*eps of the max, at expert 1; expert 2 = arg-max of the others, weighted the
    same way among the remaining experts near it."""
    if k != 2:
        raise HexqError(f"PhiMoE's sparsemixer routes exactly 2 experts per token, the config asks for {k}")
    weights, ids, masked = [], [], scores
    for _ in range(2):
        top, index = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        near = ((top - scores) / factor) <= 2 * jitter_eps
        gates = masked.masked_fill(~near, float("-inf")).softmax(dim=-1)
        weights.append(gates.gather(1, index))
        ids.append(index)
        masked = masked.scatter(1, index, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)
