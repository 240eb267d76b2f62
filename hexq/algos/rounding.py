"""Rounding of low-width expert replicas optimised on the expert's routed tokens (sign-gradient descent, the method
of AutoRound: Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent").

GPTQ rounds one column at a time against a quadratic proxy of each projection's error (eq. 4-6). At 1-2 bits the
rounding choices interact through the expert's nonlinearity, which that proxy does not see. Here every code may
move by one level from GPTQ's choice and every group's scale may stretch, to minimise the expert's own output error
on the tokens routed to it:

    min_{V, a}  sum_t || down_q(V, a) f(gate_up_q(V, a) x_t) - y_t ||^2 / sum_t ||y_t||^2
    W_q = (clamp(q0 + round(V), 0, qmax) - z) * s * a,    V in [-1, 1],  a in [1 - A, 1 + A] per group

with y_t the full-precision expert's output, q0, s, z GPTQ's codes and grid, f the gated activation. round() passes
its gradient straight through; V and a move by lr * sign(gradient) per step (signed gradient descent: the step is
the same for every weight whatever the scale of its gradient, and `steps` steps of lr = 2 / steps can carry V across
one rounding boundary and back). Each expert keeps its best step, the start included, so the objective never rises
on the tokens it is measured on. Zero points stay GPTQ's (integers for widths >= 2).

Every expert of a batch is optimised at once ([n, ...] batched products); the experts' token sets are padded to one
length with zero rows, masked out of the objective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

STEPS = 100
SCALE_RANGE = 0.5  # a in [0.5, 1.5]: AutoRound's min/max tuning range


@dataclass(frozen=True)
class Replica:
    """One projection of n experts at one width: codes [n, rows, cols] (uint8 or float), scale, zero [n, rows,
    groups]; the dequantized weight is (codes - zero) * scale per group of cols / groups columns."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def weight(self, codes: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        codes = self.codes if codes is None else codes
        scale = self.scale if scale is None else scale
        n, rows, cols = codes.shape
        groups = scale.shape[-1]
        grouped = codes.to(scale.dtype).reshape(n, rows, groups, cols // groups)
        return ((grouped - self.zero[..., None]) * scale[..., None]).reshape(n, rows, cols)


def _expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> torch.Tensor:
    """The gated MLP of n experts on their tokens: x [n, t, H], gate_up [n, 2I, H], down [n, H, I] -> [n, t, H]."""
    gate, up = (x @ gate_up.mT).chunk(2, dim=-1)
    return (act_fn(gate) * up) @ down.mT


def _relative_error(y: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Per expert sum_t mask_t ||y_t - target_t||^2 / norm: [n]."""
    return ((y - target).square().sum(dim=-1) * mask).sum(dim=-1) / norm


def optimize_rounding(x: torch.Tensor, mask: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn: Callable,
                      replicas: tuple[Replica, Replica], qmax: int, steps: int = STEPS,
                      ) -> tuple[tuple[Replica, Replica], torch.Tensor, torch.Tensor]:
    """The replicas (gate_up, down) of n experts at one width with their rounding and scales optimised (module
    docstring) on tokens x [n, t, H] (mask [n, t]: each real token's weight, 0 for padding) against the full-precision
    weights gate_up [n, 2I, H], down [n, H, I]. Returns the new replicas (codes uint8, scales in the replicas'
    dtype) and the relative output error per expert before and after ([n] each, float32).

    Runs on x's device in float32 (float64 when x is float64); autograd is enabled inside whatever the caller's
    mode."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    device = x.device
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, mask = x.to(dtype), mask.to(dtype)
    with torch.no_grad():
        target = _expert_outputs(x, gate_up.to(dtype), down.to(dtype), act_fn)
        norm = (target.square().sum(dim=-1) * mask).sum(dim=-1).clamp(min=torch.finfo(dtype).tiny)
    base = [r.codes.to(device=device, dtype=dtype) for r in replicas]
    scales = [r.scale.to(device=device, dtype=dtype) for r in replicas]
    grids = [Replica(b, s, r.zero.to(device=device, dtype=dtype)) for b, s, r in zip(base, scales, replicas,
                                                                                          strict=True)]
    offsets = [torch.zeros_like(b, requires_grad=True) for b in base]
    stretch = [torch.ones_like(s, requires_grad=True) for s in scales]
    best_offsets = [torch.zeros_like(b) for b in base]
    best_stretch = [torch.ones_like(s) for s in scales]
    best = start = None
    lr = 2.0 / max(steps, 1)
    with torch.enable_grad():
        for step in range(steps + 1):
            codes = [(b + (v.round() - v).detach() + v).clamp(0, qmax) for b, v in zip(base, offsets, strict=True)]
            weights = [g.weight(c, g.scale * a) for g, c, a in zip(grids, codes, stretch, strict=True)]
            error = _relative_error(_expert_outputs(x, *weights, act_fn), target, mask, norm)
            with torch.no_grad():
                if best is None:
                    best, start = error.detach().clone(), error.detach().clone()
                improved = error.detach() < best
                best = torch.where(improved, error.detach(), best)
                for kept, current in zip(best_offsets + best_stretch, offsets + stretch, strict=True):
                    kept.copy_(torch.where(improved.view(-1, *[1] * (current.dim() - 1)), current, kept))
            if step == steps:
                break
            grads = torch.autograd.grad(error.sum(), offsets + stretch)
            with torch.no_grad():
                for param, grad in zip(offsets + stretch, grads, strict=True):
                    param.sub_(lr * grad.sign())
                for v in offsets:
                    v.clamp_(-1, 1)
                for a in stretch:
                    a.clamp_(1 - SCALE_RANGE, 1 + SCALE_RANGE)
    with torch.no_grad():
        out = tuple(Replica((b + v.round()).clamp(0, qmax).to(torch.uint8), (s * a).to(r.scale.dtype), r.zero)
                    for b, v, s, a, r in zip(base, best_offsets, scales, best_stretch, replicas, strict=True))
    return out, start, best


# ------------------------------------------------------------------------------------------ whole decoder blocks
#
# Every quantized matrix of a decoder block at once, against the block's full-precision output instead of each
# expert's (AutoRound's block-wise objective, min_{V, a} || block_q(x) - block(x) ||^2 over its calibration batches):
# attention and the routed experts then correct each other's errors, and each routed expert's error counts by its
# routing weight on the tokens that reach it. The parametrization is AutoRound's, on the replica's grid (scale s and
# zero z from GPTQ's static groups):
#
#     W_q = (clamp(round(W / s' + z' + V), 0, qmax) - z') s',    V in [-1/2, 1/2]
#
# from the full-precision weight W, not from GPTQ's codes: starting at GPTQ's integer codes, every offset that the
# gradient pushes one way reaches the rounding boundary at the same step and thousands of codes flip at once (the
# block's error rose tenfold in one step on the reference models); from W / s + z each code starts at its own
# distance from the boundary and codes cross one by one. GPTQ's rounding stays the reference: the tuned matrices
# are kept only where they lower the block's error over every batch.
#
# The grid (s', z') is AutoRound's min/max tuning: the group's lowest level lo = -z s and highest hi = (qmax - z) s
# each stretched, lo a and hi b with a, b in [1 - A, 1 + A], then s' = (hi b - lo a) / qmax and z' = z + round(-lo a
# / s' - z) (round passing its gradient straight through): the range may shift towards the side the group's weights
# need, and the zero point with it, by whole levels, so z' stays on the codes' grid (an integer where z was one). On
# a symmetric grid, and at one bit (whose two levels are the group's mean -+ a spread, hexq.algos.quant), a = b: the
# scale stretches and the zero stays.

Objective = Callable[[dict[str, torch.Tensor], int], torch.Tensor]
BLOCK_OFFSET = 0.5  # V in [-1/2, 1/2]: a code moves at most one level from round-to-nearest


def tuned_grid(grid: Replica, low: torch.Tensor, high: torch.Tensor | None, qmax: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s', z') [n, rows, groups] of the module comment from the group stretches low (a) and high (b; None: a = b)."""
    if high is None:
        return grid.scale * low, grid.zero
    tiny = torch.finfo(grid.scale.dtype).tiny
    span = (high * (qmax - grid.zero) + low * grid.zero).clamp(min=tiny)  # (hi b - lo a) / s
    scale = grid.scale * span / qmax
    shift = low * grid.zero * qmax / span - grid.zero
    return scale, grid.zero + shift + (shift.round() - shift).detach()


@dataclass(frozen=True)
class BlockRounding:
    """The outcome of optimize_block_rounding: the replicas (tuned, or GPTQ's when tuning did not lower the error
    over every batch), and the block's mean squared output error over every batch with GPTQ's and with these."""

    replicas: dict[str, Replica]
    before: float
    after: float


CHUNK_ELEMENTS = 1 << 24  # elements per chunk of BlockWeight's elementwise work: 64 MB per float32 temporary


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    n, rows, cols = t.shape
    return t.reshape(n, rows, groups, cols // groups)


def _rounded(weight, scale, zero, offset, qmax):
    """(clamp(round(u), 0, qmax), [round(u) within [0, qmax]]) of u = W / s' + z' + V, grouped [n, rows, groups, g]."""
    groups = scale.shape[-1]
    place = (_grouped(weight, groups) / scale[..., None] + zero[..., None] + _grouped(offset, groups)).round_()
    inside = (place >= 0) & (place <= qmax)
    return place.clamp_(0, qmax), inside


def _chunks(weight: torch.Tensor):
    step = max(1, CHUNK_ELEMENTS // max(weight[0].numel(), 1))
    return [slice(start, start + step) for start in range(0, weight.shape[0], step)]


def _block_rounded(weight, scale, zero, offset, qmax, held_codes, held, part: slice):
    """_rounded on matrices `part`, the held ones at held_codes with m = 0 (grouped)."""
    codes, inside = _rounded(weight[part], scale[part], zero[part], offset[part], qmax)
    if held is None:
        return codes, inside
    where = held[part].view(-1, 1, 1, 1)
    return torch.where(where, _grouped(held_codes[part], scale.shape[-1]).to(codes.dtype), codes), inside & ~where


def block_codes(weight, scale, zero, offset, qmax, held_codes, held) -> torch.Tensor:
    """BlockWeight's codes clamp(round(W / s' + z' + V), 0, qmax), the held matrices' at held_codes: uint8 [n, rows,
    cols], worked in the same chunks."""
    out = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    for part in _chunks(weight):
        codes, _inside = _block_rounded(weight, scale, zero, offset, qmax, held_codes, held, part)
        out[part] = codes.reshape(out[part].shape)
    return out


class BlockWeight(torch.autograd.Function):
    """W_q = (clamp(round(W / s' + z' + V), 0, qmax) - z') s' with round() passing its gradient straight through, as
    one autograd node that keeps only its inputs: the composed ops would keep ~5 temporaries the size of W for the
    backward pass, ~12 GB on one Qwen3-30B-A3B layer's experts in float32. With m = [round(u) within [0, qmax]]:

        dW_q/dV = s' m,    dW_q/ds' = (c - z') - m W / s',    dW_q/dz' = -s' (1 - m)

    (the last two summed over each group). Matrices in `held` [n] (bool) keep their given codes and pass no gradient
    to V."""

    @staticmethod
    def forward(ctx, weight, scale, zero, offset, qmax, held_codes, held):
        ctx.save_for_backward(weight, scale, zero, offset, held_codes, held)
        ctx.qmax = qmax
        out = torch.empty_like(weight)
        for part in _chunks(weight):
            codes, _inside = _block_rounded(weight, scale, zero, offset, qmax, held_codes, held, part)
            out[part] = ((codes - zero[part][..., None]) * scale[part][..., None]).reshape(out[part].shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, scale, zero, offset, held_codes, held = ctx.saved_tensors
        groups = scale.shape[-1]
        grad_offset = torch.empty_like(offset) if ctx.needs_input_grad[3] else None
        grad_scale, grad_zero = torch.empty_like(scale), torch.empty_like(zero)
        for part in _chunks(weight):
            s, z = scale[part][..., None], zero[part][..., None]
            codes, inside = _block_rounded(weight, scale, zero, offset, ctx.qmax, held_codes, held, part)
            g = _grouped(grad[part], groups)
            if grad_offset is not None:
                grad_offset[part] = (g * s * inside).reshape(grad_offset[part].shape)
            grad_scale[part] = (g * (codes - z - inside * _grouped(weight[part], groups) / s)).sum(-1)
            grad_zero[part] = -(g * s * ~inside).sum(-1)
        return None, grad_scale, grad_zero, grad_offset, None, None, None


def optimize_block_rounding(weights: dict[str, torch.Tensor], replicas: dict[str, Replica], qmax: dict[str, int],
                            objective: Objective, batches: int, steps: int = STEPS,
                            frozen: dict[str, torch.Tensor] | None = None,
                            moving_zero: frozenset[str] = frozenset()) -> BlockRounding:
    """The rounding and grids of every matrix named in `replicas` (GPTQ's n matrices [n, rows, cols] on their grids;
    weights[name] the full-precision ones, qmax[name] the largest code) optimised by signed gradient (module
    comment above) on objective(dequantized weights {name: [n, rows, cols]}, batch): the block's squared output
    error on calibration batch `batch` (0 <= batch < batches). Step i uses batch i mod batches, as AutoRound cycles
    its mini-batches; V, a and b move by lr * sign(gradient) with lr falling linearly from 1 / steps to 0 (AutoRound's
    default schedule), and the state kept is the one whose batch error, relative to GPTQ's on that batch, was
    lowest. moving_zero: the matrices on asymmetric grids of 2 bits or more, whose range ends stretch apart (their
    zero points move); the others' scales stretch alone. frozen[name] [n] bool: matrices kept at GPTQ's codes and
    grid (experts too rarely routed for their gradient to mean anything).

    The result keeps GPTQ's replicas unless the tuned ones lower the mean error over every batch. Runs in float32
    on the replicas' device."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    grids = {name: Replica(r.codes, r.scale.float(), r.zero.float()) for name, r in replicas.items()}
    full = {name: weights[name].float() for name in grids}
    held = {name: frozen[name] for name in (frozen or {}) if name in grids}
    offsets = {name: torch.zeros_like(full[name], requires_grad=True) for name in grids}
    low = {name: torch.ones_like(grid.scale, requires_grad=True) for name, grid in grids.items()}
    high = {name: torch.ones_like(grids[name].scale, requires_grad=True) for name in grids if name in moving_zero}

    def current_grid(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(s', z') at the present a, b; GPTQ's for the held matrices."""
        grid = grids[name]
        scale, zero = tuned_grid(grid, low[name], high.get(name), qmax[name])
        if name in held:
            where = held[name].view(-1, 1, 1)
            scale, zero = torch.where(where, grid.scale, scale), torch.where(where, grid.zero, zero)
        return scale, zero

    def dequantized() -> dict[str, torch.Tensor]:
        return {name: BlockWeight.apply(full[name], *current_grid(name), offsets[name], qmax[name], grid.codes,
                                        held.get(name)) for name, grid in grids.items()}

    def codes_now() -> dict[str, Replica]:
        """The codes and grids at the present V, a, b (uint8 codes: what the best state keeps)."""
        out = {}
        for name, grid in grids.items():
            scale, zero = (t.detach() for t in current_grid(name))
            codes = block_codes(full[name], scale, zero, offsets[name], qmax[name], grid.codes, held.get(name))
            out[name] = Replica(codes, scale, zero)
        return out

    with torch.no_grad():
        initial = [float(objective({name: grid.weight() for name, grid in grids.items()}, batch))
                   for batch in range(batches)]
    before = sum(initial) / batches
    params = list(offsets.values()) + list(low.values()) + list(high.values())
    best, best_state = 1.0, None
    with torch.enable_grad():
        for step in range(steps):
            batch = step % batches
            error = objective(dequantized(), batch)
            relative = float(error.detach()) / max(initial[batch], torch.finfo(torch.float32).tiny)
            if relative < best:  # the state this error was measured at
                with torch.no_grad():
                    best, best_state = relative, codes_now()
            grads = torch.autograd.grad(error, params)
            del error
            lr = (1 - step / steps) / steps
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param.add_(grad.sign_(), alpha=-lr)
                del grads
                for v in offsets.values():
                    v.clamp_(-BLOCK_OFFSET, BLOCK_OFFSET)
                for stretch in (*low.values(), *high.values()):
                    stretch.clamp_(1 - SCALE_RANGE, 1 + SCALE_RANGE)
    if best_state is None:
        return BlockRounding(dict(replicas), before, before)
    offsets.clear()  # the best state is kept as codes; V is no longer needed
    params.clear()
    with torch.no_grad():
        after = sum(float(objective({name: r.weight() for name, r in best_state.items()}, batch))
                    for batch in range(batches)) / batches
        if not after < before:
            return BlockRounding(dict(replicas), before, before)
        tuned = {name: Replica(r.codes, r.scale.to(replicas[name].scale.dtype), r.zero.to(replicas[name].zero.dtype))
                 for name, r in best_state.items()}
    return BlockRounding(tuned, before, after)
