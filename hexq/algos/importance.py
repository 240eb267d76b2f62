"""Expert importance from routing statistics (paper 002 §4.1, Algorithm 1 lines 11-16).

For each layer l and expert e, with P_{l,e} the number of routed (token, slot) pairs that chose e and W_{l,e} the
sum of their routing scores:

    S_{l,e} = alpha * Norm(P_{l,e}) + (1 - alpha) * Norm(W_{l,e})

The paper leaves Norm open. hexq divides by the layer's total (Norm(x)_e = x_e / sum_e' x_e'), so both terms are
distributions over the layer's experts: P~ is the share of routed pairs, W~ the share of routing mass, and S is a
convex mix of the two that also sums to 1. This keeps alpha meaningful whatever the number of tokens or the
router's score scale (softmax, renormalized top-k or sigmoid scores). Min-max scaling was rejected because it
maps the least used expert to 0 in both terms whatever its share, and divides by zero when all experts tie.
A layer that routed no tokens has S = 0 for every expert (no NaN); its order is then expert id.
"""

from __future__ import annotations

import torch


def share(x: torch.Tensor) -> torch.Tensor:
    """x divided by its sum over the last dim (float64); all-zero rows stay zero."""
    x = x.to(torch.float64)
    total = x.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(x))


def importance(counts: torch.Tensor, score_sums: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """S = alpha * P/sum(P) + (1 - alpha) * W/sum(W) over the last dim ([E], or [L, E] for all layers), float64."""
    if counts.shape != score_sums.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and score_sums {tuple(score_sums.shape)} differ in shape")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if (counts < 0).any() or (score_sums < 0).any():
        raise ValueError("counts and score_sums must be non-negative (routing counts and sums of routing scores)")
    return alpha * share(counts) + (1.0 - alpha) * share(score_sums)


def importance_order(S: torch.Tensor) -> list[int]:
    """Expert ids of one layer's scores S [E], most important first; equal scores in ascending expert id."""
    if S.ndim != 1:
        raise ValueError(f"S must be one layer's scores [E], got shape {tuple(S.shape)}")
    # A stable descending sort keeps equal scores in index order, so ties never depend on the sort kernel.
    return torch.sort(S, descending=True, stable=True).indices.tolist()
