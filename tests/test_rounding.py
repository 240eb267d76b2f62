"""Rounding optimised on routed tokens (hexq.algos.rounding) and its calibration glue (hexq.calib.rounding)."""

from __future__ import annotations

import pytest
import torch

from hexq.algos.gptq import gptq_bank
from hexq.algos.quant import QuantSpec
from hexq.algos.rounding import SCALE_RANGE, Replica, optimize_block_rounding, optimize_rounding
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


# ------------------------------------------------------------------------------------------ whole blocks


def two_layer_block(seed: int = 0, tokens: int = 96, width: int = 16):
    """A block y = x + W2 silu(W1 x) as optimize_block_rounding sees one: full-precision weights {"w1", "w2"}
    [1, rows, cols], their GPTQ replicas at 2 bits (groups of 8), and an objective over two batches of tokens."""
    g = torch.Generator().manual_seed(seed)
    weights = {"w1": torch.randn(1, 2 * width, width, generator=g) / width**0.5,
               "w2": torch.randn(1, width, 2 * width, generator=g) / (2 * width)**0.5}
    x = torch.randn(2, tokens, width, generator=g)

    def block(w: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
        return x[batch] + ACT(x[batch] @ w["w1"][0].mT) @ w["w2"][0].mT

    def objective(w: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
        return (block(w, batch) - block(weights, batch)).square().mean()

    spec = QuantSpec(bits=2, group_size=8, symmetric=False)
    inputs = {"w1": x.reshape(-1, width), "w2": ACT(x.reshape(-1, width) @ weights["w1"][0].mT)}
    replicas = {}
    for name, weight in weights.items():
        result = gptq_bank(weight.double(), 2 * (inputs[name].mT @ inputs[name]).double()[None], [2], spec)[2]
        replicas[name] = Replica(result.codes, result.scale.float(), result.zero.float())
    return weights, replicas, objective


def test_block_rounding_lowers_the_block_error_and_stays_on_the_grid():
    weights, replicas, objective = two_layer_block()
    result = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=60)
    with torch.no_grad():
        measured = [sum(float(objective({n: r.weight() for n, r in chosen.items()}, b)) for b in (0, 1)) / 2
                    for chosen in (replicas, result.replicas)]
    assert result.before == pytest.approx(measured[0], rel=1e-5)
    assert result.after == pytest.approx(measured[1], rel=1e-5)
    assert result.after < 0.9 * result.before
    for name, new in result.replicas.items():
        old = replicas[name]
        assert new.codes.dtype == torch.uint8 and int(new.codes.max()) <= 3
        ratio = new.scale / old.scale
        assert (ratio >= 1 - SCALE_RANGE - 1e-6).all() and (ratio <= 1 + SCALE_RANGE + 1e-6).all()
        assert torch.equal(new.zero, old.zero)


def test_moving_zero_points_stay_on_the_integer_grid_and_the_scale_within_the_stretch():
    """AutoRound's min/max tuning (hexq.algos.rounding.tuned_grid): each group's lowest and highest level stretch
    independently, the zero point moves by whole levels (and somewhere does), the scale stays within the stretch."""
    weights, replicas, objective = two_layer_block(seed=5)
    both = frozenset(replicas)
    result = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=80,
                                     moving_zero=both)
    tied = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=80)
    assert result.after < result.before and result.after != tied.after
    moved = 0
    for name, new in result.replicas.items():
        old = replicas[name]
        assert torch.equal(new.zero, new.zero.round()) and new.zero.min() >= 0 and new.zero.max() <= 3
        moved += int((new.zero != old.zero).sum())
        ratio = new.scale / old.scale  # s' / s = (b (qmax - z) + a z) / qmax: between a and b
        assert (ratio >= 1 - SCALE_RANGE - 1e-6).all() and (ratio <= 1 + SCALE_RANGE + 1e-6).all()
    assert moved


def test_block_rounding_codes_stay_within_one_level_of_round_to_nearest():
    """V in [-1/2, 1/2]: each code is within one level of rounding the weight on its (stretched) grid."""
    weights, replicas, objective = two_layer_block(seed=1)
    result = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=40)
    for name, new in result.replicas.items():
        n, rows, cols = new.codes.shape
        place = (weights[name].reshape(n, rows, -1, 8) / new.scale[..., None] + new.zero[..., None])
        nearest = place.reshape(n, rows, cols).round().clamp(0, 3)
        assert (new.codes.float() - nearest).abs().max() <= 1


def test_block_weight_node_has_the_gradient_of_its_composed_ops(monkeypatch):
    """hexq.algos.rounding.BlockWeight (one autograd node, worked in chunks of matrices) against the same W_q composed
    of differentiable ops with round() passed straight through: equal values and gradients for V, s' and z', the
    held matrices at their given codes with no gradient to V."""
    import hexq.algos.rounding as rounding

    monkeypatch.setattr(rounding, "CHUNK_ELEMENTS", 2 * 6 * 16)  # 2 of 5 matrices per chunk
    g = torch.Generator().manual_seed(7)
    n, rows, cols, groups, qmax = 5, 6, 16, 2, 3
    weight = torch.randn(n, rows, cols, generator=g, dtype=F64)
    scale = (0.2 + torch.rand(n, rows, groups, generator=g, dtype=F64)).requires_grad_(True)
    zero = torch.randint(0, qmax + 1, (n, rows, groups), generator=g).to(F64).requires_grad_(True)
    offset = (torch.rand(n, rows, cols, generator=g, dtype=F64) - 0.5).requires_grad_(True)
    held = torch.tensor([False, True, False, False, True])
    held_codes = torch.randint(0, qmax + 1, (n, rows, cols), generator=g).to(torch.uint8)
    upstream = torch.randn(n, rows, cols, generator=g, dtype=F64)

    place = (weight.reshape(n, rows, groups, -1) / scale[..., None] + zero[..., None]).reshape(n, rows, cols) + offset
    codes = (place + (place.round() - place).detach()).clamp(0, qmax)
    codes = torch.where(held.view(-1, 1, 1), held_codes.to(F64), codes)
    expected = ((codes.reshape(n, rows, groups, -1) - zero[..., None]) * scale[..., None]).reshape(n, rows, cols)
    want = torch.autograd.grad((expected * upstream).sum(), (offset, scale, zero))

    got = rounding.BlockWeight.apply(weight, scale, zero, offset, qmax, held_codes, held)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    for ours, theirs in zip(torch.autograd.grad((got * upstream).sum(), (offset, scale, zero)), want, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)
    assert (want[0][held] == 0).all()


def test_frozen_matrices_and_no_steps_keep_gptq():
    weights, replicas, objective = two_layer_block(seed=2)
    none = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=0)
    assert none.replicas == replicas and none.after == none.before
    frozen = {"w1": torch.ones(1, dtype=torch.bool), "w2": torch.zeros(1, dtype=torch.bool)}
    result = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=40,
                                     frozen=frozen)
    assert result.after < result.before
    assert torch.equal(result.replicas["w1"].codes, replicas["w1"].codes.to(torch.uint8))
    assert torch.equal(result.replicas["w1"].scale, replicas["w1"].scale)
    assert not torch.equal(result.replicas["w2"].codes, replicas["w2"].codes.to(torch.uint8))


def test_routed_experts_stand_in_computes_what_the_experts_module_does():
    """hexq.calib.block_rounding.RoutedExperts (one padded batch for all experts) against each expert's tokens
    computed one expert at a time (hexq.model.simulate.routed_outputs), with a dropped slot (id -1) ignored by both."""
    from hexq.calib.block_rounding import RoutedExperts
    from hexq.model.simulate import RoutedTokens, routed_outputs

    g = torch.Generator().manual_seed(3)
    experts, hidden, inner, tokens, k = 5, 12, 6, 40, 2
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g)
    down = torch.randn(experts, hidden, inner, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[3, 1] = -1
    weights = torch.rand(tokens, k, generator=g)
    stand_in = RoutedExperts(ACT)
    stand_in.gate_up, stand_in.down = gate_up, down
    expected = routed_outputs(RoutedTokens.from_batches([(x, index, weights)], experts),
                              lambda ids: (gate_up[ids], down[ids]), ACT, None, None, chunk=2)
    assert torch.allclose(stand_in(x, index, weights), expected, atol=1e-5)


def test_routed_experts_gradient_is_the_same_every_run():
    """The block's gradient reaches the layer's input through the stand-in's gather of each token once per routed
    slot: on 2 threads it must add the repeated tokens' gradients in one order, the one torch's deterministic mode
    uses (an indexing gather's gradient adds them with atomics across threads, in whatever order the threads meet,
    and block rounding's calibration differed between runs). Both on 2 threads, so that the products around the
    gather sum the same way."""
    from hexq.calib.block_rounding import RoutedExperts

    g = torch.Generator().manual_seed(5)
    experts, hidden, inner, tokens, k = 8, 64, 16, 2048, 4  # tokens x k x hidden far above torch's parallel grain
    stand_in = RoutedExperts(ACT)
    stand_in.gate_up = torch.randn(experts, 2 * inner, hidden, generator=g)
    stand_in.down = torch.randn(experts, hidden, inner, generator=g)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights, upstream = torch.rand(tokens, k, generator=g), torch.randn(tokens, hidden, generator=g)

    def gradient(deterministic: bool) -> torch.Tensor:
        torch.use_deterministic_algorithms(deterministic)
        return torch.autograd.grad((stand_in(x, index, weights) * upstream).sum(), x)[0]

    threads, mode = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    try:
        sequential = gradient(True)
        assert all(torch.equal(gradient(False), sequential) for _ in range(4))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(mode)


def test_tuning_that_lowers_one_batch_but_not_the_mean_keeps_gptq():
    """Batch 0 rewards any move towards the full-precision weights, batch 1 punishes any move away from GPTQ's: the
    best state on batch 0 is worse over both, so GPTQ's replicas come back."""
    weights, replicas, _objective = two_layer_block(seed=4)
    gptq = {name: r.weight().float() for name, r in replicas.items()}

    def objective(w, batch):
        target, factor = (weights, 1.0) if batch == 0 else (gptq, 1000.0)
        return factor * sum((w[n] - target[n]).square().sum() for n in w) + 1e-3

    result = optimize_block_rounding(weights, replicas, {"w1": 3, "w2": 3}, objective, batches=2, steps=20)
    assert result.replicas == replicas and result.after == result.before
