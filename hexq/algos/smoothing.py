"""Activation smoothing for joint weight-activation (W8A8) quantization (paper 003 §III.B.1, HAQ).

A linear y = W x reading channels c = 1..C can be rewritten y = (W diag(s)) (diag(s)^-1 x) for any positive s [C]:
the full-precision function is unchanged, but the quantization difficulty moves from the activations (outlier
channels stretch each token's range) to the weights. HAQ picks s by minimising the joint error

    s = argmin_s || Q(W s) Q(s^-1 X) - W X ||                                                   (eq. 1)

(eq. 2 is AWQ's weight-only version || Q(W s)(s^-1 X) - W X ||), restricted to the one-parameter family

    s = s_X^e,  e in [0, 1], s_X = per-channel max|X|                                            (eq. 3)

found by grid search (Algorithm 1, step 1). e = 0 is no smoothing (s = 1); e = 1 flattens every channel of X to
max 1. SmoothQuant's rule s = max|X|^a / max|W|^(1-a) is the same search with the weights' column maxima in the
denominator; `smoothing_scales` offers both.

Conventions: X is [T, C] (tokens x channels, the norm output every weight of a smoothing group reads); each
weight is [out, C]; activations are fake-quantized per token dynamically (asymmetric by default, as in 003),
weights per output channel (or in `QuantSpec.group_size` column groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hexq.algos.quant import QuantSpec, fake_quantize, fake_quantize_activations

# Channel maxima at or below this are "dead" (never active in calibration): they get s = 1, because x^e -> 0
# would divide their (possibly nonzero at inference) activations by ~0.
DEAD_CHANNEL_MAX = 1e-5
# Final clamp on s: keeps W*s and X/s finite in fp16/bf16 whatever the statistics.
SCALE_MIN, SCALE_MAX = 1e-4, 1e4
W8 = QuantSpec(bits=8)  # HAQ's default weight grid: 8 bits, symmetric, per output channel
# Rows of the stacked weights multiplied at once in `joint_w8a8_error` (bounds the [T, rows] temporaries).
ROW_CHUNK = 4096


def activation_channel_max(x: torch.Tensor) -> torch.Tensor:
    """s_X of eq. 3: per-channel max|X| over every token of x [..., C], as float32 [C]."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()


def weight_channel_max(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """SmoothQuant's max|W| per input channel, over every row of every weight [out_i, C] of a group."""
    return torch.stack([w.detach().reshape(-1, w.shape[-1]).abs().amax(dim=0).float() for w in weights]).amax(0)


def smoothing_scales(act_max: torch.Tensor, weight_max: torch.Tensor | None, exponent: float) -> torch.Tensor:
    """Smoothing factors s [C] (float32).

    weight_max None (HAQ, eq. 3): s = max|X|^e. HAQ uses only the activations' magnitudes.
    weight_max given (SmoothQuant): s = max|X|^a / max|W|^(1-a) with a = exponent.

    Channels with max|X| <= DEAD_CHANNEL_MAX, or (SmoothQuant) an all-zero weight column, get s = 1: there is
    nothing to migrate, and a tiny s would blow up whatever they carry at inference. s is clamped to
    [SCALE_MIN, SCALE_MAX]. exponent = 0 gives s = 1 exactly for HAQ.
    """
    if not 0.0 <= exponent <= 1.0:
        raise ValueError(f"smoothing exponent must be in [0, 1], got {exponent}")
    act_max = act_max.detach().double()
    if act_max.dim() != 1 or not torch.isfinite(act_max).all() or (act_max < 0).any():
        raise ValueError("act_max must be a 1-D tensor of finite non-negative per-channel maxima")
    live = act_max > DEAD_CHANNEL_MAX
    s = act_max.clamp(min=DEAD_CHANNEL_MAX).pow(exponent)
    if weight_max is not None:
        weight_max = weight_max.detach().double()
        if weight_max.shape != act_max.shape or not torch.isfinite(weight_max).all() or (weight_max < 0).any():
            raise ValueError(f"weight_max must be finite, non-negative and shaped like act_max {tuple(act_max.shape)}")
        live &= weight_max > 0
        s = s / weight_max.clamp(min=DEAD_CHANNEL_MAX).pow(1.0 - exponent)
    s = torch.where(live, s, torch.ones_like(s))
    return s.clamp(SCALE_MIN, SCALE_MAX).float()


def smoothquant_scales(act_max: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's s = max|X|^alpha / max|W|^(1-alpha), max|W| over every weight reading the channels."""
    return smoothing_scales(act_max, weight_channel_max(weights), alpha)


def full_precision_outputs(weights: Sequence[torch.Tensor], x: torch.Tensor) -> list[list[torch.Tensor]]:
    """W X of every weight, in the row chunks `joint_w8a8_error` uses: the target of eq. 1, the same for every
    candidate s, so a grid search computes it once."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    return [[x @ rows.T for rows in w.detach().reshape(-1, w.shape[-1]).float().split(ROW_CHUNK)] for w in weights]


def joint_w8a8_error(weights: Sequence[torch.Tensor], x: torch.Tensor, s: torch.Tensor, w_spec: QuantSpec | None,
                     a_bits: int, *, a_symmetric: bool = False,
                     quantize_weights: Sequence[bool] | None = None,
                     targets: list[list[torch.Tensor]] | None = None) -> float:
    """|| Q(W s) Q(s^-1 X) - W X ||^2 (eq. 1 / eq. 3's objective), summed over every weight of the group.

    weights: [out_i, C] matrices reading x [T, C]; fused experts enter as gate_up.reshape(-1, C), which is exact
    because weight quantization runs row by row. Q on activations: dynamic per token, `a_bits`, asymmetric unless
    a_symmetric. Q on weights: fake_quantize(., w_spec); w_spec None, or quantize_weights[i] False, keeps that
    weight in full precision (e.g. a router kept in fp still reads the quantized activations).
    Computed in float32, accumulated in float64. targets: `full_precision_outputs(weights, x)`, if already known.
    """
    if quantize_weights is not None and len(quantize_weights) != len(weights):
        raise ValueError(f"quantize_weights has {len(quantize_weights)} flags for {len(weights)} weights")
    x = x.detach().reshape(-1, x.shape[-1]).float()
    s = s.detach().float()
    if s.shape != (x.shape[1],):
        raise ValueError(f"scales of shape {tuple(s.shape)} do not match {x.shape[1]} activation channels")
    xq = fake_quantize_activations(x / s, a_bits, per_token=True, symmetric=a_symmetric)
    total = 0.0
    for i, w in enumerate(weights):
        w = w.detach().reshape(-1, w.shape[-1]).float()
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"weight {i} reads {w.shape[1]} channels, activations have {x.shape[1]}")
        quantized = w_spec is not None and (quantize_weights is None or quantize_weights[i])
        for j, rows in enumerate(w.split(ROW_CHUNK)):
            ws = fake_quantize(rows * s, w_spec) if quantized else rows * s
            target = x @ rows.T if targets is None else targets[i][j]
            total += float(((xq @ ws.T) - target).double().pow(2).sum())
    return total


@dataclass(frozen=True)
class SmoothingSearch:
    """Result of the grid search of eq. 3.

    exponent: the chosen e (smallest on ties); scales: s [C] for it; grid and errors: every e tried and its
    joint error (eq. 1); baseline_error: the error without smoothing (s = 1), which is errors[0] (e = 0) for HAQ;
    for SmoothQuant's rule (weight_max given) alpha = 0 is s = 1/max|W|, not s = 1, so it is computed separately.
    """

    exponent: float
    scales: torch.Tensor
    grid: tuple[float, ...]
    errors: tuple[float, ...]
    baseline_error: float

    @property
    def error(self) -> float:
        return self.errors[self.grid.index(self.exponent)]


def exponent_grid(grid_step: float) -> tuple[float, ...]:
    """0, step, 2 step, ..., 1; the step must divide 1 (0.05 -> 21 points)."""
    if not 0.0 < grid_step <= 1.0:
        raise ValueError(f"grid_step must be in (0, 1], got {grid_step}")
    n = round(1.0 / grid_step)
    if abs(n * grid_step - 1.0) > 1e-9:
        raise ValueError(f"grid_step must divide 1 evenly (e.g. 0.05, 0.1, 0.25), got {grid_step}")
    return tuple(i / n for i in range(n + 1))


def search_exponent(weights: Sequence[torch.Tensor], x: torch.Tensor, act_max: torch.Tensor | None = None,
                    grid_step: float = 0.05, *, w_spec: QuantSpec | None = W8, a_bits: int = 8,
                    a_symmetric: bool = False, weight_max: torch.Tensor | None = None,
                    quantize_weights: Sequence[bool] | None = None) -> SmoothingSearch:
    """HAQ's smoothing search (eq. 3, Algorithm 1 step 1): e over a grid in [0, 1] minimising eq. 1.

    act_max is s_X (default: activation_channel_max(x)); pass the statistics of a larger calibration set when x is
    a subsample. weight_max given turns the search into SmoothQuant's alpha search. Ties go to the smallest e
    (least migration); the search is deterministic for fixed inputs.
    """
    if act_max is None:
        act_max = activation_channel_max(x)
    grid = exponent_grid(grid_step)
    targets = full_precision_outputs(weights, x)
    errors = tuple(joint_w8a8_error(weights, x, smoothing_scales(act_max, weight_max, e), w_spec, a_bits,
                                    a_symmetric=a_symmetric, quantize_weights=quantize_weights, targets=targets)
                   for e in grid)
    best = min(range(len(grid)), key=lambda i: (errors[i], i))  # ties -> smallest index -> smallest e
    baseline = errors[0] if weight_max is None else joint_w8a8_error(
        weights, x, torch.ones_like(act_max, dtype=torch.float32), w_spec, a_bits, a_symmetric=a_symmetric,
        quantize_weights=quantize_weights, targets=targets)
    return SmoothingSearch(exponent=grid[best], scales=smoothing_scales(act_max, weight_max, grid[best]),
                           grid=grid, errors=errors, baseline_error=baseline)
