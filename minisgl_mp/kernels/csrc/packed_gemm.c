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
 * Packed layout (packed_gemm_pack): output channels in units of UW (the last one may be
 * narrower, in steps of 16, zero-padded past N); unit u holds K rows of its width,
 * consecutive: element (n, k) of unit u = panel[u * UW * K + k * width_u + (n - u * UW)]. The
 * buffer holds ceil(N / 16) * 16 * K floats whatever the ISA. UW and MR follow the build's
 * ISA (see packed_gemm_unit), so a buffer is only valid for the library that packed it.
 */
#include <stdint.h>

#include "panel_prefetch.h"
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

/* R rows of y by the V vectors of one unit (ncols of them real), over k steps of K: the
 * accumulators start from zero on the first block of K and from y after it, and the bias is
 * added on the last. R and V are literals at every call site, so each instantiation keeps its
 * accumulators in registers. */
static inline __attribute__((always_inline)) void micro(
    const float *x, int64_t ldx, int64_t k, const float *panel, int64_t width, const float *bias,
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
            const vf a = VSET1(x + r * ldx + i);
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
        micro(x, ldx, k, panel, width, bias, y, ldy, ncols, first, last, pn, pn_lines, R, V);        \
    }

/* Every (rows, vectors) pair the ISA can meet: rows 1..MR, vectors 1..NV (a narrow last unit). */
#if defined(__AVX512F__)
#define ROWS_V(V) MICRO(1, V) MICRO(2, V) MICRO(3, V) MICRO(4, V) MICRO(5, V) MICRO(6, V) MICRO(7, V) MICRO(8, V)
ROWS_V(1) ROWS_V(2) ROWS_V(3)
#define ROW_FNS(V) {micro_1_##V, micro_2_##V, micro_3_##V, micro_4_##V, micro_5_##V, micro_6_##V, micro_7_##V, micro_8_##V}
static const micro_fn MICROS[NV][MR] = {ROW_FNS(1), ROW_FNS(2), ROW_FNS(3)};
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS_V(V) MICRO(1, V) MICRO(2, V) MICRO(3, V) MICRO(4, V) MICRO(5, V) MICRO(6, V)
ROWS_V(1) ROWS_V(2)
#define ROW_FNS(V) {micro_1_##V, micro_2_##V, micro_3_##V, micro_4_##V, micro_5_##V, micro_6_##V}
static const micro_fn MICROS[NV][MR] = {ROW_FNS(1), ROW_FNS(2)};
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

/* x rows `ldx` apart, y rows `ldy` apart; bias [N] or NULL. Threads split the units into
 * contiguous runs: each streams one run of the packed weight, and knows its next unit. Blocking
 * the rows as well (x in L2 beside a unit) measured no faster up to 2,048 rows, so the rows are
 * not blocked. */
void packed_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels, int64_t n,
                     const float *bias, float *y, int64_t ldy) {
    const int64_t units = (n + UW - 1) / UW;
    const int64_t groups = (m + MR - 1) / MR;
#pragma omp parallel if (m * n * k >= 65536)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t n0 = u * UW, width = unit_width(n, u);
            const int ncols = (int)(n - n0 < UW ? n - n0 : UW);
            const float *panel = panels + n0 * k;
            const float *bu = bias ? bias + n0 : NULL;
            /* The thread's next unit, fetched into L2 by the row groups' passes over this one:
             * group g takes its share of the lines, spread over the blocks of K. */
            const int64_t next_lines = u + 1 < u1 && groups > 1 ? unit_width(n, u + 1) * k * 4 / 64 : 0;
            const int64_t share = prefetch_share(next_lines, groups);
            const char *next = (const char *)(panels + (n0 + UW) * k);
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
        }
    }
}

/* The unit width this build packs for (48, 16 or 16) and its row tile, for tests and logs. */
int packed_gemm_unit(void) { return UW; }
int packed_gemm_rows(void) { return MR; }
