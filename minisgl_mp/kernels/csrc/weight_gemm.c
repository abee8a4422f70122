/*
 * y[M, N] = x[M, K] W[N, K]^T (* scale[N]) (+ bias[N]) with x and y float32 and W stored as
 * float32, float16, bfloat16, int8 (weight-only, per-output-channel float scale) or int4 (Q4
 * blocks, below). Each weight vector is widened to float32 in registers and used for up to
 * RMAX rows of x at once, so a small batch reads W from memory once: the product is bound by
 * the weight bytes.
 *
 * From PANEL_MIN_ROWS rows the widening would be repeated for every RMAX rows and would bound
 * the product instead: there each thread widens a unit of output channels once per call into
 * the float32 column panel of packed_gemm.c (on the fly, in a per-thread buffer that stays in
 * L2) and runs that kernel's register tile over every row, so a stored format multiplies at
 * the float32 panels' rate while still reading only its own bytes from memory.
 *
 * int4 (FMT_Q4): rows of K / 32 blocks of 20 bytes, llama.cpp's block_q4_1 as GGUF files hold
 * it: float16 scale d, float16 minimum m, then 16 bytes whose low nibbles are the block's
 * elements 0-15 and high nibbles elements 16-31; element = d * q + m. K is a multiple of 32.
 *
 * The ISA is fixed at build time from the compiler's target (-march=native, or an override
 * that removes AVX-512): AVX-512F, else AVX2 + FMA + F16C, else plain C. `weight_gemm_isa`
 * says which one this build took.
 *
 * Layout: W row-major, one output channel per row, K contiguous; x rows contiguous, y rows
 * `ldy` apart. Threads split the output channels in blocks of CBLOCK (static schedule, so each
 * thread streams one contiguous run of W).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "claim_units.h"
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_num_threads(void) { return 1; }
#endif

/* 4 and 5 are decode_layers.c's packed bfloat16 kinds, which do not come here. */
enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_I8 = 3, FMT_Q4 = 6 };
#define Q4_GROUP 32
#define Q4_BLOCK 20 /* bytes a block: d, m (float16), 16 bytes of nibbles */

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal half: normalise */
        int e = -1;
        uint32_t m = man;
        do { m <<= 1; ++e; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const unsigned char *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Element i of an int4 row. */
static inline float q4_scalar(const unsigned char *row, int64_t i) {
    const unsigned char *blk = row + (i / Q4_GROUP) * Q4_BLOCK;
    const int j = (int)(i % Q4_GROUP);
    const int q = j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4;
    return f16_to_f32(load_u16(blk)) * (float)q + f16_to_f32(load_u16(blk + 2));
}

/* Element i of a weight row in format FMT, widened. */
static inline float w_scalar(const void *row, int64_t i, const int fmt) {
    switch (fmt) {
    case FMT_F32: return ((const float *)row)[i];
    case FMT_F16: return f16_to_f32(((const uint16_t *)row)[i]);
    case FMT_BF16: return bf16_to_f32(((const uint16_t *)row)[i]);
    case FMT_Q4: return q4_scalar((const unsigned char *)row, i);
    default: return (float)((const int8_t *)row)[i];
    }
}

/* Bytes from a row's start to its element i (i a multiple of 32 for int4), and a row's bytes. */
static inline int64_t w_offset(int64_t i, const int fmt) {
    switch (fmt) {
    case FMT_F32: return 4 * i;
    case FMT_I8: return i;
    case FMT_Q4: return i / Q4_GROUP * Q4_BLOCK;
    default: return 2 * i;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define ISA 512
#define VL 16
#define RMAX 4
#define CMAX 4
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOADX(p) _mm512_loadu_ps(p)
#define VSUM(v) _mm512_reduce_add_ps(v)
static inline vf vload_w(const void *row, int64_t i, const int fmt) {
    switch (fmt) {
    case FMT_F32: return _mm512_loadu_ps((const float *)row + i);
    case FMT_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    case FMT_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))), 16));
    case FMT_Q4: {
        /* 16 elements: the low (first half of a block) or high nibbles of its 16 bytes */
        const unsigned char *blk = (const unsigned char *)row + (i >> 5) * Q4_BLOCK;
        const __m128i b = _mm_srl_epi16(_mm_loadu_si128((const __m128i *)(blk + 4)), _mm_cvtsi32_si128((int)(i & 16) >> 2));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0f))));
        int32_t dm_bits;
        memcpy(&dm_bits, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)); /* d, m, 0, 0 */
        return _mm512_fmadd_ps(q, _mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    }
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + i))));
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA 256
#define VL 8
#define RMAX 4
#define CMAX 4
/* 16 ymm registers: up to 8 accumulators plus the loads. One or two rows still take four
 * channels, so a lone row has four independent FMA chains to hide the FMA latency. */
#define CWIDTH(R) ((R) <= 2 ? 4 : 2)
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOADX(p) _mm256_loadu_ps(p)
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vload_w(const void *row, int64_t i, const int fmt) {
    switch (fmt) {
    case FMT_F32: return _mm256_loadu_ps((const float *)row + i);
    case FMT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    case FMT_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    case FMT_Q4: {
        /* 8 elements: low (first half of a block) or high nibbles of 8 of its bytes */
        const unsigned char *blk = (const unsigned char *)row + (i >> 5) * Q4_BLOCK;
        const __m128i b = _mm_srl_epi16(_mm_loadl_epi64((const __m128i *)(blk + 4 + (i & 8))), _mm_cvtsi32_si128((int)(i & 16) >> 2));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0f))));
        int32_t dm_bits;
        memcpy(&dm_bits, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)); /* d, m, 0, 0 */
        return _mm256_fmadd_ps(q, _mm256_broadcastss_ps(dm), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
    }
    default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
    }
}
#else
#define ISA 0
#define VL 1
#define RMAX 4
#define CMAX 4
typedef float vf;
#define VZERO() 0.0f
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VLOADX(p) (*(p))
#define VSUM(v) (v)
static inline vf vload_w(const void *row, int64_t i, const int fmt) { return w_scalar(row, i, fmt); }
#endif

#ifndef CWIDTH
#define CWIDTH(R) CMAX
#endif
#define CBLOCK 16  /* output channels per thread work item: a multiple of every tile width */

/* R rows x C channels of y, one pass over K. R, C and fmt are literals at every call site,
 * so each instantiation keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t k, const char *w, const int fmt, const float *scale, const float *bias,
    float *y, int64_t ldy, int64_t n0, const int R, const int C) {
    const int64_t wrow = w_offset(k, fmt);
    vf acc[RMAX][CMAX];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = VZERO();
    const int64_t kv = k - k % VL;
    for (int64_t i = 0; i < kv; i += VL) {
        vf wv[CMAX];
        for (int c = 0; c < C; ++c) wv[c] = vload_w(w + (n0 + c) * wrow, i, fmt);
        for (int r = 0; r < R; ++r) {
            const vf xv = VLOADX(x + r * k + i);
            for (int c = 0; c < C; ++c) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            const void *row = w + (n0 + c) * wrow;
            float s = VSUM(acc[r][c]);
            for (int64_t i = kv; i < k; ++i) s += x[r * k + i] * w_scalar(row, i, fmt);
            if (scale) s *= scale[n0 + c];
            if (bias) s += bias[n0 + c];
            y[r * ldy + n0 + c] = s;
        }
}

/* Rows [r0, r0 + R) of y for channels [n0, n1), with fmt fixed. */
static inline __attribute__((always_inline)) void block_rows(
    const float *x, int64_t k, const char *w, const int fmt, const float *scale, const float *bias,
    float *y, int64_t ldy, int64_t n0, int64_t n1, const int R) {
    const int C = CWIDTH(R);
    int64_t n = n0;
    for (; n + C <= n1; n += C) tile(x, k, w, fmt, scale, bias, y, ldy, n, R, C);
    for (; n < n1; ++n) tile(x, k, w, fmt, scale, bias, y, ldy, n, R, 1);
}

#define I8_PREFETCH_BYTES 2048 /* how far ahead row1 prefetches int8 and int4 rows */

#define Q4_VECS (Q4_GROUP / VL) /* vectors a block widens to */

/* The 32 elements of one int4 block, widened: w[v] holds elements v * VL .. v * VL + VL - 1. */
static inline __attribute__((always_inline)) void q4_block(const unsigned char *blk, vf *w) {
#if ISA == 512
    const __m128i b = _mm_loadu_si128((const __m128i *)(blk + 4)), low = _mm_set1_epi8(0x0f);
    int32_t dm_bits;
    memcpy(&dm_bits, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
    const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low))), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low))), d, m);
#elif ISA == 256
    const __m128i b = _mm_loadu_si128((const __m128i *)(blk + 4)), low = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    int32_t dm_bits;
    memcpy(&dm_bits, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
#else
    for (int i = 0; i < Q4_GROUP; ++i) w[i] = q4_scalar(blk, i);
#endif
}

/* `row1` for int4: whole blocks at a time (one load of the nibbles and of d, m each), two
 * blocks an iteration into four accumulator chains. */
static void row1_q4(const float *x, int64_t k, const char *w, const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t blocks = k / Q4_GROUP, wrow = blocks * Q4_BLOCK;
    for (int64_t n = n0; n < n1; ++n) {
        const unsigned char *row = (const unsigned char *)w + n * wrow;
        vf acc[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
        int64_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
            __builtin_prefetch(row + b * Q4_BLOCK + I8_PREFETCH_BYTES, 0, 0);
            vf w0[Q4_VECS], w1[Q4_VECS];
            q4_block(row + b * Q4_BLOCK, w0);
            q4_block(row + (b + 1) * Q4_BLOCK, w1);
            const float *xb = x + b * Q4_GROUP;
            for (int v = 0; v < Q4_VECS; ++v) {
                acc[(2 * v) % 4] = VFMA(VLOADX(xb + v * VL), w0[v], acc[(2 * v) % 4]);
                acc[(2 * v + 1) % 4] = VFMA(VLOADX(xb + Q4_GROUP + v * VL), w1[v], acc[(2 * v + 1) % 4]);
            }
        }
        if (b < blocks) {
            vf w0[Q4_VECS];
            q4_block(row + b * Q4_BLOCK, w0);
            for (int v = 0; v < Q4_VECS; ++v) acc[v % 4] = VFMA(VLOADX(x + b * Q4_GROUP + v * VL), w0[v], acc[v % 4]);
        }
        float s = VSUM(acc[0]) + VSUM(acc[1]) + VSUM(acc[2]) + VSUM(acc[3]);
        if (bias) s += bias[n];
        y[n] = s;
    }
}

#if ISA == 512 || ISA == 256
/* The batch-1 int4 product without shuffles. Widening a block as q4_block does spends most of
 * its instructions on the shuffle port (bytes spread to lanes, d and m broadcast), which then
 * bounds the product well above its weight bytes. Here a block's 16 bytes are broadcast to
 * every 128-bit chunk by the load itself and each 32-bit lane cuts its own nibble out with a
 * variable shift, so the elements arrive in a fixed permuted order; x is permuted to match
 * once per product (it is shared by every channel). The scale and minimum come out of a
 * float16 -> float32 table with one load each, and the minimum's share is m * (sum of the
 * block's x), with those sums also taken once per product:
 *   y = sum over blocks of d * (q . x) + m * sum(x).
 * Vector u, lane L (C = VL / 4 chunks a vector, c = L / 4, i = L % 4, P = 4 / C vectors a
 * half block): h = u / P, o = (u % P) * C + c; the lane holds element 16 h + 4 i + o, the
 * nibble at bit 8 o + 4 h of the chunk's dword i. */
static float f16_table[65536];
__attribute__((constructor)) static void fill_f16_table(void) {
    for (uint32_t h = 0; h < 65536; ++h) f16_table[h] = f16_to_f32((uint16_t)h);
}

static inline int q4_lane_element(int u, int lane, int *shift) {
    const int chunks = VL / 4, c = lane / 4, i = lane % 4, per_half = 4 / chunks;
    const int h = u / per_half, o = (u % per_half) * chunks + c;
    *shift = 8 * o + 4 * h;
    return 16 * h + 4 * i + o;
}

#if ISA == 512
typedef __m512i vi;
#define VI_LOAD_SHIFTS(p) _mm512_loadu_si512((const void *)(p))
#define Q4_BYTES(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define Q4_NIBBLES(b, s, mask) _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, s), mask))
#define VI_SET1(v) _mm512_set1_epi32(v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSET1(v) _mm512_set1_ps(v)
#define VADD(a, b) _mm512_add_ps(a, b)
#else
typedef __m256i vi;
#define VI_LOAD_SHIFTS(p) _mm256_loadu_si256((const __m256i *)(p))
#define Q4_BYTES(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define Q4_NIBBLES(b, s, mask) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s), mask))
#define VI_SET1(v) _mm256_set1_epi32(v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSET1(v) _mm256_set1_ps(v)
#define VADD(a, b) _mm256_add_ps(a, b)
#endif

/* Channels [n0, n1) from xp (x in the lanes' order) and sx (each block's sum of x). */
static void row1_q4_lanes(const float *xp, const float *sx, const vi *shifts, int64_t k, const char *w,
                          const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t blocks = k / Q4_GROUP, wrow = blocks * Q4_BLOCK;
    const vi mask = VI_SET1(0x0f);
    for (int64_t n = n0; n < n1; ++n) {
        const unsigned char *row = (const unsigned char *)w + n * wrow;
        vf acc0 = VZERO(), acc1 = VZERO();
        float mins0 = 0.0f, mins1 = 0.0f;
        int64_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
            __builtin_prefetch(row + b * Q4_BLOCK + I8_PREFETCH_BYTES, 0, 0);
            const unsigned char *b0 = row + b * Q4_BLOCK, *b1 = b0 + Q4_BLOCK;
            const vi q0 = Q4_BYTES(b0 + 4), q1 = Q4_BYTES(b1 + 4);
            const float *x0 = xp + b * Q4_GROUP, *x1 = x0 + Q4_GROUP;
            vf t0 = VMUL(Q4_NIBBLES(q0, shifts[0], mask), VLOADX(x0));
            vf t1 = VMUL(Q4_NIBBLES(q1, shifts[0], mask), VLOADX(x1));
            for (int u = 1; u < Q4_VECS; ++u) {
                t0 = VFMA(Q4_NIBBLES(q0, shifts[u], mask), VLOADX(x0 + u * VL), t0);
                t1 = VFMA(Q4_NIBBLES(q1, shifts[u], mask), VLOADX(x1 + u * VL), t1);
            }
            acc0 = VFMA(t0, VSET1(f16_table[load_u16(b0)]), acc0);
            acc1 = VFMA(t1, VSET1(f16_table[load_u16(b1)]), acc1);
            mins0 += f16_table[load_u16(b0 + 2)] * sx[b];
            mins1 += f16_table[load_u16(b1 + 2)] * sx[b + 1];
        }
        if (b < blocks) {
            const unsigned char *b0 = row + b * Q4_BLOCK;
            const vi q0 = Q4_BYTES(b0 + 4);
            const float *x0 = xp + b * Q4_GROUP;
            vf t0 = VMUL(Q4_NIBBLES(q0, shifts[0], mask), VLOADX(x0));
            for (int u = 1; u < Q4_VECS; ++u) t0 = VFMA(Q4_NIBBLES(q0, shifts[u], mask), VLOADX(x0 + u * VL), t0);
            acc0 = VFMA(t0, VSET1(f16_table[load_u16(b0)]), acc0);
            mins0 += f16_table[load_u16(b0 + 2)] * sx[b];
        }
        float s = VSUM(VADD(acc0, acc1)) + (mins0 + mins1);
        if (bias) s += bias[n];
        y[n] = s;
    }
}

/* A lone row of x over int4 weights: x permuted and summed once, then the channels split
 * between the threads as `block` splits them. Returns -1 (nothing done) without memory. */
static int q4_row1(const float *x, int64_t k, const char *w, const float *bias, float *y, int64_t n) {
    const int64_t blocks = k / Q4_GROUP;
    float *xp = (float *)malloc((size_t)(k + blocks) * sizeof(float));
    if (xp == NULL) return -1;
    float *sx = xp + k;
    int32_t shift_lanes[Q4_VECS][VL];
    int element[Q4_VECS][VL];
    for (int u = 0; u < Q4_VECS; ++u)
        for (int lane = 0; lane < VL; ++lane) element[u][lane] = q4_lane_element(u, lane, &shift_lanes[u][lane]);
    vi shifts[Q4_VECS];
    for (int u = 0; u < Q4_VECS; ++u) shifts[u] = VI_LOAD_SHIFTS(shift_lanes[u]);
    for (int64_t b = 0; b < blocks; ++b) {
        const float *xb = x + b * Q4_GROUP;
        float *out = xp + b * Q4_GROUP, sum = 0.0f;
        for (int u = 0; u < Q4_VECS; ++u)
            for (int lane = 0; lane < VL; ++lane) out[u * VL + lane] = xb[element[u][lane]];
        for (int i = 0; i < Q4_GROUP; ++i) sum += xb[i];
        sx[b] = sum;
    }
    const int64_t units = (n + CBLOCK - 1) / CBLOCK;
#pragma omp parallel for schedule(static) if (n * k >= 32768)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n0 = u * CBLOCK, n1 = n0 + CBLOCK < n ? n0 + CBLOCK : n;
        row1_q4_lanes(xp, sx, shifts, k, w, bias, y, n0, n1);
    }
    free(xp);
    return 0;
}
#else
static int q4_row1(const float *x, int64_t k, const char *w, const float *bias, float *y, int64_t n) {
    (void)x, (void)k, (void)w, (void)bias, (void)y, (void)n;
    return -1; /* plain C: `block` widens whole blocks (row1_q4) */
}
#endif

/* A single row of x (batch-1 decode): each channel's weight row is read as one sequential
 * stream, with four independent accumulator chains along K. Interleaving CMAX channels as
 * `tile` does splits the thread's reads into CMAX streams, which held 16-bit weights to about
 * half the machine's read rate; one stream reaches it. int8 and int4 rows are short in bytes,
 * so the hardware prefetcher starts too late on each: the next rows are prefetched by hand. */
static inline __attribute__((always_inline)) void row1(
    const float *x, int64_t k, const char *w, const int fmt, const float *scale, const float *bias,
    float *y, int64_t n0, int64_t n1) {
    const int64_t wrow = w_offset(k, fmt);
    const int64_t step = 4 * VL, kv = k - k % step;
    for (int64_t n = n0; n < n1; ++n) {
        const char *row = w + n * wrow;
        vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        for (int64_t i = 0; i < kv; i += step) {
            if (fmt == FMT_I8) __builtin_prefetch(row + i + I8_PREFETCH_BYTES, 0, 0);
            a0 = VFMA(VLOADX(x + i), vload_w(row, i, fmt), a0);
            a1 = VFMA(VLOADX(x + i + VL), vload_w(row, i + VL, fmt), a1);
            a2 = VFMA(VLOADX(x + i + 2 * VL), vload_w(row, i + 2 * VL, fmt), a2);
            a3 = VFMA(VLOADX(x + i + 3 * VL), vload_w(row, i + 3 * VL, fmt), a3);
        }
        float s = VSUM(a0) + VSUM(a1) + VSUM(a2) + VSUM(a3);
        for (int64_t i = kv; i < k; ++i) s += x[i] * w_scalar(row, i, fmt);
        if (scale) s *= scale[n];
        if (bias) s += bias[n];
        y[n] = s;
    }
}

static inline __attribute__((always_inline)) void block(
    const float *x, int64_t m, int64_t k, const char *w, const int fmt, const float *scale,
    const float *bias, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    if (m == 1 && fmt == FMT_Q4) {
        row1_q4(x, k, w, bias, y, n0, n1);
        return;
    }
    if (m == 1) {
        row1(x, k, w, fmt, scale, bias, y, n0, n1);
        return;
    }
    /* Row groups share the channel block, which stays in cache between them. */
    int64_t r = 0;
    for (; r + RMAX <= m; r += RMAX) block_rows(x + r * k, k, w, fmt, scale, bias, y + r * ldy, ldy, n0, n1, RMAX);
    switch (m - r) {
    case 3: block_rows(x + r * k, k, w, fmt, scale, bias, y + r * ldy, ldy, n0, n1, 3); break;
    case 2: block_rows(x + r * k, k, w, fmt, scale, bias, y + r * ldy, ldy, n0, n1, 2); break;
    case 1: block_rows(x + r * k, k, w, fmt, scale, bias, y + r * ldy, ldy, n0, n1, 1); break;
    default: break;
    }
}

/* ---- From PANEL_MIN_ROWS rows: units of channels widened into packed_gemm.c's panels ---- */

/* packed_gemm.c: every row of x over one unit's panel, and the unit width of its layout. */
void packed_gemm_panel(const float *x, int64_t m, int64_t ldx, int64_t kc, const float *panel, int64_t width,
                       int ncols, const float *bias, float *y, int64_t ldy, int first, int last);
int packed_gemm_unit(void);

#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 6
#endif
/* int4 widens slowly (nibbles, two scales a block), and 5 rows took the tiles two passes over
 * the weight (4 rows, then 1): there the panels won on both builds (docs/notes/features.md). */
#ifndef PANEL_MIN_ROWS_Q4
#define PANEL_MIN_ROWS_Q4 5
#endif
/* Steps of K a panel holds (a multiple of 32: whole int4 blocks): 48 x 1,024 floats, 192 KiB,
 * in L2 while the rows pass over it. */
#define PANEL_KC 1024
#define PANEL_PAD 16 /* a unit's width is a multiple of this (zero channels past N) */

/* Each thread's panel, kept between calls as packed_gemm.c keeps its packed rows. */
static __thread float *panel_buf;
static __thread int64_t panel_cap;

static float *panel_block(int64_t floats) {
    if (floats > panel_cap) {
        free(panel_buf);
        panel_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        panel_cap = panel_buf ? floats : 0;
    }
    return panel_buf;
}

#if ISA == 512
/* r[c][l] -> r[l][c], 16 x 16 */
static inline void transpose_vl(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + j], 128-bit lane L: rows i..i+3 of column 4L + j */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; ++j) { /* a 4 x 4 transpose of the lanes of r[j], r[4 + j], r[8 + j], r[12 + j] */
        const __m512 ab0 = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 ab1 = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 cd0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 cd1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        t[j] = _mm512_shuffle_f32x4(ab0, cd0, _MM_SHUFFLE(2, 0, 2, 0));
        t[4 + j] = _mm512_shuffle_f32x4(ab0, cd0, _MM_SHUFFLE(3, 1, 3, 1));
        t[8 + j] = _mm512_shuffle_f32x4(ab1, cd1, _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + j] = _mm512_shuffle_f32x4(ab1, cd1, _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSET1(v) _mm512_set1_ps(v)
#elif ISA == 256
/* r[c][l] -> r[l][c], 8 x 8 */
static inline void transpose_vl(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* u[i + j], 128-bit half H: rows i..i+3 of column 4H + j */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSET1(v) _mm256_set1_ps(v)
#endif

#if VL > 1
/* r[c] byte j -> r[j] byte c, 16 x 16 bytes: four rounds of interleaving rows i and i + 8, each
 * rotating the bits of (row, byte) by one. */
static inline void transpose_bytes(__m128i *r) {
    for (int round = 0; round < 4; ++round) {
        __m128i t[16];
        for (int i = 0; i < 8; ++i) {
            t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]);
            t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
        }
        for (int i = 0; i < 16; ++i) r[i] = t[i];
    }
}

/* 16 float32 lanes (channels) from 16 int32 ones, times scale s and plus offset o (pointers to
 * 16 floats each; o may be NULL), stored at dst. */
static inline void put16(__m128i bytes, int is_signed, const float *s, const float *o, float *dst) {
#if ISA == 512
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    const __m512 f = _mm512_cvtepi32_ps(v);
    _mm512_storeu_ps(dst, o ? _mm512_fmadd_ps(f, _mm512_loadu_ps(s), _mm512_loadu_ps(o))
                            : _mm512_mul_ps(f, _mm512_loadu_ps(s)));
#else
    const __m128i hi8 = _mm_srli_si128(bytes, 8);
    const __m256 f0 = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
    const __m256 f1 = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(hi8) : _mm256_cvtepu8_epi32(hi8));
    _mm256_storeu_ps(dst, o ? _mm256_fmadd_ps(f0, _mm256_loadu_ps(s), _mm256_loadu_ps(o))
                            : _mm256_mul_ps(f0, _mm256_loadu_ps(s)));
    _mm256_storeu_ps(dst + 8, o ? _mm256_fmadd_ps(f1, _mm256_loadu_ps(s + 8), _mm256_loadu_ps(o + 8))
                                : _mm256_mul_ps(f1, _mm256_loadu_ps(s + 8)));
#endif
}

static const unsigned char zero_bytes[Q4_BLOCK > 16 ? Q4_BLOCK : 16];

/* Bytes ahead that widening prefetches in each of its 16 rows: a row's next blocks would
 * otherwise arrive from memory one round trip per step of the loop, 16 rows at once but no
 * further ahead (the work between the loads fills the out-of-order window), which held the
 * widening to a fifth of the memory's rate. Past the end of the rows' range of K [lo, hi) it
 * takes the same range of the 16 rows after them, the thread's next channels. */
#define WIDEN_PF 256
static inline void widen_prefetch(const unsigned char *const *rows, int64_t stride, int64_t at, int64_t lo,
                                  int64_t hi) {
    const int64_t o = at + WIDEN_PF;
    for (int c = 0; c < 16; ++c)
        if (rows[c]) __builtin_prefetch(o < hi ? rows[c] + o : rows[c] + 16 * stride + lo + (o - hi), 0, 3);
}

/* int4: 16 channels from `rows` (NULL past N) by steps [k0, k0 + kc) (whole blocks) into the
 * panel at dst (row stride `width`). Per block the channels' 16 bytes of nibbles are transposed
 * as bytes, so that byte j of every channel (its steps j and j + 16) sits in one register, and
 * each step is then widened for all 16 channels at once with their d and m in lanes. */
static void widen16_q4(const unsigned char *const *rows, int64_t stride, int64_t k0, int64_t kc, float *dst,
                       int64_t width) {
    const __m128i low = _mm_set1_epi8(0x0f);
    const int64_t b0 = k0 / Q4_GROUP, b1 = (k0 + kc) / Q4_GROUP;
    for (int64_t b = b0; b < b1; ++b, dst += Q4_GROUP * width) {
        widen_prefetch(rows, stride, b * Q4_BLOCK, b0 * Q4_BLOCK, b1 * Q4_BLOCK);
        __m128i r[16];
        uint16_t dh[16], mh[16];
        float d[16], m[16];
        for (int c = 0; c < 16; ++c) {
            const unsigned char *blk = rows[c] ? rows[c] + b * Q4_BLOCK : zero_bytes;
            r[c] = _mm_loadu_si128((const __m128i *)(blk + 4));
            dh[c] = load_u16(blk);
            mh[c] = load_u16(blk + 2);
        }
#if ISA == 512
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)));
        _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mh)));
#else
        for (int h = 0; h < 16; h += 8) {
            _mm256_storeu_ps(d + h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + h))));
            _mm256_storeu_ps(m + h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + h))));
        }
#endif
        transpose_bytes(r);
        for (int j = 0; j < 16; ++j) {
            put16(_mm_and_si128(r[j], low), 0, d, m, dst + j * width);
            put16(_mm_and_si128(_mm_srli_epi16(r[j], 4), low), 0, d, m, dst + (j + 16) * width);
        }
    }
}

/* int8: 16 channels by steps [k0, k0 + kc) as widen16_q4, 16 steps at a time (byte j of each
 * channel's 16 is its step j), times the channels' scales; steps past the last 16 one by one. */
static void widen16_i8(const unsigned char *const *rows, int64_t stride, const float *scale16, int64_t k0,
                       int64_t kc, float *dst, int64_t width) {
    const int64_t kv = kc - kc % 16;
    for (int64_t i = 0; i < kv; i += 16) {
        widen_prefetch(rows, stride, k0 + i, k0, k0 + kc);
        __m128i r[16];
        for (int c = 0; c < 16; ++c) r[c] = _mm_loadu_si128((const __m128i *)(rows[c] ? rows[c] + k0 + i : zero_bytes));
        transpose_bytes(r);
        for (int j = 0; j < 16; ++j) put16(r[j], 1, scale16, NULL, dst + (i + j) * width);
    }
    for (int64_t i = kv; i < kc; ++i)
        for (int c = 0; c < 16; ++c)
            dst[i * width + c] = rows[c] ? (float)((const int8_t *)rows[c])[k0 + i] * scale16[c] : 0.0f;
}
#endif

/* Channels [n0, n0 + width) of W (zero past n), steps [k0, k0 + kc) of K, widened (times int8's
 * scale) into the panel layout of packed_gemm.c: element (c, i) at panel[(i - k0) * width + c - n0].
 * int4 and int8 go 16 channels at a time through a transpose of their bytes (widen16_*); other
 * formats VL channels by VL steps at a time, widened in registers and transposed there. */
static inline __attribute__((always_inline)) void widen_unit(
    const char *w, int64_t k, const int fmt, const float *scale, int64_t n, int64_t n0, int64_t width,
    int64_t k0, int64_t kc, float *panel) {
    const int64_t wrow = w_offset(k, fmt);
#if VL > 1
    const int64_t kv = kc - kc % VL;
#else
    const int64_t kv = 0;
#endif
#if VL > 1
    if (fmt == FMT_Q4 || fmt == FMT_I8) {
        for (int64_t c0 = n0; c0 < n0 + width; c0 += 16) {
            const unsigned char *rows[16];
            float s16[16];
            for (int c = 0; c < 16; ++c) {
                rows[c] = c0 + c < n ? (const unsigned char *)w + (c0 + c) * wrow : NULL;
                s16[c] = c0 + c < n && scale ? scale[c0 + c] : 0.0f;
            }
            if (fmt == FMT_Q4)
                widen16_q4(rows, wrow, k0, kc, panel + (c0 - n0), width);
            else
                widen16_i8(rows, wrow, s16, k0, kc, panel + (c0 - n0), width);
        }
        return;
    }
#endif
    for (int64_t c0 = n0; c0 < n0 + width; c0 += VL) {
#if VL > 1
        for (int64_t i = 0; i < kv; i += VL) {
            vf r[VL];
            for (int c = 0; c < VL; ++c) {
                const int64_t ch = c0 + c;
                r[c] = ch < n ? vload_w(w + ch * wrow, k0 + i, fmt) : VZERO();
                if (scale && ch < n) r[c] = VMUL(r[c], VSET1(scale[ch]));
            }
            transpose_vl(r);
            for (int l = 0; l < VL; ++l) VSTORE(panel + (i + l) * width + (c0 - n0), r[l]);
        }
#endif
        for (int64_t i = kv; i < kc; ++i)
            for (int c = 0; c < VL; ++c) {
                const int64_t ch = c0 + c;
                float v = 0.0f;
                if (ch < n) {
                    v = w_scalar(w + ch * wrow, k0 + i, fmt);
                    if (scale) v *= scale[ch];
                }
                panel[i * width + (c0 + c - n0)] = v;
            }
    }
}

/* Threads take runs of units as they come (claim_units.h); each unit is widened block of K by
 * block and every row of x passes over it. Returns -1 (nothing computed) when no thread could
 * allocate its panel. */
static inline __attribute__((always_inline)) int gemm_panels(
    const float *x, int64_t m, int64_t k, const char *w, const int fmt, const float *scale,
    const float *bias, float *y, int64_t ldy, int64_t n) {
    const int64_t uw = packed_gemm_unit(), units = (n + uw - 1) / uw;
    const int64_t kcap = k < PANEL_KC ? k : PANEL_KC;
    int64_t claimed = 0; /* units handed out so far */
#pragma omp parallel if (m * n * k >= 65536)
    {
        const int64_t nt = omp_get_num_threads();
        float *panel = panel_block(uw * kcap);
        int64_t end = units, u = panel ? claim_units(&claimed, units, nt, &end) : units;
        while (u < end) {
            for (; u < end; ++u) {
                const int64_t n0 = u * uw, ncols = n - n0 < uw ? n - n0 : uw;
                const int64_t width = (ncols + PANEL_PAD - 1) / PANEL_PAD * PANEL_PAD;
                for (int64_t k0 = 0; k0 < k; k0 += PANEL_KC) {
                    const int64_t kc = k - k0 < PANEL_KC ? k - k0 : PANEL_KC;
#ifndef SKIP_WIDEN
                    widen_unit(w, k, fmt, scale, n, n0, width, k0, kc, panel);
#endif
#ifndef SKIP_MICRO
                    packed_gemm_panel(x + k0, m, k, kc, panel, width, (int)ncols, bias ? bias + n0 : NULL, y + n0,
                                      ldy, k0 == 0, k0 + kc == k);
#endif
                }
            }
            u = claim_units(&claimed, units, nt, &end);
        }
    }
    return claimed == 0 && units > 0 ? -1 : 0;
}

#define DEFINE_FMT(NAME, FMT)                                                                     \
    static void NAME(const float *x, int64_t m, int64_t k, const char *w, const float *scale,    \
                     const float *bias, float *y, int64_t ldy, int64_t n) {                       \
        if (FMT != FMT_F32 && m >= (FMT == FMT_Q4 ? PANEL_MIN_ROWS_Q4 : PANEL_MIN_ROWS) &&       \
            gemm_panels(x, m, k, w, FMT, scale, bias, y, ldy, n) == 0)                            \
            return;                                                                               \
        if (FMT == FMT_Q4 && m == 1 && q4_row1(x, k, w, bias, y, n) == 0) return;               \
        const int64_t blocks = (n + CBLOCK - 1) / CBLOCK;                                         \
        _Pragma("omp parallel for schedule(static) if (n * k >= 32768)")                          \
        for (int64_t b = 0; b < blocks; ++b) {                                                    \
            const int64_t n0 = b * CBLOCK, n1 = n0 + CBLOCK < n ? n0 + CBLOCK : n;                \
            block(x, m, k, w, FMT, scale, bias, y, ldy, n0, n1);                                  \
        }                                                                                         \
    }
DEFINE_FMT(gemm_f32, FMT_F32)
DEFINE_FMT(gemm_f16, FMT_F16)
DEFINE_FMT(gemm_bf16, FMT_BF16)
DEFINE_FMT(gemm_i8, FMT_I8)
DEFINE_FMT(gemm_q4, FMT_Q4)

/* Returns 0, or -1 for an unknown format (or int4 with K not a multiple of 32). scale: [N] for
 * int8 (NULL otherwise); bias: [N] or NULL. */
int weight_gemm(const float *x, int64_t m, int64_t k, const void *w, int fmt, const float *scale,
                const float *bias, float *y, int64_t ldy, int64_t n) {
    switch (fmt) {
    case FMT_F32: gemm_f32(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_F16: gemm_f16(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_BF16: gemm_bf16(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_I8: gemm_i8(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_Q4:
        if (k % Q4_GROUP) return -1;
        gemm_q4(x, m, k, (const char *)w, scale, bias, y, ldy, n);
        return 0;
    default: return -1;
    }
}

/* 512 (AVX-512F), 256 (AVX2 + FMA + F16C) or 0 (plain C): the path this build compiled. */
int weight_gemm_isa(void) { return ISA; }
