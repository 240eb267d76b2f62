"""Dense bit packing of integer codes for every width 1..8.

Layout: codes are flattened (row-major) into one little-endian bit stream. Code i occupies stream bits
[i*bits, (i+1)*bits), least significant bit first, and stream bit j is bit (j % 8) of byte j // 8. The last byte is
zero-padded. So n codes of `bits` bits take exactly ceil(bits*n/8) bytes, with no per-row or per-byte padding
(3-bit codes cost 3 bits each, not 4). Shapes are not stored: the caller keeps numel (and the shape) alongside.
"""

from __future__ import annotations

import math

import torch


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for `numel` codes of `bits` bits: ceil(bits * numel / 8)."""
    _check_bits(bits)
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    return (bits * numel + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    """(bytes, codes) of the smallest whole-byte group: lcm(bits, 8) bits, e.g. 3 bytes hold 8 codes of 3 bits."""
    span = math.lcm(bits, 8)
    return span // 8, span // bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any shape, values in [0, 2^bits - 1]) into a 1-D uint8 tensor of packed_nbytes bytes."""
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor (uint8), got dtype {codes.dtype}")
    flat = codes.reshape(-1)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi > 2**bits - 1:
            raise ValueError(f"codes must lie in [0, {2**bits - 1}] for {bits} bits, got values in [{lo}, {hi}]")
    numel = flat.numel()
    group_bytes, group_codes = _group(bits)
    # The stream is little-endian: a group of `group_codes` codes is one integer sum(code_i << bits*i) (at most
    # 56 bits, so int64 holds it), written as its `group_bytes` low bytes.
    flat = torch.nn.functional.pad(flat.to(torch.int64), (0, (-numel) % group_codes)).reshape(-1, group_codes)
    code_shifts = bits * torch.arange(group_codes, dtype=torch.int64, device=flat.device)
    value = (flat << code_shifts).sum(dim=1)
    byte_shifts = 8 * torch.arange(group_bytes, dtype=torch.int64, device=flat.device)
    stream = ((value[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return stream[: packed_nbytes(numel, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` codes as a 1-D uint8 tensor (reshape to the stored shape)."""
    expected = packed_nbytes(numel, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got dtype {packed.dtype} and shape {tuple(packed.shape)}")
    if packed.numel() != expected:
        raise ValueError(f"packed buffer has {packed.numel()} bytes, expected {expected} for {numel} codes of "
                         f"{bits} bits")
    group_bytes, group_codes = _group(bits)
    if group_bytes == 1:  # 1, 2, 4 and 8 bits: whole codes per byte, no widening needed
        shifts = bits * torch.arange(group_codes, dtype=torch.uint8, device=packed.device)
        return ((packed[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:numel]
    grouped = torch.nn.functional.pad(packed, (0, (-packed.numel()) % group_bytes)).reshape(-1, group_bytes)
    byte_shifts = 8 * torch.arange(group_bytes, dtype=torch.int64, device=packed.device)
    value = (grouped.to(torch.int64) << byte_shifts).sum(dim=1)
    code_shifts = bits * torch.arange(group_codes, dtype=torch.int64, device=packed.device)
    return ((value[:, None] >> code_shifts) & (2**bits - 1)).to(torch.uint8).reshape(-1)[:numel]
