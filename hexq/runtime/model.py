"""A model computing as the artifact says: built from its config, non-expert weights from dense.safetensors
(quantized linears dequantized, activation quantization attached), and each layer's routed-experts module
replaced in one place by a module the caller chooses (all experts resident at the allocation, or the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hexq.adapters import adapter_for
from hexq.artifact.format import DENSE_SHARD, Artifact, PackedWeight, dequantize_packed
from hexq.errors import HexqError
from hexq.models import pick_device
from hexq.recipe import recipe_from_dict
from hexq.simulate import ActQuantizer, SimulatedExperts, act_quantizer, attach_input_quant

ExpertsFactory = Callable[[int, torch.nn.Module], torch.nn.Module]


def expert_quantizers(artifact: Artifact, layer: int) -> tuple[ActQuantizer | None, ActQuantizer | None]:
    """(input, intermediate) activation quantizers of a layer's routed experts, from the recipe."""
    setting = recipe_from_dict(artifact.manifest["recipe"]).expert_activations
    if setting.bits is None:
        return None, None
    shard = f"experts/layer_{layer:03d}.safetensors"
    keys = set(artifact.keys(shard))
    ranges = [artifact.tensor(shard, key) if key in keys else None for key in ("act.input", "act.mid")]
    return act_quantizer(setting, ranges[0]), act_quantizer(setting, ranges[1])


def resident_experts(artifact: Artifact, layer: int, bits: list[int], act_fn,
                     dtype: torch.dtype = torch.float32) -> SimulatedExperts:
    """All of a layer's experts dequantized at `bits[e]` (0: skipped, zero weights) in one fused module."""
    weights = [artifact.expert_weights(layer, expert, b, dtype) for expert, b in enumerate(bits)]
    return SimulatedExperts(torch.stack([w[0] for w in weights]), torch.stack([w[1] for w in weights]), act_fn,
                            *expert_quantizers(artifact, layer))


def load_dense(model: torch.nn.Module, artifact: Artifact) -> None:
    """Load every non-expert tensor into `model` and attach activation quantization to the quantized linears."""
    dense = artifact.shard_tensors(DENSE_SHARD)
    meta = artifact.manifest["dense"]
    setting = recipe_from_dict(artifact.manifest["recipe"]).activations
    state: dict[str, torch.Tensor] = {}
    for key, bits in meta["quantized_linears"].items():
        shape = tuple(model.get_parameter(key).shape)
        state[key] = dequantize_packed(PackedWeight(dense.pop(f"{key}.codes"), dense.pop(f"{key}.scale"),
                                                    dense.pop(f"{key}.zero"), bits, shape))
        module = model.get_submodule(key.removesuffix(".weight"))
        quantizer = act_quantizer(setting, dense.pop(f"{key.removesuffix('.weight')}.act_range", None))
        if quantizer is not None:
            attach_input_quant(module, quantizer)
    state.update({key: tensor.float() for key, tensor in dense.items()})
    result = model.load_state_dict(state, strict=False)
    experts = f".{artifact.manifest['model']['moe']}.{artifact.manifest['model']['experts']}."
    missing = [key for key in result.missing_keys if experts not in key and key not in meta["aliases"]]
    if missing or result.unexpected_keys:
        raise HexqError(f"{artifact.path}: dense weights do not fit the model built from its config "
                        f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")


def build_model(artifact: Artifact | str | Path, experts: ExpertsFactory | None = None, device: str | None = None):
    """(model, tokenizer, artifact) in eval mode. `experts(layer, old_module)` returns each layer's routed-experts
    module; by default every expert is resident at the artifact's allocation."""
    artifact = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    for name in ("config.json", "tokenizer.json"):
        if name in artifact.files:
            artifact.verify(name)
    config = AutoConfig.from_pretrained(artifact.path)
    adapter = adapter_for(config.model_type)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_dense(model, artifact)
    allocation = artifact.allocation
    for index, layer in enumerate(model.model.layers):
        moe = getattr(layer, adapter.moe)
        old = getattr(moe, adapter.experts)
        new = experts(index, old) if experts else resident_experts(artifact, index, allocation[index], old.act_fn)
        setattr(moe, adapter.experts, new)
    tokenizer = AutoTokenizer.from_pretrained(artifact.path)
    return model.to(pick_device(device)).eval(), tokenizer, artifact
