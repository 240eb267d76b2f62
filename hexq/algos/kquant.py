"""ggml's K-quant grids (Q2_K, Q3_K) and GPTQ on them.

A K-quant row is cut into super-blocks of 256 weights, each of 16 sub-blocks of 16 (hexq.packed.ggml has the byte
layout). Sub-block j has its own step a_j and, for Q2_K, offset b_j; neither is stored as a float: a_j = d sc_j with
one float16 super-scale d per super-block and a 4-bit (Q2_K, 0..15) or signed 6-bit (Q3_K, -32..31) integer sc_j,
and b_j = dmin m_j likewise (Q2_K, 4-bit m_j). So
    Q2_K: x = a_j q - b_j, q in 0..3          Q3_K: x = a_j (u - 4), u in 0..7.
A code made on another grid (hexq's float16 scale per group) does not fit. Here the grid is made the way the format
asks: per sub-block the step (and offset) minimising the importance-weighted error sum_i h_i (x_i - Q(x_i))^2 over a
small set of candidate ranges, each refit by weighted least squares (h: the Hessian diagonal, i.e. the activation
energy of each input column, what llama.cpp calls the importance matrix); then the sub-block steps are quantized
under their super-scale. `kquant_grid` is that grid for every row of a span of 256 columns; `gptq_kquant` runs GPTQ
(hexq.algos.gptq.gptq_grid) with it, each super-block's grid made from the error-updated weights when the column
loop reaches it, so the error compensation works on the exact grid llama.cpp will compute with. `rtn_kquant` is the
same grid without compensation (the baseline GPTQ is measured against); `kquant_blocks` writes either as GGML blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexq.algos.gptq import gptq_grid
from hexq.algos.hessian import HessianFactor
from hexq.packed.ggml import Q2_K, SUB, encode_q2_k, encode_q3_k

SUPER = Q2_K.block  # weights per super-block (Q3_K's too); SUB weights per sub-block
TINY = 1e-30  # a zero step as the column loop's scale: every code then decodes to the offset


@dataclass(frozen=True)
class KQuantSpec:
    name: str  # "Q2_K" | "Q3_K"
    qmax: int  # top code
    scale_max: int  # largest sub-block scale integer
    symmetric: bool  # Q3_K: x = a (u - 4), a signed; Q2_K: x = a q - b, a, b >= 0


KQUANTS = {"Q2_K": KQuantSpec("Q2_K", 3, 15, False), "Q3_K": KQuantSpec("Q3_K", 7, 31, True)}


@dataclass(frozen=True)
class KQuantParams:
    """The integers and super-scales of one K-quant matrix set (E experts): d [E, out, in / 256] (float16 values),
    sc [E, out, in / 16] (Q2_K 0..15, Q3_K -32..31), and for Q2_K dmin and m likewise (None for Q3_K)."""

    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------ one sub-block


def _weighted_sums(h: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hq = h * q
    return h.sum(-1), hq.sum(-1), (hq * q).sum(-1), (h * x).sum(-1), (hq * x).sum(-1)


def affine_steps(x: torch.Tensor, h: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K's sub-block grids: step a >= 0 and offset b >= 0 (x ~ a q - b, q in 0..qmax) for every sub-block x
    [..., 16] with weights h (broadcast to x). Candidate ranges [min(x, 0), max(x)] / (qmax + t), t in -0.5..1.0,
    each refit by weighted least squares with the codes it gives; the one of least weighted error is kept."""
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1)
    h = h.expand_as(x)
    best_a, best_b = (hi - lo) / qmax, -lo
    best_err = torch.full_like(lo, float("inf"))
    for t in torch.linspace(-0.5, 1.0, 16).tolist():
        a0 = ((hi - lo) / (qmax + t)).clamp(min=TINY)
        q = ((x - lo[..., None]) / a0[..., None]).round().clamp(0, qmax)
        sw, sq, sqq, sx, sqx = _weighted_sums(h, q, x)
        det = sw * sqq - sq * sq
        ok = det > 1e-12 * sw * sqq
        a = torch.where(ok, (sw * sqx - sq * sx) / torch.where(ok, det, 1), a0)
        c = torch.where(ok, (sqq * sx - sq * sqx) / torch.where(ok, det, 1), lo)  # x ~ a q + c
        positive = c > 0  # the offset must be <= 0 (b >= 0): refit the step alone with c = 0
        a = torch.where(positive, sqx / sqq.clamp(min=1e-30), a).clamp(min=0)
        c = torch.where(positive, 0, c)
        err = (h * (a[..., None] * q + c[..., None] - x) ** 2).sum(-1)
        better = err < best_err
        best_a, best_b, best_err = torch.where(better, a, best_a), torch.where(better, -c, best_b), \
            torch.where(better, err, best_err)
    return best_a, best_b


def symmetric_steps(x: torch.Tensor, h: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Q3_K's sub-block steps (x ~ a q, q in low..high, a of either sign) for sub-blocks x [..., 16]: candidates put
    the largest |x| at about `low` or at about `high`, each refit by weighted least squares a = sum h x q /
    sum h q^2; the one of least weighted error is kept."""
    h = h.expand_as(x)
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]  # signed value of largest magnitude
    best_a = peak / low
    best_err = torch.full_like(peak, float("inf"))
    targets = torch.cat([torch.linspace(low - 0.5, low + 1.0, 12), torch.linspace(high - 0.5, high + 0.5, 6)])
    for t in targets.tolist():
        a0 = peak / t
        safe = torch.where(a0 != 0, a0, 1)
        q = (x / safe[..., None]).round().clamp(low, high)
        hq = h * q
        sqq, sqx = (hq * q).sum(-1), (hq * x).sum(-1)
        a = torch.where(sqq > 0, sqx / sqq.clamp(min=1e-30), 0)
        err = (h * x * x).sum(-1) - a * sqx  # the weighted error at the least-squares a
        better = err < best_err
        best_a, best_err = torch.where(better, a, best_a), torch.where(better, err, best_err)
    return best_a


# ------------------------------------------------------------------------------------------ one super-block


def quantize_steps(steps: torch.Tensor, scale_max: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block steps [..., 16] as (float16 super-scale d [...], integers sc [..., 16]) with steps ~ d sc: unsigned
    0..scale_max (largest step -> scale_max), or signed -(scale_max + 1)..scale_max (the step of largest magnitude ->
    -(scale_max + 1), so that both signs keep their full range)."""
    if signed:
        peak = steps.gather(-1, steps.abs().argmax(-1, keepdim=True))[..., 0]
        d = (-peak / (scale_max + 1)).to(torch.float16).float()
        low = -(scale_max + 1)
    else:
        d = (steps.amax(-1) / scale_max).to(torch.float16).float()
        low = 0
    sc = torch.where(d[..., None] != 0, steps / torch.where(d != 0, d, 1)[..., None], 0).round().clamp(low, scale_max)
    return d, sc


class KQuantGrid:
    """The grid of one K-quant for gptq_grid: called with a span of 256 columns [E, 256, R] (R output rows) and its
    first column, it returns the loop's (scale, zero) [E, 16, R] and records the integers and super-scales, which
    `params` returns [E, R, ...] once every span was seen. `importance` [E, in]: the weight of each input column in
    the sub-block fits (the Hessian diagonal)."""

    def __init__(self, spec: KQuantSpec, importance: torch.Tensor, rows: int) -> None:
        self.spec, self.importance = spec, importance
        num, cols = importance.shape
        shape_sb, shape_sub = (num, cols // SUPER, rows), (num, cols // SUB, rows)
        self.d = torch.zeros(shape_sb, dtype=torch.float32, device=importance.device)
        self.sc = torch.zeros(shape_sub, dtype=torch.int8, device=importance.device)
        self.dmin = None if spec.symmetric else torch.zeros_like(self.d)
        self.m = None if spec.symmetric else torch.zeros_like(self.sc)

    def __call__(self, columns: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        num, span, rows = columns.shape
        x = columns.float().permute(0, 2, 1).reshape(num, rows, SUPER // SUB, SUB)
        h = self.importance[:, first:first + SUPER].float().reshape(num, 1, SUPER // SUB, SUB)
        block, subs = first // SUPER, slice(first // SUB, (first + SUPER) // SUB)
        if self.spec.symmetric:
            d, sc = quantize_steps(symmetric_steps(x, h, -(self.spec.qmax + 1) // 2, self.spec.qmax // 2),
                                   self.spec.scale_max, signed=True)
            step = d[..., None] * sc
            scale, zero = torch.where(step != 0, step, TINY), torch.full_like(step, (self.spec.qmax + 1) // 2)
        else:
            a, b = affine_steps(x, h, self.spec.qmax)
            d, sc = quantize_steps(a, self.spec.scale_max, signed=False)
            dmin, m = quantize_steps(b, self.spec.scale_max, signed=False)
            step, offset = d[..., None] * sc, dmin[..., None] * m
            scale = torch.where(step != 0, step, TINY)
            zero = offset / scale  # x = (q - zero) scale = step q - offset
            self.dmin[:, block], self.m[:, subs] = dmin, m.to(torch.int8).transpose(1, 2)
        self.d[:, block], self.sc[:, subs] = d, sc.to(torch.int8).transpose(1, 2)
        return scale.transpose(1, 2).to(columns.dtype), zero.transpose(1, 2).to(columns.dtype)

    def params(self) -> KQuantParams:
        def rows_first(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.transpose(1, 2).contiguous()

        return KQuantParams(rows_first(self.d), rows_first(self.sc), rows_first(self.dmin), rows_first(self.m))


@dataclass(frozen=True)
class KQuantResult:
    """Experts' weights on a K-quant grid: codes [E, out, in] uint8 (Q2_K q, Q3_K u), their KQuantParams, and the
    dequantized weights' GPTQ loss [E, out] (None for round-to-nearest)."""

    kind: str
    codes: torch.Tensor
    params: KQuantParams
    loss: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """Float32 [E, out, in]: x = d sc q - dmin m (Q2_K) or d sc (u - 4) (Q3_K)."""
        p = self.params
        num, rows, cols = self.codes.shape
        step = (p.d.repeat_interleave(SUPER // SUB, -1) * p.sc.float()).repeat_interleave(SUB, -1)
        if KQUANTS[self.kind].symmetric:
            return step * (self.codes.float() - 4)
        offset = (p.dmin.repeat_interleave(SUPER // SUB, -1) * p.m.float()).repeat_interleave(SUB, -1)
        return step * self.codes.float() - offset


def check_kquant_shape(kind: str, cols: int) -> None:
    if kind not in KQUANTS:
        raise ValueError(f"unknown K-quant {kind!r}; choose one of {', '.join(KQUANTS)}")
    if cols % SUPER:
        raise ValueError(f"{kind} needs rows of a multiple of {SUPER} weights, got {cols}")


def gptq_kquant(W: torch.Tensor, factor: HessianFactor, importance: torch.Tensor, kind: str,
                block_size: int = 128) -> KQuantResult:
    """GPTQ of W [E, out, in] on the K-quant `kind`'s grid (module docstring); importance [E, in] weights the
    sub-block fits (the Hessian diagonal)."""
    check_kquant_shape(kind, W.shape[-1])
    spec = KQUANTS[kind]
    grid = KQuantGrid(spec, importance.to(W.device), W.shape[1])
    codes, _scale, _zero, loss = gptq_grid(W, factor, grid, SUPER, SUB, spec.qmax, block_size=block_size)
    return KQuantResult(kind, codes, grid.params(), loss)


def rtn_kquant(W: torch.Tensor, importance: torch.Tensor, kind: str) -> KQuantResult:
    """The same grid without error compensation: every weight at its nearest code (W [E, out, in])."""
    check_kquant_shape(kind, W.shape[-1])
    spec = KQUANTS[kind]
    num, rows, cols = W.shape
    grid = KQuantGrid(spec, importance.to(W.device), rows)
    columns = W.float().transpose(1, 2)
    codes = torch.empty(num, cols, rows, dtype=torch.uint8, device=W.device)
    for first in range(0, cols, SUPER):
        scale, zero = grid(columns[:, first:first + SUPER], first)
        span = columns[:, first:first + SUPER].reshape(num, SUPER // SUB, SUB, rows)
        q = (span / scale[:, :, None] + zero[:, :, None]).round().clamp(0, spec.qmax)
        codes[:, first:first + SUPER] = q.reshape(num, SUPER, rows).to(torch.uint8)
    return KQuantResult(kind, codes.transpose(1, 2).contiguous(), grid.params())


def kquant_blocks(result: KQuantResult) -> torch.Tensor:
    """Every expert's blocks [E, out * row_bytes] of a K-quant result (the encoders are row-wise: one call on the
    experts' rows stacked)."""
    p = result.params
    num, rows, _cols = result.codes.shape

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(num * rows, -1)

    if result.kind == "Q2_K":
        raw = encode_q2_k(flat(result.codes), flat(p.sc), flat(p.m), flat(p.d), flat(p.dmin))
    else:
        raw = encode_q3_k(flat(result.codes), flat(p.sc), flat(p.d))
    return raw.reshape(num, -1)
