/*
 * Causal attention of long query runs (prefill chunks, extends over a cached prefix) on the CPU,
 * float32, reading K and V from the paged pool through the page table. Same layouts and
 * arguments as paged_attention.c (q, out [T, Hq, D]; k, v [S, Hkv, D]; kv_index [B, stride];
 * q_start, q_len, kv_len [B]); D must be a multiple of 32.
 *
 * Why beside paged_attention.c: that kernel takes a query row at a time against each key (dot
 * products), right for decodes, but its cost grows with queries x keys at well under the FMA
 * rate; PyTorch's flash kernel blocks the products but runs a 256-token prompt in 64-row
 * blocks at about a third of the matrix rate (docs/benchmarks.md section 19). Here a work item
 * is (request, kv head, block of QB query tokens): the block's rows (its query tokens times the
 * kv head's query heads) are held against tiles of KT keys, both products in the
 * register-tiled outer-product form (RB rows of accumulators, the key tile's vectors loaded once
 * per step and shared by the rows), with an online softmax between them. The scores need the
 * key tile transposed (d rows of KT keys), which each item does for the tiles it sees. Tiles past a block's
 * last query position are skipped, so a causal prompt costs half its square.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

typedef float vf __attribute__((vector_size(64))); /* 16 floats: one zmm, two ymm or four xmm */
#define VW 16

/* Query tokens per work item. Every item transposes the key tiles it sees, so larger blocks
 * transpose less; 64 measured faster than 32 on 256-token prompts and as fast as 128. */
#define QB 64
#if defined(__AVX512F__)
#define RB 8  /* rows per register block */
#define NVK 3 /* vectors of scores per row in a key tile: 8 x 3 accumulators, 24 of 32 registers */
#else
#define RB 3  /* AVX2's 16 registers: 3 x 2 accumulators of two ymm each */
#define NVK 2
#endif
#define KT (NVK * VW) /* keys per tile */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* exp(x) for x <= 0, as in paged_attention.c (degree-6 polynomial, 2^n in the exponent bits). */
static inline float exp_nonpos(float x) {
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

/* R rows of s[., KT] = qs[., d] . kt[d, KT] (kt: the key tile transposed, KT floats a row). R is
 * a literal at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores_rows(const float *qs, int64_t d, const float *kt,
                                                              float *s, const int R) {
    vf a[RB][NVK];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NVK; ++u) a[r][u] = (vf){0};
    for (int64_t j = 0; j < d; ++j) {
        vf kv[NVK];
        for (int u = 0; u < NVK; ++u) kv[u] = vload(kt + j * KT + u * VW);
        for (int r = 0; r < R; ++r) {
            const float x = qs[r * d + j];
            for (int u = 0; u < NVK; ++u) a[r][u] += x * kv[u];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NVK; ++u) vstore(s + r * KT + u * VW, a[r][u]);
}

static void scores_tile(const float *qs, int64_t rows, int64_t d, const float *kt, float *s) {
    int64_t r = 0;
    for (; r + RB <= rows; r += RB) scores_rows(qs + r * d, d, kt, s + r * KT, RB);
    for (; r < rows; ++r) scores_rows(qs + r * d, d, kt, s + r * KT, 1);
}

/* R rows of acc[., c : c + 32] += p[., nk] . V[nk keys, c : c + 32] (vrow[j]: key j's values). */
static inline __attribute__((always_inline)) void values_rows(const float *p, int64_t nk, const float *const *vrow,
                                                              int64_t c, int64_t d, float *acc, const int R) {
    vf a0[RB], a1[RB];
    for (int r = 0; r < R; ++r) {
        a0[r] = vload(acc + r * d + c);
        a1[r] = vload(acc + r * d + c + VW);
    }
    for (int64_t j = 0; j < nk; ++j) {
        const vf v0 = vload(vrow[j] + c), v1 = vload(vrow[j] + c + VW);
        for (int r = 0; r < R; ++r) {
            const float x = p[r * KT + j];
            a0[r] += x * v0;
            a1[r] += x * v1;
        }
    }
    for (int r = 0; r < R; ++r) {
        vstore(acc + r * d + c, a0[r]);
        vstore(acc + r * d + c + VW, a1[r]);
    }
}

static void values_tile(const float *p, int64_t rows, int64_t nk, const float *const *vrow, int64_t d,
                        float *acc) {
    for (int64_t c = 0; c < d; c += 2 * VW) {
        int64_t r = 0;
        for (; r + RB <= rows; r += RB) values_rows(p + r * KT, nk, vrow, c, d, acc + r * d, RB);
        for (; r < rows; ++r) values_rows(p + r * KT, nk, vrow, c, d, acc + r * d, 1);
    }
}

/* Returns 0, or -1 when scratch space could not be allocated (the output is then incomplete). */
int extend_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    if (d % (2 * VW) != 0 || hq % hkv != 0) return -2;
    const int64_t groups = hq / hkv;
    const int64_t rows_max = QB * groups;
    /* items: for each request, hkv heads x ceil(q_len / QB) blocks */
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    if (!first_item) return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < batch; ++b) first_item[b + 1] = first_item[b] + hkv * ((q_len[b] + QB - 1) / QB);
    const int64_t items = first_item[batch];
    int failed = 0;
#pragma omp parallel
    {
#if defined(__SSE__)
        const unsigned int csr = _mm_getcsr(); /* denormals flushed in this call only */
        _mm_setcsr(csr | 0x8040);
#endif
        float *qs = malloc(sizeof(float) * (size_t)(rows_max * d));
        float *acc = malloc(sizeof(float) * (size_t)(rows_max * d));
        float *s = malloc(sizeof(float) * (size_t)(rows_max * KT));
        float *kt = malloc(sizeof(float) * (size_t)(d * KT));
        float *run_max = malloc(sizeof(float) * (size_t)rows_max);
        float *run_sum = malloc(sizeof(float) * (size_t)rows_max);
        const float **vrow = malloc(sizeof(float *) * KT);
        if (!qs || !acc || !s || !kt || !run_max || !run_sum || !vrow) {
#pragma omp atomic write
            failed = 1;
        }
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
            const int64_t *slots = kv_index + b * stride;
            const float *qb = q + q_start[b] * hq * d;
            for (int64_t r = 0; r < rows; ++r) {
                const float *src = qb + ((i0 + r / groups) * hq + h * groups + r % groups) * d;
                for (int64_t j = 0; j < d; ++j) qs[r * d + j] = src[j] * scale;
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(rows * d));
            const int64_t keys = first + i0 + ni; /* the block's last query sees keys [0, keys) */
            for (int64_t t0 = 0; t0 < keys; t0 += KT) {
                const int64_t nk = keys - t0 < KT ? keys - t0 : KT;
                for (int64_t j = 0; j < KT; ++j) {
                    if (j < nk) {
                        const float *kr = k + (slots[t0 + j] * hkv + h) * d;
                        for (int64_t e = 0; e < d; ++e) kt[e * KT + j] = kr[e];
                        vrow[j] = v + (slots[t0 + j] * hkv + h) * d;
                    } else {
                        for (int64_t e = 0; e < d; ++e) kt[e * KT + j] = 0.0f;
                    }
                }
                scores_tile(qs, rows, d, kt, s);
                for (int64_t r = 0; r < rows; ++r) {
                    /* keys of this tile that row r's query sees: positions <= first + its index */
                    const int64_t last = first + i0 + r / groups;
                    const int64_t seen = last - t0 + 1 < nk ? last - t0 + 1 : nk;
                    float *sr = s + r * KT;
                    if (seen <= 0) {
                        memset(sr, 0, sizeof(float) * KT);
                        continue;
                    }
                    float m = run_max[r];
                    for (int64_t j = 0; j < seen; ++j) m = sr[j] > m ? sr[j] : m;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < seen; ++j) {
                        sr[j] = exp_nonpos(sr[j] - m);
                        sum += sr[j];
                    }
                    for (int64_t j = seen; j < KT; ++j) sr[j] = 0.0f;
                    if (m != run_max[r]) {
                        const float corr = exp_nonpos(run_max[r] - m); /* 0 on the first tile */
                        float *a = acc + r * d;
#pragma omp simd
                        for (int64_t j = 0; j < d; ++j) a[j] *= corr;
                        run_sum[r] *= corr;
                        run_max[r] = m;
                    }
                    run_sum[r] += sum;
                }
                values_tile(s, rows, nk, vrow, d, acc);
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *dst = out + (q_start[b] + i0 + r / groups) * hq * d + (h * groups + r % groups) * d;
                const float inv = 1.0f / run_sum[r];
                for (int64_t j = 0; j < d; ++j) dst[j] = acc[r * d + j] * inv;
            }
        }
        free(qs);
        free(acc);
        free(s);
        free(kt);
        free(run_max);
        free(run_sum);
        free(vrow);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    free(first_item);
    return failed ? -1 : 0;
}
