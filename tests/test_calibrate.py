"""hexq calibrate end to end on a tiny random Qwen3-MoE: outputs, determinism, resume, errors, loss tables."""

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from hexq.base.errors import HexqError
from hexq.calib import pipeline
from hexq.calib.calibrated import calibrated_model
from hexq.calib.pipeline import calibrate
from hexq.calib.store import read_json
from hexq.config.recipe import Calibration, Experts, Pack, WeightQuant
from hexq.model.layer_pass import full_precision_plan
from hexq.model.simulate import loss_sample
from hexq.model.streaming import open_model
from hexq.packed.bitpack import packed_nbytes, unpack_bits
from hexq_cli.main import app
from tests.conftest import small_recipe

from reference import stream_logits

SMALL = Calibration(num_samples=6, seqlen=32, seed=0)
MIXED = dict(weights=WeightQuant(group_size=16, symmetric=False))
small = small_recipe


def mixed(**experts):
    """experts-mixed as the shared mixed_calibration fixture makes it (conftest.mixed_recipe: pack section too)."""
    return replace(small("experts-mixed", **experts), pack=Pack())


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "timings.json"}


real_calibrate_layer = pipeline.calibrate_layer


@pytest.fixture(scope="module")
def mixed_run(mixed_calibration):
    return mixed_calibration


def test_output_folder_layout_and_loss_table(mixed_run):
    out, summary = mixed_run
    manifest = read_json(out / "manifest.json")
    assert manifest["expert_bits"] == [1, 2, 3, 4, 8] and manifest["model"]["layers"] == summary.layers == 2
    for index in range(2):
        tensors = load_file(out / f"layer_{index:03d}.safetensors")
        table = tensors["loss_table"]
        assert table.shape == (8, 5) and torch.isfinite(table).all()
        # more bits, less output error, for every expert (1 -> 8 bits)
        assert (table[:, 0] > table[:, 3]).all() and (table[:, 3] > table[:, 4]).all()
        bank = load_file(out / f"layer_{index:03d}.bank.safetensors")  # the replica bank is a file of its own
        for bits in (1, 2, 3, 4, 8):
            codes = bank[f"experts.gate_up.b{bits}.codes"]  # bit-packed per expert, as in the artifact
            assert codes.shape == (8, packed_nbytes(32 * 32, bits)) and codes.dtype == torch.uint8
            assert int(unpack_bits(codes[3], bits, 32 * 32).max()) <= 2**bits - 1
            assert bank[f"experts.gate_up.b{bits}.scale"].shape == (8, 32, 2)
        assert int(tensors["router.counts"].sum()) == 6 * 32 * 2  # tokens x top-2
        assert tensors["router.topk"].shape == (6 * 32, 2)
        assert torch.equal(tensors["loss_table.tokens"].clamp(max=1), (tensors["experts.tokens"] > 0).long())
    # timings.json: every part of a layer's wall time has its stage (reading it in, each pass, writing it out)
    timings = read_json(out / "timings.json")
    for index in range(2):
        stages = timings["stages"][f"layer_{index:03d}"]
        assert list(stages) == ["load", "smoothing", "quantize", "quantized pass", "loss table", "save"]
        assert sum(stages.values()) <= timings[f"layer_{index:03d}"] + 0.01


def test_loss_sample_strides_over_every_window():
    x = torch.arange(10).float()[:, None]
    assert loss_sample(x, 10) is x
    assert loss_sample(x, 4)[:, 0].tolist() == [0, 3, 6, 9]  # at most 4 rows, first to last
    assert loss_sample(x, 3)[:, 0].tolist() == [0, 4, 8]


def test_loss_tokens_samples_the_loss_table_and_nothing_else(tiny_qwen3moe, tmp_path):
    """A loss table measured on at most 4 tokens per expert: the same banks (down_fit's maps are fitted on every
    routed token, and rounding is off) and next-layer inputs (every routed token still goes through the propagated
    replica), a different but still ordered loss table."""
    out, capped = tmp_path / "all", tmp_path / "capped"
    calibrate(tiny_qwen3moe, mixed(**MIXED, down_fit="replica"), "bundled", out)
    calibrate(tiny_qwen3moe, mixed(**MIXED, loss_tokens=4, down_fit="replica"), "bundled", capped)
    for index in range(2):
        name = f"layer_{index:03d}.bank.safetensors"
        assert (capped / name).read_bytes() == (out / name).read_bytes()
        full = load_file(out / f"layer_{index:03d}.safetensors")["loss_table"]
        sampled = load_file(capped / f"layer_{index:03d}.safetensors")["loss_table"]
        assert not torch.equal(full, sampled)
        assert (sampled[:, 0] > sampled[:, 3]).all() and (sampled[:, 3] > sampled[:, 4]).all()


def test_same_inputs_give_the_same_bytes(tiny_qwen3moe, mixed_run, tmp_path, monkeypatch):
    """Rerun: the same bytes, also with the loss table taking one expert at a time (its chunk bounds memory only)."""
    out, _ = mixed_run
    again = tmp_path / "again"
    monkeypatch.setattr("hexq.calib.loss_table.LOSS_CHUNK_BYTES", 1)
    calibrate(tiny_qwen3moe, mixed(**MIXED), "bundled", again)
    assert folder_bytes(again) == folder_bytes(out)


def test_interrupted_run_resumes_from_the_last_finished_layer(tiny_qwen3moe, mixed_run, tmp_path):
    out, _ = mixed_run
    final = tmp_path / "resumed"
    partial = tmp_path / ".resumed.partial"  # where an unfinished run's work lives
    shutil.copytree(out, partial)
    # as if killed after layer 0: layer 1 and the manifest never written, progress says 1 layer done
    for name in ("layer_001.safetensors", "layer_001.json", "manifest.json"):
        (partial / name).unlink()
    progress = json.loads((partial / "progress.json").read_text())
    (partial / "progress.json").write_text(json.dumps(progress | {"layers_done": 1}))
    summary = calibrate(tiny_qwen3moe, mixed(**MIXED), "bundled", final)
    assert summary.resumed_from == 1 and not partial.exists()
    assert folder_bytes(final) == folder_bytes(out)
    assert calibrate(tiny_qwen3moe, mixed(**MIXED), "bundled", final).resumed_from == -1


def test_a_killed_run_leaves_nothing_under_the_final_name_and_a_rerun_resumes(tiny_qwen3moe, mixed_run, tmp_path,
                                                                               monkeypatch):
    """A disk that fills while layer 1 is written: one clean error, no folder under the final name, layer 0 kept in
    the partial folder, and the rerun resumes from it (layer 0 is not calibrated again)."""
    import hexq.calib.pipeline as pipeline

    out, _ = mixed_run
    final = tmp_path / "cal"
    real_save = pipeline.save_layer

    def full_disk(folder, index, tensors, meta):
        if index == 1:
            raise OSError(28, "No space left on device")
        real_save(folder, index, tensors, meta)

    monkeypatch.setattr(pipeline, "save_layer", full_disk)
    with pytest.raises(OSError, match="No space left"):
        calibrate(tiny_qwen3moe, mixed(**MIXED), "bundled", final)
    assert not final.exists() and (tmp_path / ".cal.partial" / "layer_000.safetensors").is_file()
    assert not (tmp_path / ".cal.partial" / "layer_001.safetensors").exists()
    monkeypatch.setattr(pipeline, "save_layer", real_save)
    calibrated = []
    monkeypatch.setattr(pipeline, "calibrate_layer",
                        lambda loaded, *a, **k: calibrated.append(loaded.index) or real_calibrate_layer(loaded, *a,
                                                                                                         **k))
    assert calibrate(tiny_qwen3moe, mixed(**MIXED), "bundled", final).resumed_from == 1
    assert calibrated == [1] and folder_bytes(final) == folder_bytes(out)


def test_folder_of_another_calibration_needs_force(tiny_qwen3moe, mixed_run, tmp_path):
    out, _ = mixed_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with pytest.raises(HexqError, match="already holds a calibration; pass --force"):
        calibrate(tiny_qwen3moe, small("haq-w8a8"), "bundled", copy)
    assert folder_bytes(copy) == folder_bytes(out)
    calibrate(tiny_qwen3moe, small("haq-w8a8"), "bundled", copy, force=True)
    assert read_json(copy / "manifest.json")["recipe"]["name"] == "haq-w8a8"


def test_foreign_non_empty_folder_is_refused_even_with_force(tiny_qwen3moe, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(HexqError, match="was not written by hexq"):
            calibrate(tiny_qwen3moe, small("haq-w8a8"), "bundled", tmp_path, force=force)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_output_may_not_be_the_model_or_its_parent(tiny_qwen3moe):
    for out in (tiny_qwen3moe, tiny_qwen3moe.parent):
        with pytest.raises(HexqError, match="input"):
            calibrate(tiny_qwen3moe, small("haq-w8a8"), "bundled", out, force=True)
    assert (tiny_qwen3moe / "config.json").is_file()


def calibrated_logits(folder, ids):
    streamed, _tokenizer, prepare = calibrated_model(folder, torch.device("cpu"))
    return stream_logits(streamed, ids, prepare)


def test_haq_w8a8_smoothing_helps_on_outliers_and_stays_close_to_full_precision(tmp_path):
    """On a model with 50x activation-outlier channels (function-preserving injection, as large LLMs have them) the
    chosen exponent must cut the W8A8 error of eq. 1 far below no smoothing, and the smoothed quantized model must be
    far closer to full precision than the same recipe without smoothing."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from hexq.model.adapters import adapter_for
    from tests.conftest import TOKENIZER_DIR, build_tiny_model

    from outliers import inject_outliers

    model = build_tiny_model("qwen3_moe")
    inject_outliers(model, adapter_for("qwen3_moe"), channels_per_norm=4, factor=50.0, seed=0)
    folder = tmp_path / "outliers"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    recipe = small("haq-w8a8")
    calibrate(folder, recipe, "bundled", tmp_path / "haq")
    calibrate(folder, replace(recipe, smoothing=replace(recipe.smoothing, method="none")), "bundled",
              tmp_path / "none")
    manifest = read_json(tmp_path / "haq" / "manifest.json")
    for layer in manifest["layers"]:
        for group in ("attn_in", "moe_in"):
            entry = layer["smoothing"][group]
            # measured: e 0.95-1.0 and error / error_without_smoothing ~0.002; unsmoothed 8-bit tokens lose the
            # 49 small channels to the outliers' range
            assert 0.5 <= entry["exponent"] <= 1.0, (group, entry)
            assert entry["error"] < 0.1 * entry["error_without_smoothing"], (group, entry)
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(5))
    reference, _ = open_model(folder, torch.device("cpu"))
    full = stream_logits(reference, ids, full_precision_plan(reference))
    smoothed, unsmoothed = (calibrated_logits(tmp_path / name, ids) for name in ("haq", "none"))
    assert not torch.equal(smoothed, full)
    assert float((smoothed - full).abs().max()) < 0.05 * float(full.abs().max())
    # measured: mean squared logit error 2.9e-7 smoothed vs 8.6e-5 without smoothing
    assert float((smoothed - full).pow(2).mean()) < 0.1 * float((unsmoothed - full).pow(2).mean())


def test_cold_experts_use_the_fallback_and_are_still_quantized(tiny_qwen3moe, tmp_path):
    recipe = mixed(**MIXED, min_tokens=10_000)  # every expert counts as cold
    summary = calibrate(tiny_qwen3moe, recipe, "bundled", tmp_path / "cold")
    assert summary.fallback_experts == 2 * 8
    tensors = load_file(tmp_path / "cold" / "layer_000.safetensors")
    bank = load_file(tmp_path / "cold" / "layer_000.bank.safetensors")
    assert torch.isfinite(bank["experts.down.b4.scale"]).all()
    assert math.isfinite(float(tensors["loss_table"].sum()))


def test_too_short_calibration_text(tiny_qwen3moe, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("only a handful of words")
    with pytest.raises(HexqError, match="too short"):
        calibrate(tiny_qwen3moe, small("haq-w8a8"), str(text), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_group_size_not_dividing_a_width(tiny_qwen3moe, tmp_path):
    recipe = small("experts-mixed", weights=WeightQuant(group_size=24))
    with pytest.raises(HexqError, match="24"):
        calibrate(tiny_qwen3moe, recipe, "bundled", tmp_path / "out")


def test_cli_calibrate_then_eval(tiny_qwen3moe, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cal"
    result = runner.invoke(app, ["calibrate", str(tiny_qwen3moe), "-r", "haq-w8a8", "-o", str(out), "-n", "4",
                                 "-L", "32"])
    assert result.exit_code == 0, result.output
    assert "calibrated 2 layers" in result.output
    result = runner.invoke(app, ["eval", str(out), "-d", "austen", "-L", "32", "-n", "2"])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(app, ["calibrate", str(tiny_qwen3moe), "-r", "no-such-recipe", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "haq-w8a8" in bad.output


def test_experts_setting_is_typed():
    with pytest.raises(HexqError):
        Experts(mode="replicas", replica_bits=(4, 2))


@pytest.mark.parametrize("recipe_name", ["experts-mixed", "experts-vllm", "experts-vllm-g32"])
def test_every_expert_calibrated_whatever_its_token_count(tiny_qwen3moe, tmp_path, recipe_name):
    """One window of 4 tokens (8 routed slots over 8 experts): experts with 0, 1 and a few tokens, all below
    min_tokens, each gets a full bank from the layer-wide fallback Hessian and a finite loss-table row; the summary
    counts them."""
    from dataclasses import replace

    recipe = small_recipe(recipe_name)
    if recipe.expert_weights.group_size and recipe.expert_weights.group_size > 16:  # the tiny experts are 16 wide
        recipe = replace(recipe, experts=replace(recipe.experts,
                                                 weights=replace(recipe.expert_weights, group_size=16)))
    recipe = replace(recipe, calibration=Calibration(num_samples=1, seqlen=4, seed=0))
    out = tmp_path / "cal"
    summary = calibrate(tiny_qwen3moe, recipe, "bundled", out)
    counts = set()
    fallback = 0
    for index in range(summary.layers):
        tensors = load_file(out / f"layer_{index:03d}.safetensors")
        tokens = tensors["experts.tokens"]
        counts |= set(tokens.tolist())
        assert torch.isfinite(tensors["loss_table"]).all() and torch.isfinite(tensors["loss_table.skip"]).all()
        meta = read_json(out / f"layer_{index:03d}.json")
        assert sorted(meta["fallback_experts"]) == [e for e in range(8) if tokens[e] < recipe.experts.min_tokens]
        fallback += len(meta["fallback_experts"])
        bank = load_file(out / f"layer_{index:03d}.bank.safetensors")
        for bits in recipe.experts.replica_bits:
            assert torch.isfinite(bank[f"experts.down.b{bits}.scale"].float()).all()
    assert {0, 1} <= counts and any(1 < c < recipe.experts.min_tokens for c in counts), counts
    assert summary.fallback_experts == fallback == 2 * 8
