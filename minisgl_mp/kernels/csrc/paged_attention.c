/*
 * Paged attention on the CPU for short query runs: decode (one query token per request) and
 * short extends over a cached prefix. It reads K and V straight from the paged pool through
 * the page table, so no gathered copy of the cache is ever made.
 *
 * Layouts (row-major, contiguous; queries and outputs float32, arithmetic in float32):
 *   q, out     [T, Hq, D]      the batch's query tokens, request by request
 *   k, v       [S, Hkv, D]     one layer of the pool, float32 (paged_attention_f32) or bfloat16
 *                              (paged_attention_bf16kv: widened on load, half the bytes read);
 *                              a slot is a token position
 *   kv_index   [B, stride]     the page table rows: slot of each token position
 *   q_start    [B]             first row of request b in q / out
 *   q_len      [B]             query tokens of request b (its newest tokens)
 *   kv_len     [B]             tokens of request b with KV in the pool, queries included
 * Query i of request b sits at position kv_len - q_len + i and sees keys [0, that position].
 * Work is split over requests (and over runs of a request's key blocks when requests are few);
 * the Hq / Hkv query heads of a kv head share its reads. A query row's result is the same, bit
 * for bit, whatever the batch, the split or the other rows of its request (see KEY_BLOCK).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "exp_nonpos.h"

/* Vectors of the build's native width (VW floats). GCC lowers a wider generic vector badly:
 * 16-float vectors on an AVX2 build lived on the stack, and this kernel read its K/V at well
 * under half the memory's rate there (docs/benchmarks.md section 20).
 * K/V elements are read through kv_load / kv_at, so one kernel body serves both pool dtypes:
 * `bf16` is a compile-time constant in each exported entry point, and the always-inline body
 * is specialised for it. A bfloat16 is the top half of a float32: widening is a shift. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf kv_load(const void *base, int64_t off, int bf16) {
    if (!bf16) return vload((const float *)base + off);
    vu16 h;
    memcpy(&h, (const uint16_t *)base + off, sizeof h);
    const vu32 w = __builtin_convertvector(h, vu32) << 16;
    vf f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float kv_at(const void *base, int64_t off, int bf16) {
    if (!bf16) return ((const float *)base)[off];
    const uint32_t w = (uint32_t)((const uint16_t *)base)[off] << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* The keys of a tile that every query row sees (all of a decode's) go KEY_CHUNK at a time, kv
 * head by kv head, and each load of a chunk's rows goes beside a prefetch of the same line in
 * the row PF_AHEAD keys on, into L2 (PF_HINT; see stream_rows). Chunks and distances of 8 to
 * 32 keys measured alike on the Zen 5 of docs/benchmarks.md section 24. */
#ifndef KEY_CHUNK
#define KEY_CHUNK 16
#endif
#ifndef PF_AHEAD
#define PF_AHEAD KEY_CHUNK
#endif
#ifndef PF_HINT
#define PF_HINT 2
#endif

/* One query row . one key (any d). Where n is a whole number of vectors this is dot4's
 * arithmetic for one key: the same lane accumulators, then the halving tree hsum4 takes (upper
 * half onto lower, down to one lane), so a key's score does not depend on which loop computed
 * it: an extend's later query rows score their last keys here, the same query decoded alone
 * scores them in dot4 (see block_partial). */
static inline float dot(const float *restrict q, const void *kv, int64_t off, int64_t n, int bf16) {
    if (n % VW == 0) {
        vf a = {0};
        for (int64_t j = 0; j < n; j += VW) a += vload(q + j) * kv_load(kv, off + j, bf16);
        float lanes[VW];
        memcpy(lanes, &a, sizeof a);
        for (int w = VW / 2; w >= 1; w /= 2)
            for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
        return lanes[0];
    }
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += q[i] * kv_at(kv, off + i, bf16);
    return s;
}

/* The four sums of four vectors, by a shuffle tree (halves of pairs added, then halves of
 * those): fewer shuffles and adds than four separate horizontal sums, each a chain of its own. */
static inline void hsum4(vf a0, vf a1, vf a2, vf a3, float out[4]) {
#if VW == 16
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* b01: eight partial sums of a0, then eight of a1; b23 likewise */
    const vf c = __builtin_shufflevector(b01, b23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(b01, b23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    /* c: four partial sums each of a0, a1, a2, a3 */
    const vf e = c + __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vf f = e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = f[0];
    out[1] = f[4];
    out[2] = f[8];
    out[3] = f[12];
#elif VW == 8
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    /* b01: four partial sums of a0, then four of a1; b23 likewise */
    const vf c = __builtin_shufflevector(b01, b23, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(b01, b23, 2, 3, 10, 11, 6, 7, 14, 15);
    /* c: two partial sums each of a0, a2, a1, a3 */
    const vf e = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = e[0];
    out[1] = e[4];
    out[2] = e[2];
    out[3] = e[6];
#else
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 4, 5) + __builtin_shufflevector(a0, a1, 2, 3, 6, 7);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 4, 5) + __builtin_shufflevector(a2, a3, 2, 3, 6, 7);
    const vf c = __builtin_shufflevector(b01, b23, 0, 2, 4, 6) + __builtin_shufflevector(b01, b23, 1, 3, 5, 7);
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
#endif
}

/* Four dot products of one query row with four keys at once. A single dot of 128 floats is a
 * chain of dependent multiply-adds ending in a horizontal sum; four independent chains keep the
 * FMA units busy and share the query loads (measured: the q.k pass was most of the kernel).
 * n must be a multiple of 16. GCC/Clang vector extensions: AVX-512, AVX2 or SSE as built. */
static inline void dot4(const float *restrict q, const void *k, int64_t o0, int64_t o1, int64_t o2,
                        int64_t o3, int64_t n, int bf16, const char *const *pf, float out[4]) {
    const int64_t es = bf16 ? 2 : 4;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j = 0; j < n; j += VW) {
        if (pf && (j * es & 63) == 0) /* a line a row */
            for (int c = 0; c < 4; ++c) __builtin_prefetch(pf[c] + j * es, 0, PF_HINT);
        const vf qv = vload(q + j);
        a0 += qv * kv_load(k, o0 + j, bf16);
        a1 += qv * kv_load(k, o1 + j, bf16);
        a2 += qv * kv_load(k, o2 + j, bf16);
        a3 += qv * kv_load(k, o3 + j, bf16);
    }
    hsum4(a0, a1, a2, a3, out);
}

/* dot4 for two query rows that share the keys (two query heads of one kv head): each key chunk
 * is loaded, and widened, once for both. */
static inline void dot4x2(const float *restrict q0, const float *restrict q1, const void *k, int64_t o0,
                          int64_t o1, int64_t o2, int64_t o3, int64_t n, int bf16, const char *const *pf,
                          float out0[4], float out1[4]) {
    const int64_t es = bf16 ? 2 : 4;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    for (int64_t j = 0; j < n; j += VW) {
        if (pf && (j * es & 63) == 0) /* a line a row */
            for (int c = 0; c < 4; ++c) __builtin_prefetch(pf[c] + j * es, 0, PF_HINT);
        const vf x = vload(q0 + j), y = vload(q1 + j);
        const vf k0 = kv_load(k, o0 + j, bf16), k1 = kv_load(k, o1 + j, bf16);
        const vf k2 = kv_load(k, o2 + j, bf16), k3 = kv_load(k, o3 + j, bf16);
        a0 += x * k0;
        a1 += x * k1;
        a2 += x * k2;
        a3 += x * k3;
        c0 += y * k0;
        c1 += y * k1;
        c2 += y * k2;
        c3 += y * k3;
    }
    hsum4(a0, a1, a2, a3, out0);
    hsum4(c0, c1, c2, c3, out1);
}

/* The numerics do not depend on how a request is batched, split or decoded (a verification
 * step's query rows must give exactly what decoding them one at a time gives, or speculative
 * decoding would change greedy answers wherever two logits nearly tie). So a row's keys fall in
 * fixed blocks of KEY_BLOCK positions, [0, KEY_BLOCK), [KEY_BLOCK, 2 KEY_BLOCK), ..., whatever
 * the request's length; each block gives the row a partial (its max, its sum of exponentials
 * and its unnormalised accumulator), and the partials are merged in block order (merge_block)
 * by whichever thread holds them. Splitting a request over threads only decides where the
 * partials are merged, never the arithmetic; a thread's scratch stays bounded by its query
 * rows, never by the context. */
#define KEY_BLOCK 128

/* The part buffer (the split requests' block partials) is kept under this size: a call that
 * would need more runs unsplit, with the same results. */
#define MAX_PART_BYTES ((size_t)64 << 20)

static inline int64_t request_blocks(int64_t nk) { return (nk + KEY_BLOCK - 1) / KEY_BLOCK; }

/* The threads a request of nk keys is split over: at most key_splits, at least a block each. */
static inline int64_t request_splits(int64_t nk, int64_t key_splits) {
    const int64_t blocks = request_blocks(nk);
    return key_splits < blocks ? key_splits : blocks;
}

/* One row's state (acc[d], *m, *s) absorbs a block's partial (blk[d], bm, bs); a block the
 * row sees no key of (bm = -inf) leaves it as it is. The state starts at (0, -inf, 0). */
static inline void merge_block(float *restrict acc, float *m, float *s, const float *restrict blk, float bm,
                               float bs, int64_t d) {
    if (bm == -INFINITY) return;
    const float mn = bm > *m ? bm : *m;
    const float a = exp_nonpos(*m - mn), c = exp_nonpos(bm - mn); /* a is 0 on the first block */
    *s = *s * a + bs * c;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) acc[j] = acc[j] * a + blk[j] * c;
    *m = mn;
}

static inline void normalise(float *out, const float *acc, float sum, int64_t d) {
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) out[j] = acc[j] * inv;
}

/* Accumulator vectors a row keeps in registers in pv_rows: R rows x DC vectors plus DC loaded
 * values must fit the register file (32 zmm; 16 ymm or xmm). */
#if VW == 16
#define PV_MAX_VECS 8
#else
#define PV_MAX_VECS 4
#endif

/* The rows the chunk of keys [c0, c0 + n) prefetches, one per key: those of the key PF_AHEAD
 * further on in this pass (rows of `cur`, keys before cur_end), and past the pass's end those
 * of the next pass (rows of `nxt`, keys from nxt_start, before nxt_end); past both, the key's
 * own row (in cache already). The chunked loops below issue one prefetch per cache line they
 * load, at the same offset in these rows: a slot's row is a 4 KiB page for the 0.6B shape's
 * heads in float32 and a request's slots lie scattered over the pool, and the hardware
 * prefetchers stop at page boundaries, so without this each row would begin with a wait on
 * memory. */
static inline void stream_rows(const char **pf, int64_t c0, int64_t n, const int64_t *slots, int64_t row_bytes,
                               const void *cur, int64_t cur_end, const void *nxt, int64_t nxt_start,
                               int64_t nxt_end) {
    for (int64_t c = 0; c < n; ++c) {
        int64_t p = c0 + c + PF_AHEAD;
        if (p < cur_end) {
            pf[c] = (const char *)cur + slots[p] * row_bytes;
            continue;
        }
        p = nxt_start + (p - cur_end);
        pf[c] = p < nxt_end ? (const char *)nxt + slots[p] * row_bytes : (const char *)cur + slots[c0 + c] * row_bytes;
    }
}

/* acc rows (R of them, acc_ld apart) += sum over n keys c of p[r][c] * V[slot c][off .. off +
 * DC * VW): the R rows' accumulator vectors stay in registers over the keys, so each value is
 * loaded once for the R query heads of its kv head and no accumulator is loaded or stored per
 * key. R and DC are literals at every call site. */
static inline __attribute__((always_inline)) void pv_rows(float *acc, int64_t acc_ld, const float *p, int64_t p_ld,
                                                          const void *v, const int64_t *slots, int64_t n,
                                                          int64_t row_elems, int64_t off, const char *const *pf,
                                                          const int bf16, const int R, const int DC) {
    const int64_t es = bf16 ? 2 : 4;
    vf a[2][PV_MAX_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int x = 0; x < DC; ++x) a[r][x] = vload(acc + r * acc_ld + x * VW);
    for (int64_t c = 0; c < n; ++c) {
        const int64_t o = slots[c] * row_elems + off;
        if (pf)
#pragma GCC unroll 8
            for (int x = 0; x < DC; x += 64 / (VW * es) > 0 ? 64 / (VW * es) : 1)
                __builtin_prefetch(pf[c] + (off + x * VW) * es, 0, PF_HINT);
        vf w[PV_MAX_VECS];
#pragma GCC unroll 8
        for (int x = 0; x < DC; ++x) w[x] = kv_load(v, o + x * VW, bf16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const float pr = p[r * p_ld + c];
#pragma GCC unroll 8
            for (int x = 0; x < DC; ++x) a[r][x] += pr * w[x];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int x = 0; x < DC; ++x) memcpy(acc + r * acc_ld + x * VW, &a[r][x], sizeof(vf));
}

/* pv_rows over a whole head row of d elements, in runs of the most vectors that divide it. */
static inline __attribute__((always_inline)) void pv_head(float *acc, int64_t acc_ld, const float *p, int64_t p_ld,
                                                          const void *v, const int64_t *slots, int64_t n,
                                                          int64_t row_elems, int64_t off, int64_t d,
                                                          const char *const *pf, const int bf16, const int R) {
    const int64_t vecs = d / VW;
    const int dc = vecs % 8 == 0 && PV_MAX_VECS >= 8 ? 8 : vecs % 4 == 0 ? 4 : vecs % 2 == 0 ? 2 : 1;
    for (int64_t j = 0; j < d; j += dc * VW) {
        switch (dc) {
        /* (8 only where the registers hold it: the case is never taken elsewhere) */
        case 8: pv_rows(acc + j, acc_ld, p, p_ld, v, slots, n, row_elems, off + j, pf, bf16, R, PV_MAX_VECS); break;
        case 4: pv_rows(acc + j, acc_ld, p, p_ld, v, slots, n, row_elems, off + j, pf, bf16, R, 4); break;
        case 2: pv_rows(acc + j, acc_ld, p, p_ld, v, slots, n, row_elems, off + j, pf, bf16, R, 2); break;
        default: pv_rows(acc + j, acc_ld, p, p_ld, v, slots, n, row_elems, off + j, pf, bf16, R, 1); break;
        }
    }
}

/* One block's partial for every query row of request b (keys [t0, t1), the query rows seeing
 * keys [0, first + i]): scores, their max and exponentials per row into blk_max / blk_sum, and
 * the weighted values into blk (zeroed here). A row that sees none of the block gets max -inf.
 * `bf16` is a literal at the call site. */
static inline __attribute__((always_inline)) void block_partial(
    const float *qb, const void *k, const void *v, const int64_t *slots, int64_t nq, int64_t first, int64_t t0,
    int64_t t1, int64_t next_end, int64_t hq, int64_t hkv, int64_t d, float scale, float *scores, float *blk,
    float *blk_max, float *blk_sum, const int bf16) {
    const int64_t groups = hq / hkv, row_elems = hkv * d, rows = nq * hq;
    const int64_t esize = bf16 ? 2 : 4, row_bytes = row_elems * esize;
    memset(blk, 0, sizeof(float) * (size_t)(rows * d));
    /* [t0, all) are the keys of the block every query row sees (all of a decode's). They go in
     * chunks of KEY_CHUNK, kv head by kv head, each load of a chunk's rows beside a prefetch of
     * the row PF_AHEAD keys on (stream_rows): the keys, then the values. Only the first query
     * token's pass prefetches (an extend's later ones would only repeat it, at the cost of a
     * load slot each). */
    const int64_t all = first + 1 < t1 ? first + 1 : t1;
    int64_t t = t0;
    if (d % 16 == 0)
        for (int64_t c0 = t0; c0 + 4 <= all; c0 += KEY_CHUNK) {
            const int64_t c1 = c0 + ((all - c0 < KEY_CHUNK ? all - c0 : KEY_CHUNK) & ~(int64_t)3);
            const char *pf[KEY_CHUNK];
            stream_rows(pf, c0, c1 - c0, slots, row_bytes, k, all, v, t0, all);
            for (int64_t h = 0; h < hkv; ++h) {
                const int64_t hb = h * d * esize;
                for (int64_t i = 0; i < nq; ++i) {
                    int64_t qh = h * groups;
                    const int64_t qe = qh + groups;
                    for (; qh + 2 <= qe; qh += 2) /* query heads in pairs of one kv head */
                        for (int64_t c = c0; c < c1; c += 4) {
                            const char *ph[4] = {pf[c - c0] + hb, pf[c - c0 + 1] + hb, pf[c - c0 + 2] + hb,
                                                 pf[c - c0 + 3] + hb};
                            float s0[4], s1[4];
                            dot4x2(qb + (i * hq + qh) * d, qb + (i * hq + qh + 1) * d, k,
                                   slots[c] * row_elems + h * d, slots[c + 1] * row_elems + h * d,
                                   slots[c + 2] * row_elems + h * d, slots[c + 3] * row_elems + h * d, d, bf16,
                                   i == 0 ? ph : NULL, s0, s1);
                            float *row0 = scores + (i * hq + qh) * KEY_BLOCK + (c - t0);
                            float *row1 = row0 + KEY_BLOCK;
                            for (int x = 0; x < 4; ++x) {
                                row0[x] = s0[x] * scale;
                                row1[x] = s1[x] * scale;
                            }
                        }
                    for (; qh < qe; ++qh)
                        for (int64_t c = c0; c < c1; c += 4) {
                            const char *ph[4] = {pf[c - c0] + hb, pf[c - c0 + 1] + hb, pf[c - c0 + 2] + hb,
                                                 pf[c - c0 + 3] + hb};
                            float sc[4];
                            dot4(qb + (i * hq + qh) * d, k, slots[c] * row_elems + h * d,
                                 slots[c + 1] * row_elems + h * d, slots[c + 2] * row_elems + h * d,
                                 slots[c + 3] * row_elems + h * d, d, bf16, i == 0 ? ph : NULL, sc);
                            float *row = scores + (i * hq + qh) * KEY_BLOCK + (c - t0);
                            for (int x = 0; x < 4; ++x) row[x] = sc[x] * scale;
                        }
                }
            }
            t = c1;
        }
    for (; t < t1; ++t) {
        const int64_t kr = slots[t] * row_elems;
        const int64_t i0 = t > first ? t - first : 0; /* queries that see key t */
        for (int64_t i = i0; i < nq; ++i)
            for (int64_t qh = 0; qh < hq; ++qh)
                scores[(i * hq + qh) * KEY_BLOCK + (t - t0)] =
                    dot(qb + (i * hq + qh) * d, k, kr + (qh / groups) * d, d, bf16) * scale;
    }
    /* The block's softmax per row: its max, the exponentials and their sum. */
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t seen = first + r / hq + 1 - t0; /* keys of the block row r sees */
        if (seen <= 0) {
            blk_max[r] = -INFINITY;
            blk_sum[r] = 0.0f;
            continue;
        }
        const int64_t n = seen < t1 - t0 ? seen : t1 - t0;
        float *sr = scores + r * KEY_BLOCK;
        float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            sr[j] = exp_nonpos(sr[j] - m);
            sum += sr[j];
        }
        blk_max[r] = m;
        blk_sum[r] = sum;
    }
    /* The values of the keys every row weighs, chunk by chunk and kv head by kv head, each
     * head's rows accumulating in registers (pv_rows); then prefetches of the next block's keys. */
    t = t0;
    if (d % VW == 0) {
        for (int64_t c0 = t0; c0 < all; c0 += KEY_CHUNK) {
            const int64_t c1 = c0 + KEY_CHUNK < all ? c0 + KEY_CHUNK : all;
            const char *pf[KEY_CHUNK];
            stream_rows(pf, c0, c1 - c0, slots, row_bytes, v, all, k, t1, next_end);
            for (int64_t h = 0; h < hkv; ++h) {
                for (int64_t i = 0; i < nq; ++i) {
                    int64_t qh = h * groups;
                    const int64_t qe = qh + groups;
                    for (; qh + 2 <= qe; qh += 2) {
                        const int64_t r = i * hq + qh;
                        pv_head(blk + r * d, d, scores + r * KEY_BLOCK + (c0 - t0), KEY_BLOCK, v, slots + c0,
                                c1 - c0, row_elems, h * d, d, i == 0 ? pf : NULL, bf16, 2);
                    }
                    for (; qh < qe; ++qh) {
                        const int64_t r = i * hq + qh;
                        pv_head(blk + r * d, d, scores + r * KEY_BLOCK + (c0 - t0), KEY_BLOCK, v, slots + c0,
                                c1 - c0, row_elems, h * d, d, i == 0 ? pf : NULL, bf16, 1);
                    }
                }
            }
        }
        t = all > t0 ? all : t0;
    }
    for (; t < t1; ++t) {
        const int64_t vr = slots[t] * row_elems;
        const int64_t i0 = t > first ? t - first : 0;
        for (int64_t r = i0 * hq; r < rows; ++r) {
            const float p = scores[r * KEY_BLOCK + (t - t0)];
            const int64_t vh = vr + ((r % hq) / groups) * d;
            float *a = blk + r * d;
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) a[j] += p * kv_at(v, vh + j, bf16);
        }
    }
}

/* The part buffer: [batch, max_blocks, max_rows, d + 2], a block partial's accumulator, then
 * its max and sum. */
static inline float *part_at(float *part, int64_t b, int64_t block, int64_t r, int64_t max_blocks,
                             int64_t max_rows, int64_t d) {
    return part + ((b * max_blocks + block) * max_rows + r) * (d + 2);
}

/* What one thread does for the work items it takes (see attend). `bf16` is a literal at both
 * call sites, so each copy reads its pool's dtype without a test per load. */
static inline __attribute__((always_inline)) void attend_items(
    const float *q, const void *k, const void *v, const int64_t *kv_index, int64_t stride,
    const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out, int64_t batch,
    int64_t hq, int64_t hkv, int64_t d, float scale, int64_t key_splits, int64_t max_rows, int64_t max_blocks,
    float *part, int *failed, const int bf16) {
    /* scores [rows, KEY_BLOCK] (64-byte aligned, every row alike, so a row's reductions never
     * depend on where its buffer fell), a block's partial: blk [rows, d], max and sum [rows];
     * the merged state: acc [rows, d], max and sum [rows] */
    const size_t score_bytes = (sizeof(float) * (size_t)(max_rows * KEY_BLOCK) + 63) & ~(size_t)63;
    float *scores = aligned_alloc(64, score_bytes);
    float *blk = malloc(sizeof(float) * (size_t)(max_rows * d));
    float *acc = malloc(sizeof(float) * (size_t)(max_rows * d));
    float *stats = malloc(sizeof(float) * (size_t)(4 * max_rows));
    if (!scores || !blk || !acc || !stats) {
#pragma omp atomic write
        *failed = 1;
    }
    float *blk_max = stats, *blk_sum = stats + max_rows, *run_max = stats + 2 * max_rows,
          *run_sum = stats + 3 * max_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < batch * key_splits; ++w) {
        int stop;
#pragma omp atomic read
        stop = *failed;
        if (stop) continue;
        const int64_t b = w / key_splits, split = w % key_splits;
        const int64_t nq = q_len[b], nk = kv_len[b], first = nk - nq;
        const int64_t blocks = request_blocks(nk), splits = request_splits(nk, key_splits);
        if (split >= splits) continue;
        const int64_t per_split = (blocks + splits - 1) / splits;
        const int64_t bs = split * per_split, be = bs + per_split < blocks ? bs + per_split : blocks;
        const int64_t ke = be * KEY_BLOCK < nk ? be * KEY_BLOCK : nk;
        const int64_t rows = nq * hq; /* row r = i * hq + head */
        const int64_t *slots = kv_index + b * stride;
        const float *qb = q + q_start[b] * hq * d;
        if (splits == 1) {
            memset(acc, 0, sizeof(float) * (size_t)(rows * d));
            for (int64_t r = 0; r < rows; ++r) {
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
        }
        for (int64_t j = bs; j < be; ++j) {
            const int64_t t0 = j * KEY_BLOCK, t1 = t0 + KEY_BLOCK < nk ? t0 + KEY_BLOCK : nk;
            block_partial(qb, k, v, slots, nq, first, t0, t1, ke, hq, hkv, d, scale, scores, blk, blk_max, blk_sum,
                          bf16);
            for (int64_t r = 0; r < rows; ++r) {
                if (splits == 1) {
                    merge_block(acc + r * d, run_max + r, run_sum + r, blk + r * d, blk_max[r], blk_sum[r], d);
                    continue;
                }
                float *pb = part_at(part, b, j, r, max_blocks, max_rows, d); /* the merge pass finishes it */
                memcpy(pb, blk + r * d, sizeof(float) * (size_t)d);
                pb[d] = blk_max[r];
                pb[d + 1] = blk_sum[r];
            }
        }
        if (splits == 1)
            for (int64_t r = 0; r < rows; ++r) normalise(out + q_start[b] * hq * d + r * d, acc + r * d, run_sum[r], d);
    }
    free(scores);
    free(blk);
    free(acc);
    free(stats);
}

static inline __attribute__((always_inline)) int attend(
    const float *q, const void *k, const void *v, const int64_t *kv_index, int64_t stride,
    const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out, int64_t batch,
    int64_t hq, int64_t hkv, int64_t d, float scale, int64_t key_splits, const int bf16) {
    /* A work item is (request, run of its key blocks), over every head: a slot's heads are
     * adjacent, so an item's reads run along memory, and the query heads of a kv head share
     * its loads. Requests are split by key blocks (up to key_splits runs) only when there are
     * too few of them to keep every thread streaming: one core alone reads at about half the
     * machine's rate. Split items leave their blocks' partials, which a second pass merges in
     * the order an unsplit item merges them. */
    if (key_splits < 1) key_splits = 1;
    int64_t max_rows = 0, max_blocks = 0;
    for (int64_t b = 0; b < batch; ++b) {
        if (q_len[b] > max_rows) max_rows = q_len[b];
        if (request_blocks(kv_len[b]) > max_blocks) max_blocks = request_blocks(kv_len[b]);
    }
    max_rows *= hq;
    const size_t part_bytes = sizeof(float) * (size_t)(batch * max_blocks * max_rows * (d + 2));
    if (key_splits > 1 && part_bytes > MAX_PART_BYTES) key_splits = 1;
    float *part = NULL;
    if (key_splits > 1) {
        part = malloc(part_bytes);
        if (!part) return -1;
    }
    int failed = 0;
#pragma omp parallel
    {
#if defined(__SSE__)
        /* Flush denormals to zero in this call only (the threads are torch's: restore after). */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#endif
        /* Within the parallel region a const argument is a shared variable, not a constant:
         * branch once here so that each copy of the work is compiled for its dtype. */
        if (bf16)
            attend_items(q, k, v, kv_index, stride, q_start, q_len, kv_len, out, batch, hq, hkv, d, scale,
                         key_splits, max_rows, max_blocks, part, &failed, 1);
        else
            attend_items(q, k, v, kv_index, stride, q_start, q_len, kv_len, out, batch, hq, hkv, d, scale,
                         key_splits, max_rows, max_blocks, part, &failed, 0);
        if (part) {
            /* Merge each split request's block partials, row by row, in block order. */
            int stop;
#pragma omp atomic read
            stop = failed;
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < batch * max_rows; ++w) {
                const int64_t b = w / max_rows, r = w % max_rows;
                if (stop || request_splits(kv_len[b], key_splits) < 2 || r >= q_len[b] * hq) continue;
                float *o = out + q_start[b] * hq * d + r * d;
                float m = -INFINITY, sum = 0.0f;
                memset(o, 0, sizeof(float) * (size_t)d);
                for (int64_t j = 0; j < request_blocks(kv_len[b]); ++j) {
                    const float *pb = part_at(part, b, j, r, max_blocks, max_rows, d);
                    merge_block(o, &m, &sum, pb, pb[d], pb[d + 1], d);
                }
                normalise(o, o, sum, d);
            }
        }
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    free(part);
    return failed ? -1 : 0;
}

int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index,
                        int64_t stride, const int64_t *q_start, const int64_t *q_len,
                        const int64_t *kv_len, float *out, int64_t batch, int64_t hq, int64_t hkv,
                        int64_t d, float scale, int64_t key_splits) {
    return attend(q, k, v, kv_index, stride, q_start, q_len, kv_len, out, batch, hq, hkv, d, scale,
                  key_splits, 0);
}

int paged_attention_bf16kv(const float *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *kv_index, int64_t stride, const int64_t *q_start,
                           const int64_t *q_len, const int64_t *kv_len, float *out, int64_t batch,
                           int64_t hq, int64_t hkv, int64_t d, float scale, int64_t key_splits) {
    return attend(q, k, v, kv_index, stride, q_start, q_len, kv_len, out, batch, hq, hkv, d, scale,
                  key_splits, 1);
}
