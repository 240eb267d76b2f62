"""Batched GPTQ (gptq_bank, factorize_hessians) against the per-expert, per-width reference
(benchmarks/gptq_reference.py).

Two GPTQ runs with different floating-point summation orders agree on every code except at rounding ties: a
symmetric grid puts a group's most negative weight exactly half-way between two levels (w / scale = -(qmax+1)/2 +
1/2), so a 1-ulp difference in an updated weight can round it either way, and the rest of that row then follows a
different (equally valid) path. `assert_same_up_to_ties` checks exactly that: per row, codes are identical along
the quantization order up to the first difference, and that first difference is a tie in the reference
(gptq_reference.assert_same_up_to_ties).
"""

from __future__ import annotations

import dataclasses

import gptq_reference as ref
import pytest
import torch

from hexq.algos import hessian as hessian_mod
from hexq.algos.gptq import GPTQBankResult, gptq_bank, gptq_replicas
from hexq.algos.hessian import HessianFactor, factorize_hessians
from hexq.algos.quant import QuantSpec, dequantize, grid_params
from hexq.algos.row_grids import RowGrids
from tests.conftest import HexqFactoriesOnMeta
from tests.gptq_single import gptq_quantize


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def expert_batch(experts: int = 3, rows: int = 8, n: int = 48, tokens: int = 192, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [E, rows, n], H [E, n, n] = 2 X X^T with correlated channels and a few outlier channels, importance [E, n]
    (max |x| per channel). Each expert sees its own tokens, so orders and grids differ between experts."""
    g = _gen(seed)
    f64 = torch.float64
    mixing = torch.randn(n, n, generator=g, dtype=f64) / n**0.5
    mixing = mixing @ torch.diag(torch.logspace(0, -2, n, dtype=f64)) + 0.05 * torch.eye(n, dtype=f64)
    X = torch.randn(experts, tokens, n, generator=g, dtype=torch.float64) @ mixing.T
    X[:, :, [3 % n, 17 % n, 40 % n]] *= 10.0
    W = torch.randn(experts, rows, n, generator=g, dtype=torch.float64)
    H = 2 * X.mT @ X
    return W.to(dtype), H.to(dtype), X.abs().amax(dim=1).to(dtype)


def quantization_order(factor: HessianFactor, expert: int) -> torch.Tensor:
    n = factor.hinv_chol.shape[-1]
    return torch.arange(n) if factor.perm is None else factor.perm[expert]


def check_against_reference(W: torch.Tensor, H: torch.Tensor, bank: dict[int, GPTQBankResult], factor: HessianFactor,
                            template: QuantSpec, act_order: str, importance: torch.Tensor | None, *, tie: float,
                            loss_rtol: float) -> dict[int, list[ref.GPTQResult]]:
    """Every expert and width of `bank` against the reference run on that expert and width alone; returns the
    reference results."""
    references = {}
    for bits, result in bank.items():
        spec = dataclasses.replace(template, bits=bits)
        references[bits] = []
        for e in range(W.shape[0]):
            want = ref.gptq_quantize(W[e], H[e], spec, act_order=act_order,
                                     column_importance=None if importance is None else importance[e])
            same = ref.assert_same_up_to_ties(result.codes[e], want.codes, want.rounding, quantization_order(factor, e),
                                              tie=tie)
            assert torch.allclose(result.loss[e][same], want.loss[same].to(result.loss.dtype), rtol=loss_rtol)
            assert torch.allclose(result.scale[e][same], want.meta.scale[same].to(result.scale.dtype), rtol=loss_rtol)
            assert torch.allclose(result.zero[e][same], want.meta.zero[same].to(result.zero.dtype), rtol=loss_rtol)
            references[bits].append(want)
    return references


# ------------------------------------------------------------------------------------------ equal to the reference

ALL_WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("act_order", ["none", "max_activation", "sum_of_squares"])
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_bank_equals_reference_float64(symmetric: bool, group_size: int | None, act_order: str) -> None:
    W, H, importance = expert_batch(seed=1)
    template = QuantSpec(bits=4, group_size=group_size, symmetric=symmetric)
    imp = importance if act_order == "max_activation" else None
    factor = factorize_hessians(H, act_order=act_order, column_importance=imp)
    bank = gptq_bank(W, factor, ALL_WIDTHS, template, block_size=10)  # blocks not aligned with groups
    assert sorted(bank) == ALL_WIDTHS
    for bits, result in bank.items():
        assert result.codes.shape == W.shape and result.codes.dtype == torch.uint8 and result.bits == bits
        assert result.scale.shape == (3, 8, 48 // (group_size or 48)) and result.loss.shape == (3, 8)
        assert result.codes.max() <= 2**bits - 1
    check_against_reference(W, H, bank, factor, template, act_order, imp, tie=1e-9, loss_rtol=1e-9)


@pytest.mark.parametrize("act_order", ["none", "sum_of_squares"])
def test_spread_one_bit_grids_equal_reference(act_order: str) -> None:
    """weights.one_bit spread: the 1-bit rows' grids (dynamic in natural order, static with act_order) are the
    reference's quant.grid_params with the spread levels, every other width as with min/max."""
    W, H, _importance = expert_batch(seed=2)
    template = QuantSpec(bits=4, group_size=16, symmetric=False, one_bit="spread")
    factor = factorize_hessians(H, act_order=act_order)
    bank = gptq_bank(W, factor, [1, 2], template, block_size=10)
    check_against_reference(W, H, bank, factor, template, act_order, None, tie=1e-9, loss_rtol=1e-9)
    plain = gptq_bank(W, factor, [1, 2], QuantSpec(bits=4, group_size=16, symmetric=False), block_size=10)
    assert not torch.equal(bank[1].scale, plain[1].scale) and torch.equal(bank[2].codes, plain[2].codes)


@pytest.mark.parametrize("act_order", ["none", "sum_of_squares"])
def test_float_zero_grids_equal_reference(act_order: str) -> None:
    """weights.float_zero_bits: those widths' grids (dynamic in natural order, static with act_order) are the
    reference's quant.grid_params spanning [min, max] with a float zero point, the other widths as before."""
    W, H, _importance = expert_batch(seed=3)
    template = QuantSpec(bits=4, group_size=16, symmetric=False, float_zero_bits=(2,))
    factor = factorize_hessians(H, act_order=act_order)
    bank = gptq_bank(W, factor, [2], template, block_size=10)
    check_against_reference(W, H, bank, factor, template, act_order, None, tie=1e-9, loss_rtol=1e-9)
    assert not bool((bank[2].zero == bank[2].zero.round()).all())


@pytest.mark.parametrize("group_size", [8, 16, 24])
@pytest.mark.parametrize("symmetric", [True, False])
def test_groups_inside_and_across_blocks(symmetric: bool, group_size: int) -> None:
    """Dynamic groups starting inside a lazy block (8, 16 in blocks of 40), ending past it (24), and longer than a
    segment: every grid must see fully updated weights, so results equal the reference."""
    W, H, _ = expert_batch(experts=2, rows=24, seed=12)
    template = QuantSpec(bits=3, group_size=group_size, symmetric=symmetric)
    factor = factorize_hessians(H)
    bank = gptq_bank(W, factor, [2, 3, 4], template, block_size=40)
    check_against_reference(W, H, bank, factor, template, "none", None, tie=1e-9, loss_rtol=1e-9)


def float32_loss_rtol(bits: int, columns: int) -> float:
    """How far a float32 GPTQ loss may lie from the float64 reference's, from the arithmetic alone (no machine's
    measurement): every updated weight is a float32 accumulation over at most `columns` terms, so it carries a
    relative error of at most gamma_n = n*u / (1 - n*u) (u = 2^-24, the unit roundoff; Higham, Accuracy and Stability
    of Numerical Algorithms, eq. 3.4) of the row's magnitude; a b-bit grid leaves residuals of about 2^-(b+1) of the
    row's range, so relative to a residual that error is gamma_n * 2^(b+1); the loss squares the residual (x2) and
    the float32 Hessian factor rounds once more on the way in (x2). Which SIMD kernels a CPU picks moves the result
    inside this bound, not past it (the previous fixed 1e-4 passed on one CPU and failed on another)."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = columns * u / (1 - columns * u)
    return gamma * 2 ** (bits + 1) * 4


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_bank_float32_matches_reference(symmetric: bool, group_size: int | None) -> None:
    """float32 Hessians factorized in float32: the reference factorizes in float64, so weights differ by float32
    rounding; codes still agree up to near-ties and each row's loss within float32_loss_rtol."""
    W, H, _ = expert_batch(experts=2, rows=32, n=96, tokens=384, seed=2, dtype=torch.float32)
    template = QuantSpec(bits=4, group_size=group_size, symmetric=symmetric)
    factor = factorize_hessians(H)
    assert factor.hinv_chol.dtype == torch.float32 and not factor.float64_used.any()
    bank = gptq_bank(W, factor, [1, 2, 3, 4, 8], template)
    for bits, result in bank.items():
        rtol = float32_loss_rtol(bits, W.shape[-1])
        references = check_against_reference(W, H, {bits: result}, factor, template, "none", None, tie=1e-3,
                                             loss_rtol=rtol)
        want = references[bits]
        differ = torch.stack([r.codes for r in want]) != result.codes
        assert differ.float().mean() < 0.01
        # symmetric grids: a row that took the other side of a tie follows another, equally valid path whose loss
        # differs by a few percent (measured up to 7% on one row); asymmetric grids have no systematic ties.
        total = sum(float(r.loss.sum()) for r in want)
        assert float(result.loss.sum()) == pytest.approx(total, rel=0.02 if symmetric else rtol)


def test_batch_equals_each_expert_alone() -> None:
    W, H, importance = expert_batch(experts=4, seed=3, dtype=torch.float32)
    template = QuantSpec(bits=3, group_size=16, symmetric=False)
    for act_order, imp in (("none", None), ("max_activation", importance)):
        batch = gptq_bank(W, H, [2, 4], template, act_order=act_order, column_importance=imp, block_size=16)
        for e in range(4):
            alone = gptq_bank(W[e:e + 1], H[e:e + 1], [2, 4], template, act_order=act_order,
                              column_importance=None if imp is None else imp[e:e + 1], block_size=16)
            for bits in (2, 4):
                assert torch.equal(batch[bits].codes[e], alone[bits].codes[0])
                assert torch.equal(batch[bits].scale[e], alone[bits].scale[0])
                assert torch.allclose(batch[bits].loss[e], alone[bits].loss[0], rtol=1e-6)


def test_wrappers_are_the_bank_with_one_expert() -> None:
    W, H, importance = expert_batch(experts=1, seed=4, dtype=torch.float32)
    template = QuantSpec(bits=4, group_size=16, symmetric=False)
    bank = gptq_bank(W, H, [2, 3], template, act_order="max_activation", column_importance=importance)
    replicas = gptq_replicas(W[0], H[0], [2, 3], template, act_order="max_activation",
                             column_importance=importance[0])
    single = gptq_quantize(W[0], H[0], QuantSpec(bits=3, group_size=16, symmetric=False), act_order="max_activation",
                           column_importance=importance[0])
    for bits in (2, 3):
        assert torch.equal(replicas[bits].codes, bank[bits].codes[0])
        assert torch.equal(dequantize(replicas[bits].codes, replicas[bits].meta),
                           dequantize(bank[bits].codes[0], bank[bits].meta(0)))
    assert torch.equal(single.codes, bank[3].codes[0]) and single.damp_used == pytest.approx(0.01)


def test_row_grids_equal_grid_params() -> None:
    """The per-row-width grid of the stacked loop is quant.grid_params, bit for bit, at every width."""
    g = _gen(5)
    w = torch.randn(6, 9, 16, generator=g)
    w[0] = w[0].abs()  # all positive
    w[1] = -w[1].abs()  # all negative
    w[2] = 0.0  # all zero
    specs = [QuantSpec(bits=b, symmetric=s) for s in (True, False) for b in range(1, 9)]
    specs += [QuantSpec(bits=b, symmetric=False, float_zero_bits=(b,)) for b in range(2, 9)]
    for symmetric in (True, False):
        chosen = [s for s in specs if s.symmetric == symmetric]
        grids = RowGrids.build(chosen, 9, torch.float32, w.device)
        stacked = w.repeat(1, len(chosen), 1)  # [6, 8 * 9, 16]: row block b at width chosen[b]
        lo, hi = torch.aminmax(stacked, dim=-1)
        scale, zero = grids.params(lo, hi)
        for b, spec in enumerate(chosen):
            want_scale, want_zero = grid_params(w, spec)
            assert torch.equal(scale[:, b * 9:(b + 1) * 9], want_scale), spec
            assert torch.equal(zero[:, b * 9:(b + 1) * 9], want_zero), spec
    spread = [QuantSpec(bits=b, symmetric=False, one_bit="spread") for b in (1, 2)]
    grids = RowGrids.build(spread, 9, torch.float32, w.device)
    scale, zero = grids.params(*grids.bounds(w.repeat(1, 2, 1), -1))
    for b, spec in enumerate(spread):
        want_scale, want_zero = grid_params(w, spec)
        assert torch.allclose(scale[:, b * 9:(b + 1) * 9], want_scale, rtol=1e-6), spec
        assert torch.allclose(zero[:, b * 9:(b + 1) * 9], want_zero, rtol=1e-6, atol=1e-6), spec


def test_dead_inputs_zeroed_per_expert() -> None:
    W, H, _ = expert_batch(experts=2, n=32, seed=6, dtype=torch.float32)
    H[0, 5, :] = H[0, :, 5] = 0.0
    H[1, [7, 30], :] = 0.0
    H[1, :, [7, 30]] = 0.0
    factor = factorize_hessians(H)
    assert factor.dead[0].nonzero().flatten().tolist() == [5] and factor.dead[1].nonzero().flatten().tolist() == [7, 30]
    result = gptq_bank(W, factor, [4], QuantSpec(bits=4, symmetric=False))[4]
    assert torch.equal(dequantize(result.codes[0], result.meta(0))[:, 5], torch.zeros(8))
    assert torch.equal(dequantize(result.codes[1], result.meta(1))[:, [7, 30]], torch.zeros(8, 2))
    assert dequantize(result.codes[0], result.meta(0))[:, 7].abs().sum() > 0


# ------------------------------------------------------------------------------------------ factorization


def test_damping_and_float64_fallback_are_per_expert() -> None:
    g = _gen(7)
    n = 32
    well = torch.randn(n, 4 * n, generator=g, dtype=torch.float64)
    low_rank = torch.randn(n, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 256, generator=g,
                                                                                 dtype=torch.float64)
    indefinite = 2 * low_rank @ low_rank.T
    indefinite -= 0.05 * torch.diagonal(indefinite).mean() * torch.eye(n, dtype=torch.float64)
    # expert 0: fine in float32; expert 1: rank 8, so 1e-7 damping is below float32 resolution but not float64's;
    # expert 2: indefinite, needs damp >= 0.05.
    H = torch.stack([2 * well @ well.T, 2 * low_rank @ low_rank.T, indefinite]).float()
    factor = factorize_hessians(H, damp=1e-7)
    assert factor.float64_used.tolist() == [False, True, False]
    assert factor.damp_used.tolist() == pytest.approx([1e-7, 1e-7, 0.1])
    assert factor.hinv_chol.dtype == torch.float32 and torch.isfinite(factor.hinv_chol).all()
    for e in range(3):  # each expert's factor is the one it gets alone
        alone = factorize_hessians(H[e:e + 1], damp=1e-7)
        assert torch.equal(alone.hinv_chol[0], factor.hinv_chol[e])
        assert alone.damp_used.tolist() == factor.damp_used[e:e + 1].tolist()
    W = torch.randn(3, 4, n, generator=g)
    result = gptq_bank(W, factor, [4], QuantSpec(bits=4))[4]
    assert result.damp_used.tolist() == pytest.approx([1e-7, 1e-7, 0.1]) and torch.isfinite(result.loss).all()


def test_float64_retry_only_for_failing_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which experts each attempt covers: all in float32, then only the failures in float64."""
    W, H, _ = expert_batch(experts=4, n=16, seed=8, dtype=torch.float32)
    attempts = []
    original = hessian_mod._damped_inverse_cholesky

    def failing_expert_2_in_float32(A: torch.Tensor, damp: float):
        U, ok = original(A, damp)
        attempts.append((A.dtype, A.shape[0]))
        if A.dtype == torch.float32 and A.shape[0] == 4:
            ok = ok.clone()
            ok[2] = False
        return U, ok

    monkeypatch.setattr(hessian_mod, "_damped_inverse_cholesky", failing_expert_2_in_float32)
    factor = factorize_hessians(H)
    assert attempts == [(torch.float32, 4), (torch.float64, 1)]
    assert factor.float64_used.tolist() == [False, False, True, False]
    assert factor.damp_used.tolist() == pytest.approx([0.01] * 4)
    monkeypatch.undo()
    exact = factorize_hessians(H.double())
    assert torch.allclose(factor.hinv_chol[2], exact.hinv_chol[2].float(), rtol=1e-6, atol=1e-9)


def test_factorization_errors_name_the_expert() -> None:
    H = torch.eye(2).repeat(3, 1, 1)
    H[1] = torch.tensor([[1.0, 5.0], [5.0, 1.0]])  # eigenvalues 6, -4: no damp up to max_damp fixes it
    with pytest.raises(ValueError, match=r"expert 1 .*max_damp"):
        factorize_hessians(H)
    H[1] = torch.eye(2)
    H[2, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="expert 2 contains NaN"):
        factorize_hessians(H)
    with pytest.raises(ValueError, match=r"\[E, in, in\]"):
        factorize_hessians(torch.eye(2))
    with pytest.raises(ValueError, match="column_importance"):
        factorize_hessians(torch.eye(4).repeat(2, 1, 1), act_order="max_activation", column_importance=torch.ones(2, 3))


def test_bank_argument_errors() -> None:
    W, H, _ = expert_batch(experts=2, n=16, seed=9, dtype=torch.float32)
    spec = QuantSpec(bits=4)
    with pytest.raises(ValueError, match="bits_list"):
        gptq_bank(W, H, [], spec)
    with pytest.raises(ValueError, match=r"\[E, out, in\]"):
        gptq_bank(W[0], H, [4], spec)
    with pytest.raises(ValueError, match=r"H must be \[2, 16, 16\]"):
        gptq_bank(W, H[:1], [4], spec)
    with pytest.raises(ValueError, match="factor is for 1 experts"):
        gptq_bank(W, factorize_hessians(H[:1]), [4], spec)
    with pytest.raises(ValueError, match="multiple of group_size"):
        gptq_bank(W, H, [4], QuantSpec(bits=4, group_size=6))


# ------------------------------------------------------------------------------------------ structure


def _torch_calls(fn) -> int:
    class Counter(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.calls


@pytest.mark.parametrize("group_size", [None, 8])
def test_python_steps_do_not_grow_with_experts_or_widths(group_size: int | None) -> None:
    """The column loop runs `in` times whatever E and the number of widths: the torch calls made do not depend on
    E at all, and each extra width adds the same few calls (result slicing) whatever the number of columns."""
    spec = QuantSpec(bits=4, group_size=group_size, symmetric=False)

    def calls(experts: int, widths: list[int], n: int) -> int:
        W, H, _ = expert_batch(experts=experts, n=n, seed=10, dtype=torch.float32)
        factor = factorize_hessians(H)
        return _torch_calls(lambda: gptq_bank(W, factor, widths, spec, block_size=8))

    assert calls(5, [4], 32) == calls(1, [4], 32)
    assert calls(5, [1, 2, 3, 4, 8], 32) - calls(5, [4], 32) == calls(5, [1, 2, 3, 4, 8], 64) - calls(5, [4], 64)
    assert calls(1, [4], 64) - calls(1, [4], 32) >= 32 * 8  # while every extra column costs several calls


def test_runs_with_meta_default_device() -> None:
    """Every tensor is created on the inputs' device: with the default device set to meta, CPU inputs still give
    the same CPU results (including the identity used for failed factors and the float64 retry), and no factory
    function is called without device=."""
    W, H, importance = expert_batch(experts=3, n=32, seed=11, dtype=torch.float32)
    low_rank = torch.randn(32, 4, generator=_gen(12)) @ torch.randn(4, 64, generator=_gen(13))
    H[2] = 2 * low_rank @ low_rank.T
    H[2] -= 0.05 * torch.diagonal(H[2]).mean() * torch.eye(32)  # indefinite: needs escalation
    H[1, 4, :] = H[1, :, 4] = 0.0  # a dead channel
    spec = QuantSpec(bits=3, group_size=8, symmetric=True)

    def run():
        banks = [gptq_bank(W, H, [1, 3], spec, act_order=act_order, column_importance=importance)
                 for act_order in ("none", "max_activation")]
        return banks, gptq_quantize(W[0], H[0], spec)

    want = run()
    with HexqFactoriesOnMeta():
        got = run()
    for got_bank, want_bank in zip(got[0], want[0], strict=True):
        for bits in (1, 3):
            assert got_bank[bits].codes.device.type == "cpu"
            assert torch.equal(got_bank[bits].codes, want_bank[bits].codes)
            assert torch.equal(got_bank[bits].loss, want_bank[bits].loss)
            assert torch.equal(got_bank[bits].damp_used, want_bank[bits].damp_used)
    assert torch.equal(got[1].codes, want[1].codes)


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_bits_keeps_each_rows_best_range_and_what_it_reports_is_what_it_kept(symmetric):
    """clip_bits (CLIP_RATIOS): every row's loss is the lowest of its whole-range and narrowed copies, so never above
    the bank without it, and below it on some rows; the kept codes, grids and loss belong together (the loss
    recomputed from the dequantized row, 0.5 dw H_damped dw^T, is the reported one); widths outside clip_bits are
    unchanged."""
    W, H, _ = expert_batch(rows=16)
    factor = factorize_hessians(H, damp=0.01, act_order="sum_of_squares")
    template = QuantSpec(bits=2, group_size=16, symmetric=symmetric, float_zero_bits=() if symmetric else (2,))
    plain = gptq_bank(W, factor, [2, 3], template)
    clipped = gptq_bank(W, factor, [2, 3], template, clip_bits=[2])
    assert torch.equal(clipped[3].codes, plain[3].codes)  # the rest up to the summation order of a wider stack
    for name in ("scale", "zero", "loss"):
        assert torch.allclose(getattr(clipped[3], name), getattr(plain[3], name), rtol=1e-9)
    new, old = clipped[2], plain[2]
    assert (new.loss <= old.loss * (1 + 1e-9)).all() and (new.loss < old.loss * (1 - 1e-6)).any()
    narrowed = (new.scale < old.scale * (1 - 1e-9)).all(dim=-1)  # rows that kept a narrowed copy, every group
    assert narrowed.any() and (narrowed | (new.scale == old.scale).all(dim=-1)).all()
    damped = H + torch.diag_embed(factor.damp_used[:, None] * H.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True)
                                  .expand(-1, H.shape[-1]))
    grid = (new.codes.double().reshape(3, 16, -1, 16) - new.zero[..., None]) * new.scale[..., None]
    dw = W - grid.reshape(W.shape)
    recomputed = 0.5 * torch.einsum("eri,eij,erj->er", dw, damped, dw)
    assert torch.allclose(recomputed, new.loss, rtol=1e-6)
