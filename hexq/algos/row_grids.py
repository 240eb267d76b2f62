"""The grids of GPTQ's stacked rows (hexq.algos.gptq.gptq_bank): rows of several widths, and of several ranges of one
width (clip_bits), quantized in one column loop, each with the grid quant.grid_params would give its width."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hexq.algos.clipping import fit_grid
from hexq.algos.quant import QuantSpec, one_bit_levels


@dataclass(frozen=True)
class RowGrids:
    """Per stacked row [B * out]: what quant.grid_params needs to know about that row's width."""

    qmax: torch.Tensor  # 2^bits - 1
    one_bit: torch.Tensor  # bool
    spread: torch.Tensor  # bool: a 1-bit asymmetric row whose levels are quant.one_bit_levels
    float_zero: torch.Tensor  # bool: a row whose asymmetric grid spans [min, max] with a float zero (1 bit, float_zero)
    sym_divisor: torch.Tensor  # scale = 2 max|w| / divisor: qmax, or 2 for 1 bit (levels +-max|w|/2)
    sym_zero: torch.Tensor  # (qmax + 1) / 2, or 0.5 for 1 bit
    symmetric: bool
    ratio: torch.Tensor | None  # the fraction of its range each row's grid spans (clip_bits); None: every row all

    @classmethod
    def build(cls, specs: Sequence[QuantSpec], rows: int, dtype: torch.dtype, device: torch.device,
              ratios: Sequence[float] = ()) -> RowGrids:
        """specs: per stacked width its QuantSpec; ratios (empty: all 1): the fraction of the range its grids span."""
        def per_row(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(rows)

        return cls(ratio=per_row(list(ratios)) if any(r != 1.0 for r in ratios) else None,
                   qmax=per_row([s.qmax for s in specs]),
                   one_bit=per_row([s.bits == 1 for s in specs]).bool(),
                   float_zero=per_row([s.bits == 1 or s.float_zero for s in specs]).bool(),
                   spread=per_row([s.bits == 1 and not s.symmetric and s.one_bit == "spread"
                                   for s in specs]).bool(),
                   sym_divisor=per_row([2 if s.bits == 1 else s.qmax for s in specs]),
                   sym_zero=per_row([0.5 if s.bits == 1 else float((s.qmax + 1) // 2) for s in specs]),
                   symmetric=specs[0].symmetric)

    def params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """quant.grid_params for rows of different widths, from each row's (or group's) min and max along the last
        axis of the stacked rows: same conventions and the same float operations, so the grids are identical. Rows
        with a ratio below 1 first narrow [lo, hi] about its middle (symmetric grids: max |w|) to that fraction."""
        if self.ratio is not None:
            if self.symmetric:  # a ratio of 1 leaves lo and hi exactly as they are
                lo, hi = lo * self.ratio, hi * self.ratio
            else:  # the middle and half-range of a whole-range row need not give back its lo and hi exactly
                middle, half = (lo + hi) / 2, (hi - lo) / 2 * self.ratio
                narrowed = self.ratio < 1
                lo, hi = torch.where(narrowed, middle - half, lo), torch.where(narrowed, middle + half, hi)
        if self.symmetric:
            amax = torch.maximum(-lo, hi).clamp(min=1e-8)  # max |w|, exactly
            scale = 2 * amax / self.sym_divisor
            return scale, self.sym_zero.expand_as(scale).clone()
        # 1 bit asymmetric and float_zero: the range [min, max]; otherwise widened to include 0, the zero rounded.
        lo = torch.where(self.float_zero, lo, lo.clamp(max=0))
        hi = torch.where(self.float_zero, hi, hi.clamp(min=0))
        scale = ((hi - lo) / self.qmax).clamp(min=1e-8)
        zero = -lo / scale
        return scale, torch.where(self.float_zero, zero, torch.round(zero))

    def bounds(self, columns: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) of each row's values along `dim` of columns [..., R] (R stacked rows last): min and max, or the
        spread rows' quant.one_bit_levels."""
        lo, hi = columns.amin(dim=dim), columns.amax(dim=dim)
        if bool(self.spread.any()):
            low, high = one_bit_levels(columns, dim)
            lo, hi = torch.where(self.spread, low, lo), torch.where(self.spread, high, hi)
        return lo, hi

    def fitted(self, columns: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The grids of groups columns [..., g, R] (g columns of the R stacked rows): `params` from their bounds,
        then, for the stacked rows `rows` (None: none), fitted to the columns with column weights weight [..., g]
        (hexq.algos.clipping.fit_grid)."""
        scale, zero = self.params(*self.bounds(columns, -2))
        if rows is not None:
            scale[..., rows], zero[..., rows] = fit_grid(columns[..., rows], weight, scale[..., rows],
                                                         zero[..., rows], self.qmax[rows], self.one_bit[rows],
                                                         self.float_zero[rows], self.symmetric)
        return scale, zero
