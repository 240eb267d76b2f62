"""Rounding optimised on routed tokens (hexq.algos.rounding) and its calibration glue (hexq.calib.rounding)."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.gptq import gptq_bank
from hexq.algos.quant import QuantSpec
from hexq.algos.rounding import SCALE_RANGE, Replica, optimize_rounding
from tests.conftest import DEVICES

F64 = torch.float64
ACT = torch.nn.functional.silu


def experts_and_tokens(n: int = 3, hidden: int = 16, inner: int = 8, tokens: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * inner, hidden, generator=g, dtype=F64) / hidden**0.5
    down = torch.randn(n, hidden, inner, generator=g, dtype=F64) / inner**0.5
    x = torch.randn(n, tokens, hidden, generator=g, dtype=F64)
    return gate_up, down, x


def gptq_replicas(gate_up, down, x, bits: int) -> tuple[Replica, Replica]:
    """GPTQ replicas of both projections on each expert's own tokens (group 8, asymmetric)."""
    spec = QuantSpec(bits=bits, group_size=8, symmetric=False)
    mid = ACT((x @ gate_up.mT).chunk(2, dim=-1)[0]) * (x @ gate_up.mT).chunk(2, dim=-1)[1]
    out = []
    for weight, inputs in ((gate_up, x), (down, mid)):
        result = gptq_bank(weight, 2 * inputs.mT @ inputs, [bits], spec)[bits]
        out.append(Replica(result.codes, result.scale, result.zero))
    return tuple(out)


def output_error(replicas, gate_up, down, x, mask) -> torch.Tensor:
    def run(gu, dn):
        gate, up = (x @ gu.mT).chunk(2, dim=-1)
        return (ACT(gate) * up) @ dn.mT

    target = run(gate_up, down)
    y = run(*(r.weight() for r in replicas))
    return ((y - target).square().sum(-1) * mask).sum(-1) / (target.square().sum(-1) * mask).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_lowers_the_output_error_and_stays_on_the_grid(device):
    gate_up, down, x = (t.to(device) for t in experts_and_tokens())
    mask = torch.ones(x.shape[:2], dtype=F64, device=device)
    start = gptq_replicas(gate_up, down, x, bits=2)
    rounded, before, after = optimize_rounding(x, mask, gate_up, down, ACT, start, qmax=3, steps=40)
    assert torch.allclose(before, output_error(start, gate_up, down, x, mask), rtol=1e-9)
    assert torch.allclose(after, output_error(rounded, gate_up, down, x, mask), rtol=1e-9)
    assert (after <= before).all() and (after < 0.9 * before).all()  # each expert keeps its best step
    for old, new in zip(start, rounded, strict=True):
        assert new.codes.dtype == torch.uint8 and int(new.codes.max()) <= 3
        assert (new.codes.int() - old.codes.int()).abs().max() <= 1  # one level at most from GPTQ's choice
        ratio = new.scale / old.scale
        assert (ratio >= 1 - SCALE_RANGE).all() and (ratio <= 1 + SCALE_RANGE).all()
        assert torch.equal(new.zero, old.zero)


def test_experts_are_independent_and_padding_is_ignored():
    """One expert optimised alone on its tokens gives what it gets in a batch where it is padded with zero rows
    (masked) next to other experts."""
    gate_up, down, x = experts_and_tokens(n=2, tokens=48)
    start = gptq_replicas(gate_up, down, x, bits=1)
    padded = torch.cat([x, torch.zeros(2, 16, x.shape[2], dtype=F64)], dim=1)
    mask = torch.cat([torch.ones(2, 48, dtype=F64), torch.zeros(2, 16, dtype=F64)], dim=1)
    both, _, after_both = optimize_rounding(padded, mask, gate_up, down, ACT, start, qmax=1, steps=20)
    alone = [Replica(r.codes[:1], r.scale[:1], r.zero[:1]) for r in start]
    one, _, after_one = optimize_rounding(x[:1], torch.ones(1, 48, dtype=F64), gate_up[:1], down[:1], ACT,
                                          tuple(alone), qmax=1, steps=20)
    assert torch.allclose(after_one, after_both[:1], rtol=1e-9)
    for a, b in zip(one, both, strict=True):
        assert torch.equal(a.codes, b.codes[:1]) and torch.equal(a.scale, b.scale[:1])


def test_an_expert_without_tokens_keeps_gptq_rounding():
    gate_up, down, x = experts_and_tokens(n=2)
    mask = torch.ones(x.shape[:2], dtype=F64)
    mask[1] = 0
    start = gptq_replicas(gate_up, down, x, bits=2)
    rounded, _, _ = optimize_rounding(x, mask, gate_up, down, ACT, start, qmax=3, steps=10)
    for old, new in zip(start, rounded, strict=True):
        assert torch.equal(new.codes[1], old.codes[1]) and torch.equal(new.scale[1], old.scale[1])
