"""Each group's grid refitted to the codes GPTQ chose: the scales (and float zero points) that minimise GPTQ's own
objective ||(W - Q) X||^2 = tr((W - Q) H (W - Q)^T) (003 eq. 4) with the codes held fixed.

GPTQ picks each column's code on a grid fixed before the column is reached (eq. 5) and never revisits the grid; once
every code is known, the grid that best reproduces a row under H is a linear least-squares problem. For a row w [n]
with codes q in G groups of g columns, the quantized row is w_q = A theta with

    integer zero points z (kept):  A[j, k] = (q_j - z_k) 1[j in group k],          theta = the G scales
    float zero points:             A[j, k] = q_j 1[j in k], A[j, G + k] = 1[j in k], theta = (s, m), z = -m / s

and (w - A theta)^T H (w - A theta) is minimised by the normal equations (A^T H A) theta = A^T H w: one system of G
or 2G unknowns per row. H's off-diagonal blocks couple the groups, as GPTQ's compensation coupled their errors, so
the fit is exact for GPTQ's objective rather than a per-group stand-in (hexq.algos.clipping fits each group alone,
before or while GPTQ runs). A row keeps its old grid unless the new one lowers the objective with every scale
positive. Cost per matrix and width: rows x n^2 / 2 multiply-adds in products of inner size g (one group's columns:
the symmetric scale block) and rows x n^2 in one product (H d), as GPTQ's column loop; docs/calibration.md has the
real-size seconds.
"""

from __future__ import annotations

import torch

from hexq.algos.quant import QuantSpec

# Ridge towards the old grid, relative to each unknown's diagonal entry: a group whose codes are all equal (its scale
# and offset not separable) keeps its old grid instead of making the system singular.
RIDGE = 1e-6
# Bytes of float32 Hessians per chunk of experts, and of the per-row intermediates per chunk of rows (~ a dozen G x G
# float64 blocks, and a few rows of n values): what the refit adds to calibration's working set.
REFIT_CHUNK_BYTES = 64 << 20


def damped(hessians: torch.Tensor, damp: torch.Tensor) -> torch.Tensor:
    """H with each dead input's diagonal set to 1, plus damp * mean(diag) * I, for a batch [E, n, n] and per-matrix
    damp [E]: the Hessian GPTQ's factor was made from (hexq.algos.hessian's _prepared, then its damping), so the
    refit minimises the objective GPTQ did."""
    h = hessians.clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag.add_((damp.to(h) * diag.mean(dim=-1))[:, None])
    return h


def offset_sums(hessian: torch.Tensor, groups: int) -> torch.Tensor:
    """u [E, G, G, g], u[e, l, k, i] = sum over j in group l of H_j,kg+i: H's column sums over each group (1_l^T H),
    of which the float zero points' terms of the normal equations are made."""
    num, n, _ = hessian.shape
    g = n // groups
    return hessian.reshape(num, groups, g, n).sum(2).reshape(num, groups, groups, g)


def normal_equations(a: torch.Tensor, hessian: torch.Tensor, residual: torch.Tensor, groups: int,
                     u: torch.Tensor | None):
    """The blocks of (A^T H A) theta = A^T H d, in float64, for design values a [E, R, n] (the codes, or the codes
    minus the integer zero points), hessian [E, n, n] and the rows' residuals d = w - A theta_0 [E, R, n]: the scales'
    block ss [E, R, G, G] and right-hand side rs [E, R, G]; with float zero points (u: offset_sums) also the
    scale-offset block sm [E, R, G, G] (sm[k, l] = sum over j in group k, i in group l of a_j H_ji) and the offsets'
    right-hand side rm [E, R, G] (else None). The offsets' own block, H's group sums, is every row's
    (u.sum(-1)). The right-hand side from the residual, not from w: the step from the old grid is then a difference
    of small terms computed as such, exact enough in float32.

    ss[k, l] = a_k^T H_kl a_l (a_k: the row's values in group k) is symmetric: per group k one product of its g
    columns with H's rows from group k on ([R, g] x [g, n - k g]) and a contraction with the row, half of the full R n^2
    multiply-adds and never an [R, G, n] intermediate. The offset terms need no product per row: sm[k, l] = u_l . a_k
    on group k's columns."""
    num, rows, n = a.shape
    g = n // groups
    a4 = a.reshape(num, rows, groups, g)
    ss = a.new_empty(num, rows, groups, groups)
    for k in range(groups):
        z = torch.matmul(a4[:, :, k], hessian[:, k * g:(k + 1) * g, k * g:])  # a_k^T H_k,l for l >= k
        ss[:, :, k, k:] = (z.reshape(num, rows, groups - k, g) * a4[:, :, k:]).sum(-1)
        ss[:, :, k + 1:, k] = ss[:, :, k, k + 1:]  # and the lower triangle
    hd = (residual @ hessian).reshape(num, rows, groups, g)
    rs = (a4 * hd).sum(-1).double()
    if u is None:
        return ss.double(), rs, None, None
    sm = torch.einsum("erki,elki->erkl", a4, u)
    return ss.double(), rs, sm.double(), hd.sum(-1).double()


def solve_step(ss: torch.Tensor, rs: torch.Tensor, sm: torch.Tensor | None, rm: torch.Tensor | None,
               mm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(step [E, R, U], change [E, R]): the solution theta - theta_0 of normal_equations' system (mm [E, G, G]: the
    offsets' block) with a ridge of RIDGE times each unknown's diagonal entry, and the objective's change along it
    (step^T M step - 2 step^T rhs = -step^T rhs - step^T ridge step, since (M + ridge) step = rhs). With offsets,
    through the Schur complement of the offsets' block, which all rows share: one inverse per matrix, then a G x G
    system per row instead of a 2G x 2G one."""
    ridge_s = RIDGE * torch.diagonal(ss, dim1=-2, dim2=-1).clamp(min=1e-30)
    torch.diagonal(ss, dim1=-2, dim2=-1).add_(ridge_s)
    if sm is None:
        step = torch.linalg.solve(ss, rs)
        return step, -(step * rs).sum(-1) - (ridge_s * step * step).sum(-1)
    ridge_m = RIDGE * torch.diagonal(mm, dim1=-2, dim2=-1).clamp(min=1e-30)
    num, rows, groups, _ = sm.shape
    mm_inv = torch.linalg.inv(mm + torch.diag_embed(ridge_m))  # [E, G, G], symmetric
    c = (sm.reshape(num, rows * groups, groups) @ mm_inv).reshape(sm.shape)  # sm mm^-1, one product per matrix
    step_s = torch.linalg.solve(ss - c @ sm.mT, rs - (c @ rm[..., None])[..., 0])
    step_m = (rm - (step_s[..., None, :] @ sm)[..., 0, :]) @ mm_inv  # mm^-1 (rm - sm^T step_s), as rows
    change = (-(step_s * rs).sum(-1) - (step_m * rm).sum(-1) - (ridge_s * step_s * step_s).sum(-1)
              - (ridge_m[:, None] * step_m * step_m).sum(-1))
    return torch.cat([step_s, step_m], dim=-1), change


def _refit_rows(w: torch.Tensor, hessian: torch.Tensor, q: torch.Tensor, s0: torch.Tensor, z0: torch.Tensor,
                u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(better [E, R], scale, zero [E, R, G]): refit_grids on one chunk, and which rows the new grid improves; u:
    offset_sums where the zero points are floats, else None."""
    groups = s0.shape[-1]
    g = w.shape[-1] // groups
    centred = q - z0.repeat_interleave(g, dim=-1)
    residual = w - centred * s0.repeat_interleave(g, dim=-1)  # w - (q - z) s: the old grid's error
    free_zero = u is not None
    ss, rs, sm, rm = normal_equations(q if free_zero else centred, hessian, residual, groups, u)
    step, change = solve_step(ss, rs, sm, rm, u.sum(-1).double() if free_zero else None)
    theta = (torch.cat([s0, -s0 * z0], dim=-1) if free_zero else s0).double() + step
    s = theta[..., :groups]
    better = (change < 0) & (s > 0).all(dim=-1)
    return better, s, (-theta[..., groups:] / s if free_zero else z0)


def refit_grids(w: torch.Tensor, hessian: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor, free_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The refitted (scale, zero) [E, R, G] of matrices w [E, R, n] quantized to codes [E, R, n] on (scale, zero),
    under the (damped) Hessians [E, n, n] GPTQ used. free_zero: float zero points, refitted with the scales; else
    integer zero points, kept, the scales alone refitted. The products in float32, each row's small system in
    float64; a few experts and rows at a time (REFIT_CHUNK_BYTES of Hessians, and of the rows' intermediates)."""
    num, rows, n = w.shape
    groups = scale.shape[-1]
    per_row = 96 * groups * groups + 16 * n  # bytes: a dozen G x G float64 blocks, a few rows of n float32 values
    # rows before experts: each chunk of rows reads the chunk's Hessians again
    experts = max(1, min(num, REFIT_CHUNK_BYTES // (4 * n * n + rows * per_row)))
    step = max(1, REFIT_CHUNK_BYTES // (experts * per_row))
    new_scale, new_zero = scale.clone(), zero.clone()
    for e in range(0, num, experts):
        h = hessian[e:e + experts].float()
        u = offset_sums(h, groups) if free_zero else None
        for r in range(0, rows, step):
            part = (slice(e, e + experts), slice(r, r + step))
            better, s, z = _refit_rows(w[part].float(), h, codes[part].float(), scale[part].float(),
                                       zero[part].float(), u)
            keep = ~better[..., None]  # a row not improved keeps its grid bit for bit
            new_scale[part] = torch.where(keep, scale[part], s.to(scale.dtype))
            new_zero[part] = torch.where(keep, zero[part], z.to(zero.dtype))
    return new_scale, new_zero


def refit_bank(bank: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], weights: torch.Tensor,
               hessians: torch.Tensor, damp: torch.Tensor,
               specs: dict[int, QuantSpec]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """bank {bits: (codes [E, R, n], scale, zero [E, R, G])} of GPTQ on weights [E, R, n] under Hessians [E, n, n]
    damped by damp [E] (as GPTQ's factor was), with the grids of the widths in specs refitted (refit_grids; the
    zero point refitted where the spec's is a float)."""
    if not specs:
        return bank
    h = damped(hessians, damp)
    dead = torch.diagonal(hessians, dim1=-2, dim2=-1) == 0
    w = weights.masked_fill(dead[:, None, :], 0)  # gptq_bank's target: a dead input's column is zeroed
    bank = dict(bank)
    for bits, spec in specs.items():
        codes, scale, zero = bank[bits]
        bank[bits] = (codes, *refit_grids(w, h, codes, scale, zero, spec.zero_is_float))
    return bank
