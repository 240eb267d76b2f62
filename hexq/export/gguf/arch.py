"""What llama.cpp needs to know about a model, as data: for each family it runs, its architecture name, the
hyper-parameter keys, how the family's tensor names map to GGUF's, and the tokenizer.

Read from llama.cpp's own converter (convert_hf_to_gguf.py, conversion/{llama,qwen,olmo}.py) and its model loaders
(src/models/<arch>.cpp): which keys each loader reads, which tensors it requires, how it routes. The routing of each
llama.cpp architecture is fixed in its graph (top-k weights renormalized for llama and qwen3moe, not for qwen2moe
and olmoe), so a config whose `norm_topk_prob` disagrees is refused rather than exported into a model that routes
differently. llama.cpp's `llama` architecture (Mixtral) rotates interleaved pairs where transformers rotates halves:
the converter permutes the rows of q_proj and k_proj, and so does this export (`rope_permutation`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.errors import HexqError


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp architecture
    normalized_topk: bool  # llama.cpp's graph renormalizes the top-k weights
    interleaved_rope: bool  # llama.cpp's `llama` rope: q/k rows permuted (LlamaModel.permute in the converter)
    output_required: bool  # the loader needs output.weight even when the head is tied to the embeddings


FAMILIES = {
    "mixtral": Family("llama", normalized_topk=True, interleaved_rope=True, output_required=False),
    "qwen3_moe": Family("qwen3moe", normalized_topk=True, interleaved_rope=False, output_required=False),
    "qwen2_moe": Family("qwen2moe", normalized_topk=False, interleaved_rope=False, output_required=True),
    "olmoe": Family("olmoe", normalized_topk=False, interleaved_rope=False, output_required=True),
}

# Tensor names inside a decoder layer: the family's (transformers') name -> GGUF's, for every family above.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
EXPERT_NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def family_of(config) -> Family:
    """The family's llama.cpp description, or a one-line error for a model llama.cpp does not run as it is."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise HexqError(f"hexq export --format gguf writes {', '.join(sorted(FAMILIES))}; {config.model_type} is not "
                        "among them (use the compressed-tensors export)")
    normalize = getattr(config, "norm_topk_prob", config.model_type == "mixtral")
    if bool(normalize) != family.normalized_topk:
        raise HexqError(f"llama.cpp's {family.arch} graph {'always' if family.normalized_topk else 'never'} "
                        f"renormalizes the top-k routing weights, this {config.model_type} config has norm_topk_prob "
                        f"{normalize}: llama.cpp would route it differently (use the compressed-tensors export)")
    if config.model_type == "olmoe" and config.num_key_value_heads != config.num_attention_heads:
        raise HexqError("llama.cpp's olmoe loader normalizes k over all heads as the model width (no grouped-query "
                        f"attention); this config has {config.num_key_value_heads} key-value heads for "
                        f"{config.num_attention_heads} (use the compressed-tensors export)")
    dense = [i for i in range(config.num_hidden_layers) if i in (getattr(config, "mlp_only_layers", None) or [])]
    if dense or getattr(config, "decoder_sparse_step", 1) != 1:
        raise HexqError(f"llama.cpp's {family.arch} loader takes MoE layers only; this config has dense layers "
                        f"{dense or 'by decoder_sparse_step'} (use the compressed-tensors export)")
    return family


def gguf_name(name: str) -> str | None:
    """The GGUF name of a model tensor (routed experts excluded: EXPERT_NAMES), or None if it has none."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    module, kind = ".".join(parts[3:-1]), parts[-1]
    base = LAYER_NAMES.get(module)
    return None if base is None else f"blk.{parts[2]}.{base}.{kind}"


def rope_permutation(rows: int, heads: int) -> torch.Tensor:
    """Row order that turns transformers' rotate-half q/k rows into llama.cpp's interleaved pairs: within each head
    of d rows, row 2i takes row i and row 2i + 1 takes row i + d/2 (the converter's LlamaModel.permute)."""
    head = rows // heads
    index = torch.arange(rows).reshape(heads, 2, head // 2)
    return index.transpose(1, 2).reshape(rows)


def add_hyperparameters(writer, config, family: Family) -> None:
    """The keys llama.cpp's loader for `family.arch` reads (values from the transformers config)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise HexqError(f"rope scaling {rope.get('rope_type')!r} is not exported to GGUF (default rope only)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family.arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    moe_width = getattr(config, "moe_intermediate_size", None)
    if moe_width is not None:
        writer.add_expert_feed_forward_length(moe_width)
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared is not None:
        writer.add_expert_shared_feed_forward_length(shared)


# A byte-level BPE tokenizer's pre-tokenizer, as llama.cpp names it (its converter identifies it by a hash of how a
# test string tokenizes; hexq reads tokenizer.json's declaration instead): GPT-2's regex split.
GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """tokenizer.ggml.* for a byte-level BPE tokenizer (tokenizer.json), the way llama.cpp's converter writes it
    (_set_vocab_gpt2): every id below vocab_size (unused ids as [PADn]), added special tokens as control tokens,
    merges and special ids through gguf-py's SpecialVocab."""
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    model, pre = data.get("model", {}), data.get("pre_tokenizer")
    if model.get("type") != "BPE" or pre != GPT2_PRE:
        raise HexqError(f"{folder}/tokenizer.json: only byte-level BPE tokenizers with GPT-2's pre-tokenizer are "
                        f"exported to GGUF (this one: model {model.get('type')}, pre-tokenizer {pre})")
    reverse = {index: token for token, index in model["vocab"].items()}
    special = {added["id"]: added["content"] for added in data.get("added_tokens", []) if added.get("special")}
    reverse.update(special)
    tokens, types = [], []
    for index in range(vocab_size):
        tokens.append(reverse.get(index, f"[PAD{index}]"))
        types.append(gguf.TokenType.CONTROL if index in special else
                     gguf.TokenType.NORMAL if index in reverse else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)
