/*
 * Causal attention of long query runs (prefill chunks, extends over a cached prefix) on the CPU,
 * float32, reading K and V from the paged pool through the page table. Same layouts and
 * arguments as paged_attention.c (q, out [T, Hq, D]; k, v [S, Hkv, D]; kv_index [B, stride];
 * q_start, q_len, kv_len [B]); D must be a multiple of 32.
 *
 * Why beside paged_attention.c: that kernel takes a query row at a time against each key (dot
 * products), right for decodes, but its cost grows with queries x keys at well under the FMA
 * rate; PyTorch's flash kernel blocks the products but runs a 256-token prompt in 64-row
 * blocks at about half the matrix rate (docs/benchmarks.md section 19). Here a work item is
 * (request, kv head, block of QB query tokens): the block's rows (its query tokens times the kv
 * head's query heads) meet tiles of KT keys, both products in the register-tiled
 * outer-product form, with an online softmax between them:
 * - scores are computed transposed, s[key][row]: RK keys' values are broadcast from the pool
 *   rows in place against vectors of the rows' queries (transposed once per item), so no key is
 *   ever copied, and the softmax runs with each row a vector lane;
 * - values: RB rows of accumulators take each key's value vectors, read in place, once.
 * Tiles past a block's last position are skipped, and within the tiles on the diagonal each
 * register block of rows stops at the last key its last row sees, so a causal prompt costs
 * about half its square rather than a tile-rounded 0.7 of it (docs/benchmarks.md section 25).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "exp_nonpos.h"

/* Query tokens per work item. */
#define QB 64
#define KT 48 /* keys per tile */
#define QT_SKEW 16 /* floats of padding per row of the transposed queries (see ldq) */

/* One vector of the build's native width. GCC splits a wider generic vector into native ones
 * badly: 16-float vectors on an AVX2 build kept their accumulators on the stack and built each
 * broadcast through integer moves, and ran this kernel 15-20x slower than sdpa. */
#if defined(__AVX512F__)
#define VW 16
#define RK 6  /* keys per register block of scores: 6 keys x 4 vectors of rows, 24 of 32 registers */
#define NVR 4
#define RB 8  /* rows per register block of values: 8 x 2 vectors */
#else
#if defined(__AVX__)
#define VW 8
#else
#define VW 4  /* SSE, or the compiler's lowering of 4-float vectors elsewhere */
#endif
#define RK 6  /* 16 registers: 6 x 2 accumulators, 2 vectors of queries, a broadcast */
#define NVR 2
#define RB 6
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
#define RC (NVR * VW) /* rows per chunk of scores */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Scores of R keys (krow[j]: key j's d values) against a chunk of RC rows, transposed: s[j][0:RC]
 * (lds floats a key) = k_j . qt[., rows] (qt: the rows' queries transposed, ldq floats a dim).
 * The keys are read in place from the pool; R is a literal at each call site. */
static inline __attribute__((always_inline)) void scores_keys(const float *const *krow, const float *qt,
                                                              int64_t ldq, int64_t d, float *s, int64_t lds,
                                                              const int R) {
    vf a[RK][NVR];
    for (int j = 0; j < R; ++j)
        for (int u = 0; u < NVR; ++u) a[j][u] = (vf){0};
    for (int64_t e = 0; e < d; ++e) {
        vf qv[NVR];
        for (int u = 0; u < NVR; ++u) qv[u] = vload(qt + e * ldq + u * VW);
        for (int j = 0; j < R; ++j) {
            const float x = krow[j][e];
            for (int u = 0; u < NVR; ++u) a[j][u] += x * qv[u];
        }
    }
    for (int j = 0; j < R; ++j)
        for (int u = 0; u < NVR; ++u) vstore(s + j * lds + u * VW, a[j][u]);
}

/* Keys [0, nk) of a tile that row r can see: those up to vis0 + r / groups (the causal mask;
 * vis0 = row 0's position minus the tile's first key), at most nk. */
static inline int64_t visible_keys(int64_t vis0, int64_t r, int64_t groups, int64_t nk) {
    const int64_t n = vis0 + r / groups + 1;
    return n < 0 ? 0 : n < nk ? n : nk;
}

/* Each chunk of RC rows stops at the last key its last row sees: the scores past it are all
 * hidden from the chunk, and the caller's mask overwrites them with -inf. */
static void scores_tile(const float *const *krow, int64_t nk, const float *qt, int64_t ldq, int64_t rows_pad,
                        int64_t d, float *s, int64_t vis0, int64_t groups) {
    for (int64_t c = 0; c < rows_pad; c += RC) {
        const int64_t nkc = visible_keys(vis0, c + RC - 1, groups, nk);
        int64_t j = 0;
        for (; j + RK <= nkc; j += RK) scores_keys(krow + j, qt + c, ldq, d, s + j * rows_pad + c, rows_pad, RK);
        for (; j < nkc; ++j) scores_keys(krow + j, qt + c, ldq, d, s + j * rows_pad + c, rows_pad, 1);
    }
}

/* R rows of acc[., c : c + 2 VW] += p[., nk] . V[nk keys, c : c + 2 VW] (vrow[j]: key j's values; p
 * transposed, ldp floats a key). */
static inline __attribute__((always_inline)) void values_rows(const float *p, int64_t ldp, int64_t nk,
                                                              const float *const *vrow, int64_t c, int64_t d,
                                                              float *acc, const int R) {
    vf a0[RB], a1[RB];
    for (int r = 0; r < R; ++r) {
        a0[r] = vload(acc + r * d + c);
        a1[r] = vload(acc + r * d + c + VW);
    }
    for (int64_t j = 0; j < nk; ++j) {
        const vf v0 = vload(vrow[j] + c), v1 = vload(vrow[j] + c + VW);
        for (int r = 0; r < R; ++r) {
            const float x = p[j * ldp + r];
            a0[r] += x * v0;
            a1[r] += x * v1;
        }
    }
    for (int r = 0; r < R; ++r) {
        vstore(acc + r * d + c, a0[r]);
        vstore(acc + r * d + c + VW, a1[r]);
    }
}

/* Each block of rows takes the keys its last row sees: the weights of the rest are 0 for it. */
static void values_tile(const float *p, int64_t ldp, int64_t rows, int64_t nk, const float *const *vrow,
                        int64_t d, float *acc, int64_t vis0, int64_t groups) {
    for (int64_t c = 0; c < d; c += 2 * VW) {
        int64_t r = 0;
        for (; r + RB <= rows; r += RB)
            values_rows(p + r, ldp, visible_keys(vis0, r + RB - 1, groups, nk), vrow, c, d, acc + r * d, RB);
        for (; r < rows; ++r) values_rows(p + r, ldp, visible_keys(vis0, r, groups, nk), vrow, c, d, acc + r * d, 1);
    }
}

/* Returns 0, or -1 when scratch space could not be allocated (the output is then incomplete). */
int extend_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    if (d % (2 * VW) != 0 || hq % hkv != 0) return -2;
    const int64_t groups = hq / hkv;
    const int64_t rows_max = (QB * groups + RC - 1) / RC * RC;
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
        float *qt = malloc(sizeof(float) * (size_t)((rows_max + QT_SKEW) * d));
        float *acc = malloc(sizeof(float) * (size_t)(rows_max * d));
        float *s = malloc(sizeof(float) * (size_t)(rows_max * KT));
        float *run_max = malloc(sizeof(float) * (size_t)rows_max);
        float *run_sum = malloc(sizeof(float) * (size_t)rows_max);
        float *tile_max = malloc(sizeof(float) * (size_t)rows_max);
        const float **krow = malloc(sizeof(float *) * KT);
        const float **vrow = malloc(sizeof(float *) * KT);
        if (!qt || !acc || !s || !run_max || !run_sum || !tile_max || !krow || !vrow) {
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
            const int64_t rows_pad = (rows + RC - 1) / RC * RC; /* padding rows: zero queries, never written */
            /* qt's rows (one a dim) one line more apart than rows_pad: at 128 rows they were 512
             * bytes apart, so the transposing stores, a line for each of d dims at every query
             * row, met in an eighth of L1's sets and evicted each other; that copy was a fifth of
             * the kernel's time on 256-token prompts (docs/benchmarks.md section 25). */
            const int64_t ldq = rows_pad + QT_SKEW;
            const int64_t *slots = kv_index + b * stride;
            const float *qb = q + q_start[b] * hq * d;
            for (int64_t r = 0; r < rows_pad; ++r) {
                if (r < rows) {
                    const float *src = qb + ((i0 + r / groups) * hq + h * groups + r % groups) * d;
                    for (int64_t e = 0; e < d; ++e) qt[e * ldq + r] = src[e] * scale;
                } else {
                    for (int64_t e = 0; e < d; ++e) qt[e * ldq + r] = 0.0f;
                }
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(rows * d));
            const int64_t keys = first + i0 + ni; /* the block's last query sees keys [0, keys) */
            for (int64_t t0 = 0; t0 < keys; t0 += KT) {
                const int64_t nk = keys - t0 < KT ? keys - t0 : KT;
                for (int64_t j = 0; j < nk; ++j) {
                    krow[j] = k + (slots[t0 + j] * hkv + h) * d;
                    vrow[j] = v + (slots[t0 + j] * hkv + h) * d;
                }
                const int64_t vis0 = first + i0 - t0; /* row 0's position, from the tile's first key */
                scores_tile(krow, nk, qt, ldq, rows_pad, d, s, vis0, groups);
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
                values_tile(s, rows_pad, rows, nk, vrow, d, acc, vis0, groups);
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
        free(run_max);
        free(run_sum);
        free(tile_max);
        free(krow);
        free(vrow);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    free(first_item);
    return failed ? -1 : 0;
}
