"""hexq's stored codes as GGML blocks, and the float weights both stand for.

A stored matrix is hexq's w = (q - zero) * scale per group of input columns, scale and zero float16
(hexq.artifact.format.PackedWeight). Over 32-weight blocks (a group of 32k columns is k blocks with the same
parameters; a per-channel grid repeats over the whole row):
- Q4_1: d = scale, m = -zero * scale (computed in float32, rounded once to float16: the only rounding), q unchanged;
- Q4_0 and Q8_0 (symmetric grids, zero = 2^(b-1)): signed code q - 2^(b-1) with d = scale, exactly; 1-bit
  symmetric (zero 0.5) as 2q - 1 with d = scale / 2.
K-quant replicas are stored as their blocks already (hexq.gguf.kstore) and copied.
"""

from __future__ import annotations

import torch

from hexq.artifact.bitpack import unpack_bits
from hexq.artifact.format import PackedWeight, dequantize_packed
from hexq.gguf.blocks import Q4_0, Q4_1, Q8_0, BlockType, encode_q4_0, encode_q4_1, encode_q8_0, rtn_q8_0


def _block_params(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """scale and zero [rows, cols / 32] (float32) of a stored matrix: each group's over its blocks."""
    rows, cols = weight.shape
    per_group = cols // weight.scale.shape[1]
    if per_group % 32:
        raise ValueError(f"groups of {per_group} columns do not cover whole 32-weight blocks")
    repeat = per_group // 32
    return weight.scale.float().repeat_interleave(repeat, 1), weight.zero.float().repeat_interleave(repeat, 1)


def packed_blocks(weight: PackedWeight, symmetric: bool, kind: BlockType) -> torch.Tensor:
    """Blocks [rows, row_bytes] of `kind` holding a stored matrix (exact forms as in the module docstring; an
    asymmetric code in Q8_0 is re-rounded: rtn_q8_0 of its weights)."""
    rows, cols = weight.shape
    if kind == Q8_0 and not symmetric:
        return rtn_q8_0(dequantize_packed(weight))
    q = unpack_bits(weight.codes, weight.bits, rows * cols).reshape(rows, cols)
    scale, zero = _block_params(weight)
    if kind == Q4_1:
        if weight.bits > 4:
            raise ValueError(f"a {weight.bits}-bit code does not fit Q4_1")
        return encode_q4_1(q, scale, -zero * scale)
    if not symmetric or kind not in (Q4_0, Q8_0):
        raise ValueError(f"{kind.name} does not hold a {'symmetric' if symmetric else 'asymmetric'} code exactly")
    if weight.bits == 1:
        signed, d = 2 * q.to(torch.int16) - 1, scale / 2
    else:
        signed, d = q.to(torch.int16) - 2 ** (weight.bits - 1), scale
    if kind == Q4_0:
        if weight.bits > 4:
            raise ValueError(f"a {weight.bits}-bit code does not fit Q4_0")
        return encode_q4_0((signed + 8).to(torch.uint8), d)
    return encode_q8_0(signed.to(torch.int8), d)


def zero_blocks(rows: int, cols: int, kind: BlockType) -> torch.Tensor:
    """A matrix of exact zeros (a skipped expert): every block's scales are 0, and so is every weight."""
    return torch.zeros(rows, kind.row_bytes(cols), dtype=torch.uint8)
