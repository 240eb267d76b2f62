"""The GPU kernels on packed weights (hexq.packed.triton) against float64 references: on CUDA where there is one,
else in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), so the CI checks the kernel math."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.model.simulate import ActQuantizer
from hexq.packed import triton as kernels
from hexq.packed.bitpack import pack_bits

# gpu: scripts/gpu_check.sh selects them (-m gpu) to run on CUDA; elsewhere they run in the interpreter
pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton is not installed"), pytest.mark.gpu]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed(rows: int, cols: int, bits: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    codes, meta = quantize(w, QuantSpec(bits, group, symmetric=symmetric))
    scale, zero = meta.scale.half(), meta.zero.half()
    return pack_bits(codes, bits), scale, zero, dequantize(codes, QuantMeta(scale.double(), zero.double(), group, bits))


def float32_bound(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - W x| of a float32 computation of the same products: gamma_n of sum |w x| (n = columns), twice for the
    rounding of (q - z) * s."""
    n = weights.shape[1]
    u = torch.finfo(torch.float32).eps / 2
    return 3 * n * u / (1 - n * u) * (x.double().abs() @ weights.abs().T) + 1e-30


@pytest.mark.parametrize("group", [32, 128])
def test_pair_gemv_mixed_widths_in_one_launch(group: int) -> None:
    rows, cols = 40, 256
    widths = [1, 2, 3, 4, 5, 8]
    matrices = [packed(rows, cols, b, group, b % 2 == 0, seed=b) for b in widths]
    arena = kernels.PackedArena(sum(m[0].numel() for m in matrices), sum(m[1].numel() for m in matrices), DEVICE)
    offsets = [arena.add(codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)) for codes, scale, zero, _ in matrices]
    chosen = [5, 0, 2, 2, 3, 1, 4]  # pairs -> matrix: repeats and every width, as a layer's routing gives
    x = torch.randn(len(chosen), cols, generator=torch.Generator().manual_seed(0))
    code_off = torch.tensor([offsets[m][0] for m in chosen], dtype=torch.int64, device=DEVICE)
    param_off = torch.tensor([offsets[m][1] for m in chosen], dtype=torch.int64, device=DEVICE)
    bits = torch.tensor([widths[m] for m in chosen], dtype=torch.int32, device=DEVICE)
    y = kernels.pair_gemv(x.to(DEVICE), arena, code_off, param_off, bits, (rows, cols), group).cpu()
    for p, m in enumerate(chosen):
        weights = matrices[m][3]
        want = x[p:p + 1].double() @ weights.T
        assert ((y[p].double() - want[0]).abs() <= float32_bound(weights, x[p:p + 1])[0]).all(), (p, widths[m])


def test_pair_gemv_one_matrix_for_every_row() -> None:
    """A dense linear: one table entry, every row of x through it; rows and columns off the block sizes."""
    rows, cols = 37, 96
    codes, scale, zero, weights = packed(rows, cols, 8, 96, False, seed=3)
    arena = kernels.PackedArena(codes.numel(), scale.numel(), DEVICE)
    code_at, param_at = arena.add(codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE))
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=DEVICE)  # noqa: E731
    y = kernels.pair_gemv(x.to(DEVICE), arena, one(code_at, torch.int64), one(param_at, torch.int64),
                          one(8, torch.int32), (rows, cols), 96).cpu()
    want = x.double() @ weights.T
    assert ((y.double() - want).abs() <= float32_bound(weights, x)).all()


@pytest.mark.parametrize("quantizer", [ActQuantizer(8, False, True), ActQuantizer(8, True, True),
                                       ActQuantizer(8, False, False, -1.5, 2.5), ActQuantizer(4, False, True)],
                         ids=["dynamic", "dynamic-symmetric", "static", "4-bit"])
def test_the_activation_grid_inside_the_launch_is_the_quantizers(quantizer) -> None:
    """x put on the recipe's activation grid inside the pair GEMV's launch (hexq.runtime.arena.kernel_grid) gives the
    bits of quantizer(x) then the GEMV: the same grid values (rounded half to even, as torch.round), summed in the
    same order. One row is made of exact ties (range [0, 255]: scale 1, so x.5 lands between two codes)."""
    from hexq.runtime.arena import kernel_grid

    rows, cols = 40, 256
    codes, scale, zero, _ = packed(rows, cols, 4, 32, False, seed=7)
    arena = kernels.PackedArena(codes.numel(), scale.numel(), DEVICE)
    code_at, param_at = arena.add(codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, cols, generator=g) * torch.tensor([[1.0], [30.0], [1e-3], [1.0]])
    x[0, :3] = torch.tensor([-8.0, 40.0, 0.0])  # outliers set the range
    x[3] = torch.arange(cols) % 256 + 0.5  # ties
    x[3, 0], x[3, 1] = 0.0, 255.0
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=DEVICE)  # noqa: E731
    tables = (one(code_at, torch.int64), one(param_at, torch.int64), one(4, torch.int32), (rows, cols), 32)
    fused = kernels.pair_gemv(x.to(DEVICE), arena, *tables, grid=kernel_grid(quantizer)).cpu()
    separate = kernels.pair_gemv(quantizer(x).to(DEVICE), arena, *tables).cpu()
    assert torch.equal(fused, separate)
    assert not torch.equal(fused, kernels.pair_gemv(x.to(DEVICE), arena, *tables).cpu())  # the grid moved x
