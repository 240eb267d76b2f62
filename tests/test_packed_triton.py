"""The GPU kernels on packed weights (hexq.packed.triton) against float64 references: on CUDA where there is one,
else in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), so the CI checks the kernel math."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
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
