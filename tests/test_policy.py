"""Precision policies (hexq.runtime.policy): static, context (002), online (001), depth (004), make_policy."""

from __future__ import annotations

import pytest
import torch

from hexq.algos import policy_widths
from hexq.algos.allocation import avg_bit_budget
from hexq.runtime.policy import POLICIES, PolicyContext, context_widths, make_policy

TABLE_BITS = (1, 2, 3, 4, 8)
ROW = [4, 4, 3, 3, 3, 3, 2, 2]  # average 3 bits; experts 0 and 1 are the artifact's hot ones


def make_context(layers: int = 2, allocation_row: list[int] = ROW, avg_bits: float = 3.0, top_k: int = 2,
                 hot_fraction: float = 0.25) -> PolicyContext:
    E = len(allocation_row)
    # Loss halves with every extra bit; a little per-expert spread so experts are not interchangeable.
    base = 1.0 + 0.1 * torch.arange(E, dtype=torch.float64)
    loss = base[None, :, None] * 2.0 ** -torch.tensor(TABLE_BITS, dtype=torch.float64)
    return PolicyContext(allocation=[list(allocation_row) for _ in range(layers)],
                         loss_table=loss.expand(layers, E, len(TABLE_BITS)).clone(),
                         skip_loss=base.expand(layers, E).clone(), table_bits=TABLE_BITS, avg_bits=avg_bits,
                         hot_fraction=hot_fraction, top_k=top_k)


def routing(experts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] indices and routing weights that decrease along the slots (as a sorted top-k returns them)."""
    indices = torch.tensor(experts)
    k = indices.shape[1]
    scores = torch.linspace(0.6, 0.4, k).expand(indices.shape[0], k).clone()
    return indices, scores


def constant_routing(experts: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return routing([experts] * tokens)


# ------------------------------------------------------------------------------------------ static


def test_static_returns_the_allocation():
    ctx = make_context(layers=1)
    policy = make_policy("static", ctx)
    indices, scores = routing([[0, 7], [3, 6], [1, 2]])
    for prefill in (True, False):
        widths = policy.choose(0, indices, scores, prefill)
        assert widths.dtype == torch.long
        assert widths.tolist() == [[ROW[e] for e in row] for row in indices.tolist()]
    assert policy.transitions() == []


# ------------------------------------------------------------------------------------------ context (002)


def test_context_promotes_the_prompt_experts_within_the_budget():
    ctx = make_context()
    policy = make_policy("context", ctx)
    policy.begin_sequence()
    prompt = [[5, 6]] * 30 + [[6, 5]] * 10 + [[0, 5], [1, 6], [2, 3]]
    indices, scores = routing(prompt)
    for layer in range(ctx.num_layers):
        assert policy.choose(layer, indices, scores, prefill=True).tolist() == [[ROW[e] for e in t] for t in prompt]
    policy.end_prefill()

    decode_indices, decode_scores = routing([[5, 6], [0, 7]])
    budget = avg_bit_budget(ctx.avg_bits, ctx.num_experts)
    all_experts, _ = routing([list(range(ctx.num_experts))])
    for layer in range(ctx.num_layers):
        assert policy.choose(layer, decode_indices, decode_scores, prefill=False)[0].tolist() == [4, 4]
        plan = policy.choose(layer, all_experts, torch.ones_like(all_experts, dtype=torch.float), False)[0]
        assert sum(plan.tolist()) <= budget  # table-bits average within avg_bits
        assert set(plan.tolist()) <= {1, 2, 3, 4}  # no 8-bit replica: the artifact's plan stops at 4 bits

    moves = policy.transitions()
    for layer in range(ctx.num_layers):
        assert {(layer, 5, 4), (layer, 6, 4)} <= set(moves)
    assert all(bits > ROW[expert] for _, expert, bits in moves)  # only promotions are prefetched
    assert policy.transitions() == []  # drained

    policy.begin_sequence()  # the next prompt starts from the artifact's plan again
    assert policy.choose(0, decode_indices, decode_scores, prefill=True)[0].tolist() == [ROW[5], ROW[6]]


def test_context_keeps_static_plan_without_prompt_statistics():
    ctx = make_context(layers=1)
    policy = make_policy("context", ctx)
    policy.begin_sequence()
    policy.end_prefill()
    indices, scores = routing([[0, 7]])
    assert policy.choose(0, indices, scores, prefill=False).tolist() == [[ROW[0], ROW[7]]]
    assert policy.transitions() == []


def test_context_widths_shrinks_the_hot_set_to_fit_a_tight_budget():
    E, bits = 8, [1, 2, 3, 4]
    loss = torch.rand(E, 4, generator=torch.Generator().manual_seed(0)).sort(dim=1, descending=True).values
    S = torch.linspace(1.0, 0.0, E)
    widths = context_widths(S, [1] * E, loss, bits, avg_bits=1.25, hot=2)  # 2 x 4 bits would leave 2 for 6
    assert sum(widths) <= avg_bit_budget(1.25, E)
    assert min(widths) >= 1
    roomy = context_widths(S, [1] * E, loss, bits, avg_bits=3.0, hot=2)
    assert roomy[0] == roomy[1] == 4 and sum(roomy) <= 24


# ------------------------------------------------------------------------------------------ online (001)


def run_intervals(policy, layer: int, per_interval: list[tuple[list[int], int]]) -> None:
    """Each entry: route `count` of the interval's 16 tokens to `experts`, the other tokens elsewhere."""
    for experts, count in per_interval:
        filler = [e for e in range(8) if e not in experts][: len(experts)]
        indices, scores = routing([experts] * count + [filler] * (16 - count))
        policy.choose(layer, indices, scores, prefill=False)


def test_online_hysteresis_stops_flapping():
    ctx = make_context(layers=1, allocation_row=[4, 2, 2, 2], top_k=1, avg_bits=2.5)  # K = 1: expert 0 is hot
    alternating = [([0], 9), ([1], 9)] * 10  # experts 0 and 1 take turns at 9 vs 7 tokens of 16

    def flips(margin: float) -> int:
        policy = make_policy("online", ctx, margin=margin)
        for experts, count in alternating:
            other = [1 - experts[0]]
            indices, scores = routing([experts] * count + [other] * (16 - count))
            policy.choose(0, indices, scores, prefill=False)
        return len([move for move in policy.transitions() if move[2] == 4])

    assert flips(margin=0.1) == 0
    assert flips(margin=0.0) > 0  # without the margin the same routing flaps


def test_online_follows_a_domain_switch():
    ctx = make_context(layers=2)
    policy = make_policy("online", ctx)  # hot {0, 1} at 4 bits from the allocation, others at 2
    indices, scores = routing([[0, 1], [5, 6]])
    assert policy.choose(1, indices, scores, prefill=False).tolist() == [[4, 4], [2, 2]]

    run_intervals(policy, 1, [([0, 1], 16)] * 4)
    assert policy.transitions() == []  # the traffic matches the hot set
    run_intervals(policy, 1, [([5, 6], 16)] * 5)
    moves = policy.transitions()
    assert {(1, 5, 4), (1, 6, 4), (1, 0, 2), (1, 1, 2)} == set(moves)
    assert policy.choose(1, indices, scores, prefill=False).tolist() == [[2, 2], [4, 4]]
    assert policy.choose(0, indices, scores, prefill=False).tolist() == [[4, 4], [2, 2]]  # other layer untouched
    assert policy.transitions() == []


def test_online_long_prefill_steps_once_per_interval():
    ctx = make_context(layers=1)
    whole, pieces = make_policy("online", ctx), make_policy("online", ctx)
    indices, scores = routing([[e % 8, (e + 3) % 8] for e in range(64)])
    whole.choose(0, indices, scores, prefill=True)
    for start in range(0, 64, 16):
        pieces.choose(0, indices[start:start + 16], scores[start:start + 16], prefill=False)
    assert torch.allclose(whole.hotness, pieces.hotness)
    assert whole.hotness.sum() > 0


# ------------------------------------------------------------------------------------------ depth (004)


def test_depth_keeps_more_slots_high_in_early_layers():
    ctx = make_context(layers=4, top_k=4)
    policy = make_policy("depth", ctx)  # lam 0.5: r = 1, 0.875, 0.625, 0.5 -> 4, 4, 3, 2 of 4 slots
    indices = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    scores = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.4, 0.3, 0.2, 0.1]])
    high = [(policy.choose(layer, indices, scores, prefill=False) == 4).sum(dim=1).tolist() for layer in range(4)]
    assert high == [[4, 4], [4, 4], [3, 3], [2, 2]]
    last = policy.choose(3, indices, scores, prefill=True)
    assert last.tolist() == [[2, 4, 2, 4], [4, 4, 2, 2]]  # the two best-scored slots of each token


def test_depth_low_bits_zero_skips_and_one_slot_stays_high():
    ctx = make_context(layers=3, top_k=2)
    policy = make_policy("depth", ctx, lam=0.0, low_bits=0)  # r(last) = 0
    indices, scores = routing([[0, 1], [2, 3], [4, 5]])
    last = policy.choose(2, indices, scores, prefill=False)
    assert last.tolist() == [[4, 0]] * 3
    for layer in range(3):
        assert ((policy.choose(layer, indices, scores, prefill=False) == 4).sum(dim=1) >= 1).all()


# ------------------------------------------------------------------------------------------ make_policy


def test_make_policy_names_and_errors():
    ctx = make_context(layers=1)
    assert POLICIES == ("static", "context", "online", "depth")
    assert all(make_policy(name, ctx).name == name for name in POLICIES)
    with pytest.raises(ValueError, match="static, context, online, depth"):
        make_policy("lru", ctx)
    with pytest.raises(ValueError, match=r"unknown option.*interval"):
        make_policy("static", ctx, interval=4)
    with pytest.raises(ValueError, match="high_bits=5"):
        make_policy("online", ctx, high_bits=5)
    with pytest.raises(ValueError, match="low_bits=4 is above"):
        make_policy("depth", ctx, high_bits=2, low_bits=4)
    with pytest.raises(ValueError, match="loss_table must have shape"):
        PolicyContext(ctx.allocation, ctx.loss_table[:, :, :2], ctx.skip_loss, TABLE_BITS, 3.0, 0.25, 2)


@pytest.mark.parametrize("row", [ROW, [8, 4, 4, 2, 2, 1, 1, 0], [3] * 8, [0] * 8])
def test_pack_stores_exactly_the_widths_each_policy_asks_for(row):
    """hexq pack --bank POLICY stores policy_widths (computed from the allocation alone); the runtime's policy with its
    defaults must ask for exactly those, or a run would miss a replica (or the artifact carry an unused one)."""
    context = make_context(allocation_row=row, avg_bits=max(1.0, sum(row) / len(row)))
    assert set(POLICIES) == set(policy_widths.POLICIES)
    for name in POLICIES:
        if name == "context" and not any(row):
            continue  # context needs a non-zero budget
        assert policy_widths.policy_widths(name, context.allocation, TABLE_BITS) == make_policy(name, context).widths()
