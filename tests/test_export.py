"""compressed-tensors export: exact reload of hexq's dequantized weights, the format details vLLM reads, and the
guard against checkpoints whose expert keys transformers silently skips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file, save_file

from hexq.adapters import adapter_for
from hexq.algos.quant import QuantSpec, quantize
from hexq.artifact.export import export_compressed_tensors, load_exported
from hexq.errors import HexqError

# (model_type, size overrides, per-layer schemes). Mixtral at hidden 256 / intermediate 128 uses real groups of
# 128 (two per gate/up row, one per down row); the default tiny Qwen3-MoE (moe_intermediate 16) falls back to
# one group of 16 for all its experts; Qwen2-MoE adds a shared expert with its own widths (32 and 24).
CASES = [
    ("mixtral", dict(hidden_size=256, intermediate_size=128), ["w4a16", "w8a8"]),
    ("qwen3_moe", {}, ["w8a8", "w4a16"]),
    ("qwen2_moe", {}, ["w4a16", "w8a8"]),
]


def _ids() -> torch.Tensor:
    return torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(_ids()).logits


@pytest.mark.parametrize(("model_type", "overrides", "schemes"), CASES)
def test_reload_reproduces_hexq_reference(tmp_path: Path, tokenizer, model_type, overrides, schemes) -> None:
    model = build_tiny_model(model_type, **overrides)
    original = _logits(model)
    out = tmp_path / "ct"
    reference = export_compressed_tensors(model, tokenizer, adapter_for(model_type), schemes, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct"]  # the temporary folder was renamed away
    assert (out / "tokenizer.json").is_file()

    loaded = load_exported(out)
    model.load_state_dict(reference)
    expected = _logits(model)
    assert (_logits(loaded) - expected).abs().max() <= 1e-4
    assert (expected - original).abs().max() > 1e-3  # the weights really were quantized
    loaded_state = loaded.state_dict()
    assert all(torch.equal(loaded_state[name], tensor) for name, tensor in reference.items())


def test_mixtral_format_details(tmp_path: Path) -> None:
    model = build_tiny_model("mixtral", hidden_size=256, intermediate_size=128)
    export_compressed_tensors(model, None, adapter_for("mixtral"), ["w4a16", "w8a8"], tmp_path)  # replaces it
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*"))  # no temporary or moved-aside folder left
    qconfig = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == "mixed-precision"
    groups = qconfig["config_groups"]
    assert groups["w4a16_g128"]["format"] == "pack-quantized" and groups["w4a16_g128"]["input_activations"] is None
    assert groups["w4a16_g128"]["weights"].items() >= {"num_bits": 4, "symmetric": True, "strategy": "group",
                                                       "group_size": 128}.items()
    assert groups["w4a16_g128"]["targets"] == [r"re:model\.layers\.0\.block_sparse_moe\.experts\.\d+\."]
    assert groups["w8a8"]["format"] == "int-quantized"
    assert groups["w8a8"]["input_activations"].items() >= {"num_bits": 8, "strategy": "token", "dynamic": True}.items()
    assert "model.layers.0.self_attn.q_proj" in groups["w8a8"]["targets"]

    tensors = load_file(tmp_path / "model.safetensors")
    w1 = "model.layers.0.block_sparse_moe.experts.3.w1"  # Mixtral's original per-expert names
    assert tensors[f"{w1}.weight_packed"].dtype == torch.int32 and tensors[f"{w1}.weight_packed"].shape == (128, 32)
    assert tensors[f"{w1}.weight_scale"].shape == (128, 2) and tensors[f"{w1}.weight_shape"].tolist() == [128, 256]
    w2 = "model.layers.1.block_sparse_moe.experts.3.w2"
    assert tensors[f"{w2}.weight"].dtype == torch.int8 and tensors[f"{w2}.weight_scale"].shape == (256, 1)
    assert tensors["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32  # router stays dense
    assert not any("zero_point" in key or "gate_up_proj" in key for key in tensors)


@pytest.mark.parametrize(("bits", "group", "strategy"), [(4, 128, "group"), (8, None, "channel")])
def test_hexq_grid_is_compressed_tensors_grid(bits: int, group: int | None, strategy: str) -> None:
    """compressed-tensors' symmetric scale max|w| / ((qmax - qmin) / 2) and its signed codes are hexq's."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    codes, meta = quantize(w, QuantSpec(bits=bits, group_size=group))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group)
    grouped = w.reshape(16, -1, group or 256)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    torch.testing.assert_close(scale, meta.scale, rtol=1e-6, atol=0)
    signed = ct_quantize(w, meta.scale, torch.zeros_like(meta.scale), args, dtype=torch.int8)
    assert torch.equal(signed.to(torch.int16), codes.to(torch.int16) - 2 ** (bits - 1))


def _rename_experts(folder: Path, renames: dict[str, str]) -> None:
    """Rename dotted name segments in the tensors and config targets, as a wrong exporter would write them."""
    def sub(text: str) -> str:
        for old, new in renames.items():
            text = re.sub(rf"(?<=\.){old}(?=\\?\.)", new, text)
        return text

    path = folder / "model.safetensors"
    save_file({sub(key): tensor for key, tensor in load_file(path).items()}, path)
    config = json.loads((folder / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [sub(target) for target in group["targets"]]
    (folder / "config.json").write_text(json.dumps(config))


# llmcompressor writes Mixtral experts under their linearized in-memory names; the reverse mistake on Qwen3-MoE
# uses Mixtral's names. transformers' conversion mapping matches neither, so it loads those experts as random.
WRONG_NAMES = [
    ("mixtral", dict(hidden_size=256, intermediate_size=128),
     {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    ("qwen3_moe", {}, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
]


@pytest.mark.parametrize(("model_type", "overrides", "renames"), WRONG_NAMES)
def test_guard_rejects_expert_keys_transformers_skips(tmp_path: Path, model_type, overrides, renames) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = build_tiny_model(model_type, **overrides)
    model.load_state_dict(export_compressed_tensors(model, None, adapter_for(model_type), ["w4a16", "w8a8"],
                                                    tmp_path))
    _rename_experts(tmp_path, renames)

    # The class of bug is real: transformers' own compressed-tensors loading (dequantize on load, formerly
    # run_compressed=False) accepts the folder, loads attention right and leaves the experts random.
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    got, want = plain.state_dict(), model.state_dict()
    attention, experts = "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(got[attention], want[attention]) and not torch.equal(got[experts], want[experts])
    for module in plain.modules():  # switch off the w8a8 activation emulation: compare the weights' effect alone
        module.quantization_enabled = False
    assert (_logits(plain) - _logits(model)).abs().max() > 1e-3

    with pytest.raises(HexqError, match="missing") as raised:
        load_exported(tmp_path)
    message = str(raised.value)
    assert "model.layers.0.mlp.experts.gate_up_proj" in message and "model.layers.1.mlp.experts.down_proj" in message
    assert f"model.layers.0.mlp.experts.0.{renames['w1' if 'w1' in renames else 'gate_proj']}.weight" in message


def test_guard_rejects_a_weight_that_changed_on_load(tmp_path: Path, monkeypatch) -> None:
    """Keys can all match and a loader still be wrong: the value check names the tensor."""
    import transformers.core_model_loading as loading

    model = build_tiny_model("qwen3_moe")
    export_compressed_tensors(model, None, adapter_for("qwen3_moe"), ["w4a16", "w4a16"], tmp_path)
    merge = loading.MergeModulelist.convert

    def reversed_experts(self, input_dict, *args, **kwargs):  # a loader that permutes the experts
        return {key: value.flip(0) for key, value in merge(self, input_dict, *args, **kwargs).items()}

    monkeypatch.setattr(loading.MergeModulelist, "convert", reversed_experts)
    with pytest.raises(HexqError, match=r"different after loading: .*experts\.\d+\.(gate|up|down)_proj\.weight"):
        load_exported(tmp_path)


def test_rejects_bad_schemes(tmp_path: Path) -> None:
    model = build_tiny_model("mixtral")
    adapter = adapter_for("mixtral")
    with pytest.raises(HexqError, match="allowed: w4a16, w8a8"):
        export_compressed_tensors(model, None, adapter, ["w4a16", "w3a16"], tmp_path / "a")
    with pytest.raises(HexqError, match="2 layers"):
        export_compressed_tensors(model, None, adapter, ["w4a16"], tmp_path / "b")
    with pytest.raises(HexqError, match=r"input widths \[16, 32\] .* group size 12"):
        export_compressed_tensors(model, None, adapter, ["w4a16", "w8a8"], tmp_path / "c", group_size=12)
    assert not any(tmp_path.iterdir())
