"""The llmcompressor peer: quantized experts really run in forward, on the right grid, with the activations
quantized as the scheme says, calibrated on causal activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import save_tiny_model

from llmcompressor_peer import (
    PEER_SCHEMES,
    PeerScheme,
    build_recipe,
    calibration_loader,
    peer_cost,
    quantization_scheme,
    run_peer,
)
from reference import load_model

pytest.importorskip("llmcompressor")

MODEL_TYPES = ("mixtral", "qwen3_moe")
CALIB = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return {t: save_tiny_model(tmp_path_factory.mktemp(f"peer-{t}"), t) for t in MODEL_TYPES}


@pytest.fixture(scope="module")
def peers(folders) -> dict:
    """One oneshot run per (model, scheme), shared by the tests below (about 1 s each)."""
    return {(t, s): run_peer(folders[t], s, CALIB) for t in MODEL_TYPES for s in ("w4a16", "w8a8-dyn")}


def fp_model(folder):
    return load_model(folder)[0]


def layer0_experts(model):
    return model.model.layers[0].mlp.experts


def per_token_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-row fake quantization written out (compressed-tensors' range: scale = max|x| / (2^b-1)/2)."""
    qmax = 2 ** (bits - 1)
    scale = x.abs().amax(dim=-1, keepdim=True) / ((2**bits - 1) / 2)
    return (x / scale).round().clamp(-qmax, qmax - 1) * scale


def test_scheme_table_builds_explicit_config_groups():
    assert set(PEER_SCHEMES) == {"w8a8-dyn", "w8a8-static", "w6a6", "w4a8", "w4a4", "w4a16-g32", "w4a16", "w3a16",
                                 "w2a16"}
    for name, spec in PEER_SCHEMES.items():
        qs = quantization_scheme(spec)
        assert qs.weights.num_bits == spec.weight_bits and qs.weights.symmetric
        assert qs.weights.strategy == ("group" if spec.weight_group_size else "channel")
        if spec.act_bits is None:
            assert qs.input_activations is None and not spec.smoothquant, name
        else:
            inputs = qs.input_activations
            assert inputs.num_bits == spec.act_bits and spec.smoothquant, name
            assert (inputs.strategy, inputs.dynamic) == (("token", True) if spec.act_dynamic else ("tensor", False))
        kinds = [type(m).__name__ for m in build_recipe(spec)]
        assert kinds == (["SmoothQuantModifier"] if spec.smoothquant else []) + ["GPTQModifier"]
    assert quantization_scheme(PEER_SCHEMES["w4a16-g32"]).weights.group_size == 32
    assert type(build_recipe(PeerScheme(4, method="rtn"))[-1]).__name__ == "QuantizationModifier"
    with pytest.raises(ValueError, match="weight_bits"):
        PeerScheme(9)


def test_calibration_loader_keeps_every_window_with_a_causal_mask():
    batches = list(calibration_loader(CALIB, batch_size=3))
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), CALIB)
    mask = batches[0]["attention_mask"]
    assert mask.shape == (3, 1, 32, 32)
    assert (mask[0, 0].tril() == 0).all() and (mask[0, 0].triu(1) < -1e30).sum() == 32 * 31 // 2


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-dyn"])
def test_experts_are_linearized_quantized_and_used(peers, folders, model_type, scheme):
    peer, fp = peers[(model_type, scheme)], fp_model(folders[model_type])
    bits = PEER_SCHEMES[scheme].weight_bits
    experts = layer0_experts(peer)
    assert type(experts).__name__ == "LinearExperts2D"  # llmcompressor's linearized experts, kept after oneshot
    fused = layer0_experts(fp).gate_up_proj.detach()  # [E, 2I, H]
    inter = fused.shape[1] // 2
    for index in range(fused.shape[0]):
        gate = experts[index].gate_proj
        assert str(gate.quantization_status) == "QuantizationStatus.FROZEN" and "forward" in vars(gate)
        weight, scale = gate.weight.detach(), gate.weight_scale.detach()
        assert not torch.equal(weight, fused[index, :inter])
        assert torch.allclose(weight, fused[index, :inter], atol=float(scale.max()) * 4)
        levels = weight / scale
        assert torch.allclose(levels, levels.round(), atol=1e-3)
        assert levels.round().min() >= -(2 ** (bits - 1)) and levels.round().max() <= 2 ** (bits - 1) - 1
        assert max(len(torch.unique(row)) for row in weight) <= 2**bits
    with torch.no_grad():
        ref, out = fp(PROBE).logits, peer(PROBE).logits
    rel = float((out - ref).norm() / ref.norm())
    assert rel > 1e-5
    if scheme == "w8a8-dyn":
        assert rel < 0.02


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_expert_inputs_are_fake_quantized_per_token(peers, model_type):
    peer = peers[(model_type, "w8a8-dyn")]
    captured = {}

    def keep(name):
        def hook(module, args, output):
            captured[name] = (module, args[0].reshape(-1, args[0].shape[-1]), output.reshape(-1, output.shape[-1]))
        return hook

    experts = layer0_experts(peer)
    handles = [experts[i].up_proj.register_forward_hook(keep(i)) for i in range(experts.num_experts)]
    try:
        with torch.no_grad():
            peer(PROBE)
    finally:
        for handle in handles:
            handle.remove()
    module, x, y = max(captured.values(), key=lambda item: item[1].shape[0])
    assert x.shape[0] > 1
    assert not torch.allclose(y, F.linear(x, module.weight), atol=1e-6)
    assert torch.allclose(y, F.linear(per_token_fake_quant(x, 8), module.weight), atol=1e-5)


def test_static_scales_come_from_causal_calibration(folders):
    """Regression for the traced config dropping `_attn_implementation`: the static o_proj input scale must
    equal the max of the causal fp activations, not of bidirectional ones."""
    folder = folders["qwen3_moe"]
    fp = fp_model(folder)
    seen = []
    handle = fp.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().max()))
    with torch.no_grad():
        fp(CALIB)
    handle.remove()
    peer = run_peer(folder, PeerScheme(8, act_bits=8, act_dynamic=False), CALIB)
    scale = float(peer.model.layers[0].self_attn.o_proj.input_scale)
    assert scale == pytest.approx(float(max(seen)) / 127.5, rel=1e-3)


def test_peer_cost_measures_a_child_process(folders):
    seconds, rss = peer_cost(folders["mixtral"], "w4a16", CALIB[:2])
    assert 0 < seconds < 120
    assert 100 * 2**20 < rss < 8 * 2**30
