"""CPU kernels that compute from packed weights (kernels.c beside this file): a grouped GEMV and a dequantization.

Why. A 3-bit expert is 0.19x the bytes of its bf16 copy (0.25x with its float16 scale and zero per 32), and decode
is bound by the bytes it reads: computing straight from the packed codes reads those bytes and nothing else, where
expanding to bf16 first reads the codes, writes bf16, and reads the bf16 again.

The GEMV. y[t, r] = sum_c W[r, c] x[t, c] with W = (q - zero) * scale per group (hexq.packed: q are the `bits`-bit
codes of one little-endian bit stream). x is quantized per block of 32 values to int16 (dx = max|x| / 32767), so
that (q - z) s . x = s dx (q . xq - z sum(xq)) per block: the codes go through integer multiply-adds (AVX2
`vpmaddwd`; AVX-512 VNNI `vpdpwssd` from the stream, and from the planes layout `vpdpbusd` on the codes as bytes
against xq split into its high and low bytes, the same integers without widening the codes) and one float
multiply-add per block. int16 keeps 15 bits of every value relative to its block's largest, so the relative error
of an output is ~3e-5 (measured; tests/test_packed_cpu.py bounds it). The rows8 GEMVs of the SIMD paths (AVX-512,
AVX-VNNI, AVX2: the decode step's experts, below) read int8 blocks instead (dx = max|x| / 127, llama.cpp's Q8_0
activations; kernels.c "int8 activation blocks"): one vpdpbusd per 4 codes of 8 rows where int16 took two (on AVX2
vpmaddubsw + vpmaddwd), the kernel's instructions being
as much its limit as the bytes at 1-4 bits; each output then carries up to ~5e-3 relative error, and the served
perplexity stays within 0.1% of `hexq eval` (docs/runtime.md, "Activation blocks"). A task is one matrix with its
own tokens; one call runs many tasks (all experts of a layer, mixed widths) on a pool of threads that work on rows.

The planes layout. Reading the stored stream, the GEMV spends most of its instructions cutting codes out of it (a
3-bit code straddles bytes), not waiting for the bytes. `relayout` re-lays a matrix's codes in place, once, into
planes of 4, 2 and 1 bits per block of 32 codes (kernels.c "the planes layout"), from which a block unpacks to 32
bytes with one shift and one mask per plane: the same bytes per row, so slots and memory accounting do not change.
On the AVX-512 and AVX-VNNI paths matrices of whole groups of 8 rows go one step further, into the rows8 layout
(kernels.c "the rows8 layout"): 8 rows interleaved block by block, scales and zeros too, so that one vpdpbusd
multiplies 4 codes of each of 8 rows and a block's scaling is one FMA for 8 rows (3-bit experts from memory on an
AMD EPYC, 2 threads: 0.85 ms per layer against 1.05 from the planes; benchmarks/gemv_speed.py --layouts planes rows8).
Where every zero of a matrix of widths 1-4 is an integer in [0, 15] (asymmetric grids' zero points are, unless the
recipe asks for float ones; symmetric grids' are 2^(bits - 1)) its zeros go into 4 bits each, packed in row order into
the first quarter of their array ("rows8z4", kernels.c "zeros as 4-bit integers"): a 3-bit expert in groups of 32 then
reads 3.625 bits per weight instead of 4, and a decode step reads that much less; the slot keeps its size.
It pays where a matrix is read many times: the native decode step re-lays every resident expert and dense matrix
it serves when it is built (hexq.runtime.native); a miss loaded for one use keeps the stream. Re-laid codes are read
only by these kernels (GEMV and dequantization take every layout on every path; `stream` gives a stored-layout copy
back).

The dequantization. The packed codes to float32 / bfloat16 / float16 in one pass, bit for bit the torch path
(hexq.packed.bitpack.dequantize_into): what a prefill expert expanded for a matrix product, or a whole dense
matrix, goes through.

Paths. One build serves every x86-64 CPU: each instruction set is a function of its own (target attributes), and the
path is chosen at run time from what the CPU has - `avx512` (F, BW, DQ, VL, VBMI, VNNI: Ice Lake and later Intel, AMD
Zen 4), `avxvnni` (the AVX2 path with the rows8 GEMV on 256-bit VNNI: Alder Lake and later Intel client cores and Sierra
Forest, which have AVX-VNNI but no AVX-512; offered on AVX-512 VNNI CPUs too, which run the same instruction in its EVEX
encoding, so that every such machine tests it), `avx2` (AVX2, FMA, F16C, BMI2), `scalar` (portable C) - or forced with
HEXQ_CPU_PATH for tests and comparisons. Without a C compiler or with a failed build there is no library: callers use
the torch path (a one-line notice, never a different number). `--stats` names the path taken.

Build. Plain C with no torch or Python headers, compiled on first use with the system C compiler (`$CC`, else cc, gcc
or clang) into hexq's cache folder (hexq.base.io.cache_dir()/kernels), keyed by a hash of the source, the compiler's
version and the flags, and loaded with ctypes, which releases the GIL during a call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.io import cache_dir
from hexq.packed.weight import LAYOUTS, ROWS8, ROWS8_LAYOUTS, PackedWeight, zeros_as_laid

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# The library's sources: the GEMV, dequantization and pool (kernels.c), the native decode step (decode.c), and what
# they share (kernels.h), and the 256-bit VNNI code each compiles twice (one copy per encoding of vpdpbusd): the
# rows8 GEMV (vnni256.h, kernels.c) and the integer W8A8 rows (w8a8_256.h, decode.c).
SOURCES = (SOURCE, SOURCE.with_name("decode.c"))
HEADERS = tuple(SOURCE.with_name(name) for name in ("kernels.h", "vnni256.h", "w8a8_256.h"))  # what they include
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
PATHS = ("scalar", "avx2", "avx512", "avxvnni")  # the C enum's order
# The paths whose GEMV reads the rows8 layouts at speed, from int8 activation blocks (vpdpbusd; on AVX2 emulated by
# vpmaddubsw + vpmaddwd, kernels.c dpbusd_avx2); the portable path reads rows8 too, from int16 blocks, slowly.
ROWS8_PATHS = ("avx2", "avx512", "avxvnni")
FASTEST_LAST = ("scalar", "avx2", "avxvnni", "avx512")  # the default is the last one this CPU runs
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK = 32  # activation block of the GEMV (kernels.c BLOCK)
MAX_BLOCKS = 1024  # blocks per row the GEMV takes (kernels.c MAX_BLOCKS)


class GemvTask(ctypes.Structure):
    """kernels.c's hexq_gemv_task: y[t, :rows] = W x[t, :cols] for t < ntok."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("group", ctypes.c_int64), ("x_stride", ctypes.c_int64), ("y_stride", ctypes.c_int64),
                ("bits", ctypes.c_int32), ("ntok", ctypes.c_int32), ("layout", ctypes.c_int32)]


@dataclass(frozen=True)
class GemvJob:
    """One matrix and its tokens: y [n, rows] = x [n, cols] W^T for a packed W. x and y are float32 CPU tensors whose
    rows are contiguous (any row stride)."""

    weight: PackedWeight
    x: torch.Tensor
    y: torch.Tensor


def gemv_takes(shape: tuple[int, int], bits: int, groups: int, path: str) -> bool:
    """Whether the GEMV takes a [rows, cols] matrix of `bits`-bit codes with `groups` groups per row on `path`."""
    rows, cols = shape
    if groups <= 0 or cols % groups:
        return False
    group = cols // groups
    return 1 <= bits <= 8 and group % BLOCK == 0 and cols // BLOCK <= MAX_BLOCKS and cols * bits % 8 == 0


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path(compiler: str) -> Path:
    """Where the library built from this source with this compiler lives in hexq's cache folder."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, version, " ".join(FLAGS), platform.machine()]).encode())
    return cache_dir() / "kernels" / f"hexq-cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        built = Path(folder) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"], check=True,
                       capture_output=True, timeout=300)
        os.replace(built, target)  # atomic: a concurrent process sees the old file or the complete new one


class CpuKernels:
    """The loaded library with one chosen path and thread count (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL, path: str, threads: int) -> None:
        self.library, self.path, self.threads = library, path, threads
        self._path_index = PATHS.index(path)
        library.hexq_gemv.restype = ctypes.c_int
        library.hexq_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        library.hexq_gemv_scratch.restype = ctypes.c_int64
        library.hexq_gemv_scratch.argtypes = [ctypes.c_void_p, ctypes.c_int]
        library.hexq_dequant.restype = ctypes.c_int
        library.hexq_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        library.hexq_zeros_fit4.restype = ctypes.c_int
        library.hexq_zeros_fit4.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        library.hexq_relayout.restype = ctypes.c_int
        library.hexq_relayout.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 5
        self._local = threading.local()

    def with_path(self, path: str) -> CpuKernels:
        """The same library on another path (one this CPU runs)."""
        if path not in available_paths(self.library):
            raise ValueError(f"CPU path {path} is not available here; this CPU runs {available_paths(self.library)}")
        return CpuKernels(self.library, path, self.threads)

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """The calling thread's scratch for the GEMV's quantized activations (grown on demand, 64-byte aligned)."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or buffer.numel() < nbytes + 64:
            buffer = self._local.scratch = torch.empty(max(nbytes + 64, 1 << 16), dtype=torch.uint8, device="cpu")
        return buffer[(-buffer.data_ptr()) % 64:]

    def gemv(self, jobs: list[GemvJob]) -> None:
        """Every job's y, in one call on the pool (jobs sharing one x tensor share its quantization)."""
        if jobs:
            self.run_tasks(self.tasks(jobs))

    @staticmethod
    def tasks(jobs: list[GemvJob]) -> ctypes.Array:
        """The C tasks of `jobs` (pointers into their tensors, which must outlive the tasks' use)."""
        tasks = (GemvTask * len(jobs))()
        for task, job in zip(tasks, jobs, strict=True):
            w = job.weight
            rows, cols = w.shape
            task.codes, task.scale, task.zero = w.codes.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr()
            task.x, task.y = job.x.data_ptr(), job.y.data_ptr()
            task.rows, task.cols, task.group = rows, cols, cols // w.scale.shape[-1]
            task.x_stride, task.y_stride = job.x.stride(0), job.y.stride(0)
            task.bits, task.ntok, task.layout = w.bits, job.x.shape[0], LAYOUTS.index(w.layout)
        return tasks

    def run_tasks(self, tasks: ctypes.Array) -> None:
        """The GEMV of tasks made by `tasks` (benchmarks/gemv_speed.py makes them once and times this call alone, as
        the native step calls the kernels with no Python between them)."""
        scratch = self._scratch(self.library.hexq_gemv_scratch(tasks, len(tasks)))
        if self.library.hexq_gemv(tasks, len(tasks), self._path_index, self.threads, scratch.data_ptr()) != 0:
            raise ValueError(f"the {self.path} GEMV refused one of {len(tasks)} matrices (check gemv_takes first)")

    def dequantize(self, out: torch.Tensor, weight: PackedWeight) -> bool:
        """Write the matrix `weight` stands for into `out` (contiguous, its shape, float32/bfloat16/float16); False if
        this path does not take the inputs (the caller uses the torch path; never for re-laid codes, which only
        these kernels read)."""
        groups = weight.scale.numel()
        takes = (out.dtype in OUT_KIND and weight.scale.dtype == torch.float16 and weight.zero.dtype == torch.float16
                 and groups and out.numel() % groups == 0)
        taken = takes and self.library.hexq_dequant(
            weight.codes.data_ptr(), weight.bits, weight.scale.data_ptr(), weight.zero.data_ptr(), out.numel(),
            out.numel() // groups, out.data_ptr(), OUT_KIND[out.dtype], self._path_index, weight.shape[1],
            LAYOUTS.index(weight.layout), self.threads) == 0
        if not taken and weight.layout != "stream":
            raise ValueError(f"the {self.path} kernels refused a {weight.layout} {list(weight.shape)} matrix into "
                             f"{out.dtype}")
        return taken

    def layout_for(self, weight: PackedWeight) -> str:
        """The layout `relayout` gives `weight` on this path: "rows8" where the path's GEMV reads 8 rows at a time
        (ROWS8_PATHS; whole groups of 8 rows), "rows8z4" for those of widths 1-4 whose zeros are all integers in
        [0, 15] (kernels.c "zeros as 4-bit integers"), "planes" for the other matrices of widths 1-7 the kernels
        take, else its own (8-bit codes are bytes already; other devices' codes stay as stored)."""
        rows, cols = weight.shape
        if (weight.layout != "stream" or weight.codes.device.type != "cpu" or not 1 <= weight.bits <= 7
                or not gemv_takes(weight.shape, weight.bits, weight.scale.shape[-1], self.path) or cols % BLOCK):
            return weight.layout
        if self.path not in ROWS8_PATHS or rows % ROWS8:
            return "planes"
        return "rows8z4" if weight.bits <= 4 and self.zeros_fit4(weight.zero) else "rows8"

    def zeros_fit4(self, zero: torch.Tensor) -> bool:
        """Whether every zero point is an integer in [0, 15] (what the rows8z4 layout holds): kernels.c
        hexq_zeros_fit4, from the float16 bits (asked at every re-layout, a cache miss's too)."""
        if zero.dtype != torch.float16 or zero.device.type != "cpu" or not zero.is_contiguous():
            return False
        return bool(self.library.hexq_zeros_fit4(zero.data_ptr(), zero.numel()))

    def read_nbytes(self, weight: PackedWeight) -> int:
        """Bytes a product of `weight` reads once `relayout` has laid it out for this path (layout_for): its
        PackedWeight.nbytes, rows8z4's zeros a quarter of theirs."""
        if weight.layout == "stream" and self.layout_for(weight) == "rows8z4":
            return weight.nbytes - weight.zero.nbytes + zeros_as_laid(weight.zero, "rows8z4").nbytes
        return weight.nbytes

    def relayout(self, weight: PackedWeight, layout: str | None = None) -> PackedWeight:
        """`weight` with its codes (and for rows8 its scales and zeros) re-laid in place into `layout` (default
        `layout_for(weight)`; kernels.c "the planes layout", "the rows8 layout": the same bytes, faster to read), else
        `weight` itself (a stored-layout weight the layout does not take)."""
        layout = self.layout_for(weight) if layout is None else layout
        if layout == weight.layout or weight.layout != "stream":
            return weight
        # in place, each row or group of 8 rows through a copy of itself (kernels.c hexq_relayout): never a second
        # copy of the codes (a quantized head: 175 MB of them at Qwen3-30B-A3B's vocabulary), and cheap enough for
        # every cache miss of the native step under a small fast tier
        if self._relayout(weight, weight, layout, forward=True) != 0:
            return weight
        return dataclasses.replace(weight, zero=zeros_as_laid(weight.zero, layout), layout=layout)

    def stream(self, weight: PackedWeight) -> PackedWeight:
        """A stream-layout copy of re-laid codes (for the torch path and checks); `weight` itself if it is one."""
        if weight.layout == "stream":
            return weight
        rows8 = weight.layout in ROWS8_LAYOUTS
        copy = dataclasses.replace(weight, codes=torch.empty_like(weight.codes), layout="stream",
                                   scale=torch.empty_like(weight.scale) if rows8 else weight.scale,
                                   zero=torch.empty_like(weight.scale) if rows8 else weight.zero)
        if self._relayout(weight, copy, weight.layout, forward=False) != 0:
            raise ValueError(f"a {weight.bits}-bit {list(weight.shape)} matrix cannot be in the {weight.layout} layout")
        return copy

    def _relayout(self, src: PackedWeight, dst: PackedWeight, layout: str, forward: bool) -> int:
        rows, cols = src.shape
        return self.library.hexq_relayout(
            src.codes.data_ptr(), dst.codes.data_ptr(), src.scale.data_ptr(), dst.scale.data_ptr(),
            src.zero.data_ptr(), dst.zero.data_ptr(), rows, cols, src.scale.shape[-1], src.bits, LAYOUTS.index(layout),
            int(forward), self._path_index, self.threads)


def available_paths(library: ctypes.CDLL) -> list[str]:
    """The paths this CPU runs, slowest first."""
    library.hexq_paths.restype = ctypes.c_int
    mask = library.hexq_paths()
    return [name for name in FASTEST_LAST if mask >> PATHS.index(name) & 1]


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler (cc, gcc, clang or $CC): packed weights are computed with torch ops")
        return None
    try:
        target = library_path(compiler)
        if not target.is_file():
            _build(compiler, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        logger.warning("the CPU kernels did not build (%s %s): packed weights are computed with torch ops", error,
                       detail[:300])
        return None


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def load_cpu_kernels(path: str | None = None, threads: int | None = None) -> CpuKernels | None:
    """The kernels on `path` (default: $HEXQ_CPU_PATH, else the fastest this CPU runs) with `threads` threads
    (default: every core this process may use); None when the library cannot be had (see the module docstring).
    A path this CPU does not run is a ValueError naming the ones it does."""
    library = _library()
    if library is None:
        return None
    paths = available_paths(library)
    path = path or os.environ.get("HEXQ_CPU_PATH") or paths[-1]
    if path not in PATHS:
        raise ValueError(f"CPU path {path!r}: choose one of {', '.join(PATHS)}")
    if path not in paths:
        raise ValueError(f"CPU path {path} is not available on this CPU; it runs {', '.join(paths)}")
    return CpuKernels(library, path, threads or default_threads())
