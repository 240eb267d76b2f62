"""The packed artifact: one folder, written atomically, every file checksummed, read one layer at a time.

    NAME.hexq/
      manifest.json                 format + version, model summary, provenance, recipe, allocation, placement,
                                    byte accounting, and the SHA-256 and size of every other file (written last)
      config.json, tokenizer*.json  the source model's config and tokenizer, as they were
      dense/top.safetensors         embeddings, final norm, LM head (absent when tied to the embeddings)
      dense/layer_NNN.safetensors   one decoder layer's non-expert tensors under their model names (smoothing
                                    folded into the norms); quantized linears as "<name>.weight.codes/.scale/.zero"
                                    plus a static activation range "<name>.act_range"; a dense layer's MLP too
      stats.safetensors             per MoE layer: loss tables, router counts / score sums / calibration top-k
                                    traces, importance, placement
      experts/layer_NNN.safetensors one MoE layer's stored replicas: for expert e at b bits,
                                    "eEEEE.bB.gate_up.codes" (densely bit-packed, ceil(b*numel/8) bytes), ".scale"
                                    and ".zero" (float16, one per group), same for "down"; static expert activation
                                    ranges if any. Every expert keeps its allocated width plus the `bank` widths

Layer numbers in file names are the model's; the allocation, placement and statistics have one row per MoE layer
(`model.moe_layers` gives their model indices), so dense layers (e.g. DeepSeek's first layers) take no row.

Why per-layer shards: a file's SHA-256 is checked the first time it is opened, so reading one layer checks one
layer's shards, not the whole artifact; inside a shard safetensors reads only the requested tensors (mmap), and
`Artifact.read_expert` reads one replica with pread into a caller's buffer (a server keeps nothing mapped). Scales
and zeros are stored as float16: the weights computed by every consumer of the artifact are `dequantize_packed` of
these bytes, which is the model's definition from here on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hexq import __version__
from hexq.algos.quant import QuantMeta
from hexq.artifact.bitpack import OUT_DTYPES, DequantScratch, dequantize_into, pack_bits, packed_nbytes
from hexq.errors import HexqError
from hexq.io import read_sealed_json, save_tensors, write_sealed_json

FORMAT = "hexq-artifact"
FORMAT_VERSION = 2  # 2: per-layer dense shards, MoE-layer rows, only the allocated + bank widths stored
MANIFEST = "manifest.json"
TOP_SHARD = "dense/top.safetensors"
STATS_SHARD = "stats.safetensors"
SCALE_DTYPE = torch.float16
PROJECTIONS = ("gate_up", "down")


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


# ------------------------------------------------------------------------------------------ one replica


@dataclass(frozen=True)
class PackedWeight:
    """One quantized matrix as stored: packed codes [ceil(bits*numel/8)] uint8, scale and zero [out, groups]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.codes": self.codes, f"{prefix}.scale": self.scale, f"{prefix}.zero": self.zero}


def pack_weight(codes: torch.Tensor, meta: QuantMeta) -> PackedWeight:
    """Codes [out, in] (integers on meta's grid) and their meta as stored bytes."""
    return PackedWeight(pack_bits(codes, meta.bits), meta.scale.to(SCALE_DTYPE).contiguous(),
                        meta.zero.to(SCALE_DTYPE).contiguous(), meta.bits, tuple(codes.shape))


def dequantize_packed(weight: PackedWeight, dtype: torch.dtype = torch.float32,
                      scratch: DequantScratch | None = None) -> torch.Tensor:
    """The float matrix [out, in] a PackedWeight stands for, in `dtype`, on the device of its codes.

    bfloat16, float16 and float32 are produced directly (bitpack.dequantize_into); other dtypes are the float32
    result converted.
    """
    direct = dtype if dtype in OUT_DTYPES else torch.float32
    out = torch.empty(weight.shape, dtype=direct, device=weight.codes.device)
    return dequantize_packed_into(out, weight, scratch).to(dtype)


def dequantize_packed_into(out: torch.Tensor, weight: PackedWeight,
                           scratch: DequantScratch | None = None) -> torch.Tensor:
    """Write the matrix a PackedWeight stands for into `out` (preallocated [out, in], bfloat16, float16 or float32,
    on the codes' device) and return it; `scratch` is the reusable code buffer (see bitpack.DequantScratch)."""
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out has shape {list(out.shape)}, the packed weight is {list(weight.shape)}")
    rows, cols = weight.shape
    groups = weight.scale.shape[-1] if weight.scale.ndim == 2 else 0
    if not groups or cols % groups:
        raise ValueError(f"packed weight scale has shape {list(weight.scale.shape)}: expected [{rows}, groups] with "
                         f"groups dividing {cols}")
    return dequantize_into(out, weight.codes, weight.bits, weight.scale, weight.zero, cols // groups, scratch)


def packed_weight_nbytes(shape: tuple[int, int], bits: int, group_size: int) -> int:
    """Bytes of a PackedWeight: ceil(bits*numel/8) of codes plus a float16 scale and zero per group."""
    rows, cols = shape
    groups = rows * (cols // group_size)
    return packed_nbytes(rows * cols, bits) + 2 * groups * torch.finfo(SCALE_DTYPE).bits // 8


# ------------------------------------------------------------------------------------------ files and hashes


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in a safetensors file: [start, end) in absolute file offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_spans(path: Path) -> dict[str, TensorSpan]:
    """Every tensor of a safetensors file with its absolute byte range, read from the header alone (no mapping)."""
    from hexq.checkpoint import safetensors_dtype

    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise HexqError(f"{path} is not a safetensors file (header length {length}, file size {size})")
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise HexqError(f"{path}: unreadable safetensors header ({err})") from None
    spans, base = {}, 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = safetensors_dtype(entry["dtype"]), tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HexqError(f"{path}: tensor {name} has a malformed header entry") from None
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype is None or not 0 <= begin <= end <= size - base or end - begin != numel * dtype.itemsize:
            raise HexqError(f"{path}: tensor {name} has an inconsistent header entry {entry}")
        spans[name] = TensorSpan(dtype, shape, base + begin, base + end)
    return spans


def read_spans_into(fd: int, spans: list[TensorSpan], buffer: torch.Tensor) -> list[torch.Tensor]:
    """pread the tensors `spans` of an open file into `buffer` (1-D uint8 CPU tensor, pinned or not) and return
    views of them: no memory map, so nothing of the file stays in the process's memory but `buffer`. Spans adjacent
    in the file are read with one call; each tensor keeps its file offset modulo 8 in the buffer, so a tensor
    aligned to its element size in the file (safetensors' layout) stays aligned in the buffer."""

    order = sorted(range(len(spans)), key=lambda i: spans[i].start)
    runs: list[list[int]] = []
    for i in order:
        if runs and spans[runs[-1][-1]].end == spans[i].start:
            runs[-1].append(i)
        else:
            runs.append([i])
    view = buffer.numpy() if buffer.device.type == "cpu" else None
    if view is None or buffer.dtype != torch.uint8 or buffer.ndim != 1:
        raise ValueError("read_spans_into needs a 1-D uint8 CPU buffer")
    out: list[torch.Tensor | None] = [None] * len(spans)
    offset = 0
    for run in runs:
        first, last = spans[run[0]].start, spans[run[-1]].end
        offset += (first - offset) % 8
        if offset + last - first > buffer.numel():
            raise ValueError(f"read buffer of {buffer.numel()} bytes is too small for {last - first} more bytes")
        target, done = memoryview(view[offset:offset + last - first]), 0
        while done < last - first:
            got = os.preadv(fd, [target[done:]], first + done)
            if got <= 0:
                raise HexqError(f"short read at byte {first + done} of an artifact file (truncated while open?)")
            done += got
        for i in run:
            span = spans[i]
            begin = offset + span.start - first
            out[i] = buffer[begin:begin + span.end - span.start].view(span.dtype).view(span.shape)
        offset += last - first
    return out


def spans_buffer_nbytes(spans: list[TensorSpan]) -> int:
    """Bytes `read_spans_into` needs for these spans in the worst case (7 alignment bytes per read)."""
    return sum(s.end - s.start for s in spans) + 8 * len(spans)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactWriter:
    """Fills an artifact folder (the temporary folder hexq.outputs.output_folder gives, published only when
    complete): every file written atomically and recorded with its size and SHA-256; the manifest, written last by
    `finish`, lists them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, dict] = {}

    def _record(self, name: str) -> None:
        path = self.folder / name
        self.files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}

    def add_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_tensors(self.folder / name, tensors)
        self._record(name)

    def add_file(self, name: str, source: Path) -> None:
        shutil.copyfile(source, self.folder / name)
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


class Artifact:
    """Read access to a packed artifact. Each file's size and SHA-256 are checked against the manifest the first
    time the file is used (thread-safe); tensors are then read one at a time through safetensors' mmap."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_artifact_manifest(self.path)
        self.files: dict[str, dict] = self.manifest["files"]
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self._handles: dict[str, object] = {}
        self._keys: dict[str, set[str]] = {}
        self._fds: dict[str, int] = {}  # expert shards opened for pread (no mapping)
        self._spans: dict[str, dict[str, TensorSpan]] = {}
        self.bytes_read = 0  # bytes of expert replicas read through read_expert

    # --- integrity

    def verify(self, name: str) -> Path:
        """The path of file `name`, after checking its size and SHA-256 against the manifest (once)."""
        if name in self._verified:
            return self.path / name
        with self._lock:
            if name not in self._verified:
                self._check(name)
                self._verified.add(name)
        return self.path / name

    def _check(self, name: str) -> None:
        entry = self.files.get(name)
        if entry is None:
            raise HexqError(f"{self.path} has no file {name} in its manifest")
        file = self.path / name
        if not file.is_file():
            raise HexqError(f"artifact file {file} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise HexqError(f"artifact file {file} is truncated or altered: {size} bytes, manifest says "
                            f"{entry['bytes']}")
        actual = sha256_file(file)
        if actual != entry["sha256"]:
            raise HexqError(f"artifact file {file} is corrupt: sha256 {actual[:16]}..., manifest says "
                            f"{entry['sha256'][:16]}...")

    def verify_all(self) -> dict[str, bool]:
        """{file: ok} for every file, without stopping at the first bad one."""
        result = {}
        for name in self.files:
            try:
                self.verify(name)
                result[name] = True
            except HexqError:
                result[name] = False
        return result

    # --- tensors

    def _handle(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            path = self.verify(name)
            with self._lock:
                handle = self._handles.get(name)
                if handle is None:
                    handle = safe_open(str(path), framework="pt")
                    self._handles[name] = handle
        return handle

    def tensor(self, shard: str, key: str) -> torch.Tensor:
        return self._handle(shard).get_tensor(key)

    def keys(self, shard: str) -> set[str]:
        keys = self._keys.get(shard)
        if keys is None:
            keys = self._keys[shard] = set(self._handle(shard).keys())
        return keys

    def shard_tensors(self, shard: str) -> dict[str, torch.Tensor]:
        handle = self._handle(shard)
        return {key: handle.get_tensor(key) for key in sorted(handle.keys())}

    # --- model facts

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model (dense ones included)."""
        return self.manifest["model"]["num_layers"]

    @property
    def moe_layers(self) -> list[int]:
        """Model indices of the MoE layers, in order: row r of the allocation, placement and stats is layer
        moe_layers[r]."""
        return self.manifest["model"]["moe_layers"]

    @property
    def num_experts(self) -> int:
        return self.manifest["model"]["num_experts"]

    @property
    def replica_bits(self) -> list[int]:
        """Widths the calibration made (the loss table's columns)."""
        return self.manifest["experts"]["replica_bits"]

    @property
    def bank_bits(self) -> list[int]:
        """Widths stored for every expert besides its allocated one."""
        return self.manifest["experts"]["bank_bits"]

    @property
    def allocation(self) -> list[list[int]]:
        """[MoE layer row][expert] allocated widths (0: skipped)."""
        return self.manifest["allocation"]["bits"]

    def stored_bits(self, row: int, expert: int) -> list[int]:
        """Widths stored for one expert of MoE layer row `row`."""
        own = self.allocation[row][expert]
        return sorted({b for b in (own, *self.bank_bits) if b})

    def expert_shape(self, projection: str) -> tuple[int, int]:
        return tuple(self.manifest["experts"]["shapes"][projection])

    def packed_expert(self, row: int, expert: int, bits: int, projection: str) -> PackedWeight:
        """One stored replica matrix of MoE layer row `row`, read from its layer's shard only."""
        if bits not in self.stored_bits(row, expert):
            raise HexqError(f"{self.path} stores expert {expert} of layer {self.moe_layers[row]} at "
                            f"{self.stored_bits(row, expert)} bits, not {bits}; pack with --bank {bits} to keep it")
        shard, prefix = expert_shard(self.moe_layers[row]), replica_key(expert, bits, projection)
        return PackedWeight(self.tensor(shard, f"{prefix}.codes"), self.tensor(shard, f"{prefix}.scale"),
                            self.tensor(shard, f"{prefix}.zero"), bits, self.expert_shape(projection))

    def expert_spans(self, row: int, expert: int, bits: int) -> list[TensorSpan]:
        """Byte ranges of one stored replica in its layer's shard: codes, scale and zero of gate_up then down."""
        if bits not in self.stored_bits(row, expert):
            raise HexqError(f"{self.path} stores expert {expert} of layer {self.moe_layers[row]} at "
                            f"{self.stored_bits(row, expert)} bits, not {bits}; pack with --bank {bits} to keep it")
        shard = expert_shard(self.moe_layers[row])
        spans = self._spans.get(shard)
        if spans is None:
            spans = self._spans.setdefault(shard, safetensors_spans(self.verify(shard)))
        try:
            return [spans[f"{replica_key(expert, bits, p)}.{part}"] for p in PROJECTIONS
                    for part in ("codes", "scale", "zero")]
        except KeyError as err:
            raise HexqError(f"{self.path / shard} has no tensor {err.args[0]}") from None

    def read_expert(self, row: int, expert: int, bits: int, buffer: torch.Tensor) -> tuple[PackedWeight, ...]:
        """(gate_up, down) of one stored replica read with pread into `buffer` (1-D uint8 CPU tensor of at least
        spans_buffer_nbytes(expert_spans(...)) bytes; the PackedWeights are views of it, valid until it is reused).
        Nothing is memory-mapped: the process keeps only `buffer`, whatever the artifact's size."""
        spans = self.expert_spans(row, expert, bits)
        shard = expert_shard(self.moe_layers[row])
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(self.path / shard, os.O_RDONLY)
        tensors = read_spans_into(fd, spans, buffer)
        with self._lock:
            self.bytes_read += sum(span.end - span.start for span in spans)
        return tuple(PackedWeight(*tensors[3 * i:3 * i + 3], bits, self.expert_shape(p))
                     for i, p in enumerate(PROJECTIONS))

    def expert_weights(self, row: int, expert: int, bits: int,
                       dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert at `bits`, dequantized; bits 0 gives zeros (skipped)."""
        if bits == 0:
            return tuple(torch.zeros(self.expert_shape(p), dtype=dtype, device="cpu") for p in PROJECTIONS)
        return tuple(dequantize_packed(self.packed_expert(row, expert, bits, p), dtype) for p in PROJECTIONS)

    # --- dense weights (hexq.streaming.LayerSource)

    def _dense_file(self, name: str) -> str:
        layer = layer_of(name)
        return TOP_SHARD if layer is None else dense_shard(layer)

    def has_param(self, name: str) -> bool:
        name = self.manifest["dense"]["aliases"].get(name, name)
        shard = self._dense_file(name)
        return shard in self.files and (name in self.keys(shard) or f"{name}.codes" in self.keys(shard))

    def read_param(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A non-expert parameter by its model name: stored tensors as they are, quantized linears dequantized
        (float32), tied parameters through their alias."""
        name = self.manifest["dense"]["aliases"].get(name, name)
        shard = self._dense_file(name)
        bits = self.manifest["dense"]["quantized_linears"].get(name)
        if bits is not None:
            weight = PackedWeight(self.tensor(shard, f"{name}.codes"), self.tensor(shard, f"{name}.scale"),
                                  self.tensor(shard, f"{name}.zero"), bits, tuple(shape))
            return dequantize_packed(weight)
        if shard not in self.files or name not in self.keys(shard):
            raise HexqError(f"{self.path}: tensor {name} is not in {shard}")
        tensor = self.tensor(shard, name)
        if tuple(tensor.shape) != tuple(shape):
            raise HexqError(f"{self.path / shard}: tensor {name} has shape {list(tensor.shape)}, the model's config "
                            f"needs {list(shape)}")
        return tensor

    def read_param_copy(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """read_param into memory of its own, read with pread: nothing of the file is mapped, so a server that keeps
        the tensor holds it once (not its file pages as well) and never reads it from disk again."""
        alias = self.manifest["dense"]["aliases"].get(name, name)
        if alias in self.manifest["dense"]["quantized_linears"]:
            return self.read_param(name, shape)  # dequantized into a new tensor already
        return self._read_copy(self._dense_file(alias), alias, tuple(shape))

    def read_packed_copy(self, name: str, shape: tuple[int, int]) -> PackedWeight:
        """A quantized dense linear's weight as stored (codes, scale, zero), each read with pread into memory of its
        own (see read_param_copy): what a server computes from."""
        alias = self.manifest["dense"]["aliases"].get(name, name)
        bits = self.manifest["dense"]["quantized_linears"].get(alias)
        if bits is None:
            raise HexqError(f"{self.path}: {alias} is not a quantized linear")
        shard = self._dense_file(alias)
        return PackedWeight(*(self._read_copy(shard, f"{alias}.{part}") for part in ("codes", "scale", "zero")), bits,
                            tuple(shape))

    def packed_param_nbytes(self, name: str) -> int:
        """Bytes of a quantized dense linear's stored codes, scale and zero (from its shard's header)."""
        alias = self.manifest["dense"]["aliases"].get(name, name)
        spans = self._shard_spans(self._dense_file(alias))
        return sum(spans[f"{alias}.{part}"].end - spans[f"{alias}.{part}"].start for part in ("codes", "scale", "zero"))

    def _shard_spans(self, shard: str) -> dict[str, TensorSpan]:
        if shard not in self.files:
            raise HexqError(f"{self.path} has no file {shard} in its manifest")
        spans = self._spans.get(shard)
        if spans is None:
            spans = self._spans.setdefault(shard, safetensors_spans(self.verify(shard)))
        return spans

    def _read_copy(self, shard: str, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor of a shard read with pread into a new CPU tensor (its shape checked against `shape`)."""
        span = self._shard_spans(shard).get(key)
        if span is None:
            raise HexqError(f"{self.path}: tensor {key} is not in {shard}")
        if shape is not None and tuple(span.shape) != tuple(shape):
            raise HexqError(f"{self.path / shard}: tensor {key} has shape {list(span.shape)}, the model's config "
                            f"needs {list(shape)}")
        out = torch.empty(span.shape, dtype=span.dtype, device="cpu")
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        fd = os.open(self.path / shard, os.O_RDONLY)
        try:
            done = 0
            while done < span.end - span.start:
                got = os.preadv(fd, [target[done:]], span.start + done)
                if got <= 0:
                    raise HexqError(f"short read of {key} in {self.path / shard}")
                done += got
        finally:
            os.close(fd)
        return out

    def param_dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a non-expert parameter (a quantized linear dequantizes to float32)."""
        from hexq.checkpoint import safetensors_dtype

        name = self.manifest["dense"]["aliases"].get(name, name)
        if name in self.manifest["dense"]["quantized_linears"]:
            return torch.float32
        shard = self._dense_file(name)
        return safetensors_dtype(self._handle(shard).get_slice(name).get_dtype())

    def release(self) -> None:
        """Close the shards' memory maps (pages read so far stop counting in the process's memory)."""
        with self._lock:
            self._handles.clear()

    def close(self) -> None:
        """Close the memory maps and the files opened for read_expert."""
        self.release()
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def act_range(self, linear: str) -> torch.Tensor | None:
        """Static input range of a quantized linear (name without .weight), if the artifact stores one."""
        shard = self._dense_file(linear)
        key = f"{linear}.act_range"
        return self.tensor(shard, key) if key in self.keys(shard) else None
