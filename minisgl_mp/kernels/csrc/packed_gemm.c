/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias[N]), float32, for decode batches (one to a few hundred
 * rows), with W packed once at load time into column panels.
 *
 * Why a second float32 kernel: weight_gemm.c reduces along K (a dot product per output), which
 * is right while the weight bytes bound the product (one to eight rows) but leaves it short of
 * the FMA rate past that, and oneDNN's prepacked path is no better at 16-64 rows on these CPUs
 * (docs/benchmarks.md). This is the register-tiled outer-product form of BLAS kernels: MR rows
 * of x times a unit of UW output channels are held in vector accumulators for the whole of K;
 * each step along K loads the unit's UW weights (contiguous, thanks to the packing) and
 * broadcasts one x value per row. A unit's block of K stays in L2 while the row groups of x
 * pass over it, so W is read from memory once per call, and the passes prefetch the thread's
 * next unit into L2 as they go, so that its passes do not wait on memory either
 * (csrc/panel_prefetch.h; docs/benchmarks.md sections 19 and 24).
 *
 * Past PACKED_X_MIN_ROWS rows (prefill chunks) the kernel is bound by the FMAs rather than by
 * the weight bytes, and the x values each step broadcasts become the weak point: one scalar from
 * each of MR rows K floats apart, a stream per row for L1 and the prefetchers to keep up with.
 * There each thread takes its own rows, copies a block of MC of them into row groups laid out
 * step by step (xp[g][k][r], the MR values of a step side by side: one stream, a cache line per
 * two steps), and passes every unit of W over its block. That ran the products of the 0.6B
 * shapes above oneDNN's prepacked ones from 128 rows to 2,048 (docs/benchmarks.md section 25),
 * so one packed copy of W serves every batch.
 *
 * Packed layout (packed_gemm_pack): output channels in units of UW (the last one may be
 * narrower, in steps of 16, zero-padded past N); unit u holds K rows of its width,
 * consecutive: element (n, k) of unit u = panel[u * UW * K + k * width_u + (n - u * UW)]. The
 * buffer holds ceil(N / 16) * 16 * K floats whatever the ISA. UW and MR follow the build's
 * ISA (see packed_gemm_unit), so a buffer is only valid for the library that packed it.
 */
#include <stdint.h>

#include "claim_units.h"
#include "panel_prefetch.h"
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

#define PANEL 16 /* channel padding granule, and the widest vector */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define NV 3 /* vectors per unit: 8 rows x 3 vectors = 24 of the 32 zmm registers */
#define MR 8
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(p) _mm512_set1_ps(*(p))
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline void vstore_n(float *p, vf v, int n) {
    if (n >= VL) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
static inline vf vload_n(const float *p, int n) {
    return n >= VL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define NV 2 /* 6 rows x 2 vectors = 12 of the 16 ymm registers */
#define MR 6
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(p) _mm256_broadcast_ss(p)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
/* Partial vectors through lane masks: a temporary array would make the accumulators
 * addressable, and GCC then keeps them on the stack inside the k loop. */
static inline __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline void vstore_n(float *p, vf v, int n) {
    if (n >= VL) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lane_mask(n), v);
}
static inline vf vload_n(const float *p, int n) {
    return n >= VL ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}
#else
#define VL 1
#define NV 16
#define MR 4
typedef float vf;
#define VZERO() 0.0f
#define VSET1(p) (*(p))
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
static inline void vstore_n(float *p, vf v, int n) { if (n > 0) *p = v; }
static inline vf vload_n(const float *p, int n) { return n > 0 ? *p : 0.0f; }
#endif

#define UW (VL * NV) /* channels per unit: 48 (AVX-512), 16 (AVX2 and plain C) */
/* Steps of K per block. A block of a unit (48 x 2048 floats, 384 KiB) stays in L2 while the
 * row groups pass over it; blocks of 64-512 steps measured no faster on the 0.6B shapes, and
 * each block costs a round of accumulator loads and stores. Models of the 0.6B-4B shapes have
 * K <= 2048 except in the down projection, so most products are one block. */
#ifndef KC
#define KC 2048
#endif
/* Steps of K to prefetch the weights ahead, for a pass that finds its unit not yet in L2 (one
 * row group alone, or the thread's first unit): it reads them from memory. */
#ifndef PF
#define PF 16
#endif

/* R rows of y by the V vectors of one unit (ncols of them real), over k steps of K (row r's
 * value at step i is x[r * ldx + i * sx]: rows of x as they are, or packed row groups): the
 * accumulators start from zero on the first block of K and from y after it, and the bias is
 * added on the last. R and V are literals at every call site, so each instantiation keeps its
 * accumulators in registers. */
static inline __attribute__((always_inline)) void micro(
    const float *x, int64_t ldx, int64_t sx, int64_t k, const float *panel, int64_t width, const float *bias,
    float *y, int64_t ldy, int ncols, int first, int last, const char *pn, int64_t pn_lines, const int R,
    const int V) {
    /* The loops over R and V are unrolled by request: left to GCC 12, the accumulator array
     * stayed in memory as well, a store of every accumulator at every step of K, which held
     * the AVX2 build to half the FMA rate (docs/benchmarks.md section 20). */
    vf acc[MR][NV];
    int64_t pn_acc = 0;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
        const int n = ncols - v * VL;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][v] = first || n <= 0 ? VZERO() : vload_n(y + r * ldy + v * VL, n);
    }
    for (int64_t i = 0; i < k; ++i) {
        const float *b = panel + i * width;
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) __builtin_prefetch(b + PF * width + v * VL, 0, 3);
        /* pn_lines cache lines of the next unit spread evenly over the k steps, into L2 */
        for (pn_acc += pn_lines; pn_acc >= k; pn_acc -= k, pn += 64) __builtin_prefetch(pn, 0, 2);
        vf w[NV];
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) w[v] = VLOAD(b + v * VL);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const vf a = VSET1(x + r * ldx + i * sx);
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) acc[r][v] = VFMA(a, w[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
        const int n = ncols - v * VL;
        if (n <= 0) break; /* a vector of padding only (AVX2's second half of a unit) */
        const vf bv = bias && last ? vload_n(bias + v * VL, n) : VZERO();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) vstore_n(y + r * ldy + v * VL, acc[r][v] + bv, n);
    }
}

typedef void (*micro_fn)(const float *, int64_t, int64_t, const float *, int64_t, const float *, float *,
                         int64_t, int, int, int, const char *, int64_t);

#define MICRO(R, V)                                                                                  \
    static void micro_##R##_##V(const float *x, int64_t ldx, int64_t k, const float *panel,          \
                                int64_t width, const float *bias, float *y, int64_t ldy, int ncols,   \
                                int first, int last, const char *pn, int64_t pn_lines) {             \
        micro(x, ldx, 1, k, panel, width, bias, y, ldy, ncols, first, last, pn, pn_lines, R, V);     \
    }                                                                                                \
    /* x packed (ldx unused): the strides are literals, each broadcast a fixed offset */            \
    static void microp_##R##_##V(const float *x, int64_t ldx, int64_t k, const float *panel,         \
                                 int64_t width, const float *bias, float *y, int64_t ldy, int ncols,  \
                                 int first, int last, const char *pn, int64_t pn_lines) {            \
        (void)ldx;                                                                                   \
        micro(x, 1, MR, k, panel, width, bias, y, ldy, ncols, first, last, pn, pn_lines, R, V);      \
    }

/* Every (rows, vectors) pair the ISA can meet: rows 1..MR, vectors 1..NV (a narrow last unit). */
#if defined(__AVX512F__)
#define ROWS_V(V) MICRO(1, V) MICRO(2, V) MICRO(3, V) MICRO(4, V) MICRO(5, V) MICRO(6, V) MICRO(7, V) MICRO(8, V)
ROWS_V(1) ROWS_V(2) ROWS_V(3)
#define ROW_FNS(P, V) {P##_1_##V, P##_2_##V, P##_3_##V, P##_4_##V, P##_5_##V, P##_6_##V, P##_7_##V, P##_8_##V}
static const micro_fn MICROS[NV][MR] = {ROW_FNS(micro, 1), ROW_FNS(micro, 2), ROW_FNS(micro, 3)};
static const micro_fn MICROS_PACKED[NV][MR] = {ROW_FNS(microp, 1), ROW_FNS(microp, 2), ROW_FNS(microp, 3)};
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS_V(V) MICRO(1, V) MICRO(2, V) MICRO(3, V) MICRO(4, V) MICRO(5, V) MICRO(6, V)
ROWS_V(1) ROWS_V(2)
#define ROW_FNS(P, V) {P##_1_##V, P##_2_##V, P##_3_##V, P##_4_##V, P##_5_##V, P##_6_##V}
static const micro_fn MICROS[NV][MR] = {ROW_FNS(micro, 1), ROW_FNS(micro, 2)};
static const micro_fn MICROS_PACKED[NV][MR] = {ROW_FNS(microp, 1), ROW_FNS(microp, 2)};
#else
/* Plain C: one unit of 16 channels, looped rather than unrolled per width. */
static void micro_scalar(const float *x, int64_t ldx, int64_t k, const float *panel, int64_t width,
                         const float *bias, float *y, int64_t ldy, int ncols, int first, int last, int R) {
    float acc[MR][NV];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = first || v >= ncols ? 0.0f : y[r * ldy + v];
    for (int64_t i = 0; i < k; ++i)
        for (int r = 0; r < R; ++r) {
            const float a = x[r * ldx + i];
            for (int v = 0; v < NV; ++v) acc[r][v] += a * panel[i * width + v];
        }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < ncols; ++v) y[r * ldy + v] = acc[r][v] + (bias && last ? bias[v] : 0.0f);
}
#endif

static inline int64_t unit_width(int64_t n, int64_t u) {
    const int64_t padded = (n + PANEL - 1) / PANEL * PANEL, rest = padded - u * UW;
    return rest < UW ? rest : UW;
}

/* W [N, K] row-major -> the packed layout above (ceil(N / 16) * 16 * K floats at `out`). */
void packed_gemm_pack(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t units = (n + UW - 1) / UW;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t width = unit_width(n, u), n0 = u * UW;
        float *dst = out + n0 * k;
        for (int64_t c = 0; c < width; ++c) {
            const int64_t ch = n0 + c;
            if (ch < n) {
                const float *src = w + ch * k;
                for (int64_t i = 0; i < k; ++i) dst[i * width + c] = src[i];
            } else {
                for (int64_t i = 0; i < k; ++i) dst[i * width + c] = 0.0f;
            }
        }
    }
}

#if VL > 1
/* Rows from which x is packed into row groups (see the top of the file); below it each thread
 * streams its own run of W's units past all the rows instead, which is what bounds a decode
 * batch. 128 rows: where the two measured alike on 2 threads (docs/benchmarks.md section 25).
 * Since each thread then reads all of W for its own rows, it also takes PACKED_X_THREAD_ROWS
 * rows a thread: with many threads and few rows each, reading W once per thread would make the
 * product bound by memory again. */
#ifndef PACKED_X_MIN_ROWS
#define PACKED_X_MIN_ROWS 128
#endif
#ifndef PACKED_X_THREAD_ROWS
#define PACKED_X_THREAD_ROWS 64
#endif
/* Rows of x a thread packs at a time: MC x K floats (6 MiB at K = 3,072), the block every unit
 * of W passes over before the next block is packed; W is read once per block. */
#ifndef MC
#define MC 512
#endif

/* Each thread's packed block, kept between calls (OpenMP's threads persist): the size is
 * bounded by MC x K, and a fresh allocation of it every product would page-fault it in again. */
static __thread float *xp_buf;
static __thread int64_t xp_cap;

static float *xp_block(int64_t floats) {
    if (floats > xp_cap) {
        free(xp_buf);
        xp_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        xp_cap = xp_buf ? floats : 0;
    }
    return xp_buf;
}

/* The threads split the row groups; each packs MC rows at a time and runs every unit of W over
 * them, every group taking its share of the next unit into L2 (panel_prefetch.h) while they
 * pass over this one. Returns -1 when a thread's block could not be allocated. */
static int packed_x_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels, int64_t n,
                         const float *bias, float *y, int64_t ldy) {
    const int64_t units = (n + UW - 1) / UW, all_groups = (m + MR - 1) / MR;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = all_groups * t / nt, g1 = all_groups * (t + 1) / nt;
        const int64_t block = MC / MR * MR; /* whole row groups (MR is 6 on AVX2) */
        const int64_t mb_max = (g1 - g0) * MR < block ? (g1 - g0) * MR : block;
        float *xp = g1 > g0 ? xp_block(mb_max * k) : NULL;
        if (g1 > g0 && xp == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = g0 * MR; xp != NULL && m0 < g1 * MR; m0 += block) {
            const int64_t m1 = m0 + block < g1 * MR ? m0 + block : g1 * MR, rows_b = (m1 < m ? m1 : m) - m0;
            const int64_t groups = (rows_b + MR - 1) / MR;
            for (int64_t g = 0; g < groups; ++g) {
                float *dst = xp + g * MR * k;
                const int rows = (int)(rows_b - g * MR < MR ? rows_b - g * MR : MR);
                for (int r = 0; r < rows; ++r) {
                    const float *src = x + (m0 + g * MR + r) * ldx;
                    for (int64_t i = 0; i < k; ++i) dst[i * MR + r] = src[i];
                }
            }
            for (int64_t u = 0; u < units; ++u) {
                const int64_t n0 = u * UW, width = unit_width(n, u);
                const int ncols = (int)(n - n0 < UW ? n - n0 : UW);
                const float *panel = panels + n0 * k;
                const int64_t next_lines = u + 1 < units && groups > 1 ? unit_width(n, u + 1) * k * 4 / 64 : 0;
                const int64_t share = prefetch_share(next_lines, groups);
                const char *next = (const char *)(panels + (n0 + UW) * k);
                for (int64_t g = 0; g < groups; ++g) {
                    const int rows = (int)(rows_b - g * MR < MR ? rows_b - g * MR : MR);
                    int64_t start;
                    const int64_t lines = prefetch_lines(g, share, next_lines, 0, k, k, &start);
                    MICROS_PACKED[width / VL - 1][rows - 1](xp + g * MR * k, MR, k, panel, width, bias ? bias + n0 : NULL,
                                                     y + (m0 + g * MR) * ldy + n0, ldy, ncols, 1, 1,
                                                     next + start * 64, lines);
                }
            }
        }
    }
    return failed ? -1 : 0;
}
#endif

/* x rows `ldx` apart, y rows `ldy` apart; bias [N] or NULL. From PACKED_X_MIN_ROWS rows (and
 * PACKED_X_THREAD_ROWS a thread) the packed-x path above; below, threads take runs of units
 * as they come (claim_units.h): each streams its run of the packed weight past all the rows, as
 * they are, and knows its next unit. */
void packed_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels, int64_t n,
                     const float *bias, float *y, int64_t ldy) {
#if VL > 1
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    if (m >= PACKED_X_MIN_ROWS && m >= PACKED_X_THREAD_ROWS * threads &&
        packed_x_gemm(x, m, k, ldx, panels, n, bias, y, ldy) == 0)
        return;
#endif
    const int64_t units = (n + UW - 1) / UW;
    const int64_t groups = (m + MR - 1) / MR;
    int64_t claimed = 0; /* units handed out so far */
#pragma omp parallel if (m * n * k >= 65536)
    {
        const int64_t nt = omp_get_num_threads();
        int64_t end, u = claim_units(&claimed, units, nt, &end);
        while (u < end) {
            /* The run's last unit claims the next run now, so that its first unit is prefetched. */
            int64_t un = u + 1, next_end = end;
            if (un == end) un = claim_units(&claimed, units, nt, &next_end);
            const int64_t n0 = u * UW, width = unit_width(n, u);
            const int ncols = (int)(n - n0 < UW ? n - n0 : UW);
            const float *panel = panels + n0 * k;
            const float *bu = bias ? bias + n0 : NULL;
            /* The thread's next unit, fetched into L2 by the row groups' passes over this one:
             * group g takes its share of the lines, spread over the blocks of K. */
            const int64_t next_lines = un < next_end && groups > 1 ? unit_width(n, un) * k * 4 / 64 : 0;
            const int64_t share = prefetch_share(next_lines, groups);
            const char *next = (const char *)(panels + (un < next_end ? un : u) * UW * k);
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                const int first = k0 == 0, last = k0 + kc == k;
                for (int64_t r = 0, g = 0; r < m; r += MR, ++g) {
                    const int rows = (int)(m - r < MR ? m - r : MR);
                    const float *xb = x + r * ldx + k0, *pb = panel + k0 * width;
                    float *yb = y + r * ldy + n0;
                    int64_t start;
                    const int64_t lines = prefetch_lines(g, share, next_lines, k0, kc, k, &start);
#if VL == 1
                    micro_scalar(xb, ldx, kc, pb, width, bu, yb, ldy, ncols, first, last, rows);
#else
                    MICROS[width / VL - 1][rows - 1](xb, ldx, kc, pb, width, bu, yb, ldy, ncols, first, last,
                                                     next + start * 64, lines);
#endif
                }
            }
            u = un;
            end = next_end;
        }
    }
}

/* Every row of x (rows ldx apart, from the panel's first step of K) over one unit's panel of kc
 * steps and `width` channels (a multiple of 16, at most the unit width; ncols of them real) in
 * this file's layout, row group by row group into y: the accumulators start from zero on the
 * `first` block of K and from y after it, and the bias is added on the `last`. For weight_gemm.c,
 * which widens stored weights into such panels on the fly. */
void packed_gemm_panel(const float *x, int64_t m, int64_t ldx, int64_t kc, const float *panel, int64_t width,
                       int ncols, const float *bias, float *y, int64_t ldy, int first, int last) {
    for (int64_t r = 0; r < m; r += MR) {
        const int rows = (int)(m - r < MR ? m - r : MR);
#if VL == 1
        micro_scalar(x + r * ldx, ldx, kc, panel, width, bias, y + r * ldy, ldy, ncols, first, last, rows);
#else
        MICROS[width / VL - 1][rows - 1](x + r * ldx, ldx, kc, panel, width, bias, y + r * ldy, ldy, ncols, first,
                                         last, NULL, 0);
#endif
    }
}

/* The unit width this build packs for (48, 16 or 16) and its row tile, for tests and logs. */
int packed_gemm_unit(void) { return UW; }
int packed_gemm_rows(void) { return MR; }
