"""Atomic file writes: write to a temporary file in the same folder, then rename over the target. Also a streaming
safetensors writer built the same way, sealed JSON, and hexq's one file hasher (file_sha256, file_record)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.errors import HexqError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename; the file gets the usual 0666 & ~umask mode
    (mkstemp's 0600 would hide artifacts and reports from other users)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


# safetensors dtype names (the format's spelling, as safetensors.torch reads them back).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one declared tensor lives in the file: byte range [begin, end) of the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[TensorEntry]:
    """Byte ranges for the declared tensors, packed with no gaps (safetensors rejects holes).

    The data section is ordered by element size, largest first (stable within a size, so the declared order
    otherwise), as safetensors' own serializer does: every tensor then starts at a multiple of its element size,
    since the data section itself starts 8-byte aligned."""
    entries = []
    for name, spec in specs.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise HexqError(f"safetensors tensor name {name!r} must be a non-empty string other than __metadata__")
        try:
            dtype, shape = spec
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise HexqError(f"tensor {name!r}: spec {spec!r} must be (torch.dtype, shape tuple)") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise HexqError(f"tensor {name!r}: dtype {dtype} has no safetensors name; "
                            f"use one of {', '.join(str(d) for d in SAFETENSORS_DTYPES)}")
        if any(d < 0 for d in shape):
            raise HexqError(f"tensor {name!r}: shape {shape} has a negative dimension")
        entries.append((name, dtype, shape))
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)  # sorted() is stable
    layout, offset = [], 0
    for i in order:
        name, dtype, shape = entries[i]
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append(TensorEntry(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    return layout


def safetensors_header(layout: list[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte little-endian header length and the JSON header, space-padded so the data starts 8-aligned."""
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise HexqError(f"safetensors metadata must map strings to strings; key {bad[0]!r} does not")
        header["__metadata__"] = dict(metadata)
    for entry in layout:
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [entry.begin, entry.end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, holding none of them.

        with SafetensorsWriter(path, {"a": (torch.bfloat16, (4, 8)), "b": (torch.float32, ())}) as w:
            w.write("b", torch.tensor(1.0))
            w.write("a", a)

    Every tensor's name, dtype and shape is declared up front, so the header (with all offsets) is written
    first. Tensors may then be written in any order, each exactly once; each goes straight to its place in
    the file. The file is built under a temporary name in the same folder and renamed to `path` (after fsync)
    only when the block ends cleanly with every tensor written. An exception inside the block, an undeclared,
    repeated, misshaped or mistyped tensor, or a declared tensor never written removes the temporary file;
    the last three raise HexqError naming the tensor. Nothing ever appears under `path` unless complete.

    Several processes can fill one file: the owner creates it; another process opens the same temporary file with
    `attach=owner.temporary` (same specs and metadata) and writes its rows; `close` there only flushes. The owner
    counts those rows as written with `accept_rows` and publishes the file with `close`.
    """

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, attach: str | Path | None = None):
        if sys.byteorder != "little":  # safetensors data is little-endian; raw tensor bytes are native order
            raise HexqError("SafetensorsWriter needs a little-endian machine")
        self.path = Path(path)
        self._entries = {entry.name: entry for entry in safetensors_layout(specs)}
        header = safetensors_header(list(self._entries.values()), metadata)
        self._data_start = len(header)
        self._written: set[str] = set()
        self._rows: dict[str, torch.Tensor] = {}  # tensors being written row by row: which rows are done
        self._attached = attach is not None
        if self._attached:
            self._tmp = str(attach)
            self._handle = open(self._tmp, "r+b")  # noqa: SIM115 - closed by close/abort
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self._handle = os.fdopen(fd, "wb")
        try:
            self._handle.write(header)
            # Size the file now: tensors written out of order leave no short file, and an empty tensor at the
            # end needs no bytes at all.
            self._handle.truncate(self._data_start + max((e.end for e in self._entries.values()), default=0))
        except BaseException:
            self.abort()
            raise

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    @property
    def temporary(self) -> str:
        """The file being written (what another process attaches to)."""
        return self._tmp

    def accept_rows(self, name: str, start: int, count: int) -> None:
        """Count rows [start, start + count) of `name` as written (by an attached process)."""
        entry = self._entries[name]
        filled = self._rows.setdefault(name, torch.zeros(entry.shape[0], dtype=torch.bool, device="cpu"))
        filled[start:start + count] = True
        if bool(filled.all()):
            self._written.add(name)

    @property
    def pending(self) -> list[str]:
        """Declared tensors not written yet (or only partly, row by row), in declaration order."""
        return [name for name in self._entries if name not in self._written]

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write rows [start, start + len(rows)) of a declared tensor (first dimension): a tensor too large to hold
        is filled piece by piece, and counts as written once every row is (each row exactly once)."""
        entry = self._entries.get(name)
        if entry is None or not entry.shape:
            self.abort()
            raise HexqError(f"tensor {name!r} was not declared with rows for {self.path}")
        filled = self._rows.setdefault(name, torch.zeros(entry.shape[0], dtype=torch.bool, device="cpu"))
        count = rows.shape[0] if rows.ndim else 0
        if rows.dtype != entry.dtype or tuple(rows.shape[1:]) != entry.shape[1:] or start < 0 \
                or start + count > entry.shape[0] or bool(filled[start:start + count].any()):
            self.abort()
            raise HexqError(f"tensor {name!r}: rows {start}..{start + count} of shape {tuple(rows.shape)} "
                            f"{rows.dtype} do not fit the declared {entry.shape} {entry.dtype} (or were written "
                            f"before) in {self.path}")
        row_bytes = entry.dtype.itemsize * math.prod(entry.shape[1:])
        try:
            self._handle.seek(self._data_start + entry.begin + start * row_bytes)
            if count:
                self._handle.write(rows.detach().to("cpu").contiguous().view(torch.uint8).numpy())
        except BaseException:
            self.abort()
            raise
        filled[start:start + count] = True
        if bool(filled.all()):
            self._written.add(name)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one declared tensor (any device; copied to CPU in pieces only as the file needs)."""
        if self._handle is None:
            raise HexqError(f"cannot write tensor {name!r}: {self.path} is already closed")
        try:
            entry = self._entries.get(name)
            if entry is None:
                raise HexqError(f"tensor {name!r} was not declared for {self.path}")
            if name in self._written:
                raise HexqError(f"tensor {name!r} written twice to {self.path}")
            if tensor.dtype != entry.dtype:
                raise HexqError(f"tensor {name!r}: dtype {tensor.dtype} but {entry.dtype} was declared "
                                f"for {self.path}")
            if tuple(tensor.shape) != entry.shape:
                raise HexqError(f"tensor {name!r}: shape {tuple(tensor.shape)} but {entry.shape} was declared "
                                f"for {self.path}")
            self._handle.seek(self._data_start + entry.begin)
            flat = tensor.detach().reshape(-1)
            # Bounded pieces keep a device-to-CPU copy small.
            step = max(1, (64 << 20) // max(1, entry.dtype.itemsize))
            for start in range(0, flat.numel(), step):
                piece = flat[start:start + step].to("cpu").contiguous()
                self._handle.write(piece.view(torch.uint8).numpy())
            self._written.add(name)
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        """Check every declared tensor was written, then fsync and rename into place."""
        if self._handle is None:
            return
        if self._attached:  # the owner checks and publishes
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
            return
        missing = self.pending
        if missing:
            self.abort()
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise HexqError(f"tensor {missing[0]!r}{more} declared but never written; {self.path} not created")
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
            os.chmod(self._tmp, 0o666 & ~_umask())
            os.replace(self._tmp, self.path)
            _fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the temporary file; `path` is left as it was."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if not self._attached:
            Path(self._tmp).unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable: fsync the folder that holds the new name (POSIX; skipped where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def cache_dir() -> Path:
    """hexq's own cache folder: $HEXQ_CACHE_DIR, else $XDG_CACHE_HOME/hexq, else ~/.cache/hexq."""
    env = os.environ.get("HEXQ_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hexq"


def file_sha256(path: str | Path, *, cached: bool = False) -> str:
    """SHA-256 of a file: hexq's one hasher (artifact and calibration integrity checks, model fingerprints).

    cached: remember it in hexq's cache by (real path, size, mtime, inode), so that a 60 GB checkpoint is hashed once,
    not by every command that checks it is unchanged; an edit that changes neither size, mtime nor inode then goes
    unseen, so integrity checks of hexq's own files never use the cache."""
    path = Path(path).resolve()
    if not cached:
        return _sha256(path)
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    index = cache_dir() / "sha256.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    value = _sha256(path)
    try:
        known = {k: v for k, v in known.items() if not k.startswith(f"{path}|")}
        known[key] = value
        write_json_atomic(index, known)
    except OSError:  # a read-only home still gets the right answer, only not remembered
        pass
    return value


def _sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: str | Path) -> dict:
    """{sha256, bytes} of a file, as artifact and calibration manifests record every file they hold."""
    return {"sha256": file_sha256(path), "bytes": Path(path).stat().st_size}


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `tensors` (names sorted, so the same tensors give the same bytes), written atomically
    straight from the tensors: no second copy of the file in memory, which matters for 2 GB layer files."""
    ordered = {name: tensors[name].detach() for name in sorted(tensors)}
    specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in ordered.items()}
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name, tensor in ordered.items():
            writer.write(name, tensor.cpu())


def seal_path(path: Path) -> Path:
    """Where the seal of a JSON file lives: manifest.json -> manifest.sha256."""
    return Path(path).with_suffix(".sha256")


def write_sealed_json(path: str | Path, obj) -> None:
    """Write `obj` as JSON and, beside it, its SHA-256 in sha256sum's format (`sha256sum -c` checks it), so that any
    later edit of the file is detected and named by `read_sealed_json`. The seal is written second: a run killed in
    between leaves a file that fails its check rather than one that passes it."""
    path = Path(path)
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    write_bytes_atomic(path, data)
    write_bytes_atomic(seal_path(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())


def read_sealed_json(path: str | Path):
    """The JSON object in `path`, after checking it against its seal (write_sealed_json); a missing, unreadable or
    different seal, or invalid JSON, is a one-line HexqError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise HexqError(f"{path} is missing") from None
    except OSError as err:
        raise HexqError(f"{path} is unreadable: {err}") from None
    seal = seal_path(path)
    try:
        recorded = seal.read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        raise HexqError(f"{seal} is missing or unreadable: {path.name} cannot be checked") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        raise HexqError(f"{path} was changed after hexq wrote it: sha256 {actual[:16]}..., {seal.name} says "
                        f"{recorded[:16]}...")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HexqError(f"{path} is not valid JSON: {err}") from None
