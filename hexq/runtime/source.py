"""The slow tier (the artifact) and the memory of the fast tier: expert slots, allocated once and reused.

What a slot holds (`--cache`):
  packed  (default) the stored replica as it is on disk: gate_up and down codes, float16 scale and zero, read with
          pread straight into the slot. Nothing is expanded: the runtime computes from the codes
          (hexq.runtime.compute). A slot's size is its width's packed size, so a 3-bit expert takes ~0.25x the bytes
          of its bf16 copy and the same memory holds ~4x as many experts.
  bf16, fp32  the replica dequantized into compute-ready matrices (the pread goes to a per-thread read buffer and
          the dequantization writes the slot; hexq.packed.cpu's kernel, or the torch path).

Slots are pooled by size (one pool per width in packed mode, one size in the expanded modes): a slot given back by
the cache (`recycle`) is reused by the next load of that size, so serving allocates nothing and faults no page in
after the warm-up. The pools are sized against the cache's own count, the memory plan's `FastTier`: the slots in
use are the bytes it holds (each fill reserves its slot's bytes before the load asks for the slot, and the cache
hands a slot back before it releases its bytes), so a new slot is allocated only once the free slots of other sizes
are released down to what the count leaves (`used + free <= capacity`). Slot sizes and the loaders' scratch are known
before anything is allocated (`SlotSizes`), for the memory plan.

On CUDA the slots live in device memory: the pread goes to a pinned host buffer, then one copy to the slot (packed)
or to a device read buffer that is dequantized into the slot (expanded).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from hexq.artifact.reader import Artifact
from hexq.artifact.spans import read_buffer_nbytes
from hexq.packed.bitpack import DequantScratch
from hexq.packed.weight import PackedWeight, dequantize_packed_into, packed_weight_nbytes
from hexq.runtime.cache import ExpertWeights
from hexq.runtime.residency import FastTier

LOADERS = 2  # threads that load experts: the forward pass and the prefetch worker
CACHE_FORMATS = ("packed", "bf16", "fp32")
EXPANDED = {"bf16": torch.bfloat16, "fp32": torch.float32}
ALIGN = 64


def _replica_nbytes(artifact: Artifact, bits: int) -> int:
    """Bytes of one stored replica at `bits` (both matrices: codes, scale, zero) plus the alignment pread may add."""
    group = artifact.group_size
    shapes = artifact.expert_shapes
    tensors = [packed_weight_nbytes(s, bits, group or s[1]) for s in shapes]
    return read_buffer_nbytes(sum(tensors), 3 * len(tensors))  # codes, scale and zero of each matrix


@dataclass(frozen=True)
class SlotSizes:
    """What the fast tier's slots take for one artifact, cache format and device, known before anything is allocated
    (the memory plan needs it). slot_bytes: width -> bytes of one expert's slot; read_nbytes: one stored replica as
    read (the pread buffer); scratch_nbytes: the load scratch the runtime reserves (`of`)."""

    cache_format: str
    device: torch.device
    slot_bytes: dict[int, int]
    read_nbytes: int
    scratch_nbytes: int
    shapes: tuple[tuple[int, int], ...]

    @property
    def largest_slot(self) -> int:
        return max(self.slot_bytes.values(), default=0)

    @property
    def numels(self) -> list[int]:
        return [rows * cols for rows, cols in self.shapes]

    @classmethod
    def of(cls, artifact: Artifact, cache_format: str = "packed", device: torch.device | None = None,
           kernels: bool = False) -> SlotSizes:
        """Sizes for `cache_format` on `device`; kernels: the CPU kernels dequantize (no torch code buffer needed).
        The load scratch: per loading thread a pread buffer (expanded modes; twice on CUDA for its device copy) and
        the torch path's code buffer without the kernels, plus the forward pass's transient slot."""
        device = device or torch.device("cpu")
        shapes = tuple(tuple(shape) for shape in artifact.expert_shapes)
        numels = [rows * cols for rows, cols in shapes]
        widths = sorted({b for row in artifact.allocation for b in row if b} | set(artifact.bank_bits))
        replica_bytes = {b: _replica_nbytes(artifact, b) for b in widths}
        read_nbytes = max(replica_bytes.values(), default=0)
        packed = cache_format == "packed"
        if packed:
            slot_bytes = {b: -(-n // ALIGN) * ALIGN for b, n in replica_bytes.items()}
        else:
            slot_bytes = dict.fromkeys(widths, sum(numels) * EXPANDED[cache_format].itemsize)
        per_thread = 0
        if not packed:
            per_thread = read_nbytes * (2 if device.type == "cuda" else 1)
            if not (kernels and device.type == "cpu"):
                per_thread += DequantScratch.nbytes_for(max(numels))
        elif device.type == "cuda":
            per_thread = read_nbytes  # the pinned host buffer of the copy
        scratch = LOADERS * per_thread + max(slot_bytes.values(), default=0)
        return cls(cache_format, device, slot_bytes, read_nbytes, scratch, shapes)


@dataclass
class _ThreadScratch:
    """One loading thread's buffers: the pread buffer (expanded modes; pinned on CUDA), its device copy (CUDA), the
    torch path's code buffer, and the transient slot of bypass loads (allocated at the thread's first bypass)."""

    read: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    codes: DequantScratch | None = None
    transient: torch.Tensor | None = None


class ArtifactSource:
    """The cache's ExpertSource: `load` fills a slot, `recycle` takes it back, `load_transient` fills the calling
    thread's bypass slot (valid until that thread's next bypass load). Layers are MoE rows. `fast_tier` is the
    cache's count (the same object), which the slot pools stay within."""

    def __init__(self, artifact: Artifact, sizes: SlotSizes, fast_tier: FastTier, kernels=None) -> None:
        self.artifact, self.sizes, self.fast_tier = artifact, sizes, fast_tier
        self.format, self.device = sizes.cache_format, sizes.device
        self.kernels = kernels if self.device.type == "cpu" else None
        self.packed = self.format == "packed"
        self._pools: dict[int, list[torch.Tensor]] = {}  # slot size -> free slots
        self._lock = threading.Lock()
        self._local = threading.local()
        self.load_seconds: dict[int, list[float]] = {}  # width -> [total seconds, loads]

    def nbytes(self, layer: int, expert: int, bits: int) -> int:
        return self.sizes.slot_bytes[bits]

    # --- slots

    def _new_slot(self, size: int) -> torch.Tensor:
        """`size` bytes: raw bytes for packed replicas, the expanded dtype otherwise."""
        dtype = torch.uint8 if self.packed else EXPANDED[self.format]
        return torch.empty(size // dtype.itemsize, dtype=dtype, device=self.device)

    def _take(self, size: int) -> torch.Tensor:
        with self._lock:
            free = self._pools.get(size)
            if free:
                return free.pop()
            # The count holds every slot in use and this one (reserved before the load): release free slots of
            # other sizes until what is allocated, in use and free, stays within the capacity.
            free_bytes = sum(other * len(slots) for other, slots in self._pools.items())
            for other, slots in self._pools.items():
                while slots and self.fast_tier.used + free_bytes > self.fast_tier.capacity:
                    slots.pop()
                    free_bytes -= other
        return self._new_slot(size)

    def recycle(self, weights: ExpertWeights) -> None:
        """Take a slot back (the cache calls this once the version in it is unpublished and unpinned)."""
        if weights.slot is not None and not weights.transient:
            with self._lock:
                self._pools.setdefault(self.sizes.slot_bytes[weights.bits], []).append(weights.slot)

    def _scratch(self) -> _ThreadScratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _ThreadScratch()
            cuda = self.device.type == "cuda"
            if not self.packed or cuda:
                scratch.read = torch.empty(self.sizes.read_nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
            if not self.packed and cuda:
                scratch.staging = torch.empty(self.sizes.read_nbytes, dtype=torch.uint8, device=self.device)
            if not self.packed and self.kernels is None:
                scratch.codes = DequantScratch(max(self.sizes.numels), self.device)
        return scratch

    # --- loads

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        slot = self._take(self.sizes.slot_bytes[bits])
        try:
            return self._load_into(slot, layer, expert, bits, transient=False)
        except BaseException:
            with self._lock:
                self._pools.setdefault(self.sizes.slot_bytes[bits], []).append(slot)
            raise

    def load_transient(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        """Load into the calling thread's bypass slot (valid until this thread's next transient load)."""
        scratch = self._scratch()
        if scratch.transient is None:
            scratch.transient = self._new_slot(self.sizes.largest_slot)
        return self._load_into(scratch.transient, layer, expert, bits, transient=True)

    def _load_into(self, slot: torch.Tensor, layer: int, expert: int, bits: int, transient: bool) -> ExpertWeights:
        started = time.perf_counter()
        if self.packed:
            weights = self._read_packed(slot, layer, expert, bits)
        else:
            weights = self._read_expanded(slot, layer, expert, bits)
        elapsed = time.perf_counter() - started
        with self._lock:
            total = self.load_seconds.setdefault(bits, [0.0, 0])
            total[0] += elapsed
            total[1] += 1
        return ExpertWeights(bits, *weights, slot=slot, transient=transient)

    def _read_packed(self, slot: torch.Tensor, layer: int, expert: int, bits: int) -> tuple[PackedWeight, ...]:
        if self.device.type == "cpu":
            return self.artifact.read_expert(layer, expert, bits, slot)
        host = self._scratch().read
        packed = self.artifact.read_expert(layer, expert, bits, host)
        moved = tuple(_to_device(weight, slot) for weight in packed)
        torch.cuda.current_stream(self.device).synchronize()  # the host buffer is reused by this thread's next load
        return moved

    def _read_expanded(self, slot: torch.Tensor, layer: int, expert: int, bits: int) -> tuple[torch.Tensor, ...]:
        scratch = self._scratch()
        packed = self.artifact.read_expert(layer, expert, bits, scratch.read)
        if scratch.staging is not None:
            packed = tuple(_to_device(weight, scratch.staging) for weight in packed)
        parts = zip(slot.split(self.sizes.numels), self.sizes.shapes, strict=True)
        gate_up, down = (part.view(shape) for part, shape in parts)
        for out, weight in zip((gate_up, down), packed, strict=True):
            if self.kernels is None or not self.kernels.dequantize(out, weight):
                dequantize_packed_into(out, weight, scratch.codes)
        if scratch.staging is not None:  # the staging buffer is reused by this thread's next load
            torch.cuda.current_stream(self.device).synchronize()
        return gate_up, down

    def mean_load_seconds(self, bits: int) -> float:
        """Measured mean seconds of one load at `bits` (the mean over all widths before the first at `bits`; 1.0
        before any load): T_e of the cost model."""
        total = self.load_seconds.get(bits)
        if total and total[1]:
            return total[0] / total[1]
        done = [t for t in self.load_seconds.values() if t[1]]
        return sum(t[0] for t in done) / sum(t[1] for t in done) if done else 1.0


def _to_device(weight: PackedWeight, target: torch.Tensor) -> PackedWeight:
    """The packed weight's tensors copied, as packed bytes, into the device buffer `target` at the byte offsets they
    have in the host read buffer (both buffers are laid out alike)."""
    moved = []
    for tensor in (weight.codes, weight.scale, weight.zero):
        start = tensor.storage_offset() * tensor.element_size()
        part = target[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        part.copy_(tensor, non_blocking=True)
        moved.append(part)
    return PackedWeight(*moved, weight.bits, weight.shape)
