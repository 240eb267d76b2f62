"""Write random-weight MoE checkpoints with the exact layer shapes of published models, laid out as the hub ships them.

    python scripts/make_checkpoint.py --family qwen3_moe --layers 2 --out DIR [--size published|tiny] [--seed 0]
        [--shard-size 2GB] [--skew 0.35] [--vocab N] [--force]

From Python (tests, benchmarks): `from scripts.make_checkpoint import write_checkpoint` (run from the checkout root,
as `python -m pytest` does), then `write_checkpoint(out, "mixtral", size="tiny", layers=None, seed=0,
**config_overrides) -> out`; a tiny checkpoint of any family takes well under a second.

What the folder holds
- config.json: the published model's hub config.json (sources below) with these documented changes only:
  num_hidden_layers; the special token ids (bos/eos/pad) follow the tokenizer shipped in the folder (hexq's
  byte-level BPE, id 0 = <|endoftext|>) while vocab_size keeps the published value, so embedding and head shapes
  are real and every token id of the tokenizer stays valid; `auto_map` (remote code, not shipped) and DeepSeek-V3's
  fp8 `quantization_config` are dropped, since the weights are bf16 and transformers' own classes load them;
  `architectures` names the transformers class (Phi-3.5-MoE's hub config names its remote `PhiMoEForCausalLM`);
  DeepSeek-V3's multi-token-prediction layer is not written (num_nextn_predict_layers 0); for the DeepSeek families
  `first_k_dense_replace` is lowered to layers - 1 when the layer count would otherwise hold no MoE layer.
  --size tiny scales the same structure down (hidden 64, 8-16 experts, expert width 32, 2-3 layers with the dense
  first layer where the family has one, vocab 8192; longrope factor lists resampled to the smaller head).
- generation_config.json (the same token ids) and the tokenizer files (models/tokenizer).
- The weights: bf16 safetensors, one tensor per expert and projection under the hub's key names (Mixtral and PhiMoE
  `model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight`, w1 = gate, w3 = up, w2 = down, and
  `block_sparse_moe.gate.weight`; Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3
  `model.layers.{l}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` and `mlp.gate.weight`), which transformers
  5.x fuses into `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]` when loading. Shards of about
  --shard-size (decimal units as on the hub: 2GB = 2e9 bytes) named model-00001-of-0000N.safetensors, each with
  metadata {"format": "pt"}, and model.safetensors.index.json {"metadata": {"total_size": bytes}, "weight_map":
  {key: shard}} with sorted keys; a checkpoint that fits one shard is a single model.safetensors without index, as
  save_pretrained writes it. Tensors fill shards in module order (embeddings, layer 0 ... layer L-1, final norm,
  head), a new shard starting when the next tensor would overflow. Tiny checkpoints default to 1MB shards, so they
  are sharded like real ones.

Weights. Seeded and reproducible: each tensor has its own generator seeded from (seed, tensor name), so the same seed
gives the same bytes whatever the shard size. Linear weights N(0, 1/fan_in), so activations keep unit scale; the
projections that write into the residual stream (o_proj, down_proj, w2) further scaled by 1/sqrt(2 L) for L decoder
layers, as GPT-2 does, so the random blocks together add about as much as the token embedding at any depth;
embeddings N(0, 1). Unit-RMS embeddings keep the token signal dominant in the random residual stream: with the usual
N(0, 0.02^2) the common-mode output of the random attention swamps it, every token's router input points the same
way and a few experts take most slots (tiny models, unskewed routers, forward pass over text: hottest quarter 39-61%
of the slots, against 32-35% with unit embeddings). Norm weights 1 + N(0, 0.02^2) and biases N(0, 0.02^2), not the
init values 1 and 0, so a reader that silently skips a norm or a bias fails a value check; DeepSeek-V3's router
`e_score_correction_bias` N(0, 0.01^2) in F32, as the hub stores it. Each tensor is generated in float32 chunks of
at most 16M elements, written through hexq.io.SafetensorsWriter and freed: peak memory is about one bf16 tensor
plus one chunk (measured with /usr/bin/time -f %M, one published layer: Qwen3-30B-A3B 0.97 GB RSS for a 2.49 GB
checkpoint in 39 s, Mixtral-8x7B 0.64 GB for 3.43 GB in 45 s, on 2 shared cores; Python with torch alone: 0.23 GB).

Router skew. Real routers are skewed: in hexq's trained reference models the hottest 25% of experts take ~31-43% of
the routed (token, slot) pairs. Here router row e of each layer is a random direction of norm s_e = exp(alpha q_e),
q = the standard-normal quantiles at (i + 0.5)/E in a seeded order per layer (each layer has its own hot experts).
On router inputs of unit RMS (what an RMSNorm/LayerNorm with weights ~1 produces) the logits are then close to
independent N(0, s_e^2), and an expert with a larger scale reaches the top-k more often. Row scaling serves all
seven families with one mechanism and one calibration; the router bias only DeepSeek-V3 has is what real V3
checkpoints use to cancel imbalance, not to create it. alpha is found by bisection so that, on independent
N(0, s_e^2) logits (8 seeded scale orders x 4000 draws) through the family's own selection rule (top-k of the
logits; DeepSeek-V3's sigmoid + bias and group-limited top-k), the quarter of experts with the largest scales takes
--skew (default 0.35) of the routed slots; --skew 0.25 writes unskewed routers. The script then measures what it
wrote and prints the mean over MoE layers and the range: on 16384 normalized random vectors (x = sqrt(H) g/|g|)
through the written router weights (every size), and for --size tiny also by a forward pass of the loaded model over
the first 2 x 256 tokens of the austen, pydocs and foldoc training text (hooked router outputs). Measured: random
vectors 0.34-0.37 on every family and size; text on tiny 0.35-0.42 (0.32-0.35 with --skew 0.25: repeated tokens
route alike, so real text concentrates routing beyond the router's own skew, as it does in trained models).

Config sources (hub config.json of each repository; values cross-checked against public copies of those files):
  qwen3_moe    Qwen/Qwen3-30B-A3B               https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
  mixtral      mistralai/Mixtral-8x7B-v0.1      https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
  olmoe        allenai/OLMoE-1B-7B-0924         https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json
  qwen2_moe    Qwen/Qwen1.5-MoE-A2.7B           https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json
  deepseek_v2  deepseek-ai/DeepSeek-V2-Lite     https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
  deepseek_v3  deepseek-ai/DeepSeek-V3          https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
  phimoe       microsoft/Phi-3.5-MoE-instruct   https://huggingface.co/microsoft/Phi-3.5-MoE-instruct/blob/main/config.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `hexq` importable from the checkout
    sys.path.insert(0, str(ROOT))

from hexq.errors import HexqError  # noqa: E402
from hexq.io import SafetensorsWriter, write_bytes_atomic, write_json_atomic  # noqa: E402

TOKENIZER_DIR = ROOT / "models" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_SPECIAL_ID = 0  # <|endoftext|> in hexq's tokenizer: bos = eos = unk
DEFAULT_HOT_SHARE = 0.35
DEFAULT_SHARD = {"published": "2GB", "tiny": "1MB"}
CHUNK_ELEMENTS = 16 << 20
WEIGHTS_DTYPE = torch.bfloat16

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


# ---------------------------------------------------------------------------------------------------------------
# Tensors: names and shapes as the hub files hold them, in module order


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the checkpoint and how its random values are drawn."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "normal" (N(0, std^2)), "norm" (1 + N(0, std^2)), "router", "score_bias"
    std: float
    dtype: torch.dtype = WEIGHTS_DTYPE

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def linear(name: str, out_features: int, in_features: int, bias: bool = False, gain: float = 1.0
           ) -> list[TensorPlan]:
    plans = [TensorPlan(f"{name}.weight", (out_features, in_features), "normal", gain * in_features ** -0.5)]
    if bias:
        plans.append(TensorPlan(f"{name}.bias", (out_features,), "normal", 0.02))
    return plans


def norm(name: str, width: int, bias: bool = False) -> list[TensorPlan]:
    plans = [TensorPlan(f"{name}.weight", (width,), "norm", 0.02)]
    if bias:
        plans.append(TensorPlan(f"{name}.bias", (width,), "normal", 0.02))
    return plans


def residual_gain(config: dict) -> float:
    """Scale of the projections that write into the residual stream: 1/sqrt(2 L) (GPT-2's rule)."""
    return (2 * config["num_hidden_layers"]) ** -0.5


def glu_mlp(config: dict, prefix: str, width: int,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[TensorPlan]:
    gate, up, down = names
    hidden = config["hidden_size"]
    return (linear(f"{prefix}.{gate}", width, hidden) + linear(f"{prefix}.{up}", width, hidden)
            + linear(f"{prefix}.{down}", hidden, width, gain=residual_gain(config)))


def attention_tensors(config: dict, prefix: str) -> list[TensorPlan]:
    model_type, hidden = config["model_type"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    if model_type in ("deepseek_v2", "deepseek_v3"):  # multi-head latent attention
        bias = config.get("attention_bias", False)
        qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        if config.get("q_lora_rank") is None:
            plans = linear(f"{prefix}.q_proj", heads * qk_head, hidden)
        else:
            rank = config["q_lora_rank"]
            plans = (linear(f"{prefix}.q_a_proj", rank, hidden, bias) + norm(f"{prefix}.q_a_layernorm", rank)
                     + linear(f"{prefix}.q_b_proj", heads * qk_head, rank))
        kv_rank = config["kv_lora_rank"]
        return plans + (
            linear(f"{prefix}.kv_a_proj_with_mqa", kv_rank + config["qk_rope_head_dim"], hidden, bias)
            + norm(f"{prefix}.kv_a_layernorm", kv_rank)
            + linear(f"{prefix}.kv_b_proj", heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_rank)
            + linear(f"{prefix}.o_proj", hidden, heads * config["v_head_dim"], bias, residual_gain(config)))
    dim = head_dim(config)
    qkv_bias = config.get("qkv_bias", True) if model_type == "qwen2_moe" else config.get("attention_bias", False)
    o_bias = False if model_type == "qwen2_moe" else config.get("attention_bias", False)
    plans = (linear(f"{prefix}.q_proj", heads * dim, hidden, qkv_bias)
             + linear(f"{prefix}.k_proj", kv_heads * dim, hidden, qkv_bias)
             + linear(f"{prefix}.v_proj", kv_heads * dim, hidden, qkv_bias)
             + linear(f"{prefix}.o_proj", hidden, heads * dim, o_bias, residual_gain(config)))
    if model_type == "qwen3_moe":  # per-head q/k norms
        plans += norm(f"{prefix}.q_norm", dim) + norm(f"{prefix}.k_norm", dim)
    elif model_type == "olmoe":  # q/k norms over the whole projection
        plans += norm(f"{prefix}.q_norm", heads * dim) + norm(f"{prefix}.k_norm", kv_heads * dim)
    return plans


def moe_tensors(config: dict, prefix: str) -> list[TensorPlan]:
    model_type, hidden = config["model_type"], config["hidden_size"]
    width, experts = expert_width(config), num_experts(config)
    if model_type in ("mixtral", "phimoe"):
        block = f"{prefix}.block_sparse_moe"
        plans = [TensorPlan(f"{block}.gate.weight", (experts, hidden), "router", hidden ** -0.5)]
        for e in range(experts):
            plans += glu_mlp(config, f"{block}.experts.{e}", width, ("w1", "w3", "w2"))
        return plans
    block = f"{prefix}.mlp"
    plans = [TensorPlan(f"{block}.gate.weight", (experts, hidden), "router", hidden ** -0.5)]
    if model_type == "deepseek_v3":
        plans.append(TensorPlan(f"{block}.gate.e_score_correction_bias", (experts,), "score_bias", 0.01,
                                torch.float32))
    for e in range(experts):
        plans += glu_mlp(config, f"{block}.experts.{e}", width)
    if model_type == "qwen2_moe":
        plans += glu_mlp(config, f"{block}.shared_expert", config["shared_expert_intermediate_size"])
        plans += linear(f"{block}.shared_expert_gate", 1, hidden)
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        plans += glu_mlp(config, f"{block}.shared_experts", width * config["n_shared_experts"])
    return plans


def checkpoint_plan(config: dict) -> list[TensorPlan]:
    """Every tensor of the checkpoint in module order, named and shaped as the family's hub files are."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    layer_norm_bias = model_type == "phimoe"  # PhiMoE uses LayerNorm (weight and bias), the rest RMSNorm
    plans = [TensorPlan("model.embed_tokens.weight", (config["vocab_size"], hidden), "normal", 1.0)]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        plans += norm(f"{prefix}.input_layernorm", hidden, layer_norm_bias)
        plans += attention_tensors(config, f"{prefix}.self_attn")
        plans += norm(f"{prefix}.post_attention_layernorm", hidden, layer_norm_bias)
        if is_moe_layer(config, layer):
            plans += moe_tensors(config, prefix)
        else:
            plans += glu_mlp(config, f"{prefix}.mlp", config["intermediate_size"])
    plans += norm("model.norm", hidden, layer_norm_bias)
    if not config.get("tie_word_embeddings", False):
        plans += linear("lm_head", config["vocab_size"], hidden, config.get("lm_head_bias", False))
    elif config.get("lm_head_bias", False):
        plans.append(TensorPlan("lm_head.bias", (config["vocab_size"],), "normal", 0.02))
    return plans


# ---------------------------------------------------------------------------------------------------------------
# Random values


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A generator of its own per tensor, so values do not depend on write order or sharding."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def normal_quantiles(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard-normal quantiles at (i + 0.5) / count: an evenly spread, symmetric profile."""
    p = (torch.arange(count, dtype=torch.float64, device=device) + 0.5) / count
    return math.sqrt(2.0) * torch.special.erfinv(2.0 * p - 1.0)


def router_scales(num_experts: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """Row scales s_e = exp(alpha * q_e), q = normal quantiles in a seeded order (see the docstring)."""
    order = torch.randperm(num_experts, generator=generator)
    return torch.exp(alpha * normal_quantiles(num_experts)[order]).to(torch.float32)


def make_tensor(plan: TensorPlan, seed: int, alpha: float = 0.0) -> torch.Tensor:
    """The tensor's values: drawn in float32 chunks of whole rows (bounded memory), stored as plan.dtype."""
    g = tensor_generator(seed, plan.name)
    scales = router_scales(plan.shape[0], alpha, g) if plan.kind == "router" else None
    out = torch.empty(plan.shape, dtype=plan.dtype, device="cpu")
    rows = out.reshape(-1, plan.shape[-1]) if len(plan.shape) > 1 else out.reshape(1, -1)
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = torch.randn(rows[start:start + step].shape, generator=g, dtype=torch.float32).mul_(plan.std)
        if plan.kind == "norm":
            chunk += 1.0
        elif scales is not None:  # rows of norm exactly s_e: logit std s_e on unit-RMS inputs, no chi noise
            chunk *= scales[start:start + step, None] / chunk.norm(dim=1, keepdim=True)
        rows[start:start + step] = chunk.to(plan.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Routing: each family's expert choice, the hot-quarter share, and the skew calibration


def select_experts(config: dict, logits: torch.Tensor, score_bias: torch.Tensor | None = None) -> torch.Tensor:
    """[N, k] expert indices the family's router picks from router logits [N, E] (inference mode).

    Softmax-then-top-k (Mixtral, Qwen, OLMoE, DeepSeek-V2 greedy) and PhiMoE's sparsemixer at inference (the
    arg-max, then the arg-max of the rest) all pick the k largest logits. DeepSeek-V2 group_limited_greedy keeps
    the topk_group groups with the largest max score; DeepSeek-V3 noaux_tc ranks sigmoid(logit) + bias, keeps
    the topk_group groups with the largest sum of their two best, and takes the top k inside them."""
    k, method = config["num_experts_per_tok"], config.get("topk_method", "greedy")
    if config["model_type"] == "deepseek_v3" or method == "noaux_tc":
        scores = logits.float().sigmoid()
        if score_bias is not None:
            scores = scores + score_bias.to(device=scores.device, dtype=scores.dtype)
        group_scores = scores.unflatten(-1, (config["n_group"], -1)).topk(2, dim=-1).values.sum(-1)
    elif method == "group_limited_greedy":
        scores = logits.float().softmax(dim=-1)
        group_scores = scores.unflatten(-1, (config["n_group"], -1)).amax(dim=-1)
    else:
        return logits.topk(k, dim=-1).indices
    groups = group_scores.topk(config["topk_group"], dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.repeat_interleave(scores.shape[-1] // config["n_group"], dim=-1)
    return scores.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices


def quarter(num_experts: int) -> int:
    return max(1, round(num_experts / 4))


def hot_quarter_share(indices: torch.Tensor, num_experts: int) -> float:
    """Share of routed (token, slot) pairs taken by the most-used quarter of the experts (at least one)."""
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)
    return float(counts.sort(descending=True).values[:quarter(num_experts)].sum() / counts.sum())


def modelled_share(config: dict, alpha: float, samples: int = 4000, layers: int = 8, seed: int = 0) -> float:
    """Mean hot-quarter share under the skew model: independent N(0, s_e^2) logits through the family's
    selection, over `layers` seeded orders of the scales (with group-limited routing the order matters).

    The quarter is the one with the largest scales, not the most-used quarter of this sample: that is the
    large-sample limit, free of the upward bias a post-hoc pick of the busiest experts has on few tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    experts = num_experts(config)
    shares = []
    for _ in range(layers):
        scales = router_scales(experts, alpha, g)
        logits = torch.randn(samples, experts, generator=g) * scales
        bias = torch.randn(experts, generator=g) * 0.01 if config["model_type"] == "deepseek_v3" else None
        counts = torch.bincount(select_experts(config, logits, bias).reshape(-1), minlength=experts)
        shares.append(float(counts[scales.topk(quarter(experts)).indices].sum() / counts.sum()))
    return sum(shares) / layers


def calibrate_alpha(config: dict, target: float) -> float:
    """The alpha whose modelled hot-quarter share is `target` (bisection; the share grows with alpha).

    It depends only on the routing fields of the config, so it is computed once per routing shape."""
    if not 0.25 <= target < 1.0:
        raise HexqError(f"--skew {target} must be a share in [0.25, 1): 0.25 is unskewed, real routers ~0.31-0.43")
    routing = {key: config.get(key) for key in ("model_type", "num_experts_per_tok", "topk_method", "n_group",
                                                "topk_group")}
    return _calibrated_alpha(tuple(sorted(routing.items())), num_experts(config), float(target))


@contextlib.contextmanager
def one_thread():
    """Small tensor ops run several times faster on one thread than on a shared pool (restored on exit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=64)
def _calibrated_alpha(routing: tuple, experts: int, target: float) -> float:
    if target == 0.25:
        return 0.0
    with one_thread():
        return _bisect_alpha(dict(routing) | {"num_experts": experts}, experts, target)


def _bisect_alpha(config: dict, experts: int, target: float) -> float:
    low, high = 0.0, 4.0
    if modelled_share(config, high) < target:
        raise HexqError(f"--skew {target} is out of reach for {config['model_type']} with {experts} experts, "
                        f"top-{config['num_experts_per_tok']}")
    for _ in range(14):  # alpha to 4 / 2^14
        mid = 0.5 * (low + high)
        if modelled_share(config, mid) < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


# ---------------------------------------------------------------------------------------------------------------
# Shards and the folder


def parse_size(text: str | int) -> int:
    """Bytes in '2GB', '500MB', '1.5GiB' or an int (decimal units as huggingface_hub reads them)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match:
        raise HexqError(f"shard size {text!r} is not a size such as 2GB, 500MB or 1GiB")
    number, unit = float(match.group(1)), match.group(2).rstrip("B")
    factor = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    size = int(number * factor)
    if size < 1:
        raise HexqError(f"shard size {text!r} must be at least one byte")
    return size


def plan_shards(plans: list[TensorPlan], shard_size: int) -> list[list[TensorPlan]]:
    """Consecutive tensors per shard; a new shard when the next tensor would overflow (huggingface_hub's rule)."""
    shards: list[list[TensorPlan]] = []
    current: list[TensorPlan] = []
    used = 0
    for plan in plans:
        if current and used + plan.nbytes > shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(plan)
        used += plan.nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def generation_config(config: dict) -> dict:
    out = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if config.get("pad_token_id") is not None:
        out["pad_token_id"] = config["pad_token_id"]
    return out | {"transformers_version": config.get("transformers_version", "")}


def write_checkpoint(out: Path, family: str, size: str = "tiny", layers: int | None = None, seed: int = 0, *,
                     shard_size: int | str | None = None, skew: float = DEFAULT_HOT_SHARE, vocab: int | None = None,
                     force: bool = False, progress: Callable[[str, int, int], None] | None = None,
                     **overrides) -> Path:
    """Write a checkpoint folder (config, generation config, tokenizer, sharded weights) and return `out`.

    `overrides` change config.json values before the shapes are derived (e.g. num_experts=8). progress(shard,
    bytes_done, bytes_total) is called after each tensor. `out` must be empty or missing unless force=True,
    which first removes the weight files of an earlier checkpoint there."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise HexqError(f"{out} is not empty; choose a new folder or pass --force to replace its checkpoint")
    config = build_config(family, size, layers, vocab, **overrides)
    plans = checkpoint_plan(config)
    alpha = calibrate_alpha(config, skew)
    shards = plan_shards(plans, parse_size(shard_size if shard_size is not None else DEFAULT_SHARD[size]))
    names = shard_names(len(shards))
    if out.exists():
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    write_json_atomic(out / "config.json", config)
    write_json_atomic(out / "generation_config.json", generation_config(config))
    for filename in TOKENIZER_FILES:
        write_bytes_atomic(out / filename, (TOKENIZER_DIR / filename).read_bytes())

    total, done = sum(p.nbytes for p in plans), 0
    for name, shard in zip(names, shards, strict=True):
        specs = {p.name: (p.dtype, p.shape) for p in shard}
        with SafetensorsWriter(out / name, specs, metadata={"format": "pt"}) as writer:
            for plan in shard:
                tensor = make_tensor(plan, seed, alpha)
                writer.write(plan.name, tensor)
                del tensor
                done += plan.nbytes
                if progress is not None:
                    progress(name, done, total)
    if len(shards) > 1:
        weight_map = {p.name: name for name, shard in zip(names, shards, strict=True) for p in shard}
        write_json_atomic(out / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return out


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# Measuring the skew that was written


def router_keys(config: dict) -> list[tuple[str, str | None]]:
    """(router weight, score bias or None) per MoE layer, as named in the files."""
    block = "block_sparse_moe" if config["model_type"] in ("mixtral", "phimoe") else "mlp"
    keys = []
    for layer in range(config["num_hidden_layers"]):
        if is_moe_layer(config, layer):
            prefix = f"model.layers.{layer}.{block}.gate"
            keys.append((f"{prefix}.weight",
                         f"{prefix}.e_score_correction_bias" if config["model_type"] == "deepseek_v3" else None))
    return keys


def shares_on_random_inputs(folder: Path, samples: int = 16384, seed: int = 0, batch: int = 2048) -> list[float]:
    """Hot-quarter share per MoE layer for router inputs x = sqrt(H) g/|g| (unit RMS, like a norm's output),
    read from the written router weights."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    files = weight_files(folder)
    shares = []
    for weight_key, bias_key in router_keys(config):
        with safe_open(folder / files[weight_key], "pt") as f:
            weight = f.get_tensor(weight_key).float()
        bias = None
        if bias_key is not None:
            with safe_open(folder / files[bias_key], "pt") as f:
                bias = f.get_tensor(bias_key).float()
        g = torch.Generator(device="cpu").manual_seed(seed)
        counts = torch.zeros(weight.shape[0], dtype=torch.int64)
        for start in range(0, samples, batch):
            x = torch.randn(min(batch, samples - start), config["hidden_size"], generator=g)
            x *= config["hidden_size"] ** 0.5 / x.norm(dim=-1, keepdim=True)
            counts += torch.bincount(select_experts(config, x @ weight.T, bias).reshape(-1), minlength=len(counts))
        shares.append(float(counts.sort(descending=True).values[:quarter(len(counts))].sum() / counts.sum()))
    return shares


def routed_indices(output) -> torch.Tensor:
    """Expert indices from a transformers 5.x router's output (router_logits, scores, indices)."""
    return output[-1]


def corpus_windows(tokenizer, seqlen: int = 256, windows_per_corpus: int = 2) -> torch.Tensor:
    """[W, seqlen] token ids: the first windows of each training corpus (austen, pydocs, foldoc)."""
    from hexq.data import TRAIN_CORPORA, corpus_text

    windows = []
    for name in TRAIN_CORPORA:
        text = corpus_text(name, "train")[: 16 * seqlen * windows_per_corpus]  # ample: a token is a few bytes
        ids = tokenizer(text)["input_ids"]
        windows += [ids[i * seqlen:(i + 1) * seqlen] for i in range(windows_per_corpus)]
    return torch.tensor(windows, dtype=torch.long)


def shares_on_text(model, input_ids: torch.Tensor) -> list[float]:
    """Hot-quarter share per MoE layer of a loaded transformers model over `input_ids` (router outputs hooked)."""
    config = model.config.to_dict()
    captured: dict[int, list[torch.Tensor]] = {}
    routers = [(i, layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate)
               for i, layer in enumerate(model.model.layers) if is_moe_layer(config, i)]
    hooks = []
    try:
        for i, router in routers:
            hooks.append(router.register_forward_hook(
                lambda _module, _args, output, i=i: captured.setdefault(i, []).append(routed_indices(output))))
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return [hot_quarter_share(torch.cat(captured[i]), num_experts(config)) for i, _ in routers]


def load_for_measurement(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, model_max_length=1 << 30)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=families())
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: tiny 2-3; published: first_k_dense_replace + 1, i.e. one MoE "
                             "layer)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=("published", "tiny"), default="published")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", default=None, help="about this many bytes per shard (default: published 2GB, "
                                                           "tiny 1MB)")
    parser.add_argument("--skew", type=float, default=DEFAULT_HOT_SHARE,
                        help="target share of routed slots taken by the hottest quarter of experts (0.25 = none)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab_size (default: the published one; tiny 8192)")
    parser.add_argument("--force", action="store_true", help="replace the checkpoint in a non-empty --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    state = {"shard": None}

    def progress(shard: str, done: int, total: int) -> None:
        if shard != state["shard"]:
            state["shard"] = shard
            print(f"  {shard}  ({done / 1e9:.2f} of {total / 1e9:.2f} GB)", flush=True)

    start = time.perf_counter()
    try:
        folder = write_checkpoint(args.out, args.family, args.size, args.layers, args.seed,
                                  shard_size=args.shard_size, skew=args.skew, vocab=args.vocab, force=args.force,
                                  progress=progress)
    except HexqError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    config = json.loads((folder / "config.json").read_text())
    on_disk = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(f"{folder}: {config['model_type']} ({FAMILIES[args.family].source} shapes, --size {args.size}), "
          f"{config['num_hidden_layers']} layers, {len(weight_files(folder))} tensors, "
          f"{on_disk / 1e9:.3f} GB on disk, written in {seconds:.1f} s")
    target = f"target {args.skew:.3f}"
    shares = shares_on_random_inputs(folder)
    print(f"hot-quarter share on normalized random inputs: mean {sum(shares) / len(shares):.3f} "
          f"(layers {min(shares):.3f}-{max(shares):.3f}), {target}")
    if args.size == "tiny":
        model, tokenizer = load_for_measurement(folder)
        shares = shares_on_text(model, corpus_windows(tokenizer))
        print(f"hot-quarter share on a forward pass over corpus text: mean {sum(shares) / len(shares):.3f} "
              f"(layers {min(shares):.3f}-{max(shares):.3f}), {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
