"""The published MoE families scripts/make_checkpoint.py writes: their hub config.json (sources in make_checkpoint's
docstring), the tiny variants and the config a checkpoint is written with."""

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `hexq` importable from the checkout
    sys.path.insert(0, str(ROOT))

from hexq.base.errors import HexqError  # noqa: E402

TOKENIZER_SPECIAL_ID = 0  # <|endoftext|> in hexq's tokenizer: bos = eos = unk
DEFAULT_SHARD = {"published": "2GB", "tiny": "1MB"}

# Phi-3.5-MoE's longrope factors (64 = head_dim / 2 each).
PHI35_LONG_FACTOR = [
    1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.059999942779541, 1.059999942779541, 1.059999942779541, 1.059999942779541,
    1.059999942779541, 1.059999942779541, 1.0999999046325684, 1.1799999475479126, 1.1799999475479126,
    1.3700000047683716, 1.4899998903274536, 2.109999895095825, 2.8899998664855957, 3.9499998092651367,
    4.299999713897705, 6.429999828338623, 8.09000015258789, 10.690000534057617, 12.050000190734863,
    18.229999542236328, 18.84000015258789, 19.899999618530273, 21.420000076293945, 26.200000762939453,
    34.28000259399414, 34.590003967285156, 38.730003356933594, 40.22000503540039, 42.54000473022461,
    44.000003814697266, 47.590003967285156, 54.750003814697266, 56.19000244140625, 57.44000244140625,
    57.4900016784668, 61.20000076293945, 61.540000915527344, 61.75, 61.779998779296875, 62.06999969482422,
    63.11000061035156, 63.43000030517578, 63.560001373291016, 63.71000289916992, 63.92000198364258,
    63.94000244140625, 63.94000244140625, 63.96000289916992, 63.980003356933594, 64.0300064086914,
    64.0300064086914, 64.0300064086914, 64.04000854492188, 64.10000610351562, 64.19000244140625,
    64.20999908447266, 64.75, 64.95999908447266,
]
PHI35_SHORT_FACTOR = [
    1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.059999942779541, 1.059999942779541,
    1.0699999332427979, 1.0699999332427979, 1.0699999332427979, 1.0699999332427979, 1.1399999856948853,
    1.159999966621399, 1.159999966621399, 1.159999966621399, 1.159999966621399, 1.1799999475479126,
    1.1999999284744263, 1.3199999332427979, 1.3399999141693115, 1.3499999046325684, 1.3999998569488525,
    1.4799998998641968, 1.4999998807907104, 1.589999794960022, 1.6499998569488525, 1.71999990940094,
    1.8999998569488525, 1.9099998474121094, 1.9099998474121094, 1.9899998903274536, 1.9999998807907104,
    1.9999998807907104, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.0999999046325684, 2.319999933242798,
    2.419999837875366, 2.5899999141693115, 2.7899999618530273,
]


@dataclass(frozen=True)
class Family:
    """One published model: its hub config.json and the overrides that shrink it for --size tiny."""

    model_type: str
    source: str  # hub repository the config comes from
    published: dict
    tiny: dict
    tiny_layers: int


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen3_moe", "Qwen/Qwen3-30B-A3B", dict(
        architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
        decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
        initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
        mlp_only_layers=[], model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
        num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
        torch_dtype="bfloat16", transformers_version="4.51.0", use_cache=True, use_sliding_window=False,
        vocab_size=151936),
        tiny=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4, max_window_layers=2),
        tiny_layers=2),
    Family("mixtral", "mistralai/Mixtral-8x7B-v0.1", dict(
        architectures=["MixtralForCausalLM"], attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
        hidden_act="silu", hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
        max_position_embeddings=32768, model_type="mixtral", num_attention_heads=32, num_experts_per_tok=2,
        num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8, output_router_logits=False,
        rms_norm_eps=1e-05, rope_theta=1000000.0, router_aux_loss_coef=0.02, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.36.0.dev0", use_cache=True,
        vocab_size=32000),
        tiny=dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2),
        tiny_layers=2),
    Family("olmoe", "allenai/OLMoE-1B-7B-0924", dict(
        architectures=["OlmoeForCausalLM"], attention_bias=False, attention_dropout=0.0, clip_qkv=None,
        eos_token_id=50279, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=1024,
        max_position_embeddings=4096, model_type="olmoe", norm_topk_prob=False, num_attention_heads=16,
        num_experts=64, num_experts_per_tok=8, num_hidden_layers=16, num_key_value_heads=16,
        output_router_logits=False, pad_token_id=1, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0,
        router_aux_loss_coef=0.01, tie_word_embeddings=False, torch_dtype="bfloat16",
        transformers_version="4.43.0.dev0", use_cache=True, vocab_size=50304),
        tiny=dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  num_experts=16, num_experts_per_tok=4),
        tiny_layers=2),
    Family("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B", dict(
        architectures=["Qwen2MoeForCausalLM"], attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1,
        eos_token_id=151643, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=5632,
        max_position_embeddings=8192, max_window_layers=21, model_type="qwen2_moe", moe_intermediate_size=1408,
        norm_topk_prob=False, num_attention_heads=16, num_experts=60, num_experts_per_tok=4, num_hidden_layers=24,
        num_key_value_heads=16, output_router_logits=False, rms_norm_eps=1e-06, rope_theta=1000000.0,
        router_aux_loss_coef=0.001, shared_expert_intermediate_size=5632, sliding_window=32768,
        tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.39.0.dev0", use_cache=True,
        use_sliding_window=False, vocab_size=151936),
        tiny=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=12, num_experts_per_tok=2,
                  max_window_layers=2),
        tiny_layers=2),
    Family("deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite", dict(
        architectures=["DeepseekV2ForCausalLM"], attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001,
        bos_token_id=100000, eos_token_id=100001, first_k_dense_replace=1, hidden_act="silu", hidden_size=2048,
        initializer_range=0.02, intermediate_size=10944, kv_lora_rank=512, max_position_embeddings=163840,
        model_type="deepseek_v2", moe_intermediate_size=1408, moe_layer_freq=1, n_group=1, n_routed_experts=64,
        n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16, num_experts_per_tok=6,
        num_hidden_layers=27, num_key_value_heads=16, pretraining_tp=1, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, rms_norm_eps=1e-06,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                          original_max_position_embeddings=4096, type="yarn"),
        rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", seq_aux=True, tie_word_embeddings=False,
        topk_group=1, topk_method="greedy", torch_dtype="bfloat16", transformers_version="4.33.1", use_cache=True,
        v_head_dim=128, vocab_size=102400),
        tiny=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                  n_shared_experts=2, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        tiny_layers=3),
    Family("deepseek_v3", "deepseek-ai/DeepSeek-V3", dict(
        architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=0,
        eos_token_id=1, ep_size=1, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
        initializer_range=0.02, intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840,
        model_type="deepseek_v3", moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256,
        n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8,
        num_hidden_layers=61, num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False,
        topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16", transformers_version="4.46.3",
        use_cache=True, v_head_dim=128, vocab_size=129280),
        tiny=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                  n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, first_k_dense_replace=1),
        tiny_layers=3),
    Family("phimoe", "microsoft/Phi-3.5-MoE-instruct", dict(
        architectures=["PhiMoEForCausalLM"], attention_bias=True, attention_dropout=0.0, bos_token_id=1,
        eos_token_id=32000, hidden_act="silu", hidden_dropout=0.0, hidden_size=4096, initializer_range=0.02,
        input_jitter_noise=0.01, intermediate_size=6400, lm_head_bias=True, max_position_embeddings=131072,
        model_type="phimoe", num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32,
        num_key_value_heads=8, num_local_experts=16, original_max_position_embeddings=4096,
        output_router_logits=False, rms_norm_eps=1e-05,
        rope_scaling=dict(long_factor=PHI35_LONG_FACTOR, long_mscale=1.243163121016122,
                          original_max_position_embeddings=4096, short_factor=PHI35_SHORT_FACTOR,
                          short_mscale=1.243163121016122, type="longrope"),
        rope_theta=10000.0, router_aux_loss_coef=0.0, router_jitter_noise=0.01, sliding_window=131072,
        tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.43.3", use_cache=True,
        vocab_size=32064),
        tiny=dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2),
        tiny_layers=2),
)}

# transformers' class for each family (the hub's `architectures` may name a remote-code class).
ARCHITECTURES = {"phimoe": "PhimoeForCausalLM"}
DROPPED_KEYS = ("auto_map", "quantization_config")


def families() -> list[str]:
    return sorted(FAMILIES)


def family_of(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise HexqError(f"unknown family {name!r}; choose one of {', '.join(families())}") from None


# ---------------------------------------------------------------------------------------------------------------
# config.json


def num_experts(config: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in config:
            return int(config[key])
    raise HexqError(f"config of {config.get('model_type')!r} names no routed-expert count")


def expert_width(config: dict) -> int:
    return int(config.get("moe_intermediate_size") or config["intermediate_size"])


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def is_moe_layer(config: dict, layer: int) -> bool:
    """Which decoder layers route (the rest are dense MLPs), as the family's modeling code decides it."""
    model_type = config["model_type"]
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return layer >= config["first_k_dense_replace"] and layer % config.get("moe_layer_freq", 1) == 0
    if model_type in ("qwen3_moe", "qwen2_moe"):
        return layer not in config.get("mlp_only_layers", []) and (layer + 1) % config["decoder_sparse_step"] == 0
    return True


def resample(values: list[float], count: int) -> list[float]:
    """`count` evenly spaced entries of a per-frequency factor list (longrope), keeping its first and last."""
    if count == len(values):
        return list(values)
    if count == 1:
        return [values[0]]
    return [values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)]


def build_config(family: str, size: str = "tiny", layers: int | None = None, vocab: int | None = None,
                 **overrides) -> dict:
    """The config.json written for `family` at `size` (see the module docstring for what differs from the hub)."""
    spec = family_of(family)
    if size not in DEFAULT_SHARD:
        raise HexqError(f"unknown size {size!r}; choose published or tiny")
    config = copy.deepcopy(spec.published)
    for key in DROPPED_KEYS:
        config.pop(key, None)
    config["architectures"] = [ARCHITECTURES.get(family, config["architectures"][0])]
    if size == "tiny":
        config.update(copy.deepcopy(spec.tiny))
        config["vocab_size"] = 8192
    if "num_hidden_layers" in overrides:
        raise HexqError("give the layer count as layers (--layers), not as a num_hidden_layers override")
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise HexqError(f"unknown config key {unknown[0]!r} for {family}; known keys: {', '.join(sorted(config))}")
    config.update(copy.deepcopy(overrides))
    if vocab is not None:
        config["vocab_size"] = int(vocab)
    layers = spec.tiny_layers if layers is None and size == "tiny" else layers
    if layers is None:
        layers = config.get("first_k_dense_replace", 0) + 1
    if layers < 1:
        raise HexqError(f"layers must be at least 1, got {layers}")
    config["num_hidden_layers"] = int(layers)
    if "first_k_dense_replace" in config and config["first_k_dense_replace"] >= layers:
        config["first_k_dense_replace"] = layers - 1  # keep at least one MoE layer
    if "num_nextn_predict_layers" in config:
        config["num_nextn_predict_layers"] = 0  # no multi-token-prediction layer is written
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = TOKENIZER_SPECIAL_ID
    if "pad_token_id" in config:
        config["pad_token_id"] = None  # the shipped tokenizer has no padding token
    rope = config.get("rope_scaling")
    if rope and rope.get("type") == "longrope":  # one factor per rotary frequency
        pairs = head_dim(config) // 2
        rope["long_factor"] = resample(rope["long_factor"], pairs)
        rope["short_factor"] = resample(rope["short_factor"], pairs)
    return config


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")
