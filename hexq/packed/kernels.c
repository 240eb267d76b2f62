/* hexq's CPU kernels on packed weights: see hexq/packed/cpu.py for what each computes and why.

   One source, compiled once per machine with the system C compiler; every instruction-set path is a function of its
   own with a target attribute, and the caller picks the path at run time (hexq_paths() says which this CPU runs),
   so one build serves every x86-64 CPU and a test can force each path the CPU has. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HEXQ_X86 1
#endif

int hexq_paths(void) {
    int paths = 1 << PATH_SCALAR;
#ifdef HEXQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
        paths |= 1 << PATH_AVX2;  /* F16C comes with every AVX2 CPU; the build flags name it */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi")
        && __builtin_cpu_supports("avx512vnni"))
        paths |= 1 << PATH_AVX512;
    if ((paths >> PATH_AVX2 & 1) && (cpu_has_avxvnni()
        || (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))))
        paths |= 1 << PATH_AVXVNNI; /* rows_avxvnni says why either */
#endif
    return paths;
}

/* ------------------------------------------------------------------------------------------ the task */

#define MAX_TOK 4
/* the planes layout's byte order within a block (see "the planes layout" below) */
static inline int perm32(int j) { return (j >> 3 == 1 || j >> 3 == 2) ? j ^ 24 : j; }
/* The row functions keep their per-row arrays (w, s, z) on their own stack: a _Thread_local array in this shared
   library costs a __tls_get_addr call per use, inside the inner loop. */

/* A block's step dx: its largest |x| on int16's 32767 (both copies of quantize_x). */
static inline float block_step(float amax) { return amax / 32767.0f; }

/* int8 activation blocks. The rows8 GEMV multiplies a dword of codes by a dword of x with one vpdpbusd per byte of x
   it reads: int16 blocks take two (high and low byte) and int8 blocks one, which on the AVX-512 path of an AMD EPYC
   (Zen 4) took a 3-bit block of 8 rows from 10.7 to 7.9 ns read from memory (7.6 to 6.3 in cache): at 1-4 bits that
   kernel is bound by its instructions nearly as much as by memory. An int8 block of 32 values with step
   dx8 = max|x| / 127 is llama.cpp's Q8_0 activation, which its Q4_0 and K-quant products read; each value moves by at
   most dx8 / 2, 1/254 of its block's largest, under a 4-bit code's own rounding of the weight (1/30 of its group's
   range) by a factor 8 and more. The rows8 GEMVs read them on the SIMD paths (the decode step's experts); the int16
   blocks stay for every other product. */
static inline float block_step8(float amax) { return amax / 127.0f; }

static inline __attribute__((always_inline)) void quantize_x_body(const hexq_gemv_task* t, quantized_x* out) {
    const int64_t blocks = t->cols / BLOCK;
    for (int k = 0; k < t->ntok; k++) {
        const float* x = t->x + k * t->x_stride;
        for (int64_t b = 0; b < blocks; b++) {
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) { /* not fmaxf: a libm call per value without -ffinite-math-only */
                const float a = fabsf(x[b * BLOCK + i]);
                amax = a > amax ? a : amax; /* passes over a NaN, as fmaxf does */
            }
            const float dx = block_step(amax), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const int32_t v = (int32_t)nearbyintf(x[b * BLOCK + i] * inv);
                const int16_t q = (int16_t)(v > 32767 ? 32767 : v < -32767 ? -32767 : v);
                out->q[k * t->cols + b * BLOCK + i] = q;
                sum += q;
            }
            out->dx[k * blocks + b] = dx;
            out->sum[k * blocks + b] = sum;
            if (!out->q8) continue;
            const float inv8 = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum8 = 0;
            for (int p = 0; p < BLOCK; p++) { /* byte p holds value perm32(p), as the rows8 codes lie */
                const int32_t v = (int32_t)nearbyintf(x[b * BLOCK + perm32(p)] * inv8);
                const int8_t q = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
                out->q8[k * t->cols + b * BLOCK + p] = q;
                sum8 += q;
            }
            out->dx8[k * blocks + b] = block_step8(amax);
            out->zx8[k * blocks + b] = out->dx8[k * blocks + b] * (float)sum8;
        }
    }
}

/* out->lo and out->hi from out->q: byte p of a block holds value perm32(p), as the planes hold code perm32(p). */
static void split_bytes_portable(int64_t n, quantized_x* out) {
    for (int64_t b = 0; b < n; b += BLOCK)
        for (int p = 0; p < BLOCK; p++) {
            const int16_t q = out->q[b + perm32(p)];
            out->lo[b + p] = (uint8_t)(q & 0xff);
            out->hi[b + p] = (int8_t)(q >> 8);
        }
}

static void quantize_x_portable(const hexq_gemv_task* t, quantized_x* out) { quantize_x_body(t, out); }
#if defined(__x86_64__)
/* quantize_x_body in AVX2, the same numbers bit for bit: vmaxps passes over a NaN as the comparison does (it returns
   its second operand, the running maximum, when either is NaN), vroundps rounds as nearbyintf in the default mode,
   and the clamp to +-32767 is the body's (a NaN's INT_MIN included). A block is 4 registers: the compiled body spent
   ~1 ns per value on the int32 -> int16 narrowing it built lane by lane (the native step reads ~86k values per token
   of a 6-layer Qwen3-30B-A3B-shaped model). */
/* The sum of v's 8 int32 lanes. */
__attribute__((target("avx2"))) static inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

__attribute__((target("avx2,fma"))) static void quantize_x_avx2(const hexq_gemv_task* t, quantized_x* out) {
    const int64_t blocks = t->cols / BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
    for (int k = 0; k < t->ntok; k++) {
        const float* x = t->x + k * t->x_stride;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float dx = block_step(amax), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(scaled), top), bottom);
                sum = _mm256_add_epi32(sum, q[i]);
            }
            int16_t* to = out->q + k * t->cols + b * BLOCK;
            for (int i = 0; i < 2; i++) /* vpackssdw interleaves 128-bit lanes; vpermq puts them back in order */
                _mm256_storeu_si256((__m256i*)(to + 16 * i),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xd8));
            out->dx[k * blocks + b] = dx;
            out->sum[k * blocks + b] = hsum_epi32(sum);
            if (!out->q8) continue;
            /* int8: vpackssdw then vpacksswb leave dwords of values 0-3, 8-11, 16-19, 24-27, 4-7, ...; vpermd puts
               them in perm32's order (0-7, 16-23, 8-15, 24-31) */
            const __m256 inv8 = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m256i top8 = _mm256_set1_epi32(127), bottom8 = _mm256_set1_epi32(-127);
            __m256i q8[4], sum8 = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], inv8),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q8[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(scaled), top8), bottom8);
                sum8 = _mm256_add_epi32(sum8, q8[i]);
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q8[0], q8[1]), _mm256_packs_epi32(q8[2], q8[3]));
            _mm256_storeu_si256((__m256i*)(out->q8 + k * t->cols + b * BLOCK),
                                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)));
            out->dx8[k * blocks + b] = block_step8(amax);
            out->zx8[k * blocks + b] = out->dx8[k * blocks + b] * (float)hsum_epi32(sum8);
        }
    }
}

/* split_bytes_portable with vpack{us,s}wb, whose interleaving of the two halves' 128-bit lanes is perm32's order. */
__attribute__((target("avx2"))) static void split_bytes_avx2(int64_t n, quantized_x* out) {
    const __m256i low = _mm256_set1_epi16(0xff);
    for (int64_t b = 0; b < n; b += BLOCK) {
        const __m256i q0 = _mm256_loadu_si256((const __m256i*)(out->q + b));
        const __m256i q1 = _mm256_loadu_si256((const __m256i*)(out->q + b + 16));
        _mm256_storeu_si256((__m256i*)(out->lo + b),
                            _mm256_packus_epi16(_mm256_and_si256(q0, low), _mm256_and_si256(q1, low)));
        _mm256_storeu_si256((__m256i*)(out->hi + b),
                            _mm256_packs_epi16(_mm256_srai_epi16(q0, 8), _mm256_srai_epi16(q1, 8)));
    }
}
#endif

HIDDEN int cpu_has_avx2(void) {
#if defined(__x86_64__)
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return has;
#else
    return 0;
#endif
}

HIDDEN int cpu_has_avxvnni(void) {
#ifdef HEXQ_AVXVNNI_VEX
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avxvnni");
    }
    return has;
#else
    return 0;
#endif
}

HIDDEN void quantize_x(const hexq_gemv_task* t, quantized_x* out, int path) {
    const int64_t n = (int64_t)t->ntok * t->cols;
#if defined(__x86_64__)
    if (path != PATH_SCALAR && cpu_has_avx2()) { /* the scalar path, forced, runs the portable copy */
        quantize_x_avx2(t, out);
        if (out->lo) split_bytes_avx2(n, out);
        return;
    }
#endif
    quantize_x_portable(t, out);
    if (out->lo) split_bytes_portable(n, out);
}

/* For the tests: x [n] (n a multiple of 32) into q [n], dx and sum [n / 32], and q8 [n], dx8 and zx8 [n / 32]
   (q8 NULL: not), as `path` computes them, so that the copies of quantize_x can be compared bit for bit. Returns -1
   for a path this CPU does not run. */
int hexq_quantize_x(const float* x, int64_t n, int path, int16_t* q, float* dx, int32_t* sum, int8_t* q8, float* dx8,
                    float* zx8) {
    if (!(hexq_paths() >> path & 1) || n % BLOCK) return -1;
    const hexq_gemv_task t = {0, 0, 0, x, 0, 0, n, BLOCK, n, 0, 1, 1, LAYOUT_STREAM};
    quantized_x out = {q, dx, sum, NULL, NULL, q8, dx8, zx8};
    quantize_x(&t, &out, path);
    return 0;
}

/* Per row: w_b = scale * dx of every block (block b in group b*32/group) and the zero term sum_b w_b * zero * sum_b,
   so that y = sum_b w_b * dot_b(q, xq) - zero term: (q - z) s . x = s dx (q . xq - z sum(xq)). */
static inline void row_terms(const hexq_gemv_task* t, const quantized_x* xq, const float* s, const float* z, int64_t r,
                             int ntok, float w[][MAX_BLOCKS], float* zterm) {
    const int64_t blocks = t->cols / BLOCK, per_group = t->group / BLOCK, groups = t->cols / t->group;
    (void)r;
    (void)groups;
    for (int k = 0; k < ntok; k++) {
        const float* dx = xq->dx + k * blocks;
        const int32_t* sum = xq->sum + k * blocks;
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const float wb = s[b / per_group] * dx[b];
            w[k][b] = wb;
            acc += wb * z[b / per_group] * (float)sum[b];
        }
        zterm[k] = acc;
    }
}

/* ------------------------------------------------------------------------------------------ the stream */

static inline uint32_t code_at(const uint8_t* stream, int64_t i, int bits) {
    int64_t bit = i * bits;
    uint32_t word = stream[bit >> 3];
    if ((bit & 7) + bits > 8) word |= (uint32_t)stream[(bit >> 3) + 1] << 8;
    return (word >> (bit & 7)) & ((1u << bits) - 1);
}

/* ------------------------------------------------------------------------------------------ prefetch */

/* Why. A row is three short streams (codes, scales, zeros) of one matrix among the dozens a call reads: the hardware
   prefetchers, which ramp up within a page and stop at its end, keep few of them ahead, and a GEMV from memory ran at
   ~9.5 GB/s on 2 cores of a machine that reads ~30 GB/s, its time in the loads of the codes (perf). The row functions
   ask for the row PREFETCH_BYTES of codes ahead (AMD EPYC, 2 threads, 3-bit experts from memory: ~9.5 -> ~13 GB/s,
   benchmarks/gemv_speed.py; 1-4 rows ahead measured alike). A prefetch never faults, but rows past the task's end are
   not asked for (they are another matrix's, or nothing). PREFETCH_BYTES and prefetch_ahead: kernels.h. */

/* always_inline, and the builtin rather than _mm_prefetch: GCC 12 drops an _mm_prefetch of a plain inline function
   inlined into the row functions' target("avx2") code (the library had no prefetch in its row functions). */
static inline __attribute__((always_inline)) void prefetch_row(const hexq_gemv_task* t, int64_t r, int64_t row_bytes,
                                                               int64_t groups) {
    if (r >= t->rows) return;
    const char* codes = (const char*)(t->codes + r * row_bytes);
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(codes + o, 0, 3);
    for (int64_t o = 0; o < groups * 2; o += 64) {
        __builtin_prefetch((const char*)(t->scale + r * groups) + o, 0, 3);
        __builtin_prefetch((const char*)(t->zero + r * groups) + o, 0, 3);
    }
}

/* ------------------------------------------------------------------------------------------ the planes layout */

/* Why. A GEMV from the stream layout spends most of its instructions cutting codes out of the stream (at 3 bits a
   code straddles bytes); the bytes themselves arrive faster than that. Re-laid at load, a block of 32 codes becomes
   32 bytes with one shift and one mask per plane, the way llama.cpp re-lays Q4_0 (repack.cpp) - but for every width
   1-7 and in place (the same bytes per row, so the cache's slots and byte accounting do not change).

   The layout of one row of `cols` codes (blocks of 32; widths 1-7; 8-bit codes keep the stream, which is bytes):
   - a width is split into planes of 4, 2 and 1 bits (7 = 4 + 2 + 1, 6 = 4 + 2, 5 = 4 + 1, 3 = 2 + 1); the first plane
     holds the code's lowest bits;
   - a w-bit plane is a run of 32-byte units, each holding 8/w consecutive blocks: bits [w*k, w*k + w) of byte p of a
     unit are that plane's bits of code perm(p) of the unit's k-th block;
   - perm swaps the middle two 8-byte quarters of a block (codes 8-15 at bytes 16-23, 16-23 at 8-15), so that
     unpacking the 32 bytes to int16 within 128-bit lanes (vpunpcklbw/vpunpckhbw) yields codes 0-15 and 16-31 in order;
   - the planes cover the first `planes_blocks` blocks of the row (a multiple of the widest unit, 8/w blocks of its
     narrowest plane), one plane after the other; the remaining blocks follow as a little-endian bit stream. */

static inline int64_t planes_blocks(int64_t cols, int bits) {
    const int64_t unit = 8 / (bits & -bits); /* blocks per unit of the narrowest plane */
    return cols / BLOCK / unit * unit;
}

static inline uint32_t code_planes(const uint8_t* row, int64_t cols, int bits, int64_t i) {
    const int64_t nbp = planes_blocks(cols, bits), b = i / BLOCK;
    if (b >= nbp) return code_at(row + nbp * 4 * bits, i - nbp * BLOCK, bits);
    const int p = perm32((int)(i % BLOCK));
    uint32_t code = 0;
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        code |= ((uint32_t)(row[b / per * 32 + p] >> (w * (b % per))) & ((1u << w) - 1)) << off;
        off += w;
        row += nbp * 4 * w;
    }
    return code;
}

static inline int takes_planes(int64_t cols, int bits) { return bits >= 1 && bits <= 7 && cols % BLOCK == 0; }

/* ------------------------------------------------------------------------------------------ the rows8 layout */

/* Why. From the planes layout the AVX-512 GEMV still spends, per block of one row, a float conversion and an FMA to
   scale the block's integer dot product and a horizontal sum per row, and each vpdpbusd serves one row. With 8 rows
   interleaved, one register holds 4 codes of each of 8 rows: a vpdpbusd multiplies them by 4 broadcast values of x
   for 8 rows at once, a block's scaling is one conversion and FMA for 8 rows, a group's scale one float16 load for 8
   rows, and rows end in no horizontal sum (llama.cpp re-lays Q4_0 rows 8 at a time for the same reasons). Measured
   on an AMD EPYC, one thread, 3-bit experts from memory: 1.1 ms per layer against 1.6-2.4 from the planes.

   The layout of rows 8G .. 8G + 7 (rows % 8 == 0, cols % 32 == 0), at 8 G row_bytes, one block of 32 codes after
   the other (32 bits bytes each), each block's planes of 4, 2 and 1 bits after one another (a w-bit plane: w
   registers of 32 bytes): bits [w f, w f + w) of byte 4 r + i of the plane's register m hold that plane's bits of
   row 8G + r's code at perm32 position 4 D + i, D = m (8 / w) + f. So the plane bits of dword D of every row of a
   block sit in one register, one field per byte: a shift and a mask per plane give 8 rows x 4 codes as bytes in the
   order x's bytes are (quantize_x). Scale and zero g of row 8G + r at 8 G groups + 8 g + r. The same bytes as the
   stream; the rows of a group of 8 are no longer each other's. */

static inline int takes_rows8(int64_t rows, int64_t cols, int bits) { return takes_planes(cols, bits) && rows % 8 == 0; }

/* Offset in a rows8 block of plane w's register m (the wider planes' registers first). */
static inline int64_t rows8_register(int bits, int w, int m) { return 32 * ((bits & ~(2 * w - 1)) + m); }

/* Code i of row r (0-7) of the group of 8 rows at group8. */
static inline uint32_t code_rows8(const uint8_t* group8, int r, int bits, int64_t i) {
    const uint8_t* block = group8 + i / BLOCK * 32 * bits;
    const int p = perm32((int)(i % BLOCK)), d = p >> 2;
    uint32_t code = 0;
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        const uint8_t byte = block[rows8_register(bits, w, d / per) + 4 * r + (p & 3)];
        code |= ((uint32_t)(byte >> (w * (d % per))) & ((1u << w) - 1)) << off;
        off += w;
    }
    return code;
}

/* Code i of row r of a task, in any layout (the portable path's reader). */
static inline uint32_t task_code(const hexq_gemv_task* t, int64_t r, int64_t i) {
    const int64_t row_bytes = t->cols * t->bits / 8;
    if (is_rows8(t->layout)) return code_rows8(t->codes + (r & ~7) * row_bytes, (int)(r & 7), t->bits, i);
    const uint8_t* row = t->codes + r * row_bytes;
    return t->layout == LAYOUT_PLANES ? code_planes(row, t->cols, t->bits, i) : code_at(row, i, t->bits);
}

/* Where scale g of row r lies (and zero g, but in LAYOUT_ROWS8_Z4), in any layout. */
static inline int64_t grid_index(int layout, int64_t r, int64_t g, int64_t groups) {
    return is_rows8(layout) ? (r & ~7) * groups + g * 8 + (r & 7) : r * groups + g;
}

/* ------------------------------------------------------------------------------------------ zeros as 4-bit integers */

/* Why. A 3-bit matrix in groups of 32 with a float16 scale and zero per group reads 4 bits per weight, a quarter of
   them the grid; yet an asymmetric grid's zero point is an integer in [0, 2^bits - 1] unless the recipe asks for a
   float one (hexq.algos.quant.grid_params), and a symmetric grid's is 2^(bits - 1). Held as 4-bit integers, the zeros
   of a matrix of 1-4-bit codes cost 1/8 bit per weight instead of 1/2: a 3-bit expert reads 3.625 bits per weight
   (-9%), a 4-bit one 4.5 (-10%), and a decode step, which is bound by what it reads, is that much shorter.

   The layout (LAYOUT_ROWS8_Z4, chosen by hexq.packed.cpu.CpuKernels.layout_for where every zero of a matrix is an
   integer in [0, 15]): rows8, but the zeros packed into the first quarter of the array their float16 values held, one
   stream: 4 groups bytes per group of 8 rows, 4 bytes per group: bits [4 r, 4 r + 4) of the little-endian 32-bit
   word of group g of rows 8G .. 8G + 7 (at byte 4 groups G + 4 g) hold the zero of row 8G + r; the other three
   quarters are zero. One stream, not a quarter of each group of rows' own region: read at a stride, the quarters
   came slower than the whole regions had (the hardware prefetchers follow a stream). The same values: only where they
   lie and in how many bits. */
static inline const uint8_t* zeros4_of(const uint16_t* zero, int64_t r, int64_t g, int64_t groups) {
    return (const uint8_t*)zero + (r & ~7) * groups / 2 + 4 * g;
}

/* The zeros of rows r on (r a multiple of 8 in the rows8 layouts), in any layout. */
static inline const uint16_t* zero_rows(const uint16_t* zero, int layout, int64_t r, int64_t groups) {
    return layout == LAYOUT_ROWS8_Z4 ? (const uint16_t*)((const uint8_t*)zero + r * groups / 2) : zero + r * groups;
}

/* Zero g of row r, in any layout. */
static inline float zero_at(const uint16_t* zero, int layout, int64_t r, int64_t g, int64_t groups) {
    if (layout == LAYOUT_ROWS8_Z4) return (float)((zeros4_of(zero, r, g, groups)[(r & 7) / 2] >> (4 * (r & 1))) & 15);
    return half_to_float(zero[grid_index(layout, r, g, groups)]);
}

/* The integer in [0, 15] a float16 value is (-0 counts as 0), or -1: from its bits, no float conversion (a zero
   array is checked and packed at every re-layout, a cache miss's too). A positive normal value 2^k (1 + m / 1024)
   is an integer below 16 when 0 <= k <= 3 and the mantissa's low 10 - k bits are clear. */
static inline int half_nibble(uint16_t h) {
    if (!(h & 0x7fff)) return 0;
    if (h & 0x8000) return -1;
    const int k = (h >> 10) - 15, m = h & 0x3ff;
    if (k < 0 || k > 3 || (m & ((1 << (10 - k)) - 1))) return -1;
    return (1024 + m) >> (10 - k);
}

#if defined(__x86_64__)
/* hexq_zeros_fit4 8 values at a time (F16C): the same answer, ordered comparisons failing a NaN as half_nibble does. */
__attribute__((target("avx2,f16c"))) static int zeros_fit4_avx2(const uint16_t* zero, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(zero + i)));
        const __m256 whole = _mm256_cmp_ps(v, _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                           _CMP_EQ_OQ);
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ),
                                        _mm256_cmp_ps(v, _mm256_set1_ps(15.0f), _CMP_LE_OQ));
        if (_mm256_movemask_ps(_mm256_and_ps(whole, in)) != 0xff) return 0;
    }
    for (; i < n; i++)
        if (half_nibble(zero[i]) < 0) return 0;
    return 1;
}
#endif

/* Whether every one of n float16 zeros is an integer in [0, 15] (what LAYOUT_ROWS8_Z4 holds; hexq.packed.cpu's
   layout_for asks, and hexq_relayout before it writes anything). */
int hexq_zeros_fit4(const uint16_t* zero, int64_t n) {
#if defined(__x86_64__)
    if (cpu_has_avx2()) return zeros_fit4_avx2(zero, n);
#endif
    for (int64_t i = 0; i < n; i++)
        if (half_nibble(zero[i]) < 0) return 0;
    return 1;
}

#if defined(__x86_64__)
/* zeros4_pack on 8 groups at a time (F16C): each row's values converted and shifted into the 8 groups' words. */
__attribute__((target("avx2,f16c"))) static void zeros4_pack_avx2(const uint16_t* grid, uint8_t* out,
                                                                  int64_t groups) {
    for (int64_t g = 0; g < groups; g += 8) {
        __m256i words = _mm256_setzero_si256();
        for (int r = 0; r < 8; r++) {
            const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(grid + r * groups + g)));
            words = _mm256_or_si256(words, _mm256_slli_epi32(_mm256_cvttps_epi32(v), 4 * r));
        }
        _mm256_storeu_si256((__m256i*)(out + 4 * g), words);
    }
}
#endif

/* The 4-bit zeros of rows 8G .. 8G + 7 (their float16 values row-major in `grid`, checked by hexq_zeros_fit4) at
   `out`: 4 bytes per group (kernels.c "zeros as 4-bit integers"). */
static void zeros4_pack(const uint16_t* grid, uint8_t* out, int64_t groups, int path) {
#if defined(__x86_64__)
    if (path != PATH_SCALAR && groups % 8 == 0 && cpu_has_avx2()) {
        zeros4_pack_avx2(grid, out, groups);
        return;
    }
#endif
    (void)path;
    for (int64_t g = 0; g < groups; g++) {
        uint32_t word = 0;
        for (int r = 0; r < 8; r++) word |= (uint32_t)half_nibble(grid[r * groups + g]) << (4 * r);
        memcpy(out + 4 * g, &word, 4);
    }
}

/* LAYOUT_ROWS8_Z4's zeros back to float16 [rows, groups] (row-major) at dst, through a copy (dst may be src). Returns
   0, or -1 without the memory for the copy (nothing written). */
static int zeros4_back(const uint16_t* src, uint16_t* dst, int64_t rows, int64_t groups) {
    const size_t n = (size_t)(rows * groups);
    uint16_t* packed = malloc(n / 2);
    if (!packed) return -1;
    memcpy(packed, src, n / 2);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++)
            dst[r * groups + g] = float_to_half(zero_at(packed, LAYOUT_ROWS8_Z4, r, g, groups));
    free(packed);
    return 0;
}

/* One row of codes: from the stream into planes (to_planes) or back, on the portable path. The stream's tail (the
   blocks after nbp) starts on a whole byte in both layouts and is copied as it is. */
static void relayout_row(const uint8_t* src, uint8_t* dst, int64_t cols, int bits, int to_planes) {
    const int64_t nbp = planes_blocks(cols, bits), row_bytes = cols * bits / 8, head = nbp * 4 * bits;
    memcpy(dst + head, src + head, (size_t)(row_bytes - head));
    memset(dst, 0, (size_t)head);
    for (int64_t i = 0; i < nbp * BLOCK; i++) {
        const uint32_t code = to_planes ? code_at(src, i, bits) : code_planes(src, cols, bits, i);
        if (!to_planes) {
            const int64_t bit = i * bits;
            const uint32_t v = code << (bit & 7);
            dst[bit >> 3] |= (uint8_t)v;
            if ((bit & 7) + bits > 8) dst[(bit >> 3) + 1] |= (uint8_t)(v >> 8);
            continue;
        }
        const int64_t b = i / BLOCK;
        uint8_t* plane = dst;
        int off = 0;
        for (int w = 4; w >= 1; w >>= 1) {
            if (!(bits & w)) continue;
            const int per = 8 / w;
            plane[b / per * 32 + perm32((int)(i % BLOCK))] |= (uint8_t)(((code >> off) & ((1u << w) - 1))
                                                                          << (w * (b % per)));
            off += w;
            plane += nbp * 4 * w;
        }
    }
}

typedef struct {
    const uint8_t* src;
    uint8_t* dst;
    const uint16_t* src_grid[2]; /* scale, zero */
    uint16_t* dst_grid[2];
    int64_t rows, cols, groups;
    int bits, layout, forward, path;
    uint8_t* zeros4;         /* LAYOUT_ROWS8_Z4 forward: the 4-bit zeros, packed here, then over the float16 ones */
    uint8_t* eights;         /* rows8: one buffer of 8 rows per thread, */
    _Atomic uint64_t idle;   /* those no item holds (one bit each) */
} relayout_job;

static void relayout_item(void* arg, int64_t item);

#define RELAYOUT_ROWS 64 /* a multiple of 8: an item holds whole groups of the rows8 layout */

/* dst (rows x cols codes; src itself: in place, through a copy of each row or group of 8 rows; else not overlapping
   src) = src re-laid, stream -> `layout` (forward 1) or back, on instruction-set path `path` (the same bytes on every
   path). The rows8 layouts re-lay the scales and zeros [rows, groups] too (src_scale -> dst_scale, likewise zero;
   the same array: in place); LAYOUT_PLANES leaves them (and takes NULL). Returns 0, or -1 for a shape or width the
   layout does not take (LAYOUT_ROWS8_Z4: widths 1-4), or (LAYOUT_ROWS8_Z4, forward) a zero that is not an integer
   in [0, 15]: then nothing was written. */
int hexq_relayout(const uint8_t* src, uint8_t* dst, const uint16_t* src_scale, uint16_t* dst_scale,
                  const uint16_t* src_zero, uint16_t* dst_zero, int64_t rows, int64_t cols, int64_t groups, int bits,
                  int layout, int forward, int path, int threads) {
    if (!takes_planes(cols, bits) || cols / BLOCK > MAX_BLOCKS || rows < 0 || !(hexq_paths() >> path & 1)) return -1;
    if (is_rows8(layout)
        && (!takes_rows8(rows, cols, bits) || groups <= 0 || cols % groups || !src_scale || !dst_scale || !src_zero
            || !dst_zero))
        return -1;
    if (layout != LAYOUT_PLANES && !is_rows8(layout)) return -1;
    if (layout == LAYOUT_ROWS8_Z4 && (bits > 4 || (forward && !hexq_zeros_fit4(src_zero, rows * groups)))) return -1;
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    relayout_job job = {src, dst, {src_scale, src_zero}, {dst_scale, dst_zero}, rows, cols, groups, bits, layout,
                        forward, path, NULL, NULL, threads == 64 ? ~0ULL : (1ULL << threads) - 1};
    if (is_rows8(layout)) { /* up to 229 KB a thread: not on its stack; refused before anything is written */
        job.eights = malloc((size_t)threads * (size_t)(8 * (cols * bits / 8) + 64));
        if (!job.eights) return -1;
    }
    const size_t n = (size_t)(rows * groups);
    if (layout == LAYOUT_ROWS8_Z4 && forward && !(job.zeros4 = malloc(n / 2))) {
        free(job.eights);
        return -1;
    }
    if (layout == LAYOUT_ROWS8_Z4 && !forward && zeros4_back(src_zero, dst_zero, rows, groups) != 0) {
        free(job.eights);
        return -1;
    }
    parallel(relayout_item, &job, (rows + RELAYOUT_ROWS - 1) / RELAYOUT_ROWS, threads);
    if (job.zeros4) { /* every group's float16 zeros read: the 4-bit ones over them, the rest of the array zero */
        memcpy(dst_zero, job.zeros4, n / 2);
        memset((uint8_t*)dst_zero + n / 2, 0, n * 2 - n / 2);
        free(job.zeros4);
    }
    free(job.eights);
    return 0;
}

/* ------------------------------------------------------------------------------------------ portable GEMV */

static void rows_scalar(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1) {
    const int64_t groups = t->cols / t->group, blocks = t->cols / BLOCK;
    float w[MAX_TOK][MAX_BLOCKS];
    float s[MAX_BLOCKS], z[MAX_BLOCKS], zterm[MAX_TOK];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < groups; g++) {
            s[g] = half_to_float(t->scale[grid_index(t->layout, r, g, groups)]);
            z[g] = zero_at(t->zero, t->layout, r, g, groups);
        }
        row_terms(t, xq, s, z, r, t->ntok, w, zterm);
        for (int k = 0; k < t->ntok; k++) {
            const int16_t* x = xq->q + k * t->cols;
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int i = 0; i < BLOCK; i++) dot += (int32_t)task_code(t, r, b * BLOCK + i) * x[b * BLOCK + i];
                total += w[k][b] * (float)dot;
            }
            t->y[k * t->y_stride + r] = total - zterm[k];
        }
    }
}

#ifdef HEXQ_X86
/* ------------------------------------------------------------------------------------------ AVX2 path */

#define AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define INLINE __attribute__((always_inline)) inline

/* n float16 values as float32 (F16C), 8 at a time. */
static AVX2 INLINE void halves_avx2(const uint16_t* h, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
}

/* 8 codes of `bits` bits (bits bytes of the stream at p) -> 8 bytes, one code each: one pdep. One 8-byte load
   where the stream has 8 bytes left (a load of `bits` bytes through memory stalls store forwarding), else a copy. */
static AVX2 INLINE uint64_t eight_codes(const uint8_t* p, const uint8_t* end, const int bits) {
    uint64_t word = 0;
    if (p + 8 <= end) {
        memcpy(&word, p, 8);
        if (bits < 8) word &= (1ULL << (8 * bits)) - 1;
    } else {
        memcpy(&word, p, bits);
    }
    return bits == 8 ? word : _pdep_u64(word, 0x0101010101010101ULL * ((1u << bits) - 1));
}

static AVX2 INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* row_terms 8 blocks at a time (see row_terms_avx512). */
static AVX2 INLINE void row_terms_avx2(const hexq_gemv_task* t, const quantized_x* xq, int64_t r, int ntok,
                                       float* sb, float* zb, float w[][MAX_BLOCKS], float* zterm) {
    const int64_t cols = t->cols, groups = cols / t->group, blocks = cols / BLOCK, per_group = t->group / BLOCK;
    if (per_group == 1) {
        halves_avx2(t->scale + r * groups, sb, groups);
        halves_avx2(t->zero + r * groups, zb, groups);
    } else {
        float sg[MAX_BLOCKS], zg[MAX_BLOCKS];
        halves_avx2(t->scale + r * groups, sg, groups);
        halves_avx2(t->zero + r * groups, zg, groups);
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < per_group; j++) {
                sb[g * per_group + j] = sg[g];
                zb[g * per_group + j] = zg[g];
            }
    }
    for (int k = 0; k < ntok; k++) {
        const float* dx = xq->dx + k * blocks;
        const int32_t* sum = xq->sum + k * blocks;
        __m256 acc = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= blocks; b += 8) {
            const __m256 wb = _mm256_mul_ps(_mm256_loadu_ps(sb + b), _mm256_loadu_ps(dx + b));
            _mm256_storeu_ps(w[k] + b, wb);
            const __m256 zs = _mm256_mul_ps(_mm256_loadu_ps(zb + b),
                                            _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(sum + b))));
            acc = _mm256_fmadd_ps(wb, zs, acc);
        }
        float tail = 0.0f;
        for (; b < blocks; b++) {
            w[k][b] = sb[b] * dx[b];
            tail += w[k][b] * zb[b] * (float)sum[b];
        }
        zterm[k] = hsum256(acc) + tail;
    }
}

/* 16 codes of `bits` bits as 16 int16 lanes, without pdep: each 128-bit half of the register holds 8 codes, which
   lie in the first bits + 1 bytes at its source (the second half's source is `bits` bytes on); a byte shuffle puts
   the two bytes that cover code j into 16-bit lane j, a multiply by 2^(7 - shift) and a shift right by 7 move the
   code to bit 0 (AVX2 has no per-lane 16-bit shift), a mask clears the rest. 4 vector ops per 16 codes against two
   pdeps, two inserts and a widening. */
typedef struct {
    __m256i index, multiplier, mask;
} unpack16;

static AVX2 INLINE unpack16 unpack16_for(int bits) {
    uint8_t index[32];
    int16_t multiplier[16];
    for (int lane = 0; lane < 2; lane++)
        for (int j = 0; j < 8; j++) {
            const int bit = j * bits;
            index[16 * lane + 2 * j] = (uint8_t)(bit >> 3);
            index[16 * lane + 2 * j + 1] = (uint8_t)((bit >> 3) + 1);
            multiplier[8 * lane + j] = (int16_t)(1 << (7 - (bit & 7)));
        }
    unpack16 u;
    u.index = _mm256_loadu_si256((const __m256i*)index);
    u.multiplier = _mm256_loadu_si256((const __m256i*)multiplier);
    u.mask = _mm256_set1_epi16((short)((1 << bits) - 1));
    return u;
}

static AVX2 INLINE __m256i codes16(const unpack16* u, const uint8_t* p, const int bits) {
    if (bits == 8) return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); /* bytes are the codes */
    const __m256i raw = _mm256_loadu2_m128i((const __m128i*)(p + bits), (const __m128i*)p);
    const __m256i lanes = _mm256_shuffle_epi8(raw, u->index);
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(lanes, u->multiplier), 7), u->mask);
}

/* relayout_row's stream -> planes on AVX2: a block's 32 codes by codes16 in two halves, packed to bytes (vpackuswb
   interleaves the halves' 128-bit lanes into perm32 order), each plane's bits ORed into its unit. */
static AVX2 INLINE void to_planes_avx2_bits(const uint8_t* src, uint8_t* dst, int64_t cols, const int bits) {
    const int64_t nbp = planes_blocks(cols, bits), row_bytes = cols * bits / 8, head = nbp * 4 * bits;
    const unpack16 u = unpack16_for(bits);
    memcpy(dst + head, src + head, (size_t)(row_bytes - head));
    memset(dst, 0, (size_t)head);
    for (int64_t b = 0; b < nbp; b++) {
        const __m256i q = _mm256_packus_epi16(codes16(&u, src + b * 4 * bits, bits),
                                              codes16(&u, src + b * 4 * bits + 2 * bits, bits));
        uint8_t* plane = dst;
        int off = 0;
        for (int w = 4; w >= 1; w >>= 1) {
            if (!(bits & w)) continue;
            const int per = 8 / w;
            __m256i* unit = (__m256i*)(plane + b / per * 32);
            const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, off), _mm256_set1_epi8((char)((1 << w) - 1)));
            _mm256_storeu_si256(unit, _mm256_or_si256(_mm256_loadu_si256(unit),
                                                      _mm256_sll_epi16(v, _mm_cvtsi32_si128(w * (int)(b % per)))));
            off += w;
            plane += nbp * 4 * w;
        }
    }
}

static AVX2 void to_planes_avx2(const uint8_t* src, uint8_t* dst, int64_t cols, int bits) {
#define CASE(B) case B: to_planes_avx2_bits(src, dst, cols, B); return;
    switch (bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) }
#undef CASE
}

/* v[i] lane r <- v[r] lane i: an 8 x 8 transpose of dwords (rows' blocks <-> the rows8 layout's registers). */
static AVX2 INLINE void transpose8(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);     /* dwords 0 1 | 4 5 of rows i, i + 1, interleaved */
        a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]); /* dwords 2 3 | 6 7 */
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);         /* dword 0 | 4 of rows i .. i + 3 */
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);     /* 1 | 5 */
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]); /* 2 | 6 */
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]); /* 3 | 7 */
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x31);
    }
}

/* 8 rows of stream codes (src: 8 row_bytes and 64 readable bytes after) -> the rows8 layout at dst: per block, each
   row's 32 codes as bytes in perm32 order (as to_planes_avx2), transposed so that register d holds every row's
   dword d, then each plane's fields packed into its registers (every byte of the block written). Block b: */
static AVX2 INLINE void rows8_block_avx2(const uint8_t* src, uint8_t* dst, int64_t cols, int64_t b, const unpack16* u,
                                         const int bits) {
    const int64_t row_bytes = cols * bits / 8;
    __m256i t[8];
    for (int r = 0; r < 8; r++) {
        const uint8_t* p = src + r * row_bytes + b * 4 * bits;
        t[r] = _mm256_packus_epi16(codes16(u, p, bits), codes16(u, p + 2 * bits, bits));
    }
    transpose8(t);
    uint8_t* block = dst + b * 32 * bits;
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        for (int m = 0; m < w; m++) {
            __m256i reg = _mm256_setzero_si256();
            for (int f = 0; f < per; f++) {
                const __m256i v = _mm256_and_si256(_mm256_srli_epi16(t[m * per + f], off),
                                                   _mm256_set1_epi8((char)((1 << w) - 1)));
                reg = _mm256_or_si256(reg, _mm256_sll_epi16(v, _mm_cvtsi32_si128(w * f)));
            }
            _mm256_storeu_si256((__m256i*)(block + rows8_register(bits, w, m)), reg);
        }
        off += w;
    }
}

static AVX2 INLINE void to_rows8_avx2_bits(const uint8_t* src, uint8_t* dst, int64_t cols, const int bits) {
    const unpack16 u = unpack16_for(bits);
    for (int64_t b = 0; b < cols / BLOCK; b++) rows8_block_avx2(src, dst, cols, b, &u, bits);
}

static AVX2 void to_rows8_avx2(const uint8_t* src, uint8_t* dst, int64_t cols, int bits) {
#define CASE(B) case B: to_rows8_avx2_bits(src, dst, cols, B); return;
    switch (bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) }
#undef CASE
}

/* bits [w*k, w*k + w) of every byte of v moved to [off, off + w), the rest cleared (a 16-bit shift: the bits it
   brings in from the neighbouring byte land outside the mask). */
static AVX2 INLINE __m256i plane_bits(__m256i v, const int w, const int k, const int off) {
    const int from = w * k;
    const __m256i moved = from > off   ? _mm256_srli_epi16(v, from - off)
                          : from < off ? _mm256_slli_epi16(v, off - from)
                                       : v;
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(((1 << w) - 1) << off)));
}

/* Block b0 + k of a planes row (b0 a multiple of the row's unit, b0 + k < nbp) as 32 code bytes in perm32 order. */
static AVX2 INLINE __m256i planes_block(const uint8_t* row, int64_t nbp, int64_t b0, const int k, const int bits) {
    __m256i q = _mm256_setzero_si256();
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        const __m256i v = _mm256_loadu_si256((const __m256i*)(row + (b0 / per + k / per) * 32));
        q = _mm256_or_si256(q, plane_bits(v, w, k % per, off));
        off += w;
        row += nbp * 4 * w;
    }
    return q;
}

/* One block's 32 code bytes (perm32 order) times each token's int16 x block, scaled by w_b into acc. */
static AVX2 INLINE void block_bytes_dot(__m256i q, const quantized_x* xq, int64_t cols, int64_t b,
                                        float w[][MAX_BLOCKS], __m256* acc, const int ntok) {
    const __m256i lo = _mm256_unpacklo_epi8(q, _mm256_setzero_si256()); /* codes 0-15 as int16 */
    const __m256i hi = _mm256_unpackhi_epi8(q, _mm256_setzero_si256()); /* codes 16-31 */
    for (int k = 0; k < ntok; k++) {
        const int16_t* x = xq->q + k * cols + b * BLOCK;
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)x)),
                                             _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 16))));
        acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w[k][b]), acc[k]);
    }
}

static AVX2 INLINE void rows_avx2_bits(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1,
                                       const int bits, const int ntok) {
    const int64_t cols = t->cols, blocks = cols / BLOCK, row_bytes = cols * bits / 8;
    const int planes = bits < 8 && t->layout == LAYOUT_PLANES;
    const int64_t nbp = planes ? planes_blocks(cols, bits) : 0; /* blocks in planes; the rest is a stream */
    const int unit = 8 / (bits & -bits);
    const uint8_t* end = t->codes + t->rows * row_bytes;
    const unpack16 u = unpack16_for(bits);
    float w[MAX_TOK][MAX_BLOCKS];
    float s[MAX_BLOCKS], z[MAX_BLOCKS], zterm[MAX_TOK];
    uint8_t padded[MAX_BLOCKS * 32 + 32]; /* a row whose last loads would read past the codes: copied here */
    const int64_t ahead = prefetch_ahead(row_bytes);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* row = t->codes + r * row_bytes;
        prefetch_row(t, r + ahead, row_bytes, cols / t->group);
        if (bits < 8 && row + row_bytes + 16 > end) { /* codes16 reads up to 16 bytes past its codes' start + bits */
            memcpy(padded, row, (size_t)row_bytes);
            memset(padded + row_bytes, 0, 32);
            row = padded;
        }
        row_terms_avx2(t, xq, r, ntok, s, z, w, zterm);
        __m256 even[MAX_TOK], odd[MAX_TOK]; /* even and odd blocks: their FMAs do not wait on each other */
        for (int k = 0; k < ntok; k++) even[k] = odd[k] = _mm256_setzero_ps();
        int64_t b = 0;
        if (bits == 8) { /* bytes are the codes; vpermq puts them in perm32 order. Two blocks a step: which
                            accumulator a block adds to must be known at compile time to keep them in registers. */
#define BYTES(B) _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)(row + (B) * 32)), 0xd8)
            for (; b + 2 <= blocks; b += 2) {
                block_bytes_dot(BYTES(b), xq, cols, b, w, even, ntok);
                block_bytes_dot(BYTES(b + 1), xq, cols, b + 1, w, odd, ntok);
            }
            if (b < blocks) block_bytes_dot(BYTES(b), xq, cols, b, w, even, ntok), b++;
#undef BYTES
        }
        for (; b < nbp; b += unit) { /* a unit's blocks spelled out: every shift and offset a constant */
#define BLOCK_OF_UNIT(K) \
    if (K < unit) block_bytes_dot(planes_block(row, nbp, b, K, bits), xq, cols, b + K, w, K & 1 ? odd : even, ntok);
            BLOCK_OF_UNIT(0) BLOCK_OF_UNIT(1) BLOCK_OF_UNIT(2) BLOCK_OF_UNIT(3)
            BLOCK_OF_UNIT(4) BLOCK_OF_UNIT(5) BLOCK_OF_UNIT(6) BLOCK_OF_UNIT(7)
#undef BLOCK_OF_UNIT
        }
        const uint8_t* stream = row + nbp * 4 * bits; /* the stream's blocks: from nbp on */
        for (; b < blocks; b++) {
            const int64_t c = (b - nbp) * BLOCK;
            const __m256i q0 = codes16(&u, stream + c / 8 * bits, bits);
            const __m256i q1 = codes16(&u, stream + (c + 16) / 8 * bits, bits);
            for (int k = 0; k < ntok; k++) {
                const int16_t* x = xq->q + k * cols + b * BLOCK;
                const __m256i dot = _mm256_add_epi32(
                    _mm256_madd_epi16(q0, _mm256_loadu_si256((const __m256i*)x)),
                    _mm256_madd_epi16(q1, _mm256_loadu_si256((const __m256i*)(x + 16))));
                even[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w[k][b]), even[k]);
            }
        }
        for (int k = 0; k < ntok; k++) t->y[k * t->y_stride + r] = hsum256(_mm256_add_ps(even[k], odd[k])) - zterm[k];
    }
}

static AVX2 void rows8_maddubs(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1);

static AVX2 void rows_avx2(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1) {
    if (is_rows8(t->layout)) { /* whole groups of 8 rows with int8 blocks: rows8_maddubs; else the portable loop */
        (!(r0 % 8) && !(r1 % 8) ? rows8_maddubs : rows_scalar)(t, xq, r0, r1);
        return;
    }
#define CASE(B)                                                                              \
    case B:                                                                                  \
        switch (t->ntok) {                                                                   \
            case 1: rows_avx2_bits(t, xq, r0, r1, B, 1); return;                             \
            case 2: rows_avx2_bits(t, xq, r0, r1, B, 2); return;                             \
            case 3: rows_avx2_bits(t, xq, r0, r1, B, 3); return;                             \
            default: rows_avx2_bits(t, xq, r0, r1, B, 4); return;                            \
        }
    switch (t->bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* ------------------------------------------------------------------------------------------ AVX-512 path */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,fma,f16c,bmi2")))

/* n float16 values as float32, 16 at a time. */
static AVX512 INLINE void halves_avx512(const uint16_t* h, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + i)));
    }
}

typedef struct {
    __m512i index, shift, mask;
    __mmask64 load;
} unpack64;

/* 64 codes per step: one masked load of 8*bits bytes, vpermb moves the bytes of codes 8k..8k+7 into 64-bit lane k,
   vpmultishiftqb cuts one code into each byte, a mask clears the bits above the code. perm32: each 32 codes' lanes
   in perm32 order instead (codes 0-7, 16-23, 8-15, 24-31: the bytes of the planes and rows8 layouts). */
static AVX512 INLINE unpack64 unpack64_for(int bits, int perm32) {
    uint8_t index[64], shift[64];
    for (int k = 0; k < 8; k++) {
        const int lane = perm32 ? (k & 4) | (k & 1) << 1 | (k & 2) >> 1 : k;
        for (int j = 0; j < 8; j++) {
            index[8 * k + j] = (uint8_t)(lane * bits + (j < bits ? j : 0));
            shift[8 * k + j] = (uint8_t)(j * bits);
        }
    }
    unpack64 u;
    u.index = _mm512_loadu_si512(index);
    u.shift = _mm512_loadu_si512(shift);
    u.mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    u.load = bits == 8 ? ~0ULL : ((1ULL << (8 * bits)) - 1);
    return u;
}

static AVX512 INLINE __m512i codes64(const unpack64* u, const uint8_t* p, const int bits) {
    if (bits == 8) return _mm512_loadu_si512(p);
    const __m512i raw = _mm512_maskz_loadu_epi8(u->load, p);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(u->shift, _mm512_permutexvar_epi8(u->index, raw)), u->mask);
}

/* transpose8 on two blocks at once: block b in the low 256 bits of every register, b + 1 in the high (the unpacks
   work within 128-bit lanes; vpermt2q takes the place of vperm2i128 in each half). */
static AVX512 INLINE void transpose8_avx512(__m512i v[8]) {
    __m512i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int i = 0; i < 4; i++) {
        const __m512i first = b[i], second = b[i + 4];
        v[i] = _mm512_permutex2var_epi64(first, low, second);
        v[i + 4] = _mm512_permutex2var_epi64(first, high, second);
    }
}

/* to_rows8_avx2 two blocks at a time (an odd last block by rows8_block_avx2): each row's 64 codes of blocks b and
   b + 1 cut into bytes by codes64 in perm32 order (a third of the AVX2 unpacking's instructions), then the transpose
   and the planes on 512-bit registers, whose halves are the two blocks. The same bytes as to_rows8_avx2. */
static AVX512 INLINE void to_rows8_avx512_bits(const uint8_t* src, uint8_t* dst, int64_t cols, const int bits) {
    const int64_t row_bytes = cols * bits / 8, blocks = cols / BLOCK;
    const unpack64 u = unpack64_for(bits, 1);
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        __m512i t[8];
        for (int r = 0; r < 8; r++) t[r] = codes64(&u, src + r * row_bytes + b * 4 * bits, bits);
        transpose8_avx512(t);
        uint8_t* block = dst + b * 32 * bits;
        int off = 0;
        for (int w = 4; w >= 1; w >>= 1) {
            if (!(bits & w)) continue;
            const int per = 8 / w;
            for (int m = 0; m < w; m++) {
                __m512i reg = _mm512_setzero_si512();
                for (int f = 0; f < per; f++) {
                    const __m512i v = _mm512_and_si512(_mm512_srli_epi16(t[m * per + f], off),
                                                       _mm512_set1_epi8((char)((1 << w) - 1)));
                    reg = _mm512_or_si512(reg, _mm512_sll_epi16(v, _mm_cvtsi32_si128(w * f)));
                }
                _mm256_storeu_si256((__m256i*)(block + rows8_register(bits, w, m)), _mm512_castsi512_si256(reg));
                _mm256_storeu_si256((__m256i*)(block + 32 * bits + rows8_register(bits, w, m)),
                                    _mm512_extracti64x4_epi64(reg, 1));
            }
            off += w;
        }
    }
    if (b < blocks) {
        const unpack16 u = unpack16_for(bits);
        rows8_block_avx2(src, dst, cols, b, &u, bits);
    }
}

static AVX512 void to_rows8_avx512(const uint8_t* src, uint8_t* dst, int64_t cols, int bits) {
#define CASE(B) case B: to_rows8_avx512_bits(src, dst, cols, B); return;
    switch (bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) }
#undef CASE
}

/* row_terms on 16 blocks at a time: float16 scale/zero of the row expanded to one value per block, w_b = scale *
   dx_b, zero term = sum_b w_b * zero_b * sum_b. */
static AVX512 INLINE void row_terms_avx512(const hexq_gemv_task* t, const quantized_x* xq, int64_t r, int ntok,
                                           float* sb, float* zb, float w[][MAX_BLOCKS], float* zterm) {
    const int64_t cols = t->cols, groups = cols / t->group, blocks = cols / BLOCK, per_group = t->group / BLOCK;
    if (per_group == 1) {
        halves_avx512(t->scale + r * groups, sb, groups);
        halves_avx512(t->zero + r * groups, zb, groups);
    } else {
        float sg[MAX_BLOCKS], zg[MAX_BLOCKS];
        halves_avx512(t->scale + r * groups, sg, groups);
        halves_avx512(t->zero + r * groups, zg, groups);
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < per_group; j++) {
                sb[g * per_group + j] = sg[g];
                zb[g * per_group + j] = zg[g];
            }
    }
    for (int k = 0; k < ntok; k++) {
        const float* dx = xq->dx + k * blocks;
        const int32_t* sum = xq->sum + k * blocks;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b += 16) {
            const __mmask16 m = blocks - b >= 16 ? 0xffff : (__mmask16)((1u << (blocks - b)) - 1);
            const __m512 wb = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sb + b), _mm512_maskz_loadu_ps(m, dx + b));
            _mm512_mask_storeu_ps(w[k] + b, m, wb);
            const __m512 zs = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, zb + b),
                                            _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, sum + b)));
            acc = _mm512_fmadd_ps(wb, zs, acc);
        }
        zterm[k] = _mm512_reduce_add_ps(acc);
    }
}

/* 64 codes at a time: two blocks of 32, each widened to int16 and multiplied into int32 pairs with one vpdpwssd per
   token (AVX-512 VNNI), then scaled by that block's w_b into a float32 accumulator. */
static AVX512 INLINE void rows_avx512_bits(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1,
                                           const int bits, const int ntok) {
    const int64_t cols = t->cols, groups = cols / t->group, row_bytes = cols * bits / 8;
    const unpack64 u = unpack64_for(bits, 0);
    float w[MAX_TOK][MAX_BLOCKS];
    float s[MAX_BLOCKS], z[MAX_BLOCKS], zterm[MAX_TOK];
    const int64_t ahead = prefetch_ahead(row_bytes);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* row = t->codes + r * row_bytes;
        prefetch_row(t, r + ahead, row_bytes, groups);
        row_terms_avx512(t, xq, r, ntok, s, z, w, zterm);
        __m512 total[MAX_TOK], odd[MAX_TOK]; /* even and odd blocks: their FMAs do not wait on each other */
        for (int k = 0; k < ntok; k++) total[k] = odd[k] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 64 <= cols; c += 64) {
            const __m512i q = codes64(&u, row + c / 8 * bits, bits);
            const __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q));
            const __m512i hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1));
            for (int k = 0; k < ntok; k++) {
                const int16_t* x = xq->q + k * cols + c;
                const __m512i d0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
                const __m512i d1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 32));
                total[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(w[k][c / 32]), total[k]);
                odd[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(w[k][c / 32 + 1]), odd[k]);
            }
        }
        if (c < cols) { /* a last block of 32 codes: a load of its 4*bits bytes only (never past the stream) */
            const unpack64 half = {u.index, u.shift, u.mask, bits == 8 ? 0xffffffffULL : (1ULL << (4 * bits)) - 1};
            const __m512i raw = _mm512_maskz_loadu_epi8(half.load, row + c / 8 * bits);
            const __m512i q = bits == 8 ? raw : _mm512_and_si512(
                _mm512_multishift_epi64_epi8(half.shift, _mm512_permutexvar_epi8(half.index, raw)), half.mask);
            const __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q));
            for (int k = 0; k < ntok; k++) {
                const __m512i d0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo,
                                                       _mm512_loadu_si512(xq->q + k * cols + c));
                total[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(w[k][c / 32]), total[k]);
            }
        }
        for (int k = 0; k < ntok; k++)
            t->y[k * t->y_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(total[k], odd[k])) - zterm[k];
    }
}

/* The planes layout on AVX-512 VNNI: a block's 32 code bytes (planes_block) times x's int16 block split into its two
   bytes, x = 256 hi + lo (hi signed, lo unsigned; quantize_x lays both out in the planes' byte order). vpdpbusd
   multiplies unsigned bytes by signed ones, so q . x = 256 (q . hi) + (lo . q), the second with the codes as the
   signed operand (a code of at most 7 bits is a non-negative int8): the same integers as the int16 product, without
   widening the codes to int16 (3 integer ops per block where the AVX2 path spends 5). Per lane |q . x| <= 4 * 127 *
   32767 < 2^24, so its conversion to float is exact too: the result differs from the other paths' only in the order
   of the float sums. 256-bit registers: on CPUs that split 512-bit ops in two (Zen 4) they do the same work per
   instruction pair, and a block is one register. */
static AVX512 INLINE void block_vnni(__m256i q, const quantized_x* xq, int64_t cols, int64_t b,
                                    float w[][MAX_BLOCKS], __m256* acc, const int ntok) {
    for (int k = 0; k < ntok; k++) {
        const __m256i hi = _mm256_loadu_si256((const __m256i*)(xq->hi + k * cols + b * BLOCK));
        const __m256i lo = _mm256_loadu_si256((const __m256i*)(xq->lo + k * cols + b * BLOCK));
        const __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, hi);
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), lo, q);
        acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w[k][b]), acc[k]);
    }
}

/* Rows whose blocks are all in the planes (planes_blocks(cols, bits) == cols / BLOCK; rows_avx512 checks). */
static AVX512 INLINE void rows_avx512_planes_bits(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0,
                                                  int64_t r1, const int bits, const int ntok) {
    const int64_t cols = t->cols, blocks = cols / BLOCK, row_bytes = cols * bits / 8;
    const int unit = 8 / (bits & -bits);
    float w[MAX_TOK][MAX_BLOCKS];
    float s[MAX_BLOCKS], z[MAX_BLOCKS], zterm[MAX_TOK];
    const int64_t groups = cols / t->group, ahead = prefetch_ahead(row_bytes);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* row = t->codes + r * row_bytes;
        prefetch_row(t, r + ahead, row_bytes, groups);
        row_terms_avx512(t, xq, r, ntok, s, z, w, zterm);
        __m256 even[MAX_TOK], odd[MAX_TOK]; /* even and odd blocks: their FMAs do not wait on each other */
        for (int k = 0; k < ntok; k++) even[k] = odd[k] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b += unit) { /* a unit's blocks spelled out: every shift a constant */
#define BLOCK_OF_UNIT(K) \
    if (K < unit) block_vnni(planes_block(row, blocks, b, K, bits), xq, cols, b + K, w, K & 1 ? odd : even, ntok);
            BLOCK_OF_UNIT(0) BLOCK_OF_UNIT(1) BLOCK_OF_UNIT(2) BLOCK_OF_UNIT(3)
            BLOCK_OF_UNIT(4) BLOCK_OF_UNIT(5) BLOCK_OF_UNIT(6) BLOCK_OF_UNIT(7)
#undef BLOCK_OF_UNIT
        }
        for (int k = 0; k < ntok; k++) t->y[k * t->y_stride + r] = hsum256(_mm256_add_ps(even[k], odd[k])) - zterm[k];
    }
}

/* Dword d of block b of a group of 8 rows in the rows8 layout: lane r holds row r's codes at perm32 positions
   4d .. 4d + 3 of that block as bytes (one shift and mask per plane). */
static AVX2 INLINE __m256i rows8_dword(const uint8_t* group8, int64_t b, const int d, const int bits) {
    const uint8_t* block = group8 + b * 32 * bits;
    __m256i q = _mm256_setzero_si256();
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        const __m256i v = _mm256_loadu_si256((const __m256i*)(block + rows8_register(bits, w, d / per)));
        q = _mm256_or_si256(q, plane_bits(v, w, d % per, off));
        off += w;
    }
    return q;
}

/* Block b of a group of 8 rows in the rows8 layout back in each row's own order: t[r] = row r's 32 codes as bytes in
   perm32 order (the 8 dword registers, transposed). */
static AVX2 INLINE void rows8_block_codes(const uint8_t* group8, int64_t b, const int bits, __m256i t[8]) {
    for (int d = 0; d < 8; d++) t[d] = rows8_dword(group8, b, d, bits);
    transpose8(t);
}

/* vpdpbusd on plain AVX2, for the AVX2 path's rows8 GEMV (rows8_maddubs, below): unsigned codes times signed int8
   x, byte pairs summed into int16 by vpmaddubsw and into int32 by vpmaddwd, llama.cpp's AVX2 dot product. Exact for
   the rows8 layouts' codes of at most 7 bits: a pair is at most 2 * 127 * 127 < 2^15, so vpmaddubsw never saturates
   and the dwords are vpdpbusd's. */
static AVX2 INLINE __m256i dpbusd_avx2(__m256i acc, __m256i codes, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}

/* The rows8 GEMV: vnni256.h, here with EVEX vpdpbusd (rows8_avx512), with VEX vpdpbusd (rows8_avxvnni) and with
   dpbusd_avx2 (rows8_maddubs: CPUs with AVX2 and neither VNNI, e.g. AMD Zen 2 and 3). */
#define VNNI256 AVX2
#define DPBUSD dpbusd_avx2
#define VNNI256_NAME(f) f##_maddubs
#include "vnni256.h"
#undef VNNI256
#undef DPBUSD
#undef VNNI256_NAME
#define VNNI256 AVX512
#define DPBUSD _mm256_dpbusd_epi32
#define VNNI256_NAME(f) f##_avx512
#include "vnni256.h"
#undef VNNI256
#undef DPBUSD
#undef VNNI256_NAME
#ifdef HEXQ_AVXVNNI_VEX
#define VNNI256 __attribute__((target("avx2,fma,f16c,bmi2,avxvnni")))
#define DPBUSD _mm256_dpbusd_avx_epi32
#define VNNI256_NAME(f) f##_avxvnni
#include "vnni256.h"
#undef VNNI256
#undef DPBUSD
#undef VNNI256_NAME
#endif

static AVX512 void rows_avx512(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1) {
    const int planes = t->layout == LAYOUT_PLANES && t->bits < 8, rows8 = is_rows8(t->layout);
    if ((planes && planes_blocks(t->cols, t->bits) != t->cols / BLOCK)  /* a stream tail: AVX2's code reads both */
        || (rows8 && (r0 % 8 || r1 % 8))) {  /* never from the pool's items (multiples of 8 rows); still correct */
        (rows8 ? rows_scalar : rows_avx2)(t, xq, r0, r1);
        return;
    }
#define CASE(B)                                                                              \
    case B:                                                                                  \
        switch (t->ntok) {                                                                   \
            case 1: ROWS(t, xq, r0, r1, B, 1); return;                                       \
            case 2: ROWS(t, xq, r0, r1, B, 2); return;                                       \
            case 3: ROWS(t, xq, r0, r1, B, 3); return;                                       \
            default: ROWS(t, xq, r0, r1, B, 4); return;                                      \
        }
    if (rows8) {
        rows8_avx512(t, xq, r0, r1);
        return;
    }
    if (planes) {
#define ROWS rows_avx512_planes_bits
        switch (t->bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) }
#undef ROWS
    }
#define ROWS rows_avx512_bits
    switch (t->bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef ROWS
#undef CASE
}

/* ------------------------------------------------------------------------------------------ AVX-VNNI path */

/* The AVX2 path with the rows8 layout's GEMV on 256-bit vpdpbusd: for CPUs with AVX-VNNI and no AVX-512 (whose AVX2
   path would emulate vpdpbusd with two instructions, rows8_maddubs). The VEX copy (rows8_avxvnni) runs where the CPU has AVX-VNNI; elsewhere the
   path is offered where AVX512-VNNI and VL give the same instruction in its EVEX encoding (rows8_avx512), so that
   every machine with either runs this path's code and its tests. The two copies are one source (vnni256.h). */
static AVX2 void rows_avxvnni(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1) {
    if (is_rows8(t->layout) && !(r0 % 8) && !(r1 % 8)) {
#ifdef HEXQ_AVXVNNI_VEX
        if (cpu_has_avxvnni()) {
            rows8_avxvnni(t, xq, r0, r1);
            return;
        }
#endif
        rows8_avx512(t, xq, r0, r1);
        return;
    }
    rows_avx2(t, xq, r0, r1);
}
#endif

/* The encoding of the AVX-VNNI path's vpdpbusd on this CPU: 1 VEX, 2 EVEX, 0 the path is not offered. */
int hexq_avxvnni_encoding(void) {
    if (!(hexq_paths() >> PATH_AVXVNNI & 1)) return 0;
#ifdef HEXQ_X86
    return cpu_has_avxvnni() ? 1 : 2;
#else
    return 0;
#endif
}

HIDDEN rows_fn rows_for(int path) {
#ifdef HEXQ_X86
    if (path == PATH_AVX512) return rows_avx512;
    if (path == PATH_AVXVNNI) return rows_avxvnni;
    if (path == PATH_AVX2) return rows_avx2;
#endif
    return rows_scalar;
}

/* Row src of the job's source from the stream into planes at dst, or back; padded: room for a row and 64 bytes,
   where a row is copied first when the job is in place (the loads past a row's end would read bytes another thread
   rewrites) or its loads would read past the codes. */
static void relayout_one(const relayout_job* j, const uint8_t* src, uint8_t* dst, int to_planes, uint8_t* padded) {
    const int64_t row_bytes = j->cols * j->bits / 8;
    if (j->src == j->dst || src + row_bytes + 32 > j->src + j->rows * row_bytes) {
        memcpy(padded, src, (size_t)row_bytes);
        memset(padded + row_bytes, 0, 64);
        src = padded;
    }
#ifdef HEXQ_X86
    if (to_planes && j->path != PATH_SCALAR) {
        to_planes_avx2(src, dst, j->cols, j->bits);
        return;
    }
#endif
    relayout_row(src, dst, j->cols, j->bits, to_planes);
}

/* Code i of row r (0-7) ORed into the group of 8 rows at group8 in the rows8 layout (code_rows8's inverse). */
static inline void put_rows8(uint8_t* group8, int r, int bits, int64_t i, uint32_t code) {
    uint8_t* block = group8 + i / BLOCK * 32 * bits;
    const int p = perm32((int)(i % BLOCK)), d = p >> 2;
    int off = 0;
    for (int w = 4; w >= 1; w >>= 1) {
        if (!(bits & w)) continue;
        const int per = 8 / w;
        block[rows8_register(bits, w, d / per) + 4 * r + (p & 3)] |=
            (uint8_t)(((code >> off) & ((1u << w) - 1)) << (w * (d % per)));
        off += w;
    }
}

/* out[g * 8 + r] = in[r * groups + g]: 8 rows' scales (or zeros) interleaved one value at a time; with `vector`, 8
   groups at a time by an 8 x 8 transpose of 16-bit values (SSE2: three rounds of unpacks). */
static void interleave8(const uint16_t* in, uint16_t* out, int64_t groups, int vector) {
    int64_t g = 0;
#ifdef HEXQ_X86
    for (; vector && g + 8 <= groups; g += 8) {
        __m128i v[8], a[8], b[8];
        for (int r = 0; r < 8; r++) v[r] = _mm_loadu_si128((const __m128i*)(in + r * groups + g));
        for (int r = 0; r < 8; r += 2) { /* rows r, r + 1: groups 0-3, then 4-7, a value of each row in turn */
            a[r] = _mm_unpacklo_epi16(v[r], v[r + 1]);
            a[r + 1] = _mm_unpackhi_epi16(v[r], v[r + 1]);
        }
        for (int r = 0; r < 8; r += 4) { /* rows r .. r + 3: groups (0, 1), (2, 3), (4, 5), (6, 7) */
            b[r] = _mm_unpacklo_epi32(a[r], a[r + 2]);
            b[r + 1] = _mm_unpackhi_epi32(a[r], a[r + 2]);
            b[r + 2] = _mm_unpacklo_epi32(a[r + 1], a[r + 3]);
            b[r + 3] = _mm_unpackhi_epi32(a[r + 1], a[r + 3]);
        }
        for (int k = 0; k < 4; k++) { /* groups 2k and 2k + 1, rows 0-3 then 4-7 */
            _mm_storeu_si128((__m128i*)(out + (g + 2 * k) * 8), _mm_unpacklo_epi64(b[k], b[k + 4]));
            _mm_storeu_si128((__m128i*)(out + (g + 2 * k + 1) * 8), _mm_unpackhi_epi64(b[k], b[k + 4]));
        }
    }
#endif
    (void)vector;
    for (; g < groups; g++)
        for (int r = 0; r < 8; r++) out[g * 8 + r] = in[r * groups + g];
}

/* Rows 8G .. 8G + 7 from the stream into rows8 (forward) or back. `eight`: room for 8 row_bytes + 64, where the
   group's bytes are copied first (so in place is safe, and no load reads past the codes); scales and zeros through
   `grid` (8 groups values). */
static void relayout_rows8(const relayout_job* j, int64_t G, uint8_t* eight, uint16_t* grid) {
    const int64_t row_bytes = j->cols * j->bits / 8, groups = j->groups, bytes = 8 * row_bytes;
    uint8_t* dst = j->dst + G * bytes;
    memcpy(eight, j->src + G * bytes, (size_t)bytes);
    memset(eight + bytes, 0, 64);
#ifdef HEXQ_X86
    if (j->forward && j->path == PATH_AVX512) to_rows8_avx512(eight, dst, j->cols, j->bits);
    else if (j->forward && j->path != PATH_SCALAR) to_rows8_avx2(eight, dst, j->cols, j->bits);
    else
#endif
    {
        memset(dst, 0, (size_t)bytes); /* the portable loops OR the fields in */
        for (int r = 0; r < 8; r++)
            for (int64_t i = 0; i < j->cols; i++) {
                if (j->forward) {
                    put_rows8(dst, r, j->bits, i, code_at(eight + r * row_bytes, i, j->bits));
                    continue;
                }
                const uint32_t code = code_rows8(eight, r, j->bits, i);
                const int64_t bit = i * j->bits;
                uint8_t* row = dst + r * row_bytes;
                row[bit >> 3] |= (uint8_t)(code << (bit & 7));
                if ((bit & 7) + j->bits > 8) row[(bit >> 3) + 1] |= (uint8_t)(code >> (8 - (bit & 7)));
            }
    }
    for (int a = 0; a < 2; a++) {
        if (a == 1 && j->layout == LAYOUT_ROWS8_Z4) { /* packed aside (forward), or already back (zeros4_back) */
            if (j->forward) zeros4_pack(j->src_grid[1] + 8 * G * groups, j->zeros4 + 4 * G * groups, groups, j->path);
            break;
        }
        memcpy(grid, j->src_grid[a] + 8 * G * groups, (size_t)(8 * groups) * 2);
        uint16_t* out = j->dst_grid[a] + 8 * G * groups;
        if (j->forward) {
            interleave8(grid, out, groups, j->path != PATH_SCALAR);
            continue;
        }
        for (int r = 0; r < 8; r++)
            for (int64_t g = 0; g < groups; g++) out[r * groups + g] = grid[g * 8 + r];
    }
}

static void relayout_item(void* arg, int64_t item) {
    const relayout_job* j = (const relayout_job*)arg;
    const int64_t row_bytes = j->cols * j->bits / 8, r0 = item * RELAYOUT_ROWS;
    const int64_t r1 = r0 + RELAYOUT_ROWS < j->rows ? r0 + RELAYOUT_ROWS : j->rows;
    if (is_rows8(j->layout)) { /* at most `threads` items at once: one of the job's buffers is idle */
        relayout_job* shared = (relayout_job*)arg;
        uint64_t idle = atomic_load(&shared->idle);
        while (!idle || !atomic_compare_exchange_weak(&shared->idle, &idle, idle & (idle - 1)))
            if (!idle) idle = atomic_load(&shared->idle);
        const int slot = __builtin_ctzll(idle); /* (a pool with more workers than `threads`: the extra wait here) */
        uint16_t grid[8 * MAX_BLOCKS];
        for (int64_t G = r0 / 8; G < r1 / 8; G++) relayout_rows8(j, G, j->eights + slot * (8 * row_bytes + 64), grid);
        atomic_fetch_or(&shared->idle, 1ULL << slot);
        return;
    }
    uint8_t padded[MAX_BLOCKS * 32 + 64];
    for (int64_t r = r0; r < r1; r++)
        relayout_one(j, j->src + r * row_bytes, j->dst + r * row_bytes, j->forward, padded);
}

/* ------------------------------------------------------------------------------------------ dequantization */

/* out[i] for i < numel from the packed stream: out_kind 0 float32 (q - z) * s; 1 bfloat16 and 2 float16 of
   q*s + (-z*s), computed in float32 and rounded once (with float16 scale and zero both products are exact, so this
   is (q - z) * s rounded: the torch path's value, hexq.packed.bitpack.dequantize_into). scale/zero: float16, one per
   `group` consecutive codes. Bit for bit equal across paths. */

static inline uint16_t float_to_bf16(float v) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void dequant_scalar(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                           int64_t numel, int64_t group, void* out, int out_kind) {
    for (int64_t g = 0; g < numel / group; g++) {
        const float s = half_to_float(scale[g]), z = half_to_float(zero[g]), b = -(z * s);
        for (int64_t i = g * group; i < (g + 1) * group; i++) {
            const float q = (float)code_at(packed, i, bits);
            if (out_kind == 0) ((float*)out)[i] = (q - z) * s;
            else if (out_kind == 1) ((uint16_t*)out)[i] = float_to_bf16(q * s + b);
            else ((uint16_t*)out)[i] = float_to_half(q * s + b);
        }
    }
}

/* The planes layout, any path: each row's codes read with code_planes (rows of `cols` codes). */
static void dequant_planes_scalar(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                  int64_t numel, int64_t group, int64_t cols, void* out, int out_kind) {
    const int64_t row_bytes = cols * bits / 8;
    for (int64_t i = 0; i < numel; i++) {
        const int64_t r = i / cols, g = i / group;
        const float s = half_to_float(scale[g]), z = half_to_float(zero[g]), b = -(z * s);
        const float q = (float)code_planes(packed + r * row_bytes, cols, bits, i % cols);
        if (out_kind == 0) ((float*)out)[i] = (q - z) * s;
        else if (out_kind == 1) ((uint16_t*)out)[i] = float_to_bf16(q * s + b);
        else ((uint16_t*)out)[i] = float_to_half(q * s + b);
    }
}

#ifdef HEXQ_X86
/* AVX2: 8 codes per pdep, 8 outputs per step. */
static AVX2 INLINE __m128i bf16_avx2(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                     _mm256_set1_epi32(1)));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 8 codes as float32 (q), dequantized and stored at out + i. */
static AVX2 INLINE void dequant8_avx2(__m256 q, __m256 s, __m256 z, __m256 b, void* out, int64_t i, int out_kind) {
    if (out_kind == 0) {
        _mm256_storeu_ps((float*)out + i, _mm256_mul_ps(_mm256_sub_ps(q, z), s));
    } else {
        const __m256 v = _mm256_fmadd_ps(q, s, b);
        const __m128i h = out_kind == 1 ? bf16_avx2(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i*)((uint16_t*)out + i), h);
    }
}

static AVX2 INLINE void dequant_avx2_bits(const uint8_t* packed, const int bits, const uint16_t* scale,
                                          const uint16_t* zero, int64_t numel, int64_t group, void* out,
                                          int out_kind) {
    const uint8_t* end = packed + numel * bits / 8;
    for (int64_t g = 0; g < numel / group; g++) {
        const float sf = _cvtsh_ss(scale[g]), zf = _cvtsh_ss(zero[g]);
        const __m256 s = _mm256_set1_ps(sf), z = _mm256_set1_ps(zf), b = _mm256_set1_ps(-(zf * sf));
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
            const uint64_t codes = eight_codes(packed + i / 8 * bits, end, bits);
            dequant8_avx2(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)codes))), s, z, b,
                          out, i, out_kind);
        }
    }
}

/* One block's 32 codes (bytes in perm32 order: unpacked within 128-bit lanes they come out in order) dequantized
   with scale s and zero z into out at element i. */
static AVX2 INLINE void dequant_block_avx2(__m256i q, float sf, float zf, void* out, int64_t i, int out_kind) {
    const __m256 s = _mm256_set1_ps(sf), z = _mm256_set1_ps(zf), b = _mm256_set1_ps(-(zf * sf));
    const __m256i lo = _mm256_unpacklo_epi8(q, _mm256_setzero_si256());
    const __m256i hi = _mm256_unpackhi_epi8(q, _mm256_setzero_si256());
    const __m128i quarter[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int j = 0; j < 4; j++)
        dequant8_avx2(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(quarter[j])), s, z, b, out, i + 8 * j, out_kind);
}

/* The planes layout on AVX2: a block of 32 codes per step (planes_block, its shift counts known at run time here),
   the stream's blocks 8 codes per pdep. group: a multiple of 32. */
static AVX2 void dequant_planes_avx2(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                     int64_t numel, int64_t group, int64_t cols, void* out, int out_kind) {
    const int64_t row_bytes = cols * bits / 8, blocks = cols / BLOCK, nbp = planes_blocks(cols, bits);
    const int unit = 8 / (bits & -bits);
    for (int64_t r = 0; r < numel / cols; r++) {
        const uint8_t* row = packed + r * row_bytes;
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t i = r * cols + blk * BLOCK, g = i / group;
            const float sf = _cvtsh_ss(scale[g]), zf = _cvtsh_ss(zero[g]);
            const __m256 s = _mm256_set1_ps(sf), z = _mm256_set1_ps(zf), b = _mm256_set1_ps(-(zf * sf));
            if (blk >= nbp) {
                const uint8_t* stream = row + nbp * 4 * bits;
                for (int64_t c = (blk - nbp) * BLOCK, j = 0; j < BLOCK; j += 8, c += 8) {
                    const uint64_t codes = eight_codes(stream + c / 8 * bits, row + row_bytes, bits);
                    dequant8_avx2(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)codes))), s,
                                  z, b, out, i + j, out_kind);
                }
                continue;
            }
            dequant_block_avx2(planes_block(row, nbp, blk - blk % unit, (int)(blk % unit), bits), sf, zf, out, i,
                               out_kind);
        }
    }
}

static AVX2 void dequant_avx2(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                              int64_t numel, int64_t group, void* out, int out_kind) {
#define CASE(B) case B: dequant_avx2_bits(packed, B, scale, zero, numel, group, out, out_kind); return;
    switch (bits) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* AVX-512: 64 codes per step (unpack64); bfloat16 with bits <= 4 through a 16-entry table per group,
   T[q] = q*s + (-z*s) rounded to bfloat16 and looked up with vpermw, 32 codes per lookup. */
static AVX512 INLINE __m256i bf16_avx512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                     _mm512_set1_epi32(1)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16));
}

static AVX512 void dequant_avx512(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                    int64_t numel, int64_t group, void* out, int out_kind) {
    const unpack64 u = unpack64_for(bits, 0);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi16(16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const int table = bits <= 4 && out_kind == 1;
    const int64_t groups = numel / group;
    float s_of[256], b_of[256]; /* per group of the block: scale, and -z*s (float32 out: z) */
    for (int64_t g0 = 0; g0 < groups; g0 += 256) {
        const int64_t ng = groups - g0 < 256 ? groups - g0 : 256;
        for (int64_t j = 0; j < ng; j += 16) {
            const __mmask16 m = ng - j >= 16 ? 0xffff : (__mmask16)((1u << (ng - j)) - 1);
            const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scale + g0 + j));
            const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, zero + g0 + j));
            _mm512_storeu_ps(s_of + j, s);
            _mm512_storeu_ps(b_of + j, out_kind == 0 ? z : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, s)));
        }
        const int64_t end = (g0 + ng) * group;
        for (int64_t i = g0 * group; i < end; i += 64) {
            const __m512i codes = codes64(&u, packed + (i >> 3) * bits, bits);
            if (table) {
                for (int h = 0; h < 2; h++) {
                    const int64_t o = i + 32 * h, ga = o / group - g0, gb = (o + 16) / group - g0;
                    const __m256i ta = bf16_avx512(_mm512_fmadd_ps(iota, _mm512_set1_ps(s_of[ga]),
                                                                   _mm512_set1_ps(b_of[ga])));
                    const __m256i tb = bf16_avx512(_mm512_fmadd_ps(iota, _mm512_set1_ps(s_of[gb]),
                                                                   _mm512_set1_ps(b_of[gb])));
                    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(ta), tb, 1);
                    const __m512i q = _mm512_add_epi16(
                        _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(codes, 1) : _mm512_castsi512_si256(codes)),
                        second);
                    _mm512_storeu_si512((uint16_t*)out + o, _mm512_permutexvar_epi16(q, t));
                }
                continue;
            }
            for (int k = 0; k < 4; k++) {
                const int64_t o = i + 16 * k, g = o / group - g0;
                const __m128i bytes = k == 0 ? _mm512_extracti32x4_epi32(codes, 0)
                                    : k == 1 ? _mm512_extracti32x4_epi32(codes, 1)
                                    : k == 2 ? _mm512_extracti32x4_epi32(codes, 2)
                                             : _mm512_extracti32x4_epi32(codes, 3);
                const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                const __m512 s = _mm512_set1_ps(s_of[g]);
                if (out_kind == 0) {
                    _mm512_storeu_ps((float*)out + o, _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(b_of[g])), s));
                } else {
                    const __m512 v = _mm512_fmadd_ps(q, s, _mm512_set1_ps(b_of[g]));
                    const __m256i r = out_kind == 1 ? bf16_avx512(v)
                                                    : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    _mm256_storeu_si256((__m256i*)((uint16_t*)out + o), r);
                }
            }
        }
    }
}
/* The rows8 layout into bfloat16 at widths 1-4 (what a prefill's expansion asks for): per block of a group of 8 rows,
   the 8 dword registers transposed back into each row's 32 codes, put back in natural order (perm32 swaps the middle
   quarters: one qword permute), widened to 16-bit indices into a table of the group's 16 values q s - z s, one
   vpermw for 32 outputs (dequant_avx512's table for the stream). Twice the speed of the AVX2 code per weight. */
static AVX512 void dequant_rows8_avx512(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                        int layout, int64_t rows, int64_t group, int64_t cols, void* out) {
    const int64_t row_bytes = cols * bits / 8, groups = cols / group;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
        for (int64_t blk = 0; blk < cols / BLOCK; blk++) {
            __m256i t[8];
            rows8_block_codes(packed + r0 * row_bytes, blk, bits, t);
            for (int r = 0; r < 8; r++) {
                const int64_t g = blk * BLOCK / group;
                const float sf = _cvtsh_ss(scale[grid_index(layout, r0 + r, g, groups)]);
                const float zf = zero_at(zero, layout, r0 + r, g, groups);
                const __m512i table = _mm512_castsi256_si512(
                    bf16_avx512(_mm512_fmadd_ps(iota, _mm512_set1_ps(sf), _mm512_set1_ps(-(zf * sf)))));
                const __m512i q = _mm512_cvtepu8_epi16(_mm256_permute4x64_epi64(t[r], 0xd8));
                _mm512_storeu_si512((uint16_t*)out + (r0 + r) * cols + blk * BLOCK, _mm512_permutexvar_epi16(q, table));
            }
        }
}
#endif

static void dequant_planes(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                           int64_t numel, int64_t group, int64_t cols, void* out, int out_kind, int path) {
#ifdef HEXQ_X86
    if (path != PATH_SCALAR) {
        dequant_planes_avx2(packed, bits, scale, zero, numel, group, cols, out, out_kind);
        return;
    }
#endif
    (void)path;
    dequant_planes_scalar(packed, bits, scale, zero, numel, group, cols, out, out_kind);
}

/* The rows8 layout: per block of a group of 8 rows, each row's 32 codes (rows8_block_codes) dequantized as a planes
   block is (dequant_block_avx2); the portable path reads each code with code_rows8. */
#ifdef HEXQ_X86
static AVX2 void dequant_rows8_avx2(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                    int layout, int64_t rows, int64_t group, int64_t cols, void* out, int out_kind) {
    const int64_t row_bytes = cols * bits / 8, groups = cols / group;
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
        for (int64_t blk = 0; blk < cols / BLOCK; blk++) {
            __m256i t[8];
            rows8_block_codes(packed + r0 * row_bytes, blk, bits, t);
            for (int r = 0; r < 8; r++) {
                const int64_t g = blk * BLOCK / group;
                dequant_block_avx2(t[r], _cvtsh_ss(scale[grid_index(layout, r0 + r, g, groups)]),
                                   zero_at(zero, layout, r0 + r, g, groups), out, (r0 + r) * cols + blk * BLOCK,
                                   out_kind);
            }
        }
}
#endif

static void dequant_rows8_scalar(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero,
                                 int layout, int64_t rows, int64_t group, int64_t cols, void* out, int out_kind) {
    const int64_t row_bytes = cols * bits / 8, groups = cols / group;
    for (int64_t i = 0; i < rows * cols; i++) {
        const int64_t r = i / cols, g = i % cols / group;
        const float s = half_to_float(scale[grid_index(layout, r, g, groups)]), z = zero_at(zero, layout, r, g, groups);
        const float b = -(z * s);
        const float q = (float)code_rows8(packed + (r & ~7) * row_bytes, (int)(r & 7), bits, i % cols);
        if (out_kind == 0) ((float*)out)[i] = (q - z) * s;
        else if (out_kind == 1) ((uint16_t*)out)[i] = float_to_bf16(q * s + b);
        else ((uint16_t*)out)[i] = float_to_half(q * s + b);
    }
}

/* hexq_dequant on one range of whole rows; run 0: only whether the path takes these inputs (0) or not (-1). */
static int dequant_part(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero, int64_t numel,
                        int64_t group, void* out, int out_kind, int path, int64_t cols, int layout, int run) {
    if (bits < 1 || bits > 8 || group <= 0 || numel % group || out_kind < 0 || out_kind > 2
        || !(hexq_paths() >> path & 1))
        return -1;
    if (layout == LAYOUT_PLANES || is_rows8(layout)) { /* every path takes them: they have no other reader */
        if (!takes_planes(cols, bits) || numel % cols || group % BLOCK || cols % group) return -1;
        if (is_rows8(layout) && !takes_rows8(numel / cols, cols, bits)) return -1;
        if (!run) return 0;
        const int64_t rows = numel / cols;
        if (layout == LAYOUT_PLANES) dequant_planes(packed, bits, scale, zero, numel, group, cols, out, out_kind, path);
#ifdef HEXQ_X86
        else if (path == PATH_AVX512 && bits <= 4 && out_kind == 1)
            dequant_rows8_avx512(packed, bits, scale, zero, layout, rows, group, cols, out);
        else if (path != PATH_SCALAR)
            dequant_rows8_avx2(packed, bits, scale, zero, layout, rows, group, cols, out, out_kind);
#endif
        else dequant_rows8_scalar(packed, bits, scale, zero, layout, rows, group, cols, out, out_kind);
        return 0;
    }
#ifdef HEXQ_X86
    if (path == PATH_AVX512) {
        if (group % 16 || numel % 64) return -1;
        if (run) dequant_avx512(packed, bits, scale, zero, numel, group, out, out_kind);
        return 0;
    }
    if (path == PATH_AVX2 || path == PATH_AVXVNNI) {
        if (group % 8) return -1;
        if (run) dequant_avx2(packed, bits, scale, zero, numel, group, out, out_kind);
        return 0;
    }
#endif
    if (run) dequant_scalar(packed, bits, scale, zero, numel, group, out, out_kind);
    return 0;
}

typedef struct {
    const uint8_t* packed;
    const uint16_t *scale, *zero;
    void* out;
    int64_t rows, cols, group;
    int bits, out_kind, path, layout;
} dequant_job;

#define DEQUANT_ROWS 64 /* rows per pool item: a multiple of 8 (whole groups of the rows8 layout) */

static void dequant_item(void* arg, int64_t item) {
    const dequant_job* j = (const dequant_job*)arg;
    const int64_t r0 = item * DEQUANT_ROWS, r1 = r0 + DEQUANT_ROWS < j->rows ? r0 + DEQUANT_ROWS : j->rows;
    const int64_t row_bytes = j->cols * j->bits / 8, groups = j->cols / j->group, size = j->out_kind == 0 ? 4 : 2;
    const uint16_t* zero = zero_rows(j->zero, j->layout, r0, groups);
    dequant_part(j->packed + r0 * row_bytes, j->bits, j->scale + r0 * groups, zero,
                 (r1 - r0) * j->cols, j->group, (char*)j->out + r0 * j->cols * size, j->out_kind, j->path, j->cols,
                 j->layout, 1);
}

/* out[i] for i < numel (rows of `cols` codes): the matrix the codes stand for, on `threads` threads (a block of
   DEQUANT_ROWS rows per pool item where rows are whole bytes and whole groups; else on the calling thread). Returns
   0, or -1 if the path does not take these inputs (nothing written; the caller then uses another path). layout:
   any of the LAYOUT_ values. Why threads: a prefill expands most experts of every layer (~0.66 ms
   each for a real-shaped 3-bit matrix on one core), which was half of a 128-token prompt's time on 2 cores. */
int hexq_dequant(const uint8_t* packed, int bits, const uint16_t* scale, const uint16_t* zero, int64_t numel,
                 int64_t group, void* out, int out_kind, int path, int64_t cols, int layout, int threads) {
    if (dequant_part(packed, bits, scale, zero, numel, group, out, out_kind, path, cols, layout, 0) != 0) return -1;
    const int rows_split = threads > 1 && cols > 0 && numel % cols == 0 && cols % 64 == 0 && cols * bits % 8 == 0
                           && cols % group == 0 && numel / cols > DEQUANT_ROWS;
    if (!rows_split) return dequant_part(packed, bits, scale, zero, numel, group, out, out_kind, path, cols, layout, 1);
    dequant_job job = {packed, scale, zero, out, numel / cols, cols, group, bits, out_kind, path, layout};
    parallel(dequant_item, &job, (job.rows + DEQUANT_ROWS - 1) / DEQUANT_ROWS, threads);
    return 0;
}

/* ------------------------------------------------------------------------------------------ the thread pool */

/* A persistent pool. A job is posted by bumping a generation counter; workers wait for it (a short spin, then a
   futex), and everyone - the calling thread too - claims items with a compare-and-swap on one ticket that holds
   (generation, next item), so a worker that wakes late for a job that is over claims nothing, and the caller never
   waits for a worker that has not started: it only waits for items that were claimed and not yet finished. Jobs
   alternate between two slots, so a late worker reading the previous job's slot is never handed a half-written job
   (its claim fails on the ticket's generation first). Calls from several threads are serialised.

   Items are claimed in runs (guided scheduling): a claim takes 1/(2 * threads) of the items left, at least one, so a
   job costs ~2 * threads * ln(items) claims instead of one per item, each thread reads long contiguous stretches of
   rows (what the hardware prefetchers follow), and the shrinking runs still even out the end of the job. Why: every
   claim moves the ticket's and the done counter's cache lines between cores; claimed one item (16 rows) at a time,
   a grouped GEMV of 8 experts from memory ran at 1.64 ms per layer on 2 threads of an AMD EPYC against 2.33 on one
   (benchmarks/gemv_speed.py), its second core nearly idle. The ticket and the done counters have their own cache
   lines, away from what workers spin on. */

#define MAX_THREADS 64
#define SPIN 256 /* pauses before a worker sleeps (~10-40 us): enough to catch a kernel call that follows at once, short enough not to take the core from torch's own threads between calls */

typedef struct {
    void (*run)(void* ctx, int64_t item);
    void* ctx;
    int64_t items;
    int threads;
} job;

static struct {
    pthread_mutex_t lock;
    _Atomic int generation;
    job jobs[2];
    int workers;
    _Atomic int hot;                                 /* pool_hot: workers spin instead of sleeping */
    _Alignas(64) _Atomic uint64_t ticket;            /* generation << 32 | next item */
    _Alignas(64) _Atomic int64_t done[2];            /* items finished, per job slot */
    char pad[64 - 2 * sizeof(int64_t)];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

HIDDEN void pool_hot(int hot) { atomic_store(&pool.hot, hot); }

static void futex_wait(_Atomic int* addr, int value) {
    syscall(SYS_futex, (int*)addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic int* addr) {
    syscall(SYS_futex, (int*)addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

static inline void relax(void) {
#ifdef HEXQ_X86
    _mm_pause();
#endif
}

/* Items a claim takes when `left` are left: 1/(2 * threads) of them, at least one (guided scheduling, see above). */
static inline int64_t claim_run(int64_t left, int threads) {
    const int64_t run = left / (2 * threads);
    return run > 1 ? run : 1;
}

/* Claim and run items of job `generation` until none is left (or the job is over). */
static void drain(int generation) {
    const job j = pool.jobs[generation & 1];
    const uint64_t tag = (uint64_t)(uint32_t)generation << 32;
    for (;;) {
        uint64_t ticket = atomic_load(&pool.ticket);
        const int64_t next = (int64_t)(ticket & 0xffffffffULL);
        if ((ticket & ~0xffffffffULL) != tag || next >= j.items) return;
        const int64_t run = claim_run(j.items - next, j.threads);
        if (!atomic_compare_exchange_weak(&pool.ticket, &ticket, ticket + (uint64_t)run)) continue;
        for (int64_t i = next; i < next + run; i++) j.run(j.ctx, i);
        atomic_fetch_add(&pool.done[generation & 1], run);
    }
}

static void* worker(void* arg) {
    int seen = (int)(intptr_t)arg; /* the generation when it was made: every later job is one to join */
    for (;;) {
        int spins = 0, now;
        while ((now = atomic_load(&pool.generation)) == seen) {
            if (++spins < SPIN || atomic_load(&pool.hot)) relax();
            else futex_wait(&pool.generation, seen);
        }
        seen = now;
        drain(now);
    }
    return NULL;
}

static void ensure_workers(int wanted) {
    if (wanted > MAX_THREADS - 1) wanted = MAX_THREADS - 1;
    while (pool.workers < wanted) { /* under pool.lock */
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&thread, &attr, worker, (void*)(intptr_t)atomic_load(&pool.generation)) != 0) break;
        pool.workers++;
    }
}

/* Run run(ctx, item) for every item in [0, items) on `threads` threads (the caller included). */
HIDDEN void parallel(void (*run)(void*, int64_t), void* ctx, int64_t items, int threads) {
    if (threads <= 1 || items <= 1) {
        for (int64_t i = 0; i < items; i++) run(ctx, i);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    ensure_workers(threads - 1);
    const int generation = atomic_load(&pool.generation) + 1;
    pool.jobs[generation & 1] = (job){run, ctx, items, threads};
    atomic_store(&pool.done[generation & 1], 0);
    atomic_store(&pool.ticket, (uint64_t)(uint32_t)generation << 32);
    atomic_store(&pool.generation, generation);
    futex_wake_all(&pool.generation);
    drain(generation);
    for (int spins = 0; atomic_load(&pool.done[generation & 1]) < items; spins++) {
        if (spins < SPIN) relax();
        else sched_yield(); /* a claimed item's worker was descheduled: give it the core */
    }
    pthread_mutex_unlock(&pool.lock);
}

/* ------------------------------------------------------------------------------------------ grouped GEMV */

#define ROWS_PER_ITEM 16

typedef struct {
    const hexq_gemv_task* tasks;
    quantized_x* xq;           /* per task; tasks sharing an x share its quantization */
    const int64_t* first_item; /* item index where each task starts, ntasks + 1 entries */
    int ntasks;
    rows_fn rows;
    int path;
} gemv_ctx;

static void quantize_item(void* arg, int64_t task) {
    const gemv_ctx* c = (const gemv_ctx*)arg;
    if (task == 0 || c->xq[task].q != c->xq[task - 1].q) quantize_x(&c->tasks[task], &c->xq[task], c->path);
}

static void gemv_item(void* arg, int64_t item) {
    const gemv_ctx* c = (const gemv_ctx*)arg;
    int lo = 0, hi = c->ntasks - 1;
    while (lo < hi) { /* the task holding this item */
        int mid = (lo + hi + 1) / 2;
        if (c->first_item[mid] <= item) lo = mid; else hi = mid - 1;
    }
    const hexq_gemv_task* t = &c->tasks[lo];
    const int64_t r0 = (item - c->first_item[lo]) * ROWS_PER_ITEM;
    const int64_t r1 = r0 + ROWS_PER_ITEM < t->rows ? r0 + ROWS_PER_ITEM : t->rows;
    const int64_t blocks = t->cols / BLOCK;
    hexq_gemv_task part = *t;
    for (int k = 0; k < t->ntok; k += MAX_TOK) { /* more than MAX_TOK tokens: in slices of MAX_TOK */
        part.ntok = t->ntok - k < MAX_TOK ? t->ntok - k : MAX_TOK;
        part.y = t->y + k * t->y_stride;
        const quantized_x* q = &c->xq[lo];
        const quantized_x slice = {q->q + k * t->cols, q->dx + k * blocks, q->sum + k * blocks,
                                   q->lo ? q->lo + k * t->cols : NULL, q->lo ? q->hi + k * t->cols : NULL,
                                   q->q8 ? q->q8 + k * t->cols : NULL, q->q8 ? q->dx8 + k * blocks : NULL,
                                   q->q8 ? q->zx8 + k * blocks : NULL};
        c->rows(&part, &slice, r0, r1);
    }
}

/* Every task's y on `threads` threads with instruction-set path `path`; scratch: int16 x and block terms, at least
   hexq_gemv_scratch(tasks, ntasks) bytes, 64-byte aligned. Returns 0, or -1 for a task the kernels do not take (a
   group that is not a multiple of 32 codes, more than MAX_BLOCKS blocks, a row not a whole number of bytes, an
   unavailable path). */
int64_t hexq_gemv_scratch(const hexq_gemv_task* tasks, int ntasks) {
    int64_t bytes = 0;
    for (int i = 0; i < ntasks; i++) {
        const int64_t values = (int64_t)tasks[i].ntok * tasks[i].cols;
        bytes += 2 * ((values * 2 + 63) / 64 * 64) + 2 * ((values / BLOCK * 4 + 63) / 64 * 64); /* int16, bytes */
        bytes += (values + 63) / 64 * 64 + 2 * ((values / BLOCK * 4 + 63) / 64 * 64);            /* int8 */
    }
    return bytes;
}

int hexq_gemv(const hexq_gemv_task* tasks, int ntasks, int path, int threads, uint8_t* scratch) {
    if (!(hexq_paths() >> path & 1) || ntasks <= 0) return -1;
    int64_t first[ntasks + 1];
    quantized_x xq[ntasks];
    first[0] = 0;
    for (int i = 0; i < ntasks; i++) {
        const hexq_gemv_task* t = &tasks[i];
        if (t->bits < 1 || t->bits > 8 || t->group <= 0 || t->group % BLOCK || t->cols % t->group
            || (t->cols * t->bits) % 8 || t->cols / BLOCK > MAX_BLOCKS || t->ntok < 1)
            return -1;
        first[i + 1] = first[i] + (t->rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
        const int64_t values = (int64_t)t->ntok * t->cols;
        if (i > 0 && t->x == tasks[i - 1].x && t->ntok == tasks[i - 1].ntok && t->cols == tasks[i - 1].cols) {
            xq[i] = xq[i - 1];
            continue;
        }
        xq[i].q = (int16_t*)scratch;
        scratch += (values * 2 + 63) / 64 * 64;
        xq[i].dx = (float*)scratch;
        scratch += (values / BLOCK * 4 + 63) / 64 * 64;
        xq[i].sum = (int32_t*)scratch;
        scratch += (values / BLOCK * 4 + 63) / 64 * 64;
        xq[i].lo = reads_bytes(path) ? scratch : NULL;
        xq[i].hi = (int8_t*)(scratch + values);
        scratch += (values * 2 + 63) / 64 * 64;
        xq[i].q8 = reads_int8(path) ? (int8_t*)scratch : NULL;
        scratch += (values + 63) / 64 * 64;
        xq[i].dx8 = (float*)scratch;
        scratch += (values / BLOCK * 4 + 63) / 64 * 64;
        xq[i].zx8 = (float*)scratch;
        scratch += (values / BLOCK * 4 + 63) / 64 * 64;
    }
    gemv_ctx ctx = {tasks, xq, first, ntasks, rows_for(path), path};
    parallel(quantize_item, &ctx, ntasks, threads);
    parallel(gemv_item, &ctx, first[ntasks], threads);
    return 0;
}
