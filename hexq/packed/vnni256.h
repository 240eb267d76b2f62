/* The rows8 GEMV on 256-bit VNNI (kernels.c "the rows8 layout"), written once and compiled twice by kernels.c: for the
   AVX-512 path (EVEX vpdpbusd, AVX512-VNNI + VL) and for the AVX-VNNI path (VEX vpdpbusd: Alder Lake and later Intel
   client cores, Sierra Forest), which has the same 256-bit instruction without AVX-512. Only the encoding of
   vpdpbusd differs between the two copies; everything else is AVX2, FMA and F16C. The includer defines VNNI256 (the
   functions' target attribute), DPBUSD (the intrinsic: acc += unsigned bytes . signed bytes per dword) and
   VNNI256_NAME(f) (the copy's names). */

/* Block b of 8 rows into acc[t] (8 lanes, one per row): dx8_b times the block's integer dot product with token t's
   int8 x (kernels.c "int8 activation blocks"): one vpdpbusd per dword, codes unsigned and x signed. Two accumulators
   (even and odd dwords) so that the vpdpbusd chains are half as long. */
static VNNI256 INLINE void VNNI256_NAME(rows8_block)(const uint8_t* group8, const quantized_x* xq, int64_t cols,
                                                     int64_t blocks, int64_t b, const int bits, const int ntok,
                                                     __m256* acc) {
    __m256i dot[MAX_TOK][2];
    for (int t = 0; t < ntok; t++) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8 /* every dword's loads and shifts constant, the accumulators in registers */
    for (int d = 0; d < 8; d++) {
        const __m256i q = rows8_dword(group8, b, d, bits);
        for (int t = 0; t < ntok; t++) {
            const int32_t x = ((const int32_t*)(xq->q8 + t * cols + b * BLOCK))[d];
            dot[t][d & 1] = DPBUSD(dot[t][d & 1], q, _mm256_set1_epi32(x));
        }
    }
    for (int t = 0; t < ntok; t++)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot[t][0], dot[t][1])),
                                 _mm256_set1_ps(xq->dx8[t * blocks + b]), acc[t]);
}

/* The end of group g for 8 rows: total += s_g (acc - z_g zx_g), acc cleared (scale and zero: the group's 8 values;
   z4: the zeros as 4-bit integers, kernels.c "zeros as 4-bit integers", one 32-bit word for the 8 rows). */
static VNNI256 INLINE void VNNI256_NAME(rows8_group)(const uint16_t* scale, const void* zero, const int z4,
                                                     const float* const* zx, int64_t g, const int ntok, __m256* acc,
                                                     __m256* total) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)scale));
    __m256 z;
    if (z4) {
        int32_t word;
        memcpy(&word, zero, 4);
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        z = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts),
                                                _mm256_set1_epi32(15)));
    } else {
        z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)zero));
    }
    for (int t = 0; t < ntok; t++) {
        total[t] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_set1_ps(zx[t][g]), acc[t]), total[t]);
        acc[t] = _mm256_setzero_ps();
    }
}

/* The rows8 layout on 256-bit VNNI, 8 rows per pass. A block's dot product for 8 rows: 8 dwords of codes, each times
   one broadcast dword of x's int8 block; per lane |q . x8| <= 32 * 127 * 127 < 2^24, exact in float32. Then
   y = sum_g s_g (sum_{b in g} dx8_b dot_b - z_g sum_{b in g} zx8_b), zx8_b = dx8_b sum(q8_b) from quantize_x: one
   conversion and FMA per block and one float16 scale and zero per group for 8 rows. r0 and r1: multiples of 8. */
static VNNI256 INLINE void VNNI256_NAME(rows8_bits)(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0,
                                                    int64_t r1, const int bits, const int ntok, const int z4) {
    const int64_t cols = t->cols, blocks = cols / BLOCK, row_bytes = cols * bits / 8, groups = cols / t->group;
    const int64_t per_group = t->group / BLOCK;
    /* per token and group: the sum over its blocks of zx8_b; groups of one block read zx8 itself (a pool item is 16
       rows: summing every group of the row per item cost a tenth of this GEMV's time) */
    float sums[MAX_TOK][MAX_BLOCKS];
    const float* zx[MAX_TOK];
    for (int k = 0; k < ntok; k++) {
        zx[k] = per_group == 1 ? xq->zx8 + k * blocks : sums[k];
        for (int64_t g = 0; per_group > 1 && g < groups; g++) {
            float acc = 0.0f;
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) acc += xq->zx8[k * blocks + b];
            sums[k][g] = acc;
        }
    }
    for (int64_t r = r0; r < r1; r += 8) {
        const uint8_t* group8 = t->codes + r * row_bytes;
        const uint16_t* scale = t->scale + r * groups;
        const uint16_t* zero = t->zero + r * groups;
        const uint8_t* zero4 = (const uint8_t*)t->zero + r * groups / 2; /* z4 */
        __m256 total[MAX_TOK], acc[MAX_TOK];
        for (int k = 0; k < ntok; k++) total[k] = acc[k] = _mm256_setzero_ps();
        for (int64_t b = 0, g = 0, in_group = 0; b < blocks; b++) {
            /* the block PREFETCH_BYTES ahead (see "prefetch"): one stream per group of 8 rows */
            const char* ahead = (const char*)group8 + b * 32 * bits + PREFETCH_BYTES;
            for (int o = 0; o < 32 * bits; o += 64) __builtin_prefetch(ahead + o, 0, 3);
            VNNI256_NAME(rows8_block)(group8, xq, cols, blocks, b, bits, ntok, acc);
            if (++in_group == per_group) {
                const void* zeros = z4 ? (const void*)(zero4 + 4 * g) : (const void*)(zero + g * 8);
                VNNI256_NAME(rows8_group)(scale + g * 8, zeros, z4, zx, g, ntok, acc, total);
                g++;
                in_group = 0;
            }
        }
        for (int k = 0; k < ntok; k++) _mm256_storeu_ps(t->y + k * t->y_stride + r, total[k]);
    }
}

/* Rows [r0, r1) of a rows8 task (r0 and r1 multiples of 8; bits 1-7), the width, token count and zeros' form
   spelled out (4-bit zeros: widths 1-4 only, the only ones whose zeros all fit). */
static VNNI256 void VNNI256_NAME(rows8)(const hexq_gemv_task* t, const quantized_x* xq, int64_t r0, int64_t r1) {
#define CASE(B, Z)                                                                           \
    case B:                                                                                  \
        switch (t->ntok) {                                                                   \
            case 1: VNNI256_NAME(rows8_bits)(t, xq, r0, r1, B, 1, Z); return;                \
            case 2: VNNI256_NAME(rows8_bits)(t, xq, r0, r1, B, 2, Z); return;                \
            case 3: VNNI256_NAME(rows8_bits)(t, xq, r0, r1, B, 3, Z); return;                \
            default: VNNI256_NAME(rows8_bits)(t, xq, r0, r1, B, 4, Z); return;               \
        }
    if (t->layout == LAYOUT_ROWS8_Z4) {
        switch (t->bits) { CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) }
    }
    switch (t->bits) { CASE(1, 0) CASE(2, 0) CASE(3, 0) CASE(4, 0) CASE(5, 0) CASE(6, 0) CASE(7, 0) }
#undef CASE
}
