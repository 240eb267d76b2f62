"""experts.down_fit "replica" (hexq.calib.down_fit): each width's down projection fitted to the intermediate the same
width's gate_up replica produces. The map's algebra on constructed inputs, then what it changes in a calibration."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from hexq.calib.down_fit import FIT_BELOW, FLOAT32_TOKENS, fitted_map, output_scale, solve_dtype
from hexq.calib.pipeline import calibrate
from hexq.config.recipe import RecipeError
from tests.conftest import mixed_recipe


def statistics(full: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H) of intermediates [n, in]: C = sum_t m_t q_t^T, H = sum_t q_t q_t^T."""
    return full.T @ got, got.T @ got


@pytest.mark.parametrize("tokens", [8, 4096])  # fewer tokens than inputs (the ridge dominates), and many more
def test_the_map_undoes_a_per_channel_gain_exactly(tokens):
    """q = m G (a gain per channel): V = W G^-1 whatever the ridge, since the ridge pulls towards W D and D = G^-1."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=generator, dtype=torch.float64)
    full = torch.randn(tokens, 32, generator=generator, dtype=torch.float64)
    gains = torch.rand(32, generator=generator, dtype=torch.float64) + 0.5
    cross, hessian = statistics(full, full * gains)
    mapped = fitted_map(weight, cross, hessian, torch.tensor(tokens))
    torch.testing.assert_close(mapped, weight / gains, rtol=1e-9, atol=1e-9)


def test_the_float32_solve_matches_float64_up_to_its_token_bound():
    """Float32 statistics are solved in float32 up to FLOAT32_TOKENS tokens (the system's condition number is at most
    tokens + 1), in float64 beyond: both give the float64 map to float32 accuracy on uneven channel scales."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 64, generator=generator)
    scales = torch.rand(64, generator=generator, dtype=torch.float64) ** 3 + 1e-3  # channels 1000x apart
    for tokens in (FLOAT32_TOKENS, FLOAT32_TOKENS + 1):
        got = torch.randn(tokens, 64, generator=generator, dtype=torch.float64) * scales
        full = got + 0.1 * torch.randn(tokens, 64, generator=generator, dtype=torch.float64) * scales
        cross, hessian = statistics(full, got)
        exact = fitted_map(weight.double(), cross, hessian, torch.tensor(tokens))
        mapped = fitted_map(weight, cross.float(), hessian.float(), torch.tensor(tokens))
        assert mapped.dtype == torch.float32
        assert solve_dtype(hessian.float(), torch.tensor(tokens)) == (
            torch.float32 if tokens <= FLOAT32_TOKENS else torch.float64)
        assert solve_dtype(hessian, torch.tensor(tokens)) == torch.float64
        output = float((got @ (mapped.double() - exact).T).norm() / (got @ exact.T).norm())
        assert output < 1e-5, (tokens, output)


def squared_error(weight, full, got, mapped) -> float:
    return float((full @ weight.T - got @ mapped.T).square().sum())


def test_the_map_lowers_the_error_below_its_ridge_target_and_nears_least_squares_as_tokens_grow():
    """A general mixing plus noise: on the fitting tokens the map's error is at most that of W D (what the ridge pulls
    towards) and below W's; the ridge shrinks as in / tokens, so the map nears the least-squares one (2% at 2000x
    more tokens than inputs)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 24, generator=generator, dtype=torch.float64)
    mixing = torch.eye(24, dtype=torch.float64) + 0.3 * torch.randn(24, 24, generator=generator, dtype=torch.float64)
    distances = []
    for tokens in (48, 4800, 48000):
        full = torch.randn(tokens, 24, generator=generator, dtype=torch.float64)
        got = full @ mixing + 0.2 * torch.randn(tokens, 24, generator=generator, dtype=torch.float64)
        cross, hessian = statistics(full, got)
        mapped = fitted_map(weight, cross, hessian, torch.tensor(tokens))
        gains = torch.diagonal(cross) / torch.diagonal(hessian)
        assert squared_error(weight, full, got, mapped) <= squared_error(weight, full, got, weight * gains)
        assert squared_error(weight, full, got, mapped) < squared_error(weight, full, got, weight)
        least_squares = weight @ cross @ torch.linalg.inv(hessian)
        distances.append(float((mapped - least_squares).norm() / least_squares.norm()))
    assert distances[0] > distances[1] > distances[2] and distances[2] < 0.02, distances


def test_output_scale_restores_each_rows_gain():
    """q = m G and Q = diag(a) W G^-1: Q q = diag(a) W m, so each row's factor is exactly 1 / a_r."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(12, 20, generator=generator, dtype=torch.float64)
    full = torch.randn(500, 20, generator=generator, dtype=torch.float64)
    gains = torch.rand(20, generator=generator, dtype=torch.float64) + 0.5
    cross, hessian = statistics(full, full * gains)
    row_gains = torch.rand(12, generator=generator, dtype=torch.float64) + 0.5
    quantized = row_gains[:, None] * weight / gains
    torch.testing.assert_close(output_scale(weight, quantized, cross, hessian), 1 / row_gains, rtol=1e-9, atol=1e-9)
    quantized[3] = 0  # a row whose output is zero keeps its scale
    assert float(output_scale(weight, quantized, cross, hessian)[3]) == 1.0


def test_replica_fit_changes_only_the_warm_experts_down_replicas_and_lowers_their_loss(tiny_qwen3moe, tmp_path):
    """min_tokens 45 makes 3 of layer 0's 8 experts cold (34-39 routed tokens) and leaves 5 warm (47-71)."""
    recipe = mixed_recipe()
    plain, fitted = tmp_path / "plain", tmp_path / "fitted"
    for folder, down_fit in ((plain, "full_precision"), (fitted, "replica")):
        calibrate(tiny_qwen3moe, replace(recipe, experts=replace(recipe.experts, down_fit=down_fit, min_tokens=45)),
                  "bundled", folder)
    # layer 0 only: the 4-bit replicas make the next layer's inputs, and their down projection changed
    before, after = (load_file(folder / "layer_000.bank.safetensors") for folder in (plain, fitted))
    tokens = load_file(plain / "layer_000.safetensors")["experts.tokens"]
    warm = tokens >= 45
    assert 0 < int(warm.sum()) < len(warm)  # both kinds are exercised
    for bits in recipe.experts.replica_bits:
        for part in ("codes", "scale", "zero"):
            assert torch.equal(before[f"experts.gate_up.b{bits}.{part}"], after[f"experts.gate_up.b{bits}.{part}"])
        down = [(before[f"experts.down.b{bits}.{part}"], after[f"experts.down.b{bits}.{part}"])
                for part in ("codes", "scale", "zero")]
        changed = [not all(torch.equal(a[e], b[e]) for a, b in down) for e in range(len(warm))]
        assert changed == (warm.tolist() if bits < FIT_BELOW else [False] * len(warm)), bits
    loss_before = load_file(plain / "layer_000.safetensors")["loss_table"]
    loss_after = load_file(fitted / "layer_000.safetensors")["loss_table"]
    # the warm experts' loss at 1, 2, 3 and 4 bits: 0.05, 0.69, 0.74, 0.75 of one Hessian's; with the map fitted to
    # the full-precision intermediate instead of the replica's, 0.27, 0.88, 0.95, 0.98; 8 bits keep one Hessian
    ratio = loss_after[warm].sum(dim=0) / loss_before[warm].sum(dim=0)
    assert float(ratio[0]) < 0.15 and bool((ratio[1:4] < 0.8).all()) and float(ratio[4]) == 1.0, ratio
    assert torch.equal(loss_after[~warm], loss_before[~warm])


def test_down_fit_is_checked():
    from hexq.config.recipe import Experts

    with pytest.raises(RecipeError, match="down_fit"):
        Experts(mode="replicas", down_fit="sideways")
    with pytest.raises(RecipeError, match="down_fit"):
        Experts(mode="uniform", down_fit="replica")
