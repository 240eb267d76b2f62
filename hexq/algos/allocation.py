"""Mixed-precision bit allocation for the experts of one layer, and budget splitting across layers.

Inputs (one layer): a loss table `loss` [E, K] with loss[e, j] = output MSE of expert e's replica at `bits[j]`,
an ascending bit set `bits` (0 means "skip the expert": its column holds the loss of dropping the expert, paper 004
§4.3 "0-bit = skipping"), and an importance order (expert ids, most important first). An assignment is returned as
a list of widths indexed by expert id.

A *prefix-structured* assignment (paper 002 §4.2) never raises the width while walking the experts in importance
order: the most important experts get the highest width, the next ones the next width, and so on. With ranks
i = 1..E in importance order, it is fully described by m_k = #experts at level >= k (k = 1..K-1), a chain
E >= m_1 >= m_2 >= ... >= m_{K-1} >= 0, and (increment form of 002 eq. "3 n_4 + 2 n_3 + n_2 = R")

    cost(m) = E c_0 + sum_k m_k (c_k - c_{k-1})
    loss(m) = sum_i L_i(0) + sum_k D_k(m_k),   D_k(m) = sum_{i<=m} [L_i(k) - L_i(k-1)]   (prefix sums, 002 C_b)

Budget conventions: per-level costs are integers per expert (the width for average-bit budgets, the bytes of one
expert for byte budgets) and a budget is an integer total that is never exceeded. An average-bit budget b on E
experts is floor(b * E) bits (`avg_bit_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Slack for floor(avg_bits * E): 2.3 * 10 is 22.999999999999996 in binary floating point but means 23 bits.
_FLOOR_SLACK = 1e-9
# Largest DP table `allocate` builds ((E+1) x (units+1) cells per level); realistic byte costs stay far below it.
_MAX_DP_CELLS = 10_000_000


def avg_bit_budget(avg_bits: float, num_experts: int) -> int:
    """Total bits allowed for `num_experts` experts at average `avg_bits`: floor(avg_bits * E) (+1e-9 slack)."""
    if not math.isfinite(avg_bits) or avg_bits < 0:
        raise ValueError(f"avg_bits must be a finite number >= 0, got {avg_bits}")
    return math.floor(avg_bits * num_experts + _FLOOR_SLACK)


def _check_order(order: Sequence[int] | torch.Tensor, num_experts: int) -> list[int]:
    ids = [int(i) for i in order]
    if sorted(ids) != list(range(num_experts)):
        raise ValueError(f"order must be a permutation of the {num_experts} expert ids 0..{num_experts - 1}, "
                         f"got {ids[:8]}{'...' if len(ids) > 8 else ''} (length {len(ids)})")
    return ids


def _ranked_table(loss: torch.Tensor, bits: Sequence[int], order: Sequence[int] | torch.Tensor
                  ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Validated loss table with rows in importance order (float64), the bit set and the order as lists."""
    bits = [int(b) for b in bits]
    if not bits or any(b < 0 for b in bits) or any(b1 >= b2 for b1, b2 in zip(bits, bits[1:], strict=False)):
        raise ValueError(f"bits must be non-empty, >= 0 and strictly ascending, got {bits}")
    if loss.ndim != 2 or loss.shape[1] != len(bits):
        raise ValueError(f"loss must have shape [E, {len(bits)}] (one column per width in {bits}), "
                         f"got {tuple(loss.shape)}")
    table = loss.detach().to(torch.float64).cpu()
    if not torch.isfinite(table).all():
        raise ValueError("loss contains NaN or inf; every (expert, width) entry must be a measured finite loss")
    ids = _check_order(order, table.shape[0])
    return table[ids], bits, ids


def _checked_costs(costs: Sequence[int], bits: Sequence[int], experts: int, budget: int) -> tuple[list[int], int]:
    """(costs, budget) as integers, after checking one cost >= 0 per width, strictly increasing, and a budget no
    smaller than every expert at the lowest width (the error names that minimum)."""
    costs = [int(c) for c in costs]
    if len(costs) != len(bits) or costs[0] < 0 or any(c1 >= c2 for c1, c2 in zip(costs, costs[1:], strict=False)):
        raise ValueError(f"costs must give one integer >= 0 per width in {bits}, strictly increasing; got {costs}")
    budget = int(budget)
    if budget < experts * costs[0]:
        raise ValueError(f"budget {budget} is infeasible: the minimum is {experts * costs[0]} "
                         f"({experts} experts at {bits[0]} bits, {costs[0]} each)")
    return costs, budget


def _to_experts(levels: Sequence[int], bits: Sequence[int], order: Sequence[int]) -> list[int]:
    """Widths by expert id from levels by importance rank."""
    out = [0] * len(order)
    for rank, expert in enumerate(order):
        out[expert] = bits[levels[rank]]
    return out


def allocate(loss: torch.Tensor, bits: Sequence[int], order: Sequence[int] | torch.Tensor,
             costs: Sequence[int], budget: int) -> list[int]:
    """Exact minimum-loss prefix-structured assignment with sum of per-expert costs <= budget; widths by expert id.

    costs[j] is the integer cost of one expert at bits[j], strictly increasing (bytes: A * b + O for b >= 1 and 0
    for b = 0; average bits: the width itself, see `allocate_avg_bits`). budget is an integer total; if it is below
    E * costs[0] (every expert at the lowest width) a ValueError names that minimum.

    Method (module docstring, increment form): the first step c_1 - c_0 may carry a fixed overhead (skip -> first
    width costs O + A b_1), so m_1 is enumerated explicitly; the other steps are divided by their gcd g (A times a
    bit difference for byte costs) and a DP over (m, units) solves the chain m_{K-1} <= ... <= m_2 <= m_1:

        G_k[m, u] = min_{m' <= m} D_k(m') + G_{k+1}[m', u - m' w_k],   G_K = 0,   w_k = (c_k - c_{k-1}) / g

    (a running minimum over m'). The answer is min over m_1 of D_1(m_1) + G_2[m_1, floor(rest(m_1) / g)].
    Time and memory are O(K E U) with U <= E (b_max - b_1) for width-proportional costs (E = 128, 6 levels: ~1e5
    cells per level).
    """
    table, bits, ids = _ranked_table(loss, bits, order)
    E, K = table.shape
    costs, budget = _checked_costs(costs, bits, E, budget)
    minimum = E * costs[0]
    if K == 1 or E == 0:
        return _to_experts([0] * E, bits, ids)

    D = torch.cat([torch.zeros(1, K - 1, dtype=torch.float64, device=table.device),
                   torch.cumsum(table[:, 1:] - table[:, :-1], dim=0)])  # D[m, k-1] = D_k(m)
    steps = [c2 - c1 for c1, c2 in zip(costs, costs[1:], strict=False)]
    g = math.gcd(*steps[1:]) if K > 2 else 1
    w = [s // g for s in steps[1:]]
    # Levels >= 2 need m_1 >= 1, which leaves at most budget - minimum - steps[0]; units beyond that, or beyond all
    # experts at the top width, cannot change the optimum.
    units = max(min(E * sum(w), (budget - minimum - steps[0]) // g), 0) if K > 2 else 0
    if (E + 1) * (units + 1) > _MAX_DP_CELLS:
        raise ValueError(f"costs {costs} need a DP over {units + 1} budget units; costs above the lowest width "
                         "should share a large common divisor (bytes A * b + O do: A times the bit step)")

    m = torch.arange(E + 1, device=table.device)
    u = torch.arange(units + 1, device=table.device)
    G = torch.zeros(E + 1, units + 1, dtype=torch.float64, device=table.device)
    choice: dict[int, torch.Tensor] = {}
    for k in range(K - 1, 1, -1):
        src = u[None, :] - m[:, None] * w[k - 2]
        H = torch.where(src >= 0, G.gather(1, src.clamp(min=0)), math.inf) + D[:, k - 1, None]
        G, choice[k] = torch.cummin(H, dim=0)

    rest = budget - minimum - m * steps[0]
    total = D[:, 0] + G[m, (rest.clamp(min=0) // g).clamp(max=units)]
    total[rest < 0] = math.inf
    m_k = [int(torch.argmin(total))]
    left = min((budget - minimum - m_k[0] * steps[0]) // g, units)
    for k in range(2, K):
        m_k.append(int(choice[k][m_k[-1], left]))
        left -= m_k[-1] * w[k - 2]
    levels = [sum(rank < mk for mk in m_k) for rank in range(E)]
    return _to_experts(levels, bits, ids)


def allocate_free(loss: torch.Tensor, bits: Sequence[int], costs: Sequence[int], budget: int) -> list[int]:
    """Exact minimum-loss assignment with any width per expert (no importance order): the multiple-choice knapsack
    min sum_e loss[e, j_e] subject to sum_e costs[j_e] <= budget; widths by expert id.

    Where the loss table weighs each expert by how much of the layer's output it carries (pack.loss "layer"), a
    rarely routed expert's bytes can pay for a hot expert's width whatever their importance ranks, which the
    prefix structure of `allocate` forbids. Costs and budget are integers as in `allocate`, divided by their gcd;
    a DP over (expert, budget units), G_e[u] = min_j G_{e-1}[u - w_j] + loss[e, j] with G_0 = 0 ("at most u units"),
    then one backward pass over the recorded choices. O(E U K) time, O(E U) bytes of choices.
    """
    table, bits, ids = _ranked_table(loss, bits, range(loss.shape[0]))
    E = table.shape[0]
    costs, budget = _checked_costs(costs, bits, E, budget)
    g = math.gcd(*costs) if any(costs) else 1
    w = [c // g for c in costs]
    units = min(budget // g, E * w[-1])  # beyond every expert at the widest width nothing changes
    if (E + 1) * (units + 1) > _MAX_DP_CELLS:
        raise ValueError(f"costs {costs} need a DP over {units + 1} budget units; costs should share a large common "
                         "divisor (bytes A * b + O do when A and O do)")
    # G padded with w[-1] infeasible cells in front, so G[u - w_j] is one gather for every width: source[j, u]
    source = torch.arange(units + 1, device=table.device)[None, :] - torch.tensor(w, device=table.device)[:, None]
    source += w[-1]
    padded = torch.full((w[-1] + units + 1,), math.inf, dtype=torch.float64, device=table.device)
    padded[w[-1]:] = 0.0
    choices = torch.empty(E, units + 1, dtype=torch.long, device=table.device)
    for e in range(E):
        G, choices[e] = (padded[source] + table[e, :, None]).min(dim=0)
        padded[w[-1]:] = G
    left, levels = units, [0] * E
    for e in range(E - 1, -1, -1):
        levels[e] = int(choices[e, left])
        left -= w[levels[e]]
    return [bits[j] for j in levels]


def allocate_model(losses: Sequence[torch.Tensor], bits: Sequence[int], costs: Sequence[int],
                   budget: int) -> list[list[int]]:
    """Any width per expert over every layer at once (pack.schedule "model"): min sum_l sum_e loss_l[e, j] subject to
    one budget for all of them, so a layer whose table says its experts lose more at low width takes bytes from one
    that loses less. Widths [L][E] by expert id.

    A model has too many experts x budget units for `allocate_free`'s DP (Qwen3-30B-A3B: 6144 experts, 12,288 units
    at 2 bits), so: the Lagrangian relaxation min_j loss[e, j] + lam * costs[j] per expert, lam bisected to the
    smallest that fits the budget (each such choice is optimal for what it spends), then the experts whose choice
    changes just below that lam upgraded, best loss saved per byte first, as many as the budget left holds."""
    tables = [_ranked_table(loss, bits, range(loss.shape[0]))[0] for loss in losses]
    table = torch.cat(tables)
    costs, budget = _checked_costs(costs, list(bits), table.shape[0], budget)
    cost = torch.tensor(costs, dtype=torch.float64)

    def pick(lam: float) -> torch.Tensor:
        return (table + lam * cost).argmin(dim=1)

    def spend(choice: torch.Tensor) -> float:
        return float(cost[choice].sum())

    low, high = 0.0, 1.0
    while spend(pick(high)) > budget:  # at a large enough lam every expert takes its cheapest width, which fits
        low, high = high, high * 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if spend(pick(middle)) <= budget else (middle, high)
    choice, richer = pick(high), pick(low)
    left = budget - spend(choice)
    rows = torch.arange(table.shape[0])
    extra = cost[richer] - cost[choice]
    saved = table[rows, choice] - table[rows, richer]
    upgrades = (extra > 0).nonzero().squeeze(1)
    upgrades = upgrades[torch.argsort(-(saved[upgrades] / extra[upgrades]), stable=True)]
    taken = upgrades[torch.cumsum(extra[upgrades], 0) <= left]
    choice[taken] = richer[taken]
    return [[int(bits[j]) for j in layer.tolist()] for layer in choice.split([t.shape[0] for t in tables])]


def allocate_avg_bits(loss: torch.Tensor, bits: Sequence[int], order: Sequence[int] | torch.Tensor,
                      avg_bits: float) -> list[int]:
    """`allocate` with cost = width and budget floor(avg_bits * E) bits (0 bits = skipped expert, costs nothing)."""
    return allocate(loss, bits, order, costs=list(bits), budget=avg_bit_budget(avg_bits, loss.shape[0]))


def loss_columns(loss_table: torch.Tensor, skip_loss: torch.Tensor, table_bits: Sequence[int],
                 bits: Sequence[int]) -> torch.Tensor:
    """One layer's loss table [E, len(table_bits)] restricted to `bits`, float64 [E, len(bits)]; width 0 takes
    skip_loss [E], the loss of skipping the expert (the calibration's loss_table.skip)."""
    table_bits = list(table_bits)
    columns = [skip_loss if b == 0 else loss_table[:, table_bits.index(b)] for b in bits]
    return torch.stack(columns, dim=1).double()


def assignment_loss(loss: torch.Tensor, bits: Sequence[int], assignment: Sequence[int]) -> float:
    """Summed table loss of an assignment (widths by expert id): sum_e loss[e, bits.index(assignment[e])]."""
    bits = [int(b) for b in bits]
    if len(assignment) != loss.shape[0] or any(int(b) not in bits for b in assignment):
        raise ValueError(f"assignment must give one width from {bits} per expert ({loss.shape[0]}), got {assignment}")
    cols = torch.tensor([bits.index(int(b)) for b in assignment], dtype=torch.long, device=loss.device)
    return float(loss.to(torch.float64).gather(1, cols[:, None]).sum())


def average_bits(assignment: Sequence[int]) -> float:
    """Mean width of an assignment (skipped experts count as 0 bits)."""
    if len(assignment) == 0:
        raise ValueError("assignment is empty; there is no average width")
    return sum(int(b) for b in assignment) / len(assignment)


def cosine_retention(num_layers: int, lam: float) -> list[float]:
    """Paper 004 eq. 4: r(l) = (1 - lam) (cos(pi l / (L-1)) + 1) / 2 + lam for l = 0..L-1; r(0) = 1, r(L-1) = lam.

    Early layers keep more (they are the sensitive ones); a single layer gets r = 1.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if num_layers == 1:
        return [1.0]
    return [(1 - lam) * (math.cos(math.pi * layer / (num_layers - 1)) + 1) / 2 + lam
            for layer in range(num_layers)]


def _split(total: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder rounding of total * w / sum(w): sums to exactly total (ties go to the earlier layer)."""
    wsum = math.fsum(weights)
    exact = [total * w / wsum for w in weights]
    shares = [math.floor(x) for x in exact]
    extra = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[:max(extra, 0)]:
        shares[i] += 1
    return shares


def layer_budgets(total_budget: int, weights: Sequence[float], minimums: Sequence[int] | None = None) -> list[int]:
    """Split one whole-model integer budget across layers in proportion to `weights` (all ones = uniform).

    Shares are rounded by largest remainder, so they sum to exactly total_budget. `minimums` (e.g. E * costs[0]
    per layer) are the smallest feasible layer budgets: a layer whose share falls below its minimum gets exactly
    the minimum and the rest is re-split among the other layers, repeated until all fit; the sum then stays
    <= total_budget. If total_budget < sum(minimums) no split fits and a ValueError names that minimum total.
    """
    weights = [float(w) for w in weights]
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or math.fsum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0, non-empty and not all zero; got {weights}")
    mins = [0] * len(weights) if minimums is None else [int(x) for x in minimums]
    if len(mins) != len(weights):
        raise ValueError(f"minimums has {len(mins)} entries for {len(weights)} layers")
    total_budget = int(total_budget)
    if total_budget < sum(mins):
        raise ValueError(f"total budget {total_budget} is infeasible: the minimum total that fits every layer is "
                         f"{sum(mins)}")
    pinned: set[int] = set()
    while True:
        free = [i for i in range(len(weights)) if i not in pinned]
        rest = total_budget - sum(mins[i] for i in pinned)
        if not free or math.fsum(weights[i] for i in free) <= 0:
            # Only zero-weight layers are left: they get their minimum, the remainder is left unspent.
            shares = {i: 0 for i in free}
        else:
            shares = dict(zip(free, _split(rest, [weights[i] for i in free]), strict=True))
        short = [i for i in free if shares[i] < mins[i]]
        if not short:
            return [mins[i] if i in pinned else max(shares[i], mins[i]) for i in range(len(weights))]
        pinned.update(short)
