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
at most 16M elements, written through hexq.base.io.SafetensorsWriter and freed: peak memory is about one bf16 tensor
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

from hexq.base.errors import HexqError  # noqa: E402
from hexq.base.io import SafetensorsWriter, write_bytes_atomic, write_json_atomic  # noqa: E402
from scripts.checkpoint_families import (  # noqa: E402
    DEFAULT_SHARD,
    FAMILIES,
    build_config,
    expert_width,
    families,
    head_dim,
    is_moe_layer,
    num_experts,
    weight_files,
)
from scripts.checkpoint_skew import (  # noqa: E402
    calibrate_alpha,
    corpus_windows,
    load_for_measurement,
    router_scales,
    shares_on_random_inputs,
    shares_on_text,
)

TOKENIZER_DIR = ROOT / "models" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEFAULT_HOT_SHARE = 0.35
CHUNK_ELEMENTS = 16 << 20
WEIGHTS_DTYPE = torch.bfloat16

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
