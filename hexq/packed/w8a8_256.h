/* rows_w8a8_avx512 (decode.c) on 256-bit registers for the AVX-VNNI path: the same integer sums, 32 codes per
   vpdpbusd. Written once and compiled twice by decode.c, as vnni256.h is by kernels.c: VEX vpdpbusd where the CPU has
   AVX-VNNI, EVEX where AVX512-VNNI and VL give the instruction (kernels.c rows_avxvnni says why). The includer defines
   VNNI256 (the function's target attribute), DPBUSD (the intrinsic) and VNNI256_NAME(f) (the copy's name). */

static VNNI256 void VNNI256_NAME(rows_w8a8)(const hexq_matrix* m, const act_codes* a, float* y, int64_t r0,
                                             int64_t r1) {
    const int64_t n = m->cols, ahead = prefetch_ahead(n);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* q = (const uint8_t*)m->data + r * n;
        if (r + ahead < m->rows)
            for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(q + ahead * n + o, 0, 3);
        __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256(), sums = _mm256_setzero_si256();
        int64_t c = 0;
        for (; c + 64 <= n; c += 64) {
            const __m256i q0 = _mm256_loadu_si256((const __m256i*)(q + c));
            const __m256i q1 = _mm256_loadu_si256((const __m256i*)(q + c + 32));
            dot0 = DPBUSD(dot0, q0, _mm256_loadu_si256((const __m256i*)(a->q + c)));
            dot1 = DPBUSD(dot1, q1, _mm256_loadu_si256((const __m256i*)(a->q + c + 32)));
            sums = _mm256_add_epi64(sums, _mm256_add_epi64(_mm256_sad_epu8(q0, _mm256_setzero_si256()),
                                                           _mm256_sad_epu8(q1, _mm256_setzero_si256())));
        }
        int32_t lanes[8];
        int64_t wide[4];
        _mm256_storeu_si256((__m256i*)lanes, _mm256_add_epi32(dot0, dot1));
        _mm256_storeu_si256((__m256i*)wide, sums);
        int64_t qc = 0, qsum = wide[0] + wide[1] + wide[2] + wide[3];
        for (int i = 0; i < 8; i++) qc += lanes[i];
        for (; c < n; c++) { /* the last cols % 64 */
            qc += (int64_t)q[c] * a->q[c];
            qsum += q[c];
        }
        y[r] = w8a8_row((double)qc, (double)qsum, _cvtsh_ss(m->zero[r]), _cvtsh_ss(m->scale[r]), a, n);
    }
}
