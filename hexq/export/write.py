"""An export written one decoder layer at a time into hub-named safetensors shards (ShardedWriter), from the plan
(hexq.export.plan) and the artifact's stored codes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.artifact.format import HEAD_WEIGHT, MODEL_FILES, TOP_SHARD, dense_shard, export_shard, replica_key
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.base.io import SafetensorsWriter, write_json_atomic
from hexq.export.codec import (
    INDEX,
    SINGLE,
    CtScheme,
    CtWeight,
    expert_modules,
    experts_target,
    hub_name,
    module_specs,
    module_tensors,
    quantization_config,
    retarget,
    rtn_weight,
)
from hexq.export.plan import ExpertChoice, LayerExport, dense_scheme, plan_export
from hexq.model.adapters import MoEAdapter
from hexq.model.streaming import StreamedModel
from hexq.packed.weight import PROJECTIONS, PackedWeight, dequantize_packed
from hexq.runtime.model import artifact_config

Progress = Callable[[str, int, int], None]
DEFAULT_SHARD_BYTES = 5 * 10**9  # as save_pretrained's default max_shard_size "5GB"


# ------------------------------------------------------------------------------------------ sharded writing


class ShardedWriter:
    """A checkpoint written tensor by tensor into shards of at most `max_bytes` (a tensor larger than that gets a
    shard of its own), named as the hub names them, with model.safetensors.index.json; a single shard is
    model.safetensors without index, as save_pretrained writes it. Every tensor is declared up front (`plan`, in
    order), so each shard's header is written first and a tensor goes straight to its place in the file; a shard
    is closed (fsync, rename) as soon as its last tensor is written, so only open files' headers stay in memory."""

    def __init__(self, folder: Path, plan: dict[str, tuple[torch.dtype, tuple]], max_bytes: int) -> None:
        self.folder = Path(folder)
        shards: list[dict] = [{}]
        size = 0
        for key, (dtype, shape) in plan.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = (dtype, shape)
            size += nbytes
        count = len(shards)
        self.names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                  for i in range(count)]
        self.specs = shards
        self.shard_of = {key: i for i, shard in enumerate(shards) for key in shard}
        self.total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in plan.values())
        self._open: dict[int, SafetensorsWriter] = {}
        self._left = [len(shard) for shard in shards]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        index = self.shard_of.get(key)
        if index is None:
            raise HexqError(f"tensor {key} was not planned for the export (the export plan and its tensors differ)")
        writer = self._open.get(index)
        if writer is None:
            writer = self._open[index] = SafetensorsWriter(self.folder / self.names[index], self.specs[index],
                                                           {"format": "pt"})
        writer.write(key, tensor)
        self._left[index] -= 1
        if self._left[index] == 0:
            self._open.pop(index).close()

    def finish(self) -> None:
        """Fail unless every planned tensor was written; write the index."""
        left = [i for i, count in enumerate(self._left) if count]
        if left:
            pending = next(key for key, i in self.shard_of.items() if i == left[0]
                           and (i not in self._open or key in self._open[i].pending))
            self.abort()
            raise HexqError(f"export tensor {pending} was planned but never written")
        if len(self.names) > 1:
            write_json_atomic(self.folder / INDEX, {"metadata": {"total_size": self.total},
                                                    "weight_map": {key: self.names[i]
                                                                   for key, i in sorted(self.shard_of.items())}})

    def abort(self) -> None:
        for writer in self._open.values():
            writer.abort()
        self._open.clear()




# ------------------------------------------------------------------------------------------ tensors of one layer


def split_rows(weight: CtWeight, at: int) -> tuple[CtWeight, CtWeight]:
    """gate_up's [2I, H] codes as (gate [I, H], up [I, H]): every tensor of a CtWeight is per output row."""
    parts = [t.split([at, t.shape[0] - at]) if t is not None else (None, None)
             for t in (weight.codes, weight.scale, weight.zero)]
    return CtWeight(parts[0][0], parts[1][0], parts[2][0]), CtWeight(parts[0][1], parts[1][1], parts[2][1])


def expert_weight(artifact: Artifact, row: int, choice: ExpertChoice, projection: str, scheme: CtScheme) -> CtWeight:
    """One projection of one expert in the layer's scheme, from the source `choice` names."""
    shape = artifact.expert_shape(projection)
    symmetric = (artifact.export_section["symmetric"] if choice.source == "export-replica"
                 else artifact.symmetric)
    if choice.source == "rtn":
        return rtn_weight(dequantize_packed(artifact.packed_expert(row, choice.expert, choice.allocated,
                                                                   projection)), scheme)
    if choice.source == "export-replica":
        shard, prefix = export_shard(artifact.moe_layers[row]), replica_key(choice.expert, choice.bits, projection)
        packed = PackedWeight(artifact.tensor(shard, f"{prefix}.codes"), artifact.tensor(shard, f"{prefix}.scale"),
                              artifact.tensor(shard, f"{prefix}.zero"), choice.bits, shape)
    else:
        packed = artifact.packed_expert(row, choice.expert, choice.bits, projection)
    weight = retarget(packed, symmetric, scheme)
    if weight is None:
        raise HexqError(f"{artifact.path}: expert {choice.expert} of layer {artifact.moe_layers[row]} "
                        f"({projection}, {choice.bits} bits) has no exact {scheme.name} form (its zero points are "
                        "not on the expected grid); the artifact may be corrupt")
    return weight


def quantized_module_weight(artifact: Artifact, name: str, bits: int, shape: tuple[int, int],
                            scheme: CtScheme) -> CtWeight:
    """A quantized dense linear (weight name `name`) in the dense scheme, bit-identical."""
    shard = dense_shard(int(name.split(".")[2]))
    packed = PackedWeight(artifact.tensor(shard, f"{name}.codes"), artifact.tensor(shard, f"{name}.scale"),
                          artifact.tensor(shard, f"{name}.zero"), bits, shape)
    weight = retarget(packed, scheme.symmetric, scheme)
    if weight is None:
        raise HexqError(f"{artifact.path}: {name} ({bits} bits) has no exact {scheme.name} form")
    return weight


# ------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class WritePlan:
    """Every checkpoint tensor (in writing order) and how the modules are quantized, before anything is read."""

    specs: dict[str, tuple[torch.dtype, tuple]]
    groups: dict[CtScheme, list[str]]
    layers: list[LayerExport]
    dense: CtScheme


def _header_specs(artifact: Artifact, shard: str) -> dict[str, tuple[torch.dtype, tuple]]:
    from safetensors import safe_open

    with safe_open(str(artifact.verify(shard)), framework="pt") as handle:
        out = {}
        for key in handle.keys():
            piece = handle.get_slice(key)
            out[key] = (getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                                        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                                        "U8": "uint8", "BOOL": "bool"}[piece.get_dtype()]),
                        tuple(piece.get_shape()))
    return out


def _dense_keys(artifact: Artifact, shard: str, quantized: dict[str, int]) -> tuple[dict, list[str]]:
    """(stored plain tensors {key: spec}, quantized weight names) of one dense shard."""
    plain, modules = {}, []
    for key, spec in _header_specs(artifact, shard).items():
        if key.endswith(".act_range") or any(key == f"{name}.{part}" for name in quantized
                                             for part in ("codes", "scale", "zero")):
            continue
        plain[key] = spec
    modules = [name for name in quantized if f"{name}.codes" in artifact.keys(shard)]
    return plain, modules


def top_specs(artifact: Artifact, streamed) -> dict[str, tuple[torch.dtype, tuple]]:
    """The top shard's tensors as the export writes them. A quantized head (the recipe's head section) becomes one
    float lm_head.weight in the embeddings' dtype, its codes dequantized: compressed-tensors checkpoints keep the LM
    head in full precision (llm-compressor's leave it unquantized, and vLLM applies their schemes to linear layers,
    which its vocabulary-parallel head is not)."""
    top = _header_specs(artifact, TOP_SHARD)
    if HEAD_WEIGHT in artifact.quantized_linears:
        for part in ("codes", "scale", "zero"):
            del top[f"{HEAD_WEIGHT}.{part}"]
        shape = tuple(streamed.model.get_parameter(HEAD_WEIGHT).shape)
        top[HEAD_WEIGHT] = (top["model.embed_tokens.weight"][0], shape)
    return top


def top_tensor(artifact: Artifact, key: str, spec: tuple[torch.dtype, tuple]) -> torch.Tensor:
    """One tensor of top_specs: as stored, or the quantized head dequantized into its spec's dtype."""
    if key == HEAD_WEIGHT and key in artifact.quantized_linears:
        return artifact.read_param(key, spec[1], spec[0])  # 622 MB in bfloat16 at a 151,936-token vocabulary
    return artifact.tensor(TOP_SHARD, key)


def make_write_plan(artifact: Artifact, streamed, layers: list[LayerExport], adapter: MoEAdapter) -> WritePlan:
    dense = dense_scheme(artifact)
    quantized = artifact.quantized_linears
    specs: dict[str, tuple[torch.dtype, tuple]] = {}
    groups: dict[CtScheme, list[str]] = {}
    top = top_specs(artifact, streamed)
    first = [key for key in top if key.startswith("model.embed_tokens")]
    specs |= {key: top[key] for key in first}
    by_layer = {plan.layer: plan for plan in layers}
    shapes = {p: artifact.expert_shape(p) for p in PROJECTIONS}
    inner = shapes["gate_up"][0] // 2
    for index in range(artifact.num_layers):
        plain, modules = _dense_keys(artifact, dense_shard(index), quantized)
        for key, spec in plain.items():
            specs[hub_name(key, adapter)] = spec
        for name in modules:
            shape = tuple(streamed.model.get_parameter(name).shape)
            module = hub_name(name.removesuffix(".weight"), adapter)
            specs |= module_specs(module, shape, dense)
            groups.setdefault(dense, []).append(module)
        plan = by_layer.get(index)
        if plan is not None:
            for e in range(artifact.num_experts):
                gate, up, down = expert_modules(index, e, adapter)
                for module, shape in ((gate, (inner, shapes["gate_up"][1])), (up, (inner, shapes["gate_up"][1])),
                                      (down, shapes["down"])):
                    specs |= module_specs(module, shape, plan.scheme)
    specs |= {key: spec for key, spec in top.items() if key not in first}
    for scheme in {plan.scheme for plan in layers}:
        groups.setdefault(scheme, []).append(
            experts_target([plan.layer for plan in layers if plan.scheme == scheme], adapter))
    return WritePlan(specs, groups, layers, dense)


def write_layer(artifact: Artifact, streamed, writer: ShardedWriter, index: int, plan: WritePlan,
                adapter: MoEAdapter) -> None:
    """Layer `index`'s tensors into the writer: dense part, then every routed expert, one at a time."""
    quantized = artifact.quantized_linears
    shard = dense_shard(index)
    plain, modules = _dense_keys(artifact, shard, quantized)
    for key in plain:
        writer.write(hub_name(key, adapter), artifact.tensor(shard, key))
    for name in modules:
        shape = tuple(streamed.model.get_parameter(name).shape)
        weight = quantized_module_weight(artifact, name, quantized[name], shape, plan.dense)
        for key, tensor in module_tensors(hub_name(name.removesuffix(".weight"), adapter), weight,
                                          plan.dense).items():
            writer.write(key, tensor)
    layer = next((p for p in plan.layers if p.layer == index), None)
    if layer is None:
        return
    row = artifact.moe_layers.index(index)
    inner = artifact.expert_shape("gate_up")[0] // 2
    for choice in layer.choices:
        gate_up = expert_weight(artifact, row, choice, "gate_up", layer.scheme)
        down = expert_weight(artifact, row, choice, "down", layer.scheme)
        gate, up = split_rows(gate_up, inner)
        for module, weight in zip(expert_modules(index, choice.expert, adapter), (gate, up, down), strict=True):
            for key, tensor in module_tensors(module, weight, layer.scheme).items():
                writer.write(key, tensor)


def write_export(artifact: Artifact, folder: Path, experts: str = "auto", shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Progress | None = None) -> WritePlan:
    """Write the checkpoint into `folder` (an empty folder: the caller publishes it)."""
    config = artifact_config(artifact)
    streamed = StreamedModel(config, artifact, torch.device("cpu"))  # the skeleton, for shapes only
    adapter = streamed.adapter
    plan = make_write_plan(artifact, streamed, plan_export(artifact, experts), adapter)
    writer = ShardedWriter(folder, plan.specs, shard_bytes)
    try:
        top = top_specs(artifact, streamed)
        for key, spec in top.items():
            if key.startswith("model.embed_tokens"):
                writer.write(key, top_tensor(artifact, key, spec))
        # the artifact's pages read so far stop counting in the process after each part (at a real vocabulary the
        # embeddings alone are 622 MB of mapped file)
        artifact.release()
        for index in range(artifact.num_layers):
            write_layer(artifact, streamed, writer, index, plan, adapter)
            artifact.release()
            if progress:
                progress("write", index + 1, artifact.num_layers)
        for key, spec in top.items():
            if not key.startswith("model.embed_tokens"):
                writer.write(key, top_tensor(artifact, key, spec))
        artifact.release()
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    data = json.loads((artifact.verify("config.json")).read_text())
    data["quantization_config"] = quantization_config(plan.groups)
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")

    for name in MODEL_FILES:
        if name != "config.json" and name in artifact.files:
            (folder / name).write_bytes(artifact.verify(name).read_bytes())
    return plan
