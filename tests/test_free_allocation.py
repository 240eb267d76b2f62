"""Any width per expert (allocate_free) against brute force, and `hexq pack` with pack.order free / pack.loss layer."""

from __future__ import annotations

import itertools

import pytest
import torch

from hexq.algos.allocation import allocate_free, assignment_loss
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.config.recipe import Pack
from hexq.pack.stage import Budget, pack, read_stats, table_losses


def brute_force(loss: torch.Tensor, bits: list[int], costs: list[int], budget: int) -> float:
    return min(sum(float(loss[e, j]) for e, j in enumerate(choice))
               for choice in itertools.product(range(len(bits)), repeat=loss.shape[0])
               if sum(costs[j] for j in choice) <= budget)


@pytest.mark.parametrize("seed", range(6))
def test_free_allocation_is_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    bits, costs = [0, 1, 2, 4, 8], [0, 7, 12, 22, 42]  # bytes A b + O (A = 5, O = 2), skipping costs nothing
    for experts in (1, 3, 5):
        loss = torch.rand(experts, len(bits), generator=g, dtype=torch.float64)
        for budget in (0, 11, 30, 60, 200):
            got = allocate_free(loss, bits, costs, budget)
            assert sum(costs[bits.index(b)] for b in got) <= budget
            assert assignment_loss(loss, bits, got) == pytest.approx(brute_force(loss, bits, costs, budget), abs=1e-12)


def test_free_allocation_errors():
    loss = torch.rand(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="infeasible: the minimum is 6"):
        allocate_free(loss, [1, 2], [2, 3], 5)
    with pytest.raises(ValueError, match="strictly increasing"):
        allocate_free(loss, [1, 2], [3, 3], 10)


def test_a_rarely_routed_expert_pays_for_a_hot_one(mixed_calibration, tmp_path):
    """With the loss weighted by routing mass and any width per expert, the allocation at 2 bits on average gives
    the least routed expert of a layer fewer bits than the most routed one (the prefix split by importance would
    too; here nothing but the weighted losses decides), skips nothing it cannot afford, and meets the budget."""
    out = tmp_path / "free.hexq"
    pack(mixed_calibration[0], out, Pack(widths=(0, 1, 2, 3, 4, 8), loss="layer", order="free"), Budget(avg_bits=2.0))
    artifact = Artifact(out)
    mass = artifact.tensor(STATS_SHARD, "loss_table.mass")
    for layer, row in enumerate(artifact.allocation):
        assert sum(row) <= 2.0 * len(row)
        assert row[int(mass[layer].argmin())] <= row[int(mass[layer].argmax())]


def test_layer_loss_needs_the_routing_mass(mixed_calibration):
    """Statistics of a calibration made before loss_table.mass existed pack with the per-expert loss and are refused
    with the layer loss, naming what to do."""
    stats = read_stats(mixed_calibration[0], [0, 1], None)
    assert "loss_table.mass" in stats
    layer = table_losses(stats, [1, 2, 3, 4, 8], Pack(widths=(0, 1, 2), avg_bits=1.5, loss="layer"))
    expert = table_losses(stats, [1, 2, 3, 4, 8], Pack(widths=(0, 1, 2), avg_bits=1.5))
    assert torch.allclose(layer[1], expert[1] * stats["loss_table.mass"][1].double()[:, None])
    del stats["loss_table.mass"]
    assert len(table_losses(stats, [1, 2, 3, 4, 8], Pack())) == 2
    with pytest.raises(HexqError, match="calibrate again"):
        table_losses(stats, [1, 2, 3, 4, 8], Pack(loss="layer"))
