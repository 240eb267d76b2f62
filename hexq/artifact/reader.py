"""Reading a packed artifact (hexq.artifact.format): every file's size and SHA-256 checked on first use, tensors read
one layer at a time, one expert replica read with pread into a caller's buffer (nothing mapped)."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from hexq.artifact.format import TOP_SHARD, dense_shard, expert_shard, layer_of, read_artifact_manifest, replica_key
from hexq.artifact.spans import TensorSpan, read_spans_into, safetensors_spans
from hexq.base.errors import HexqError
from hexq.base.io import file_sha256
from hexq.config.recipe import Recipe, recipe_from_dict
from hexq.model.checkpoint import safetensors_dtype
from hexq.packed.weight import PROJECTIONS, PackedWeight, dequantize_packed

# ------------------------------------------------------------------------------------------ the reader


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
        actual = file_sha256(file)
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
    def model_type(self) -> str:
        """The checkpoint's config model_type (hexq.model.adapters.adapter_for's key)."""
        return self.manifest["model"]["model_type"]

    @property
    def top_k(self) -> int:
        return self.manifest["model"]["top_k"]

    @property
    def hexq_version(self) -> str:
        """The hexq that packed the artifact."""
        return self.manifest.get("hexq_version", "")

    @property
    def provenance(self) -> dict:
        """Where the artifact came from: model_path, model_sha256, data_sha256, calibration_recipe_sha256,
        calibration_data, calibrated_with."""
        return self.manifest["provenance"]

    # --- the dense part

    @property
    def quantized_linears(self) -> dict[str, int]:
        """Dense weight names stored as packed codes -> their width (the rest is stored as the checkpoint has it)."""
        return self.manifest["dense"]["quantized_linears"]

    @property
    def aliases(self) -> dict[str, str]:
        """Dense weight names stored under another name (a tied head -> the embeddings)."""
        return self.manifest["dense"]["aliases"]

    # --- the experts

    @property
    def replica_bits(self) -> list[int]:
        """Widths the calibration made (the loss table's columns)."""
        return self.manifest["experts"]["replica_bits"]

    @property
    def bank_bits(self) -> list[int]:
        """Widths stored for every expert besides its allocated one."""
        return self.manifest["experts"]["bank_bits"]

    @property
    def group_size(self) -> int | None:
        """Codes per scale and zero in a routed expert's rows (None: one group per row)."""
        return self.manifest["experts"].get("group_size")

    @property
    def symmetric(self) -> bool:
        """Whether the experts' grids are symmetric."""
        return self.manifest["experts"]["symmetric"]

    @property
    def allocation(self) -> list[list[int]]:
        """[MoE layer row][expert] allocated widths (0: skipped)."""
        return self.manifest["allocation"]["bits"]

    @property
    def average_bits(self) -> float:
        """The allocation's mean width over every routed expert."""
        return self.manifest["allocation"]["average_bits"]

    @property
    def placement(self) -> dict:
        """hexq pack's hot-expert placement: scheme, hot_per_layer, hot ([MoE layer row] -> hot expert ids)."""
        return self.manifest["placement"]

    @property
    def export_section(self) -> dict:
        """The compressed-tensors export's kept replicas (bits, group_size, symmetric, own_grid, replicas); {} when
        hexq pack kept none."""
        return self.manifest.get("export") or {}

    @property
    def gguf_replicas(self) -> dict[str, dict]:
        """Per MoE layer row (as a string), the K-quant replicas hexq pack kept for a GGUF export; {} when none."""
        return (self.manifest.get("gguf") or {}).get("replicas", {})

    def stored_bits(self, row: int, expert: int) -> list[int]:
        """Widths stored for one expert of MoE layer row `row`."""
        own = self.allocation[row][expert]
        return sorted({b for b in (own, *self.bank_bits) if b})

    def expert_shape(self, projection: str) -> tuple[int, int]:
        return tuple(self.manifest["experts"]["shapes"][projection])

    @property
    def expert_shapes(self) -> list[tuple[int, int]]:
        """A routed expert's stored matrices' shapes, in PROJECTIONS order (gate_up, down)."""
        return [self.expert_shape(p) for p in PROJECTIONS]

    @functools.cached_property
    def recipe(self) -> Recipe:
        """The recipe the artifact was calibrated and packed with (its manifest's, every check applied)."""
        return recipe_from_dict(self.manifest["recipe"])

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

    def expert_fd(self, row: int) -> int:
        """The read-only file descriptor of MoE row `row`'s expert shard (opened once, kept open while the artifact
        is), which expert_spans' offsets index."""
        shard = expert_shard(self.moe_layers[row])
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(self.verify(shard), os.O_RDONLY)
        return fd

    def read_expert(self, row: int, expert: int, bits: int, buffer: torch.Tensor) -> tuple[PackedWeight, ...]:
        """(gate_up, down) of one stored replica read with pread into `buffer` (1-D uint8 CPU tensor of at least
        read_buffer_nbytes(the replica's bytes, 6) bytes; the PackedWeights are views of it, valid until it is
        reused). Nothing is memory-mapped: the process keeps only `buffer`, whatever the artifact's size."""
        spans = self.expert_spans(row, expert, bits)
        tensors = read_spans_into(self.expert_fd(row), spans, buffer)
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

    # --- dense weights (hexq.model.streaming.LayerSource)

    def _dense_file(self, name: str) -> str:
        layer = layer_of(name)
        return TOP_SHARD if layer is None else dense_shard(layer)

    def has_param(self, name: str) -> bool:
        name = self.aliases.get(name, name)
        shard = self._dense_file(name)
        return shard in self.files and (name in self.keys(shard) or f"{name}.codes" in self.keys(shard))

    def packed_param(self, name: str, shape: tuple[int, ...]) -> PackedWeight:
        """A quantized dense linear (or head) as stored, its tensors read where they lie in the shard."""
        name = self.aliases.get(name, name)
        bits = self.quantized_linears.get(name)
        if bits is None:
            raise HexqError(f"{self.path}: {name} is not a quantized linear")
        shard = self._dense_file(name)
        return PackedWeight(self.tensor(shard, f"{name}.codes"), self.tensor(shard, f"{name}.scale"),
                            self.tensor(shard, f"{name}.zero"), bits, tuple(shape))

    def read_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A non-expert parameter by its model name: stored tensors as they are, quantized linears dequantized
        (into `dtype`, directly: no float32 copy of a bfloat16 result), tied parameters through their alias."""
        name = self.aliases.get(name, name)
        shard = self._dense_file(name)
        if name in self.quantized_linears:
            return dequantize_packed(self.packed_param(name, shape), dtype)
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
        alias = self.aliases.get(name, name)
        if alias in self.quantized_linears:
            return self.read_param(name, shape)  # dequantized into a new tensor already
        return self._read_copy(self._dense_file(alias), alias, tuple(shape))

    def read_packed_copy(self, name: str, shape: tuple[int, int]) -> PackedWeight:
        """A quantized dense linear's weight as stored (codes, scale, zero), each read with pread into memory of its
        own (see read_param_copy): what a server computes from."""
        alias = self.aliases.get(name, name)
        bits = self.quantized_linears.get(alias)
        if bits is None:
            raise HexqError(f"{self.path}: {alias} is not a quantized linear")
        shard = self._dense_file(alias)
        return PackedWeight(*(self._read_copy(shard, f"{alias}.{part}") for part in ("codes", "scale", "zero")), bits,
                            tuple(shape))

    def packed_param_nbytes(self, name: str) -> int:
        """Bytes of a quantized dense linear's stored codes, scale and zero (from its shard's header)."""
        alias = self.aliases.get(name, name)
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
        name = self.aliases.get(name, name)
        if name in self.quantized_linears:
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
