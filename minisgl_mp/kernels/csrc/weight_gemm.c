/*
 * y[M, N] = x[M, K] W[N, K]^T (* scale[N]) (+ bias[N]) with x and y float32 and W stored as
 * float32, float16, bfloat16 or int8 (weight-only, per-output-channel float scale). Each
 * weight vector is widened to float32 in registers and used for up to RMAX rows of x at once,
 * so a small batch reads W from memory once: the product is bound by the weight bytes.
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
#include <string.h>

enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_I8 = 3 };

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

/* Element i of a weight row in format FMT, widened. */
static inline float w_scalar(const void *row, int64_t i, const int fmt) {
    switch (fmt) {
    case FMT_F32: return ((const float *)row)[i];
    case FMT_F16: return f16_to_f32(((const uint16_t *)row)[i]);
    case FMT_BF16: return bf16_to_f32(((const uint16_t *)row)[i]);
    default: return (float)((const int8_t *)row)[i];
    }
}

static inline int64_t w_bytes(const int fmt) { return fmt == FMT_F32 ? 4 : fmt == FMT_I8 ? 1 : 2; }

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
    const int64_t wrow = k * w_bytes(fmt);
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

/* A single row of x (batch-1 decode): each channel's weight row is read as one sequential
 * stream, with four independent accumulator chains along K. Interleaving CMAX channels as
 * `tile` does splits the thread's reads into CMAX streams, which held 16-bit weights to about
 * half the machine's read rate; one stream reaches it. int8 rows are short in bytes, so the
 * hardware prefetcher starts too late on each: the next rows are prefetched by hand. */
#define I8_PREFETCH_BYTES 2048
static inline __attribute__((always_inline)) void row1(
    const float *x, int64_t k, const char *w, const int fmt, const float *scale, const float *bias,
    float *y, int64_t n0, int64_t n1) {
    const int64_t wrow = k * w_bytes(fmt);
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

#define DEFINE_FMT(NAME, FMT)                                                                     \
    static void NAME(const float *x, int64_t m, int64_t k, const char *w, const float *scale,    \
                     const float *bias, float *y, int64_t ldy, int64_t n) {                       \
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

/* Returns 0, or -1 for an unknown format. scale: [N] for int8 (NULL otherwise); bias: [N] or NULL. */
int weight_gemm(const float *x, int64_t m, int64_t k, const void *w, int fmt, const float *scale,
                const float *bias, float *y, int64_t ldy, int64_t n) {
    switch (fmt) {
    case FMT_F32: gemm_f32(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_F16: gemm_f16(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_BF16: gemm_bf16(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    case FMT_I8: gemm_i8(x, m, k, (const char *)w, scale, bias, y, ldy, n); return 0;
    default: return -1;
    }
}

/* 512 (AVX-512F), 256 (AVX2 + FMA + F16C) or 0 (plain C): the path this build compiled. */
int weight_gemm_isa(void) { return ISA; }
