import dataclasses
from itertools import combinations, product

import pytest
import torch
from placement import global_frequency_placement, path_coverage, placement_metrics  # benchmarks/placement.py

from hexq.algos.placement import (
    SCHEMES,
    expert_counts,
    frequency_placement,
    hit_rates,
    path_placement,
    place,
    transition_counts,
    two_stage_placement,
)
from hexq.model.adapters import adapter_for
from tests.conftest import build_tiny_model

from reference import capture_router_counts, capture_router_topk, stack_trace


def random_trace(L: int, T: int, k: int, E: int, seed: int = 0) -> torch.Tensor:
    """Top-k routing with distinct experts per token and a skewed, layer-dependent load."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, 1, E, generator=generator) * 1.5 + torch.randn(L, T, E, generator=generator)
    return logits.topk(k, dim=-1).indices.to(torch.int16)


def trace_from_paths(paths: dict[tuple[int, ...], int]) -> torch.Tensor:
    """Top-1 trace [L, T, 1] holding each complete path `count` times."""
    columns = [torch.tensor(path) for path, count in paths.items() for _ in range(count)]
    return torch.stack(columns, dim=1).unsqueeze(-1)


def schemes(topk: torch.Tensor, E: int, K: int) -> dict[str, torch.Tensor]:
    return {"1": path_placement(topk, E, K), "2": frequency_placement(expert_counts(topk, E), K),
            "3": two_stage_placement(topk, E, K)}


def test_every_scheme_places_exactly_k_experts_per_layer_deterministically():
    E = 6
    topk = random_trace(L=3, T=50, k=2, E=E)
    topk[1] = topk[1] % 3  # layer 1 never routes to experts 3-5: they still fill the budget, by id
    topk[1, :, 1] = (topk[1, :, 0] + 1) % 3
    for K in range(E + 1):
        for name, mask in schemes(topk, E, K).items():
            assert mask.dtype == torch.bool and mask.shape == (3, E)
            assert mask.sum(dim=1).tolist() == [K] * 3, (name, K)
            assert torch.equal(mask, schemes(topk, E, K)[name])
    assert frequency_placement(expert_counts(topk, E), 4)[1].tolist() == [True] * 4 + [False] * 2


def test_frequency_placement_maximizes_every_layers_hit_rate_on_its_own_trace():
    E, K = 5, 2
    for seed in range(3):
        topk = random_trace(L=3, T=40, k=2, E=E, seed=seed)
        rates = {name: hit_rates(mask, topk) for name, mask in schemes(topk, E, K).items()}
        best = torch.zeros(3, dtype=torch.float64)
        for subset in combinations(range(E), K):  # brute force over every fast set
            mask = torch.zeros(3, E, dtype=torch.bool)
            mask[:, list(subset)] = True
            best = torch.maximum(best, hit_rates(mask, topk))
        assert torch.allclose(rates["2"], best)
        assert (rates["1"] <= best + 1e-12).all() and (rates["3"] <= best + 1e-12).all()


def test_transition_counts_match_a_loop_over_tokens():
    E = 4
    topk = random_trace(L=3, T=20, k=2, E=E, seed=1)
    expected = torch.zeros(2, E, E, dtype=torch.long)
    for layer, t in product(range(2), range(20)):
        for a, b in product(topk[layer, t].tolist(), topk[layer + 1, t].tolist()):
            expected[layer, a, b] += 1
    assert torch.equal(transition_counts(topk, E), expected)


# 30 tokens take one hot path 0 -> 0 -> 0; 70 spread over experts 1 and 2 so that each of those is more frequent
# per layer (34-36 tokens) than expert 0 (30), but no transition among them is (at most 18 tokens).
PATHS = {(0, 0, 0): 30} | dict(zip(product((1, 2), repeat=3), (9, 9, 9, 9, 9, 9, 8, 8), strict=True))


def test_on_a_hot_path_scheme_1_covers_the_path_and_scheme_2_the_per_layer_peaks():
    topk, E = trace_from_paths(PATHS), 4
    assert expert_counts(topk, E).tolist() == [[30, 36, 34, 0], [30, 36, 34, 0], [30, 35, 35, 0]]
    path_mask, freq_mask = path_placement(topk, E, 1), frequency_placement(expert_counts(topk, E), 1)
    assert path_mask.nonzero()[:, 1].tolist() == [0, 0, 0]
    assert freq_mask.nonzero()[:, 1].tolist() == [1, 1, 1]  # layer 2's tie 35/35 goes to the lower id
    # Frequency wins every layer's hit rate; the path serves 30% of tokens on every layer, frequency only the
    # 9 tokens that happen to take 1 -> 1 -> 1.
    assert hit_rates(freq_mask, topk).tolist() == pytest.approx([0.36, 0.36, 0.35])
    assert hit_rates(path_mask, topk).tolist() == pytest.approx([0.30, 0.30, 0.30])
    assert path_coverage(path_mask, topk) == pytest.approx(0.30)
    assert path_coverage(freq_mask, topk) == pytest.approx(0.09)


def test_two_stage_takes_the_hot_path_then_the_most_frequent_experts():
    topk, E = trace_from_paths(PATHS), 4
    mask = two_stage_placement(topk, E, K=2)  # path_k = min(k, K) = 1
    assert mask.tolist() == [[True, True, False, False]] * 3
    assert path_coverage(mask, topk) == pytest.approx(0.39)  # the hot path and 1 -> 1 -> 1
    assert torch.equal(two_stage_placement(topk, E, K=2, path_k=0), frequency_placement(expert_counts(topk, E), 2))
    assert torch.equal(two_stage_placement(topk, E, K=2, path_k=2), path_placement(topk, E, 2))
    with pytest.raises(ValueError, match="path_k"):
        two_stage_placement(topk, E, K=2, path_k=3)


def test_a_per_layer_budget_lifts_the_weakest_layer_that_a_global_budget_starves():
    # 003 Table IV: a global frequency ranking spends the budget on the concentrated layer 0, the flat layer 1
    # gets one expert; the same K per layer trades a little mean hit rate for a much smaller spread.
    counts = [[40, 30, 28, 2], [26, 25, 25, 24]]
    topk = torch.stack([torch.cat([torch.full((n,), e) for e, n in enumerate(layer)]) for layer in counts])[..., None]
    global_mask = global_frequency_placement(expert_counts(topk, 4), total=4)
    assert global_mask.sum(dim=1).tolist() == [3, 1]
    per_layer, glob = placement_metrics(two_stage_placement(topk, 4, K=2), topk), placement_metrics(global_mask, topk)
    assert glob.per_layer == pytest.approx((0.98, 0.26)) and per_layer.per_layer == pytest.approx((0.70, 0.51))
    assert glob.mean > per_layer.mean
    assert per_layer.std < glob.std and per_layer.gap < glob.gap and min(per_layer.per_layer) > min(glob.per_layer)


def test_metrics_against_hand_computation():
    # 2 layers, 3 tokens, top-2 over 4 experts; fast sets {0, 1} and {2}.
    topk = torch.tensor([[[0, 1], [0, 2], [3, 1]], [[2, 0], [2, 1], [2, 3]]])
    mask = torch.tensor([[True, True, False, False], [False, False, True, False]])
    metrics = placement_metrics(mask, topk)
    assert metrics.per_layer == pytest.approx((4 / 6, 3 / 6))
    assert metrics.mean == pytest.approx(7 / 12)
    assert metrics.std == pytest.approx(1 / 12)  # population std of two values is half their difference
    assert metrics.gap == pytest.approx(1 / 6)
    assert metrics.path_coverage == 0.0  # every token has a slow expert somewhere
    mask[1, :] = True
    assert placement_metrics(mask, topk).path_coverage == pytest.approx(1 / 3)  # token 0: {0,1} then anything
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.mean = 0.0


def test_bad_traces_and_budgets_are_rejected():
    topk = random_trace(L=2, T=5, k=2, E=4)
    with pytest.raises(ValueError, match="K must be"):
        frequency_placement(expert_counts(topk, 4), 5)
    with pytest.raises(ValueError, match="expert ids"):
        path_placement(torch.tensor([[[0, 3]], [[1, 2]]]), 3, 1)
    with pytest.raises(ValueError, match=r"\[L, T, k\]"):
        hit_rates(torch.ones(2, 4, dtype=torch.bool), topk[0])
    with pytest.raises(ValueError, match="no routed tokens"):
        hit_rates(torch.ones(2, 4, dtype=torch.bool), topk[:, :0])
    with pytest.raises(ValueError, match="different tokens"):
        stack_trace([[topk[0]], [topk[1, :3]]])


def test_capture_router_topk_records_the_same_routing_as_the_counts():
    model = build_tiny_model("qwen3_moe", num_hidden_layers=3)
    adapter = adapter_for("qwen3_moe")
    ids = torch.randint(0, 8192, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_router_topk(model, adapter) as calls, \
            capture_router_counts(model, adapter, num_experts=8) as stats:
        model(input_ids=ids)
        model(input_ids=ids[:1, :5])  # a second call with other tokens appends to every layer
    topk = stack_trace(calls)
    assert topk.shape == (3, 2 * 7 + 5, 2) and topk.dtype == torch.int16
    assert torch.equal(expert_counts(topk, 8), stats.counts)
    # Row t of every layer is the same token: the second call's first 5 rows repeat the first call's first 5.
    assert torch.equal(topk[:, 14:], topk[:, :5])
    with torch.no_grad():  # hooks are removed when the block ends
        model(input_ids=ids)
    assert stack_trace(calls).shape == topk.shape


def test_place_dispatches_by_name_or_003_number():
    topk, E, K = random_trace(L=4, T=40, k=2, E=16, seed=17), 16, 4
    counts = expert_counts(topk, E)
    masks = schemes(topk, E, K)
    assert not any(torch.equal(masks[a], masks[b]) for a, b in combinations(masks, 2))  # a mix-up would show
    for number, name in SCHEMES.items():
        assert torch.equal(place(number, topk, counts, K), place(name, topk, counts, K))
        assert torch.equal(place(name, topk, counts, K), schemes(topk, E, K)[number])
    with pytest.raises(ValueError, match="unknown placement scheme 'four'"):
        place("four", topk, counts, K)
