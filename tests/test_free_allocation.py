"""Any width per expert (allocate_free) against brute force, across layers (allocate_model) against the exact DP, and
`hexq pack` with pack.order free / pack.loss layer / pack.schedule model."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from hexq.algos.allocation import allocate_free, allocate_model, assignment_loss
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.inspect import summarize
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.config.recipe import Pack
from hexq.config.typed_config import RecipeError
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


@pytest.mark.parametrize("seed", range(4))
def test_model_allocation_is_within_a_hair_of_the_exact_optimum(seed):
    """allocate_model (Lagrangian + the upgrades the budget still holds) against allocate_free's exact DP over the
    same experts concatenated, on tables shaped like the loss tables (each bit ~4x less output error, an expert's
    scale and its routing mass spread over decades): within the budget, and its summed loss within 0.5% of the
    optimum (the reference models' tables: the same allocations as the DP). On tables far from convex in cost
    (uniform random, sorted) the relaxation's gap reaches ~1%."""
    g = torch.Generator().manual_seed(seed)
    bits, costs = [0, 1, 2, 3, 4, 8], [0, 1, 2, 3, 4, 8]
    shape = torch.tensor([1.5] + [4.0 ** -b for b in bits[1:]], dtype=torch.float64)  # 0 bits: the expert skipped

    def layer(scale: float) -> torch.Tensor:
        experts = 10.0 ** (2 * torch.rand(64, 1, generator=g, dtype=torch.float64))
        noise = 0.7 + 0.6 * torch.rand(64, len(bits), generator=g, dtype=torch.float64)
        return (scale * experts * shape * noise).cummin(dim=1).values  # more bits never lose more

    losses = [layer(3.0 ** index) for index in range(4)]  # each layer on its own scale (deeper outputs are larger)
    for budget in (4 * 64, 2 * 4 * 64, 3 * 4 * 64 - 5):
        got = allocate_model(losses, bits, costs, budget)
        flat = [b for row in got for b in row]
        assert [len(row) for row in got] == [64] * 4 and sum(flat) <= budget
        table = torch.cat(losses)
        exact = assignment_loss(table, bits, allocate_free(table, bits, costs, budget))
        assert exact <= assignment_loss(table, bits, flat) <= exact * 1.005
        assert sum(got[3]) > sum(got[0])  # the layer losing most at low width gets most of the budget
    with pytest.raises(ValueError, match="infeasible"):
        allocate_model([loss[:, 1:3] for loss in losses], [1, 2], [1, 2], 255)  # every expert at 1 bit: 256


def test_model_allocation_spends_what_the_relaxation_leaves():
    """Identical experts all change width at the same lam: the relaxation alone gives every one the narrow width
    (or overspends), and the upgrades after it fill the budget exactly as the DP does."""
    same = torch.tensor([[4.0, 1.0, 0.25]], dtype=torch.float64).expand(10, 3)
    got = allocate_model([same, same], [1, 2, 3], [1, 2, 3], 20 + 7)
    assert sorted(b for row in got for b in row) == [1] * 13 + [2] * 7


def test_model_schedule_spends_the_models_budget_where_the_tables_lose_most(mixed_calibration, tmp_path):
    """pack.schedule model: --bits is the model's average, met, and the summed table loss is no more than with the
    same average in every layer (that allocation is one the model-wide one could have made); without order free the
    recipe is refused in one line."""
    settings = Pack(widths=(0, 1, 2, 3, 4, 8), loss="layer", order="free")
    summed = {}
    for schedule in ("uniform", "model"):
        out = tmp_path / f"{schedule}.hexq"
        pack(mixed_calibration[0], out, replace(settings, schedule=schedule), Budget(avg_bits=2.0))
        allocation = Artifact(out).allocation
        stats = read_stats(mixed_calibration[0], list(range(len(allocation))), None)
        summed[schedule] = sum(assignment_loss(loss, settings.widths, row)
                               for loss, row in zip(table_losses(stats, [1, 2, 3, 4, 8], settings), allocation,
                                                    strict=True))
        assert sum(map(sum, allocation)) <= 2.0 * sum(map(len, allocation))
        assert summarize(out)["allocation"]["budget"] == {"uniform": "2.0 bits per layer",
                                                          "model": "2.0 bits over the model"}[schedule]
    assert summed["model"] <= summed["uniform"] * (1 + 1e-9)
    budget = Artifact(tmp_path / "uniform.hexq").manifest["accounting"]["allocated_expert_bytes"]
    by_bytes = pack(mixed_calibration[0], tmp_path / "bytes.hexq", replace(settings, schedule="model"),
                    Budget(total_bytes=budget))
    assert by_bytes.allocated_bytes <= budget
    with pytest.raises(RecipeError, match="needs order: free"):
        Pack(schedule="model")


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
