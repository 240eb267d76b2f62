"""A fused unpack + dequantize kernel for cache misses on CPU: packed codes straight to bf16/fp16/fp32 weights.

Why a kernel. `hexq.packed.bitpack.dequantize_into` does the same work with stock torch ops: a whole-tensor pass per
unpack step and one for the per-group affine, each reading and writing the expert once more. On a Qwen3-30B-A3B expert
(gate_up [1536, 2048], down [2048, 768], groups of 32) it reaches 9-20% of a memory copy of the output bytes into
bfloat16 (benchmarks/results/dequant_speed.json). This kernel makes one pass: 64 codes per step are loaded with one
masked load of 8*bits bytes, moved into eight 64-bit lanes (one lane per 8 codes, `vpermb`), cut into one byte per code
with `vpmultishiftqb` (AVX-512 VBMI) and a mask, then turned into the output dtype:

    bfloat16, bits <= 4: a 16-entry table per group, T[q] = q*s + (-z*s) rounded to bfloat16, looked up with `vpermw`
                         (32 codes per lookup, two groups' tables side by side when a group is 16 codes);
    bfloat16 / float16 otherwise: q*s + (-z*s) in float32 (one fused multiply-add), rounded once to the output;
    float32:             (q - z) * s, a subtraction then a multiplication.

Results are bit for bit those of `dequantize_into`: its bfloat16/float16 path computes q*s - z*s in float32 (inference
batch norm with mean = zero, weight = scale) and rounds once; with float16 scale and zero both products are exact in
float32, so the fused multiply-add and the table (the same float32 value per code) round the same exact number. Its
float32 path is (q - z) * s, done here in the same order. Rounding to bfloat16 is round-to-nearest-even (AVX-512 BF16
`vcvtneps2bf16`, or the integer form torch uses when the CPU lacks that instruction).

Build. The kernel is plain C (no torch or Python headers, no ninja), compiled on first use with the system C compiler
(`$CC`, else cc, gcc or clang) for the machine it runs on (-O3 -march=native) into hexq's cache folder
(hexq.io.cache_dir()/kernels), keyed by a hash of the source, the compiler's version and the CPU's feature flags, and
loaded with ctypes, which releases the GIL during the call: a prefetch thread dequantizes while the forward pass
computes. It compiles in about a second. Without a compiler, on a CPU without AVX-512 (F, BW, DQ, VL and VBMI), or for
inputs it does not cover (scale/zero not float16, groups not a multiple of 16 codes, a matrix not a multiple of 64
codes, CUDA tensors), `dequantize_packed_fast` falls back to the torch path, which gives the same values.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hexq.io import cache_dir
from hexq.packed.bitpack import DequantScratch
from hexq.packed.weight import PackedWeight, dequantize_packed_into

logger = logging.getLogger(__name__)

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) \
    && defined(__AVX512VBMI__) && defined(__F16C__)
#include <immintrin.h>
#define HEXQ_SIMD 1
#endif

int hexq_dequant_available(void) {
#ifdef HEXQ_SIMD
    return 1;
#else
    return 0;
#endif
}

#ifdef HEXQ_SIMD
static inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else  /* round to nearest even as torch does: (u + 0x7fff + ((u >> 16) & 1)) >> 16 */
    __m512i u = _mm512_castps_si512(v);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                               _mm512_set1_epi32(1)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16));
#endif
}
#endif

/* out[i] for i < numel from the packed stream: out_kind 0 float32 (q - z) * s, 1 bfloat16 and 2 float16 of
   q*s + (-z*s). scale/zero: float16 bits, one per `group` consecutive codes. Returns 0, or -1 if unsupported. */
int hexq_dequant(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero, int64_t numel,
                 int64_t group, void* out, int out_kind) {
#ifndef HEXQ_SIMD
    return -1;
#else
    if (bits < 1 || bits > 8 || group % 16 || numel % 64 || out_kind < 0 || out_kind > 2) return -1;
    uint8_t idx[64], ctl[64];
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 8; j++) {
            idx[8 * k + j] = (uint8_t)(k * bits + (j < bits ? j : 0)); /* lane k <- the bytes of codes 8k..8k+7 */
            ctl[8 * k + j] = (uint8_t)(j * bits);                       /* byte j <- bits j*bits.. of its lane */
        }
    const __m512i vidx = _mm512_loadu_si512(idx), vctl = _mm512_loadu_si512(ctl);
    const __m512i vmask = _mm512_set1_epi8((char)((1 << bits) - 1));
    const __mmask64 load_mask = bits == 8 ? ~0ULL : ((1ULL << (8 * bits)) - 1);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi16(16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const int table = bits <= 4 && out_kind == 1;
    const int64_t groups = numel / group;
    float s_of[256], b_of[256]; /* per group of the block: scale, and -z*s (float32 out: z) */
    for (int64_t g0 = 0; g0 < groups; g0 += 256) {
        int64_t ng = groups - g0 < 256 ? groups - g0 : 256;
        for (int64_t j = 0; j < ng; j += 16) {
            __mmask16 m = ng - j >= 16 ? 0xffff : (__mmask16)((1u << (ng - j)) - 1);
            __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scale + g0 + j));
            __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, zero + g0 + j));
            _mm512_storeu_ps(s_of + j, s);
            _mm512_storeu_ps(b_of + j, out_kind == 0 ? z : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, s)));
        }
        const int64_t end = (g0 + ng) * group;
        for (int64_t i = g0 * group; i < end; i += 64) {
            __m512i raw = _mm512_maskz_loadu_epi8(load_mask, packed + (i >> 3) * bits);
            __m512i codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(vctl, _mm512_permutexvar_epi8(vidx, raw)),
                                             vmask);
            if (table) {
                for (int h = 0; h < 2; h++) {
                    int64_t o = i + 32 * h, ga = o / group - g0, gb = (o + 16) / group - g0;
                    __m256i ta = to_bf16(_mm512_fmadd_ps(iota, _mm512_set1_ps(s_of[ga]), _mm512_set1_ps(b_of[ga])));
                    __m256i tb = to_bf16(_mm512_fmadd_ps(iota, _mm512_set1_ps(s_of[gb]), _mm512_set1_ps(b_of[gb])));
                    __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(ta), tb, 1);
                    __m512i q = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, h)), second);
                    _mm512_storeu_si512((uint16_t*)out + o, _mm512_permutexvar_epi16(q, t));
                }
                continue;
            }
            for (int k = 0; k < 4; k++) {
                int64_t o = i + 16 * k, g = o / group - g0;
                __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, k)));
                __m512 s = _mm512_set1_ps(s_of[g]);
                if (out_kind == 0) {
                    _mm512_storeu_ps((float*)out + o, _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(b_of[g])), s));
                } else {
                    __m512 v = _mm512_fmadd_ps(q, s, _mm512_set1_ps(b_of[g]));
                    __m256i r = out_kind == 1 ? to_bf16(v)
                                              : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    _mm256_storeu_si256((__m256i*)((uint16_t*)out + o), r);
                }
            }
        }
    }
    return 0;
#endif
}
"""

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def kernel_path(compiler: str) -> Path:
    """Where the compiled kernel for this source, compiler and CPU lives in hexq's cache folder."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, version, " ".join(FLAGS), platform.machine(), _cpu_flags()]).encode())
    return cache_dir() / "kernels" / f"dequant-{key.hexdigest()[:16]}.so"


class DequantKernel:
    """The compiled kernel (see the module docstring); `__call__` writes one matrix, `supports` says if it can."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.hexq_dequant
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]

    @staticmethod
    def supports(out: torch.Tensor, weight: PackedWeight) -> bool:
        rows, cols = weight.shape
        groups = weight.scale.shape[-1] if weight.scale.ndim == 2 else 0
        return (out.device.type == "cpu" and out.dtype in _OUT_KIND and out.is_contiguous()
                and tuple(out.shape) == (rows, cols) and groups > 0 and cols % groups == 0
                and (cols // groups) % 16 == 0 and (rows * cols) % 64 == 0
                and all(t.device.type == "cpu" and t.dtype == torch.float16 and t.is_contiguous()
                        for t in (weight.scale, weight.zero))
                and weight.codes.device.type == "cpu" and weight.codes.dtype == torch.uint8
                and weight.codes.is_contiguous() and weight.codes.numel() == (weight.bits * rows * cols + 7) // 8)

    def __call__(self, out: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """Write the matrix `weight` stands for into `out` (check `supports` first); returns out."""
        rows, cols = weight.shape
        status = self._fn(weight.codes.data_ptr(), weight.bits, weight.scale.data_ptr(), weight.zero.data_ptr(),
                          rows * cols, cols // weight.scale.shape[-1], out.data_ptr(), _OUT_KIND[out.dtype])
        if status != 0:
            raise ValueError(f"the dequantization kernel refused a {weight.bits}-bit [{rows}, {cols}] matrix into "
                             f"{out.dtype}")
        return out


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        source = Path(folder) / "dequant.c"
        source.write_text(SOURCE)
        built = Path(folder) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], check=True, capture_output=True,
                       timeout=300)
        os.replace(built, target)  # atomic: a concurrent process sees the old file or the complete new one


@functools.cache
def load_kernel() -> DequantKernel | None:
    """The dequantization kernel for this machine, compiled on first use and cached; None when it cannot be had (no C
    compiler, a failed build, a CPU without the instructions it needs), with the reason logged."""
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler (cc, gcc, clang or $CC): misses dequantize with torch ops")
        return None
    try:
        target = kernel_path(compiler)
        if not target.is_file():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.info("dequantization kernel not built (%s %s): misses dequantize with torch ops", error,
                    detail.decode(errors="replace")[:500] if isinstance(detail, bytes) else detail)
        return None
    if not library.hexq_dequant_available():
        logger.info("this CPU lacks AVX-512 VBMI: misses dequantize with torch ops")
        return None
    return DequantKernel(library, target)


def dequantize_packed_fast(out: torch.Tensor, weight: PackedWeight, kernel: DequantKernel | None,
                           scratch: DequantScratch | None = None) -> torch.Tensor:
    """`hexq.packed.weight.dequantize_packed_into` through the kernel when it covers the inputs, else through torch
    ops (with `scratch`, the torch path's reusable code buffer): the same values either way."""
    if kernel is not None and kernel.supports(out, weight):
        return kernel(out, weight)
    return dequantize_packed_into(out, weight, scratch)
