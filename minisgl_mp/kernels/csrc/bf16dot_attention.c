/*
 * Causal attention of long query runs (prefill chunks, extends over a cached prefix) on
 * AVX512-BF16's dot-product instruction, for models whose linear products run there
 * (bfloat16 weights on a CPU without AMX, bf16dot_gemm.c): amx_attention.c's numerics without
 * its tiles. Same arguments as extend_attention.c's kernel: q, out [T, Hq, D] float32; k, v
 * [S, Hkv, D] the float32 pool of one layer, read through kv_index [B, stride]; q_start,
 * q_len, kv_len [B]. D a multiple of 32; whole query groups.
 *
 * Q (times the softmax scale), K, V and the probabilities are rounded to bfloat16 for the two
 * products; the scores, the online softmax and the output accumulate in float32. The blocking
 * is extend_attention.c's: a work item is (request, kv head, block of QB query tokens), whose
 * rows (query tokens times the head's query heads) meet tiles of KT keys; scores are held
 * transposed (each row a vector lane) so the softmax runs down the lanes. Each product step
 * takes a pair of values: for the scores a pair of head dims (queries stored as pairs per row,
 * each key's pair broadcast), for the values a pair of keys (the tile's V interleaved key by
 * key, each row's pair of probabilities broadcast). Tiles past a block's last position are
 * skipped.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpos.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <math.h>

#define QB 64 /* query tokens per work item */
#define KT 48 /* keys per tile (even: whole pairs) */
#define RK 6  /* keys per register block of scores: 6 keys x 4 vectors of rows, 24 of 32 registers */
#define NVR 4
#define RC (NVR * 16) /* rows per chunk of scores */
#define RB 8          /* rows per register block of values: 8 rows x 2 vectors of 16 channels */

/* 16 floats rounded to bfloat16 (nearest even) and widened into the low halves of 16 lanes. */
static inline __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

/* Pairs (lo[i], hi[i]) of bfloat16 values, one per 32-bit lane: the operand layout of vdpbf16ps. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    return _mm512_or_si512(bf16_lanes(lo), _mm512_slli_epi32(bf16_lanes(hi), 16));
}

/* Scores of R keys (kb: the tile's keys in bfloat16, d values a key, from key j0) against a
 * chunk of RC rows, transposed: s[j][0:RC] (lds floats a key). qt: the rows' query pairs, ldq
 * pairs a head-dim pair. R is a literal at each call site. */
static inline __attribute__((always_inline)) void scores_keys(const uint16_t *kb, const uint32_t *qt, int64_t ldq,
                                                              int64_t d, float *s, int64_t lds, const int R) {
    __m512 a[RK][NVR];
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j)
#pragma GCC unroll 4
        for (int u = 0; u < NVR; ++u) a[j][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; ++p) {
        __m512bh qv[NVR];
#pragma GCC unroll 4
        for (int u = 0; u < NVR; ++u) qv[u] = (__m512bh)_mm512_loadu_si512((const void *)(qt + p * ldq + u * 16));
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) {
            int32_t pair;
            memcpy(&pair, kb + j * d + 2 * p, 4);
            const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int u = 0; u < NVR; ++u) a[j][u] = _mm512_dpbf16_ps(a[j][u], kp, qv[u]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j)
#pragma GCC unroll 4
        for (int u = 0; u < NVR; ++u) _mm512_storeu_ps(s + j * lds + u * 16, a[j][u]);
}

/* R rows of acc[., c : c + 32] += P[., keys] V[keys, c : c + 32], a pair of keys a step: pb the
 * rows' probability pairs (ldp a key pair), vb the tile's values interleaved key by key
 * (vb[jp][ch][2], d channels a pair). */
static inline __attribute__((always_inline)) void values_rows(const uint32_t *pb, int64_t ldp, int64_t npairs,
                                                              const uint16_t *vb, int64_t c, int64_t d, float *acc,
                                                              const int R) {
    __m512 a0[RB], a1[RB];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_loadu_ps(acc + r * d + c);
        a1[r] = _mm512_loadu_ps(acc + r * d + c + 16);
    }
    for (int64_t jp = 0; jp < npairs; ++jp) {
        const uint16_t *vp = vb + (jp * d + c) * 2;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)vp);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(vp + 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[jp * ldp + r]);
            a0[r] = _mm512_dpbf16_ps(a0[r], pp, v0);
            a1[r] = _mm512_dpbf16_ps(a1[r], pp, v1);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc + r * d + c, a0[r]);
        _mm512_storeu_ps(acc + r * d + c + 16, a1[r]);
    }
}

/* Returns 0, -1 when scratch space could not be allocated (the output is then incomplete), or
 * -2 for a head dim or grouping it does not take. */
int extend_attention_bf16dot(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                             const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                             int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    if (d % 32 != 0 || hq % hkv != 0) return -2;
    const int64_t groups = hq / hkv;
    const int64_t rows_max = (QB * groups + RC - 1) / RC * RC;
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    if (!first_item) return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < batch; ++b) first_item[b + 1] = first_item[b] + hkv * ((q_len[b] + QB - 1) / QB);
    const int64_t items = first_item[batch];
    int failed = 0;
#pragma omp parallel
    {
        const unsigned int csr = _mm_getcsr(); /* denormals flushed in this call only */
        _mm_setcsr(csr | 0x8040);
        uint32_t *qt = malloc(sizeof(uint32_t) * (size_t)(rows_max * d / 2));
        float *acc = malloc(sizeof(float) * (size_t)(rows_max * d));
        float *s = malloc(sizeof(float) * (size_t)(rows_max * KT));
        uint32_t *pb = malloc(sizeof(uint32_t) * (size_t)(rows_max * KT / 2));
        uint16_t *kb = malloc(sizeof(uint16_t) * (size_t)(KT * d));
        uint16_t *vb = malloc(sizeof(uint16_t) * (size_t)(KT * d));
        float *run_max = malloc(sizeof(float) * (size_t)rows_max);
        float *run_sum = malloc(sizeof(float) * (size_t)rows_max);
        float *tile_max = malloc(sizeof(float) * (size_t)rows_max);
        if (!qt || !acc || !s || !pb || !kb || !vb || !run_max || !run_sum || !tile_max) {
#pragma omp atomic write
            failed = 1;
        }
        const __m512 vscale = _mm512_set1_ps(scale);
        /* Later blocks of a request see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = items - 1; w >= 0; --w) {
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) continue;
            int64_t b = 0;
            while (first_item[b + 1] <= w) ++b;
            const int64_t local = w - first_item[b], h = local % hkv, blk = local / hkv;
            const int64_t nq = q_len[b], first = kv_len[b] - nq; /* query i sits at position first + i */
            const int64_t i0 = blk * QB, ni = nq - i0 < QB ? nq - i0 : QB;
            const int64_t rows = ni * groups; /* row r = (query i0 + r / groups, head h * groups + r % groups) */
            const int64_t rows_pad = (rows + RC - 1) / RC * RC; /* padding rows: zero queries, never written */
            const int64_t *slots = kv_index + b * stride;
            const float *qb = q + q_start[b] * hq * d;
            for (int64_t r = 0; r < rows_pad; ++r) {
                if (r < rows) {
                    const float *src = qb + ((i0 + r / groups) * hq + h * groups + r % groups) * d;
                    for (int64_t e = 0; e < d; e += 32) {
                        uint32_t pairs[16];
                        /* 32 dims into 16 pairs: even dims in the low halves, odd in the high */
                        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + e), vscale);
                        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + e + 16), vscale);
                        const __m512i idx_even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                                                   28, 30);
                        const __m512i idx_odd = _mm512_add_epi32(idx_even, _mm512_set1_epi32(1));
                        const __m512 even = _mm512_permutex2var_ps(lo, idx_even, hi);
                        const __m512 odd = _mm512_permutex2var_ps(lo, idx_odd, hi);
                        _mm512_storeu_si512((void *)pairs, bf16_pairs(even, odd));
                        for (int i = 0; i < 16; ++i) qt[(e / 2 + i) * rows_pad + r] = pairs[i];
                    }
                } else {
                    for (int64_t p = 0; p < d / 2; ++p) qt[p * rows_pad + r] = 0;
                }
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(rows * d));
            const int64_t keys = first + i0 + ni; /* the block's last query sees keys [0, keys) */
            for (int64_t t0 = 0; t0 < keys; t0 += KT) {
                const int64_t nk = keys - t0 < KT ? keys - t0 : KT, npairs = (nk + 1) / 2;
                /* The tile's keys in bfloat16 rows, its values interleaved a pair of keys at a
                 * time (an odd last key paired with zeros). */
                for (int64_t j = 0; j < nk; ++j) {
                    const float *kr = k + (slots[t0 + j] * hkv + h) * d;
                    for (int64_t e = 0; e < d; e += 16)
                        _mm256_storeu_si256((__m256i *)(kb + j * d + e), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(kr + e)));
                }
                for (int64_t jp = 0; jp < npairs; ++jp) {
                    const float *va = v + (slots[t0 + 2 * jp] * hkv + h) * d;
                    const float *vz = 2 * jp + 1 < nk ? v + (slots[t0 + 2 * jp + 1] * hkv + h) * d : NULL;
                    for (int64_t c = 0; c < d; c += 16) {
                        const __m512 hi = vz ? _mm512_loadu_ps(vz + c) : _mm512_setzero_ps();
                        _mm512_storeu_si512((void *)(vb + (jp * d + c) * 2), bf16_pairs(_mm512_loadu_ps(va + c), hi));
                    }
                }
                for (int64_t c = 0; c < rows_pad; c += RC) {
                    int64_t j = 0;
                    for (; j + RK <= nk; j += RK)
                        scores_keys(kb + j * d, qt + c, rows_pad, d, s + j * rows_pad + c, rows_pad, RK);
                    for (; j < nk; ++j) scores_keys(kb + j * d, qt + c, rows_pad, d, s + j * rows_pad + c, rows_pad, 1);
                }
                /* Key t0 + j is hidden from the rows of queries before it: a prefix of the rows. */
                for (int64_t j = 0; j < nk; ++j) {
                    int64_t hidden = (t0 + j - first - i0) * groups;
                    hidden = hidden < 0 ? 0 : hidden > rows_pad ? rows_pad : hidden;
                    for (int64_t r = 0; r < hidden; ++r) s[j * rows_pad + r] = -INFINITY;
                }
                /* Online softmax, each row a lane: every row sees key 0 in the first tile, so its
                 * running max is finite from then on. */
                memcpy(tile_max, run_max, sizeof(float) * (size_t)rows_pad);
                for (int64_t j = 0; j < nk; ++j) {
                    const float *sj = s + j * rows_pad;
#pragma omp simd
                    for (int64_t r = 0; r < rows_pad; ++r) tile_max[r] = sj[r] > tile_max[r] ? sj[r] : tile_max[r];
                }
                for (int64_t r = 0; r < rows; ++r)
                    if (tile_max[r] != run_max[r]) {
                        const float corr = exp_nonpos(run_max[r] - tile_max[r]); /* 0 on the first tile */
                        float *a = acc + r * d;
#pragma omp simd
                        for (int64_t e = 0; e < d; ++e) a[e] *= corr;
                        run_sum[r] *= corr;
                    }
                for (int64_t j = 0; j < nk; ++j) {
                    float *sj = s + j * rows_pad;
#pragma omp simd
                    for (int64_t r = 0; r < rows_pad; ++r) {
                        sj[r] = exp_nonpos(sj[r] - tile_max[r]);
                        run_sum[r] += sj[r];
                    }
                }
                memcpy(run_max, tile_max, sizeof(float) * (size_t)rows_pad);
                /* The probabilities as bfloat16 pairs of keys per row (an odd last key paired
                 * with a zero), then P V. run_sum keeps the float32 probabilities' sum. */
                for (int64_t jp = 0; jp < npairs; ++jp) {
                    const float *s0 = s + 2 * jp * rows_pad, *s1 = s0 + rows_pad;
                    const int odd_last = 2 * jp + 1 >= nk;
                    for (int64_t r = 0; r < rows_pad; r += 16) {
                        const __m512 hi = odd_last ? _mm512_setzero_ps() : _mm512_loadu_ps(s1 + r);
                        _mm512_storeu_si512((void *)(pb + jp * rows_pad + r), bf16_pairs(_mm512_loadu_ps(s0 + r), hi));
                    }
                }
                for (int64_t c = 0; c < d; c += 32) {
                    int64_t r = 0;
                    for (; r + RB <= rows; r += RB) values_rows(pb + r, rows_pad, npairs, vb, c, d, acc + r * d, RB);
                    for (; r < rows; ++r) values_rows(pb + r, rows_pad, npairs, vb, c, d, acc + r * d, 1);
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *dst = out + (q_start[b] + i0 + r / groups) * hq * d + (h * groups + r % groups) * d;
                const float inv = 1.0f / run_sum[r];
                for (int64_t e = 0; e < d; ++e) dst[e] = acc[r * d + e] * inv;
            }
        }
        free(qt);
        free(acc);
        free(s);
        free(pb);
        free(kb);
        free(vb);
        free(run_max);
        free(run_sum);
        free(tile_max);
        _mm_setcsr(csr);
    }
    free(first_item);
    return failed ? -1 : 0;
}
#else
int extend_attention_bf16dot(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                             const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                             int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    (void)q, (void)k, (void)v, (void)kv_index, (void)stride, (void)q_start, (void)q_len, (void)kv_len, (void)out;
    (void)batch, (void)hq, (void)hkv, (void)d, (void)scale;
    return -2;
}
#endif
