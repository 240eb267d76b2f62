import torch

from hexq.model.adapters import adapter_for
from tests.conftest import build_tiny_model

from reference import capture_router_counts


def test_router_counts_match_a_recomputation_from_router_inputs():
    model = build_tiny_model("mixtral")
    adapter = adapter_for("mixtral")
    ids = torch.randint(0, 8192, (2, 10), generator=torch.Generator().manual_seed(0))
    router_inputs = []
    pre_hooks = [layer.mlp.gate.register_forward_pre_hook(lambda m, args: router_inputs.append(args[0]))
                 for layer in model.model.layers]
    with torch.no_grad(), capture_router_counts(model, adapter, num_experts=4) as stats:
        model(input_ids=ids)
    for hook in pre_hooks:
        hook.remove()
    for layer_index, (layer, x) in enumerate(zip(model.model.layers, router_inputs, strict=True)):
        chosen = (x @ layer.mlp.gate.weight.T).softmax(dim=-1).topk(2, dim=-1).indices
        assert torch.equal(stats.counts[layer_index], torch.bincount(chosen.reshape(-1), minlength=4))
    assert stats.counts.sum(dim=1).tolist() == [2 * 10 * 2] * 2  # top-2 of 20 tokens, 2 layers
    assert torch.allclose(stats.load.sum(dim=1), torch.ones(2, dtype=torch.float64))
    with torch.no_grad():  # hooks are removed when the block ends
        model(input_ids=ids)
    assert stats.counts.sum() == 80
