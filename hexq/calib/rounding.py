"""The rounding optimisation of a chunk's low-width replicas (hexq.algos.rounding) fed with the experts' routed
tokens: the calibration's side of `experts.round_bits`."""

from __future__ import annotations

import torch

from hexq.algos.rounding import Replica, optimize_rounding
from hexq.model.simulate import RoutedTokens
from hexq.packed.weight import PROJECTIONS


def routed_batch(routed: RoutedTokens, experts: list[int], limit: int,
                 weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `limit` routed tokens of each expert (evenly strided), padded with zero rows to one length:
    x [n, t, H] and mask [n, t], each token's weight in the objective: 1, or with `weighted` (experts.token_weights
    "routing") its squared routing weight over their mean (RoutedTokens.scales); 0 for padding."""
    picked = [routed.sampled_rows(expert, limit) for expert in experts]
    length = max([len(rows) for rows, _slots in picked] + [1])
    x = routed.x.new_zeros(len(experts), length, routed.x.shape[1])
    mask = routed.x.new_zeros(len(experts), length)
    for j, (rows, slots) in enumerate(picked):
        x[j, :len(rows)] = routed.x[rows]
        mask[j, :len(rows)] = routed.scales(rows, slots).square() if weighted else 1
    return x, mask


def round_replicas(replicas: dict, bits: int, routed: RoutedTokens, experts: list[int], positions: list[int],
                   gate_up: torch.Tensor, down: torch.Tensor, act_fn, setting) -> None:
    """Optimise the rounding of the `bits` replicas (both projections, replicas[projection][bits] = (codes, scale,
    zero) [chunk, ...]) of the chunk's experts at `positions` (`experts` their ids) on their routed tokens, weighted
    as the recipe's token_weights says (hexq.algos.rounding); the others keep GPTQ's rounding. Updates `replicas` in
    place."""
    if not experts:
        return
    x, mask = routed_batch(routed, experts, setting.round_tokens, setting.routing_weighted)
    index = torch.tensor(positions, device=gate_up.device)
    start = tuple(Replica(*(t[index] for t in replicas[p][bits])) for p in PROJECTIONS)
    rounded, _before, _after = optimize_rounding(x, mask, gate_up[index], down[index], act_fn, start, 2 ** bits - 1,
                                                 setting.round_steps)
    for projection, replica in zip(PROJECTIONS, rounded, strict=True):
        codes, scale, zero = replicas[projection][bits]
        codes[index], scale[index] = replica.codes.to(codes.device), replica.scale.to(scale.device)
