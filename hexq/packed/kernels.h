/* What hexq's two kernel sources (kernels.c: the GEMV, the dequantization and the thread pool; decode.c: the native
   decode step) share. Everything here is hidden: the library exports only the hexq_* entry points. */
#ifndef HEXQ_KERNELS_H
#define HEXQ_KERNELS_H
#include <stdint.h>
#include <string.h>

#define HIDDEN __attribute__((visibility("hidden")))

/* IEEE binary16 <-> float32, portable: the scales and zeros (kernels.c) and the native step's float16 KV cache
   (decode.c). float_to_half rounds to nearest, ties to even (as torch's .half() and F16C), past 65504 to infinity,
   NaN quiet; half_to_float is exact. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_half(float f) { /* round to nearest even, IEEE binary16 */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0));
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* overflows to infinity */
    if (x < 0x38800000) { /* subnormal or zero in half precision */
        if (x < 0x33000000) return (uint16_t)sign;
        const uint32_t mant = (x & 0x7fffff) | 0x800000, shift = 126 - (x >> 23);
        uint32_t half = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((x >> 13) - (112 << 10));
    const uint32_t rest = x & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2, PATH_AVXVNNI = 3 };

/* The AVX-VNNI path's VEX copies need a compiler that knows AVX-VNNI (GCC 11, clang 12); an older one builds the EVEX
   copies alone, and the path is then offered on AVX-512 VNNI CPUs only (kernels.c rows_avxvnni). */
#if defined(__x86_64__) && !defined(HEXQ_NO_AVXVNNI_VEX) \
    && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HEXQ_AVXVNNI_VEX 1
#endif

/* How a matrix's codes lie in memory (hexq.packed.weight.LAYOUTS). STREAM: the artifact's form, one little-endian bit
   stream, row-major (hexq.packed.bitpack). PLANES: each row re-laid at load for the GEMV (kernels.c "the planes
   layout"): the same bytes per row, the codes of a block of 32 split into 4-, 2- and 1-bit planes so that a block
   unpacks to 32 bytes with a shift and a mask per plane. ROWS8: the VNNI GEMVs' form (AVX-512 and AVX-VNNI paths;
   kernels.c "the rows8 layout"): rows in groups of 8, each row in planes, the 8 rows' bytes interleaved 4 at a time
   and their scales and zeros one at a time, so that one register holds 4 codes of each of 8 rows. ROWS8_Z4: rows8
   with each zero as a 4-bit integer (kernels.c "zeros as 4-bit integers"), for matrices whose zeros all are. */
enum { LAYOUT_STREAM = 0, LAYOUT_PLANES = 1, LAYOUT_ROWS8 = 2, LAYOUT_ROWS8_Z4 = 3 };

static inline int is_rows8(int layout) { return layout == LAYOUT_ROWS8 || layout == LAYOUT_ROWS8_Z4; }

/* y[t, r] = sum_c W[r, c] x[t, c] for r in [0, rows), t in [0, ntok), W = (q - zero) * scale per group of `group`
   codes of a row; q: `bits`-bit codes, one little-endian bit stream, row-major (hexq.packed.bitpack); scale and
   zero float16 [rows, cols / group]; x float32 [ntok, cols] (row stride x_stride), y float32 (row stride y_stride);
   layout: one of the LAYOUT_ values (rows8: codes, scales and zeros re-laid, see above). */
typedef struct {
    const uint8_t* codes;
    const uint16_t* scale;
    const uint16_t* zero;
    const float* x;
    float* y;
    int64_t rows, cols, group, x_stride, y_stride;
    int32_t bits, ntok, layout;
} hexq_gemv_task;

#define BLOCK 32            /* activation block: one scale per 32 values of x */
#define MAX_BLOCKS 1024     /* blocks per row the kernels take (cols / 32) */

/* x of one task, quantized: xq = round(x / dx) in int16 per block of 32 values with dx = max|x| / 32767 (so every
   value keeps 15 bits relative to its block's largest: relative error <= 2^-16 of that, far under float16 weights'
   own), and each block's sum of xq for the zero term. The rows8 GEMVs of the SIMD paths (AVX-512, AVX-VNNI, AVX2)
   read x in int8 blocks instead (q8 = round(x / dx8), dx8 = max|x| / 127: kernels.c "int8 activation blocks"). */
typedef struct {
    int16_t* q;   /* [ntok, cols] */
    float* dx;    /* [ntok, blocks] */
    int32_t* sum; /* [ntok, blocks] */
    uint8_t* lo;  /* [ntok, cols] q = 256 hi + lo, each block's bytes in the planes' order (kernels.c perm32), for */
    int8_t* hi;   /* the AVX-512 planes GEMV's byte products; lo NULL: not computed */
    int8_t* q8;   /* [ntok, cols] int8 blocks in the planes' byte order, for the rows8 GEMVs; q8 NULL: not computed */
    float* dx8;   /* [ntok, blocks] */
    float* zx8;   /* [ntok, blocks] dx8 times the block's sum of q8: its share of a zero point's term (vnni256.h) */
} quantized_x;

/* Which of quantized_x's optional forms a path's GEMVs read (quantize_x makes only those): x's bytes (lo, hi) for the
   AVX-512 and AVX-VNNI planes GEMV; int8 blocks (q8, dx8, zx8) for the rows8 GEMV of every SIMD path. */
static inline int reads_bytes(int path) { return path == PATH_AVX512 || path == PATH_AVXVNNI; }
static inline int reads_int8(int path) { return reads_bytes(path) || path == PATH_AVX2; }

/* The row functions prefetch the codes, scales and zeros of the row PREFETCH_BYTES of codes ahead (kernels.c
   "prefetch" says why); the native step's integer W8A8 rows (decode.c) too. */
#define PREFETCH_BYTES 2048

static inline int64_t prefetch_ahead(int64_t row_bytes) { return 1 + PREFETCH_BYTES / row_bytes; }

/* rows [r0, r1) of a task's y from its quantized x, on one instruction-set path */
typedef void (*rows_fn)(const hexq_gemv_task*, const quantized_x*, int64_t, int64_t);

int hexq_paths(void);
int hexq_avxvnni_encoding(void);
HIDDEN void quantize_x(const hexq_gemv_task* t, quantized_x* out, int path);
/* Whether this CPU runs AVX2 and FMA: scalar helpers take a copy compiled for them (the same numbers, faster). */
HIDDEN int cpu_has_avx2(void);
/* Whether this CPU runs AVX-VNNI and this build has the VEX copies for it (HEXQ_AVXVNNI_VEX): the AVX-VNNI path then
   runs them, else their EVEX twins (kernels.c rows_avxvnni). */
HIDDEN int cpu_has_avxvnni(void);
HIDDEN rows_fn rows_for(int path);
/* run(ctx, item) for every item in [0, items) on `threads` threads (the caller included), on the persistent pool */
HIDDEN void parallel(void (*run)(void*, int64_t), void* ctx, int64_t items, int threads);
/* While hot, the pool's workers spin between jobs instead of sleeping: a decode step's phases follow each other
   within microseconds, and a futex wake per phase would cost more than most phases. */
HIDDEN void pool_hot(int hot);

#endif
