"""hexq pack and hexq inspect on a tiny calibrated Qwen3-MoE: layout, bytes, allocation, integrity, errors."""

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from hexq.artifact.format import FORMAT_VERSION, expert_shard
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.base.io import write_sealed_json
from hexq.calib.calibrated import calibrated_model
from hexq.calib.store import bank_prefix, bank_weights
from hexq.config.recipe import Pack
from hexq.pack.stage import Budget, pack
from hexq.packed.bitpack import packed_nbytes
from hexq.packed.weight import PackedWeight, dequantize_packed
from hexq.runtime.model import artifact_model
from hexq_cli.main import app
from tests.conftest import mixed_recipe

from reference import stream_logits

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact_25(mixed_calibration, tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "a25.hexq"
    pack(mixed_calibration[0], out, budget=Budget(avg_bits=2.5))
    return out


def target_logits(target, ids):
    streamed, _tokenizer, prepare = target
    return stream_logits(streamed, ids, prepare)


def folder_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_layout_and_allocation(artifact_25):
    artifact = Artifact(artifact_25)
    manifest = artifact.manifest
    assert manifest["format_version"] == FORMAT_VERSION
    assert set(artifact.files) >= {"dense/top.safetensors", "dense/layer_000.safetensors",
                                   "dense/layer_001.safetensors", "stats.safetensors", "config.json",
                                   "tokenizer.json", expert_shard(0), expert_shard(1)}
    assert artifact.moe_layers == [0, 1] and artifact.bank_bits == []
    order = manifest["allocation"]["importance_order"]
    for layer, row in enumerate(artifact.allocation):
        assert len(row) == 8 and sum(row) <= math.floor(2.5 * 8)
        ranked = [row[e] for e in order[layer]]
        assert ranked == sorted(ranked, reverse=True)  # prefix-structured: widths never rise down the order
    assert manifest["provenance"]["model_sha256"] and manifest["provenance"]["data_sha256"]
    assert all(len(hot) == 2 for hot in manifest["placement"]["hot"])  # 25% of 8 experts


def test_replica_bytes_are_dense_bit_packing_plus_scales(artifact_25):
    artifact = Artifact(artifact_25)
    for expert in range(8):
        (bits,) = artifact.stored_bits(1, expert)  # only the allocated width is stored without --bank
        for projection in ("gate_up", "down"):
            weight = artifact.packed_expert(1, expert, bits, projection)
            rows, cols = weight.shape
            assert weight.codes.numel() == packed_nbytes(rows * cols, bits) == math.ceil(bits * rows * cols / 8)
            assert weight.scale.shape == weight.zero.shape == (rows, cols // 16)
        other = next(b for b in artifact.replica_bits if b != bits)
        with pytest.raises(HexqError, match=f"pack with --bank {other}"):
            artifact.packed_expert(1, expert, other, "down")
    stored = artifact.manifest["accounting"]["stored_expert_bytes"]
    assert stored == artifact.manifest["accounting"]["allocated_expert_bytes"]
    on_disk = sum(p.stat().st_size for p in artifact_25.rglob("*") if p.is_file())
    accounted = artifact.manifest["accounting"]["files_bytes"] + (artifact_25 / "manifest.json").stat().st_size
    assert abs(on_disk - accounted) <= 0.01 * on_disk


def test_resident_model_matches_the_calibrated_model(mixed_calibration, tmp_path):
    """A uniform 4-bit artifact computes what the calibration's 4-bit replicas compute (up to float16 scales)."""
    out = tmp_path / "u4.hexq"
    pack(mixed_calibration[0], out, Pack(widths=(4,), avg_bits=4.0))
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    got = target_logits(artifact_model(out, torch.device("cpu")), ids)
    want = target_logits(calibrated_model(mixed_calibration[0], torch.device("cpu"), 4), ids)
    # float16 scales move weights by ~1e-3 relative; dynamic int8 activations can round a few values differently
    assert (got - want).abs().max() < 1e-2 * want.abs().max()


def test_stored_replicas_dequantize_to_the_calibration_weights(mixed_calibration, tmp_path):
    """Exactly the calibration's packed codes and float16 scales, for every stored width (--bank all)."""
    out = tmp_path / "bank.hexq"
    pack(mixed_calibration[0], out, budget=Budget(avg_bits=2.5), bank=("all",))
    tensors = load_file(mixed_calibration[0] / "layer_001.bank.safetensors")
    artifact = Artifact(out)
    assert artifact.bank_bits == [1, 2, 3, 4, 8]
    for bits in (1, 3, 8):
        want = bank_weights(tensors, "down", bits, [5], (32, 16))[0]
        assert torch.equal(artifact.expert_weights(1, 5, bits)[1], want)


def test_a_chunk_of_replicas_dequantizes_as_its_experts_one_by_one(mixed_calibration):
    """bank_weights reads consecutive experts' whole-byte streams as one matrix: the same values as each expert's own
    stream, at every width (1 and 3 bits: codes packed across byte boundaries)."""
    tensors = load_file(mixed_calibration[0] / "layer_001.bank.safetensors")
    experts = [2, 3, 4, 5]
    for bits in (1, 2, 3, 4, 8):
        for projection, shape in (("gate_up", (32, 32)), ("down", (32, 16))):
            chunk = bank_weights(tensors, projection, bits, experts, shape)
            prefix = bank_prefix(projection, bits)
            one_by_one = torch.stack([dequantize_packed(PackedWeight(
                *(tensors[f"{prefix}.{part}"][e] for part in ("codes", "scale", "zero")), bits, shape))
                for e in experts])
            assert chunk.shape == (len(experts), *shape) and torch.equal(chunk, one_by_one), (bits, projection)


def test_same_inputs_give_the_same_bytes(mixed_calibration, artifact_25, tmp_path):
    again = tmp_path / "again.hexq"
    pack(mixed_calibration[0], again, budget=Budget(avg_bits=2.5))
    assert folder_bytes(again) == folder_bytes(artifact_25)


def test_byte_budget_with_cosine_schedule_is_never_exceeded(mixed_calibration, tmp_path):
    full = Artifact(pack(mixed_calibration[0], tmp_path / "a3.hexq", budget=Budget(avg_bits=3.0)).out)
    budget = full.manifest["accounting"]["allocated_expert_bytes"]
    out = tmp_path / "bytes.hexq"
    summary = pack(mixed_calibration[0], out, Pack(schedule="cosine", cosine_lambda=0.3), Budget(total_bytes=budget))
    assert summary.allocated_bytes <= budget
    rows = Artifact(out).allocation
    assert sum(rows[0]) >= sum(rows[-1])  # the cosine schedule keeps more in the first layer


def test_one_expert_reads_one_shard_and_corruption_is_named(artifact_25, tmp_path):
    broken = tmp_path / "broken.hexq"
    shutil.copytree(artifact_25, broken)
    shard = broken / expert_shard(1)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    artifact = Artifact(broken)
    bits0, bits1 = artifact.allocation[0][2], artifact.allocation[1][2]
    gate_up, down = artifact.expert_weights(0, 2, bits0)  # layer 0's shard is intact and is all that is read
    assert torch.isfinite(gate_up).all() and torch.isfinite(down).all()
    with pytest.raises(HexqError, match=r"layer_001\.safetensors is corrupt: sha256 .* manifest says"):
        artifact.expert_weights(1, 2, bits1)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(HexqError, match=r"truncated .* bytes, manifest says"):
        Artifact(broken).expert_weights(1, 2, bits1)


def test_newer_format_version_is_refused(artifact_25, tmp_path):
    newer = tmp_path / "newer.hexq"
    shutil.copytree(artifact_25, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    write_sealed_json(newer / "manifest.json", manifest | {"format_version": FORMAT_VERSION + 1})
    with pytest.raises(HexqError, match="newer than this hexq reads"):
        Artifact(newer)


def test_an_edited_manifest_is_named_even_when_every_shard_is_intact(artifact_25, tmp_path):
    """Changing the allocation (or top_k, or the group size) in manifest.json would change what the runtime serves
    without touching a shard: the manifest's seal names the edit, and inspect's checksums fail."""
    edited = tmp_path / "edited.hexq"
    shutil.copytree(artifact_25, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    for change in ({"allocation": manifest["allocation"] | {"bits": [[4] * 8] * 2}},
                   {"model": manifest["model"] | {"top_k": 3}},
                   {"experts": manifest["experts"] | {"group_size": 32}}):
        (edited / "manifest.json").write_text(json.dumps(manifest | change, indent=2) + "\n")
        with pytest.raises(HexqError, match="manifest.json was changed after hexq wrote it"):
            Artifact(edited)
        result = runner.invoke(app, ["inspect", str(edited)])
        assert result.exit_code == 1 and "changed after hexq wrote it" in result.output
    (edited / "manifest.sha256").unlink()
    with pytest.raises(HexqError, match="manifest.sha256 is missing"):
        Artifact(edited)


def test_a_resealed_manifest_with_impossible_fields_is_refused(artifact_25, tmp_path):
    edited = tmp_path / "edited.hexq"
    shutil.copytree(artifact_25, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    for change, field in (({"model": manifest["model"] | {"top_k": 9}}, "top_k"),
                          ({"allocation": manifest["allocation"] | {"bits": [[5] * 8] * 2}}, "allocation.bits"),
                          ({"experts": manifest["experts"] | {"group_size": 7}}, "group size"),
                          ({"model": manifest["model"] | {"moe_layers": [1, 0]}}, "moe_layers")):
        write_sealed_json(edited / "manifest.json", manifest | change)
        with pytest.raises(HexqError, match=field):
            Artifact(edited)


def test_infeasible_budget_names_the_minimum_and_leaves_nothing(mixed_calibration, tmp_path):
    out = tmp_path / "tiny.hexq"
    with pytest.raises(HexqError, match="minimum that fits is"):
        pack(mixed_calibration[0], out, budget=Budget(total_bytes=1000))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_changed_source_model_is_refused(mixed_calibration, tmp_path):
    calib = tmp_path / "cal"
    shutil.copytree(mixed_calibration[0], calib)
    manifest = json.loads((calib / "manifest.json").read_text())
    manifest["fingerprint"]["model"] = "0" * 64
    write_sealed_json(calib / "manifest.json", manifest)  # as if the model had changed after calibrating
    with pytest.raises(HexqError, match="changed since"):
        pack(calib, tmp_path / "x.hexq")
    (calib / "manifest.json").write_text(json.dumps(manifest))  # an edit without the seal is named as such
    with pytest.raises(HexqError, match="manifest.json was changed after hexq wrote it"):
        pack(calib, tmp_path / "x.hexq")


def test_a_calibration_manifest_missing_a_field_is_named(mixed_calibration, tmp_path):
    """The calibration manifest is read into one typed record (hexq.calib.store.read_manifest): a field it lacks, or
    holds with the wrong type, is named in one line, before any work starts."""
    calib = tmp_path / "cal"
    shutil.copytree(mixed_calibration[0], calib)
    manifest = json.loads((calib / "manifest.json").read_text())
    for change, field in (({"model": {k: v for k, v in manifest["model"].items() if k != "moe_layers"}},
                           "model.moe_layers"),
                          ({"expert_bits": "2,3"}, "expert_bits of type list"),
                          ({"model": manifest["model"] | {"top_k": True}}, "model.top_k")):
        write_sealed_json(calib / "manifest.json", manifest | change)
        with pytest.raises(HexqError, match=field):
            pack(calib, tmp_path / "x.hexq")
        assert not (tmp_path / "x.hexq").exists()


def test_a_corrupt_calibration_file_is_named(mixed_calibration, tmp_path):
    calib = tmp_path / "cal"
    shutil.copytree(mixed_calibration[0], calib)
    bank = calib / "layer_001.bank.safetensors"
    data = bytearray(bank.read_bytes())
    data[-7] ^= 0x10  # one flipped bit in a packed code: a silently different expert without the check
    bank.write_bytes(bytes(data))
    with pytest.raises(HexqError, match=r"layer_001\.bank\.safetensors is corrupt: sha256"):
        pack(calib, tmp_path / "x.hexq")
    assert not (tmp_path / "x.hexq").exists()


def test_cli_pack_and_inspect(mixed_calibration, tmp_path):
    out = tmp_path / "cli.hexq"
    result = runner.invoke(app, ["pack", str(mixed_calibration[0]), "-o", str(out), "--bits", "3"])
    assert result.exit_code == 0, result.output
    again = runner.invoke(app, ["pack", str(mixed_calibration[0]), "-o", str(out), "--bits", "3"])
    assert again.exit_code == 1 and "--force" in again.output
    report = tmp_path / "inspect.json"
    result = runner.invoke(app, ["inspect", str(out), "--json", str(report)])
    assert result.exit_code == 0, result.output
    info = json.loads(report.read_text())
    assert info["checksums_ok"] and info["allocation"]["average_bits"] <= 3.0
    assert info["accounting"]["head"] == "8-bit codes" and "(head 8-bit codes)" in result.output  # experts-mixed's
    assert sum(sum(row["histogram"].values()) for row in info["allocation"]["layers"]) == 2 * 8
    bad = runner.invoke(app, ["pack", str(mixed_calibration[0]), "-o", str(tmp_path / "b"), "--expert-bytes", "lots"])
    assert bad.exit_code == 1 and "cannot read 'lots' as a size" in bad.output
    old = runner.invoke(app, ["pack", str(mixed_calibration[0]), "-o", str(tmp_path / "b"), "--budget", "3MB"])
    assert old.exit_code == 2 and "No such option: --budget" in old.output  # pack's byte budget is --expert-bytes
    assert not (tmp_path / "b").exists()


def test_pack_settings_must_match_the_replicas(mixed_calibration, tmp_path):
    with pytest.raises(HexqError, match=r"need replicas at \[5\] bits"):
        pack(mixed_calibration[0], tmp_path / "x.hexq", replace(Pack(), widths=(2, 5), avg_bits=3.0))


def test_bank_export_keeps_only_the_replicas_export_projects(mixed_calibration, tmp_path):
    """--bank export stores the 4-bit replica of exactly the experts allocated a width without an exact 4-bit form,
    and hexq export writes those replicas in their place."""
    from hexq.artifact.format import export_shard

    settings = replace(Pack(), widths=(1, 2, 4, 8))
    pack(mixed_calibration[0], tmp_path / "x.hexq", settings, budget=Budget(avg_bits=4.5), bank=("export",))
    artifact = Artifact(tmp_path / "x.hexq")
    kept = artifact.export_section["replicas"]
    for layer, row in zip(artifact.moe_layers, artifact.allocation, strict=True):
        eights = [e for e, bits in enumerate(row) if bits == 8]
        assert kept.get(str(layer), []) == eights
        if eights:
            keys = artifact.keys(export_shard(layer))
            assert keys == {f"e{e:04d}.b4.{p}.{part}" for e in eights for p in ("gate_up", "down")
                            for part in ("codes", "scale", "zero")}
    assert kept and artifact.bank_bits == []  # no bank for every expert: only the projected ones' replicas
    result = runner.invoke(app, ["export", str(tmp_path / "x.hexq"), "-o", str(tmp_path / "ct"), "-n", "2", "-L", "32",
                                 "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    projected = [c for layer in json.loads((tmp_path / "r.json").read_text())["experts"] for c in layer["projected"]]
    assert projected and {c["source"] for c in projected} == {"export-replica"}


def test_pack_never_replaces_its_input_a_parent_or_a_user_folder(mixed_calibration, tmp_path):
    calibration = mixed_calibration[0]
    before = folder_bytes(calibration)
    for out in (calibration, calibration.parent):
        with pytest.raises(HexqError, match="input"):
            pack(calibration, out, overwrite=True)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(HexqError, match="was not written by hexq"):
        pack(calibration, user, overwrite=True)
    assert (user / "notes.txt").read_text() == "keep" and folder_bytes(calibration) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_pack_says_at_once_what_a_gguf_export_will_need(mixed_calibration, tmp_path):
    """Experts packed above 4 bits without a 4-bit replica: hexq pack says so (and how to keep one) rather than the
    GGUF export stopping at the last step; with --bank export nothing is missing and nothing is said."""
    from hexq.config.recipe import recipe_to_dict

    recipe = tmp_path / "recipe.json"  # YAML's superset: a JSON recipe file is read as YAML
    recipe.write_text(json.dumps(recipe_to_dict(replace(mixed_recipe(), pack=replace(Pack(), widths=(1, 2, 4, 8))))))
    args = ["pack", str(mixed_calibration[0]), "-r", str(recipe), "--bits", "4.5"]
    plain = runner.invoke(app, [*args, "-o", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    eights = sum(bits > 4 for row in Artifact(tmp_path / "plain").allocation for bits in row)
    assert eights and f"note: {eights} experts are stored above 4 bits" in plain.output
    assert "--bank export" in plain.output
    kept = runner.invoke(app, [*args, "-o", str(tmp_path / "kept"), "--bank", "export"])
    assert kept.exit_code == 0, kept.output
    assert "note:" not in kept.output
