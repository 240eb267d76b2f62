"""Round-to-nearest (RTN) weight quantization of a whole MoE model: the baseline every method is compared with.

Quantized: every linear of the attention block, every routed expert's gate/up/down matrices (one grid per
expert output row, or per group), and the shared expert when there is one. Kept in full precision: embeddings,
norms, the LM head and the router, as in GPTQ and llm-compressor's MoE recipes.
"""

from __future__ import annotations

import torch

from hexq.algos.quant import QuantSpec, fake_quantize
from hexq.model.adapters import MoEAdapter


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


def fake_quantize_experts(tensor: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Fused expert tensor [E, out, in] -> each expert's [out, in] matrix fake-quantized on its own."""
    return torch.stack([fake_quantize(matrix, spec) for matrix in tensor])


@torch.no_grad()
def rtn_quantize_model(model, adapter: MoEAdapter, spec: QuantSpec) -> None:
    """Replace the model's weights in place by their RTN fake-quantized values."""
    for layer in decoder_layers(model):
        for module in getattr(layer, adapter.attention).modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quantize(module.weight, spec))
        moe = getattr(layer, adapter.moe)
        experts = getattr(moe, adapter.experts, None)
        if experts is None:  # a dense layer (DeepSeek's first layers): its MLP is quantized like the attention
            for module in moe.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(fake_quantize(module.weight, spec))
            continue
        experts.gate_up_proj.copy_(fake_quantize_experts(experts.gate_up_proj, spec))
        experts.down_proj.copy_(fake_quantize_experts(experts.down_proj, spec))
        if adapter.shared_expert:
            for module in getattr(moe, adapter.shared_expert).modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(fake_quantize(module.weight, spec))
