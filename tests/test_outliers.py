import pytest
import torch

from hexq.algos.smoothing import activation_channel_max, search_exponent
from hexq.calib.fold import ATTN_IN, MOE_IN, smoothing_groups
from hexq.model.adapters import adapter_for
from tests.conftest import TINY_CONFIGS, build_tiny_model

from outliers import inject_outliers

IDS = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))


def logits_and_norm_outputs(model, adapter):
    """Logits, and {(layer, group): norm output [T, C]} for every smoothing group, on the fixed input ids."""
    outputs, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        for group in smoothing_groups(layer, adapter):
            handles.append(group.norm.register_forward_hook(
                lambda _m, _i, out, key=(index, group.name): outputs.__setitem__(key, out.reshape(-1, out.shape[-1]))))
    try:
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, outputs


def max_over_median(x: torch.Tensor) -> float:
    channel_max = activation_channel_max(x)
    return float(channel_max.max() / channel_max.median())


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_injection_preserves_logits_and_creates_outlier_channels(model_type):
    model, adapter = build_tiny_model(model_type), adapter_for(model_type)
    logits, before = logits_and_norm_outputs(model, adapter)
    changed = inject_outliers(model, adapter, channels_per_norm=4, factor=50.0, seed=0)
    injected_logits, after = logits_and_norm_outputs(model, adapter)

    assert (injected_logits - logits).abs().max() <= 1e-4 * logits.abs().max()
    groups = {(layer, group.name) for layer in range(2)
              for group in smoothing_groups(model.model.layers[layer], adapter)}
    assert set(changed) == groups and {(layer, name) for layer in range(2) for name in (ATTN_IN, MOE_IN)} <= groups
    for key, channels in changed.items():
        assert len(set(channels)) == 4 and list(channels) == sorted(channels)
        x0, x1 = before[key], after[key]
        # the chosen channels are exactly 50x larger, the others untouched
        assert torch.allclose(x1[:, list(channels)], 50.0 * x0[:, list(channels)], rtol=1e-4, atol=1e-6)
        others = [c for c in range(x0.shape[1]) if c not in channels]
        assert torch.allclose(x1[:, others], x0[:, others], rtol=1e-5, atol=1e-6)
        # max/median of per-channel max|X| goes from ~1.5 (random model) to roughly the factor
        assert max_over_median(x0) < 3.0
        assert max_over_median(x1) > 0.5 * 50.0


def test_injection_is_seeded():
    adapter = adapter_for("mixtral")
    first = inject_outliers(build_tiny_model("mixtral"), adapter, seed=3)
    assert inject_outliers(build_tiny_model("mixtral"), adapter, seed=3) == first
    assert inject_outliers(build_tiny_model("mixtral"), adapter, seed=4) != first
    with pytest.raises(ValueError, match="factor"):
        inject_outliers(build_tiny_model("mixtral"), adapter, factor=0.0)
    with pytest.raises(ValueError, match="channels_per_norm"):
        inject_outliers(build_tiny_model("mixtral"), adapter, channels_per_norm=33)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_search_migrates_injected_outliers_under_w8a8(model_type):
    model, adapter = build_tiny_model(model_type), adapter_for(model_type)
    inject_outliers(model, adapter, channels_per_norm=4, factor=50.0)
    _, outputs = logits_and_norm_outputs(model, adapter)
    for group in smoothing_groups(model.model.layers[0], adapter):
        x = outputs[(0, group.name)]
        result = search_exponent(group.weights(), x, grid_step=0.05, a_bits=8, quantize_weights=group.quantized())
        assert result.exponent > 0, group.name
        assert result.error < 0.5 * result.baseline_error, group.name
        # e = 0 is the unsmoothed model: s = 1 and the recorded baseline
        assert result.errors[0] == result.baseline_error
