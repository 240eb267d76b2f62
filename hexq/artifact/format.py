"""The packed artifact's folder format: file names, the writer and the manifest (hexq.artifact.reader reads it).

    NAME.hexq/
      manifest.json                 format + version, model summary, provenance, recipe, allocation, placement,
                                    byte accounting, and the SHA-256 and size of every other file (written last)
      config.json, tokenizer*.json  the source model's config and tokenizer, as they were (a quantized head of a
                                    tied model: tie_word_embeddings false, the head being a tensor of its own)
      dense/top.safetensors         embeddings, final norm, LM head (absent when tied to the embeddings; codes,
                                    scale and zero when the recipe quantizes it)
      dense/layer_NNN.safetensors   one decoder layer's non-expert tensors under their model names (smoothing
                                    folded into the norms); quantized linears as "<name>.weight.codes/.scale/.zero"
                                    plus a static activation range "<name>.act_range"; a dense layer's MLP too
      stats.safetensors             per MoE layer: loss tables, router counts / score sums / calibration top-k
                                    traces, importance, placement
      experts/layer_NNN.safetensors one MoE layer's stored replicas: for expert e at b bits,
                                    "eEEEE.bB.gate_up.codes" (densely bit-packed, ceil(b*numel/8) bytes), ".scale"
                                    and ".zero" (float16, one per group), same for "down"; static expert activation
                                    ranges if any. Every expert keeps its allocated width plus the `bank` widths
      export/layer_NNN.safetensors  the export replicas of a MoE layer's experts, when pack kept them (same keys),
                                    and their K-quant replicas for a GGUF export ("eEEEE.q3_k.gate_up": GGML blocks)

Layer numbers in file names are the model's; the allocation, placement and statistics have one row per MoE layer
(`model.moe_layers` gives their model indices), so dense layers (e.g. DeepSeek's first layers) take no row.

Why per-layer shards: a file's SHA-256 is checked the first time it is opened, so reading one layer checks one
layer's shards, not the whole artifact; inside a shard safetensors reads only the requested tensors (mmap), and
`Artifact.read_expert` reads one replica with pread into a caller's buffer (a server keeps nothing mapped). Replicas
and quantized linears are hexq.packed PackedWeights, as calibration stored them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hexq import __version__
from hexq.base.errors import HexqError
from hexq.base.io import file_record, read_sealed_json, save_tensors, write_json_atomic, write_sealed_json
from hexq.packed.weight import PROJECTIONS

FORMAT = "hexq-artifact"
FORMAT_VERSION = 2  # 2: per-layer dense shards, MoE-layer rows, only the allocated + bank widths stored
MANIFEST = "manifest.json"
TOP_SHARD = "dense/top.safetensors"
STATS_SHARD = "stats.safetensors"
# Files of the source model folder copied into the artifact (config and tokenizer; weights are re-packed).
HEAD_WEIGHT = "lm_head.weight"  # a quantized head's name in dense.quantized_linears (weight-only: hexq.calib.head)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def expert_shard(layer: int) -> str:
    return f"experts/layer_{layer:03d}.safetensors"


def dense_shard(layer: int) -> str:
    return f"dense/layer_{layer:03d}.safetensors"


def layer_of(name: str) -> int | None:
    """The decoder layer a model parameter belongs to (model.layers.N....), or None for a top-level one."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None


def replica_key(expert: int, bits: int, projection: str) -> str:
    return f"e{expert:04d}.b{bits}.{projection}"


def export_shard(layer: int) -> str:
    """The artifact file holding a MoE layer's export replicas."""
    return f"export/layer_{layer:03d}.safetensors"


def kquant_key(expert: int, kind: str, projection: str) -> str:
    """An expert's K-quant replica in its layer's export shard: the GGML blocks of one projection, 1-D uint8."""
    return f"e{expert:04d}.{kind.lower()}.{projection}"


# ------------------------------------------------------------------------------------------ writing


class ArtifactWriter:
    """Fills an artifact folder (the temporary folder hexq.base.outputs.output_folder gives, published only when
    complete): every file written atomically and recorded with its size and SHA-256; the manifest, written last by
    `finish`, lists them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, dict] = {}

    def _record(self, name: str) -> None:
        self.files[name] = file_record(self.folder / name)

    def add_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_tensors(self.folder / name, tensors)
        self._record(name)

    def add_file(self, name: str, source: Path) -> None:
        shutil.copyfile(source, self.folder / name)
        self._record(name)

    def add_json(self, name: str, data: dict) -> None:
        write_json_atomic(self.folder / name, data)
        self._record(name)

    def finish(self, manifest: dict) -> None:
        """Write the manifest and its seal (manifest.sha256): any later edit of the manifest is named on open."""
        write_sealed_json(self.folder / MANIFEST, {"format": FORMAT, "format_version": FORMAT_VERSION,
                                                   "hexq_version": __version__, **manifest,
                                                   "files": dict(sorted(self.files.items()))})


# ------------------------------------------------------------------------------------------ reading


def read_artifact_manifest(path: Path) -> dict:
    """The manifest of the artifact at `path`: its seal checked (any edit is named), then its format, version and
    every field the readers rely on (validate_manifest)."""
    manifest_path = Path(path) / MANIFEST
    if not Path(path).is_dir():
        raise HexqError(f"{path} is not a hexq artifact folder (made by hexq pack)")
    if not manifest_path.is_file():
        raise HexqError(f"{path} has no {MANIFEST}: not a hexq artifact, or hexq pack did not finish")
    manifest = read_sealed_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HexqError(f"{manifest_path} is not a hexq artifact manifest (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise HexqError(f"{path} has artifact format version {version}, newer than this hexq reads "
                        f"({FORMAT_VERSION}); upgrade hexq (it is {__version__})")
    if version < FORMAT_VERSION:
        raise HexqError(f"{path} has artifact format version {version}; this hexq reads version {FORMAT_VERSION}: "
                        "pack the calibration again")
    validate_manifest(manifest, manifest_path)
    return manifest


def _field(manifest: dict, dotted: str, kind, where: Path):
    """manifest[a][b]... of type `kind`, or a one-line HexqError naming the field."""
    value = manifest
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise HexqError(f"{where}: field {dotted} is missing")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise HexqError(f"{where}: field {dotted} has the wrong type ({type(value).__name__})")
    return value


def _ints(values, name: str, where: Path, low: int, high: int) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
                                               for v in values):
        raise HexqError(f"{where}: field {name} must be a list of integers in {low}..{high}")
    return values


def validate_manifest(manifest: dict, where: Path) -> None:
    """Every field the readers and the runtime rely on has its type and is consistent with the others (the seal
    catches edits; this catches a manifest hexq did not write the way it reads)."""
    layers = _field(manifest, "model.num_layers", int, where)
    experts = _field(manifest, "model.num_experts", int, where)
    top_k = _field(manifest, "model.top_k", int, where)
    if experts < 1 or not 1 <= top_k <= experts:
        raise HexqError(f"{where}: model.top_k {top_k} must be in 1..model.num_experts ({experts})")
    moe = _ints(_field(manifest, "model.moe_layers", list, where), "model.moe_layers", where, 0, layers - 1)
    if not moe or moe != sorted(set(moe)):
        raise HexqError(f"{where}: field model.moe_layers must list distinct layers in order")
    replica = _ints(_field(manifest, "experts.replica_bits", list, where), "experts.replica_bits", where, 1, 8)
    _ints(_field(manifest, "experts.bank_bits", list, where), "experts.bank_bits", where, 1, 8)
    if not set(manifest["experts"]["bank_bits"]) <= set(replica):
        raise HexqError(f"{where}: experts.bank_bits {manifest['experts']['bank_bits']} are not calibrated widths "
                        f"{replica}")
    shapes = _field(manifest, "experts.shapes", dict, where)
    group = manifest["experts"].get("group_size")
    for projection in PROJECTIONS:
        shape = _ints(shapes.get(projection), f"experts.shapes.{projection}", where, 1, 1 << 31)
        if len(shape) != 2 or group is not None and (not isinstance(group, int) or group < 1 or shape[1] % group):
            raise HexqError(f"{where}: experts.shapes.{projection} {shape} does not fit group size {group}")
    rows = _field(manifest, "allocation.bits", list, where)
    if len(rows) != len(moe):
        raise HexqError(f"{where}: allocation.bits has {len(rows)} rows for {len(moe)} MoE layers")
    for row in rows:
        _ints(row, "allocation.bits", where, 0, 8)
        if len(row) != experts or not set(row) <= {0, *replica}:
            raise HexqError(f"{where}: allocation.bits rows must give one of {[0, *replica]} per expert ({experts})")
    hot = _field(manifest, "placement.hot", list, where)
    if len(hot) != len(moe) or any(_ints(h, "placement.hot", where, 0, experts - 1) is None for h in hot):
        raise HexqError(f"{where}: placement.hot must have one list of experts per MoE layer")
    quantized = _field(manifest, "dense.quantized_linears", dict, where)
    if not all(isinstance(b, int) and 1 <= b <= 8 for b in quantized.values()):
        raise HexqError(f"{where}: dense.quantized_linears must map weight names to widths in 1..8")
    _field(manifest, "dense.aliases", dict, where)
    for name, entry in _field(manifest, "files", dict, where).items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("bytes"), int)) or ".." in Path(name).parts or Path(name).is_absolute():
            raise HexqError(f"{where}: files entry {name!r} is malformed")
