"""A tensor's bytes in a safetensors file by absolute byte range, read from the header alone, and pread straight into a
caller's buffer: how the runtime reads one expert replica with nothing of the artifact mapped."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.errors import HexqError
from hexq.model.checkpoint import safetensors_dtype


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in a safetensors file: [start, end) in absolute file offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_spans(path: Path) -> dict[str, TensorSpan]:
    """Every tensor of a safetensors file with its absolute byte range, read from the header alone (no mapping)."""
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


def read_buffer_nbytes(nbytes: int, tensors: int) -> int:
    """Bytes `read_spans_into` needs for `tensors` tensors of `nbytes` in all, in the worst case: each read keeps its
    file offset modulo 8, so up to 7 bytes of padding before each."""
    return nbytes + 8 * tensors
