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

The same independence makes a search of each row's grid range exact (`clip_bits`): a width's rows are stacked once
more per narrowed range (CLIP_RATIOS), and each row keeps the copy whose objective (eq. 5 summed over the loop) is the
lowest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch

from hexq.algos.hessian import HessianFactor, _compute_dtype, factorize_hessian, factorize_hessians
from hexq.algos.quant import QuantMeta, QuantSpec, one_bit_levels
from hexq.algos.row_grids import RowGrids

# The ranges tried for the widths in clip_bits, as fractions of each group's min/max range (narrowed about its middle),
# next to the whole range. Measured on the reference models' bundled banks (benchmarks/low_bits.py, 64 held-out windows
# x 256 per text): with (0.9, 0.8) at 2 bits 85-99% of Mixtral's rows keep a narrowed copy, most of them 0.8, and
# uniform 2's mean KL divergence falls by 15-21% on both models; with 0.7 and 0.6 offered too, 1-14% of the rows took
# 0.7 (0.6 almost none) and the KL divergence fell no further.
CLIP_RATIOS = (0.9, 0.8)


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


def _static_grids(grouped: torch.Tensor, U: torch.Tensor, perm: torch.Tensor | None, grids: RowGrids,
                  width_count: int, fit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Static grids [E, groups, B * out] of grouped [E, out, groups, g] (original weights, contiguous original
    columns), the rows fit_rows fitted with column weights 1 / [H^-1]_jj = 1 / sum_i U_ij^2 (U in quantization order,
    perm its original columns). One group at a time bounds the working set to a group of the stack."""
    num, rows, count, group = grouped.shape
    weight = U.square().sum(dim=1).reciprocal()
    if perm is not None:  # back to the original column order
        weight = torch.empty_like(weight).scatter_(1, perm, weight)
    weight = weight.reshape(num, count, group)
    scale = torch.empty(num, count, width_count * rows, dtype=grouped.dtype, device=grouped.device)
    zero = torch.empty_like(scale)
    for g in range(count):
        columns = grouped[:, :, g].transpose(1, 2).repeat(1, 1, width_count)  # [E, g, B * out]
        scale[:, g], zero[:, g] = grids.fitted(columns, weight[:, g], fit_rows)
    return scale, zero


def _stacked_columns(W: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor | None, width_count: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The stack [E, in, B * out]: W [E, out, in] with dead input columns zeroed (any weight gives the same output
    there, zero is the cheapest), columns in each expert's quantization order, one copy of the rows per width. Made in
    as few passes over W as it takes (one transposing copy, the order's row gather, the widths' copies): at a chunk of
    down projections these copies took a quarter of the column loop's time."""
    num, rows, n = W.shape
    Wt = torch.empty(num, n, rows, dtype=dtype, device=W.device)
    Wt.copy_(W.transpose(1, 2)).masked_fill_(dead[:, :, None], 0)
    if perm is not None:
        Wt = _rows(Wt, perm)
    if width_count == 1:
        return Wt
    stack = torch.empty(num, n, width_count * rows, dtype=dtype, device=W.device)
    stack.view(num, n, width_count, rows).copy_(Wt[:, :, None].expand(num, n, width_count, rows))
    return stack


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[e, index[e]] for every e: t [E, n, ...] and index [E, k] -> [E, k, ...], as one index_select of whole rows
    (gather needs an index per element, advanced indexing computes one: both several times slower on the stack)."""
    num, n = t.shape[:2]
    flat = (index + torch.arange(num, device=t.device)[:, None] * n).flatten()
    return t.reshape(num * n, *t.shape[2:]).index_select(0, flat).reshape(num, index.shape[1], *t.shape[2:])


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
    codes = torch.empty(num, n, stacked, dtype=torch.uint8, device=Wt.device)  # in quantization order
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
            s_blk, z_blk = _rows(scale, perm[:, i1:i2] // group), _rows(zero, perm[:, i1:i2] // group)
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
            codes[:, s1:s2].copy_(q_blk[:, s1 - i1:s2 - i1].to(torch.int32))
        if i2 < n:  # eq. 6 for the columns after the block, one batched update (lazy batch)
            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].mT, err_blk, alpha=-1)
    if perm is not None:  # back to the original column order: row j of the result is step perm^-1[j]
        codes = _rows(codes, torch.argsort(perm, dim=1))
    return codes, loss


def gptq_bank(W: torch.Tensor, factor_or_H: HessianFactor | torch.Tensor, bits_list: Sequence[int],
              spec_template: QuantSpec, *, block_size: int = 128, damp: float = 0.01, act_order: str = "none",
              column_importance: torch.Tensor | None = None, max_damp: float = 1.0,
              fit_bits: Collection[int] = (), clip_bits: Collection[int] = ()) -> dict[int, GPTQBankResult]:
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
    are in the original column order. Input columns that are dead in the factor are zeroed. The grids of the widths
    in fit_bits are then fitted to their groups (hexq.algos.clipping.fit_grid) instead of spanning min and max:
    dynamic grids inside the loop with column weights 1 / [H_F^-1]_jj (eq. 5), static grids before it with
    1 / [H^-1]_jj (a column's error once every other column compensates it). The widths in clip_bits are stacked
    once more per CLIP_RATIOS entry, grids spanning that fraction of each range, and each row keeps the copy with the
    lowest loss (rows are independent, so the choice is exact for eq. 4 on the calibration tokens).

    Peak working set beyond the inputs, in stacks (one stack = E * in * B * out values of the compute dtype, e.g.
    8 experts x 2048 x 5 x 1536 x 4 bytes = 480 MiB): the stack (1), its uint8 codes (1/4 in float32), block buffers
    (2 x block_size / in; 4 x with act_order); before the loop copies of W (2/B), after it the per-width result codes
    (1/4) in place of the stack; each clip_bits width adds len(CLIP_RATIOS) / B stacks. Measured on that example: 1.5
    stacks above the inputs (1.8 with act_order), plus U converted to the compute dtype if the factor's dtype
    differs, plus two [E, in, in] copies while factorizing when H is given rather than a factor.
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
    ranges = stacked_ranges(bits_list, clip_bits)  # the copies of the rows in the stack: (width, range fraction)
    stacked = [replace(spec_template, bits=bits) for bits, _ in ranges]
    specs = stacked[:len(dict.fromkeys(bits_list))]  # each width over its whole range, first and in order
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
    width_count = len(stacked)
    grids = RowGrids.build(stacked, rows, dtype, device, [ratio for _, ratio in ranges])
    dynamic = spec_template.group_size is not None and factor.perm is None
    dead = factor.dead.to(device)
    perm = None if factor.perm is None else factor.perm.to(device)
    U = factor.hinv_chol.to(device=device, dtype=dtype)
    fitted = [b for b, spec in enumerate(stacked) if spec.bits in fit_bits]
    fit_rows = (torch.arange(rows, device=device) + torch.tensor(fitted, device=device)[:, None] * rows).flatten() \
        if fitted else None
    if dynamic:  # filled in by the loop, each group at its first column
        scale = torch.empty(num, n // group, width_count * rows, dtype=dtype, device=device)
        zero = torch.empty_like(scale)
    else:  # static grids from the original rows, the same for every width's copy of a row: [E, groups, B * out]
        grouped = W.to(dtype).masked_fill(dead[:, None, :], 0).reshape(num, rows, n // group, group)
        if fit_rows is None:
            lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
            lo, hi = lo.transpose(1, 2).repeat(1, 1, width_count), hi.transpose(1, 2).repeat(1, 1, width_count)
            if bool(grids.spread.any()):  # [E, groups, B * out] like lo and hi
                low, high = (t.transpose(1, 2).repeat(1, 1, width_count) for t in one_bit_levels(grouped))
                lo, hi = torch.where(grids.spread, low, lo), torch.where(grids.spread, high, hi)
            scale, zero = grids.params(lo, hi)
        else:
            scale, zero = _static_grids(grouped, U, perm, grids, width_count, fit_rows)
        del grouped
    grid = None
    if dynamic:  # each group's grid from its current columns; fitted rows weigh column j by 1 / [H_F^-1]_jj (eq. 5)
        column_weight = torch.diagonal(U, dim1=1, dim2=2).square().reciprocal() if fit_rows is not None else None

        def grid(columns: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
            weight = None if column_weight is None else column_weight[:, first:first + group]
            return tuple(t[:, None] for t in grids.fitted(columns, weight, fit_rows))
    # The stack is built inside the call so that nothing here keeps it alive once the loop returns.
    codes, loss = _quantize_stack(_stacked_columns(W, dead, perm, width_count, dtype), U, perm, scale, zero,
                                  grids.qmax, group, grid, group, block_size)
    for spec in specs:  # clip_bits: each row of a width keeps its best copy
        copies = [i for i, (bits, _) in enumerate(ranges) if bits == spec.bits]  # its whole range first
        if len(copies) > 1:
            _keep_best(codes, scale, zero, loss, rows, copies)

    results = {}
    for b, spec in enumerate(specs):
        part = slice(b * rows, (b + 1) * rows)
        results[spec.bits] = GPTQBankResult(
            codes=codes[:, :, part].transpose(1, 2).contiguous(), scale=scale[:, :, part].transpose(1, 2).contiguous(),
            zero=zero[:, :, part].transpose(1, 2).contiguous(), group_size=group, bits=spec.bits,
            damp_used=factor.damp_used, loss=loss[:, part].clone())
    return results


def stacked_ranges(bits_list: Sequence[int], clip_bits: Collection[int]) -> list[tuple[int, float]]:
    """(width, fraction of its range) of every copy of the rows gptq_bank stacks: each width of bits_list over its
    whole range, in order, then each one in clip_bits once per CLIP_RATIOS entry. Its length sizes the working set
    (quantize_expert_chunk, gptq_chunk_size)."""
    widths = list(dict.fromkeys(bits_list))
    return [(bits, 1.0) for bits in widths] + [(bits, ratio) for bits in widths if bits in clip_bits
                                               for ratio in CLIP_RATIOS]


def _keep_best(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, loss: torch.Tensor, rows: int,
               widths: list[int]) -> None:
    """Into stacked width widths[0] (codes [E, in, R], scale and zero [E, groups, R], loss [E, R], R = B * rows),
    row by row the copy among `widths` with the lowest loss (clip_bits)."""
    def part(t: torch.Tensor) -> torch.Tensor:  # [K, ..., rows]: the widths' slices of the stacked rows
        return torch.stack([t[..., w * rows:(w + 1) * rows] for w in widths])

    losses = part(loss)
    best = losses.argmin(dim=0)  # [E, rows]
    own = slice(widths[0] * rows, (widths[0] + 1) * rows)
    for t in (codes, scale, zero):
        t[..., own] = part(t).gather(0, best[None, :, None, :].expand(1, -1, t.shape[1], -1))[0]
    loss[:, own] = losses.gather(0, best[None])[0]


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


def gptq_replicas(W: torch.Tensor, H: torch.Tensor, bits_list: list[int] | tuple[int, ...], spec_template: QuantSpec,
                  *, block_size: int = 128, damp: float = 0.01, act_order: str = "none",
                  column_importance: torch.Tensor | None = None, max_damp: float = 1.0,
                  fit_bits: Collection[int] = (), clip_bits: Collection[int] = ()) -> dict[int, GPTQResult]:
    """GPTQ of one W [out, in] at several bit widths (a replica bank) from a single inverse-Hessian factorization:
    gptq_bank with one expert. Each width uses spec_template with only `bits` replaced."""
    if not bits_list:
        raise ValueError("bits_list is empty; give at least one bit width")
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D [out, in] matrix, got shape {tuple(W.shape)}")
    factor = factorize_hessian(H, damp=damp, act_order=act_order, column_importance=column_importance,
                               max_damp=max_damp)
    bank = gptq_bank(W[None], factor, bits_list, spec_template, block_size=block_size, fit_bits=fit_bits,
                     clip_bits=clip_bits)
    return {bits: result.expert(0) for bits, result in bank.items()}
