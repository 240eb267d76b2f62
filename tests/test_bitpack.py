"""Dense bit packing and dequantization: round trips over every width and odd shapes, exact sizes, layout, results
against the float32 reference in every destination dtype, scratch reuse, devices, errors."""

from __future__ import annotations

import math

import pytest
import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.packed import bitpack
from hexq.packed.bitpack import DequantScratch, dequantize_into, pack_bits, packed_nbytes, unpack_bits
from hexq.packed.weight import PackedWeight, dequantize_packed, dequantize_packed_into
from tests.conftest import DEVICES


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


def test_large_odd_round_trip() -> None:
    # > one 64-code chunk, not a multiple of it: exercises the word paths and the tail of every width
    for bits in range(1, 9):
        codes = _codes((3, 1001), bits, seed=10 + bits)
        assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, codes.numel()).reshape(3, 1001), codes)


def test_unpack_misaligned_stream() -> None:
    # a stream read from a file mapping may start at any byte offset
    for bits in range(1, 9):
        for numel in (320, 333):  # whole 64-code chunks (no padding needed), and a tail
            codes = _codes((numel,), bits, seed=bits)
            packed = pack_bits(codes, bits)
            shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), packed])[3:]
            assert shifted.storage_offset() == 3
            assert torch.equal(unpack_bits(shifted, bits, numel), codes)


# ------------------------------------------------------------------------------------------ dequantize_into

SHAPES = [(7, 96, 32), (5, 256, 128), (3, 100, None)]  # (rows, cols, group_size); None: one group per row
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _packed_weight(rows: int, cols: int, bits: int, group: int | None, symmetric: bool, seed: int = 0):
    """(packed codes, float16 scale, float16 zero, group_size, float32 reference) as hexq packs a weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    codes, meta = quantize(w, QuantSpec(bits, group, symmetric=symmetric))
    scale, zero = meta.scale.half(), meta.zero.half()
    reference = dequantize(codes, QuantMeta(scale.float(), zero.float(), meta.group_size, bits))
    return pack_bits(codes, bits), scale, zero, meta.group_size, reference


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_into_matches_reference(bits: int, shape: tuple, symmetric: bool) -> None:
    rows, cols, group = shape
    packed, scale, zero, group_size, reference = _packed_weight(rows, cols, bits, group, symmetric, seed=bits)
    if bits == 1:  # the 1-bit grids: zero 0.5 (symmetric) or -min/scale, not an integer (asymmetric)
        assert not torch.equal(zero, zero.round())
    for dtype in DTYPES:
        out = torch.full((rows, cols), float("nan"), dtype=dtype)
        assert dequantize_into(out, packed, bits, scale, zero, group_size) is out
        # float32: the reference itself; half types: the float32 reference converted, bit for bit (hexq's grids have
        # zero = 0 or |zero| >= 2^-6)
        assert torch.equal(out, reference.to(dtype)), dtype


def _within_one_rounding(out: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor) -> bool:
    """|out - exact| <= slack + half a unit in the last place of out's dtype at |exact| + slack (eps/2 * |x| bounds
    half an ulp at x; the smallest normal stands in for subnormals)."""
    eps, tiny = torch.finfo(out.dtype).eps, torch.finfo(out.dtype).smallest_normal
    half_ulp = (exact.abs() + slack).clamp(min=tiny) * eps / 2
    return bool(((out.double() - exact).abs() <= half_ulp + slack).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.float32])
def test_dequantize_into_arbitrary_grid(bits: int, param_dtype: torch.dtype) -> None:
    # zeros that are not integers, negative or beyond the code range, and float32 parameters: float32 out is still
    # the reference exactly, half types within one rounding of the exact value
    rows, cols, group_size = 9, 64, 16
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (rows, cols), generator=g).to(torch.uint8)
    scale = (torch.rand(rows, cols // group_size, generator=g) * 0.1 + 1e-3).to(param_dtype)
    zero = ((torch.rand(rows, cols // group_size, generator=g) * 1.5 - 0.25) * 2**bits).to(param_dtype)
    packed = pack_bits(codes, bits)
    reference = dequantize(codes, QuantMeta(scale.float(), zero.float(), group_size, bits))
    s = scale.double().repeat_interleave(group_size, dim=1)
    z = zero.double().repeat_interleave(group_size, dim=1)
    exact = (codes.double() - z) * s
    out32 = dequantize_into(torch.empty(rows, cols), packed, bits, scale, zero, group_size)
    assert torch.equal(out32, reference)
    slack = 2.0**-22 * (codes.double() + z.abs()) * s  # float32 rounding of q*scale - zero*scale
    for dtype in (torch.bfloat16, torch.float16):
        out = dequantize_into(torch.empty(rows, cols, dtype=dtype), packed, bits, scale, zero, group_size)
        assert _within_one_rounding(out, exact, slack), dtype


def test_scratch_reuse_across_shapes_and_widths() -> None:
    shapes = [(7, 96), (5, 256), (3, 100), (1, 32)]
    scratch = DequantScratch.for_shapes(shapes, "cpu")
    assert scratch.nbytes == DequantScratch.nbytes_for(5 * 256) == 1280
    assert DequantScratch.nbytes_for(300) == 320  # rounded up to 64 codes
    for round_ in range(2):
        for bits in (3, 1, 8, 4, 7, 2):
            for rows, cols in shapes:
                group = cols // 2 if cols % 2 == 0 else None
                packed, scale, zero, group_size, reference = _packed_weight(rows, cols, bits, group, False, round_)
                out = torch.empty(rows, cols, dtype=torch.bfloat16)
                dequantize_into(out, packed, bits, scale, zero, group_size, scratch)
                assert torch.equal(out, reference.bfloat16()), (bits, rows, cols)


def test_out_in_a_larger_buffer() -> None:
    # out may be a view at any element offset of a larger buffer (its memory doubles as unpack workspace)
    packed, scale, zero, group_size, reference = _packed_weight(8, 64, 3, 32, False)
    slab = torch.zeros(3 + 8 * 64 + 5, dtype=torch.bfloat16)
    out = slab[3:3 + 8 * 64].view(8, 64)
    dequantize_into(out, packed, 3, scale, zero, group_size)
    assert torch.equal(out, reference.bfloat16())
    assert not slab[:3].any() and not slab[-5:].any()


def test_dequantize_packed_through_new_path() -> None:
    packed, scale, zero, group_size, reference = _packed_weight(6, 64, 3, 32, False)
    weight = PackedWeight(packed, scale, zero, 3, (6, 64))
    assert torch.equal(dequantize_packed(weight), reference)
    assert torch.equal(dequantize_packed(weight, torch.bfloat16), reference.bfloat16())
    assert torch.equal(dequantize_packed(weight, torch.float64), reference.double())
    out = torch.empty(6, 64, dtype=torch.bfloat16)
    assert dequantize_packed_into(out, weight, DequantScratch(6 * 64, "cpu")) is out
    assert torch.equal(out, reference.bfloat16())
    with pytest.raises(ValueError, match=r"out has shape \[6, 32\]"):
        dequantize_packed_into(torch.empty(6, 32), weight)


def test_default_device_meta() -> None:
    # every tensor dequantize_into makes is put on the inputs' device, not on the default one
    packed, scale, zero, group_size, reference = _packed_weight(5, 96, 3, 32, False)
    weight = PackedWeight(packed, scale, zero, 3, (5, 96))
    codes = _codes((77,), 5)
    torch.set_default_device("meta")
    try:
        outs = [dequantize_into(torch.empty(5, 96, dtype=dtype, device="cpu"), packed, 3, scale, zero, group_size,
                                DequantScratch(5 * 96, "cpu")) for dtype in DTYPES]
        outs.append(dequantize_packed(weight, torch.bfloat16))
        round_trip = unpack_bits(pack_bits(codes, 5), 5, 77)
    finally:
        torch.set_default_device(None)
    for out, dtype in zip(outs, DTYPES + [torch.bfloat16], strict=True):
        assert out.device.type == "cpu" and torch.equal(out, reference.to(dtype))
    assert round_trip.device.type == "cpu" and torch.equal(round_trip, codes)


def test_no_temporary_above_code_buffer() -> None:
    # the largest block allocated during a call is the per-call scratch (one byte per code), nothing wider
    rows, cols = 64, 256
    packed, scale, zero, group_size, _ = _packed_weight(rows, cols, 3, 32, False)
    scratch = DequantScratch(rows * cols, "cpu")
    outs = [torch.empty(rows, cols, dtype=dtype) for dtype in DTYPES]
    with torch.profiler.profile(profile_memory=True) as prof:
        for out in outs:
            dequantize_into(out, packed, 3, scale, zero, group_size, scratch)
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocated and max(allocated) <= rows * cols // 8  # per-group parameters only


def test_dequantize_errors() -> None:
    packed, scale, zero, group_size, _ = _packed_weight(4, 64, 3, 32, False)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be bfloat16, float16 or float32"):
        dequantize_into(out.double(), packed, 3, scale, zero, group_size)
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_into(torch.empty(64, 4, dtype=torch.bfloat16).t(), packed, 3, scale, zero, group_size)
    with pytest.raises(ValueError, match="group_size must be a positive divisor of the 64 columns"):
        dequantize_into(out, packed, 3, scale, zero, 24)
    with pytest.raises(ValueError, match="has 96 bytes, expected 128"):
        dequantize_into(out, packed, 4, scale, zero, group_size)
    with pytest.raises(ValueError, match=r"scale must have shape \[rows, cols // group_size\] = \[4, 2\]"):
        dequantize_into(out, packed, 3, scale[:, :1], zero, group_size)
    with pytest.raises(ValueError, match="zero must be float16, bfloat16 or float32"):
        dequantize_into(out, packed, 3, scale, zero.to(torch.int32), group_size)
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        dequantize_into(out, packed, 0, scale, zero, group_size)
    with pytest.raises(ValueError, match="DequantScratch holds 192 bytes, a matrix of 256 codes needs 256"):
        dequantize_into(out, packed, 3, scale, zero, group_size, DequantScratch(150, "cpu"))
    with pytest.raises(ValueError, match="DequantScratch is on meta"):
        dequantize_into(out, packed, 3, scale, zero, group_size, DequantScratch(256, "meta"))
    with pytest.raises(ValueError, match="scale is on meta"):
        dequantize_into(out, packed, 3, scale.to("meta"), zero, group_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequantize_into_on_every_device(device: str, bits: int) -> None:
    """The same bits on every device this machine has (CUDA dequantized the bf16 fast tier wrongly once)."""
    packed, scale, zero, group_size, reference = _packed_weight(48, 128, bits, 32, False, seed=bits)
    for dtype in DTYPES:
        out = torch.full((48, 128), float("nan"), dtype=dtype, device=device)
        dequantize_into(out, packed.to(device), bits, scale.to(device), zero.to(device), group_size)
        assert torch.equal(out.cpu(), reference.to(dtype)), dtype


@pytest.mark.parametrize("block", [1, 5, 1 << 22])
def test_half_affine_paths_agree(block: int, monkeypatch) -> None:
    """Both half-precision affines - batch norm in one pass (CPU) and float32 row blocks (accelerators) - give the
    reference converted, bit for bit; run here on the CPU so that the accelerator path is tested on every machine."""
    monkeypatch.setattr(bitpack, "ROW_BLOCK_ELEMENTS", block * 128)
    packed, scale, zero, group_size, reference = _packed_weight(48, 128, 3, 32, False)
    codes = unpack_bits(packed, 3, 48 * 128).view(48, 128)
    for dtype in (torch.bfloat16, torch.float16):
        for path in (bitpack._half_affine_batch_norm, bitpack._half_affine_rows):
            out = torch.full((48, 128), float("nan"), dtype=dtype)
            path(out, codes, scale.float(), zero.float(), 128 // group_size)
            assert torch.equal(out, reference.to(dtype)), (path.__name__, dtype)
