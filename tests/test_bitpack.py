"""Dense bit packing: round trips over every width and odd shapes, exact sizes, layout, errors."""

from __future__ import annotations

import math

import pytest
import torch

from hexq.artifact.bitpack import pack_bits, packed_nbytes, unpack_bits


def _codes(shape: tuple[int, ...], bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (13,), (3, 5), (2, 3, 11), (64, 129)])
def test_round_trip(bits: int, shape: tuple[int, ...]) -> None:
    codes = _codes(shape, bits, seed=bits)
    packed = pack_bits(codes, bits)
    numel = codes.numel()
    assert packed.dtype == torch.uint8 and packed.ndim == 1
    assert packed.numel() == packed_nbytes(numel, bits) == math.ceil(bits * numel / 8)
    assert torch.equal(unpack_bits(packed, bits, numel).reshape(shape), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_extreme_values_round_trip(bits: int) -> None:
    codes = torch.tensor([0, 2**bits - 1] * 9 + [2**bits - 1], dtype=torch.uint8)  # 19 codes
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 19), codes)


def test_exact_sizes() -> None:
    assert packed_nbytes(8, 3) == 3
    assert packed_nbytes(1000, 3) == 375
    assert packed_nbytes(1001, 3) == 376  # 3003 bits
    assert packed_nbytes(5, 5) == 4  # 25 bits
    assert packed_nbytes(0, 7) == 0
    assert pack_bits(_codes((1001,), 3), 3).numel() == 376


def test_known_vectors() -> None:
    # 3-bit stream 1 | 2<<3 | 3<<6 | 4<<9 | 5<<12 | 6<<15 | 7<<18 | 0<<21 = 0x1F58D1, little-endian bytes D1 58 1F
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    assert pack_bits(codes, 3).tolist() == [0xD1, 0x58, 0x1F]
    # 5 | 3<<3 | 1<<6 = 93 in byte 0, zero padding after the 9th bit
    assert pack_bits(torch.tensor([5, 3, 1], dtype=torch.uint8), 3).tolist() == [93, 0]
    # 1 bit: first code is the least significant bit
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 0x01]
    # 4 bit: low nibble first; 8 bit: identity
    assert pack_bits(torch.tensor([0xA, 0x3], dtype=torch.uint8), 4).tolist() == [0x3A]
    assert pack_bits(torch.tensor([7, 200], dtype=torch.uint8), 8).tolist() == [7, 200]


def test_wider_integer_dtypes_accepted() -> None:
    codes = torch.tensor([[3, 0], [1, 2]], dtype=torch.int64)
    assert torch.equal(unpack_bits(pack_bits(codes, 2), 2, 4), codes.reshape(-1).to(torch.uint8))


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"\[0, 7\].*\[0, 8\]"):
        pack_bits(torch.tensor([0, 8], dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="got values in"):
        pack_bits(torch.tensor([-1, 2]), 3)
    with pytest.raises(ValueError, match="integer"):
        pack_bits(torch.tensor([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([0], dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bits"):
        packed_nbytes(4, 0)
    packed = pack_bits(_codes((10,), 3), 3)  # 4 bytes
    with pytest.raises(ValueError, match="has 4 bytes, expected 3"):
        unpack_bits(packed, 3, 8)
    with pytest.raises(ValueError, match="has 3 bytes, expected 4"):
        unpack_bits(packed[:3], 3, 10)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(packed.to(torch.int32), 3, 10)
    with pytest.raises(ValueError, match="non-negative"):
        packed_nbytes(-1, 3)
