"""Fitted group grids (hexq.algos.clipping) and gptq_bank's fit_bits."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.clipping import fit_grid, grid_error
from hexq.algos.gptq import gptq_bank
from hexq.algos.hessian import factorize_hessians
from hexq.algos.quant import QuantSpec
from hexq.algos.row_grids import RowGrids
from tests.conftest import DEVICES, HexqFactoriesOnMeta
from tests.test_gptq_bank import expert_batch

F64 = torch.float64


def grids_for(bits: list[int], rows: int, symmetric: bool) -> RowGrids:
    return RowGrids.build([QuantSpec(bits=b, symmetric=symmetric) for b in bits], rows, F64, torch.device("cpu"))


def heavy_tailed(shape, seed: int) -> torch.Tensor:
    """Weights with a few large entries per group (Student-t, 2 degrees of freedom), where min/max grids waste
    levels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) / torch.rand(shape, generator=g, dtype=F64).clamp(min=0.05) ** 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_fit_never_raises_the_weighted_error(symmetric, device):
    bits = [1, 2, 3, 4, 8]
    grids = RowGrids.build([QuantSpec(bits=b, symmetric=symmetric) for b in bits], 6, F64, torch.device(device))
    w = heavy_tailed((5, 16, 30), seed=1).to(device)  # 5 batches of groups, 16 columns, 5 widths x 6 rows
    c = torch.rand(5, 16, generator=torch.Generator().manual_seed(2), dtype=F64).to(device)
    c[0] = 0  # a batch whose columns carry no weight keeps its start
    c[1, :4] = 0
    scale, zero = grids.params(w.amin(dim=1), w.amax(dim=1))
    fitted = fit_grid(w, c, scale, zero, grids.qmax, grids.one_bit, grids.float_zero, symmetric)
    before, after = grid_error(w, c, scale, zero, grids.qmax), grid_error(w, c, *fitted, grids.qmax)
    assert (after <= before).all()
    assert torch.equal(fitted[0][0], scale[0]) and torch.equal(fitted[1][0], zero[0])
    wide = slice(6, 30)  # 2 bits and more: the fit clips the tails, the error drops
    assert after[1:].sum() < before[1:].sum()
    if symmetric:
        assert torch.equal(fitted[1], zero)  # the midpoint stays
    else:
        z = fitted[1][:, wide]
        assert torch.equal(z, z.round()) and (z >= 0).all() and (z <= grids.qmax[wide]).all()


def test_one_bit_fit_is_the_weighted_two_means():
    """Two clusters around -1 and +2 and one far weight of tiny importance: min/max puts a level on the outlier; the
    fit puts the two levels on the clusters' weighted means (Lloyd's fixed point, exact for separated clusters)."""
    g = torch.Generator().manual_seed(0)
    low, high = -1 + 0.1 * torch.randn(15, generator=g, dtype=F64), 2 + 0.1 * torch.randn(16, generator=g, dtype=F64)
    w = torch.cat([low, high, torch.tensor([40.0], dtype=F64)])[None, :, None]  # [1, 32, 1]
    c = torch.cat([torch.rand(31, generator=g, dtype=F64) + 0.5, torch.tensor([1e-6], dtype=F64)])[None]
    grids = grids_for([1], rows=1, symmetric=False)
    scale, zero = grids.params(w.amin(dim=1), w.amax(dim=1))
    s, z = fit_grid(w, c, scale, zero, grids.qmax, grids.one_bit, grids.float_zero, False, steps=4)
    levels = torch.cat([-z * s, (1 - z) * s]).flatten()
    hi_mask = torch.cat([torch.zeros(15), torch.ones(17)]).bool()
    hi_mask[-1] = False  # the outlier joins the upper level but weighs nothing next to the cluster
    ci = c[0]
    want_low = (ci[:15] * w[0, :15, 0]).sum() / ci[:15].sum()
    want_high = (ci[15:] * w[0, 15:, 0]).sum() / ci[15:].sum()
    assert torch.allclose(levels, torch.stack([want_low, want_high]), rtol=1e-12)


def test_bank_fits_only_the_listed_widths_and_lowers_their_error():
    """fit_bits changes the listed widths only (GPTQ's rows are independent) and, at 1 and 2 bits on heavy-tailed
    weights, lowers GPTQ's output error ||(W - Q) X||^2 by a wide margin (min/max grids at 1 bit are worse than
    zero weights)."""
    W, H, _ = expert_batch(experts=3, rows=8, n=64)
    W = heavy_tailed(W.shape, seed=3)
    template = QuantSpec(bits=4, group_size=16, symmetric=False)
    factor = factorize_hessians(H)
    plain = gptq_bank(W, factor, [1, 2, 3, 4], template)
    fitted = gptq_bank(W, factor, [1, 2, 3, 4], template, fit_bits=[1, 2])
    for bits in (3, 4):
        for name in ("codes", "scale", "zero", "loss"):
            assert torch.equal(getattr(plain[bits], name), getattr(fitted[bits], name))

    def output_error(result):
        dq = torch.stack([((result.codes[e].double().reshape(8, -1, 16) - result.zero[e][..., None])
                           * result.scale[e][..., None]).reshape(8, 64) for e in range(3)])
        delta = W - dq
        return float(torch.einsum("eri,eij,erj->", delta, H, delta))

    assert output_error(fitted[1]) < 0.5 * output_error(plain[1])
    assert output_error(fitted[2]) < output_error(plain[2])


def test_static_grids_fitted_before_the_loop():
    """With an act_order the grids are static, from the original weights: fitted ones never have a larger weighted
    error on those weights (column weights 1 / [H^-1]_jj) than the min/max ones, and unlisted widths are unchanged."""
    W, H, importance = expert_batch(experts=2, rows=6, n=48)
    template = QuantSpec(bits=4, group_size=16, symmetric=False)
    factor = factorize_hessians(H, act_order="sum_of_squares")
    plain = gptq_bank(W, factor, [2, 4], template)
    fitted = gptq_bank(W, factor, [2, 4], template, fit_bits=[2])
    for name in ("codes", "scale", "zero"):
        assert torch.equal(getattr(plain[4], name), getattr(fitted[4], name))
    damped = H + 0.01 * H.diagonal(dim1=1, dim2=2).mean(dim=1)[:, None, None] * torch.eye(48, dtype=F64)
    c = torch.linalg.inv(damped).diagonal(dim1=1, dim2=2).reciprocal().reshape(2, 3, 16)  # [E, groups, g]
    grids = grids_for([2], rows=6, symmetric=False)
    for e in range(2):
        groups = W[e].reshape(6, 3, 16).permute(1, 2, 0)  # [groups, g, rows]
        before = grid_error(groups, c[e], plain[2].scale[e].T, plain[2].zero[e].T, grids.qmax)
        after = grid_error(groups, c[e], fitted[2].scale[e].T, fitted[2].zero[e].T, grids.qmax)
        assert (after <= before * (1 + 1e-9)).all() and after.sum() < before.sum()


def test_fit_creates_tensors_on_the_data_device():
    """Dynamic and static fitted grids with hexq's tensor factories sent to the meta device: the same CPU results,
    and no factory called without the data's device."""
    W, H, importance = expert_batch(experts=2, rows=4, n=32, dtype=torch.float32)
    spec = QuantSpec(bits=4, group_size=16, symmetric=False)

    def run():
        return [gptq_bank(W, H, [1, 2, 4], spec, act_order=order, column_importance=importance, fit_bits=[1, 2])
                for order in ("none", "max_activation")]

    want = run()
    with HexqFactoriesOnMeta():
        got = run()
    for got_bank, want_bank in zip(got, want, strict=True):
        for bits in (1, 2, 4):
            assert got_bank[bits].codes.device.type == "cpu"
            assert torch.equal(got_bank[bits].codes, want_bank[bits].codes)
            assert torch.equal(got_bank[bits].scale, want_bank[bits].scale)
