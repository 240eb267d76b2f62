"""Group grids refitted to GPTQ's codes (hexq.algos.refit) and the recipes' refit_bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hexq.algos.refit as refit
from hexq.algos.gptq import gptq_bank
from hexq.algos.hessian import factorize_hessians
from hexq.algos.quant import QuantSpec
from hexq.algos.refit import damped, refit_bank, refit_grids
from hexq.calib.quantize import quantize_bank, quantize_expert_chunk
from hexq.config.recipe import WeightQuant
from tests.test_gptq_bank import expert_batch

F64 = torch.float64
GROUP = 16


def objective(w, h, codes, scale, zero) -> torch.Tensor:
    """GPTQ's objective per row, (w - w_q) H (w - w_q)^T, [E, R]."""
    num, rows, n = w.shape
    q = (codes.double().reshape(num, rows, -1, GROUP) - zero.double()[..., None]) * scale.double()[..., None]
    d = w.double() - q.reshape(num, rows, n)
    return torch.einsum("eri,eij,erj->er", d, h.double(), d)


def min_max(w: torch.Tensor, bits: int, free_zero: bool):
    """Codes and (scale, zero) of w [E, R, n] on min/max grids (integer zero points unless free_zero)."""
    grouped = w.reshape(*w.shape[:-1], -1, GROUP)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    zero = -lo / scale if free_zero else torch.round(-lo / scale)
    codes = torch.clamp(torch.round(grouped / scale[..., None] + zero[..., None]), 0, 2**bits - 1)
    return codes.reshape(w.shape).to(torch.uint8), scale, zero


@pytest.mark.parametrize("free_zero", [True, False])
def test_the_refit_is_the_least_squares_grid_under_h(free_zero, monkeypatch):
    """Against a dense least-squares solve per row (the design matrix written out, H through its Cholesky factor):
    the same objective, whatever the chunking."""
    monkeypatch.setattr(refit, "REFIT_CHUNK_BYTES", 8 * 48 * 48 * 2)  # 2 experts, a few rows per chunk
    w, h, _ = expert_batch(experts=3, rows=6, n=48)
    bits = 1 if free_zero else 3
    codes, scale, zero = min_max(w, bits, free_zero)
    new_scale, new_zero = refit_grids(w, h, codes, scale, zero, free_zero)
    groups = scale.shape[-1]
    for e in range(3):
        chol = torch.linalg.cholesky(h[e])
        for r in range(6):
            q = codes[e, r].double()
            design = torch.zeros(48, 2 * groups if free_zero else groups, dtype=F64)
            for k in range(groups):
                cols = slice(k * GROUP, (k + 1) * GROUP)
                design[cols, k] = q[cols] if free_zero else q[cols] - zero[e, r, k]
                if free_zero:
                    design[cols, groups + k] = 1
            theta = torch.linalg.lstsq(chol.T @ design, chol.T @ w[e, r]).solution
            d = w[e, r] - design @ theta
            best = d @ h[e] @ d
            got = objective(w[e:e + 1, r:r + 1], h[e:e + 1], codes[e:e + 1, r:r + 1], new_scale[e:e + 1, r:r + 1],
                            new_zero[e:e + 1, r:r + 1])
            assert torch.isclose(got[0, 0], best, rtol=1e-6)
    if not free_zero:
        assert torch.equal(new_zero, zero)  # integer zero points stay


def test_a_row_keeps_its_grid_unless_the_refit_lowers_the_objective():
    """A row already at the optimum (refitted once) keeps its objective; a group whose codes are all equal (scale and
    offset not separable) leaves a finite grid; every scale stays positive."""
    w, h, _ = expert_batch(experts=2, rows=5, n=48)
    codes, scale, zero = min_max(w, 1, True)
    codes[0, 0, :GROUP] = 1  # one group with one code
    once = refit_grids(w, h, codes, scale, zero, True)
    twice = refit_grids(w, h, codes, *once, True)
    before, after = objective(w, h, codes, scale, zero), objective(w, h, codes, *once)
    # at the optimum already: the objective stays (the grid itself may move along directions H hardly sees)
    assert torch.allclose(objective(w, h, codes, *twice), after, rtol=1e-6)
    assert torch.isfinite(once[0]).all() and torch.isfinite(once[1]).all() and (once[0] > 0).all()
    assert (after <= before * (1 + 1e-9)).all() and after.sum() < 0.5 * before.sum()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_the_refit_lowers_gptqs_own_objective_and_keeps_its_codes(bits):
    """After GPTQ (act order, static groups, damped H), refitting each width's grids lowers GPTQ's objective under the
    damped Hessian on every row or leaves it; codes are untouched. At 1-2 bits by a fifth or more on these
    experts."""
    w, h, _ = expert_batch(experts=3, rows=8, n=48)
    spec = QuantSpec(bits=bits, group_size=GROUP, symmetric=False, one_bit="spread", float_zero_bits=(2,))
    factor = factorize_hessians(h, damp=0.01, act_order="sum_of_squares")
    result = gptq_bank(w, factor, [bits], spec)[bits]
    hd = damped(h, factor.damp_used)
    bank = refit_bank({bits: (result.codes, result.scale, result.zero)}, w, h, factor.damp_used, {bits: spec})
    codes, scale, zero = bank[bits]
    assert codes is result.codes
    before = objective(w, hd, result.codes, result.scale, result.zero)
    after = objective(w, hd, codes, scale, zero)
    assert (after <= before * (1 + 1e-9)).all()
    assert after.sum() < (0.8 if bits <= 2 else 1.0) * before.sum()
    if not spec.zero_is_float:
        assert torch.equal(zero, result.zero)


def test_recipes_refit_only_the_widths_they_name():
    """quantize_expert_chunk and quantize_bank with refit_bits [1, 2]: those widths' grids change, the codes and the
    other widths' grids are GPTQ's."""
    w, h, importance = expert_batch(experts=2, rows=8, n=48, dtype=torch.float32)
    plain = WeightQuant(group_size=GROUP, act_order="sum_of_squares", one_bit="spread", float_zero_bits=(2,))
    refitted = dataclasses.replace(plain, refit_bits=(1, 2))
    widths = (1, 2, 3)
    want, _ = quantize_expert_chunk(w, h, plain, widths, importance)
    got, _ = quantize_expert_chunk(w, h, refitted, widths, importance)
    for bits in widths:
        assert torch.equal(got[bits][0], want[bits][0])
        assert torch.equal(got[bits][1], want[bits][1]) == (bits == 3)
    one = quantize_bank(w[0], h[0], refitted, widths, importance[0])
    for bits in widths:
        codes, meta = one[bits]
        assert torch.equal(codes, got[bits][0][0]) and torch.allclose(meta.scale, got[bits][1][0])


def test_the_damped_hessian_is_the_one_gptq_inverts():
    """With a dead input (diag H == 0) and damping: damped(H)^-1 is the factor's H_D^-1 = U^T U, so the refit
    minimises the objective GPTQ did (float64; both sides exact to rounding)."""
    x = torch.randn(2, 64, 12, generator=torch.Generator().manual_seed(0), dtype=F64)
    x[0, :, 3] = 0
    h = 2 * x.mT @ x
    factor = factorize_hessians(h, damp=0.05)
    u = factor.hinv_chol
    assert torch.allclose(torch.linalg.inv(damped(h, factor.damp_used)), u.mT @ u, rtol=1e-9, atol=1e-12)
