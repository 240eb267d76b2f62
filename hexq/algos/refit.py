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
positive. Cost per matrix and width: rows x n^2 multiply-adds, as GPTQ's column loop, but in products of inner size g
(one group's columns), which a CPU runs several times slower than GPTQ's (docs/calibration.md: real-size seconds).
"""

from __future__ import annotations

import torch

from hexq.algos.quant import QuantSpec

# Ridge towards the old grid, relative to each unknown's diagonal entry: a group whose codes are all equal (its scale
# and offset not separable) keeps its old grid instead of making the system singular.
RIDGE = 1e-6
# Bytes of float32 Hessians per chunk of experts, and of the largest intermediate (experts x rows x n x G values) per
# chunk of rows: what the refit adds to calibration's working set, twice.
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


def normal_equations(a: torch.Tensor, hessian: torch.Tensor, residual: torch.Tensor, groups: int,
                     free_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(A^T H A [E, R, U, U], A^T H d [E, R, U]) for design values a [E, R, n] (the codes, or the codes minus the
    integer zero points), hessian [E, n, n] and the rows' residuals d = w - A theta_0 [E, R, n]; U = G unknowns
    (scales) or 2G (scales, offsets). The right-hand side from the residual, not from w: the step from the old grid
    is then a difference of small terms computed as such, exact enough in float32."""
    num, rows, n = a.shape
    g = n // groups
    a4 = a.reshape(num, rows, groups, g)
    # z[e, k, r, i] = sum over j in group k of a_rj H_ji: one batched product per group k ([R, g] x [g, n])
    z = torch.matmul(a4.permute(0, 2, 1, 3), hessian.reshape(num, groups, g, n)).reshape(num, groups, rows, groups, g)
    ss = torch.einsum("ekrli,erli->erkl", z, a4)  # (a broadcast product then a sum: ~4x slower on the CPU)
    hd = (residual @ hessian).reshape(num, rows, groups, g)
    rhs = (a4 * hd).sum(-1)
    if not free_zero:
        return ss, rhs
    sm = z.sum(-1).permute(0, 2, 1, 3)  # sm[e, r, k, l] = sum over j in k, i in l of a_rj H_ji
    mm = hessian.reshape(num, groups, g, groups, g).sum((2, 4))[:, None].expand(num, rows, groups, groups)
    system = torch.cat([torch.cat([ss, sm], dim=3), torch.cat([sm.mT, mm], dim=3)], dim=2)
    return system, torch.cat([rhs, hd.sum(-1)], dim=2)


def _refit_rows(w: torch.Tensor, hessian: torch.Tensor, q: torch.Tensor, s0: torch.Tensor, z0: torch.Tensor,
                free_zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(better [E, R], scale, zero [E, R, G]): refit_grids on one chunk, and which rows the new grid improves."""
    groups = s0.shape[-1]
    g = w.shape[-1] // groups
    centred = q - z0.repeat_interleave(g, dim=-1)
    residual = w - centred * s0.repeat_interleave(g, dim=-1)  # w - (q - z) s: the old grid's error
    a = q if free_zero else centred
    system, rhs = normal_equations(a, hessian, residual, groups, free_zero)
    system, rhs = system.double(), rhs.double()
    ridge = RIDGE * torch.diagonal(system, dim1=-2, dim2=-1).clamp(min=1e-30)
    step = torch.linalg.solve(system + torch.diag_embed(ridge), rhs)  # theta - theta_0
    # objective(theta_0 + step) - objective(theta_0) = step^T M step - 2 step^T A^T H d
    change = (step[..., None, :] @ system @ step[..., None])[..., 0, 0] - 2 * (step * rhs).sum(-1)
    theta = (torch.cat([s0, -s0 * z0], dim=-1) if free_zero else s0).double() + step
    s = theta[..., :groups]
    better = (change < 0) & (s > 0).all(dim=-1)
    return better, s, (-theta[..., groups:] / s if free_zero else z0)


def refit_grids(w: torch.Tensor, hessian: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor, free_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The refitted (scale, zero) [E, R, G] of matrices w [E, R, n] quantized to codes [E, R, n] on (scale, zero),
    under the (damped) Hessians [E, n, n] GPTQ used. free_zero: float zero points, refitted with the scales; else
    integer zero points, kept, the scales alone refitted. The products in float32, each row's small system in
    float64; a few experts and rows at a time (REFIT_CHUNK_BYTES of the largest intermediate, experts x rows x n x G
    values)."""
    num, rows, n = w.shape
    groups = scale.shape[-1]
    experts = max(1, min(num, REFIT_CHUNK_BYTES // (4 * n * n)))
    step = max(1, REFIT_CHUNK_BYTES // (4 * experts * n * groups))
    new_scale, new_zero = scale.clone(), zero.clone()
    for e in range(0, num, experts):
        h = hessian[e:e + experts].float()
        for r in range(0, rows, step):
            part = (slice(e, e + experts), slice(r, r + step))
            better, s, z = _refit_rows(w[part].float(), h, codes[part].float(), scale[part].float(),
                                       zero[part].float(), free_zero)
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
