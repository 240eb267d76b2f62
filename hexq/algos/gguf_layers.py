"""The GGML type of a MoE layer's routed experts, from its allocation: the rule `hexq pack --bank export` (which
K-quant replicas to keep) and `hexq export --format gguf` (which type to write) share. A fused `ffn_*_exps` tensor has
one type, so a layer's experts share one width in GGUF (as a vLLM MoE layer shares one scheme)."""

from __future__ import annotations

from hexq.packed.ggml import BLOCK_TYPES, Q4_0, Q4_1, Q8_0, BlockType


def four_bit_type(symmetric: bool) -> BlockType:
    """The 32-weight type that holds hexq's <= 4-bit codes exactly (hexq.packed.ggml.packed_blocks)."""
    return Q4_0 if symmetric else Q4_1


def layer_type(allocation: list[int], symmetric: bool, kquants_fit: bool) -> BlockType:
    """The type `--experts auto` gives a MoE layer: the class of its mean allocated width (skipped experts count 0),
    i.e. what the allocation pays for: >= 6 bits Q8_0, > 3.5 the 4-bit type, > 2.5 Q3_K, else Q2_K; the 4-bit type
    when the rows are no multiple of 256 (K-quants cannot hold them)."""
    mean = sum(allocation) / len(allocation)
    if mean >= 6:
        return Q8_0
    if mean > 3.5 or not kquants_fit:
        return four_bit_type(symmetric)
    return BLOCK_TYPES["Q3_K" if mean > 2.5 else "Q2_K"]


def wider_types(kind: BlockType, symmetric: bool) -> list[BlockType]:
    """`kind`, then the types `--experts auto` falls back to when an expert of the layer has no source for it (a
    K-quant replica, a 4-bit replica of a wider expert): the 4-bit type (hexq's <= 4-bit codes exactly), then Q8_0
    (any width). A larger file rather than a refused export, as the compressed-tensors export gives such a layer 8
    bits."""
    wider = [four_bit_type(symmetric), Q8_0]
    return [kind, *wider[wider.index(kind) + 1:]] if kind in wider else [kind, *wider]
