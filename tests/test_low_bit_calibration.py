"""The low-bit switches reach the calibration: fitted grids (experts.weights.fit_bits), ranges chosen per row
(experts.weights.clip_bits) and rounding optimised on routed tokens (experts.round_bits) change exactly the widths
they name, and lower their loss-table MSE."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from hexq.calib.pipeline import calibrate
from hexq.config.recipe import WeightQuant
from tests.conftest import mixed_recipe, small_recipe


def bank(folder, layer: int) -> dict[str, torch.Tensor]:
    return load_file(folder / f"layer_{layer:03d}.bank.safetensors")


@pytest.mark.parametrize("switch", ["fit", "clip", "round"])
def test_switch_changes_only_its_widths(switch, tiny_qwen3moe, mixed_calibration, tmp_path):
    plain = mixed_calibration[0]
    assert mixed_recipe().experts.round_bits == () and mixed_recipe().expert_weights.fit_bits == ()
    assert mixed_recipe().expert_weights.clip_bits == ()
    widths = (2,) if switch == "clip" else (1, 2)
    if switch in ("fit", "clip"):
        recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False,
                                                                   **{f"{switch}_bits": widths}))
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
            assert same == (width not in widths), replica
            if switch == "round":  # zero points stay GPTQ's
                assert torch.equal(before[f"{replica}.zero"], after[f"{replica}.zero"])
    for layer in range(2):
        columns = [w - 1 for w in widths]  # the loss table's columns: replica_bits 1, 2, 3, 4, 8
        before = load_file(plain / f"layer_{layer:03d}.safetensors")["loss_table"][:, columns]
        after = load_file(out / f"layer_{layer:03d}.safetensors")["loss_table"][:, columns]
        assert after.sum() < before.sum()


def layer_report(folder, layer: int) -> dict:
    return json.loads((folder / f"layer_{layer:03d}.json").read_text())


def test_block_rounding_changes_only_its_widths_and_reports_the_layer_error(tiny_qwen3moe, mixed_calibration,
                                                                               tmp_path):
    """experts.round_scope block on experts-mixed (W8A8 attention: its linears stay GPTQ's): the 1- and 2-bit
    replicas change exactly where the layer's error fell, every other width and the dense linears are untouched."""
    plain = mixed_calibration[0]
    recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False), round_bits=(1, 2),
                          round_steps=20, round_scope="block")
    out = tmp_path / "block"
    calibrate(tiny_qwen3moe, recipe, "bundled", out)
    lowered = 0
    for layer in range(2):
        report = layer_report(out, layer)["block_rounding"]["widths"]
        assert set(report) == {"1", "2"}
        before, after = bank(plain, layer), bank(out, layer)
        for replica in {key.rsplit(".", 1)[0] for key in before}:
            width = replica.rsplit(".b", 1)[1]
            same = all(torch.equal(before[f"{replica}.{part}"], after[f"{replica}.{part}"])
                       for part in ("codes", "scale", "zero"))
            fell = width in report and report[width]["after"] < report[width]["before"]
            assert same == (not fell), replica
            lowered += fell
        dense_before = load_file(plain / f"layer_{layer:03d}.safetensors")
        dense_after = load_file(out / f"layer_{layer:03d}.safetensors")
        for key in (k for k in dense_before if k.startswith("linear.")):
            assert torch.equal(dense_before[key], dense_after[key]), key
    assert lowered  # 20 steps lower the layer error somewhere on the tiny model


def test_block_rounding_tunes_weight_only_dense_linears(tiny_qwen3moe, tmp_path):
    weights = WeightQuant(bits=2, group_size=16, symmetric=False, act_order="sum_of_squares")
    plain = replace(small_recipe("w4a16-g32"), weights=weights)
    tuned = replace(plain, experts=replace(plain.experts, round_bits=(2,), round_scope="block", round_steps=20))
    calibrate(tiny_qwen3moe, plain, "bundled", tmp_path / "plain")
    calibrate(tiny_qwen3moe, tuned, "bundled", tmp_path / "tuned")
    report = layer_report(tmp_path / "tuned", 0)["block_rounding"]["widths"]["2"]
    assert report["after"] < report["before"]
    before = load_file(tmp_path / "plain" / "layer_000.safetensors")
    after = load_file(tmp_path / "tuned" / "layer_000.safetensors")
    changed = [key for key in before if key.startswith("linear.") and key.endswith(".codes")
               and not torch.equal(before[key], after[key])]
    assert changed


def block_recipe():
    return small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False), round_bits=(1, 2),
                        round_steps=20, round_scope="block")


def test_block_rounding_aims_at_the_full_precision_model(tiny_qwen3moe, tmp_path, monkeypatch):
    """AutoRound's objective: each layer's targets are the full-precision model's activations after it (a stream
    carried beside the quantized one), not the full-precision layer applied to the quantized layers' outputs."""
    from hexq.base.data import calibration_windows
    from hexq.calib import pipeline
    from hexq.model.layer_pass import full_precision_plan, stream_layers
    from hexq.model.streaming import open_model

    recorded = []
    real = pipeline.model_outputs

    def recording(*args, **kwargs):
        targets = real(*args, **kwargs)
        recorded.append(torch.cat(list(targets)))
        return targets

    monkeypatch.setattr(pipeline, "model_outputs", recording)
    recipe = block_recipe()
    calibrate(tiny_qwen3moe, recipe, "bundled", tmp_path / "block")
    streamed, tokenizer = open_model(tiny_qwen3moe, torch.device("cpu"))
    cal = recipe.calibration
    windows = calibration_windows(tokenizer, "bundled", cal.num_samples, cal.seqlen, seed=cal.seed).ids
    model = stream_layers(streamed, windows, 8, full_precision_plan(streamed))
    try:
        expected = torch.cat(list(model))
    finally:
        model.close()
    assert len(recorded) == streamed.num_layers == 2
    torch.testing.assert_close(recorded[-1], expected, rtol=1e-5, atol=1e-5)


def test_an_interrupted_block_rounding_run_resumes_to_the_same_calibration(tiny_qwen3moe, tmp_path):
    """The full-precision stream is rebuilt through the finished layers on resume: the resumed calibration's tensors
    are the uninterrupted one's byte for byte, and so are the layer errors it reports (its seconds aside)."""
    import shutil

    whole = tmp_path / "whole"
    calibrate(tiny_qwen3moe, block_recipe(), "bundled", whole)
    partial = tmp_path / ".resumed.partial"
    shutil.copytree(whole, partial)
    for name in ("layer_001.safetensors", "layer_001.json", "layer_001.bank.safetensors", "manifest.json"):
        (partial / name).unlink(missing_ok=True)
    progress = json.loads((partial / "progress.json").read_text())
    (partial / "progress.json").write_text(json.dumps(progress | {"layers_done": 1}))
    summary = calibrate(tiny_qwen3moe, block_recipe(), "bundled", tmp_path / "resumed")
    assert summary.resumed_from == 1
    for tensors in sorted(whole.glob("*.safetensors")):
        assert (tmp_path / "resumed" / tensors.name).read_bytes() == tensors.read_bytes(), tensors.name
    for layer in range(2):
        resumed = layer_report(tmp_path / "resumed", layer)["block_rounding"]
        assert resumed["widths"] == layer_report(whole, layer)["block_rounding"]["widths"]


def test_block_rounding_with_every_activation_spilled_is_the_same_calibration(tiny_qwen3moe, tmp_path):
    """Both activation streams (the quantized model's and the full-precision model's) spill to the calibration
    folder past --activation-memory and read back the same."""
    calibrate(tiny_qwen3moe, block_recipe(), "bundled", tmp_path / "memory")
    calibrate(tiny_qwen3moe, block_recipe(), "bundled", tmp_path / "spilled", activation_limit=1)
    for tensors in sorted((tmp_path / "memory").glob("*.safetensors")):
        assert (tmp_path / "spilled" / tensors.name).read_bytes() == tensors.read_bytes(), tensors.name
