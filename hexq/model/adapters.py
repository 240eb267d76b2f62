"""Architecture knowledge as data: for each supported MoE family, which decoder layers route, how its router picks
experts, where it keeps the router, the fused experts, the shared expert and its gate, and which norm feeds which
projections (the smoothing groups).

transformers 5.x stores every family's routed experts fused: `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I]; the router returns (router_logits, router_scores, router_indices). Everything here
was read from transformers' modeling_<family>.py (5.17) and is checked against those classes by tests/test_adapters.py
(routing reproduced bit for bit, MoE layers against the built skeleton, smoothing groups traced).
"""

from __future__ import annotations

from dataclasses import dataclass

from hexq.base.errors import HexqError

# ------------------------------------------------------------------------------------------ smoothing groups

ATTENTION, MOE = "attention", "moe"  # the recipe's smoothing.groups entries


@dataclass(frozen=True)
class NormGroup:
    """A norm inside the decoder layer and the linears that read its output directly: one smoothing group (003
    eq. 1: W X = (W diag(s)) (diag(s)^-1 X), s^-1 folded into the norm's affine weight and bias). Readers absent from
    a config (DeepSeek's q_proj when q_lora_rank is set, q_a_proj when it is not) are skipped; a group whose norm is
    absent (q_a_layernorm without q_lora_rank) does not exist in that config."""

    name: str  # key of the group's factors in a calibration layer file: "smooth.<name>"
    section: str  # the recipe's smoothing.groups entry that selects it
    norm: str  # module path relative to the decoder layer
    readers: tuple[str, ...]  # linear module paths relative to the decoder layer


ATTN_IN, MOE_IN = "attn_in", "moe_in"
STANDARD_ATTENTION = (NormGroup(ATTN_IN, ATTENTION, "input_layernorm",
                                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),)
# DeepSeek's multi-head latent attention (modeling_deepseek_v2/v3, DeepseekV*Attention.forward):
#   q = q_b_proj(q_a_layernorm(q_a_proj(x)))      (q_proj(x) when q_lora_rank is None)
#   kv_nope, k_rot = split(kv_a_proj_with_mqa(x)); kv = kv_b_proj(kv_a_layernorm(kv_nope))
# The latent norms read a slice of kv_a_proj's output, but kv_b_proj reads kv_a_layernorm's whole output directly, so
# both latent norms are ordinary groups of one reader each.
MLA_ATTENTION = (
    NormGroup(ATTN_IN, ATTENTION, "input_layernorm",
              ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    NormGroup("q_a", ATTENTION, "self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
    NormGroup("kv_a", ATTENTION, "self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
)

# ------------------------------------------------------------------------------------------ routing

SOFTMAX_TOPK = "softmax_topk"  # softmax over E, top-k of the probabilities
SOFTMAX_GROUP_TOPK = "softmax_group_topk"  # DeepSeek-V2: softmax, config.topk_method greedy | group_limited_greedy
SIGMOID_BIAS_GROUP_TOPK = "sigmoid_bias_group_topk"  # DeepSeek-V3 noaux_tc: sigmoid + bias picks, groups by top-2 sum
SPARSEMIXER = "sparsemixer"  # PhiMoE: arg-max, then arg-max of the rest, each weighted by a masked softmax
ROUTING_KINDS = (SOFTMAX_TOPK, SOFTMAX_GROUP_TOPK, SIGMOID_BIAS_GROUP_TOPK, SPARSEMIXER)
NORMALIZE = ("always", "config", "never")  # top-k weights / their sum: always, if config.norm_topk_prob, never


@dataclass(frozen=True)
class Routing:
    """The router's call contract: router(x [T, H]) -> (logits [T, E], top-k weights [T, k], top-k ids [T, k]), the
    weights and ids being what the family's experts module receives (tests/routing_reference.py's `route`
    reproduces them from the logits)."""

    kind: str
    normalize: str = "config"
    scaled: bool = False  # weights multiplied by config.routed_scaling_factor (DeepSeek)
    bias: str | None = None  # router buffer added to the scores for the choice only (DeepSeek-V3)

    def __post_init__(self) -> None:
        if self.kind not in ROUTING_KINDS or self.normalize not in NORMALIZE:
            raise ValueError(f"routing {self.kind!r} / normalize {self.normalize!r}: choose from {ROUTING_KINDS} and "
                             f"{NORMALIZE}")


# ------------------------------------------------------------------------------------------ which layers route

ALL_LAYERS = "all"
FIRST_K_DENSE = "first_k_dense_replace"  # DeepSeek: layers < first_k_dense_replace are dense MLPs
SPARSE_STEP = "sparse_step"  # Qwen2/3-MoE: dense if in mlp_only_layers or (l + 1) % decoder_sparse_step != 0
MOE_LAYER_RULES = (ALL_LAYERS, FIRST_K_DENSE, SPARSE_STEP)


@dataclass(frozen=True)
class MoEAdapter:
    """One family's topology; module names are relative to one decoder layer unless stated otherwise."""

    model_type: str
    num_experts_attr: str  # config attribute holding the routed-expert count
    routing: Routing = Routing(SOFTMAX_TOPK)
    moe_layer_rule: str = ALL_LAYERS
    moe: str = "mlp"  # the sparse MoE block inside a decoder layer (a dense layer's MLP takes the same name)
    router: str = "gate"  # inside the MoE block
    experts: str = "experts"  # inside the MoE block
    shared_expert: str | None = None  # inside the MoE block: a dense gated MLP every token goes through
    shared_expert_gate: str | None = None  # inside the MoE block: Linear H -> 1, sigmoid-scales the shared expert
    dense_mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")  # a dense MLP's (and shared expert's) input linears
    attention: str = "self_attn"
    attention_groups: tuple[NormGroup, ...] = STANDARD_ATTENTION
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"  # feeds router + experts (+ shared expert, its gate)
    # How the hub's files spell what transformers renames or fuses on load (hexq.model.checkpoint reads them directly):
    hub_moe: str | None = None  # on-disk name of the MoE block when it differs from `moe`
    hub_router: str | None = None  # on-disk name of the router when it differs from `router`
    hub_expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert (gate, up, down)

    def __post_init__(self) -> None:
        if self.moe_layer_rule not in MOE_LAYER_RULES:
            raise ValueError(f"moe_layer_rule {self.moe_layer_rule!r}: choose from {MOE_LAYER_RULES}")


ADAPTERS: dict[str, MoEAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        MoEAdapter("mixtral", "num_local_experts", Routing(SOFTMAX_TOPK, normalize="always"),
                   hub_moe="block_sparse_moe", hub_expert_projections=("w1", "w3", "w2")),
        MoEAdapter("qwen3_moe", "num_experts", moe_layer_rule=SPARSE_STEP),
        MoEAdapter("qwen2_moe", "num_experts", moe_layer_rule=SPARSE_STEP, shared_expert="shared_expert",
                   shared_expert_gate="shared_expert_gate"),
        MoEAdapter("olmoe", "num_experts"),
        MoEAdapter("deepseek_v2", "n_routed_experts", Routing(SOFTMAX_GROUP_TOPK, normalize="never", scaled=True),
                   FIRST_K_DENSE, shared_expert="shared_experts", attention_groups=MLA_ATTENTION),
        MoEAdapter("deepseek_v3", "n_routed_experts",
                   Routing(SIGMOID_BIAS_GROUP_TOPK, scaled=True, bias="e_score_correction_bias"), FIRST_K_DENSE,
                   shared_expert="shared_experts", attention_groups=MLA_ATTENTION),
        MoEAdapter("phimoe", "num_local_experts", Routing(SPARSEMIXER, normalize="never"), router="router",
                   hub_moe="block_sparse_moe", hub_router="gate",
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


# ------------------------------------------------------------------------------------------ reading a config


def _config_value(config, key: str, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def num_routed_experts(adapter: MoEAdapter, config) -> int:
    """The routed-expert count of a config object, or of a config dict (config.json spells it as the hub does;
    transformers' to_dict may use the attribute_map's target, e.g. Qwen3-MoE num_local_experts)."""
    for key in (adapter.num_experts_attr, "num_local_experts", "num_experts", "n_routed_experts"):
        value = _config_value(config, key)
        if value is not None:
            return int(value)
    return 0


def moe_layer_indices(adapter: MoEAdapter, config) -> list[int]:
    """The decoder layers with routed experts, from the config (a dict or a transformers config), by the rule the
    family's modeling code builds its layers with; the others hold a dense MLP in the MoE block's place."""
    layers = int(_config_value(config, "num_hidden_layers"))
    if adapter.moe_layer_rule == FIRST_K_DENSE:
        # DeepSeek's remote code also honoured moe_layer_freq; transformers' classes do not, so a checkpoint with
        # another frequency would be read into the wrong layout.
        freq = _config_value(config, "moe_layer_freq", 1)
        if freq not in (None, 1):
            raise HexqError(f"{adapter.model_type} config has moe_layer_freq {freq}; transformers (and hexq) build "
                            "every layer from first_k_dense_replace on as MoE, so only moe_layer_freq 1 is supported")
        first = int(_config_value(config, "first_k_dense_replace", 0) or 0)
        return [index for index in range(layers) if index >= first]
    if adapter.moe_layer_rule == SPARSE_STEP:
        dense = set(_config_value(config, "mlp_only_layers", None) or [])
        step = int(_config_value(config, "decoder_sparse_step", 1) or 1)
        experts = num_routed_experts(adapter, config)
        return [index for index in range(layers) if index not in dense and experts > 0 and (index + 1) % step == 0]
    return list(range(layers))


def check_moe_layers(adapter: MoEAdapter, config, built: list[int]) -> list[int]:
    """The config's MoE layers, after checking the model built from it routes in exactly those (`built`: the layers
    whose MoE block has routed experts); a mismatch means the adapter's rule is out of date for this config."""
    expected = moe_layer_indices(adapter, config)
    if expected != list(built):
        raise HexqError(f"{adapter.model_type}: the config makes layers {expected} MoE layers but the model built from "
                        f"it routes in layers {list(built)}; hexq's adapter ({adapter.moe_layer_rule}) does not match "
                        "this transformers version")
    if not expected:
        raise HexqError(f"{adapter.model_type} config has no MoE layer (num_hidden_layers "
                        f"{_config_value(config, 'num_hidden_layers')}); hexq quantizes mixture-of-experts models")
    return expected
