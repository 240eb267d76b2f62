"""The CPU kernels on packed weights (hexq.packed.cpu): every path this CPU runs against float64 references, with
error bounds derived from the arithmetic, and the dequantization bit for bit against the torch path."""

from __future__ import annotations

import math

import pytest
import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.packed import cpu
from hexq.packed.bitpack import dequantize_into, pack_bits
from hexq.packed.cpu import ROWS8_PATHS, GemvJob, gemv_takes, load_cpu_kernels
from hexq.packed.weight import PackedWeight, dequantize_packed
from tests.conftest import IN_CI, activation_levels, int8_blocks, needs_kernels

KERNELS = load_cpu_kernels()
pytestmark = needs_kernels(KERNELS)
PATHS = cpu.available_paths(KERNELS.library) if KERNELS else []


def test_kernels_build():
    """The kernels build from the installed sources with the system compiler (CI fails here, with the reason, rather
    than skipping every kernel test)."""
    assert KERNELS is not None, ("the CPU kernels did not build (no C compiler, or a compile error: see the warning "
                                 "logged by hexq.packed.cpu)")


def test_every_path_the_cpu_has_is_offered():
    """Each instruction-set path is offered exactly when the CPU has its instructions (so a path cannot silently go
    missing: the tests force every offered one)."""
    import platform
    import re

    flags = set()
    if platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as handle:
            flags = set(re.findall(r"\w+", handle.read().split("flags", 1)[1].split("\n", 1)[0]))
    avx2 = {"avx2", "fma", "bmi2", "f16c"} <= flags
    want = ["scalar"] + ["avx2"] * avx2
    want += ["avxvnni"] * (avx2 and ("avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags))
    want += ["avx512"] * ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"} <= flags)
    assert PATHS == want or not IN_CI and KERNELS is None
    if KERNELS is not None:  # the AVX-VNNI path's copy this CPU runs (kernels.c rows_avxvnni): 1 VEX, 2 EVEX, 0 none
        encoding = 1 if "avx_vnni" in flags else 2 if "avxvnni" in want else 0
        assert KERNELS.library.hexq_avxvnni_encoding() == encoding


def test_the_avx_vnni_copy_has_no_avx512_instruction():
    """The AVX-VNNI path's rows8 GEMV and W8A8 rows are the copies that run on CPUs without AVX-512 (Alder Lake): not
    one EVEX-encoded instruction (first byte 0x62 in 64-bit mode) nor AVX-512 register in its code, and its dot
    products are VEX vpdpbusd. A CPU without AVX-VNNI cannot run it; this is what can be checked here."""
    import re
    import shutil
    import subprocess

    if KERNELS is None or shutil.which("objdump") is None:
        assert not IN_CI, "the kernels and objdump (binutils) are part of the CI machine"
        pytest.skip("no kernels or no objdump")
    avx512_register = re.compile(r"%zmm|%k[1-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")
    for symbol in ("rows8_avxvnni", "rows_w8a8_vex"):  # the GEMV (vnni256.h) and the W8A8 rows (w8a8_256.h)
        listing = subprocess.run(["objdump", "-d", f"--disassemble={symbol}", KERNELS.library._name],
                                 capture_output=True, text=True, check=True).stdout
        lines = [line.split("\t") for line in listing.splitlines() if line.count("\t") >= 2]
        assert len(lines) > 50, listing[:2000]
        evex = [line for line in lines if line[1].startswith("62 ") or avx512_register.search(line[2])]
        assert not evex, (symbol, evex[:5])
        assert any("{vex} vpdpbusd" in line[2] for line in lines), symbol


def test_activation_blocks_are_the_portable_ones_on_every_path():
    """quantize_x (the activation blocks every packed GEMV reads: int16, and int8 for the SIMD paths' rows8 GEMVs) has
    a portable copy and an AVX2 one written with intrinsics: every path's blocks, scales and sums equal the scalar
    path's bit for bit, on blocks of zeros, signed zeros, outliers, magnitudes from 1e-30 to 1e30, a NaN and an
    infinity; and the int8 blocks are round(x / (max|x| / 127)) in the planes' byte order (kernels.c perm32)."""
    import ctypes

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=generator) * torch.logspace(-30, 30, 64)[:, None]
    x[1] = 0.0
    x[2, ::2] = -0.0
    x[3, 5] *= 1e4
    x[4, 7] = float("nan")
    x[5, 9] = float("inf")
    x[6] = torch.round(x[6] / x[6].abs().max() * 32767) / 32767 * 3.0  # values on the grid: ties to round
    x[7] = torch.round(x[7] / x[7].abs().max() * 127) / 127 * 3.0  # on the int8 grid
    x = x.reshape(-1).contiguous()
    blocks = x.numel() // 32

    def blocks_of(path: str) -> tuple[torch.Tensor, ...]:
        out = (torch.empty(x.numel(), dtype=torch.int16), torch.empty(blocks), torch.empty(blocks, dtype=torch.int32),
               torch.empty(x.numel(), dtype=torch.int8), torch.empty(blocks), torch.empty(blocks))
        done = KERNELS.library.hexq_quantize_x(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.numel()),
                                               cpu.PATHS.index(path), *(ctypes.c_void_p(t.data_ptr()) for t in out))
        assert done == 0, path
        q, dx, sums, q8, dx8, zx8 = out
        return q, dx.view(torch.int32), sums, q8, dx8.view(torch.int32), zx8.view(torch.int32)  # bit for bit (NaN too)

    want = blocks_of("scalar")
    assert int(want[0].abs().max()) == 32767 and want[0][4 * 32 + 7] == -32767  # the clamp took the NaN
    perm32 = torch.tensor([j ^ 24 if j >> 3 in (1, 2) else j for j in range(32)])
    amax = x.view(blocks, 32)[8:].abs().amax(dim=-1, keepdim=True)  # finite blocks from the 9th on
    int8 = torch.round(x.view(blocks, 32)[8:] * (127 / amax)).to(torch.int8)  # float32, as the kernels compute it
    assert torch.equal(want[3].view(blocks, 32)[8:], int8[:, perm32])
    sums8 = want[3].view(blocks, 32).sum(dim=-1, dtype=torch.int32)  # zx8: dx8 times the int8 block's sum
    assert torch.equal(want[5][8:], (want[4].view(torch.float32) * sums8.float()).view(torch.int32)[8:])
    assert int(want[3].view(blocks, 32)[4, 7]) == -127  # the NaN (byte 7 holds value 7), clamped as in int16
    for path in PATHS:
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(path), want, strict=True)), path


def packed_matrix(rows: int, cols: int, bits: int, group: int, symmetric: bool, seed: int):
    """(codes, float16 scale, float16 zero, float64 weights) of a random matrix quantized as hexq packs it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    codes, meta = quantize(w, QuantSpec(bits, group, symmetric=symmetric))
    scale, zero = meta.scale.half().contiguous(), meta.zero.half().contiguous()
    weights = dequantize(codes, QuantMeta(scale.double(), zero.double(), meta.group_size, bits))
    return pack_bits(codes, bits), scale, zero, weights


def gemv_bound(weights: torch.Tensor, x: torch.Tensor, levels: float = 32767) -> torch.Tensor:
    """|y - W x| the GEMV may show, from its arithmetic: x is rounded per block of 32 to integers of at most `levels`
    (32767: int16, 127: int8; activation_levels says which a layout reads on a path; inf: x exactly) with step
    dx = max|x| / levels, so each value moves by at most dx / 2; everything after is integer or float32 (products of
    codes and int16 or int8 values are exact in int32; the float32 sums carry at most gamma_n of sum |w x|)."""
    blocks = x.double().abs().view(x.shape[0], -1, 32).amax(dim=-1)
    step = (blocks / levels).repeat_interleave(32, dim=-1)
    rounding = (step / 2) @ weights.abs().T
    n = weights.shape[1]
    u = torch.finfo(torch.float32).eps / 2
    gamma = n * u / (1 - n * u)
    return rounding + 2 * gamma * (x.double().abs() @ weights.abs().T)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_gemv_within_its_bound(path: str, bits: int, group: int) -> None:
    kernels = KERNELS.with_path(path)
    cols = 96 if group == 32 else 256  # 96: a last block of 32 codes after whole 64-code steps
    for symmetric, ntok in ((False, 1), (True, 3), (False, 6)):  # 6 tokens: slices of 4 and 2
        codes, scale, zero, weights = packed_matrix(40, cols, bits, group, symmetric, seed=bits * 10 + group)
        x = torch.randn(ntok, cols, generator=torch.Generator().manual_seed(bits))
        x[:, 7] *= 30.0  # an outlier channel: its block's step grows, the bound with it
        y = torch.full((ntok, 40), float("nan"))
        kernels.gemv([GemvJob(PackedWeight(codes, scale, zero, bits, (40, cols)), x, y)])
        want = x.double() @ weights.T
        assert torch.isfinite(y).all()
        assert ((y.double() - want).abs() <= gemv_bound(weights, x)).all(), (symmetric, ntok)
        assert float((y.double() - want).norm() / want.norm()) <= 1e-3  # the runtime's accuracy goal per output


def test_gemv_many_tasks_mixed_widths_strides_and_threads() -> None:
    """One call with matrices of every width, shared and separate inputs, strided rows: each task as if alone, and
    the same bits on one thread and on several (every row is one thread's work)."""
    jobs, wants = [], []
    x = torch.randn(3, 512)
    for bits in (1, 2, 3, 4, 8):
        codes, scale, zero, weights = packed_matrix(48, 256, bits, 32, False, seed=bits)
        own = torch.randn(2, 256)
        out = torch.full((4, 96), float("nan"))[:, :48]  # a row stride of 96: the kernel writes where told
        weight = PackedWeight(codes, scale, zero, bits, (48, 256))
        jobs.append(GemvJob(weight, x[:, :256], out[:3]))
        jobs.append(GemvJob(weight, own, torch.empty(2, 48)))
        wants += [(x[:, :256], weights), (own, weights)]
    for path in PATHS:
        kernels = KERNELS.with_path(path)
        kernels.threads = 1
        kernels.gemv(jobs)
        first = [job.y.clone() for job in jobs]
        for job in jobs:  # a row the pool never ran must show, not keep the first call's value
            job.y.fill_(float("nan"))
        kernels.threads = 3
        kernels.gemv(jobs)
        for job, (x_in, weights), alone in zip(jobs, wants, first, strict=True):
            assert torch.equal(job.y, alone), path
            assert ((job.y.double() - x_in.double() @ weights.T).abs() <= gemv_bound(weights, x_in)).all(), path


def test_gemv_takes_and_refuses() -> None:
    assert gemv_takes((8, 256), 3, 8, "avx512") and gemv_takes((8, 96), 3, 3, "avx512")
    assert not gemv_takes((8, 64), 3, 4, "scalar")  # groups of 16
    codes, scale, zero, _ = packed_matrix(8, 64, 3, 16, False, seed=0)
    with pytest.raises(ValueError, match="refused"):
        KERNELS.gemv([GemvJob(PackedWeight(codes, scale, zero, 3, (8, 64)), torch.randn(1, 64), torch.empty(1, 8))])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_dequantize_is_the_torch_path_bit_for_bit(path: str, bits: int) -> None:
    kernels = KERNELS.with_path(path)
    for group in (16, 32, 128):
        codes, scale, zero, _ = packed_matrix(24, 256, bits, group, bits % 2 == 0, seed=bits)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = dequantize_into(torch.empty(24, 256, dtype=dtype), codes, bits, scale, zero, group)
            out = torch.full((24, 256), float("nan"), dtype=dtype)
            assert kernels.dequantize(out, PackedWeight(codes, scale, zero, bits, (24, 256)))
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (group, dtype)


@pytest.mark.parametrize("layout", ["stream", "planes", "rows8", "rows8z4"])
def test_dequantize_on_threads_is_the_torch_path_bit_for_bit(layout: str) -> None:
    """Rows split across the pool (blocks of 64 rows, the last one short): every row written once, bit for bit."""
    for bits in (3, 4, 8) if layout == "stream" else (3, 4):
        codes, scale, zero, _ = packed_matrix(200, 512, bits, 32, False, seed=bits)
        weight = KERNELS.relayout(PackedWeight(codes.clone(), scale.clone(), zero.clone(), bits, (200, 512)), layout)
        assert weight.layout == layout
        want = dequantize_into(torch.empty(200, 512, dtype=torch.bfloat16), codes, bits, scale, zero, 32)
        for threads in (1, 3):
            kernels = load_cpu_kernels(KERNELS.path, threads)
            out = torch.full((200, 512), float("nan"), dtype=torch.bfloat16)
            assert kernels.dequantize(out, weight)
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (bits, threads)


def planes_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, row bytes] of integer codes [rows, cols] in the planes layout, built from its description in kernels.c
    (not from the C code): planes of 4, 2 and 1 bits, 8/w blocks per 32-byte unit, bytes in perm32 order, the
    blocks after the last whole unit of the narrowest plane as a bit stream."""
    rows, cols = codes.shape
    blocks, unit = cols // 32, 8 // (bits & -bits)
    nbp = blocks // unit * unit
    perm = [j ^ 24 if j >> 3 in (1, 2) else j for j in range(32)]
    parts, off = [], 0
    for w in (4, 2, 1):
        if not bits & w:
            continue
        per = 8 // w
        plane = torch.zeros(rows, nbp // per, 32, dtype=torch.int64)
        for b in range(nbp):
            values = (codes[:, b * 32:(b + 1) * 32].long() >> off) & ((1 << w) - 1)
            plane[:, b // per] |= values[:, perm] << (w * (b % per))
        parts.append(plane.reshape(rows, -1).to(torch.uint8))
        off += w
    tail = codes[:, nbp * 32:]
    parts.append(torch.stack([pack_bits(row, bits) for row in tail]) if tail.shape[1] else
                 torch.zeros(rows, 0, dtype=torch.uint8))
    return torch.cat(parts, dim=1)


PLANE_COLS = (352, 384)  # 11 and 12 blocks: whole units of every plane and a stream tail for most widths


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 8))
def test_planes_layout_is_its_description_and_goes_back(path: str, bits: int) -> None:
    kernels = KERNELS.with_path(path)
    for cols in PLANE_COLS:
        codes = torch.randint(0, 1 << bits, (9, cols), generator=torch.Generator().manual_seed(bits))
        weight = PackedWeight(pack_bits(codes, bits), torch.ones(9, cols // 32, dtype=torch.float16),
                              torch.zeros(9, cols // 32, dtype=torch.float16), bits, (9, cols))
        stream = weight.codes.clone()
        planes = kernels.relayout(weight, "planes")
        assert planes.layout == "planes" and planes.codes is weight.codes  # in place: the same bytes
        assert torch.equal(planes.codes.view(9, -1), planes_reference(codes, bits)), cols
        back = kernels.stream(planes)
        assert back.layout == "stream" and torch.equal(back.codes, stream), cols


def test_planes_are_not_made_for_8_bits_or_for_the_torch_path() -> None:
    codes, scale, zero, _ = packed_matrix(4, 256, 8, 32, False, seed=0)
    weight = PackedWeight(codes, scale, zero, 8, (4, 256))
    assert KERNELS.relayout(weight) is weight  # bytes already
    codes, scale, zero, _ = packed_matrix(4, 256, 3, 32, False, seed=0)
    planes = KERNELS.relayout(PackedWeight(codes, scale, zero, 3, (4, 256)))
    with pytest.raises(ValueError, match="planes layout are read by the CPU kernels only"):
        dequantize_packed(planes)


def rows8_reference(codes: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor):
    """(codes [rows / 8, 8 row bytes], scale, zero) in the rows8 layout, from its description in kernels.c (not from
    the C code): per group of 8 rows, block after block, each block's planes of 4, 2 and 1 bits, a w-bit plane w
    registers of 32 bytes whose byte 4 r + i holds in bits [w f, w f + w) row r's code at perm32 position 4 D + i,
    D = m (8 / w) + f; scales and zeros of the 8 rows interleaved one value at a time."""
    rows, cols = codes.shape
    perm = [j ^ 24 if j >> 3 in (1, 2) else j for j in range(32)]
    # [groups, 8 rows, blocks, 8 dwords D, 4 bytes i]: the codes of each block in perm32 order
    ordered = codes.view(rows, cols // 32, 32)[:, :, perm].long().view(rows // 8, 8, cols // 32, 8, 4)
    parts, off = [], 0
    for w in (4, 2, 1):
        if not bits & w:
            continue
        per = 8 // w
        values = (ordered >> off) & ((1 << w) - 1)
        fields = values.view(rows // 8, 8, cols // 32, w, per, 4) << (w * torch.arange(per).view(per, 1))
        registers = fields.sum(dim=4)  # [groups, 8 rows, blocks, w registers, 4 bytes]: disjoint bits
        parts.append(registers.permute(0, 2, 3, 1, 4))  # [groups, blocks, w, 8 rows, 4 bytes]
        off += w
    interleaved = torch.cat(parts, dim=2).reshape(rows // 8, -1).to(torch.uint8)
    grid = [t.view(rows // 8, 8, -1).transpose(1, 2).reshape(rows, -1) for t in (scale, zero)]
    return interleaved, *grid


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 8))
def test_rows8_layout_is_its_description_and_goes_back(path: str, bits: int) -> None:
    kernels = KERNELS.with_path(path)
    for cols, groups in ((96, 3), (352, 11), (768, 6)):
        codes = torch.randint(0, 1 << bits, (24, cols), generator=torch.Generator().manual_seed(bits))
        scale = torch.randn(24, groups, generator=torch.Generator().manual_seed(cols)).half()
        zero = torch.randn(24, groups, generator=torch.Generator().manual_seed(cols + 1)).half()
        weight = PackedWeight(pack_bits(codes, bits), scale.clone(), zero.clone(), bits, (24, cols))
        stored = weight.codes.clone()
        rows8 = kernels.relayout(weight, "rows8")
        assert rows8.layout == "rows8" and rows8.codes is weight.codes and rows8.scale is weight.scale  # in place
        want_codes, want_scale, want_zero = rows8_reference(codes, bits, scale, zero)
        assert torch.equal(rows8.codes.view(3, -1), want_codes), cols
        assert torch.equal(rows8.scale, want_scale) and torch.equal(rows8.zero, want_zero), cols
        back = kernels.stream(rows8)
        assert back.layout == "stream" and torch.equal(back.codes, stored), cols
        assert torch.equal(back.scale, scale) and torch.equal(back.zero, zero), cols


def zeros4_reference(zero: torch.Tensor) -> torch.Tensor:
    """The zeros [rows, groups] (integers in [0, 15]) as the rows8z4 layout holds them, from kernels.c "zeros as 4-bit
    integers" (not from the C code): the array's first quarter holds, group of 8 rows after group, for each group g a
    little-endian 32-bit word with row r's zero in bits [4 r, 4 r + 4); the rest is zero."""
    rows, groups = zero.shape
    nibbles = zero.long().view(rows // 8, 8, groups).transpose(1, 2)  # [row groups, groups, 8 rows]
    words = (nibbles << (4 * torch.arange(8))).sum(dim=-1)  # disjoint bits
    array = torch.zeros(rows * groups * 2, dtype=torch.uint8)
    array[:rows * groups // 2] = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1).view(-1)
    return array


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 5))
def test_rows8z4_layout_is_its_description_and_goes_back(path: str, bits: int) -> None:
    """rows8z4: the codes and scales as rows8 lays them, the zeros in 4 bits each (kernels.c "zeros as 4-bit
    integers"), and back to the same stream, scales and zeros."""
    kernels = KERNELS.with_path(path)
    for cols, groups in ((96, 3), (768, 6)):
        codes = torch.randint(0, 1 << bits, (24, cols), generator=torch.Generator().manual_seed(bits))
        scale = torch.randn(24, groups, generator=torch.Generator().manual_seed(cols)).half()
        zero = torch.randint(0, 16, (24, groups), generator=torch.Generator().manual_seed(cols + 1)).half()
        weight = PackedWeight(pack_bits(codes, bits), scale.clone(), zero.clone(), bits, (24, cols))
        stored = weight.codes.clone()
        z4 = kernels.relayout(weight, "rows8z4")
        assert z4.layout == "rows8z4" and z4.codes is weight.codes and z4.scale is weight.scale  # in place
        assert z4.zero.data_ptr() == weight.zero.data_ptr() and z4.zero.shape == (6, groups)  # its first quarter
        assert z4.nbytes == weight.nbytes - 24 * groups * 2 * 3 // 4  # what a product reads
        want_codes, want_scale, _ = rows8_reference(codes, bits, scale, zero)
        assert torch.equal(z4.codes.view(3, -1), want_codes) and torch.equal(z4.scale, want_scale), cols
        assert torch.equal(weight.zero.view(torch.uint8).view(-1), zeros4_reference(zero)), cols
        back = kernels.stream(z4)
        assert back.layout == "stream" and torch.equal(back.codes, stored), cols
        assert torch.equal(back.scale, scale) and torch.equal(back.zero, zero), cols


def test_zeros_fit4_reads_every_float16_as_its_value() -> None:
    """kernels.c half_nibble decides from the float16 bits: every one of the 65,536 patterns fits exactly when its
    value is an integer in [0, 15] (-0 included; NaN, infinities, subnormals and fractions not)."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    value = every.float()
    want = (value >= 0) & (value <= 15) & (value == value.round())
    got = torch.tensor([KERNELS.zeros_fit4(every[i:i + 1]) for i in range(every.numel())])
    assert torch.equal(got, want), every[got != want][:8]
    assert KERNELS.zeros_fit4(torch.arange(16, dtype=torch.float16)) and not KERNELS.zeros_fit4(every)


def test_rows8z4_refuses_zeros_it_cannot_hold() -> None:
    """A zero that is not an integer in [0, 15], or codes wider than 4 bits: rows8 keeps float16 zeros, and a forced
    rows8z4 writes nothing."""
    codes, scale, zero, _ = packed_matrix(16, 256, 3, 32, False, seed=0)
    for bad in (0.5, 16.0, -1.0, float("nan")):
        odd = zero.clone()
        odd[9, 3] = bad
        weight = PackedWeight(codes.clone(), scale.clone(), odd.clone(), 3, (16, 256))
        for path in ROWS8_PATHS:
            if path in PATHS:
                assert KERNELS.with_path(path).layout_for(weight) == "rows8", bad
        same = KERNELS.relayout(weight, "rows8z4")
        assert same.layout == "stream" and torch.equal(same.codes, codes), bad  # nothing written
        assert torch.equal(same.zero.view(torch.int16), odd.view(torch.int16)), bad
    wide = PackedWeight(*packed_matrix(16, 256, 5, 32, False, seed=0)[:3], 5, (16, 256))
    assert 0 <= wide.zero.min() and wide.zero.max() <= 31
    wide = PackedWeight(wide.codes, wide.scale, wide.zero.clamp(max=15), 5, (16, 256))  # zeros that would fit
    for path in ROWS8_PATHS:
        if path in PATHS:
            assert KERNELS.with_path(path).layout_for(wide) == "rows8"
    assert KERNELS.relayout(wide, "rows8z4").layout == "stream"


@pytest.mark.parametrize("path", PATHS)
def test_gemv_from_rows8z4_is_rows8_bit_for_bit(path: str) -> None:
    """The same zeros as float32 either way: the same outputs to the bit (widths 2-4, symmetric and asymmetric,
    groups of 32 and 128, 1-6 tokens)."""
    kernels = KERNELS.with_path(path)
    for bits in (2, 3, 4):
        for group, symmetric, ntok in ((32, False, 1), (128, True, 3), (32, True, 6)):
            codes, scale, zero, _ = packed_matrix(48, 512, bits, group, symmetric, seed=bits * 3 + ntok)
            outs = []
            for layout in ("rows8", "rows8z4"):
                weight = kernels.relayout(PackedWeight(codes.clone(), scale.clone(), zero.clone(), bits, (48, 512)),
                                          layout)
                assert weight.layout == layout
                x = torch.randn(ntok, 512, generator=torch.Generator().manual_seed(bits))
                outs.append(torch.full((ntok, 48), float("nan")))
                kernels.gemv([GemvJob(weight, x, outs[-1])])
            assert torch.equal(outs[0], outs[1]), (bits, group, symmetric, ntok)


def test_rows8_gemv_is_one_on_every_simd_path() -> None:
    """The rows8 GEMV is one source (vnni256.h) compiled with EVEX and VEX vpdpbusd and with AVX2's vpmaddubsw +
    vpmaddwd (kernels.c dpbusd_avx2, exact for codes of at most 7 bits): the same integer dot products and float32
    operations, so the same outputs to the bit on every SIMD path this CPU runs, widths 1-7, 1-5 tokens."""
    paths = [path for path in ROWS8_PATHS if path in PATHS]
    if len(paths) < 2:
        pytest.skip("fewer than two SIMD paths on this CPU")
    for bits in range(1, 8):
        codes, scale, zero, _ = packed_matrix(64, 1024, bits, 32, bits % 2 == 1, seed=bits)
        x = torch.randn(bits % 5 + 1, 1024, generator=torch.Generator().manual_seed(bits)) * 4.0  # 127 * 127 pairs
        outs = []
        for path in paths:
            kernels = KERNELS.with_path(path)
            weight = kernels.relayout(PackedWeight(codes.clone(), scale.clone(), zero.clone(), bits, (64, 1024)),
                                      "rows8")
            outs.append(torch.full((x.shape[0], 64), float("nan")))
            kernels.gemv([GemvJob(weight, x, outs[-1])])
        assert all(torch.equal(out, outs[0]) for out in outs), bits


def test_layout_for_each_path() -> None:
    """rows8z4 on the SIMD paths for whole groups of 8 rows of widths 1-4 whose zeros fit in 4 bits, planes
    otherwise; 8-bit codes keep the stream."""
    codes, scale, zero, _ = packed_matrix(16, 352, 3, 32, False, seed=0)
    weight = PackedWeight(codes, scale, zero, 3, (16, 352))
    for path in PATHS:
        assert KERNELS.with_path(path).layout_for(weight) == ("rows8z4" if path in ROWS8_PATHS else "planes")
    if "avx512" in PATHS:
        avx512 = KERNELS.with_path("avx512")
        assert avx512.layout_for(weight.rows(0, 12)) == "planes"  # not whole groups of 8
        eight = PackedWeight(*packed_matrix(16, 512, 8, 32, False, seed=0)[:3], 8, (16, 512))
        assert avx512.layout_for(eight) == "stream"
        with pytest.raises(ValueError, match="groups of 8"):
            avx512.relayout(PackedWeight(codes.clone(), scale.clone(), zero.clone(), 3, (16, 352))).rows(4, 16)


# (layout, [(cols, group)]): planes over whole units and a stream tail
LAYOUT_SHAPES = [("planes", ((352, 32), (384, 128), (512, 64))), ("rows8", ((96, 32), (512, 64), (768, 128))),
                 ("rows8z4", ((96, 32), (768, 128)))]
# (layout, bits, shapes): rows8z4 holds widths 2-4 here (1-bit grids' zeros are floats)
RELAID = [(layout, bits, shapes) for layout, shapes in LAYOUT_SHAPES
          for bits in (range(2, 5) if layout == "rows8z4" else range(1, 8))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout, bits, shapes", RELAID)
def test_gemv_on_relaid_codes_within_its_bound(path: str, bits: int, layout: str, shapes) -> None:
    """The GEMV from re-laid codes within the bound of the activation blocks it reads (the stream's int16 blocks,
    only the float32 sums' order differing; the rows8 layouts' int8 blocks on the SIMD paths, where it is also the
    product of those int8 blocks, emulated here, to float32 rounding), 1-6 tokens, groups of 32, 64 and 128. Planes:
    over whole units and a stream tail; 512 columns are 16 blocks, whole units of every width: the rows the AVX-512
    path reads with its byte products (a stream tail goes to the AVX2 code). rows8: 8 rows per pass on the SIMD
    paths, the portable reader on the scalar one."""
    kernels = KERNELS.with_path(path)
    for cols, group in shapes:
        for symmetric, ntok in ((False, 1), (True, 3), (False, 6)):
            codes, scale, zero, weights = packed_matrix(40, cols, bits, group, symmetric, seed=bits * 7 + cols)
            weight = PackedWeight(codes.clone(), scale.clone(), zero.clone(), bits, (40, cols))
            relaid = kernels.relayout(weight, layout)
            assert relaid.layout == layout
            x = torch.randn(ntok, cols, generator=torch.Generator().manual_seed(bits))
            x[:, 7] *= 30.0
            y = torch.full((ntok, 40), float("nan"))
            kernels.gemv([GemvJob(relaid, x, y)])
            want = x.double() @ weights.T
            levels = activation_levels(path, layout)
            assert ((y.double() - want).abs() <= gemv_bound(weights, x, levels)).all(), (cols, symmetric, ntok)
            if levels == 127:  # from the int8 blocks themselves only float32 sums are left
                x8 = int8_blocks(x).double()
                assert ((y.double() - x8 @ weights.T).abs() <= gemv_bound(weights, x8, math.inf)).all(), cols


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout, bits, shapes", RELAID)
def test_dequantize_relaid_codes_is_the_torch_path_bit_for_bit(path: str, bits: int, layout: str, shapes) -> None:
    kernels = KERNELS.with_path(path)
    for cols, group in shapes:
        codes, scale, zero, _ = packed_matrix(16, cols, bits, group, bits % 2 == 0, seed=bits)
        relaid = kernels.relayout(PackedWeight(codes.clone(), scale.clone(), zero.clone(), bits, (16, cols)), layout)
        assert relaid.layout == layout
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = dequantize_into(torch.empty(16, cols, dtype=dtype), codes, bits, scale, zero, group)
            out = torch.full((16, cols), float("nan"), dtype=dtype)
            assert kernels.dequantize(out, relaid)
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (cols, dtype)


def test_forced_paths(monkeypatch) -> None:
    monkeypatch.setenv("HEXQ_CPU_PATH", "scalar")
    assert load_cpu_kernels().path == "scalar"
    with pytest.raises(ValueError, match="choose one of"):
        load_cpu_kernels("avx9000")
    if "avx512" not in PATHS:
        with pytest.raises(ValueError, match="not available on this CPU"):
            load_cpu_kernels("avx512")


def test_the_float16_kv_cache_rounds_as_torch():
    """The native step's float16 KV cache (kernels.h float_to_half / half_to_float): every float32 rounds to the
    binary16 that torch's .half() gives, bit for bit (nearest, ties to even, subnormals, overflow past 65504 to
    infinity, signed zeros), and reads back exactly: random bit patterns, every tie and boundary around the normal
    range, and every binary16 value."""
    import ctypes

    generator = torch.Generator().manual_seed(4)
    random = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=generator, dtype=torch.int64)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = every[torch.isfinite(every)].double().unique()  # sorted
    middle = (finite[1:] + finite[:-1]) / 2  # every halfway point (float32 holds it exactly), both signs
    ties = torch.cat([middle, middle.float().nextafter(torch.tensor(0.0)).double(),
                      middle.float().nextafter(torch.tensor(float("inf"))).double()]).float()
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 0.0, -0.0,
                          1e-40, float("inf"), -float("inf")])
    x = torch.cat([random.to(torch.int32).view(torch.float32), every, ties, edges])
    x = x[~torch.isnan(x)].contiguous()
    half, back = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel())
    KERNELS.library.hexq_kv_half(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.numel()),
                                 ctypes.c_void_p(half.data_ptr()), ctypes.c_void_p(back.data_ptr()))
    want = x.half()
    assert torch.equal(half, want.view(torch.int16))
    assert torch.equal(back.view(torch.int32), want.float().view(torch.int32))
