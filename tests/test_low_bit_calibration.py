"""The low-bit switches reach the calibration: fitted grids (experts.weights.fit_bits) and rounding optimised on
routed tokens (experts.round_bits) change exactly the widths they name, and lower their loss-table MSE."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hexq.calib.pipeline import calibrate
from hexq.recipe import WeightQuant
from tests.conftest import mixed_recipe, small_recipe


def bank(folder, layer: int) -> dict[str, torch.Tensor]:
    return load_file(folder / f"layer_{layer:03d}.bank.safetensors")


@pytest.mark.parametrize("switch", ["fit", "round"])
def test_switch_changes_only_its_widths(switch, tiny_qwen3moe, mixed_calibration, tmp_path):
    plain = mixed_calibration[0]
    assert mixed_recipe().experts.round_bits == () and mixed_recipe().expert_weights.fit_bits == ()
    if switch == "fit":
        recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False, fit_bits=(1, 2)))
    else:
        recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False),
                              round_bits=(1, 2), round_steps=20)
    out = tmp_path / switch
    calibrate(tiny_qwen3moe, recipe, "bundled", out)
    for layer in range(2):  # propagate_bits 4 is untouched, so every layer sees the same inputs in both runs
        before, after = bank(plain, layer), bank(out, layer)
        for replica in {key.rsplit(".", 1)[0] for key in before}:  # experts.<projection>.b<width>
            width = int(replica.rsplit(".b", 1)[1])
            same = all(torch.equal(before[f"{replica}.{part}"], after[f"{replica}.{part}"])
                       for part in ("codes", "scale", "zero"))
            assert same == (width not in (1, 2)), replica
            if switch == "round":  # zero points stay GPTQ's
                assert torch.equal(before[f"{replica}.zero"], after[f"{replica}.zero"])
    for layer in range(2):
        before = load_file(plain / f"layer_{layer:03d}.safetensors")["loss_table"][:, :2]
        after = load_file(out / f"layer_{layer:03d}.safetensors")["loss_table"][:, :2]
        assert after.sum() < before.sum()
