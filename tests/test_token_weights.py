"""experts.token_weights "routing": each routed token weighs in its expert's Hessians, down fit and loss table by its
squared routing weight (hexq.model.simulate.RoutedTokens.scales)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hexq.calib import capture, down_fit, loss_table
from hexq.config.recipe import Experts, RecipeError
from hexq.model.simulate import RoutedTokens, expert_intermediate, expert_output, loss_sample

HIDDEN, INNER, EXPERTS, TOP_K = 12, 6, 4, 2
act_fn = torch.nn.functional.silu


def routed_tokens(tokens: int = 40, seed: int = 0) -> RoutedTokens:
    """Random inputs routed to TOP_K of EXPERTS experts each, with routing weights spread over (0.05, 1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = 0.05 + 0.95 * torch.rand(tokens, TOP_K, generator=generator)
    return RoutedTokens.from_batches([(x, index, weights)], EXPERTS)


def expert_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=generator),
            torch.randn(EXPERTS, HIDDEN, INNER, generator=generator))


def test_scales_are_the_routing_weights_over_their_root_mean_square():
    routed = routed_tokens()
    token, slot = routed.rows(2)
    scales = routed.scales(token, slot)
    weights = routed.weights[token, slot]
    assert torch.allclose(scales / weights, torch.full_like(scales, float(scales[0] / weights[0])))
    assert float(scales.square().mean()) == pytest.approx(1.0, rel=1e-6)
    zero = RoutedTokens.from_batches([(routed.x, routed.index, torch.zeros_like(routed.weights))], EXPERTS)
    assert torch.equal(zero.scales(token, slot), torch.ones(len(token)))  # no signal: every token alike


@pytest.mark.parametrize("weighted", [False, True])
def test_expert_hessians_weigh_each_token_by_its_squared_routing_weight(monkeypatch, weighted):
    """Against the sums written out, with token chunks of 3 rows so that the scales must follow the chunks."""
    monkeypatch.setattr(capture, "TOKEN_CHUNK", 3)
    routed, (gate_up, _down) = routed_tokens(), expert_weights()
    experts = [1, 3]
    stats = capture.expert_statistics(routed, experts, gate_up[experts], act_fn, weighted)
    plain = capture.expert_statistics(routed, experts, gate_up[experts], act_fn)
    for j, expert in enumerate(experts):
        token, slot = routed.rows(expert)
        weight = routed.scales(token, slot).square() if weighted else torch.ones(len(token))
        x = routed.x[token]
        mid = expert_intermediate(x, gate_up[expert], act_fn)
        assert torch.allclose(stats.gate_up[j], 2 * (x.T * weight) @ x, rtol=1e-5, atol=1e-5)
        assert torch.allclose(stats.down[j], 2 * (mid.T * weight) @ mid, rtol=1e-5, atol=1e-5)
    # the ranges are the inputs' own, whatever the weights
    assert torch.equal(stats.input_abs_max, plain.input_abs_max) and torch.equal(stats.mid_abs_max, plain.mid_abs_max)
    assert (stats.mid_low, stats.mid_high) == (plain.mid_low, plain.mid_high)


def test_down_fit_statistics_weigh_every_routed_token(monkeypatch):
    """H = sum_t w_t^2 q_t q_t^T and C = sum_t w_t^2 m_t q_t^T over every token routed to the expert (not the loss
    table's sample), the scales taken over them."""
    monkeypatch.setattr(down_fit, "TOKEN_CHUNK", 2)
    routed, (gate_up, _down) = routed_tokens(), expert_weights()
    replicas = torch.stack([gate_up + 0.1 * torch.randn_like(gate_up) for _ in range(2)])
    experts = [0, 2]
    hessian, cross, tokens = down_fit.replica_statistics(routed, experts, [0, 1], gate_up[experts],
                                                         replicas[:, experts], act_fn, weighted=True)
    for j, expert in enumerate(experts):
        token, slot = routed.rows(expert)
        assert int(tokens[j]) == len(token) > 7
        weight = routed.scales(token, slot).square()
        x = routed.x[token]
        full = expert_intermediate(x, gate_up[expert], act_fn)
        for b in range(2):
            got = expert_intermediate(x, replicas[b, expert], act_fn)
            for summed, expected in ((hessian[b, j], (got.T * weight) @ got), (cross[b, j], (full.T * weight) @ got)):
                # float32 sums in another order: to 1e-6 of the matrix's largest entry
                assert torch.allclose(summed, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_table_entries_are_routing_weighted_output_errors(weighted):
    """Each replica's entry: sum_t w_t^2 ||y_q(x_t) - y(x_t)||^2 / (tokens x hidden) over the sample of loss_tokens,
    w_t^2 over its mean (1 for "equal"); the skip entry alike."""
    routed, (gate_up, down) = routed_tokens(60), expert_weights()
    bits_list = (1, 2)
    noisy = {bits: (gate_up + 0.3 / bits * torch.randn_like(gate_up), down + 0.3 / bits * torch.randn_like(down))
             for bits in bits_list}
    tensors: dict = {}
    loss_tokens = 9

    def weights_of(experts):
        return gate_up[experts], down[experts]

    def replicas(bits, experts):
        return noisy[bits][0][experts], noisy[bits][1][experts]

    loss_table.loss_table(routed, weights_of, tensors, replicas, bits_list, 2, (None, None), routed.x[:5], act_fn,
                          2, loss_tokens, None, weighted=weighted)
    outputs = torch.stack([expert_output(routed.x, gate_up[e], down[e], act_fn) for e in range(EXPERTS)])  # [E, T, H]
    tokens = torch.arange(routed.x.shape[0])
    total = sum(routed.weights[:, k, None] * outputs[routed.index[:, k], tokens] for k in range(TOP_K))
    for expert in range(EXPERTS):
        token, slot = routed.rows(expert)
        token, slot = loss_sample(token, loss_tokens), loss_sample(slot, loss_tokens)
        weight = routed.scales(token, slot).square() if weighted else torch.ones(len(token))
        x = routed.x[token]
        reference = expert_output(x, gate_up[expert], down[expert], act_fn)
        for b, bits in enumerate(bits_list):
            error = (expert_output(x, noisy[bits][0][expert], noisy[bits][1][expert], act_fn) - reference).pow(2)
            expected = float((error.sum(dim=1) * weight).sum()) / (len(token) * HIDDEN)
            assert float(tensors["loss_table"][expert, b]) == pytest.approx(expected, rel=1e-5)
        # skipped: the token's other expert stands in (two per token, so the other one's output alone)
        w = routed.weights[token, slot]
        stand_in = (total[token] - w[:, None] * reference) / (routed.weights[token].sum(dim=1) - w)[:, None]
        expected = float(((stand_in - reference).pow(2).sum(dim=1) * weight).sum()) / (len(token) * HIDDEN)
        assert float(tensors["loss_table.skip"][expert]) == pytest.approx(expected, rel=1e-4)


def test_the_recipe_reaches_the_hessians_the_down_fit_and_the_loss_table(tiny_qwen3moe, tmp_path, monkeypatch):
    """One calibration with token_weights routing passes weighted=True to every statistic it weighs (and an
    equal one False), and the banks and loss tables differ from the equal weights' ones."""
    from safetensors.torch import load_file

    from hexq.calib import pipeline, quantize
    from hexq.calib.pipeline import calibrate
    from tests.conftest import mixed_recipe

    seen: dict[str, set] = {"hessians": set(), "down fit": set(), "loss table": set()}

    def spy(name, function, position):
        def wrapped(*args, **kwargs):
            seen[name].add(kwargs["weighted"] if "weighted" in kwargs else args[position])
            return function(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(quantize, "expert_statistics", spy("hessians", quantize.expert_statistics, 4))
    monkeypatch.setattr(quantize, "replica_statistics", spy("down fit", quantize.replica_statistics, 6))
    monkeypatch.setattr(pipeline, "loss_table", spy("loss table", pipeline.loss_table, 13))
    recipe = mixed_recipe()
    results = {}
    for choice in ("equal", "routing"):
        folder = tmp_path / choice
        experts = replace(recipe.experts, down_fit="replica", token_weights=choice)
        calibrate(tiny_qwen3moe, replace(recipe, experts=experts), "bundled", folder)
        assert seen == {name: {choice == "routing"} for name in seen}, choice
        seen = {name: set() for name in seen}
        results[choice] = (load_file(folder / "layer_000.bank.safetensors"),
                           load_file(folder / "layer_000.safetensors")["loss_table"])
    (equal_bank, equal_loss), (routing_bank, routing_loss) = results["equal"], results["routing"]
    assert not torch.equal(equal_loss, routing_loss)
    assert not torch.equal(equal_bank["experts.gate_up.b2.codes"], routing_bank["experts.gate_up.b2.codes"])


def test_token_weights_is_checked():
    with pytest.raises(RecipeError, match="token_weights"):
        Experts(mode="replicas", token_weights="loudest")


def test_rounding_batches_weigh_their_tokens_as_the_recipe_says():
    """experts.round_bits' objective (hexq.calib.rounding.routed_batch): each sampled token's weight in the mask, its
    squared routing scale with "routing", 1 with "equal", 0 on padding rows."""
    from hexq.calib.rounding import routed_batch

    routed, experts, limit = routed_tokens(), [0, 3], 9
    for weighted in (False, True):
        x, mask = routed_batch(routed, experts, limit, weighted)
        for j, expert in enumerate(experts):
            token, slot = (loss_sample(part, limit) for part in routed.rows(expert))
            want = routed.scales(token, slot).square() if weighted else torch.ones(len(token))
            assert torch.equal(x[j, :len(token)], routed.x[token])
            assert torch.allclose(mask[j, :len(token)], want) and not mask[j, len(token):].any()


def test_expert_rounding_is_given_the_recipes_token_weights(tiny_qwen3moe, tmp_path, monkeypatch):
    from hexq.calib import rounding
    from hexq.calib.pipeline import calibrate
    from tests.conftest import mixed_recipe

    seen = set()
    original = rounding.routed_batch

    def spy(routed, experts, limit, weighted=False):
        seen.add(weighted)
        return original(routed, experts, limit, weighted)

    monkeypatch.setattr(rounding, "routed_batch", spy)
    recipe = mixed_recipe()
    for choice in ("equal", "routing"):
        experts = replace(recipe.experts, token_weights=choice, round_bits=(1,), round_steps=2)
        calibrate(tiny_qwen3moe, replace(recipe, experts=experts), "bundled", tmp_path / choice)
        assert seen == {choice == "routing"}, choice
        seen.clear()
