"""Dense bit packing of integer codes for every width 1..8.

Layout: codes are flattened (row-major) into one little-endian bit stream. Code i occupies stream bits
[i*bits, (i+1)*bits), least significant bit first, and stream bit j is bit (j % 8) of byte j // 8. The last byte is
zero-padded. So n codes of `bits` bits take exactly ceil(bits*n/8) bytes, with no per-row or per-byte padding
(3-bit codes cost 3 bits each, not 4). Shapes are not stored: the caller keeps numel (and the shape) alongside.
"""

from __future__ import annotations

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
    flat = flat.to(torch.uint8)
    # [numel, bits] matrix of code bits, LSB first; row-major flattening is the bit stream.
    stream = ((flat[:, None] >> torch.arange(bits, dtype=torch.uint8, device=flat.device)) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
    # each row of 8 stream bits is one byte; the bits are distinct, so a uint8 sum cannot overflow.
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    return (stream.reshape(-1, 8) << byte_shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` codes as a 1-D uint8 tensor (reshape to the stored shape)."""
    expected = packed_nbytes(numel, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got dtype {packed.dtype} and shape {tuple(packed.shape)}")
    if packed.numel() != expected:
        raise ValueError(f"packed buffer has {packed.numel()} bytes, expected {expected} for {numel} codes of "
                         f"{bits} bits")
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed[:, None] >> byte_shifts) & 1).reshape(-1)[: numel * bits]
    code_shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (stream.reshape(numel, bits) << code_shifts).sum(dim=1, dtype=torch.uint8)
