"""One quantized matrix as stored: bit-packed codes plus a scale and a zero per group, and the float matrix it stands
for. Calibration banks, artifacts, the export and the runtime all store and read this one form.

Scales and zeros are stored as float16 (SCALE_DTYPE): the weights every consumer computes are `dequantize_packed` of
these bytes, which is the model's definition from calibration on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hexq.packed.bitpack import OUT_DTYPES, DequantScratch, dequantize_into, pack_bits, packed_nbytes

# Bytes a code buffer keeps after its last code for kernels that read two bytes per code (hexq.packed.triton): the
# second load of the last code stays inside the buffer.
CODE_PAD = 8
SCALE_DTYPE = torch.float16
PROJECTIONS = ("gate_up", "down")  # a routed expert's two stored matrices: gate and up fused [2I, H], down [H, I]
# How codes lie in memory (kernels.h, in this order): "stream" is what is stored (hexq.packed.bitpack); "planes",
# "rows8" (which re-lays the scales and zeros too, 8 rows interleaved) and "rows8z4" (rows8 with each zero a 4-bit
# integer: kernels.c "zeros as 4-bit integers") are the CPU kernels' forms, made at load by CpuKernels.relayout and
# read only by the CPU kernels.
LAYOUTS = ("stream", "planes", "rows8", "rows8z4")
ROWS8_LAYOUTS = ("rows8", "rows8z4")
ROWS8 = 8  # rows a group of a rows8 layout interleaves


class Grid(Protocol):
    """What pack_weight needs of a quantizer's meta (hexq.algos.quant.QuantMeta): the width and per-group grid."""

    bits: int
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True)
class PackedWeight:
    """One quantized matrix as stored: packed codes [ceil(bits*numel/8)] uint8, scale and zero [out, groups]; its
    codes in `layout` (LAYOUTS: as stored unless the CPU kernels re-laid them; rows8z4's zero is [out / 4, groups],
    its float16 array's first quarter holding 4-bit zeros: `nbytes` is what a product reads)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    shape: tuple[int, int]
    layout: str = "stream"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.codes": self.codes, f"{prefix}.scale": self.scale, f"{prefix}.zero": self.zero}

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Rows [start, stop) as a PackedWeight of their own (views, no copy): in any layout a row's codes are its
        own cols * bits / 8 bytes when that is a whole number (in a rows8 layout, those of whole groups of 8 rows)."""
        rows, cols = self.shape
        if cols * self.bits % 8:
            raise ValueError(f"a row of {cols} {self.bits}-bit codes does not end on a byte: rows cannot be cut out")
        start, stop = max(0, start), min(rows, stop)
        if self.layout in ROWS8_LAYOUTS and (start % ROWS8 or stop % ROWS8):
            raise ValueError(f"rows [{start}, {stop}) of a rows8 matrix: the layout interleaves groups of {ROWS8}")
        row_bytes = cols * self.bits // 8
        zero = zero_rows(self.zero, self.layout, start, stop)
        return PackedWeight(self.codes[start * row_bytes:stop * row_bytes], self.scale[start:stop], zero, self.bits,
                            (stop - start, cols), self.layout)


def zero_rows(zero: torch.Tensor, layout: str, start: int, stop: int) -> torch.Tensor:
    """The zeros of rows [start, stop) of a matrix in `layout`, from its zero array: in rows8z4, whose zeros are 4-bit
    integers in row order over the float16 array's first quarter (CpuKernels.relayout), that array's rows
    [start / 4, stop / 4); else its rows [start, stop)."""
    return zero[start // 4:stop // 4] if layout == "rows8z4" else zero[start:stop]


def zeros_as_laid(zero: torch.Tensor, layout: str) -> torch.Tensor:
    """The zeros a matrix in `layout` reads, from their whole float16 array [rows, groups] (zero_rows of every row)."""
    return zero_rows(zero, layout, 0, zero.shape[0])


def pack_weight(codes: torch.Tensor, meta: Grid) -> PackedWeight:
    """Codes [out, in] (integers on meta's grid) and their meta as stored bytes."""
    return PackedWeight(pack_bits(codes, meta.bits), meta.scale.to(SCALE_DTYPE).contiguous(),
                        meta.zero.to(SCALE_DTYPE).contiguous(), meta.bits, tuple(codes.shape))


def dequantize_packed(weight: PackedWeight, dtype: torch.dtype = torch.float32,
                      scratch: DequantScratch | None = None) -> torch.Tensor:
    """The float matrix [out, in] a PackedWeight stands for, in `dtype`, on the device of its codes.

    bfloat16, float16 and float32 are produced directly (bitpack.dequantize_into); other dtypes are the float32
    result converted.
    """
    direct = dtype if dtype in OUT_DTYPES else torch.float32
    out = torch.empty(weight.shape, dtype=direct, device=weight.codes.device)
    return dequantize_packed_into(out, weight, scratch).to(dtype)


def dequantize_packed_into(out: torch.Tensor, weight: PackedWeight,
                           scratch: DequantScratch | None = None) -> torch.Tensor:
    """Write the matrix a PackedWeight stands for into `out` (preallocated [out, in], bfloat16, float16 or float32,
    on the codes' device) and return it; `scratch` is the reusable code buffer (see bitpack.DequantScratch)."""
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out has shape {list(out.shape)}, the packed weight is {list(weight.shape)}")
    if weight.layout != "stream":
        raise ValueError(f"codes in the {weight.layout} layout are read by the CPU kernels only")
    rows, cols = weight.shape
    groups = weight.scale.shape[-1] if weight.scale.ndim == 2 else 0
    if not groups or cols % groups:
        raise ValueError(f"packed weight scale has shape {list(weight.scale.shape)}: expected [{rows}, groups] with "
                         f"groups dividing {cols}")
    return dequantize_into(out, weight.codes, weight.bits, weight.scale, weight.zero, cols // groups, scratch)


def packed_weight_nbytes(shape: tuple[int, int], bits: int, group_size: int) -> int:
    """Bytes of a PackedWeight: ceil(bits*numel/8) of codes plus a float16 scale and zero per group."""
    rows, cols = shape
    groups = rows * (cols // group_size)
    return packed_nbytes(rows * cols, bits) + 2 * groups * torch.finfo(SCALE_DTYPE).bits // 8
