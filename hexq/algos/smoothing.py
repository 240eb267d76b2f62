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


# ------------------------------------------------------------------------------------------ routed MoE objective

# Elements of the largest temporary of `search_exponent_routed` (float32: 64 MiB): bounds experts per chunk
# (their weights) and tokens per slice (their activations and outputs).
ROUTED_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _RoutedSlice:
    """A slice of the routed tokens of a chunk of experts, padded to a rectangle [ce, L]."""

    tokens: torch.Tensor  # [ce, L] token ids (0 where padded)
    mask: torch.Tensor  # [ce, L, 1] float, 0 where padded
    target: torch.Tensor  # [ce, L, R] W_e X_e (0 where padded): the fp target, computed once


@dataclass(frozen=True)
class _RoutedChunk:
    experts: torch.Tensor  # [ce] expert ids
    slices: tuple[_RoutedSlice, ...]


def _routed_pairs(routing: torch.Tensor, num_tokens: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids sorted by expert then token, tokens per expert [E]) of the routing [T, k]; ids outside [0, E) are
    ignored and a token listing an expert twice counts once."""
    routing = routing.reshape(num_tokens, -1).long()
    token = torch.arange(num_tokens, device=routing.device)[:, None].expand_as(routing)
    valid = (routing >= 0) & (routing < num_experts)
    keys = torch.unique(routing[valid] * num_tokens + token[valid])  # sorted: expert-major, then token
    counts = torch.bincount(keys // num_tokens, minlength=num_experts)
    return keys % num_tokens, counts


def _routed_chunks(x: torch.Tensor, routing: torch.Tensor, experts: torch.Tensor,
                   chunk_elements: int) -> list[_RoutedChunk]:
    """Split the routed (token, expert) pairs into chunks of experts and padded slices of their tokens whose
    temporaries stay within chunk_elements.

    Experts are taken in decreasing token count, so the experts of one chunk have similar counts and padding stays
    small; their fp outputs W_e X_e are computed here once for the whole search.
    """
    num_experts, rows, channels = experts.shape
    tokens_sorted, counts = _routed_pairs(routing, x.shape[0], num_experts)
    offsets = torch.cumsum(counts, 0) - counts
    by_count = torch.argsort(counts, descending=True, stable=True)
    per_chunk = max(1, min(num_experts, chunk_elements // (rows * channels)))
    chunks = []
    for start in range(0, num_experts, per_chunk):
        ids = by_count[start:start + per_chunk]
        longest = int(counts[ids].max())
        if longest == 0:  # the rest are never routed: nothing to measure
            break
        weights = experts[ids].float()
        per_slice = max(1, chunk_elements // (len(ids) * max(rows, channels)))
        slices = []
        for first in range(0, longest, per_slice):
            position = torch.arange(first, min(first + per_slice, longest), device=x.device)
            inside = position[None, :] < counts[ids, None]  # [ce, L]
            flat = (offsets[ids, None] + position[None, :]).clamp(max=max(len(tokens_sorted) - 1, 0))
            tokens = torch.where(inside, tokens_sorted[flat], torch.zeros_like(flat))
            mask = inside[..., None].to(x.dtype)
            target = torch.bmm(x[tokens] * mask, weights.mT)
            slices.append(_RoutedSlice(tokens=tokens, mask=mask, target=target))
        chunks.append(_RoutedChunk(experts=ids, slices=tuple(slices)))
    return chunks


def _routed_experts_error(experts: torch.Tensor, xq: torch.Tensor, s: torch.Tensor, w_spec: QuantSpec | None,
                         chunks: Sequence[_RoutedChunk]) -> float:
    """sum_e || Q(W_e s) Q(X_e / s) - W_e X_e ||^2 over the routed experts (eq. 1 restricted to each expert's own
    tokens), given the quantized activations xq = Q(x / s) [T, C] of every sampled token (per-token quantization
    does not depend on which expert reads the token). Each expert's weights are fake-quantized once."""
    total = 0.0
    for chunk in chunks:
        ws = experts[chunk.experts].float() * s
        if w_spec is not None:  # row by row, as for each expert alone
            ws = fake_quantize(ws.reshape(-1, ws.shape[-1]), w_spec).reshape(ws.shape)
        for piece in chunk.slices:
            out = torch.bmm(xq[piece.tokens] * piece.mask, ws.mT)
            total += float(out.sub_(piece.target).square_().sum(dim=-1).double().sum())
    return total


def search_exponent_routed(x: torch.Tensor, routing: torch.Tensor, act_max: torch.Tensor | None = None,
                           grid_step: float = 0.05, *, experts: torch.Tensor,
                           dense: Sequence[tuple[torch.Tensor, bool]] = (), w_spec: QuantSpec | None = W8,
                           a_bits: int = 8, a_symmetric: bool = False,
                           chunk_elements: int = ROUTED_CHUNK_ELEMENTS) -> SmoothingSearch:
    """HAQ's smoothing search (eq. 3) for an MoE smoothing group, with each routed expert scored on its own tokens.

    The group reads x [T, C] (sampled tokens). error(e) = sum over the `dense` readers (router, shared experts:
    (weight [out, C], quantized) pairs; an unquantized reader keeps full-precision weights but reads Q(X / s)) of
    || Q(W s) Q(X / s) - W X ||^2 on all T tokens, plus sum over routed experts of
    || Q(W_e s) Q(X_e / s) - W_e X_e ||^2 with X_e the tokens whose top-k ids `routing` [T, k] name e (ids outside
    [0, E) are ignored). experts: [E, R, C], e.g. the fused gate_up [E, 2I, C]. search_exponent instead scores
    every expert on every token, as if all were routed to it.

    W X targets are computed once; per grid point the activations are quantized once and every routed expert's
    weights once. Experts are processed in chunks, and their tokens in slices, so that the largest temporary has
    at most chunk_elements values (a few such temporaries are alive at once); the stored targets take one value per
    routed (token, expert) pair and expert row (T * k * R), plus T * out per dense reader. Ties go to the smallest e.
    """
    x = x.detach().reshape(-1, x.shape[-1]).float()
    experts = experts.detach()
    if experts.ndim != 3 or experts.shape[-1] != x.shape[1]:
        raise ValueError(f"experts must be [E, R, {x.shape[1]}] for activations with {x.shape[1]} channels, "
                         f"got {tuple(experts.shape)}")
    if routing.shape[0] != x.shape[0] or routing.is_floating_point():
        raise ValueError(f"routing must hold integer expert ids [T, k] for the {x.shape[0]} tokens, "
                         f"got {tuple(routing.shape)} {routing.dtype}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    if act_max is None:
        act_max = activation_channel_max(x)
    grid = exponent_grid(grid_step)
    dense_weights = [weight for weight, _ in dense]
    dense_flags = [quantized for _, quantized in dense]
    dense_targets = full_precision_outputs(dense_weights, x)
    chunks = _routed_chunks(x, routing.to(x.device), experts, chunk_elements)
    errors = []
    for exponent in grid:
        s = smoothing_scales(act_max, None, exponent).to(x.device)
        xq = fake_quantize_activations(x / s, a_bits, per_token=True, symmetric=a_symmetric)
        error = _routed_experts_error(experts, xq, s, w_spec, chunks)
        if dense_weights:
            error += joint_w8a8_error(dense_weights, x, s, w_spec, a_bits, a_symmetric=a_symmetric,
                                      quantize_weights=dense_flags, targets=dense_targets)
        errors.append(error)
    return pick_exponent(grid, errors, act_max)


def pick_exponent(grid: Sequence[float], errors: Sequence[float], act_max: torch.Tensor) -> SmoothingSearch:
    """The HAQ search's choice from its grid's errors (eq. 3): the smallest error, ties to the smallest e. Also
    used where the errors are summed from several ranks' shares of the experts (hexq.calib.scales)."""
    best = min(range(len(grid)), key=lambda i: (errors[i], i))
    return SmoothingSearch(exponent=grid[best], scales=smoothing_scales(act_max, None, grid[best]), grid=tuple(grid),
                           errors=tuple(errors), baseline_error=errors[0])
