"""The packed artifact: one folder, written atomically, every file checksummed, experts readable one at a time.

    NAME.hexq/
      manifest.json                 format + version, model summary, provenance, recipe, allocation, placement,
                                    byte accounting, and the SHA-256 and size of every other file (written last)
      config.json, tokenizer*.json  the source model's config and tokenizer, as they were
      dense.safetensors             every non-expert tensor (smoothing folded into the norms); quantized linears
                                    as 8-bit-or-less codes + scales + zeros, static activation ranges
      stats.safetensors             loss tables, router counts / score sums / calibration top-k traces, importance
      experts/layer_NNN.safetensors one layer's replica banks: for expert e at b bits, "eEEEE.bB.gate_up.codes"
                                    (densely bit-packed, ceil(b*numel/8) bytes), ".scale" and ".zero" (float16,
                                    one per group), same for "down"; static expert activation ranges if any

Why per-layer expert shards: a file's SHA-256 is checked the first time it is opened, so reading one expert
checks one layer's shard, not the whole artifact; inside a shard safetensors reads only the requested tensors
(mmap). Scales and zeros are stored as float16: the weights computed by every consumer of the artifact are
`dequantize_packed` of these bytes, which is the model's definition from here on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from hexq import __version__
from hexq.algos.quant import QuantMeta
from hexq.artifact.bitpack import OUT_DTYPES, DequantScratch, dequantize_into, pack_bits, packed_nbytes
from hexq.errors import HexqError
from hexq.io import write_bytes_atomic, write_json_atomic

FORMAT = "hexq-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE_SHARD = "dense.safetensors"
STATS_SHARD = "stats.safetensors"
SCALE_DTYPE = torch.float16
PROJECTIONS = ("gate_up", "down")


def expert_shard(layer: int) -> str:
    return f"experts/layer_{layer:03d}.safetensors"


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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes with a fixed key order, so the same tensors always give the same file."""
    return save({name: t.detach().cpu().contiguous() for name, t in sorted(tensors.items())})


class ArtifactWriter:
    """Builds an artifact in a hidden temporary folder beside `out` and renames it into place on `finish`.

    Nothing appears under `out` until the manifest is written; an exception (or Ctrl-C) inside the `with`
    block removes the temporary folder, so a failed pack never leaves a partial artifact under the final name.
    """

    def __init__(self, out: Path, overwrite: bool = False) -> None:
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise HexqError(f"{self.out} exists; pass --force to replace it")
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        self.files: dict[str, dict] = {}

    def __enter__(self) -> ArtifactWriter:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _record(self, name: str) -> None:
        path = self.tmp / name
        self.files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}

    def add_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        write_bytes_atomic(self.tmp / name, tensors_bytes(tensors))
        self._record(name)

    def add_file(self, name: str, source: Path) -> None:
        shutil.copyfile(source, self.tmp / name)
        self._record(name)

    def finish(self, manifest: dict) -> None:
        write_json_atomic(self.tmp / MANIFEST, {"format": FORMAT, "format_version": FORMAT_VERSION,
                                                "hexq_version": __version__, **manifest,
                                                "files": dict(sorted(self.files.items()))})
        if self.out.exists():  # --force: move the old artifact aside first, so one of the two is always whole
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.replace(self.out, old)
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)


# ------------------------------------------------------------------------------------------ reading


def read_artifact_manifest(path: Path) -> dict:
    """The manifest of the artifact at `path`, with its format and version checked."""
    manifest_path = Path(path) / MANIFEST
    if not Path(path).is_dir():
        raise HexqError(f"{path} is not a hexq artifact folder (made by hexq pack)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise HexqError(f"{path} has no {MANIFEST}: not a hexq artifact, or hexq pack did not finish") from None
    except (OSError, json.JSONDecodeError) as err:
        raise HexqError(f"{manifest_path} is unreadable: {err}") from None
    if manifest.get("format") != FORMAT:
        raise HexqError(f"{manifest_path} is not a hexq artifact manifest (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise HexqError(f"{path} has artifact format version {version}, newer than this hexq reads "
                        f"({FORMAT_VERSION}); upgrade hexq (it is {__version__})")
    return manifest


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

    def keys(self, shard: str) -> list[str]:
        return list(self._handle(shard).keys())

    def shard_tensors(self, shard: str) -> dict[str, torch.Tensor]:
        handle = self._handle(shard)
        return {key: handle.get_tensor(key) for key in handle.keys()}

    # --- model facts

    @property
    def num_layers(self) -> int:
        return self.manifest["model"]["num_layers"]

    @property
    def num_experts(self) -> int:
        return self.manifest["model"]["num_experts"]

    @property
    def replica_bits(self) -> list[int]:
        return self.manifest["experts"]["replica_bits"]

    @property
    def allocation(self) -> list[list[int]]:
        return self.manifest["allocation"]["bits"]

    def expert_shape(self, projection: str) -> tuple[int, int]:
        return tuple(self.manifest["experts"]["shapes"][projection])

    def packed_expert(self, layer: int, expert: int, bits: int, projection: str) -> PackedWeight:
        """One stored replica matrix, read from its layer's shard only."""
        if bits not in self.replica_bits:
            raise HexqError(f"{self.path} has expert replicas at {self.replica_bits} bits, not {bits}")
        shard, prefix = expert_shard(layer), replica_key(expert, bits, projection)
        return PackedWeight(self.tensor(shard, f"{prefix}.codes"), self.tensor(shard, f"{prefix}.scale"),
                            self.tensor(shard, f"{prefix}.zero"), bits, self.expert_shape(projection))

    def expert_weights(self, layer: int, expert: int, bits: int,
                       dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert at `bits`, dequantized; bits 0 gives zeros (skipped)."""
        if bits == 0:
            # on the CPU, like every tensor read from the shards
            return tuple(torch.zeros(self.expert_shape(p), dtype=dtype, device="cpu") for p in PROJECTIONS)
        return tuple(dequantize_packed(self.packed_expert(layer, expert, bits, p), dtype) for p in PROJECTIONS)
