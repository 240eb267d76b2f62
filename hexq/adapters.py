"""Architecture knowledge as data: where each supported MoE family keeps its router, fused experts,
shared expert and the norms that feed them.

transformers 5.x stores every family's routed experts fused: `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I]; the router returns (router_logits, router_scores, router_indices).
"""

from __future__ import annotations

from dataclasses import dataclass

from hexq.errors import HexqError


@dataclass(frozen=True)
class MoEAdapter:
    """Attribute names, relative to one decoder layer, of the parts hexq works on."""

    model_type: str
    num_experts_attr: str  # config attribute holding the routed-expert count
    moe: str = "mlp"  # the sparse MoE block inside a decoder layer
    router: str = "gate"  # inside the MoE block
    experts: str = "experts"  # inside the MoE block
    shared_expert: str | None = None  # inside the MoE block, when the family has one
    attention: str = "self_attn"
    attention_inputs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    input_norm: str = "input_layernorm"  # feeds attention_inputs: smoothing group 1
    post_attention_norm: str = "post_attention_layernorm"  # feeds router + experts (+ shared): group 2
    # How the hub's files spell what transformers renames or fuses on load (hexq.checkpoint reads them directly):
    hub_moe: str | None = None  # on-disk name of the MoE block when it differs from `moe`
    hub_router: str | None = None  # on-disk name of the router when it differs from `router`
    hub_expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert (gate, up, down)


ADAPTERS: dict[str, MoEAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        MoEAdapter("mixtral", "num_local_experts", hub_moe="block_sparse_moe",
                   hub_expert_projections=("w1", "w3", "w2")),
        MoEAdapter("qwen3_moe", "num_experts"),
        MoEAdapter("qwen2_moe", "num_experts", shared_expert="shared_expert"),
        MoEAdapter("olmoe", "num_experts"),
        MoEAdapter("deepseek_v2", "n_routed_experts", shared_expert="shared_experts",
                   attention_inputs=("q_proj", "q_a_proj", "kv_a_proj_with_mqa")),
        MoEAdapter("deepseek_v3", "n_routed_experts", shared_expert="shared_experts",
                   attention_inputs=("q_proj", "q_a_proj", "kv_a_proj_with_mqa")),
        MoEAdapter("phimoe", "num_local_experts", router="router", hub_moe="block_sparse_moe", hub_router="gate",
                   hub_expert_projections=("w1", "w3", "w2")),
    )
}


def supported_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model_type: str) -> MoEAdapter:
    """The adapter for a config.model_type; unsupported types fail naming the supported ones."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise HexqError(
            f"unsupported architecture {model_type!r}; hexq supports: {', '.join(supported_types())}"
        ) from None
