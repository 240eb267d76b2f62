"""Reference GPTQ: hexq's original, one column loop per bit width per weight (float64 factorization).

This is the per-expert, per-width implementation hexq.algos.gptq replaced with the batched `gptq_bank`; tests and
benchmarks/gptq_speed.py compare against it. Paper 003 §III.B eq. 4-6; GPTQ (Frantar et al.) lazy block updates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hexq.algos.quant import QuantMeta, QuantSpec, grid_params, quantize_to_grid

ACT_ORDERS = ("none", "max_activation", "sum_of_squares")


@dataclass(frozen=True)
class HessianFactor:
    """Everything GPTQ needs from H, computed once per Hessian.

    hinv_chol: upper Cholesky factor U of the damped inverse Hessian in quantization order (H^-1 = U^T U), float64.
    perm: quantization order as original column indices ([in], long), or None for the natural order.
    dead: [in] bool, input channels whose Hessian diagonal is zero (never active in calibration).
    damp_used: damping actually applied, as a fraction of the mean Hessian diagonal.
    act_order: the ordering that produced `perm`.
    """

    hinv_chol: torch.Tensor
    perm: torch.Tensor | None
    dead: torch.Tensor
    damp_used: float
    act_order: str = "none"


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
    rounding: torch.Tensor  # [out, in] w / scale + zero before rounding (original column order): finds exact ties


def inverse_hessian_cholesky(H: torch.Tensor, damp: float = 0.01, *,
                             max_damp: float = 1.0) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, in float64, and the damp that worked.

    Damping keeps H positive definite when calibration tokens are few or channels are collinear (GPTQ uses 1% of
    the mean diagonal). If a Cholesky fails (H indefinite or numerically singular) damp is multiplied by 10 up to
    `max_damp`; beyond that H is not a usable Hessian and a ValueError says so.
    """
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square [in, in] matrix, got shape {tuple(H.shape)}")
    if not 0 < damp <= max_damp:
        raise ValueError(f"damp must be in (0, max_damp={max_damp}], got {damp}")
    H64 = H.to(torch.float64)
    if not torch.isfinite(H64).all():
        raise ValueError("H contains NaN or inf; check the calibration activations")
    diag_mean = float(torch.diagonal(H64).mean())
    if diag_mean <= 0:
        raise ValueError(f"H has mean diagonal {diag_mean:g} <= 0; expected 2 X X^T summed over tokens")
    eye = torch.eye(H64.shape[0], dtype=torch.float64, device=H64.device)
    current = damp
    while True:
        L, info = torch.linalg.cholesky_ex(H64 + current * diag_mean * eye)
        if int(info) == 0:
            # H^-1 from its Cholesky factor, then the upper factor of H^-1 that eq. 5-6 read from.
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info) == 0:
                return U, current
        if current >= max_damp:
            raise ValueError(f"Cholesky of the damped Hessian failed up to damp={current:g} (max_damp={max_damp:g}); "
                             "H is not positive semi-definite - check how it was accumulated, or raise max_damp")
        current = min(current * 10, max_damp)


def column_order(H: torch.Tensor, act_order: str, column_importance: torch.Tensor | None = None) -> torch.Tensor | None:
    """Quantization order for act_order (most important column first), or None for the natural order.

    "max_activation" ranks by `column_importance` (e.g. max |X| per channel, required); "sum_of_squares" ranks by
    `column_importance` or, when absent, by diag(H) = 2 sum_t x_t^2. Important columns go first so that their error
    can still be compensated by the many columns after them.
    """
    if act_order not in ACT_ORDERS:
        raise ValueError(f"act_order must be one of {ACT_ORDERS}, got {act_order!r}")
    if act_order == "none":
        return None
    if column_importance is None:
        if act_order == "max_activation":
            raise ValueError("act_order='max_activation' needs column_importance (max |X| per input channel)")
        column_importance = torch.diagonal(H)
    if column_importance.shape != (H.shape[0],):
        raise ValueError(f"column_importance must have shape ({H.shape[0]},), got {tuple(column_importance.shape)}")
    # stable sort: ties keep the natural order, so the result does not depend on the sort implementation.
    return torch.argsort(column_importance.to(torch.float64), descending=True, stable=True)


def factorize_hessian(H: torch.Tensor, *, damp: float = 0.01, act_order: str = "none",
                      column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> HessianFactor:
    """Dead-channel fix, column ordering and inverse-Hessian Cholesky of H: the part of GPTQ shared by all widths.

    Dead inputs (diag H == 0) get diag 1, as in GPTQ: their row/column of H is zero, so this decouples them and
    keeps H invertible; gptq_quantize zeroes the matching weight columns (they never see a nonzero input).
    """
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square [in, in] matrix, got shape {tuple(H.shape)}")
    H = H.to(torch.float64).clone()
    diag = torch.diagonal(H)
    if (diag < 0).any():
        raise ValueError("H has negative diagonal entries; expected 2 X X^T summed over tokens")
    dead = diag == 0
    diag[dead] = 1.0
    perm = column_order(H, act_order, column_importance)
    if perm is not None:
        H = H[perm][:, perm]
    hinv_chol, damp_used = inverse_hessian_cholesky(H, damp, max_damp=max_damp)
    return HessianFactor(hinv_chol=hinv_chol, perm=perm, dead=dead, damp_used=damp_used, act_order=act_order)


def _block_starts(n: int, block_size: int, group_size: int | None) -> list[int]:
    """Block boundaries; with dynamic groups every group start is also a block start.

    At a block start all earlier blocks' lazy updates have reached every later column, so a group grid computed
    there sees exactly the error-updated weights, whatever block_size is.
    """
    starts = set(range(0, n, block_size))
    if group_size is not None:
        starts |= set(range(0, n, group_size))
    return sorted(starts)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor | None, spec: QuantSpec, *, block_size: int = 128,
                  damp: float = 0.01, act_order: str = "none", column_importance: torch.Tensor | None = None,
                  factor: HessianFactor | None = None, max_damp: float = 1.0) -> GPTQResult:
    """Quantize W [out, in] with GPTQ on the Hessian H [in, in] (2 X X^T summed over calibration tokens).

    Eq. 5: each column is rounded to its nearest grid value; eq. 6: its error, scaled by 1/[H_F^-1]_ii, is
    subtracted from the remaining columns along row i of the inverse-Hessian Cholesky factor.

    Grids (hexq.algos.quant.grid_params): per-channel (group_size None) grids come from the whole original row.
    With group_size and act_order "none" each group's (scale, zero) is computed from the current, already
    error-updated weights when the loop reaches the group's first column (GPTQ's static_groups=False). With any
    other act_order, columns of one group are not quantized together, so group grids are static: computed from the
    original weights of each contiguous original-column group before the loop (GPTQ's static_groups=True). In both
    cases meta groups are contiguous original columns and codes are in the original column order.

    A precomputed `factor` (factorize_hessian) replaces H, damp, act_order and column_importance, which are then
    not used. Computation runs in float64 if W is float64, else float32; meta is in that dtype.
    """
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D [out, in] matrix, got shape {tuple(W.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out_features, n = W.shape
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
    elif factor.hinv_chol.shape != (n, n):
        raise ValueError(f"factor is for {factor.hinv_chol.shape[0]} inputs, W has {n}")

    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.to(dtype).clone()
    W[:, factor.dead] = 0  # dead inputs: any weight gives the same output, zero is the cheapest
    U = factor.hinv_chol.to(dtype=dtype, device=W.device)
    n_groups = n // group
    dynamic = spec.group_size is not None and factor.perm is None
    if dynamic:
        scale = torch.empty(out_features, n_groups, dtype=dtype, device=W.device)
        zero = torch.empty_like(scale)
    else:
        scale, zero = grid_params(W.reshape(out_features, n_groups, group), spec)
    original = factor.perm.tolist() if factor.perm is not None else range(n)
    col_group = [c // group for c in original]
    if factor.perm is not None:
        W = W[:, factor.perm]

    codes = torch.empty(out_features, n, dtype=torch.uint8, device=W.device)
    rounding = torch.empty(out_features, n, dtype=dtype, device=W.device)
    loss = torch.zeros(out_features, dtype=dtype, device=W.device)
    starts = _block_starts(n, block_size, spec.group_size if dynamic else None)
    for i1, i2 in zip(starts, starts[1:] + [n], strict=True):
        if dynamic and i1 % group == 0:
            g = i1 // group
            scale[:, g], zero[:, g] = grid_params(W[:, i1:i1 + group], spec)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            d = U1[i, i]
            g = col_group[i1 + i]
            q = quantize_to_grid(w, scale[:, g], zero[:, g], spec.qmax)
            wq = (q - zero[:, g]) * scale[:, g]
            codes[:, i1 + i] = q.to(torch.uint8)
            rounding[:, i1 + i] = w / scale[:, g] + zero[:, g]
            loss += (w - wq) ** 2 / d**2 / 2  # eq. 5 objective: the output error this column adds
            err = (w - wq) / d
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]  # eq. 6 inside the block, immediately
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # eq. 6 for the columns after the block, one batched update

    if factor.perm is not None:
        codes = codes[:, torch.argsort(factor.perm)]
        rounding = rounding[:, torch.argsort(factor.perm)]
    return GPTQResult(codes=codes, meta=QuantMeta(scale, zero, group, spec.bits), damp_used=factor.damp_used,
                      loss=loss, rounding=rounding)


def gptq_replicas(W: torch.Tensor, H: torch.Tensor, bits_list: list[int] | tuple[int, ...], spec_template: QuantSpec,
                  *, block_size: int = 128, damp: float = 0.01, act_order: str = "none",
                  column_importance: torch.Tensor | None = None, max_damp: float = 1.0) -> dict[int, GPTQResult]:
    """GPTQ of one W at several bit widths (a replica bank) from a single inverse-Hessian factorization.

    Each width uses spec_template with only `bits` replaced; the Cholesky factor, ordering and damping are shared.
    """
    if not bits_list:
        raise ValueError("bits_list is empty; give at least one bit width")
    factor = factorize_hessian(H, damp=damp, act_order=act_order, column_importance=column_importance,
                               max_damp=max_damp)
    return {bits: gptq_quantize(W, None, replace(spec_template, bits=bits), block_size=block_size, factor=factor)
            for bits in dict.fromkeys(bits_list)}


def assert_same_up_to_ties(got: torch.Tensor, want: torch.Tensor, rounding: torch.Tensor, order: torch.Tensor, *,
                           tie: float, max_flipped_rows: float = 0.25) -> torch.Tensor:
    """Codes got [out, in] equal to the reference codes `want` along the quantization `order` up to each row's first
    difference, which must be a rounding tie: the reference's w / scale + zero (`rounding`) within `tie` of a
    half-integer. After a tie the row legitimately follows another path. Returns the rows that never differ.

    Two GPTQ implementations whose floating-point summation orders differ agree on every code except at ties, and a
    symmetric grid makes ties systematic: a group's most negative weight sits exactly half-way between two levels.
    """
    differ = (got != want)[:, order]
    flipped = differ.any(dim=1)
    first = differ.float().argmax(dim=1)
    rounding = rounding[:, order]
    for row in torch.where(flipped)[0].tolist():
        x = float(rounding[row, first[row]])
        assert abs(abs(x - round(x)) - 0.5) < tie, f"row {row}: codes differ at a non-tie (w/s + z = {x!r})"
    assert flipped.float().mean() <= max_flipped_rows, f"{int(flipped.sum())} of {len(flipped)} rows flipped on ties"
    return ~flipped
