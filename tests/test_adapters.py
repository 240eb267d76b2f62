"""The adapters' data checked against transformers' own classes: module names, MoE layers, routing."""

import pytest
import torch

from hexq.base.errors import HexqError
from hexq.model.adapters import (
    ADAPTERS,
    SIGMOID_BIAS_GROUP_TOPK,
    adapter_for,
    check_moe_layers,
    moe_layer_indices,
    supported_types,
)
from tests.conftest import TINY_CONFIGS, build_tiny_model
from tests.routing_reference import route


def submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:  # absent, or set to None (DeepSeek's q_proj when q_lora_rank is set)
        return None


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
        if adapter.routing.bias:
            assert getattr(router, adapter.routing.bias).shape == (num_experts,)
        # transformers 5.x fused layout: gate_up [E, 2I, H], down [E, H, I]
        gate_up, down = experts.gate_up_proj, experts.down_proj
        assert gate_up.shape[0] == down.shape[0] == num_experts
        assert gate_up.shape[2] == down.shape[1] == hidden
        assert gate_up.shape[1] == 2 * down.shape[2]
        has_shared = any(hasattr(moe, name) for name in ("shared_expert", "shared_experts"))
        assert (adapter.shared_expert is None) == (not has_shared)
        if adapter.shared_expert:
            shared = getattr(moe, adapter.shared_expert)
            assert all(isinstance(getattr(shared, n), torch.nn.Linear) for n in adapter.dense_mlp_inputs)
        assert (adapter.shared_expert_gate is None) == (not hasattr(moe, "shared_expert_gate"))
        if adapter.shared_expert_gate:
            assert getattr(moe, adapter.shared_expert_gate).weight.shape == (1, hidden)
        for group in adapter.attention_groups:
            present = [r for r in group.readers if isinstance(submodule(layer, r), torch.nn.Linear)]
            assert (submodule(layer, group.norm) is None) == (not present), group.name  # norm and readers, or none
        assert isinstance(getattr(layer, adapter.input_norm), torch.nn.Module)
        assert isinstance(getattr(layer, adapter.post_attention_norm), torch.nn.Module)


# ------------------------------------------------------------------------------------------ MoE layers

DENSE_CASES = [
    ("mixtral", {}),
    ("olmoe", {}),
    ("phimoe", {}),
    ("qwen3_moe", {"mlp_only_layers": [0, 2]}),
    ("qwen3_moe", {"decoder_sparse_step": 2}),
    ("qwen2_moe", {"mlp_only_layers": [3], "decoder_sparse_step": 1}),
    ("qwen2_moe", {"decoder_sparse_step": 3}),
    ("deepseek_v2", {"first_k_dense_replace": 2}),
    ("deepseek_v3", {"first_k_dense_replace": 1}),
    ("deepseek_v3", {"first_k_dense_replace": 0}),
]


@pytest.mark.parametrize(("model_type", "overrides"), DENSE_CASES)
def test_moe_layers_from_the_config_are_the_layers_transformers_builds_with_experts(model_type, overrides):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter = adapter_for(model_type)
    kwargs = dict(vocab_size=64, num_hidden_layers=4) | TINY_CONFIGS[model_type] | overrides
    config = AutoConfig.for_model(model_type, **kwargs)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    built = [i for i, layer in enumerate(model.model.layers) if hasattr(getattr(layer, adapter.moe), adapter.experts)]
    assert moe_layer_indices(adapter, config) == built
    assert moe_layer_indices(adapter, config.to_dict()) == built  # a config.json read as a dict gives the same
    assert check_moe_layers(adapter, config, built) == built
    if len(built) < 4:
        assert built != list(range(4))  # the case really has dense layers


def test_check_moe_layers_names_a_mismatch_and_unsupported_frequencies():
    adapter = adapter_for("deepseek_v3")
    config = {"num_hidden_layers": 3, "first_k_dense_replace": 1}
    with pytest.raises(HexqError, match=r"layers \[1, 2\] MoE layers .* routes in layers \[2\]"):
        check_moe_layers(adapter, config, [2])
    with pytest.raises(HexqError, match="moe_layer_freq 2"):
        moe_layer_indices(adapter, config | {"moe_layer_freq": 2})
    with pytest.raises(HexqError, match="no MoE layer"):
        check_moe_layers(adapter, {"num_hidden_layers": 2, "first_k_dense_replace": 2}, [])


# ------------------------------------------------------------------------------------------ routing

ROUTING_CASES = [
    ("mixtral", {}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {}),
    ("olmoe", {}),
    ("deepseek_v2", {"topk_method": "greedy", "routed_scaling_factor": 1.5}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ("deepseek_v3", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1, "norm_topk_prob": False}),
    ("phimoe", {}),
    ("phimoe", {"router_jitter_noise": 0.3}),  # several experts within the jitter band: the masked softmax matters
]


@pytest.mark.parametrize(("model_type", "overrides"), ROUTING_CASES)
def test_route_reproduces_the_family_router(model_type, overrides):
    model = build_tiny_model(model_type, num_hidden_layers=1, **overrides)
    adapter = adapter_for(model_type)
    router = getattr(getattr(model.model.layers[0], adapter.moe), adapter.router)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(generator=generator)  # random init is tiny: make the choice depend on the input
        bias = getattr(router, adapter.routing.bias) if adapter.routing.bias else None
        if bias is not None:
            bias.normal_(0.0, 0.3, generator=generator)  # large enough to change the choice
        x = torch.randn(256, model.config.hidden_size, generator=generator)
        logits, weights, ids = router(x)
    got_weights, got_ids = route(adapter.routing, model.config, logits, bias)
    # order within a token's k slots is the router's own (torch.topk sorted=False for DeepSeek): compare sorted
    order, got_order = ids.argsort(dim=-1), got_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), got_ids.gather(1, got_order))
    assert torch.allclose(weights.float().gather(1, order), got_weights.gather(1, got_order), rtol=1e-6, atol=1e-7)
    if bias is not None:  # the bias really moved choices away from the unbiased top-k
        plain_ids = route(adapter.routing, model.config, logits, None)[1]
        assert not torch.equal(plain_ids.sort(dim=-1).values, ids.sort(dim=-1).values)
        assert adapter.routing.kind == SIGMOID_BIAS_GROUP_TOPK


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(HexqError) as info:
        adapter_for("gpt2")
    message = str(info.value)
    assert "gpt2" in message
    for name in supported_types():
        assert name in message
