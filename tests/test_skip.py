"""0-bit experts: routing weights renormalised onto the kept experts (hexq.model.simulate.renormalized_weights), the
streamed experts' output with skipped experts, and the loss table's skip entry measured that way."""

from __future__ import annotations

import itertools

import pytest
import torch

from hexq.model.simulate import RoutedTokens, expert_output, renormalized_weights, routed_outputs, skipped_output
from tests.conftest import DEVICES

F64 = torch.float64
ACT = torch.nn.functional.silu


def test_renormalized_weights_against_a_loop():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(50, 4, generator=g, dtype=F64)
    kept = torch.rand(50, 4, generator=g) > 0.4
    got = renormalized_weights(weights, kept)
    for t, k in itertools.product(range(50), range(4)):
        mass = float(weights[t][kept[t]].sum())
        want = 0.0 if not kept[t, k] or mass == 0 else float(weights[t, k]) * float(weights[t].sum()) / mass
        assert abs(float(got[t, k]) - want) <= 1e-15 * max(1.0, abs(want)) * 4
    assert torch.allclose(got.sum(dim=1)[kept.any(dim=1)], weights.sum(dim=1)[kept.any(dim=1)], rtol=1e-12)
    assert torch.equal(got[~kept.any(dim=1)], torch.zeros_like(got[~kept.any(dim=1)]))


def routed_case(tokens: int = 40, experts: int = 5, k: int = 2, hidden: int = 8, inner: int = 6, seed: int = 0,
                device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=F64)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[3, 1] = experts  # a slot the family itself dropped (out-of-range id): its weight stays out
    weights = torch.softmax(torch.randn(tokens, k, generator=g, dtype=F64), dim=1)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g, dtype=F64) / hidden**0.5
    down = torch.randn(experts, hidden, inner, generator=g, dtype=F64) / inner**0.5
    routed = RoutedTokens.from_batches([(x.to(device), index.to(device), weights.to(device))], experts)
    return routed, gate_up.to(device), down.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_routed_outputs_skip_experts_with_renormalised_weights(device):
    routed, gate_up, down = routed_case(device=device)
    kept = torch.tensor([True, False, True, True, False], device=device)
    got = routed_outputs(routed, lambda ids: (gate_up[ids], down[ids]), ACT, None, None, chunk=2, kept=kept)
    want = torch.zeros_like(routed.x)
    for t in range(routed.x.shape[0]):
        slots = [(int(e), float(w)) for e, w in zip(routed.index[t], routed.weights[t], strict=True) if int(e) < 5]
        total = sum(w for _, w in slots)
        mass = sum(w for e, w in slots if kept[e])
        for e, w in slots:
            if kept[e]:
                want[t] += w * total / mass * expert_output(routed.x[t:t + 1], gate_up[e], down[e], ACT)[0]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)
    every = routed_outputs(routed, lambda ids: (gate_up[ids], down[ids]), ACT, None, None, chunk=2)
    assert torch.equal(every, routed_outputs(routed, lambda ids: (gate_up[ids], down[ids]), ACT, None, None, chunk=2,
                                             kept=torch.ones(5, dtype=torch.bool, device=device)))


def test_skip_entry_is_the_layer_output_change_of_skipping():
    """skipped_output stands in for an expert's output exactly as skipping it changes the layer's output: on every
    token routed to e, (output without e) - (output with all) = w_e * (skipped_output - y_e)."""
    routed, gate_up, down = routed_case()
    def weights_of(ids):
        return gate_up[ids], down[ids]

    every = routed_outputs(routed, weights_of, ACT, None, None, chunk=5)
    valid = (routed.index >= 0) & (routed.index < 5)
    slot_weights = routed.weights.masked_fill(~valid, 0)
    for e in range(5):
        token, slot = routed.rows(e)
        y = expert_output(routed.x[token], gate_up[e], down[e], ACT)
        stand_in = skipped_output(every, slot_weights.sum(dim=1), slot_weights, token, slot, y)
        kept = torch.ones(5, dtype=torch.bool)
        kept[e] = False
        without = routed_outputs(routed, weights_of, ACT, None, None, chunk=5, kept=kept)
        change = (without - every)[token]
        assert torch.allclose(change, slot_weights[token, slot, None] * (stand_in - y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scheme", ["1", "2", "3"])
def test_the_warm_start_loads_no_skipped_expert_and_the_most_used_last(skipping_artifact, scheme):
    """warm_order: never an expert stored at 0 bits, at most `slots` experts, least frequently routed first (so LRU
    evicts the least valuable first); more slots than stored experts give every stored one."""
    from hexq.artifact.format import STATS_SHARD
    from hexq.artifact.reader import Artifact
    from hexq.runtime.warm import warm_order

    artifact = Artifact(skipping_artifact)
    counts = artifact.tensor(STATS_SHARD, "router.counts").long()
    stored = {(row, e) for row, widths in enumerate(artifact.allocation) for e, bits in enumerate(widths) if bits}
    assert len(stored) < sum(len(widths) for widths in artifact.allocation)  # the fixture skips some
    layers = len(artifact.allocation)
    for slots in (2 * layers, 2 * layers + 3, len(stored) + 5):
        order = warm_order(artifact, scheme, slots)
        assert len(order) == len(set(order)) == min(slots, len(stored)) and set(order) <= stored
        used = [int(counts[row, e]) for row, e in order]
        assert used == sorted(used)
