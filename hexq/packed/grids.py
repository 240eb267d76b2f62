"""Which stored codes have an exact form on an export scheme's T-bit integer grid (hexq.export.codec.retarget writes
them), and the width of the export replicas `hexq pack` keeps for the experts that do not."""

from __future__ import annotations

from collections.abc import Collection

EXPORT_BITS = 4  # the width of the export replicas `hexq pack` keeps (vLLM's fused-MoE W4A16)


def scheme_fits(bits: int, symmetric: bool, target: int, float_zero_bits: Collection[int] = ()) -> bool:
    """Whether a b-bit code of a hexq grid has an exact T-bit form (`retarget`); 0 bits (skipped) always does.
    float_zero_bits: the asymmetric widths whose zero points are floats (WeightQuant.float_zero_bits; 1 bit always
    is): no integer grid holds them."""
    if bits == 0:
        return True
    if symmetric:
        return target >= 2 if bits == 1 else bits <= target
    return bits != 1 and bits not in float_zero_bits and bits <= target
