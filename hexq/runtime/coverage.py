"""Which models a decode step outside the transformers decoder computes: the native CPU step (hexq.runtime.native)
and the CUDA graph step (hexq.runtime.graph) cover the same families, for the same reasons, decided here once."""

from __future__ import annotations

from hexq.model.adapters import SOFTMAX_TOPK, adapter_for

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load (not "dynamic": it grows with length)


class NotNative(Exception):
    """Why a runtime keeps the transformers path (the message is what --stats shows)."""


def unsupported_model(runtime) -> None:
    """Raise NotNative where the model is not one a decode step outside transformers computes (this one and the CUDA
    graph step, hexq.runtime.graph): GQA attention with a static RoPE, softmax top-k routing, SiLU experts."""
    model_config = runtime.model.config
    model_type = model_config.model_type
    if model_type not in FAMILIES:
        raise NotNative(f"{model_type} is not a family the native step covers ({', '.join(FAMILIES)})")
    if adapter_for(model_type).routing.kind != SOFTMAX_TOPK:
        raise NotNative("the router is not softmax top-k")
    if getattr(model_config, "hidden_act", "silu") != "silu":
        raise NotNative(f"{model_config.hidden_act} experts (the step computes SiLU)")
    rope = (getattr(model_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        raise NotNative(f"{rope} RoPE")


def routing_normalized(config) -> bool:
    """Whether the family renormalises its top-k routing weights to sum to 1 (the adapter's rule, else the config's
    norm_topk_prob)."""
    normalize = adapter_for(config.model_type).routing.normalize
    return {"always": True, "never": False}.get(normalize, bool(getattr(config, "norm_topk_prob", False)))
