"""Paper 002's own bitwidth selector for widths {1, 2, 3, 4} (§4.2), written as the paper gives it: the reference
hexq.algos.allocation.allocate (exact for any table and bit set) is checked against on monotone tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hexq.algos.allocation import _ranked_table, _to_experts, avg_bit_budget


def prefix_split(loss: torch.Tensor, order: Sequence[int] | torch.Tensor, avg_bits: float) -> list[int]:
    """Paper 002 §4.2 bitwidth selector for widths {1, 2, 3, 4}: returns the width of each expert (by id).

    loss [E, 4] holds L_i(b) for b = 1, 2, 3, 4. Every expert starts at 1 bit; the increment budget is
    R = floor(avg_bits * E) - E (see `avg_bit_budget`). With gains Delta_i(b) = L_i(1) - L_i(b) and their prefix
    sums C_b(k) over the importance order, (n_4, n_3) are enumerated (3 n_4 + 2 n_3 <= R), n_2 takes what the
    budget allows, min(R - 3 n_4 - 2 n_3, E - n_4 - n_3), and the gain

        G = C_4(n_4) + [C_3(n_4+n_3) - C_3(n_4)] + [C_2(n_4+n_3+n_2) - C_2(n_4+n_3)]

    is maximised; O(E^2) per layer. Taking n_2 as large as possible is optimal when the loss is non-increasing in
    the width; `allocate` is exact for any table and any bit set.
    """
    table, bits, ids = _ranked_table(loss, (1, 2, 3, 4), order)
    E = table.shape[0]
    if avg_bits < 1:
        raise ValueError(f"avg_bits={avg_bits} is infeasible: every expert gets at least 1 bit, so the minimum "
                         f"is avg_bits=1 ({E} bits for {E} experts)")
    R = avg_bit_budget(avg_bits, E) - E
    zero = torch.zeros(1, 3, dtype=torch.float64, device=table.device)
    C = torch.cat([zero, torch.cumsum(table[:, :1] - table[:, 1:], dim=0)]).T.tolist()  # C[b-2][k] = C_b(k)
    C2, C3, C4 = C
    best, best_n = -math.inf, (0, 0, 0)
    for n4 in range(min(E, R // 3) + 1):
        for n3 in range(min(E - n4, (R - 3 * n4) // 2) + 1):
            n2 = min(R - 3 * n4 - 2 * n3, E - n4 - n3)
            top = n4 + n3
            gain = C4[n4] + (C3[top] - C3[n4]) + (C2[top + n2] - C2[top])
            if gain > best:
                best, best_n = gain, (n4, n3, n2)
    n4, n3, n2 = best_n
    levels = [3] * n4 + [2] * n3 + [1] * n2 + [0] * (E - n4 - n3 - n2)
    return _to_experts(levels, bits, ids)
