"""Hessian helpers for cold experts."""

from __future__ import annotations

import torch


def blend_cold_hessian(h_expert: torch.Tensor, n_expert: int, h_layer: torch.Tensor, n_layer: int,
                       min_tokens: int, blend: float) -> tuple[torch.Tensor, bool]:
    """The Hessian GPTQ uses for one expert, and whether the fallback was needed.

    H = 2 sum x x^T is a sum over tokens; an expert routed fewer than `min_tokens` calibration tokens has a
    rank-deficient, noisy H. Per-token means are blended: H = (1 - blend) * H_e / n_e + blend * H_layer / n_layer,
    with H_layer over every token reaching the MoE block (the inputs the expert could be routed); an expert with
    no routed token uses H_layer / n_layer alone. Warm experts keep their own per-token mean.
    """
    if n_layer <= 0:
        raise ValueError("the layer-wide Hessian has no tokens")
    layer_mean = h_layer / n_layer
    if n_expert == 0:
        return layer_mean.clone(), True
    expert_mean = h_expert / n_expert
    if n_expert >= min_tokens:
        return expert_mean, False
    return (1 - blend) * expert_mean + blend * layer_mean, True
