"""`hexq export --format gguf`: an artifact written as one GGUF file for llama.cpp, one decoder layer at a time.

Every tensor's type and size is known from the manifest and the shards' headers before a byte is written
(hexq.export.gguf.plan), so gguf-py's writer takes the header, the metadata (hexq.export.gguf.arch) and the tensor
table first and then each tensor as it is made: the artifact's dense shard of layer l, its experts' blocks, then layer
l + 1. Peak
memory: one fused expert tensor's blocks (the largest of a layer's three) plus one expert's unpacked codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hexq.artifact.format import HEAD_WEIGHT, TOP_SHARD, dense_shard, export_shard, kquant_key, replica_key
from hexq.artifact.reader import Artifact
from hexq.artifact.spans import safetensors_spans
from hexq.base.errors import HexqError
from hexq.export.gguf.arch import (
    EXPERT_NAMES,
    Family,
    add_hyperparameters,
    add_tokenizer,
    family_of,
    gguf_name,
    rope_permutation,
)
from hexq.export.gguf.plan import (
    ExpertSource,
    LayerPlan,
    dense_type,
    expert_type,
    fits_blocks,
    plan_auto_layer,
    plan_layer,
)
from hexq.export.plan import refuse_skipped_experts
from hexq.packed.bitpack import packed_nbytes
from hexq.packed.ggml import decode, packed_blocks
from hexq.packed.weight import PROJECTIONS, PackedWeight, dequantize_packed

ROW_ELEMENTS = 1 << 24  # weights per chunk of a 2-D tensor's rows (row_chunks): 64 MB in float32

Progress = Callable[[str, int, int], None]
FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # GGMLQuantizationType of stored floats


@dataclass
class TensorPlan:
    """One GGUF tensor: its name, torch-order shape, GGML type id, bytes, and how to make it."""

    name: str
    shape: tuple[int, ...]
    ggml: int
    nbytes: int
    make: Callable[[], torch.Tensor]
    exact: bool = True  # False: re-rounded (an asymmetric code in Q8_0)
    type_name: str = ""
    # float32 weights hexq computes with, of rows `rows` of one part: expert e of a 3-D tensor, a 2-D one as part 0;
    # None for tensors stored in float, which are written as they are stored
    reference: Callable[[int, slice], torch.Tensor] | None = None

    @property
    def parts(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1


@dataclass
class GgufPlan:
    family: Family
    layers: list[LayerPlan]
    tensors: list[TensorPlan] = field(default_factory=list)

    @property
    def inexact(self) -> list[str]:
        return [t.name for t in self.tensors if not t.exact]


# ------------------------------------------------------------------------------------------ the plan


def _shard_specs(artifact: Artifact, shard: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {key: (span.dtype, tuple(span.shape)) for key, span in safetensors_spans(artifact.verify(shard)).items()}


def _float_tensor(name: str, artifact: Artifact, shard: str, key: str, dtype: torch.dtype, shape: tuple,
                  squeeze: bool = False) -> TensorPlan:
    """A tensor stored in float: 2-D in its own dtype, 1-D (norms, biases, Qwen2-MoE's shared-expert gate) as F32."""
    out_shape = (shape[-1],) if squeeze or len(shape) == 1 else shape
    keep = len(out_shape) > 1 and dtype in FLOAT_TYPES
    out_dtype = dtype if keep else torch.float32

    def make() -> torch.Tensor:
        return artifact.tensor(shard, key).to(out_dtype).reshape(out_shape)

    ggml = FLOAT_TYPES[out_dtype]
    return TensorPlan(name, out_shape, ggml, math.prod(out_shape) * out_dtype.itemsize, make,
                      type_name={0: "F32", 1: "F16", 30: "BF16"}[ggml])


def row_chunks(shape: tuple[int, int]) -> list[slice]:
    """Rows of a quantized 2-D tensor made and checked at a time, ROW_ELEMENTS weights each, so that neither a
    head's float32 weights (1.2 GB at 151,936 x 2048) nor its unpacked codes are ever whole. GGUF's block types
    take rows of whole 32-weight blocks, so each row's codes end on a byte and rows can be cut out."""
    rows, cols = shape
    step = max(1, ROW_ELEMENTS // max(cols, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _quantized_tensor(name: str, artifact: Artifact, key: str, bits: int, shape: tuple[int, int],
                      symmetric: bool, group: int | None, permute: torch.Tensor | None) -> TensorPlan:
    kind, exact = dense_type(bits, symmetric, group, shape[1])

    def packed() -> PackedWeight:
        return artifact.packed_param(key, shape)

    def make() -> torch.Tensor:
        weight = packed()
        blocks = torch.empty(shape[0], kind.row_bytes(shape[1]), dtype=torch.uint8)
        for rows in row_chunks(shape):
            blocks[rows] = packed_blocks(weight.rows(rows.start, rows.stop), symmetric, kind)
        return blocks if permute is None else blocks[permute]

    def reference(_part: int, rows: slice) -> torch.Tensor:
        if permute is not None:  # q or k of one layer, rows in llama.cpp's RoPE order
            return dequantize_packed(packed())[permute[rows]]
        return dequantize_packed(packed().rows(rows.start, rows.stop))

    return TensorPlan(name, shape, kind.ggml, shape[0] * kind.row_bytes(shape[1]), make, exact, kind.name, reference)


def _layer_tensors(artifact: Artifact, index: int, family: Family, config) -> list[TensorPlan]:
    """The dense part of decoder layer `index`, in the shard's order."""
    shard = dense_shard(index)
    recipe = artifact.recipe
    quantized = artifact.quantized_linears
    out = []
    for key, (dtype, shape) in _shard_specs(artifact, shard).items():
        if key.endswith(".act_range") or key.endswith(".scale") or key.endswith(".zero"):
            continue
        weight = key.removesuffix(".codes")
        name = gguf_name(weight)
        if name is None:
            raise HexqError(f"{artifact.path}: {weight} has no place in llama.cpp's {family.arch} model")
        permute = None
        if family.interleaved_rope and (".self_attn.q_proj." in weight or ".self_attn.k_proj." in weight):
            heads = config.num_attention_heads if ".q_proj." in weight else config.num_key_value_heads
            rows = shape[0] if weight == key else None
            permute = rope_permutation(rows or _rows_of(artifact, shard, weight), heads)
        if weight != key:
            bits = quantized[weight]
            full = (_rows_of(artifact, shard, weight), _cols_of(artifact, shard, weight, bits))
            out.append(_quantized_tensor(name, artifact, weight, bits, full, recipe.weights.symmetric,
                                         recipe.weights.group_size, permute))
        else:
            plan = _float_tensor(name, artifact, shard, key, dtype, shape, squeeze=name.endswith("_shexp.weight")
                                 and "gate_inp" in name)
            if permute is not None:
                make = plan.make
                plan.make = lambda make=make, order=permute: make()[order]
            out.append(plan)
    return out


def _rows_of(artifact: Artifact, shard: str, weight: str) -> int:
    return _shard_specs(artifact, shard)[f"{weight}.scale"][1][0]


def _cols_of(artifact: Artifact, shard: str, weight: str, bits: int) -> int:
    """Input columns of a quantized linear, from its packed codes' length (ceil(bits * numel / 8) bytes)."""
    rows, nbytes = _rows_of(artifact, shard, weight), _shard_specs(artifact, shard)[f"{weight}.codes"][1][0]
    cols = nbytes * 8 // bits // rows
    if packed_nbytes(rows * cols, bits) != nbytes:
        raise HexqError(f"{artifact.path / shard}: {weight} holds {nbytes} bytes of {bits}-bit codes, not a matrix of "
                        f"{rows} rows")
    return cols


def _kquant_experts(artifact: Artifact, layer: int, kind: str) -> set[int]:
    section = artifact.gguf_replicas.get(str(layer), {})
    return set(section.get(kind, []))


def plan_gguf(artifact: Artifact, experts: str = "auto") -> GgufPlan:
    """Every tensor of the GGUF file for `artifact` (module docstring), nothing read but headers."""
    from hexq.runtime.model import artifact_config  # transformers: imported when a plan is made, not at start-up

    refuse_skipped_experts(artifact, "GGUF", "llama.cpp")
    config = artifact_config(artifact)
    family = family_of(config)
    symmetric, group = artifact.symmetric, artifact.group_size
    shapes = dict(zip(PROJECTIONS, artifact.expert_shapes, strict=True))
    kquants_fit = all(cols % 256 == 0 for _rows, cols in shapes.values())
    if not all(fits_blocks(group, cols, 32) for _rows, cols in shapes.values()):
        raise HexqError(f"{artifact.path}: experts in groups of {group} columns do not cover whole 32-weight blocks; "
                        "calibrate with expert groups of 32, 64 or 128 (or per channel)")
    extra = artifact.export_section  # the compressed-tensors export replicas hexq pack kept
    same_grid = (extra.get("bits"), extra.get("group_size"), extra.get("symmetric")) == (4, group, symmetric)
    layers = []
    for row, layer in enumerate(artifact.moe_layers):
        allocation = artifact.allocation[row]
        kind = expert_type(experts, allocation, symmetric, kquants_fit)
        if kind.block == 256 and not kquants_fit:
            raise HexqError(f"{kind.name} needs expert rows of a multiple of 256 weights; this model's are "
                            f"{[cols for _r, cols in shapes.values()]} (use --experts q4)")
        replicas = set(extra.get("replicas", {}).get(str(layer), [])) if same_grid else set()
        stored = [artifact.stored_bits(row, e) for e in range(artifact.num_experts)]
        if experts == "auto":
            layers.append(plan_auto_layer(layer, row, kind, allocation, stored, symmetric, replicas,
                                          lambda name, layer=layer: _kquant_experts(artifact, layer, name)))
        else:
            layers.append(plan_layer(layer, row, kind, allocation, stored, symmetric, replicas,
                                     _kquant_experts(artifact, layer, kind.name)))
    plan = GgufPlan(family, layers)
    top = _shard_specs(artifact, TOP_SHARD)
    embed = "model.embed_tokens.weight"
    plan.tensors.append(_float_tensor("token_embd.weight", artifact, TOP_SHARD, embed, *top[embed]))
    by_layer = {layer.layer: layer for layer in layers}
    for index in range(artifact.num_layers):
        plan.tensors += _layer_tensors(artifact, index, family, config)
        if index in by_layer:
            plan.tensors += _expert_tensors(artifact, by_layer[index])
    plan.tensors.append(_float_tensor("output_norm.weight", artifact, TOP_SHARD, "model.norm.weight",
                                      *top["model.norm.weight"]))
    if HEAD_WEIGHT in artifact.quantized_linears:  # the recipe's head section: its codes on a GGUF block type
        bits, head = artifact.quantized_linears[HEAD_WEIGHT], artifact.recipe.head
        shape = (_rows_of(artifact, TOP_SHARD, HEAD_WEIGHT), _cols_of(artifact, TOP_SHARD, HEAD_WEIGHT, bits))
        plan.tensors.append(_quantized_tensor("output.weight", artifact, HEAD_WEIGHT, bits, shape,
                                              head.symmetric, head.group_size, None))
    elif HEAD_WEIGHT in top:
        plan.tensors.append(_float_tensor("output.weight", artifact, TOP_SHARD, HEAD_WEIGHT, *top[HEAD_WEIGHT]))
    elif family.output_required:  # tied: the loader still wants its own copy
        plan.tensors.append(_float_tensor("output.weight", artifact, TOP_SHARD, embed, *top[embed]))
    return plan


# ------------------------------------------------------------------------------------------ routed experts


def expert_blocks(artifact: Artifact, layer: LayerPlan, source: ExpertSource, projection: str) -> torch.Tensor:
    """Blocks [rows, row_bytes] of one expert's projection (gate_up [2I, H] or down [H, I])."""
    rows, cols = artifact.expert_shape(projection)
    kind = layer.kind
    if source.source == "kquant":
        raw = artifact.tensor(export_shard(layer.layer), kquant_key(source.expert, kind.name, projection))
        return raw.reshape(rows, kind.row_bytes(cols))
    return packed_blocks(stored_expert(artifact, layer, source, projection), artifact.symmetric,
                         kind)


def stored_expert(artifact: Artifact, layer: LayerPlan, source: ExpertSource, projection: str) -> PackedWeight:
    """The stored hexq-grid matrix an exact / replica / export-replica / rtn source is made from."""
    if source.source == "export-replica":
        shard, prefix = export_shard(layer.layer), replica_key(source.expert, 4, projection)
        return PackedWeight(artifact.tensor(shard, f"{prefix}.codes"), artifact.tensor(shard, f"{prefix}.scale"),
                            artifact.tensor(shard, f"{prefix}.zero"), 4, artifact.expert_shape(projection))
    return artifact.packed_expert(layer.row, source.expert, source.bits, projection)


def reference_expert(artifact: Artifact, layer: LayerPlan, expert: int, projection: str) -> torch.Tensor:
    """Float32 [rows, cols] of one expert's projection as hexq computes the export's width of it: the stored code
    dequantized, or the K-quant replica's blocks decoded by hexq."""
    source = layer.experts[expert]
    rows, cols = artifact.expert_shape(projection)
    if source.source == "kquant":  # read here, not through expert_blocks: the check compares the two paths
        raw = artifact.tensor(export_shard(layer.layer), kquant_key(source.expert, layer.kind.name, projection))
        return decode(layer.kind, raw.reshape(rows, -1), cols)
    return dequantize_packed(stored_expert(artifact, layer, source, projection))


def _expert_tensors(artifact: Artifact, layer: LayerPlan) -> list[TensorPlan]:
    """ffn_gate_exps, ffn_up_exps, ffn_down_exps of one MoE layer: gate and up are made together (one pass over
    the experts' gate_up), down on its own."""
    num = artifact.num_experts
    (rows2, cols), (rows_down, cols_down) = artifact.expert_shape("gate_up"), artifact.expert_shape("down")
    half, kind = rows2 // 2, layer.kind
    made: dict[str, torch.Tensor] = {}

    def gate_up() -> None:
        out = torch.empty(2, num, half, kind.row_bytes(cols), dtype=torch.uint8)
        for source in layer.experts:
            blocks = expert_blocks(artifact, layer, source, "gate_up")
            out[0, source.expert], out[1, source.expert] = blocks[:half], blocks[half:]
        made["gate"], made["up"] = out[0], out[1]

    def take(name: str) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            if name not in made:
                gate_up()
            return made.pop(name)
        return make

    def down() -> torch.Tensor:
        return torch.stack([expert_blocks(artifact, layer, s, "down") for s in layer.experts])

    def reference(projection: str, rows: slice) -> Callable[[int, slice], torch.Tensor]:
        return lambda expert, chunk: reference_expert(artifact, layer, expert, projection)[rows][chunk]

    prefix, exact = f"blk.{layer.layer}.", all(s.source != "rtn" for s in layer.experts)
    gate_bytes, down_bytes = num * half * kind.row_bytes(cols), num * rows_down * kind.row_bytes(cols_down)
    return [TensorPlan(prefix + EXPERT_NAMES[0] + ".weight", (num, half, cols), kind.ggml, gate_bytes, take("gate"),
                       exact, kind.name, reference("gate_up", slice(0, half))),
            TensorPlan(prefix + EXPERT_NAMES[1] + ".weight", (num, half, cols), kind.ggml, gate_bytes, take("up"),
                       exact, kind.name, reference("gate_up", slice(half, None))),
            TensorPlan(prefix + EXPERT_NAMES[2] + ".weight", (num, rows_down, cols_down), kind.ggml, down_bytes, down,
                       exact, kind.name, reference("down", slice(None)))]


# ------------------------------------------------------------------------------------------ writing


def write_gguf(artifact: Artifact, path: Path, plan: GgufPlan, progress: Progress | None = None) -> None:
    """The GGUF file at `path` (the caller makes it a temporary name and publishes it): metadata, tensor table, then
    every tensor in plan order, made one at a time."""
    import gguf

    from hexq.runtime.model import artifact_config  # transformers: imported when a file is written, not at start-up

    config = artifact_config(artifact)
    writer = gguf.GGUFWriter(path, plan.family.arch)
    try:
        writer.add_name(Path(artifact.path).name)
        writer.add_quantized_by(f"hexq {artifact.hexq_version}".strip())
        add_hyperparameters(writer, config, plan.family)
        add_tokenizer(writer, Path(artifact.verify("tokenizer.json")).parent, config.vocab_size)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tensor in plan.tensors:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(tensor.ggml))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for done, tensor in enumerate(plan.tensors):
            data = tensor.make().contiguous()
            if data.numel() * data.element_size() != tensor.nbytes:
                raise HexqError(f"GGUF tensor {tensor.name}: made {data.numel() * data.element_size()} bytes, "
                                f"planned {tensor.nbytes}")
            writer.write_tensor_data(data.reshape(-1).view(torch.uint8).numpy())
            del data
            artifact.release()
            if progress:
                progress("write", done + 1, len(plan.tensors))
    finally:
        writer.close()
