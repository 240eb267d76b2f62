import pytest
import torch

from hexq.adapters import ADAPTERS, adapter_for, supported_types
from hexq.errors import HexqError
from tests.conftest import TINY_CONFIGS, build_tiny_model


def test_every_adapter_has_a_tiny_config():
    assert set(TINY_CONFIGS) == set(ADAPTERS)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_adapter_names_resolve_on_a_tiny_random_model(model_type):
    model = build_tiny_model(model_type)
    adapter = adapter_for(model_type)
    num_experts = getattr(model.config, adapter.num_experts_attr)
    for layer in model.model.layers:
        moe = getattr(layer, adapter.moe)
        router = getattr(moe, adapter.router)
        experts = getattr(moe, adapter.experts)
        hidden = model.config.hidden_size
        assert router.weight.shape == (num_experts, hidden)
        # transformers 5.x fused layout: gate_up [E, 2I, H], down [E, H, I]
        gate_up, down = experts.gate_up_proj, experts.down_proj
        assert gate_up.shape[0] == down.shape[0] == num_experts
        assert gate_up.shape[2] == down.shape[1] == hidden
        assert gate_up.shape[1] == 2 * down.shape[2]
        if adapter.shared_expert:
            assert isinstance(getattr(moe, adapter.shared_expert), torch.nn.Module)
        attention = getattr(layer, adapter.attention)
        assert any(isinstance(getattr(attention, name, None), torch.nn.Linear) for name in adapter.attention_inputs)
        assert isinstance(getattr(layer, adapter.input_norm), torch.nn.Module)
        assert isinstance(getattr(layer, adapter.post_attention_norm), torch.nn.Module)


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(HexqError) as info:
        adapter_for("gpt2")
    message = str(info.value)
    assert "gpt2" in message
    for name in supported_types():
        assert name in message
