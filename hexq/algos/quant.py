"""Uniform integer quantization of weights and activations.

quantize(W, spec) -> (q, QuantMeta) and dequantize(q, meta) are exact inverses up to rounding:
W ~= (q - zero) * scale, with q in [0, 2^bits - 1] (asymmetric) or [-2^(bits-1), 2^(bits-1) - 1] stored
offset by 2^(bits-1) (symmetric, zero fixed at the midpoint). Groups run along the input dimension
(the last axis) in blocks of `group_size` columns; group_size=None means one group per output row
(per-channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ONE_BIT_GRIDS = ("minmax", "spread")  # the levels of an asymmetric 1-bit grid (grid_params)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize a weight matrix [out, in]."""

    bits: int
    group_size: int | None = None  # None: per output channel
    symmetric: bool = True
    one_bit: str = "minmax"  # asymmetric 1 bit: levels at min and max, or "spread" (one_bit_levels)
    # asymmetric: the widths (2 and up) whose grid spans [min, max] with a float zero point; a tuple of widths, not
    # a flag, so that a bank's specs made from one template by replace(bits=...) keep it (recipe.WeightQuant's)
    float_zero_bits: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        if self.one_bit not in ONE_BIT_GRIDS:
            raise ValueError(f"one_bit must be one of {ONE_BIT_GRIDS}, got {self.one_bit!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be positive or None, got {self.group_size}")

    @property
    def float_zero(self) -> bool:
        """Whether this width's asymmetric grid spans [min, max] with a float zero point (grid_params)."""
        return self.bits in self.float_zero_bits

    @property
    def zero_is_float(self) -> bool:
        """Whether the grid's zero point is a float (asymmetric 1 bit, or a float_zero width): grid_params."""
        return not self.symmetric and (self.bits == 1 or self.float_zero)

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1


@dataclass(frozen=True)
class QuantMeta:
    """Scales and zero points, each [out, n_groups]; `group_size` columns share one (scale, zero)."""

    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int


# The "spread" 1-bit levels, mean -+ SPREAD x the group's mean absolute deviation: chosen on the reference
# Qwen3-MoE's experts (GPTQ, groups of 32, act_order; mean loss-table MSE of the 1-bit replicas, 16 windows): min/max
# 0.567; spread 1.0: 1.093, 1.25: 0.557, 1.5: 0.301, 1.75: 0.256, 2.0: 0.302. Min and max of a group of 32 lie ~2.5
# deviations out, so most weights sit far from both levels; the mean absolute deviation alone (the L1-optimal
# binarization's scale) is too narrow once GPTQ's updates push the later columns outward.
SPREAD = 1.75


def one_bit_levels(w: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The spread 1-bit levels of w along `dim`: mean -+ SPREAD x mean |w - mean|."""
    mean = w.mean(dim=dim, keepdim=True)
    deviation = (w - mean).abs().mean(dim=dim)
    mean = mean.squeeze(dim)
    return mean - SPREAD * deviation, mean + SPREAD * deviation


def grid_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for each row of w [rows, cols], from the row's min/max (RTN grid).

    Symmetric (the GPTQ reference convention): scale = 2*max|w| / qmax, zero at (qmax+1)/2, so the levels run
    from -(qmax+1)/qmax*max|w| to (qmax-1)/qmax*max|w|; 1-bit symmetric uses the sign levels +-max|w|/2.
    Asymmetric: the grid spans [min(w,0), max(w,0)] with an integer zero point, so 0 is exact; at a width in
    float_zero_bits it spans [min(w), max(w)] with a float zero point (every level inside the group's range: at 2
    bits, widening a group of 32 to include 0 and rounding its zero point put a level outside it and clipped the
    other end); 1-bit asymmetric uses the two levels {min(w), max(w)}, or with one_bit "spread" the levels of
    one_bit_levels.
    """
    if spec.symmetric:
        amax = w.abs().amax(dim=-1).clamp(min=1e-8)
        scale = 2 * amax / spec.qmax
        zero = torch.full_like(scale, float((spec.qmax + 1) // 2))
        if spec.bits == 1:
            # Levels (q - zero) in {-1, 0} would lose the sign: centre on +-0.5 instead.
            zero = torch.full_like(scale, 0.5)
            scale = 2 * amax / 2
    elif spec.zero_is_float:
        # The range itself, the zero point a float. 1 bit: two levels {min, max} (forcing 0 into the range, below,
        # would collapse most weights to 0), or the spread levels.
        spread = spec.bits == 1 and spec.one_bit == "spread"
        wmin, wmax = one_bit_levels(w) if spread else (w.amin(dim=-1), w.amax(dim=-1))
        scale = ((wmax - wmin) / spec.qmax).clamp(min=1e-8)
        zero = -wmin / scale
    else:
        wmin = w.amin(dim=-1).clamp(max=0)
        wmax = w.amax(dim=-1).clamp(min=0)
        scale = ((wmax - wmin) / spec.qmax).clamp(min=1e-8)
        zero = torch.round(-wmin / scale)
    return scale, zero


def quantize_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """Integer codes of w on the grid (scale, zero), broadcast along the last axis of w."""
    return torch.clamp(torch.round(w / scale + zero), 0, qmax)


def quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, QuantMeta]:
    """Round-to-nearest quantization of w [out, in]: integer codes (uint8) and their QuantMeta."""
    out_features, in_features = w.shape
    group = in_features if spec.group_size is None else spec.group_size
    if in_features % group:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group}")
    grouped = w.float().reshape(out_features, in_features // group, group)
    scale, zero = grid_params(grouped, spec)
    codes = quantize_to_grid(grouped, scale[..., None], zero[..., None], spec.qmax)
    return codes.reshape(out_features, in_features).to(torch.uint8), QuantMeta(scale, zero, group, spec.bits)


def dequantize(codes: torch.Tensor, meta: QuantMeta) -> torch.Tensor:
    """Float weights [..., out, in] from integer codes and their QuantMeta (scale and zero [..., out, n_groups]: a
    batch of matrices, e.g. a chunk of experts' replicas, takes leading dimensions)."""
    *lead, in_features = codes.shape
    dtype = torch.promote_types(torch.promote_types(torch.float32, meta.zero.dtype), meta.scale.dtype)
    grouped = codes.to(dtype, copy=True).reshape(*lead, in_features // meta.group_size, meta.group_size)
    return grouped.sub_(meta.zero[..., None]).mul_(meta.scale[..., None]).reshape(*lead, in_features)  # one buffer


def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: the weight the quantized model computes with."""
    return dequantize(*quantize(w, spec)).to(w.dtype)


def fake_quantize_activations(x: torch.Tensor, bits: int, per_token: bool = True, symmetric: bool = False,
                              scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Activation fake quantization along the last axis: dynamic per token (each row its own range), dynamic
    per tensor, or static when `scale`/`zero` are given (calibrated per-tensor range)."""
    spec = QuantSpec(bits=bits, symmetric=symmetric)
    if scale is None:
        rows = x.reshape(-1, x.shape[-1]) if per_token else x.reshape(1, -1)
        scale, zero = grid_params(rows.float(), spec)
        scale, zero = scale[:, None], zero[:, None]
        codes = quantize_to_grid(rows.float(), scale, zero, spec.qmax)
        return ((codes - zero) * scale).reshape(x.shape).to(x.dtype)
    codes = quantize_to_grid(x.float(), scale, zero, spec.qmax)
    return ((codes - zero) * scale).to(x.dtype)
