/* hexq's native decode step: one token through every decoder layer of a GQA-attention + routed-experts model
   (qwen3_moe, qwen2_moe, olmoe, mixtral) in one call, with no Python and no torch op inside; see
   hexq/runtime/native.py for what it covers, how the model is described to it and why.

   The step is a sequence of phases; each phase that has rows to spread (the q/k/v products, the heads of the
   attention, o, the routed experts' gate_up, their down products, the head) runs on the persistent pool of
   kernels.c, whose workers spin between phases while a step runs (pool_hot) instead of sleeping. What is between
   phases (norms, RoPE, the router's softmax and top-k, the weighted sum) is a few thousand flops on one thread.

   Activations stay in float32 from the embedding row to the logits. A packed matrix's input is quantized once per
   input vector into int16 blocks (kernels.c quantize_x) and shared by every matrix that reads it: q, k and v; the
   k experts' gate_up products (and the shared expert's); each expert's down product reads its own intermediate.
   Where the recipe quantizes activations (W8A8), the input is first put on the recipe's grid exactly as
   hexq.model.simulate.ActQuantizer computes it (act_quant), once per distinct grid. */
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DECODE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#endif

/* ------------------------------------------------------------------------------------------ the model, as data */

/* MAT_ABSENT: a routed expert the step may serve but whose codes are not resident now (a fast tier smaller than the
   experts): a token routed to it stops the step there (hexq_resume). */
enum { MAT_NONE = 0, MAT_PACKED = 1, MAT_F32 = 2, MAT_BF16 = 3, MAT_ABSENT = 4 };

/* The recipe's activation grid on a matrix input (hexq.model.simulate.ActQuantizer); bits 0: none. */
typedef struct {
    int32_t bits, symmetric, dynamic;
    float low, high; /* static range */
} hexq_act;

/* y = W x (+ bias): W packed (codes, float16 scale and zero per `group` codes of a row, `bits` wide) or a float32 /
   bfloat16 matrix [rows, cols] in `data`. */
typedef struct {
    int32_t kind, bits;
    int64_t rows, cols, group;
    const void* data;
    const uint16_t* scale;
    const uint16_t* zero;
    const float* bias; /* float32 [rows] or NULL */
    hexq_act act;      /* the input's grid */
    int32_t layout;    /* packed: LAYOUT_STREAM or LAYOUT_PLANES */
} hexq_matrix;

/* One routed expert as served: its two packed matrices at the served width (kind MAT_NONE: skipped, its routing
   weight renormalised onto the token's kept experts, hexq.model.simulate.served_weights; MAT_ABSENT: served, but not
   resident now). */
typedef struct {
    hexq_matrix gate_up, down;
} hexq_expert;

enum { QK_NONE = 0, QK_HEAD = 1, QK_WHOLE = 2 }; /* q/k RMSNorm: none, per head (qwen3), over the projection (olmoe) */

typedef struct {
    const float* input_norm;  /* [H] */
    const float* post_norm;   /* [H] */
    hexq_matrix q, k, v, o;
    const float* q_norm;      /* per head [D] or whole [heads * D] (qk_norm) */
    const float* k_norm;
    int32_t qk_norm;
    int32_t moe;              /* 1: router + routed experts (+ shared expert); 0: a dense MLP in `mlp_*` */
    hexq_matrix router;       /* [E, H] */
    const hexq_expert* experts; /* [E]; their matrices carry the recipe's expert activation grids */
    hexq_matrix mlp_gate, mlp_up, mlp_down; /* a dense MLP, or the shared expert (kind MAT_NONE: none) */
    hexq_matrix shared_gate;  /* [1, H]: sigmoid-scales the shared expert (kind MAT_NONE: none) */
    /* Reading ahead under a fast tier smaller than the experts (ahead NULL: every expert resident): the file
       descriptor of the file holding the layer's experts and, per expert, AHEAD_RANGES (offset, length) byte ranges
       of its stored replica there (length 0: unused). The step asks the kernel to read an absent expert's ranges
       into the page cache (posix_fadvise WILLNEED: asynchronous, no thread) as soon as it knows the expert will be
       wanted (read_ahead), so the loads the caller then makes (hexq.runtime.native) find them there. */
    int32_t ahead_fd;
    const int64_t* ahead;     /* [E][AHEAD_RANGES][2] */
} hexq_layer;

#define AHEAD_RANGES 4

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, vocab;
    int32_t num_experts, top_k, normalize, inter; /* inter: the widest routed expert's intermediate */
    int32_t mlp_inter;        /* the widest dense MLP / shared expert intermediate (0: none) */
    int32_t sliding_window;   /* 0: none; else a query attends to the last `sliding_window` positions */
    float eps, scaling, rope_scaling, clip_qkv; /* clip_qkv 0: none */
    const float* inv_freq;    /* [D / 2] RoPE frequencies */
    int32_t embed_kind;       /* MAT_F32 or MAT_BF16 */
    const void* embed;        /* [vocab, H] */
    const float* final_norm;  /* [H] */
    hexq_matrix head;         /* [vocab, H] */
    const hexq_layer* layer;  /* [layers] */
    void* k_cache;            /* [layers, kv_heads, max_pos, D] of float16 (kv_half) or float32 */
    void* v_cache;
    int64_t max_pos;
    int32_t kv_half;
} hexq_model;

/* Where a step stopped for experts, and resumes. Under a fast tier smaller than the experts, a token routed to an
   absent expert stops the step after that layer's routing (hexq_decode returns 1): `layer` names the layer, ids and
   weights its kept experts (the first n), the caller makes the absent ones resident (hexq.runtime.native) and calls
   again with the same state, and the step goes on from that layer's expert products - everything before them (the
   hidden state, the normed input, the shared expert's first products, the RoPE angles) waits in the scratch. layer
   -1: a new token. `log` (NULL: none; room for layers * top_k entries from `logged` on) receives layer * num_experts
   + expert for every kept expert a routing found resident: the cache's recency and hit counts, which the step cannot
   update itself (hexq.runtime.native). */
typedef struct {
    int32_t layer, n;
    int32_t ids[64];
    float weights[64];
    int32_t* log;
    int32_t logged;
} hexq_resume;

/* ------------------------------------------------------------------------------------------ small math */

static void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* The grid parameters of hexq.algos.quant.grid_params for one row whose minimum and maximum are lo and hi. */
static void grid_of(const hexq_act* a, float lo, float hi, float amax, float* scale, float* zero) {
    const float qmax = (float)((1 << a->bits) - 1);
    if (a->symmetric) {
        const float m = fmaxf(amax, 1e-8f);
        if (a->bits == 1) { /* levels +-max/2 */
            *scale = m;
            *zero = 0.5f;
        } else {
            *scale = 2.0f * m / qmax;
            *zero = (float)(1 << (a->bits - 1)); /* (qmax + 1) / 2 */
        }
    } else if (a->bits == 1) {
        *scale = fmaxf(hi - lo, 1e-8f);
        *zero = -lo / *scale;
    } else {
        const float wmin = fminf(lo, 0.0f), wmax = fmaxf(hi, 0.0f);
        *scale = fmaxf((wmax - wmin) / qmax, 1e-8f);
        *zero = nearbyintf(-wmin / *scale);
    }
}

/* An 8-bit activation grid's codes as the integer W8A8 product reads them: codes - 128 as int8 (value = (q + 128 -
   zero) * scale), with their sum. */
typedef struct {
    int8_t* q;
    float scale, zero;
    int64_t sum;
} act_codes;

/* x put on the activation grid (hexq.model.simulate.ActQuantizer: codes = clamp(round(x / scale + zero), 0, qmax), value
   (codes - zero) * scale), dynamic per token or from the static range; with `codes` (8-bit grids) the codes too. */
static inline __attribute__((always_inline)) void act_quant_body(const hexq_act* a, const float* x, float* out,
                                                                 int64_t n, act_codes* codes) {
    float lo, hi, amax = 0.0f;
    if (a->dynamic) {
        /* 8 lanes of each, so that the compiler vectorizes the loop; not fminf / fmaxf, which are libm calls per value
           without -ffinite-math-only (the comparisons pass over a NaN as they do) */
        float l8[8], h8[8], a8[8];
        for (int j = 0; j < 8; j++) l8[j] = h8[j] = x[0], a8[j] = 0.0f;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) {
                const float v = x[i + j], a = fabsf(v);
                l8[j] = v < l8[j] ? v : l8[j];
                h8[j] = v > h8[j] ? v : h8[j];
                a8[j] = a > a8[j] ? a : a8[j];
            }
        for (; i < n; i++) {
            const float a = fabsf(x[i]);
            l8[0] = x[i] < l8[0] ? x[i] : l8[0];
            h8[0] = x[i] > h8[0] ? x[i] : h8[0];
            a8[0] = a > a8[0] ? a : a8[0];
        }
        lo = l8[0];
        hi = h8[0];
        for (int j = 1; j < 8; j++) {
            lo = l8[j] < lo ? l8[j] : lo;
            hi = h8[j] > hi ? h8[j] : hi;
            amax = a8[j] > amax ? a8[j] : amax;
        }
        amax = a8[0] > amax ? a8[0] : amax;
    } else {
        lo = a->low;
        hi = a->high;
        amax = fmaxf(fabsf(lo), fabsf(hi));
    }
    float scale, zero;
    grid_of(a, lo, hi, amax, &scale, &zero);
    const float qmax = (float)((1 << a->bits) - 1);
    /* one loop with the codes and one without, neither with a branch or a store through `codes` inside, so that
       the compiler vectorizes both */
    if (!codes) {
        for (int64_t i = 0; i < n; i++) {
            float q = nearbyintf(x[i] / scale + zero);
            q = q < 0.0f ? 0.0f : q > qmax ? qmax : q;
            out[i] = (q - zero) * scale;
        }
    } else {
        int8_t* c = codes->q;
        int32_t sum = 0; /* |codes - 128| <= 128: exact for n < 2^24 */
        for (int64_t i = 0; i < n; i++) {
            float q = nearbyintf(x[i] / scale + zero);
            q = q < 0.0f ? 0.0f : q > qmax ? qmax : q;
            out[i] = (q - zero) * scale;
            const int32_t v = (int32_t)q - 128;
            c[i] = (int8_t)v;
            sum += v;
        }
        codes->scale = scale;
        codes->zero = zero;
        codes->sum = sum;
    }
}

static void act_quant_portable(const hexq_act* a, const float* x, float* out, int64_t n, act_codes* codes) {
    act_quant_body(a, x, out, n, codes);
}
#ifdef DECODE_X86
static AVX2 void act_quant_avx2(const hexq_act* a, const float* x, float* out, int64_t n, act_codes* codes) {
    act_quant_body(a, x, out, n, codes); /* see quantize_x */
}
#endif

static void act_quant(const hexq_act* a, const float* x, float* out, int64_t n, act_codes* codes) {
#ifdef DECODE_X86
    if (cpu_has_avx2()) {
        act_quant_avx2(a, x, out, n, codes);
        return;
    }
#endif
    act_quant_portable(a, x, out, n, codes);
}

static int same_act(const hexq_act* a, const hexq_act* b) {
    return a->bits == b->bits && (!a->bits || (a->symmetric == b->symmetric && a->dynamic == b->dynamic
                                               && a->low == b->low && a->high == b->high));
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------------------------------ float matrices */

/* y[r] = W[r] . x for a float32 or bfloat16 W, rows [r0, r1). */
static void rows_float_scalar(const hexq_matrix* m, const float* x, float* y, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        float acc[8] = {0};
        if (m->kind == MAT_F32) {
            const float* w = (const float*)m->data + r * m->cols;
            for (int64_t c = 0; c < m->cols; c++) acc[c & 7] += w[c] * x[c];
        } else {
            const uint16_t* w = (const uint16_t*)m->data + r * m->cols;
            for (int64_t c = 0; c < m->cols; c++) acc[c & 7] += bf16_to_float(w[c]) * x[c];
        }
        y[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

#ifdef DECODE_X86
static AVX2 void rows_float_avx2(const hexq_matrix* m, const float* x, float* y, int64_t r0, int64_t r1) {
    const int64_t cols = m->cols;
    for (int64_t r = r0; r < r1; r++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t c = 0;
        if (m->kind == MAT_F32) {
            const float* w = (const float*)m->data + r * cols;
            for (; c + 16 <= cols; c += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
            }
        } else {
            const uint16_t* w = (const uint16_t*)m->data + r * cols;
            for (; c + 16 <= cols; c += 16) {
                const __m256i h0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + c)));
                const __m256i h1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + c + 8)));
                a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h0, 16)), _mm256_loadu_ps(x + c), a0);
                a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h1, 16)), _mm256_loadu_ps(x + c + 8), a1);
            }
        }
        float lanes[8], total = 0.0f;
        _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
        for (int i = 0; i < 8; i++) total += lanes[i];
        for (; c < cols; c++)
            total += (m->kind == MAT_F32 ? ((const float*)m->data)[r * cols + c]
                                         : bf16_to_float(((const uint16_t*)m->data)[r * cols + c])) * x[c];
        y[r] = total;
    }
}

static AVX512 void rows_float_avx512(const hexq_matrix* m, const float* x, float* y, int64_t r0, int64_t r1) {
    const int64_t cols = m->cols;
    for (int64_t r = r0; r < r1; r++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t c = 0; c < cols; c += 32) {
            const int64_t left = cols - c;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            __m512 w0, w1;
            if (m->kind == MAT_F32) {
                const float* w = (const float*)m->data + r * cols + c;
                w0 = _mm512_maskz_loadu_ps(m0, w);
                w1 = _mm512_maskz_loadu_ps(m1, w + 16);
            } else {
                const uint16_t* w = (const uint16_t*)m->data + r * cols + c;
                w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, w)), 16));
                w1 = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, w + 16)), 16));
            }
            a0 = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, x + c), a0);
            a1 = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, x + c + 16), a1);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}
#endif

#ifdef DECODE_X86
/* A W8A8 matrix in integer arithmetic (AVX-512 VNNI): 8-bit codes q with one scale s_w and zero z_w per row, its
   input on an 8-bit grid, x = (i - z_x) s_x with codes i = c + 128 (act_codes). Then
     y = s_w s_x sum (q - z_w)(i - z_x) = s_w s_x (sum q c + (128 - z_x) sum q - z_w (sum c + 128 n - n z_x)),
   where sum q c and sum q are exact int32 sums of vpdpbusd (q unsigned, c signed) and vpsadbw: one multiply-add per
   64 codes and no float work until the row's end, where the int16-block path spends two conversions and two float
   multiply-adds per 64 codes. The same numbers as the float product of the grid values, up to one rounding. */

/* One row's output from its integer sums (above): qc = sum q c, qsum = sum q over n codes; zw and sw the row's zero
   and scale. Every copy of the W8A8 rows (rows_w8a8_avx512, w8a8_256.h) ends here. */
static inline float w8a8_row(double qc, double qsum, double zw, double sw, const act_codes* a, int64_t n) {
    const double zx = a->zero;
    const double dot = qc + (128.0 - zx) * qsum - zw * ((double)a->sum + (128.0 - zx) * (double)n);
    return (float)(sw * (double)a->scale * dot);
}

static AVX512 void rows_w8a8_avx512(const hexq_matrix* m, const act_codes* a, float* y, int64_t r0, int64_t r1) {
    const int64_t n = m->cols;
    const int64_t ahead = prefetch_ahead(n);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* q = (const uint8_t*)m->data + r * n;
        if (r + ahead < m->rows)
            for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(q + ahead * n + o, 0, 3);
        __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512(), sums = _mm512_setzero_si512();
        int64_t c = 0;
        for (; c + 128 <= n; c += 128) {
            const __m512i q0 = _mm512_loadu_si512(q + c), q1 = _mm512_loadu_si512(q + c + 64);
            dot0 = _mm512_dpbusd_epi32(dot0, q0, _mm512_loadu_si512(a->q + c));
            dot1 = _mm512_dpbusd_epi32(dot1, q1, _mm512_loadu_si512(a->q + c + 64));
            sums = _mm512_add_epi64(sums, _mm512_add_epi64(_mm512_sad_epu8(q0, _mm512_setzero_si512()),
                                                           _mm512_sad_epu8(q1, _mm512_setzero_si512())));
        }
        for (; c < n; c += 64) {
            const __mmask64 mask = n - c >= 64 ? ~0ULL : (1ULL << (n - c)) - 1;
            const __m512i q0 = _mm512_maskz_loadu_epi8(mask, q + c);
            dot0 = _mm512_dpbusd_epi32(dot0, q0, _mm512_maskz_loadu_epi8(mask, a->q + c));
            sums = _mm512_add_epi64(sums, _mm512_sad_epu8(q0, _mm512_setzero_si512()));
        }
        y[r] = w8a8_row((double)_mm512_reduce_add_epi32(_mm512_add_epi32(dot0, dot1)),
                        (double)_mm512_reduce_add_epi64(sums), _cvtsh_ss(m->zero[r]), _cvtsh_ss(m->scale[r]), a, n);
    }
}

/* The same rows on 256-bit VNNI for the AVX-VNNI path: w8a8_256.h, with VEX vpdpbusd (rows_w8a8_vex) and with EVEX
   vpdpbusd (rows_w8a8_evex). */
#ifdef HEXQ_AVXVNNI_VEX
#define VNNI256 __attribute__((target("avx2,fma,f16c,avxvnni")))
#define DPBUSD _mm256_dpbusd_avx_epi32
#define VNNI256_NAME(f) f##_vex
#include "w8a8_256.h"
#undef VNNI256
#undef DPBUSD
#undef VNNI256_NAME
#endif
#define VNNI256 AVX512
#define DPBUSD _mm256_dpbusd_epi32
#define VNNI256_NAME(f) f##_evex
#include "w8a8_256.h"
#undef VNNI256
#undef DPBUSD
#undef VNNI256_NAME
#endif

typedef void (*w8a8_rows_fn)(const hexq_matrix*, const act_codes*, float*, int64_t, int64_t);

/* The integer W8A8 rows of a path (NULL: its W8A8 matrices go through the int16-block GEMV). */
static w8a8_rows_fn w8a8_rows_for(int path) {
#ifdef DECODE_X86
    if (path == PATH_AVX512) return rows_w8a8_avx512;
#ifdef HEXQ_AVXVNNI_VEX
    if (path == PATH_AVXVNNI && cpu_has_avxvnni()) return rows_w8a8_vex;
#endif
    if (path == PATH_AVXVNNI) return rows_w8a8_evex;
#endif
    (void)path;
    return NULL;
}

/* Whether the integer W8A8 rows take matrix m reading codes a (NULL: its input's codes were not computed). */
static int takes_w8a8(const hexq_matrix* m, const act_codes* a) {
    return a && m->kind == MAT_PACKED && m->bits == 8 && m->layout == LAYOUT_STREAM && m->group == m->cols
           && m->act.bits == 8;
}

typedef void (*float_rows_fn)(const hexq_matrix*, const float*, float*, int64_t, int64_t);

static float_rows_fn float_rows_for(int path) {
#ifdef DECODE_X86
    if (path == PATH_AVX512) return rows_float_avx512;
    if (path == PATH_AVX2 || path == PATH_AVXVNNI) return rows_float_avx2;
#endif
    return rows_float_scalar;
}

/* ------------------------------------------------------------------------------------------ a phase of products */

#define MAX_PRODUCTS 80     /* products in one phase: the k experts' (k <= 64) and the shared expert's */
#define PHASE_ROWS 16       /* rows per pool item */

/* One matrix-vector product of a phase: y = W x (+ bias), from x's int16 blocks (packed W) or x itself. */
typedef struct {
    const hexq_matrix* m;
    const quantized_x* xq;
    const act_codes* codes; /* x's 8-bit grid codes (NULL: none) */
    const float* x;
    float* y;
} product;

typedef struct {
    product items[MAX_PRODUCTS];
    int64_t first[MAX_PRODUCTS + 1]; /* pool item where each product starts */
    int n;
    rows_fn packed_rows;
    float_rows_fn float_rows;
    w8a8_rows_fn w8a8_rows; /* the path's W8A8 matrices in integer arithmetic (NULL: none) */
    int path;
} phase;

static void phase_add(phase* p, const hexq_matrix* m, const quantized_x* xq, const act_codes* codes, const float* x,
                      float* y) {
    if (m->kind == MAT_NONE) return;
    p->items[p->n] = (product){m, xq, codes, x, y};
    p->first[p->n + 1] = p->first[p->n] + (m->rows + PHASE_ROWS - 1) / PHASE_ROWS;
    p->n++;
}

static void phase_item(void* arg, int64_t item) {
    const phase* p = (const phase*)arg;
    int lo = 0, hi = p->n - 1;
    while (lo < hi) { /* the product holding this item */
        const int mid = (lo + hi + 1) / 2;
        if (p->first[mid] <= item) lo = mid; else hi = mid - 1;
    }
    const product* t = &p->items[lo];
    const hexq_matrix* m = t->m;
    const int64_t r0 = (item - p->first[lo]) * PHASE_ROWS;
    const int64_t r1 = r0 + PHASE_ROWS < m->rows ? r0 + PHASE_ROWS : m->rows;
    if (takes_w8a8(m, t->codes)) {
        p->w8a8_rows(m, t->codes, t->y, r0, r1);
    } else if (m->kind == MAT_PACKED) {
        const hexq_gemv_task task = {(const uint8_t*)m->data, m->scale, m->zero, t->x, t->y, m->rows, m->cols,
                                     m->group, m->cols, m->rows, m->bits, 1, m->layout};
        p->packed_rows(&task, t->xq, r0, r1);
    } else {
        p->float_rows(m, t->x, t->y, r0, r1);
    }
    if (m->bias)
        for (int64_t r = r0; r < r1; r++) t->y[r] += m->bias[r];
}

/* Where a step's time goes (hexq_decode_profile): seconds in the pool's product phases, in the attention phase, and
   in the whole step; what is left is the single-threaded glue between phases. */
static struct {
    double products, attention, total;
    int64_t steps;
    int64_t missed, predicted, predicted_routed; /* read ahead: see read_ahead */
} profile;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Copies {products, attention, total seconds, steps, missed, predicted, predicted_routed} since the last call into
   out[7] and starts again. */
void hexq_decode_profile(double* out) {
    out[0] = profile.products;
    out[1] = profile.attention;
    out[2] = profile.total;
    out[3] = (double)profile.steps;
    out[4] = (double)profile.missed;
    out[5] = (double)profile.predicted;
    out[6] = (double)profile.predicted_routed;
    memset(&profile, 0, sizeof(profile));
}

static void phase_run(phase* p, int threads) {
    if (p->n) {
        const double start = now();
        parallel(phase_item, p, p->first[p->n], threads);
        profile.products += now() - start;
    }
    p->n = 0;
}

/* ------------------------------------------------------------------------------------------ scratch */

/* An input vector as the products read it: on a matrix's activation grid (act_quant) where the recipe asks, and in
   int16 blocks for the packed kernels. A set holds one copy per distinct grid among the matrices that read the same
   vector (one for dynamic grids; static per-linear ranges may differ), each computed once per step; it has a buffer
   per kind of reader (q, k, v; a dense MLP's or shared expert's gate and up, its gate, the router, the routed
   experts), so a grid always finds one. */
#define MAX_READERS 5

typedef struct {
    float* value;   /* [cols] */
    quantized_x q;  /* int16 blocks of value, made for the first reader that is not an integer W8A8 product */
    int blocks;     /* whether q holds them this step */
    act_codes codes; /* value's codes on an 8-bit grid, on the AVX-512 path */
    hexq_act act;   /* the grid `value` is on */
} input_buf;

typedef struct {
    input_buf b[MAX_READERS];
    int used;
} input_set;

typedef struct {
    float *x, *h, *q, *k, *v, *att, *o, *router, *scores, *hidden, *mid, *ye, *mlp_hidden, *mlp_mid, *mlp_y, *gate;
    float *cos, *sin; /* RoPE at this step's position [D/2] */
    float *h_ahead, *router_ahead; /* the next layer's router input and logits as predicted from this layer's */
    int32_t* ahead_ids; /* [1 + top_k]: how many, then the absent experts of the next layer read ahead (kept across
                           the calls of a step that stops, like all of the scratch) */
    input_set in_h, in_att, in_moe, in_final, in_mid[64], in_mlp_mid, in_ahead;
} scratch;

#define ALIGN64(n) (((n) + 63) / 64 * 64)

static uint8_t* carve(uint8_t** p, int64_t bytes) {
    uint8_t* out = *p;
    *p += ALIGN64(bytes);
    return out;
}

static void input_init(input_set* set, uint8_t** p, int64_t cols, int readers) {
    set->used = 0;
    for (int i = 0; i < readers; i++) {
        input_buf* b = &set->b[i];
        b->value = (float*)carve(p, cols * 4);
        b->q.q = (int16_t*)carve(p, cols * 2);
        b->q.dx = (float*)carve(p, cols / BLOCK * 4 + 4);
        b->q.sum = (int32_t*)carve(p, cols / BLOCK * 4 + 4);
        b->q.lo = carve(p, cols);
        b->q.hi = (int8_t*)carve(p, cols);
        b->q.q8 = (int8_t*)carve(p, cols);
        b->q.dx8 = (float*)carve(p, cols / BLOCK * 4 + 4);
        b->q.zx8 = (float*)carve(p, cols / BLOCK * 4 + 4);
        b->codes.q = (int8_t*)carve(p, cols);
    }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Lays the scratch out from `base` (NULL: only counts) and returns its size in bytes. */
static int64_t scratch_layout(const hexq_model* m, uint8_t* base, scratch* s) {
    uint8_t* p = base;
    const int64_t H = m->hidden, QD = (int64_t)m->heads * m->head_dim, KD = (int64_t)m->kv_heads * m->head_dim;
    const int64_t I = max64(m->inter, BLOCK), MI = max64(m->mlp_inter, BLOCK), k = m->top_k;
    scratch local;
    if (!s) s = &local;
    s->x = (float*)carve(&p, H * 4);
    s->h = (float*)carve(&p, H * 4);
    s->q = (float*)carve(&p, QD * 4);
    s->k = (float*)carve(&p, KD * 4);
    s->v = (float*)carve(&p, KD * 4);
    s->att = (float*)carve(&p, QD * 4);
    s->o = (float*)carve(&p, H * 4);
    s->router = (float*)carve(&p, max64(m->num_experts, 1) * 4);
    s->scores = (float*)carve(&p, (int64_t)m->heads * m->max_pos * 4);
    s->hidden = (float*)carve(&p, k * 2 * I * 4);
    s->mid = (float*)carve(&p, k * I * 4);
    s->ye = (float*)carve(&p, k * H * 4);
    s->mlp_hidden = (float*)carve(&p, 2 * MI * 4);
    s->mlp_mid = (float*)carve(&p, MI * 4);
    s->mlp_y = (float*)carve(&p, H * 4);
    s->gate = (float*)carve(&p, 64);
    s->cos = (float*)carve(&p, m->head_dim * 2);
    s->sin = (float*)carve(&p, m->head_dim * 2);
    s->h_ahead = (float*)carve(&p, H * 4);
    s->router_ahead = (float*)carve(&p, max64(m->num_experts, 1) * 4);
    s->ahead_ids = (int32_t*)carve(&p, (k + 1) * 4);
    input_init(&s->in_h, &p, H, 3);
    input_init(&s->in_att, &p, QD, 1);
    input_init(&s->in_moe, &p, H, MAX_READERS);
    input_init(&s->in_final, &p, H, 1);
    for (int j = 0; j < k && j < 64; j++) input_init(&s->in_mid[j], &p, I, 1);
    input_init(&s->in_mlp_mid, &p, MI, 1);
    input_init(&s->in_ahead, &p, H, 1);
    return p - base;
}

/* Bytes of scratch hexq_decode needs for this model (it aligns the pointer it is given to 64 bytes itself). */
int64_t hexq_decode_scratch(const hexq_model* m) { return scratch_layout(m, (uint8_t*)0, NULL) + 64; }

/* Queue y = W x for matrix `m` reading vector `src` (`cols` values) through `set`: x on m's grid, computed once per
   grid per step (set->used is reset where the vector changes). */
static void add_product(phase* p, input_set* set, const float* src, int64_t cols, const hexq_matrix* m, float* y) {
    if (m->kind == MAT_NONE) return;
    input_buf* b = NULL;
    for (int i = 0; i < set->used; i++)
        if (same_act(&set->b[i].act, &m->act)) b = &set->b[i];
    const int computed = b != NULL;
    if (!b) b = &set->b[set->used++];
    /* the grid's codes only where the integer W8A8 rows read them; a buffer found again was made for the same grid */
    act_codes* codes = p->w8a8_rows && m->act.bits == 8 ? &b->codes : NULL;
    if (!computed) {
        if (m->act.bits) act_quant(&m->act, src, b->value, cols, codes);
        else memcpy(b->value, src, (size_t)cols * 4);
        b->act = m->act;
        b->blocks = 0;
    }
    /* int16 blocks for the packed GEMV alone: not for float matrices (router, a bf16 head), nor for the integer W8A8
       rows, which read the codes (q/k/v and o on the VNNI paths) */
    if (!b->blocks && cols % BLOCK == 0 && m->kind == MAT_PACKED && !takes_w8a8(m, codes)) {
        const hexq_gemv_task t = {0, 0, 0, b->value, 0, 0, cols, BLOCK, cols, 0, 1, 1, LAYOUT_STREAM};
        quantized_x q = b->q;
        if (!reads_bytes(p->path)) q.lo = NULL;
        if (!reads_int8(p->path)) q.q8 = NULL;
        quantize_x(&t, &q, p->path);
        b->blocks = 1;
    }
    phase_add(p, m, &b->q, codes, b->value, y);
}

/* ------------------------------------------------------------------------------------------ attention */

#define MAX_GROUP 64 /* query heads per KV head the step takes */

#define MAX_HEAD_DIM 1024 /* a float16 cache row is converted on the stack (kv_row) */

/* Bytes of a cached key or value: float16 (IEEE binary16, llama.cpp's default cache type: half the bytes that
   attention reads at long context) or float32. */
static inline int64_t kv_size(const hexq_model* m) { return m->kv_half ? 2 : 4; }

/* KV head kvh's rows of layer `layer` in a cache [layers, kv_heads, max_pos, D]: position t at + t * D elements. */
static char* kv_rows(const hexq_model* m, void* cache, int layer, int64_t kvh) {
    return (char*)cache + (((int64_t)layer * m->kv_heads + kvh) * m->max_pos) * m->head_dim * kv_size(m);
}

/* float_to_half over x[0..n) into h, then half_to_float of h into back (tests: the cache's conversions against torch's). */
void hexq_kv_half(const float* x, int64_t n, uint16_t* h, float* back) {
    for (int64_t i = 0; i < n; i++) {
        h[i] = float_to_half(x[i]);
        back[i] = half_to_float(h[i]);
    }
}

/* Position t's key or value row as float32: the cache's own (float32), or converted into `tmp` (float16). */
static const float* kv_row(const hexq_model* m, const char* rows, int64_t t, float* tmp) {
    const int64_t D = m->head_dim;
    if (!m->kv_half) return (const float*)rows + t * D;
    const uint16_t* h = (const uint16_t*)rows + t * D;
    for (int64_t i = 0; i < D; i++) tmp[i] = half_to_float(h[i]);
    return tmp;
}

/* Stores x [D] as position t's row. */
static void kv_store(const hexq_model* m, char* rows, int64_t t, const float* x) {
    const int64_t D = m->head_dim;
    if (!m->kv_half) {
        memcpy((float*)rows + t * D, x, (size_t)D * 4);
        return;
    }
    uint16_t* h = (uint16_t*)rows + t * D;
    for (int64_t i = 0; i < D; i++) h[i] = float_to_half(x[i]);
}

typedef struct {
    const hexq_model* m;
    const scratch* s;
    int layer;
    int64_t pos, start;
    int64_t per; /* query heads per pool item: a divisor of the group */
} attention_ctx;

/* Query heads per attention item: the whole group of a KV head (its rows read once), halved while that leaves
   fewer items than threads. */
static int64_t heads_per_item(const hexq_model* m, int threads) {
    int64_t per = m->heads / m->kv_heads;
    while (per % 2 == 0 && m->heads / per < threads) per /= 2;
    return per;
}

/* a . b over n floats in 8 independent partial sums (so the compiler vectorizes it for the ISA of its caller). */
static inline __attribute__((always_inline)) float dot8(const float* a, const float* b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#ifdef DECODE_X86
/* e^x on 8 lanes for x in [-87.3, 88] (the caller clamps): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so
   that n ln2 is exact to float32), e^r by Cephes' degree-7 polynomial for expf (relative error ~1e-7, a float32
   ulp), 2^n into the exponent field. */
static AVX2 __m256 exp8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* scores[t] = e^(scores[t] - top) for t in [0, n), returning their sum (in 8 partial sums, then in order): exp8 on 8
   lanes where libm's expf per position took most of the attention phase (32 heads x every position per layer);
   scores[t] - top <= 0, clamped below at -87.3, where e^x is under 1.2e-38 of the largest. */
static AVX2 float softmax_exp_avx2(float* scores, int64_t n, float top) {
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(top)),
                                       _mm256_set1_ps(-87.3f));
        const __m256 e = exp8(x);
        _mm256_storeu_ps(scores + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int j = 0; j < 8; j++) total += lanes[j];
    for (; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    return total;
}
#endif

/* Query heads [first, first + c->per) of one KV head over positions [start, pos]: softmax(q k^T * scaling) v for
   each, on the portable path. The heads of an item share their KV head (per divides the group), and each key and
   value row is read once for all of them. */
static void attention_heads(void* arg, int64_t item) {
    const attention_ctx* c = (const attention_ctx*)arg;
    const hexq_model* m = c->m;
    const int64_t D = m->head_dim, per = c->per, first = item * per, kvh = first / (m->heads / m->kv_heads);
    const char *keys = kv_rows(m, m->k_cache, c->layer, kvh), *values = kv_rows(m, m->v_cache, c->layer, kvh);
    float top[MAX_GROUP], inv[MAX_GROUP], row[MAX_HEAD_DIM];
    for (int64_t g = 0; g < per; g++) top[g] = -INFINITY;
    for (int64_t t = c->start; t <= c->pos; t++) {
        const float* key = kv_row(m, keys, t, row);
        for (int64_t g = 0; g < per; g++) {
            float* scores = c->s->scores + (first + g) * m->max_pos;
            scores[t] = dot8(c->s->q + (first + g) * D, key, D) * m->scaling;
            top[g] = scores[t] > top[g] ? scores[t] : top[g]; /* not fmaxf: a libm call per position */
        }
    }
    for (int64_t g = 0; g < per; g++) {
        float* scores = c->s->scores + (first + g) * m->max_pos;
        float total = 0.0f;
        for (int64_t t = c->start; t <= c->pos; t++) {
            scores[t] = expf(scores[t] - top[g]);
            total += scores[t];
        }
        inv[g] = 1.0f / total;
        float* out = c->s->att + (first + g) * D;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    }
    for (int64_t t = c->start; t <= c->pos; t++) {
        const float* value = kv_row(m, values, t, row);
        for (int64_t g = 0; g < per; g++) {
            const float p = c->s->scores[(first + g) * m->max_pos + t] * inv[g];
            float* out = c->s->att + (first + g) * D;
            for (int64_t i = 0; i < D; i++) out[i] += p * value[i];
        }
    }
}

#ifdef DECODE_X86
/* The sums of 8 vectors' lanes, one per lane: [sum a[0], ..., sum a[7]]. */
static AVX2 __m256 sums8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

#define KV_BLOCK 32 /* positions whose value rows (16 KB at head_dim 128) stay in L1 while every head reads them */

/* Elements [i, i + 8) of a cache's rows as float32 (F16C's conversion for float16: exact). */
static AVX2 inline __attribute__((always_inline)) __m256 kv8(const char* rows, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rows + i * 2)))
                : _mm256_loadu_ps((const float*)rows + i);
}

/* out[h] += sum over positions u in [block, stop) of p[h][u] v[u], for `heads` (a constant: 1, 2 or 4) heads whose
   outputs and weights lie D and stride floats apart: 8 lanes of every head's output in registers, in two
   accumulators each (even and odd positions, so that the multiply-adds are not one chain), each value vector loaded
   once for them all. A head's arithmetic does not depend on how many heads share the call, so the step's result
   does not depend on the thread count (heads_per_item). */
static AVX2 inline __attribute__((always_inline)) void weighted_values(const char* values, const float* p,
                                                                        int64_t stride, float* out, int64_t D,
                                                                        int64_t block, int64_t stop,
                                                                        const int heads, const int half) {
    const int64_t line = half ? 32 : 16; /* elements per 64-byte line */
    for (int64_t d = 0; d < D; d += 8) {
        __m256 even[4], odd[4];
        for (int h = 0; h < heads; h++) {
            even[h] = _mm256_loadu_ps(out + h * D + d);
            odd[h] = _mm256_setzero_ps();
        }
        int64_t u = block;
        for (; u + 2 <= stop; u += 2) {
            if (d % line == 0) { /* the next block's rows, a line each: they arrive while this block is computed
                                    (one row per 256-512 bytes of stride is too sparse for the hardware's prefetch) */
                __builtin_prefetch(values + ((u + KV_BLOCK) * D + d) * (64 / line), 0, 3);
                __builtin_prefetch(values + ((u + 1 + KV_BLOCK) * D + d) * (64 / line), 0, 3);
            }
            const __m256 v0 = kv8(values, u * D + d, half), v1 = kv8(values, (u + 1) * D + d, half);
            for (int h = 0; h < heads; h++) {
                even[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + u), v0, even[h]);
                odd[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + u + 1), v1, odd[h]);
            }
        }
        if (u < stop) {
            const __m256 v = kv8(values, u * D + d, half);
            for (int h = 0; h < heads; h++)
                even[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + u), v, even[h]);
        }
        for (int h = 0; h < heads; h++) _mm256_storeu_ps(out + h * D + d, _mm256_add_ps(even[h], odd[h]));
    }
}

/* attention_heads on AVX2, for head_dim a multiple of 8, computed in register blocks: the scores of 8 positions for
   one head at a time (8 accumulators over head_dim, summed across lanes once per 8 positions, where a dot product
   per position spent a horizontal sum on each), the key rows of those 8 positions read from memory once and from L1
   by every head of the item; then each head's softmax (softmax_exp_avx2); then the output 8 lanes x up to 4 heads in
   registers (weighted_values), each value vector loaded once for them all, a block of KV_BLOCK positions at a time.
   One thread read ~4 GB/s of KV cache one head at a time, compute-bound (a 6-layer Qwen3-30B-A3B-shaped step at 4096
   positions: ~25 ms of attention on one thread). */
static AVX2 inline __attribute__((always_inline)) void attention_avx2_of(const attention_ctx* c, int64_t item,
                                                                          const int half) {
    const hexq_model* m = c->m;
    const int64_t D = m->head_dim, per = c->per, first = item * per, kvh = first / (m->heads / m->kv_heads);
    const int64_t line = half ? 32 : 16; /* elements per 64-byte line */
    const char *keys = kv_rows(m, m->k_cache, c->layer, kvh), *values = kv_rows(m, m->v_cache, c->layer, kvh);
    const int64_t start = c->start, end = c->pos + 1;
    const __m256 scaling = _mm256_set1_ps(m->scaling);
    __m256 top[MAX_GROUP];
    for (int64_t g = 0; g < per; g++) top[g] = _mm256_set1_ps(-INFINITY);
    int64_t t = start;
    for (; t + 8 <= end; t += 8)
        for (int64_t g = 0; g < per; g++) {
            const float* q = c->s->q + (first + g) * D;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                if (g == 0 && d % line == 0) /* the next 8 key rows, a line each: every head reads them next */
                    for (int j = 0; j < 8; j++) __builtin_prefetch(keys + ((t + 8 + j) * D + d) * (64 / line), 0, 3);
                const __m256 qd = _mm256_loadu_ps(q + d);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, kv8(keys, (t + j) * D + d, half), acc[j]);
            }
            const __m256 scores = _mm256_mul_ps(sums8(acc), scaling);
            _mm256_storeu_ps(c->s->scores + (first + g) * m->max_pos + t, scores);
            top[g] = _mm256_max_ps(scores, top[g]);
        }
    for (int64_t g = 0; g < per; g++) {
        float* scores = c->s->scores + (first + g) * m->max_pos;
        float lanes[8], most = -INFINITY;
        _mm256_storeu_ps(lanes, top[g]);
        for (int j = 0; j < 8; j++) most = lanes[j] > most ? lanes[j] : most;
        for (int64_t u = t; u < end; u++) { /* the last (end - start) % 8 positions */
            float row[MAX_HEAD_DIM];
            scores[u] = dot8(c->s->q + (first + g) * D, kv_row(m, keys, u, row), D) * m->scaling;
            most = scores[u] > most ? scores[u] : most;
        }
        const float inv = 1.0f / softmax_exp_avx2(scores + start, end - start, most);
        for (int64_t u = start; u < end; u++) scores[u] *= inv;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(c->s->att + (first + g) * D + d, _mm256_setzero_ps());
    }
    for (int64_t block = start; block < end; block += KV_BLOCK) {
        const int64_t stop = block + KV_BLOCK < end ? block + KV_BLOCK : end;
        for (int64_t g = 0, n; g < per; g += n) { /* 4, 2 or 1 heads at a time: a constant count keeps the
                                                    accumulators in registers */
            n = per - g >= 4 ? 4 : per - g >= 2 ? 2 : 1;
            float* out = c->s->att + (first + g) * D;
            const float* p = c->s->scores + (first + g) * m->max_pos;
            if (n == 4) weighted_values(values, p, m->max_pos, out, D, block, stop, 4, half);
            else if (n == 2) weighted_values(values, p, m->max_pos, out, D, block, stop, 2, half);
            else weighted_values(values, p, m->max_pos, out, D, block, stop, 1, half);
        }
    }
}

/* attention_avx2_of for the cache's element type (a constant inside: one copy of the loops for each). */
static AVX2 void attention_heads_avx2(void* arg, int64_t item) {
    const attention_ctx* c = (const attention_ctx*)arg;
    if (c->m->head_dim % 8) attention_heads(arg, item);
    else if (c->m->kv_half) attention_avx2_of(c, item, 1);
    else attention_avx2_of(c, item, 0);
}
#endif

/* RoPE on one head's D values (rotate_half convention: pairs (i, i + D/2)) with the position's cos and sin [D/2]
   (the same for every head and layer: computed once per step). */
static void rope(float* x, int64_t D, const float* cs, const float* sn) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i] + a * sn[i];
    }
}

/* ------------------------------------------------------------------------------------------ routing */

/* The family's softmax top-k (ties to the lower expert id), renormalised if asked; then the served weights: the
   skipped (0-bit) experts' mass shared by the kept ones (hexq.model.simulate.renormalized_weights). */
/* ids[0..k) = the indices of the k largest of v[0..E) (E <= 1024), largest first, the lower index on a tie. */
static void top_k_of(const float* v, int E, int k, int* ids) {
    unsigned char taken[1024] = {0};
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1;
        ids[j] = best;
    }
}

static int route_token(const hexq_model* m, const hexq_layer* L, const float* logits, int* ids, float* weights) {
    const int E = m->num_experts, k = m->top_k;
    float top = -INFINITY, total = 0.0f;
    for (int e = 0; e < E; e++) top = fmaxf(top, logits[e]);
    float probs[1024];
    for (int e = 0; e < E; e++) {
        probs[e] = expf(logits[e] - top);
        total += probs[e];
    }
    for (int e = 0; e < E; e++) probs[e] /= total;
    top_k_of(probs, E, k, ids);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        weights[j] = probs[ids[j]];
        sum += weights[j];
    }
    if (m->normalize)
        for (int j = 0; j < k; j++) weights[j] /= sum;
    float all = 0.0f, kept = 0.0f;
    for (int j = 0; j < k; j++) {
        all += weights[j];
        if (L->experts[ids[j]].gate_up.kind != MAT_NONE) kept += weights[j];
    }
    int n = 0;
    for (int j = 0; j < k; j++) {
        if (L->experts[ids[j]].gate_up.kind == MAT_NONE) continue;
        ids[n] = ids[j];
        weights[n] = kept > 0.0f ? weights[j] * (all / kept) : 0.0f;
        n++;
    }
    return n; /* kept experts, first n of ids / weights (absent ones included: they are served, once loaded) */
}

/* ------------------------------------------------------------------------------------------ the step */

#ifdef DECODE_X86
/* gated on 8 lanes: silu(g) = g / (1 + e^-g) with e^-g from exp8, -g clamped to [-87.3, 88] (beyond it silu(g) is g,
   or 0 to under 1e-36, as expf's answer gives). libm's expf per value took ~100 us of a 6-layer Qwen3-30B-A3B-shaped
   step (8 experts x 768 per layer), a tenth of what ran outside the pool. */
static AVX2 void gated_avx2(const float* gate_up, float* mid, int64_t inter) {
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate_up + i), u = _mm256_loadu_ps(gate_up + inter + i);
        const __m256 e = exp8(_mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                                          _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f)));
        _mm256_storeu_ps(mid + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u));
    }
    for (; i < inter; i++) mid[i] = silu(gate_up[i]) * gate_up[inter + i];
}
#endif

/* mid = silu(gate) * up for gate_up = [gate; up], each [inter]. */
static void gated(const float* gate_up, float* mid, int64_t inter, int path) {
#ifdef DECODE_X86
    if (path != PATH_SCALAR) {
        gated_avx2(gate_up, mid, inter);
        return;
    }
#endif
    (void)path;
    for (int64_t i = 0; i < inter; i++) mid[i] = silu(gate_up[i]) * gate_up[inter + i];
}

/* Ask the kernel to read expert e of layer L into the page cache now, without waiting (see hexq_layer.ahead). */
static void read_ahead(const hexq_layer* L, int e) {
#ifdef POSIX_FADV_WILLNEED
    const int64_t* range = L->ahead + (int64_t)e * AHEAD_RANGES * 2;
    for (int i = 0; i < AHEAD_RANGES; i++)
        if (range[2 * i + 1] > 0) posix_fadvise(L->ahead_fd, range[2 * i], range[2 * i + 1], POSIX_FADV_WILLNEED);
#else
    (void)L;
    (void)e;
#endif
}

/* Look-ahead prefetch (004 §4.4.1): the next layer's router applied to this layer's residual stream after
   attention, normed with the next layer's own norm - what its router will read, less this layer's experts and the
   next attention - predicts its top-k; those absent are read ahead while this layer's loads and products run.
   Records them in s->ahead_ids to count how many the next routing keeps (profile.predicted_routed). */
static void predict_ahead(const hexq_model* m, const hexq_layer* next, scratch* s) {
    int predicted[64];
    top_k_of(s->router_ahead, m->num_experts, m->top_k, predicted);
    for (int j = 0; j < m->top_k; j++) {
        const int best = predicted[j];
        if (next->experts[best].gate_up.kind != MAT_ABSENT) continue;
        read_ahead(next, best);
        s->ahead_ids[1 + s->ahead_ids[0]++] = best;
        profile.predicted++;
    }
}

/* x += W_down (silu(W_gate h) * (W_up h)) for a dense MLP; in a MoE layer the same for the shared expert (scaled by
   its sigmoid gate) beside the routed experts, whose products join the shared expert's phases. Returns 1 where a
   kept expert is absent (its routing left in r, nothing of the layer's sum done yet); `resuming`: the routing and the
   shared expert's first products were done by the call that stopped, go on from the routed experts. */
static int layer_ffn(const hexq_model* m, const hexq_layer* L, int layer, scratch* s, phase* p, int threads,
                     hexq_resume* r, int resuming) {
    const int64_t H = m->hidden, mlp_inter = L->mlp_gate.rows;
    const int dense = L->mlp_gate.kind != MAT_NONE;
    int* ids = r->ids;
    float* weights = r->weights;
    s->in_moe.used = 0;
    if (!resuming) {
        add_product(p, &s->in_moe, s->h, H, &L->mlp_gate, s->mlp_hidden);
        add_product(p, &s->in_moe, s->h, H, &L->mlp_up, s->mlp_hidden + mlp_inter);
        add_product(p, &s->in_moe, s->h, H, &L->shared_gate, s->gate);
    }
    int n = 0;
    int64_t inter = 0;
    if (L->moe) { /* the router's [E] logits first, on the pool with the shared expert's products */
        if (!resuming) {
            const hexq_layer* next = layer + 1 < m->layers ? &m->layer[layer + 1] : NULL;
            const int ahead = next && next->moe && next->ahead;
            add_product(p, &s->in_moe, s->h, H, &L->router, s->router);
            if (ahead) { /* the next layer's router on this layer's stream, in the same phase */
                rms_norm(s->x, next->post_norm, s->h_ahead, H, m->eps);
                s->in_ahead.used = 0;
                add_product(p, &s->in_ahead, s->h_ahead, H, &next->router, s->router_ahead);
            }
            phase_run(p, threads);
            r->n = route_token(m, L, s->router, ids, weights);
            for (int j = 0; r->log && j < r->n; j++)
                if (L->experts[ids[j]].gate_up.kind != MAT_ABSENT && r->logged < m->layers * m->top_k)
                    r->log[r->logged++] = layer * m->num_experts + ids[j];
            if (L->ahead) {
                for (int j = 0; j < r->n; j++) { /* this layer's misses first, all queued before any is awaited */
                    if (L->experts[ids[j]].gate_up.kind != MAT_ABSENT) continue;
                    read_ahead(L, ids[j]);
                    profile.missed++;
                }
                for (int i = 0; i < s->ahead_ids[0]; i++) /* what the previous layer predicted for this one */
                    for (int j = 0; j < r->n; j++) profile.predicted_routed += ids[j] == s->ahead_ids[1 + i];
            }
            s->ahead_ids[0] = 0;
            if (ahead) predict_ahead(m, next, s);
        }
        n = r->n;
        for (int j = 0; j < n; j++) /* checked again on resuming: the caller may not have made them all resident */
            if (L->experts[ids[j]].gate_up.kind == MAT_ABSENT) return 1;
        for (int j = 0; j < n; j++) { /* every kept expert's gate_up: one input, one phase */
            const hexq_expert* e = &L->experts[ids[j]];
            inter = e->gate_up.rows / 2;
            add_product(p, &s->in_moe, s->h, H, &e->gate_up, s->hidden + j * 2 * m->inter);
        }
    }
    phase_run(p, threads);
    for (int j = 0; j < n; j++) { /* SiLU-mul, then every expert's down product on its own intermediate */
        gated(s->hidden + j * 2 * m->inter, s->mid + j * m->inter, inter, p->path);
        s->in_mid[j].used = 0;
        add_product(p, &s->in_mid[j], s->mid + j * m->inter, inter, &L->experts[ids[j]].down, s->ye + j * H);
    }
    if (dense) {
        gated(s->mlp_hidden, s->mlp_mid, mlp_inter, p->path);
        s->in_mlp_mid.used = 0;
        add_product(p, &s->in_mlp_mid, s->mlp_mid, mlp_inter, &L->mlp_down, s->mlp_y);
    }
    phase_run(p, threads);
    for (int j = 0; j < n; j++)
        for (int64_t i = 0; i < H; i++) s->x[i] += weights[j] * s->ye[j * H + i];
    if (dense) {
        const float g = L->shared_gate.kind == MAT_NONE ? 1.0f : 1.0f / (1.0f + expf(-s->gate[0]));
        for (int64_t i = 0; i < H; i++) s->x[i] += g * s->mlp_y[i];
    }
    return 0;
}

static void layer_attention(const hexq_model* m, const hexq_layer* L, int layer, scratch* s, phase* p, int threads,
                            int64_t pos, int path) {
    const int64_t H = m->hidden, D = m->head_dim, QD = (int64_t)m->heads * D, KD = (int64_t)m->kv_heads * D;
    rms_norm(s->x, L->input_norm, s->h, H, m->eps);
    s->in_h.used = 0;
    add_product(p, &s->in_h, s->h, H, &L->q, s->q);
    add_product(p, &s->in_h, s->h, H, &L->k, s->k);
    add_product(p, &s->in_h, s->h, H, &L->v, s->v);
    phase_run(p, threads);
    if (L->qk_norm == QK_WHOLE) {
        rms_norm(s->q, L->q_norm, s->q, QD, m->eps);
        rms_norm(s->k, L->k_norm, s->k, KD, m->eps);
    }
    if (m->clip_qkv > 0.0f) {
        const float c = m->clip_qkv;
        for (int64_t i = 0; i < QD; i++) s->q[i] = fminf(fmaxf(s->q[i], -c), c);
        for (int64_t i = 0; i < KD; i++) s->k[i] = fminf(fmaxf(s->k[i], -c), c);
        for (int64_t i = 0; i < KD; i++) s->v[i] = fminf(fmaxf(s->v[i], -c), c);
    }
    for (int64_t h = 0; h < m->heads; h++) {
        if (L->qk_norm == QK_HEAD) rms_norm(s->q + h * D, L->q_norm, s->q + h * D, D, m->eps);
        rope(s->q + h * D, D, s->cos, s->sin);
    }
    for (int64_t h = 0; h < m->kv_heads; h++) {
        if (L->qk_norm == QK_HEAD) rms_norm(s->k + h * D, L->k_norm, s->k + h * D, D, m->eps);
        rope(s->k + h * D, D, s->cos, s->sin);
        kv_store(m, kv_rows(m, m->k_cache, layer, h), pos, s->k + h * D);
        kv_store(m, kv_rows(m, m->v_cache, layer, h), pos, s->v + h * D);
    }
    const int64_t start = m->sliding_window > 0 && pos - m->sliding_window + 1 > 0 ? pos - m->sliding_window + 1 : 0;
    attention_ctx ctx = {m, s, layer, pos, start, heads_per_item(m, threads)};
    const double began = now();
#ifdef DECODE_X86
    parallel(path == PATH_SCALAR ? attention_heads : attention_heads_avx2, &ctx, m->heads / ctx.per, threads);
#else
    parallel(attention_heads, &ctx, m->heads / ctx.per, threads);
#endif
    profile.attention += now() - began;
    s->in_att.used = 0;
    add_product(p, &s->in_att, s->att, QD, &L->o, s->o);
    phase_run(p, threads);
    for (int64_t i = 0; i < H; i++) s->x[i] += s->o[i];
}

/* A new token: its embedding row into x, and the RoPE angles of its position. */
static void token_start(const hexq_model* m, scratch* s, int32_t token, int64_t pos) {
    const int64_t H = m->hidden;
    if (m->embed_kind == MAT_F32) {
        memcpy(s->x, (const float*)m->embed + (int64_t)token * H, (size_t)H * 4);
    } else {
        const uint16_t* row = (const uint16_t*)m->embed + (int64_t)token * H;
        for (int64_t i = 0; i < H; i++) s->x[i] = bf16_to_float(row[i]);
    }
    for (int64_t i = 0; i < m->head_dim / 2; i++) { /* float32 angle, as the transformers rotary embedding */
        const float angle = (float)pos * m->inv_freq[i];
        s->cos[i] = cosf(angle) * m->rope_scaling;
        s->sin[i] = sinf(angle) * m->rope_scaling;
    }
}

/* One token at position `pos` (the KV cache holds positions [0, pos)): logits [vocab] float32. Returns 0; 1 where a
   kept expert is absent (`r` says where; make it resident and call again with the same arguments and `r`: see
   hexq_resume); -1 for a position past the cache, a path this CPU does not run, or a model the step does not take. */
int hexq_decode(const hexq_model* m, int32_t token, int64_t pos, float* logits, int path, int threads,
                uint8_t* scratch_bytes, hexq_resume* r) {
    if (!(hexq_paths() >> path & 1) || pos < 0 || pos >= m->max_pos || token < 0 || token >= m->vocab
        || m->top_k > 64 || m->num_experts > 1024 || m->heads / m->kv_heads > MAX_GROUP || m->head_dim > MAX_HEAD_DIM
        || r->layer >= m->layers)
        return -1;
    scratch s;
    scratch_layout(m, (uint8_t*)(((uintptr_t)scratch_bytes + 63) / 64 * 64), &s);
    phase p;
    memset(&p, 0, sizeof(p));
    p.path = path;
    p.packed_rows = rows_for(path);
    p.float_rows = float_rows_for(path);
    p.w8a8_rows = w8a8_rows_for(path);
    const int64_t H = m->hidden;
    const int first = r->layer < 0 ? 0 : r->layer;
    if (r->layer < 0) {
        token_start(m, &s, token, pos);
        s.ahead_ids[0] = 0;
    }
    const double began = now();
    pool_hot(1);
    for (int layer = first; layer < m->layers; layer++) {
        const hexq_layer* L = &m->layer[layer];
        const int resuming = layer == r->layer;
        if (!resuming) {
            layer_attention(m, L, layer, &s, &p, threads, pos, path);
            rms_norm(s.x, L->post_norm, s.h, H, m->eps);
        }
        if (layer_ffn(m, L, layer, &s, &p, threads, r, resuming)) {
            r->layer = layer;
            pool_hot(0);
            profile.total += now() - began;
            return 1;
        }
    }
    r->layer = -1;
    rms_norm(s.x, m->final_norm, s.h, H, m->eps);
    s.in_final.used = 0;
    add_product(&p, &s.in_final, s.h, H, &m->head, logits);
    phase_run(&p, threads);
    pool_hot(0);
    profile.total += now() - began;
    profile.steps++;
    return 0;
}
