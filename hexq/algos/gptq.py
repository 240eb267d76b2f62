"""GPTQ: Hessian-aware weight quantization with error compensation (paper 003 §III.B; Frantar et al., GPTQ).

Objective (eq. 4): argmin_Q ||W X - Q X||^2, row by row, whose Hessian is H = 2 X X^T. Columns are quantized one
at a time in a fixed order; column i takes the grid value nearest to its current weight (eq. 5, nearest rounding
is optimal for a single column) and the error is pushed onto the not-yet-quantized columns F (eq. 6):

    delta_F = -(w_i - Q(w_i)) / [H_F^-1]_ii * (H_F^-1)_{:,i}

GPTQ's reformulation, used here: with the upper Cholesky factor U of H^-1 (H^-1 = U^T U), row i of U restricted to
columns >= i equals (H_F^-1)_{i,F} / sqrt([H_F^-1]_ii), so every H_F^-1 needed by eq. 5-6 is read from U and never
recomputed. Updates are applied inside a block of columns immediately and to the columns after the block once per
block ("lazy batch updates"), which turns the rank-1 updates into one matrix product per block.

Rows never interact in eq. 5-6: only columns do, through U. A replica bank (paper 002 Algorithm 1: every routed
expert at several widths from one Hessian) is therefore one GPTQ run: the widths of one expert are stacked as extra
rows, each row with its own grid, and the experts are the batch dimension of every tensor (`gptq_bank`). The
Cholesky step depends only on H and is batched over experts too (`factorize_hessians`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from hexq.algos.quant import QuantMeta, QuantSpec

ACT_ORDERS = ("none", "max_activation", "sum_of_squares")


@dataclass(frozen=True)
class HessianFactor:
    """Everything GPTQ needs from a batch of E Hessians [E, n, n], computed once for every width.

    hinv_chol: [E, n, n] upper Cholesky factor U of each damped inverse Hessian, in that expert's quantization order
        (H^-1 = U^T U); float32, or float64 when H was float64.
    perm: [E, n] quantization order of each expert as original column indices (long), or None for natural order.
    dead: [E, n] bool, input channels whose Hessian diagonal is zero (never active in calibration).
    damp_used: [E] float64, damping applied per expert, as a fraction of its mean Hessian diagonal.
    float64_used: [E] bool, experts whose float32 factorization failed and were factorized in float64.
    act_order: the ordering that produced `perm`.
    """

    hinv_chol: torch.Tensor
    perm: torch.Tensor | None
    dead: torch.Tensor
    damp_used: torch.Tensor
    float64_used: torch.Tensor
    act_order: str = "none"

    @property
    def num_experts(self) -> int:
        return self.hinv_chol.shape[0]


@dataclass(frozen=True)
class GPTQResult:
    """Quantized weight: integer codes [out, in] (uint8, hexq.algos.quant convention) and their QuantMeta.

    dequantize(codes, meta) is the quantized weight. `loss` [out] is GPTQ's per-row error
    sum_i (w_i - Q(w_i))^2 / (2 [H_F^-1]_ii) (eq. 5 summed over the loop). It equals 0.5 dw H_damped dw^T for
    dw = w - w_q, i.e. ||dw X||^2 (eq. 4) plus the damping term 0.5 * damp * mean(diag H) * ||dw||^2.
    """

    codes: torch.Tensor
    meta: QuantMeta
    damp_used: float
    loss: torch.Tensor


@dataclass(frozen=True)
class GPTQBankResult:
    """One width of a bank: every expert's weight at `bits`.

    codes [E, out, in] uint8 in the original column order; scale, zero [E, out, in / group_size] (float32, or float64
    when W was float64); damp_used [E]; loss [E, out] as GPTQResult.loss per expert.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int
    damp_used: torch.Tensor
    loss: torch.Tensor

    def meta(self, expert: int) -> QuantMeta:
        return QuantMeta(self.scale[expert], self.zero[expert], self.group_size, self.bits)

    def expert(self, expert: int) -> GPTQResult:
        return GPTQResult(codes=self.codes[expert], meta=self.meta(expert), damp_used=float(self.damp_used[expert]),
                          loss=self.loss[expert])


# ------------------------------------------------------------------------------------------ the Hessian factor


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 inputs keep float64 (exact reference behaviour); everything else is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_damp(damp: float, max_damp: float) -> None:
    if not 0 < damp <= max_damp:
        raise ValueError(f"damp must be in (0, max_damp={max_damp}], got {damp}")


def _column_order(diag: torch.Tensor, act_order: str, column_importance: torch.Tensor | None) -> torch.Tensor | None:
    """Quantization order per row of diag [..., n] (see column_order)."""
    if act_order not in ACT_ORDERS:
        raise ValueError(f"act_order must be one of {ACT_ORDERS}, got {act_order!r}")
    if act_order == "none":
        return None
    if column_importance is None:
        if act_order == "max_activation":
            raise ValueError("act_order='max_activation' needs column_importance (max |X| per input channel)")
        column_importance = diag
    n = diag.shape[-1]
    if column_importance.shape not in (diag.shape, (n,)):
        raise ValueError(f"column_importance must have shape {tuple(diag.shape)} or ({n},), "
                         f"got {tuple(column_importance.shape)}")
    importance = column_importance.to(device=diag.device, dtype=torch.float64).expand(diag.shape)
    # stable sort: ties keep the natural order, so the result does not depend on the sort implementation.
    return torch.argsort(importance, dim=-1, descending=True, stable=True)


def column_order(H: torch.Tensor, act_order: str, column_importance: torch.Tensor | None = None) -> torch.Tensor | None:
    """Quantization order for act_order (most important column first), or None for the natural order.

    H is [n, n] or a batch [E, n, n]; the order is [n] or [E, n] (one per expert). "max_activation" ranks by
    `column_importance` (e.g. max |X| per channel, required, [n] or [E, n]); "sum_of_squares" ranks by
    `column_importance` or, when absent, by diag(H) = 2 sum_t x_t^2. Important columns go first so that their error
    can still be compensated by the many columns after them.
    """
    return _column_order(torch.diagonal(H, dim1=-2, dim2=-1), act_order, column_importance)


def _prepared(H: torch.Tensor, experts: torch.Tensor, perm: torch.Tensor | None, dtype: torch.dtype,
              fix_dead: bool) -> torch.Tensor:
    """A new [k, n, n] tensor: H of `experts` in their quantization order, dead diagonals set to 1, in dtype.

    Dead inputs (diag H == 0) get diag 1, as in GPTQ: their row/column of H is zero, so this decouples them and
    keeps H invertible.
    """
    if perm is None:
        A = H[experts]
    else:
        p = perm[experts]
        A = H[experts[:, None, None], p[:, :, None], p[:, None, :]]  # one gather: rows and columns permuted
    A = A.to(dtype)
    if fix_dead:
        diag = torch.diagonal(A, dim1=-2, dim2=-1)
        diag.masked_fill_(diag == 0, 1.0)
    return A


def _damped_inverse_cholesky(A: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, ok): upper Cholesky factors of (A + damp * mean(diag A) * I)^-1 for a batch A [k, n, n], and which
    experts succeeded. A is consumed: its memory holds H^-1 afterwards, so the peak is two copies of A."""
    diag = torch.diagonal(A, dim1=-2, dim2=-1)
    diag_mean = diag.mean(dim=-1, keepdim=True)
    bad_mean = torch.where(diag_mean[:, 0] <= 0)[0]
    if bad_mean.numel():
        raise ValueError(f"H of expert {int(bad_mean[0])} has mean diagonal {float(diag_mean[bad_mean[0]]):g} <= 0; "
                         "expected 2 X X^T summed over tokens")
    diag.add_(damp * diag_mean)  # in place: no dense identity
    L, info = torch.linalg.cholesky_ex(A)
    failed = info != 0
    if failed.any():  # a failed factor holds garbage: give it the identity so the steps below stay finite
        L[failed] = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    # H^-1 from its Cholesky factor (into A), then the upper factor of H^-1 that eq. 5-6 read from (into L).
    torch.cholesky_inverse(L, out=A)
    U, info_inv = torch.linalg.cholesky_ex(A, upper=True, out=(L, torch.empty_like(info)))
    u_diag = torch.diagonal(U, dim1=-2, dim2=-1)
    ok = ~failed & (info_inv == 0) & torch.isfinite(u_diag).all(dim=-1) & (u_diag > 0).all(dim=-1)
    return U, ok


def _factorize(H: torch.Tensor, perm: torch.Tensor | None, damp: float, max_damp: float,
               fix_dead: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U [E, n, n], damp_used [E] float64, float64_used [E] bool) for H [E, n, n], with per-expert fallbacks.

    All experts are factorized together in the compute dtype (float32 unless H is float64). Only the experts whose
    factorization fails are retried in float64 at the same damp, and only those that still fail move to damp x10,
    up to max_damp; beyond that H is not a usable Hessian and a ValueError names the first such expert.
    """
    dtype = _compute_dtype(H)
    device = H.device
    num = H.shape[0]
    damp_used = torch.full((num,), damp, dtype=torch.float64, device=device)
    float64_used = torch.zeros(num, dtype=torch.bool, device=device)
    attempts = (dtype,) if dtype == torch.float64 else (dtype, torch.float64)
    pending = torch.arange(num, device=device)
    U = None
    current = damp
    while True:
        for attempt in attempts:
            U_try, ok = _damped_inverse_cholesky(_prepared(H, pending, perm, attempt, fix_dead), current)
            done = pending[ok]
            if U is None:
                U = U_try.to(dtype)  # the first attempt covers every expert; failures are overwritten below
            elif done.numel():
                U[done] = U_try[ok].to(dtype)
            damp_used[done] = current
            if attempt != dtype:
                float64_used[done] = True
            pending = pending[~ok]
            if not pending.numel():
                return U, damp_used, float64_used
        if current >= max_damp:
            raise ValueError(f"Cholesky of the damped Hessian of expert {int(pending[0])} (index in the batch) "
                             f"failed up to damp={current:g} (max_damp={max_damp:g}); H is not positive "
                             "semi-definite - check how it was accumulated, or raise max_damp")
        current = min(current * 10, max_damp)


def _check_finite(H: torch.Tensor) -> None:
    finite = torch.isfinite(H).flatten(1).all(dim=1)
    if not finite.all():
        raise ValueError(f"H of expert {int(torch.where(~finite)[0][0])} contains NaN or inf; "
                         "check the calibration activations")


def inverse_hessian_cholesky(H: torch.Tensor, damp: float = 0.01, *,
                             max_damp: float = 1.0) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 for one H [n, n], and the damp that worked.

    Damping keeps H positive definite when calibration tokens are few or channels are collinear (GPTQ uses 1% of
    the mean diagonal). If a Cholesky fails (H indefinite or numerically singular) it is retried in float64, then
    damp is multiplied by 10 up to `max_damp`; beyond that a ValueError says H is not usable. U is float32, or
    float64 for a float64 H.
    """
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square [in, in] matrix, got shape {tuple(H.shape)}")
    _check_damp(damp, max_damp)
    _check_finite(H[None])
    U, damp_used, _ = _factorize(H[None], None, damp, max_damp, fix_dead=False)
    return U[0], float(damp_used[0])


def factorize_hessians(H: torch.Tensor, *, damp: float = 0.01, act_order: str = "none",
                       column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> HessianFactor:
    """Dead-channel fix, column ordering and inverse-Hessian Cholesky for a batch H [E, n, n] (float32 as
    accumulated; a float64 H is factorized in float64): the part of GPTQ shared by all widths.

    Per expert: inputs with diag H == 0 are dead (gptq_bank zeroes their weight columns: they never see a nonzero
    input); column order from act_order (column_importance [n] shared or [E, n] per expert); damping
    damp * mean(diag H) on the diagonal; U = upper Cholesky factor of H^-1. Experts whose float32 factorization
    fails are retried in float64, then with more damping (see `_factorize`); damp_used and float64_used record it.
    Working set: H plus two [E, n, n] copies in the compute dtype (the second becomes U).
    """
    if H.ndim != 3 or H.shape[1] != H.shape[2]:
        raise ValueError(f"H must be a batch of square matrices [E, in, in], got shape {tuple(H.shape)}")
    _check_damp(damp, max_damp)
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    negative = (diag < 0).any(dim=-1)
    if negative.any():
        raise ValueError(f"H of expert {int(torch.where(negative)[0][0])} has negative diagonal entries; "
                         "expected 2 X X^T summed over tokens")
    _check_finite(H)
    dead = diag == 0
    perm = _column_order(diag.to(_compute_dtype(H)).masked_fill(dead, 1.0), act_order, column_importance)
    U, damp_used, float64_used = _factorize(H, perm, damp, max_damp, fix_dead=True)
    return HessianFactor(hinv_chol=U, perm=perm, dead=dead, damp_used=damp_used, float64_used=float64_used,
                         act_order=act_order)


def factorize_hessian(H: torch.Tensor, *, damp: float = 0.01, act_order: str = "none",
                      column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> HessianFactor:
    """factorize_hessians for one H [n, n] (column_importance [n]): a factor with a batch of one expert."""
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square [in, in] matrix, got shape {tuple(H.shape)}")
    if column_importance is not None and column_importance.shape != (H.shape[0],):
        raise ValueError(f"column_importance must have shape ({H.shape[0]},), got {tuple(column_importance.shape)}")
    return factorize_hessians(H[None], damp=damp, act_order=act_order, max_damp=max_damp,
                              column_importance=None if column_importance is None else column_importance[None])


# ------------------------------------------------------------------------------------------ the column loop


# Columns per segment: inside a lazy block, each column gathers the updates of its segment's earlier columns (one
# small product, "left-looking"), and a finished segment updates the rest of its block with one product. Two levels
# keep every update a matrix product: rank-1 updates of the whole block per column would move block_size / 2 times
# the stack through memory per column instead of SEGMENT / 2 times (read only).
SEGMENT = 16


def _blocks(n: int, block_size: int, group_size: int | None) -> list[tuple[int, int]]:
    """Lazy blocks [i1, i2). With dynamic groups (group_size given), a group starting inside a block must end inside
    it: otherwise the block ends at that group start.

    A group's grid is computed at its first column from the current weights, which must then hold every update from
    the columns before it. Inside a block that is true up to the block's end (segments flush into the rest of the
    block); beyond it only at a block start (lazy updates reach later columns at block ends).
    """
    blocks, i1 = [], 0
    while i1 < n:
        i2 = min((i1 // block_size + 1) * block_size, n)
        if group_size is not None:
            first = (i1 // group_size + 1) * group_size
            i2 = next((g for g in range(first, i2, group_size) if g + group_size > i2), i2)
        blocks.append((i1, i2))
        i1 = i2
    return blocks


def _segments(i1: int, i2: int, group_size: int | None) -> list[tuple[int, int]]:
    """Segments [s1, s2) of the block [i1, i2): cut at multiples of SEGMENT and, with dynamic groups, at every group
    start (a group's grid needs its columns fully updated)."""
    cuts = {i1} | {c for c in range(i1 + 1, i2) if c % SEGMENT == 0 or (group_size is not None and c % group_size == 0)}
    starts = sorted(cuts)
    return list(zip(starts, starts[1:] + [i2], strict=True))


@dataclass(frozen=True)
class _RowGrids:
    """Per stacked row [B * out]: what quant.grid_params needs to know about that row's width."""

    qmax: torch.Tensor  # 2^bits - 1
    one_bit: torch.Tensor  # bool
    sym_divisor: torch.Tensor  # scale = 2 max|w| / divisor: qmax, or 2 for 1 bit (levels +-max|w|/2)
    sym_zero: torch.Tensor  # (qmax + 1) / 2, or 0.5 for 1 bit
    symmetric: bool

    @classmethod
    def build(cls, specs: Sequence[QuantSpec], rows: int, dtype: torch.dtype, device: torch.device) -> _RowGrids:
        def per_row(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(rows)

        return cls(qmax=per_row([s.qmax for s in specs]),
                   one_bit=per_row([s.bits == 1 for s in specs]).bool(),
                   sym_divisor=per_row([2 if s.bits == 1 else s.qmax for s in specs]),
                   sym_zero=per_row([0.5 if s.bits == 1 else float((s.qmax + 1) // 2) for s in specs]),
                   symmetric=specs[0].symmetric)

    def params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """quant.grid_params for rows of different widths, from each row's (or group's) min and max along the last
        axis of the stacked rows: same conventions and the same float operations, so the grids are identical."""
        if self.symmetric:
            amax = torch.maximum(-lo, hi).clamp(min=1e-8)  # max |w|, exactly
            scale = 2 * amax / self.sym_divisor
            return scale, self.sym_zero.expand_as(scale).clone()
        # 1 bit asymmetric: the two levels {min, max}; otherwise the range is widened to include 0.
        lo = torch.where(self.one_bit, lo, lo.clamp(max=0))
        hi = torch.where(self.one_bit, hi, hi.clamp(min=0))
        scale = ((hi - lo) / self.qmax).clamp(min=1e-8)
        zero = -lo / scale
        return scale, torch.where(self.one_bit, zero, torch.round(zero))


def _stacked_columns(W: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor | None, width_count: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The stack [E, in, B * out]: W [E, out, in] with dead input columns zeroed (any weight gives the same output
    there, zero is the cheapest), columns in each expert's quantization order, one copy of the rows per width."""
    Wt = W.to(dtype).masked_fill(dead[:, None, :], 0).transpose(1, 2)
    Wt = Wt.contiguous() if perm is None else Wt.gather(1, perm[:, :, None].expand(-1, -1, Wt.shape[2]))
    return Wt.repeat(1, 1, width_count)


# grid(columns [E, span, R], first column) -> (scale, zero) [E, span // group, R]: the grid of `span` columns made
# from their current weights when the loop reaches the first of them (GPTQ's dynamic groups).
GridFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _quantize_stack(Wt: torch.Tensor, U: torch.Tensor, perm: torch.Tensor | None, scale: torch.Tensor,
                    zero: torch.Tensor, qmax: torch.Tensor, group: int, grid: GridFn | None, span: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The column loop of gptq_bank on the stack Wt [E, in, R] (updated in place): codes [E, in, R] uint8 in the
    original column order and the loss [E, R]. scale, zero [E, groups, R] are read (static grids, grid None) or
    filled in by `grid` at the first column of each span of columns (dynamic grids); qmax [R] is each row's top code."""
    num, n, stacked = Wt.shape
    codes = torch.empty(num, n, stacked, dtype=torch.uint8, device=Wt.device)
    loss = torch.zeros(num, stacked, dtype=Wt.dtype, device=Wt.device)
    dynamic = grid is not None
    blocks = _blocks(n, block_size, span if dynamic else None)
    longest = max(i2 - i1 for i1, i2 in blocks)
    q_buffer = torch.empty(num, longest, stacked, dtype=Wt.dtype, device=Wt.device)
    err_buffer = torch.empty_like(q_buffer)
    for i1, i2 in blocks:
        k = i2 - i1
        q_blk, err_blk = q_buffer[:, :k], err_buffer[:, :k]
        if perm is not None:  # static groups, per-expert order: each step's grid, per expert and row
            index = (perm[:, i1:i2, None] // group).expand(num, k, stacked)
            s_blk, z_blk = scale.gather(1, index), zero.gather(1, index)
        d_blk = torch.diagonal(U[:, i1:i2, i1:i2], dim1=1, dim2=2)[:, :, None]  # sqrt([H_F^-1]_ii), [E, k, 1]
        for s1, s2 in _segments(i1, i2, group if dynamic else None):
            if dynamic and s1 % span == 0:
                columns = Wt[:, s1:s1 + span]  # already holds every update from the columns before s1
                part = slice(s1 // group, (s1 + span) // group)
                scale[:, part], zero[:, part] = grid(columns, s1)
            for c in range(s1, s2):
                i = c - i1
                w, q, err = Wt[:, c], q_blk[:, i], err_blk[:, i]
                s, z = (s_blk[:, i], z_blk[:, i]) if perm is not None else (scale[:, c // group], zero[:, c // group])
                if c > s1:  # eq. 6 from the segment's earlier columns, gathered now
                    Wt[:, c:c + 1].baddbmm_(U[:, None, s1:c, c], err_blk[:, s1 - i1:i], alpha=-1)
                # eq. 5: the nearest grid value (quant.quantize_to_grid, with a per-row qmax)
                torch.div(w, s, out=q).add_(z).round_().clamp_(min=0)
                torch.minimum(q, qmax, out=q)
                torch.sub(q, z, out=err).mul_(s)
                torch.sub(w, err, out=err).div_(d_blk[:, i])  # (w - Q(w)) / [U]_ii
                loss.addcmul_(err, err, value=0.5)  # eq. 5 objective: the output error this column adds
            if s2 < i2:  # eq. 6 from the finished segment to the rest of the block
                Wt[:, s2:i2].baddbmm_(U[:, s1:s2, s2:i2].mT, err_blk[:, s1 - i1:s2 - i1], alpha=-1)
            # float -> uint8 is a slow conversion on CPU, through int32 it is not; per segment keeps temporaries small
            q_int = q_blk[:, s1 - i1:s2 - i1].to(torch.int32)
            if perm is None:
                codes[:, s1:s2].copy_(q_int)
            else:
                codes.scatter_(1, perm[:, s1:s2, None].expand_as(q_int), q_int.to(torch.uint8))
        if i2 < n:  # eq. 6 for the columns after the block, one batched update (lazy batch)
            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].mT, err_blk, alpha=-1)
    return codes, loss


def gptq_bank(W: torch.Tensor, factor_or_H: HessianFactor | torch.Tensor, bits_list: Sequence[int],
              spec_template: QuantSpec, *, block_size: int = 128, damp: float = 0.01, act_order: str = "none",
              column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> dict[int, GPTQBankResult]:
    """GPTQ of E weights W [E, out, in] at every width of bits_list, in one column loop (eq. 5-6).

    factor_or_H: a HessianFactor of the E Hessians, or the Hessians [E, in, in] (2 X X^T summed over each expert's
    calibration tokens), factorized here with damp, act_order, column_importance and max_damp (ignored otherwise).
    Each width uses spec_template with only `bits` replaced. Computed in float64 if W is float64, else float32.

    The B widths of an expert are stacked as rows: [E, in, B * out], stored column-major so that one column of
    every row of every expert is a contiguous [E, B * out] slice. The loop runs over the `in` columns once (the Python
    step count depends on neither E nor B); each step quantizes that column for all experts and widths, each stacked
    row with its own grid. Updates (eq. 6) are batched matrix products at two levels: inside a lazy block of
    block_size columns, a column first gathers the errors of its segment's earlier columns (SEGMENT columns) and a
    finished segment updates the rest of its block; a finished block updates all later columns (GPTQ's lazy batch).

    Grids (see quant.grid_params): per-channel (group_size None) grids come from the whole original row. With
    group_size and no act_order, each group's (scale, zero) is computed from the current, already error-updated
    weights when the loop reaches the group's first column (GPTQ's static_groups=False). With an act_order, columns
    of one group are not quantized together, so group grids are static: from the original weights of each
    contiguous original-column group (static_groups=True). Meta groups are contiguous original columns and codes
    are in the original column order. Input columns that are dead in the factor are zeroed.

    Peak working set beyond the inputs, in stacks (one stack = E * in * B * out values of the compute dtype, e.g.
    8 experts x 2048 x 5 x 1536 x 4 bytes = 480 MiB): the stack (1), its uint8 codes (1/4 in float32), block buffers
    (2 x block_size / in; 4 x with act_order); before the loop copies of W (2/B), after it the per-width result codes
    (1/4) in place of the stack. Measured on that example: 1.5 stacks above the inputs (1.8 with act_order), plus U
    converted to the compute dtype if the factor's dtype differs, plus two [E, in, in] copies while factorizing when
    H is given rather than a factor.
    """
    if W.ndim != 3:
        raise ValueError(f"W must be a batch of matrices [E, out, in], got shape {tuple(W.shape)}")
    if not bits_list:
        raise ValueError("bits_list is empty; give at least one bit width")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num, rows, n = W.shape
    group = n if spec_template.group_size is None else spec_template.group_size
    if n % group:
        raise ValueError(f"in_features {n} is not a multiple of group_size {group}")
    specs = [replace(spec_template, bits=bits) for bits in dict.fromkeys(bits_list)]
    if isinstance(factor_or_H, HessianFactor):
        factor = factor_or_H
        if factor.hinv_chol.shape != (num, n, n):
            raise ValueError(f"factor is for {factor.num_experts} experts x {factor.hinv_chol.shape[-1]} inputs, "
                             f"W is {tuple(W.shape)}")
    else:
        if factor_or_H.shape != (num, n, n):
            raise ValueError(f"H must be [{num}, {n}, {n}] for W of shape {tuple(W.shape)}, "
                             f"got {tuple(factor_or_H.shape)}")
        factor = factorize_hessians(factor_or_H, damp=damp, act_order=act_order, column_importance=column_importance,
                                    max_damp=max_damp)

    dtype, device = _compute_dtype(W), W.device
    width_count = len(specs)
    grids = _RowGrids.build(specs, rows, dtype, device)
    dynamic = spec_template.group_size is not None and factor.perm is None
    dead = factor.dead.to(device)
    perm = None if factor.perm is None else factor.perm.to(device)
    if dynamic:  # filled in by the loop, each group at its first column
        scale = torch.empty(num, n // group, width_count * rows, dtype=dtype, device=device)
        zero = torch.empty_like(scale)
    else:  # static grids from the original rows, the same for every width's copy of a row: [E, groups, B * out]
        grouped = W.to(dtype).masked_fill(dead[:, None, :], 0).reshape(num, rows, n // group, group)
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
        del grouped
        scale, zero = grids.params(lo.transpose(1, 2).repeat(1, 1, width_count),
                                   hi.transpose(1, 2).repeat(1, 1, width_count))
    # The stack is built inside the call so that nothing here keeps it alive once the loop returns.
    grid = (lambda columns, _first: tuple(t[:, None] for t in grids.params(columns.amin(dim=1), columns.amax(dim=1)))
            ) if dynamic else None
    codes, loss = _quantize_stack(_stacked_columns(W, dead, perm, width_count, dtype),
                                  factor.hinv_chol.to(device=device, dtype=dtype), perm, scale, zero, grids.qmax, group,
                                  grid, group, block_size)

    results = {}
    for b, spec in enumerate(specs):
        part = slice(b * rows, (b + 1) * rows)
        results[spec.bits] = GPTQBankResult(
            codes=codes[:, :, part].transpose(1, 2).contiguous(), scale=scale[:, :, part].transpose(1, 2).contiguous(),
            zero=zero[:, :, part].transpose(1, 2).contiguous(), group_size=group, bits=spec.bits,
            damp_used=factor.damp_used, loss=loss[:, part].clone())
    return results


def gptq_grid(W: torch.Tensor, factor: HessianFactor, grid: GridFn, span: int, group: int, qmax: int, *,
              block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of E weights W [E, out, in] on a grid the caller makes (eq. 5-6 as in gptq_bank, one width): codes in
    0..qmax with W ~ (codes - zero) * scale per group of `group` columns, where grid(columns, first) returns the
    (scale, zero) [E, span // group, out] of `span` columns. Natural order: each span's grid comes from its current,
    error-updated weights when the loop reaches it (GPTQ's dynamic groups; span 256 for ggml's K-quant super-blocks,
    whose 16 sub-block grids share one quantized super-scale). With an act_order factor the grids are static, made
    from the original weights. Returns codes [E, out, in] uint8, scale and zero [E, out, in / group], loss [E, out]
    (GPTQResult.loss)."""
    num, rows, n = W.shape
    if n % span or span % group:
        raise ValueError(f"in_features {n} must be a multiple of the grid span {span}, itself of the group {group}")
    if factor.hinv_chol.shape != (num, n, n):
        raise ValueError(f"factor is for {factor.num_experts} experts x {factor.hinv_chol.shape[-1]} inputs, "
                         f"W is {tuple(W.shape)}")
    dtype, device = _compute_dtype(W), W.device
    dead = factor.dead.to(device)
    perm = None if factor.perm is None else factor.perm.to(device)
    scale = torch.empty(num, n // group, rows, dtype=dtype, device=device)
    zero = torch.empty_like(scale)
    if perm is not None:  # static grids from the original columns
        original = W.to(dtype).masked_fill(dead[:, None, :], 0).transpose(1, 2)
        for first in range(0, n, span):
            part = slice(first // group, (first + span) // group)
            scale[:, part], zero[:, part] = grid(original[:, first:first + span], first)
        del original
    codes, loss = _quantize_stack(_stacked_columns(W, dead, perm, 1, dtype), factor.hinv_chol.to(device=device,
                                  dtype=dtype), perm, scale, zero, torch.full((rows,), float(qmax), dtype=dtype,
                                  device=device), group, None if perm is not None else grid, span, block_size)
    return codes.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous(), zero.transpose(1, 2).contiguous(), \
        loss


# ------------------------------------------------------------------------------------------ one weight


def gptq_quantize(W: torch.Tensor, H: torch.Tensor | None, spec: QuantSpec, *, block_size: int = 128,
                  damp: float = 0.01, act_order: str = "none", column_importance: torch.Tensor | None = None,
                  factor: HessianFactor | None = None, max_damp: float = 1.0) -> GPTQResult:
    """Quantize W [out, in] with GPTQ on the Hessian H [in, in] (2 X X^T summed over calibration tokens).

    gptq_bank with one expert and one width (grids and dtypes as there). A precomputed `factor`
    (factorize_hessian, one expert) replaces H, damp, act_order and column_importance, which are then not used.
    """
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D [out, in] matrix, got shape {tuple(W.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = W.shape[1]
    group = n if spec.group_size is None else spec.group_size
    if n % group:
        raise ValueError(f"in_features {n} is not a multiple of group_size {group}")
    if factor is None:
        if H is None:
            raise ValueError("gptq_quantize needs H or a precomputed factor")
        if H.shape != (n, n):
            raise ValueError(f"H must be [{n}, {n}] for W of shape {tuple(W.shape)}, got {tuple(H.shape)}")
        factor = factorize_hessian(H, damp=damp, act_order=act_order, column_importance=column_importance,
                                   max_damp=max_damp)
    elif factor.hinv_chol.shape != (1, n, n):
        raise ValueError(f"factor is for {factor.num_experts} experts x {factor.hinv_chol.shape[-1]} inputs, "
                         f"W has 1 x {n}")
    return gptq_bank(W[None], factor, [spec.bits], spec, block_size=block_size)[spec.bits].expert(0)


def gptq_replicas(W: torch.Tensor, H: torch.Tensor, bits_list: list[int] | tuple[int, ...], spec_template: QuantSpec,
                  *, block_size: int = 128, damp: float = 0.01, act_order: str = "none",
                  column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> dict[int, GPTQResult]:
    """GPTQ of one W [out, in] at several bit widths (a replica bank) from a single inverse-Hessian factorization:
    gptq_bank with one expert. Each width uses spec_template with only `bits` replaced."""
    if not bits_list:
        raise ValueError("bits_list is empty; give at least one bit width")
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D [out, in] matrix, got shape {tuple(W.shape)}")
    factor = factorize_hessian(H, damp=damp, act_order=act_order, column_importance=column_importance,
                               max_damp=max_damp)
    bank = gptq_bank(W[None], factor, bits_list, spec_template, block_size=block_size)
    return {bits: result.expert(0) for bits, result in bank.items()}
