"""The grid of each quantization group fitted to its weights: scale and zero point minimising the Hessian-weighted
error instead of spanning the group's min and max.

A min/max grid wastes levels on the group's extremes: at 2 bits four levels span the whole range, at 1 bit the two
levels {min, max} sit where almost no weight is. For a group w_1..w_g (one row, g columns) with column weights c_j,
the error of a grid (s, z) is

    err(s, z) = sum_j c_j (s (q_j - z) - w_j)^2,    q_j = clamp(round(w_j / s + z), 0, qmax)

a diagonal stand-in for GPTQ's objective ||(W - Q) X||^2 (eq. 4). With c_j = [H]_jj it is the importance-weighted
MSE of llm-compressor's MSE observer and llama.cpp's imatrix, which takes no compensation into account; hexq uses
what a column's rounding error costs once GPTQ compensates it: inside the column loop c_j = 1 / [H_F^-1]_jj (eq. 5,
the later columns compensate), before it (static grids) c_j = 1 / [H^-1]_jj (every other column does).

The fit alternates the two steps of Lloyd's algorithm on a uniform grid (the half-quadratic split of HQQ with an
exact second step): codes q for the current grid (nearest level), then the grid for the current codes, which is a
weighted least-squares line w ~ s q + m with the moments S_0 = sum c, S_q = sum c q, S_qq = sum c q^2,
S_w = sum c w, S_qw = sum c q w:

    s = (S_0 S_qw - S_q S_w) / (S_0 S_qq - S_q^2),    m = (S_w - s S_q) / S_0,    z = -m / s

Widths >= 2 keep an integer zero point in [0, qmax] (0 stays exact and the code has the exact wider form exports
need): z is rounded and clamped, then s is refitted with z fixed, s = sum c (q - z) w / sum c (q - z)^2. Symmetric
grids keep their fixed midpoint and refit s only. 1-bit asymmetric grids take the free z (their two levels are the
weighted means of the two halves: 2-means). Each group keeps the best grid seen, the min/max start included, so the
fit never raises err.

Lloyd's steps find a local optimum near their start: from min/max, a far weight of little importance keeps one of
a 1-bit grid's two levels to itself. So 1-bit steps start from the better (by err) of the min/max grid and the grid
+- 0.798 weighted standard deviations around the weighted mean (the mean-square optimal 2-level quantizer of a
Gaussian, Max, "Quantizing for minimum distortion", 1960). Wider grids start from min/max only: started from the
Gaussian-optimal range (+- 1.494, 2.051, 2.513 sigma at 2, 3, 4 bits) the fit lowers each group's err further but
raised the 2-bit expert output error by 2-35% on the reference models' experts (the clipped weights' errors are what
GPTQ then has to compensate).
"""

from __future__ import annotations

import torch

# Lloyd steps per group: the first two give nearly all of the gain (measured on the reference models' experts at
# 1-3 bits: the output MSE after 2 and after 16 steps agree within 3%).
FIT_STEPS = 2
_TINY = 1e-8  # the smallest scale quant.grid_params allows
ONE_BIT_RANGE = 0.798  # the 1-bit start's half range in standard deviations (module docstring)


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """Nearest codes of w [..., g, R] on the grids scale, zero [..., R] (quant.quantize_to_grid, per-row qmax)."""
    q = (w / scale[..., None, :]).add_(zero[..., None, :]).round_().clamp_(min=0)
    return torch.minimum(q, qmax, out=q)


def _weighted_sum(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_j c_j x_jr over the group axis: c [..., g], x [..., g, R] -> [..., R] (one batched product)."""
    return (c[..., None, :] @ x)[..., 0, :]


def grid_error(w: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               qmax: torch.Tensor) -> torch.Tensor:
    """err(s, z) of every group: w [..., g, R] (g columns of R rows), c [..., g], scale, zero [..., R] -> [..., R]."""
    e = (_codes(w, scale, zero, qmax) - zero[..., None, :]).mul_(scale[..., None, :]).sub_(w)
    return _weighted_sum(c, e.square_())


def _one_bit_start(mean: torch.Tensor, spread: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit grids [..., R] with levels mean -+ ONE_BIT_RANGE spread (symmetric: -+ that much around 0, the fixed
    midpoint 0.5 of quant.grid_params)."""
    half = (ONE_BIT_RANGE * spread).clamp(min=_TINY)
    if symmetric:
        return 2 * (mean.abs() + half), torch.full_like(mean, 0.5)
    return 2 * half, (half - mean) / (2 * half)


def fit_grid(w: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: torch.Tensor,
             one_bit: torch.Tensor, float_zero: torch.Tensor, symmetric: bool,
             steps: int = FIT_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The grids (scale, zero) [..., R] minimising err (module docstring) for groups w [..., g, R] with column weights
    c [..., g] >= 0, started from the min/max grids scale, zero [..., R]; qmax, one_bit, float_zero (the zero point
    stays a float: no rounding) [R] per row.

    A group whose columns all have weight 0 keeps its start. Every tensor is made on w's device, in w's dtype.
    """
    best = grid_error(w, c, scale, zero, qmax)
    s0 = c.sum(dim=-1, keepdim=True)  # [..., 1]
    sw = _weighted_sum(c, w)
    best_scale, best_zero = scale, zero
    if bool(one_bit.any()):
        mean = sw / s0.clamp(min=torch.finfo(w.dtype).tiny)
        spread = (_weighted_sum(c, (w - mean[..., None, :]).square()) / s0.clamp(min=torch.finfo(w.dtype).tiny)).sqrt()
        start = _one_bit_start(mean, spread, symmetric)
        error = grid_error(w, c, *start, qmax)
        better = (error < best) & one_bit
        best = torch.where(better, error, best)
        scale = best_scale = torch.where(better, start[0], scale)
        zero = best_zero = torch.where(better, start[1], zero)
    for _ in range(steps):
        q = _codes(w, scale, zero, qmax)
        if symmetric:
            new_zero = zero
        else:
            sq, sqq, sqw = _weighted_sum(c, q), _weighted_sum(c, q * q), _weighted_sum(c, q * w)
            det = s0 * sqq - sq * sq
            line = (s0 * sqw - sq * sw) / det.clamp(min=torch.finfo(w.dtype).tiny)
            offset = (sw - line * sq) / s0.clamp(min=torch.finfo(w.dtype).tiny)
            free_zero = -offset / line.clamp(min=_TINY)
            new_zero = torch.where(float_zero, free_zero, free_zero.round().clamp(min=0).minimum(qmax))
            # a group whose codes all fell on one level has no line: keep its zero point
            new_zero = torch.where(det > 0, new_zero, zero)
        r = q.sub_(new_zero[..., None, :])
        new_scale = _weighted_sum(c, r * w) / _weighted_sum(c, r.square_()).clamp(min=torch.finfo(w.dtype).tiny)
        usable = torch.isfinite(new_scale) & (new_scale > _TINY) & torch.isfinite(new_zero)
        scale = torch.where(usable, new_scale, scale)
        zero = torch.where(usable, new_zero, zero)
        error = grid_error(w, c, scale, zero, qmax)
        better = error < best
        best = torch.where(better, error, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero
