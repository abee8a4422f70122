/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias[N]) for bfloat16 weights on CPUs with AVX512-BF16's
 * dot-product instruction (vdpbf16ps: AMD Zen 4 and 5, Intel Cooper Lake and later) but no
 * AMX, the numerics of amx_gemm.c without its tiles: x (float32) is rounded to bfloat16 once
 * per call (nearest even), each instruction multiplies pairs of bfloat16 values and adds both
 * products to a float32 lane, and y is that float32 accumulator (no rounding of the output).
 * One vdpbf16ps does the work of two float32 FMAs, so where the arithmetic bounds a product
 * (prefill, large decode batches) these run at up to twice the float32 rate; where the weight
 * bytes do, they read half of float32's.
 *
 * The register-tiled form of packed_gemm.c: MR rows of x times a unit of UW output channels
 * in vector accumulators for the whole of K, each step along K taking a pair of inputs (the
 * unit's UW x 2 weights, contiguous thanks to the packing, and one broadcast 32-bit pair of x
 * per row). A unit's block of K stays in L2 while the row groups of x pass over it, and the
 * passes prefetch the thread's next unit into L2, as there.
 *
 * Packed layout (bf16dot_gemm_pack), K even: output channels in units of UW (the last may be
 * narrower, in steps of 16, zero-padded past N); unit u of width w holds K / 2 pairs of inputs
 * in turn, each w channels x 2 inputs:
 *   element (n, k) of unit u = packed[u * UW * K + (k / 2) * 2 w + 2 (n - u * UW) + k % 2]
 * The buffer holds ceil(N / 16) * 16 * K values.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere
 * every product entry point reports the kernel unavailable.
 */
#include <stdint.h>

#include "claim_units.h"
#include "panel_prefetch.h"
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 16 /* channel padding granule: one vector of float32 outputs */
#define UW 48    /* channels per unit: 3 vectors, by MR = 8 rows = 24 of the 32 zmm registers */

static inline int64_t unit_width(int64_t n, int64_t u) {
    const int64_t padded = (n + PANEL - 1) / PANEL * PANEL, rest = padded - u * UW;
    return rest < UW ? rest : UW;
}

/* W [N, K] bfloat16 row-major -> the packed layout above; -1 when K is odd. */
int bf16dot_gemm_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    if (k % 2 || n <= 0 || k <= 0) return -1;
    const int64_t units = (n + UW - 1) / UW;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t width = unit_width(n, u), n0 = u * UW;
        uint16_t *dst = out + n0 * k;
        for (int64_t c = 0; c < width; ++c) {
            const int64_t ch = n0 + c;
            for (int64_t p = 0; p < k / 2; ++p) {
                uint16_t *d = dst + p * 2 * width + 2 * c;
                d[0] = ch < n ? w[ch * k + 2 * p] : 0;
                d[1] = ch < n ? w[ch * k + 2 * p + 1] : 0;
            }
        }
    }
    return 0;
}

/* The unit width of the packed layout, for tests. */
int bf16dot_gemm_unit(void) { return UW; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define MR 8
#define NV (UW / 16)
/* Steps of K per block: a unit's block (48 x 4,096 bfloat16 values, 384 KiB) stays in L2
 * while the row groups pass over it; every K of the 0.6B-4B shapes but the 4B's down
 * projection is one block. Even, so a block holds whole pairs. */
#define KC 4096
#define PF 8 /* pairs of K to prefetch the weights ahead, for a pass whose unit is not yet in L2 */

int bf16dot_gemm_ready(void) { return 1; }

static inline __m512 load_n(const float *p, int n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

static inline void store_n(float *p, __m512 v, int n) {
    if (n >= 16) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

/* R rows of y by the V vectors of one unit (ncols real), over kc inputs (kc / 2 pairs) of x's
 * bfloat16 rows `ldx` apart: from zero on the first block of K and from y after it, plus the
 * bias on the last. R and V are literals at every call site, so the accumulators stay in
 * registers (the loops unrolled by request, as in packed_gemm.c). */
static inline __attribute__((always_inline)) void micro(
    const uint16_t *x, int64_t ldx, int64_t kc, const uint16_t *panel, int64_t width, const float *bias, float *y,
    int64_t ldy, int ncols, int first, int last, const char *pn, int64_t pn_lines, const int R, const int V) {
    __m512 acc[MR][NV];
    const int64_t pairs = kc / 2;
    int64_t pn_acc = 0;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
        const int n = ncols - v * 16;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            acc[r][v] = first || n <= 0 ? _mm512_setzero_ps() : load_n(y + r * ldy + v * 16, n);
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const uint16_t *b = panel + i * 2 * width;
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) __builtin_prefetch(b + PF * 2 * width + v * 32, 0, 3);
        /* pn_lines cache lines of the next unit spread evenly over the pairs, into L2 */
        for (pn_acc += pn_lines; pn_acc >= pairs; pn_acc -= pairs, pn += 64) __builtin_prefetch(pn, 0, 2);
        __m512bh w[NV];
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512((const void *)(b + v * 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
        const int n = ncols - v * 16;
        if (n <= 0) break; /* a vector of padding only */
        const __m512 bv = bias && last ? load_n(bias + v * 16, n) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) store_n(y + r * ldy + v * 16, _mm512_add_ps(acc[r][v], bv), n);
    }
}

typedef void (*micro_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, const float *, float *,
                         int64_t, int, int, int, const char *, int64_t);

#define MICRO(R, V)                                                                                          \
    static void micro_##R##_##V(const uint16_t *x, int64_t ldx, int64_t kc, const uint16_t *panel,            \
                                int64_t width, const float *bias, float *y, int64_t ldy, int ncols, int first, \
                                int last, const char *pn, int64_t pn_lines) {                                 \
        micro(x, ldx, kc, panel, width, bias, y, ldy, ncols, first, last, pn, pn_lines, R, V);                \
    }
#define ROWS_V(V) MICRO(1, V) MICRO(2, V) MICRO(3, V) MICRO(4, V) MICRO(5, V) MICRO(6, V) MICRO(7, V) MICRO(8, V)
ROWS_V(1) ROWS_V(2) ROWS_V(3)
#define ROW_FNS(V) {micro_1_##V, micro_2_##V, micro_3_##V, micro_4_##V, micro_5_##V, micro_6_##V, micro_7_##V, micro_8_##V}
static const micro_fn MICROS[NV][MR] = {ROW_FNS(1), ROW_FNS(2), ROW_FNS(3)};

/* Rows [r0, r1) of x rounded to bfloat16 (nearest even, as the instruction rounds) into xb. */
static void round_rows(const float *x, int64_t ldx, int64_t k, uint16_t *xb, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const float *src = x + r * ldx;
        uint16_t *dst = xb + r * k;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
        if (i < k) {
            const __mmask16 mask = (__mmask16)((1u << (k - i)) - 1);
            const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
            _mm256_mask_storeu_epi16(dst + i, mask, v);
        }
    }
}

/* x rows `ldx` floats apart, y rows `ldy` apart; bias [N] or NULL. Threads take runs of units
 * as they come (claim_units.h), each streaming its run of the packed weight and knowing its
 * next unit. Returns 0, or -1 (odd K, or no memory for x's bfloat16 copy). */
int bf16dot_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      const float *bias, float *y, int64_t ldy) {
    if (k % 2 || m <= 0) return -1;
    uint16_t *xb = aligned_alloc(64, (size_t)((m * k * 2 + 63) / 64 * 64));
    if (!xb) return -1;
    const int64_t units = (n + UW - 1) / UW;
    const int64_t groups = (m + MR - 1) / MR;
    int64_t claimed = 0; /* units handed out so far */
#pragma omp parallel if (m * n * k >= 65536)
    {
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        round_rows(x, ldx, k, xb, m * t / nt, m * (t + 1) / nt);
#pragma omp barrier
        int64_t end, u = claim_units(&claimed, units, nt, &end);
        while (u < end) {
            /* The run's last unit claims the next run now, so that its first unit is prefetched. */
            int64_t un = u + 1, next_end = end;
            if (un == end) un = claim_units(&claimed, units, nt, &next_end);
            const int64_t n0 = u * UW, width = unit_width(n, u);
            const int ncols = (int)(n - n0 < UW ? n - n0 : UW);
            const uint16_t *panel = packed + n0 * k;
            const float *bu = bias ? bias + n0 : NULL;
            /* The thread's next unit, fetched into L2 by the row groups' passes over this one:
             * group g takes its share of the lines, spread over the blocks of K. */
            const int64_t next_lines = un < next_end && groups > 1 ? unit_width(n, un) * k * 2 / 64 : 0;
            const int64_t share = prefetch_share(next_lines, groups);
            const char *next = (const char *)(packed + (un < next_end ? un : u) * UW * k);
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                const int first = k0 == 0, last = k0 + kc == k;
                for (int64_t r = 0, g = 0; r < m; r += MR, ++g) {
                    const int rows = (int)(m - r < MR ? m - r : MR);
                    int64_t start;
                    const int64_t lines = prefetch_lines(g, share, next_lines, k0, kc, k, &start);
                    MICROS[width / 16 - 1][rows - 1](xb + r * k + k0, k, kc, panel + k0 * width, width, bu,
                                                     y + r * ldy + n0, ldy, ncols, first, last,
                                                     next + start * 64, lines);
                }
            }
            u = un;
            end = next_end;
        }
    }
    free(xb);
    return 0;
}
#else
int bf16dot_gemm_ready(void) { return 0; }

int bf16dot_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      const float *bias, float *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)y, (void)ldy;
    return -1;
}
#endif
