"""The CPU kernels on packed weights (hexq.packed.cpu): every path this CPU runs against float64 references, with
error bounds derived from the arithmetic, and the dequantization bit for bit against the torch path."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.packed import cpu
from hexq.packed.bitpack import dequantize_into, pack_bits
from hexq.packed.cpu import GemvJob, gemv_takes, load_cpu_kernels
from tests.conftest import IN_CI, needs_kernels

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
    want = ["scalar"] + ["avx2"] * ({"avx2", "fma", "bmi2", "f16c"} <= flags)
    want += ["avx512"] * ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"} <= flags)
    assert PATHS == want or not IN_CI and KERNELS is None


def packed_matrix(rows: int, cols: int, bits: int, group: int, symmetric: bool, seed: int):
    """(codes, float16 scale, float16 zero, float64 weights) of a random matrix quantized as hexq packs it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    codes, meta = quantize(w, QuantSpec(bits, group, symmetric=symmetric))
    scale, zero = meta.scale.half().contiguous(), meta.zero.half().contiguous()
    weights = dequantize(codes, QuantMeta(scale.double(), zero.double(), meta.group_size, bits))
    return pack_bits(codes, bits), scale, zero, weights


def gemv_bound(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - W x| the GEMV may show, from its arithmetic: x is rounded to int16 per block of 32 with step
    dx = max|x| / 32767, so each value moves by at most dx / 2; everything after is integer or float32 (products
    of codes and int16 values are exact in int32; the float32 sums carry at most gamma_n of sum |w x|)."""
    blocks = x.double().abs().view(x.shape[0], -1, 32).amax(dim=-1)
    step = (blocks / 32767).repeat_interleave(32, dim=-1)
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
        kernels.gemv([GemvJob(codes, scale, zero, bits, (40, cols), x, y)])
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
        jobs.append(GemvJob(codes, scale, zero, bits, (48, 256), x[:, :256], out[:3]))
        jobs.append(GemvJob(codes, scale, zero, bits, (48, 256), own, torch.empty(2, 48)))
        wants += [(x[:, :256], weights), (own, weights)]
    for path in PATHS:
        kernels = KERNELS.with_path(path)
        kernels.threads = 1
        kernels.gemv(jobs)
        first = [job.y.clone() for job in jobs]
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
        KERNELS.gemv([GemvJob(codes, scale, zero, 3, (8, 64), torch.randn(1, 64), torch.empty(1, 8))])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_dequantize_is_the_torch_path_bit_for_bit(path: str, bits: int) -> None:
    kernels = KERNELS.with_path(path)
    for group in (16, 32, 128):
        codes, scale, zero, _ = packed_matrix(24, 256, bits, group, bits % 2 == 0, seed=bits)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = dequantize_into(torch.empty(24, 256, dtype=dtype), codes, bits, scale, zero, group)
            out = torch.full((24, 256), float("nan"), dtype=dtype)
            assert kernels.dequantize(out, codes, bits, scale, zero)
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (group, dtype)


def test_forced_paths(monkeypatch) -> None:
    monkeypatch.setenv("HEXQ_CPU_PATH", "scalar")
    assert load_cpu_kernels().path == "scalar"
    with pytest.raises(ValueError, match="choose one of"):
        load_cpu_kernels("avx9000")
    if "avx512" not in PATHS:
        with pytest.raises(ValueError, match="not available on this CPU"):
            load_cpu_kernels("avx512")
