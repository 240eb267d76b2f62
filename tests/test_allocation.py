"""Bit allocation against brute force over all prefix-structured assignments (seeded random loss tables)."""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch

from hexq.algos.allocation import (
    allocate,
    allocate_avg_bits,
    assignment_loss,
    average_bits,
    avg_bit_budget,
    cosine_retention,
    layer_budgets,
)
from tests.allocation_reference import prefix_split

from reference import shuffled_like

BIT_SETS = [(1, 2, 3, 4), (1, 2, 3, 4, 8), (0, 2, 4), (0, 1, 2, 3, 4, 8), (0, 4, 8), (2,), (0, 8)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _table(E: int, K: int, g: torch.Generator, monotone: bool) -> torch.Tensor:
    """Random loss [E, K]; with monotone=True each row is non-increasing in the width."""
    loss = torch.rand(E, K, generator=g, dtype=torch.float64) * torch.rand(E, 1, generator=g, dtype=torch.float64)
    return loss.sort(dim=1, descending=True).values if monotone else loss


def _byte_costs(bits: tuple[int, ...], per_bit: int, overhead: int) -> list[int]:
    """Bytes of one expert: packed codes (per_bit bytes per bit) plus scales/zeros; a skipped expert costs 0."""
    return [per_bit * b + overhead if b > 0 else 0 for b in bits]


def _cost(assignment: list[int], bits: tuple[int, ...], costs: list[int]) -> int:
    return sum(costs[bits.index(b)] for b in assignment)


def _brute_force(loss: torch.Tensor, bits: tuple[int, ...], order: list[int], costs: list[int], budget: int) -> float:
    """Minimum loss over every non-increasing level sequence along `order` that fits the budget."""
    E, K = loss.shape
    best = math.inf
    for multiset in itertools.combinations_with_replacement(range(K), E):
        levels = sorted(multiset, reverse=True)
        if sum(costs[k] for k in levels) <= budget:
            best = min(best, sum(float(loss[order[r], levels[r]]) for r in range(E)))
    return best


def _python_work(fn) -> int:
    """Python lines executed plus calls made (Python and C) while fn runs: a count of the interpreter's work that
    no clock or machine changes. A loop over experts x widths shows in it; work inside one torch call does not."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1
        return trace

    def profile(frame, event, arg):
        nonlocal count
        count += event == "c_call"

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return count


def _is_prefix_structured(assignment: list[int], order: list[int]) -> bool:
    ranked = [assignment[e] for e in order]
    return all(a >= b for a, b in zip(ranked, ranked[1:], strict=False))


@pytest.mark.parametrize("monotone", [True, False])
def test_allocate_matches_brute_force(monotone: bool) -> None:
    g = _gen(1 if monotone else 2)
    for trial in range(60):
        bits = BIT_SETS[trial % len(BIT_SETS)]
        E = int(torch.randint(1, 9, (1,), generator=g))
        loss = _table(E, len(bits), g, monotone)
        order = torch.randperm(E, generator=g).tolist()
        if trial % 2:
            costs = list(bits)
        else:
            costs = _byte_costs(bits, per_bit=int(torch.randint(1, 40, (1,), generator=g)),
                                overhead=int(torch.randint(0, 30, (1,), generator=g)))
        lo, hi = E * costs[0], E * costs[-1]
        budget = int(torch.randint(lo, hi + 3, (1,), generator=g))
        got = allocate(loss, bits, order, costs, budget)
        assert _cost(got, bits, costs) <= budget
        assert _is_prefix_structured(got, order)
        assert assignment_loss(loss, bits, got) == pytest.approx(_brute_force(loss, bits, order, costs, budget),
                                                                 rel=1e-9, abs=1e-12)


def test_prefix_split_equals_allocate_on_monotone_tables() -> None:
    g = _gen(3)
    bits = (1, 2, 3, 4)
    for trial in range(80):
        E = int(torch.randint(1, 9, (1,), generator=g))
        loss = _table(E, 4, g, monotone=True)
        order = torch.randperm(E, generator=g).tolist()
        avg = 1 + 3.5 * float(torch.rand(1, generator=g))
        got = prefix_split(loss, order, avg)
        assert sum(got) <= avg_bit_budget(avg, E)
        assert _is_prefix_structured(got, order)
        exact = allocate_avg_bits(loss, bits, order, avg)
        assert assignment_loss(loss, bits, got) == pytest.approx(assignment_loss(loss, bits, exact), rel=1e-9,
                                                                 abs=1e-12)
        if E <= 6 and trial % 4 == 0:
            budget = avg_bit_budget(avg, E)
            assert assignment_loss(loss, bits, got) == pytest.approx(
                _brute_force(loss, bits, order, list(bits), budget), rel=1e-9, abs=1e-12)


def test_prefix_split_example_and_rounding() -> None:
    # Expert 2 is the most important, then 0, then 1; 2.34 * 3 = 7.02 -> 7 bits.
    loss = torch.tensor([[4.0, 2.0, 1.0, 0.5], [4.0, 2.0, 1.0, 0.5], [4.0, 2.0, 1.0, 0.5]])
    got = prefix_split(loss, [2, 0, 1], 2.34)
    assert sum(got) == 7 and got[2] >= got[0] >= got[1]
    assert avg_bit_budget(2.3, 10) == 23  # 2.3 * 10 = 22.999999999999996 in floating point
    assert prefix_split(loss, [0, 1, 2], 1.0) == [1, 1, 1]
    assert prefix_split(loss, [0, 1, 2], 9.0) == [4, 4, 4]


def test_infeasible_budgets_name_the_minimum() -> None:
    loss = torch.rand(5, 4, generator=_gen(4))
    with pytest.raises(ValueError, match=r"minimum is avg_bits=1 \(5 bits"):
        prefix_split(loss, range(5), 0.8)
    with pytest.raises(ValueError, match="minimum is 5"):
        allocate_avg_bits(loss, (1, 2, 3, 4), range(5), 0.9)
    costs = _byte_costs((1, 2, 3, 4), per_bit=100, overhead=7)
    with pytest.raises(ValueError, match="minimum is 535"):
        allocate(loss, (1, 2, 3, 4), range(5), costs, 534)
    assert allocate(loss, (1, 2, 3, 4), range(5), costs, 535) == [1] * 5
    # With a skip level nothing is infeasible: budget 0 skips every expert.
    assert allocate(torch.rand(5, 3, generator=_gen(5)), (0, 2, 4), range(5), [0, 2, 4], 0) == [0] * 5


def test_bad_inputs_raise() -> None:
    loss = torch.rand(3, 3, generator=_gen(6))
    with pytest.raises(ValueError, match="permutation"):
        allocate(loss, (0, 2, 4), [0, 0, 1], [0, 2, 4], 6)
    with pytest.raises(ValueError, match="strictly ascending"):
        allocate(loss, (0, 4, 2), [0, 1, 2], [0, 4, 2], 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        allocate(loss, (0, 2, 4), [0, 1, 2], [0, 2, 2], 6)
    with pytest.raises(ValueError, match="shape"):
        allocate(loss, (1, 2, 3, 4), [0, 1, 2], [1, 2, 3, 4], 6)
    with pytest.raises(ValueError, match="NaN"):
        allocate(loss.clone().fill_(math.nan), (0, 2, 4), [0, 1, 2], [0, 2, 4], 6)


def test_budget_respected_and_monotone_with_skip_and_8bit_byte_costs() -> None:
    g = _gen(7)
    for trial in range(20):
        bits = ((0, 1, 2, 3, 4, 8), (0, 2, 4, 8), (1, 2, 3, 4, 8))[trial % 3]
        E = int(torch.randint(4, 40, (1,), generator=g))
        loss = _table(E, len(bits), g, monotone=trial % 2 == 0)
        order = torch.randperm(E, generator=g).tolist()
        costs = _byte_costs(bits, per_bit=int(torch.randint(50, 5000, (1,), generator=g)),
                            overhead=int(torch.randint(0, 999, (1,), generator=g)))
        prev = math.inf
        for budget in torch.linspace(E * costs[0], E * costs[-1] + 10, 25).long().tolist():
            got = allocate(loss, bits, order, costs, budget)
            assert _cost(got, bits, costs) <= budget
            assert _is_prefix_structured(got, order)
            value = assignment_loss(loss, bits, got)
            assert value <= prev + 1e-12
            prev = value


def _large_layer(E: int = 128):
    """E experts, widths 0-8, real byte costs: a 4096 x 14336 expert's packed codes plus a scales/zeros overhead
    that is not a multiple of them."""
    g = _gen(8)
    bits = (0, 1, 2, 3, 4, 8)
    loss = _table(E, len(bits), g, monotone=True)
    order = torch.randperm(E, generator=g).tolist()
    per_bit, overhead = 4096 * 14336 // 8, 4096 * 14336 // 64 + 12345
    costs = _byte_costs(bits, per_bit, overhead)
    return loss, bits, order, costs, int(E * (2.5 * per_bit + overhead))


def test_large_layer_within_its_budget() -> None:
    loss, bits, order, costs, budget = _large_layer()
    got = allocate(loss, bits, order, costs, budget)
    assert _cost(got, bits, costs) <= budget and sum(allocate_avg_bits(loss, bits, order, 2.5)) <= 320
    assert _is_prefix_structured(got, order)


def test_allocation_work_grows_no_faster_than_the_experts() -> None:
    """8x the experts, at most ~8x the interpreter's work (measured 7.4x): no loop over experts x widths or
    experts x experts in Python, whatever the machine's speed (a wall-clock limit here depended on it)."""
    def by_bytes(loss, bits, order, costs, budget):
        return allocate(loss, bits, order, costs, budget)

    def by_average(loss, bits, order, costs, budget):
        return allocate_avg_bits(loss, bits, order, 2.5)

    for allocator in (by_bytes, by_average):
        small, large = (_python_work(functools.partial(allocator, *_large_layer(E))) for E in (128, 1024))
        assert large <= 9 * small, (allocator.__name__, small, large)


def test_shuffled_like_keeps_histogram_and_is_seeded() -> None:
    assignment = [4] * 3 + [3] * 5 + [2] * 8 + [0] * 4
    a, b = shuffled_like(assignment, seed=0), shuffled_like(assignment, seed=0)
    assert a == b and sorted(a) == sorted(assignment) and a != assignment
    assert shuffled_like(assignment, seed=1) != a
    assert average_bits(a) == average_bits(assignment) == pytest.approx((12 + 15 + 16) / 20)
    with pytest.raises(ValueError, match="empty"):
        average_bits([])


def test_cosine_retention() -> None:
    for L in (2, 3, 24, 48):
        for lam in (0.0, 0.5, 0.75, 1.0):
            r = cosine_retention(L, lam)
            assert len(r) == L and r[0] == pytest.approx(1.0) and r[-1] == pytest.approx(lam)
            assert all(x >= y - 1e-12 for x, y in zip(r, r[1:], strict=False))
    assert cosine_retention(1, 0.3) == [1.0]
    assert cosine_retention(3, 0.5)[1] == pytest.approx(0.75)
    with pytest.raises(ValueError):
        cosine_retention(4, 1.5)


def test_layer_budgets() -> None:
    g = _gen(9)
    for _ in range(200):
        L = int(torch.randint(1, 12, (1,), generator=g))
        weights = (torch.rand(L, generator=g) + 0.01).tolist()
        total = int(torch.randint(0, 10_000, (1,), generator=g))
        shares = layer_budgets(total, weights)
        assert sum(shares) == total and min(shares) >= 0
        mins = torch.randint(0, 300, (L,), generator=g).tolist()
        if total < sum(mins):
            with pytest.raises(ValueError, match=f"minimum total that fits every layer is {sum(mins)}"):
                layer_budgets(total, weights, mins)
        else:
            shares = layer_budgets(total, weights, mins)
            assert sum(shares) <= total and all(s >= m for s, m in zip(shares, mins, strict=True))
    assert layer_budgets(10, [1, 1, 1]) == [4, 3, 3]
    assert layer_budgets(100, cosine_retention(3, 0.0)) == [67, 33, 0]
    assert layer_budgets(100, cosine_retention(3, 0.0), [10, 10, 10]) == [60, 30, 10]
    assert layer_budgets(5, [0, 1], [3, 0]) == [3, 2]


def test_costs_without_common_step_are_refused_not_exhausting_memory() -> None:
    loss = torch.rand(200, 4, generator=_gen(10))
    with pytest.raises(ValueError, match="common divisor"):
        allocate(loss, (0, 1, 2, 4), range(200), [0, 1, 100_000, 200_001], 10**9)
