"""The runtime's self-check: before serving, one expert of the first MoE layer at every width it stores (on the served
path: the resident arena, or the cache's compute) and the largest quantized dense linear, on a few tokens, against
float64 products of the same packed weights; a device or kernel that computes wrong numbers stops `hexq run` with
a one-line error instead of serving them. Then the cost model's latencies are measured."""

from __future__ import annotations

import torch

from hexq.base.errors import HexqError
from hexq.model.simulate import quantized_expert_output
from hexq.packed.bitpack import packed_nbytes
from hexq.packed.weight import dequantize_packed
from hexq.runtime.compute import PackedLinear
from hexq.runtime.experts import CachedExperts

# A served computation may differ from the float64 reference by what bf16 activations and weights round away (a
# few 1e-3 relative); a wrong dequantization or kernel is off by O(1). Between the two: refuse to serve.
SELF_CHECK_TOLERANCE = 0.05


def self_check(runtime, experts: CachedExperts) -> None:
    """Compute one expert of the first MoE layer at every width it stores (on the served path: the resident
    arena, or the cache's compute), and one quantized dense linear, on a few tokens, against float64 products of
    the same packed weights; a relative error past SELF_CHECK_TOLERANCE is a HexqError (never serve wrong
    numbers). Then measure the cost model's latencies."""
    act_fn, quantizers = experts.act_fn, experts.quantizers
    generator = torch.Generator(device="cpu").manual_seed(0)
    expert = next((e for e, b in enumerate(runtime.artifact.allocation[0]) if b), None)
    buffer = torch.empty(runtime.source.sizes.read_nbytes, dtype=torch.uint8, device="cpu")
    probe = None
    if expert is not None:
        allocated = runtime.artifact.allocation[0][expert]
        widths = [allocated] if experts.arena else runtime.artifact.stored_bits(0, expert)
        for bits in widths:
            x = torch.randn(3, runtime.source.sizes.shapes[0][1], generator=generator, device="cpu")
            if experts.arena is not None:
                index = torch.full((3, 1), expert, dtype=torch.long, device=runtime.device)
                got = experts.arena(x.to(runtime.device, runtime.dtype), index,
                                       torch.ones(3, 1, device=runtime.device), act_fn, quantizers)
            else:
                probe = runtime.source.load_transient(0, expert, bits)
                if runtime.compute.lays_out(probe):  # checked in the layout the cache serves it in
                    probe = runtime.compute.relaid(probe)
                got = runtime.compute.expert(x.to(runtime.device, runtime.dtype), probe, act_fn, quantizers)
            gate_up, down = (dequantize_packed(p).double()
                             for p in runtime.artifact.read_expert(0, expert, bits, buffer))
            want = quantized_expert_output(x.double(), gate_up, down, act_fn, *quantizers)
            _check(runtime, "expert", bits, got, want)
    dense = largest_packed_linear(runtime.model)
    if dense is not None:
        x = torch.randn(2, dense.in_features, generator=generator, device="cpu").to(runtime.device, runtime.dtype)
        want = torch.nn.functional.linear(
            (x if dense.quantizer is None else dense.quantizer(x)).double().cpu(),
            dequantize_packed(_unpadded(dense.weight_packed)).double().cpu())
        _check(runtime, "dense linear", dense.bits, dense(x) - _bias(dense), want)
    runtime.compute.measure(None if probe is None else runtime.source.load_transient(0, expert, probe.bits),
                            None if dense is None else dense.weight_packed, act_fn)


def _check(runtime, what: str, bits: int, got: torch.Tensor, want: torch.Tensor) -> None:
    error = float((got.double().cpu() - want).norm() / want.norm().clamp(min=1e-30))
    if not error <= SELF_CHECK_TOLERANCE:
        raise HexqError(f"the {runtime.device} computation of a {bits}-bit {what} ({runtime.compute.path}) is off "
                        f"by {error:.2g} relative to the float64 reference (allowed {SELF_CHECK_TOLERANCE}): "
                        "refusing to serve wrong numbers; try --device cpu or HEXQ_CPU_PATH=scalar")


def _unpadded(weight):
    """A packed weight whose codes may sit in a padded buffer (Triton's second byte load), cut to its own bytes."""
    rows, cols = weight.shape
    return type(weight)(weight.codes[:packed_nbytes(rows * cols, weight.bits)], weight.scale, weight.zero,
                        weight.bits, weight.shape)


def largest_packed_linear(model: torch.nn.Module) -> PackedLinear | None:
    """The largest packed linear of the decoder layers (the one the self-check and the cost model's dense profile
    measure; a quantized head, vocab x hidden, is computed from the same kernels but would cost seconds to check)."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
    return max(linears, key=lambda m: m.in_features * m.out_features, default=None)


def _bias(linear: PackedLinear) -> torch.Tensor | float:
    return 0.0 if linear.bias is None else linear.bias.to(linear.compute.dtype)
