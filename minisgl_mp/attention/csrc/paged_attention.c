/*
 * Paged attention on the CPU for short query runs: decode (one query token per request) and
 * short extends over a cached prefix. It reads K and V straight from the paged pool through
 * the page table, so no gathered copy of the cache is ever made.
 *
 * Layouts (float32, row-major, contiguous):
 *   q, out     [T, Hq, D]      the batch's query tokens, request by request
 *   k, v       [S, Hkv, D]     one layer of the pool; a slot is a token position
 *   kv_index   [B, stride]     the page table rows: slot of each token position
 *   q_start    [B]             first row of request b in q / out
 *   q_len      [B]             query tokens of request b (its newest tokens)
 *   kv_len     [B]             tokens of request b with KV in the pool, queries included
 * Query i of request b sits at position kv_len - q_len + i and sees keys [0, that position].
 * Work is split over requests (and over kv heads when requests are few); the Hq / Hkv query
 * heads of a kv head share its reads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

/* exp(x) for x <= 0 (softmax inputs after subtracting the max), vectorizable: x = n ln2 + r,
 * e^r from a degree-6 polynomial (relative error ~2e-7), 2^n built in the exponent bits. */
static inline float exp_nonpos(float x) {
    /* Below e^-80 a probability is as good as 0; keeping it would only make products with V
     * denormal, and denormal arithmetic is ~100x slower on x86. */
    const float keep = x < -80.0f ? 0.0f : 1.0f;
    x = x < -80.0f ? -80.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } bits = {.i = ((int32_t)n + 127) << 23};
    return keep * p * bits.f;
}

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* Four dot products of one query row with four keys at once. A single dot of 128 floats is a
 * chain of dependent multiply-adds ending in a horizontal sum; four independent chains keep the
 * FMA units busy and share the query loads (measured: the q.k pass was most of the kernel).
 * n must be a multiple of 16. GCC/Clang vector extensions: AVX-512, AVX2 or SSE as built. */
typedef float vf16 __attribute__((vector_size(64)));

static inline vf16 load16(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(vf16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

static void dot4(const float *restrict q, const float *restrict k0, const float *restrict k1,
                 const float *restrict k2, const float *restrict k3, int64_t n, float out[4]) {
    vf16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j = 0; j < n; j += 16) {
        const vf16 qv = load16(q + j);
        a0 += qv * load16(k0 + j);
        a1 += qv * load16(k1 + j);
        a2 += qv * load16(k2 + j);
        a3 += qv * load16(k3 + j);
    }
    out[0] = hsum16(a0);
    out[1] = hsum16(a1);
    out[2] = hsum16(a2);
    out[3] = hsum16(a3);
}

int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index,
                        int64_t stride, const int64_t *q_start, const int64_t *q_len,
                        const int64_t *kv_len, float *out, int64_t batch, int64_t hq, int64_t hkv,
                        int64_t d, float scale, int64_t head_chunks) {
    const int64_t groups = hq / hkv;
    /* A work item is (request, chunk of kv heads). With whole slot rows per item the reads of
     * a request run along memory (a slot's heads are adjacent); chunks only split the heads
     * when there are too few requests to keep every thread busy. */
    const int64_t per_chunk = hkv / head_chunks;
    int64_t max_rows = 0, max_keys = 0;
    for (int64_t b = 0; b < batch; ++b) {
        if (q_len[b] > max_rows) max_rows = q_len[b];
        if (kv_len[b] > max_keys) max_keys = kv_len[b];
    }
    max_rows *= per_chunk * groups;
    int failed = 0;
#pragma omp parallel
    {
#if defined(__SSE__)
        /* Flush denormals to zero in this call only (the threads are torch's: restore after). */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#endif
        float *scores = malloc(sizeof(float) * (size_t)(max_rows * max_keys));
        float *acc = malloc(sizeof(float) * (size_t)(max_rows * d));
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < batch * head_chunks; ++w) {
            if (failed) continue;
            const int64_t b = w / head_chunks, h0 = (w % head_chunks) * per_chunk;
            const int64_t nq = q_len[b], nk = kv_len[b], first = nk - nq;
            const int64_t qheads = per_chunk * groups;     /* query heads of this item */
            const int64_t rows = nq * qheads;              /* row r = i * qheads + head */
            const int64_t *slots = kv_index + b * stride;
            const float *qb = q + (q_start[b] * hq + h0 * groups) * d;
            int64_t t = 0;
            /* Blocks of four keys that every query row sees (all of a decode's keys). */
            if (d % 16 == 0)
                for (; t + 4 <= first + 1 && t + 4 <= nk; t += 4) {
                    const float *k0 = k + (slots[t] * hkv + h0) * d, *k1 = k + (slots[t + 1] * hkv + h0) * d;
                    const float *k2 = k + (slots[t + 2] * hkv + h0) * d, *k3 = k + (slots[t + 3] * hkv + h0) * d;
                    for (int64_t i = 0; i < nq; ++i)
                        for (int64_t qh = 0; qh < qheads; ++qh) {
                            const int64_t off = (qh / groups) * d;
                            float sc[4];
                            dot4(qb + (i * hq + qh) * d, k0 + off, k1 + off, k2 + off, k3 + off, d, sc);
                            float *row = scores + (i * qheads + qh) * nk + t;
                            row[0] = sc[0] * scale;
                            row[1] = sc[1] * scale;
                            row[2] = sc[2] * scale;
                            row[3] = sc[3] * scale;
                        }
                }
            for (; t < nk; ++t) {
                const float *kr = k + (slots[t] * hkv + h0) * d;
                const int64_t i0 = t > first ? t - first : 0; /* queries that see key t */
                for (int64_t i = i0; i < nq; ++i)
                    for (int64_t qh = 0; qh < qheads; ++qh)
                        scores[(i * qheads + qh) * nk + t] =
                            dot(qb + (i * hq + qh) * d, kr + (qh / groups) * d, d) * scale;
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *s = scores + r * nk;
                const int64_t n = first + r / qheads + 1; /* keys this row sees */
                float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; ++t) {
                    s[t] = exp_nonpos(s[t] - m);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) s[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(rows * d));
            for (int64_t t = 0; t < nk; ++t) {
                const float *vr = v + (slots[t] * hkv + h0) * d;
                const int64_t i0 = t > first ? t - first : 0;
                for (int64_t r = i0 * qheads; r < rows; ++r) {
                    const float p = scores[r * nk + t];
                    const float *vh = vr + ((r % qheads) / groups) * d;
                    float *a = acc + r * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; ++j) a[j] += p * vh[j];
                }
            }
            for (int64_t i = 0; i < nq; ++i)
                memcpy(out + ((q_start[b] + i) * hq + h0 * groups) * d, acc + i * qheads * d,
                       sizeof(float) * (size_t)(qheads * d));
        }
        free(scores);
        free(acc);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
