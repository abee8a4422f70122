/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias[N]) for int8 and int4 weights on CPUs with AVX512-VNNI
 * (AMD Zen 4 and 5, Intel Cascade Lake and later) on its 16-bit integer dot products
 * (vpdpwssd): x is rounded once per call to int16 with a float32 scale per block of 32
 * inputs (nearest even, the block's largest magnitude to 32767), the weights are widened to
 * int16 in registers, each instruction multiplies 2 pairs into a 32-bit lane exactly, and each
 * block's integer sum is then scaled into a float32 accumulator. One instruction does the work
 * of two float32 FMAs and the widening of a weight is shared by every row, so where the
 * arithmetic bounds a product (prefill, decode batches) these run above the float32 rate that
 * widening the weights into float32 panels is held to; where the weight bytes do, they read
 * them as they are stored. The same arithmetic runs at every row count.
 *
 * Why int16 and not llama.cpp's int8 activations (vpdpbusd, twice the products a cycle): on
 * SmolLM2-135M rounding x to int8 per block of 32 moved logits by up to 1, enough to turn
 * "The capital of France is Paris." into another answer, in transformers as much as here;
 * int16 rounding is 256 times finer, below float32's own reordering noise at these sizes.
 *
 * Packed layout (vnni_gemm_pack_*), K a multiple of 32: output channels in units of 16 (the
 * last zero-padded past N), each unit's blocks of 32 inputs in turn. A block is 16 pairs of
 * inputs, each pair 16 channels x 2 values, so one widened 32-byte load is a vector of 16 lanes
 * holding 2 consecutive inputs of one channel, as vpdpwssd takes them.
 *   int8: byte (unit u, block b, pair p, channel c, input j) at ((u * B + b) * 16 + p) * 32 + 2 c + j.
 *         y = scale[n] sum over blocks of (x scale) sum(w xq) + bias.
 *   int4 (the Q4_1 blocks of int4.py): 256 bytes of nibbles per (unit, block), pairs 2 p and
 *         2 p + 1 in the low and high nibbles of bytes p * 32 + 2 c + j, then after every
 *         unit's nibbles the blocks' float16 scales d and minimums m, 16 each per (unit,
 *         block). y = sum over blocks of d (x scale) sum(q xq) + m sum(x) (+ bias), the minimum's
 *         share taken from x itself.
 *
 * Built only where the compiler targets AVX512-VNNI (-march=native on such a CPU); elsewhere
 * every entry point reports the kernel unavailable.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 32
#define LANES 16
#define I8_BLOCK 512 /* bytes of one (unit, block): 16 channels x 32 inputs */
#define Q4_NIBBLES 256
#define Q4_SRC_BLOCK 20 /* a Q4_1 block: d, m (float16), 16 bytes of nibbles */
#define MR 8            /* rows of x a tile takes: 8 int32 and 8 float32 accumulators */
#define ROW_CHUNK 64

enum { VNNI_I8 = 0, VNNI_Q4 = 1 };

static inline int64_t units_of(int64_t n) { return (n + LANES - 1) / LANES; }

/* Bytes of the packed buffer for a weight [N, K] (K a multiple of 32). */
int64_t vnni_gemm_packed_bytes(int fmt, int64_t n, int64_t k) {
    const int64_t cells = units_of(n) * (k / GROUP);
    return fmt == VNNI_I8 ? cells * I8_BLOCK : cells * (Q4_NIBBLES + 2 * LANES * 2);
}

/* int8 W [N, K] row-major -> the layout above; -1 when K is not a multiple of 32. */
int vnni_gemm_pack_i8(const int8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (k % GROUP || n <= 0 || k <= 0) return -1;
    const int64_t units = units_of(n), blocks = k / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = out + (u * blocks + b) * I8_BLOCK;
            for (int c = 0; c < LANES; ++c) {
                const int64_t ch = u * LANES + c;
                for (int i = 0; i < GROUP; ++i)
                    dst[(i / 2) * 32 + 2 * c + i % 2] = (uint8_t)(ch < n ? w[ch * k + b * GROUP + i] : 0);
            }
        }
    return 0;
}

/* int4 blocks [N, K / 32 * 20] (Q4_1) -> the layout above; -1 when K is not a multiple of 32. */
int vnni_gemm_pack_q4(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (k % GROUP || n <= 0 || k <= 0) return -1;
    const int64_t units = units_of(n), blocks = k / GROUP;
    uint16_t *scales = (uint16_t *)(out + units * blocks * Q4_NIBBLES);
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = out + (u * blocks + b) * Q4_NIBBLES;
            uint16_t *dm = scales + (u * blocks + b) * 2 * LANES;
            memset(dst, 0, Q4_NIBBLES);
            for (int c = 0; c < LANES; ++c) {
                const int64_t ch = u * LANES + c;
                const uint8_t *src = ch < n ? w + (ch * blocks + b) * Q4_SRC_BLOCK : NULL;
                uint16_t d = 0, m = 0;
                if (src) memcpy(&d, src, 2), memcpy(&m, src + 2, 2);
                dm[c] = d, dm[LANES + c] = m;
                for (int i = 0; i < GROUP; ++i) {
                    const int q = src ? (i < 16 ? src[4 + i] & 0x0f : src[4 + i - 16] >> 4) : 0;
                    const int pair = i / 2;
                    dst[(pair / 2) * 32 + 2 * c + i % 2] |= (uint8_t)(q << (4 * (pair % 2)));
                }
            }
        }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

int vnni_gemm_ready(void) { return 1; }

/* x's rows rounded to int16 per block of 32: xq [M, K], the blocks' scales sx [M, K / 32] and
 * (int4's minimums) each block's sum of x, xs [M, K / 32]. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int16_t *xq, float *sx, float *xs) {
    const int64_t blocks = k / GROUP;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float *xb = x + r * ldx + b * GROUP;
            const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
            const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
            _mm256_storeu_si256((__m256i *)(xq + r * k + b * GROUP), _mm512_cvtsepi32_epi16(qa));
            _mm256_storeu_si256((__m256i *)(xq + r * k + b * GROUP + 16), _mm512_cvtsepi32_epi16(qc));
            sx[r * blocks + b] = amax / 32767.0f;
            xs[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
        }
}

static inline __m512i bcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* With few rows a block's 16 dot products into one accumulator would wait on each other's
 * latency; they are spread over `chains` accumulators per row (as many as the tile's
 * registers hold, up to 4) and summed once per block. */
static inline __attribute__((always_inline)) int chains_for(int rows) {
    const int c = MR / rows;
    return c > 4 ? 4 : c;
}

static inline __attribute__((always_inline)) void fold_chains(__m512i *acc, int rows, int chains) {
#pragma GCC unroll 4
    for (int c = 1; c < 4; ++c)
        if (c < chains)
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
                if (r < rows) acc[r] = _mm512_add_epi32(acc[r], acc[c * rows + r]);
}

/* Rows [0, rows) of x (xq, sx, xs from that tile's first row) times one unit: the float32
 * sums of its 16 channels, before int8's scale and the bias. */
static inline __attribute__((always_inline)) void tile(
    const int fmt, const int rows, const uint8_t *wu, const uint16_t *dmu, int64_t blocks, const int16_t *xq,
    int64_t k, const float *sx, const float *xs, __m512 *out) {
    __m512 facc[MR];
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int chains = chains_for(rows);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i acc[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
        if (fmt == VNNI_I8) {
            const uint8_t *wb = wu + b * I8_BLOCK;
            _mm_prefetch((const char *)(wb + 4 * I8_BLOCK), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + 4 * I8_BLOCK + 256), _MM_HINT_T0);
#pragma GCC unroll 16
            for (int p = 0; p < 16; ++p) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + p * 32)));
                const int c = rows * (p % chains);
#pragma GCC unroll 8
                for (int r = 0; r < MR; ++r)
                    if (r < rows)
                        acc[c + r] = _mm512_dpwssd_epi32(acc[c + r], wv, bcast_pair(xq + r * k + b * GROUP + 2 * p));
            }
            fold_chains(acc, rows, chains);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
                if (r < rows)
                    facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(sx[r * blocks + b]), facc[r]);
        } else {
            const uint8_t *wb = wu + b * Q4_NIBBLES;
            _mm_prefetch((const char *)(wb + 4 * Q4_NIBBLES), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + 4 * Q4_NIBBLES + 128), _MM_HINT_T0);
#pragma GCC unroll 8
            for (int p = 0; p < 8; ++p) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + p * 32));
                const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low));
                const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
                const int c0 = rows * ((2 * p) % chains), c1 = rows * ((2 * p + 1) % chains);
#pragma GCC unroll 8
                for (int r = 0; r < MR; ++r)
                    if (r < rows) {
                        const int16_t *xr = xq + r * k + b * GROUP + 4 * p;
                        acc[c0 + r] = _mm512_dpwssd_epi32(acc[c0 + r], lo, bcast_pair(xr));
                        acc[c1 + r] = _mm512_dpwssd_epi32(acc[c1 + r], hi, bcast_pair(xr + 2));
                    }
            }
            fold_chains(acc, rows, chains);
            const uint16_t *dm = dmu + b * 2 * LANES;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm));
            const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + LANES)));
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
                if (r < rows) {
                    const int64_t at = r * blocks + b;
                    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(sx[at]));
                    facc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[at]), _mm512_fmadd_ps(t, d, facc[r]));
                }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) out[r] = facc[r];
}

#define TILE_CASE(F, R) \
    case R: tile(F, R, wu, dmu, blocks, xq + r0 * k, k, sx + r0 * blocks, xs + r0 * blocks, acc); break;
#define TILES(F)                                                                                            \
    switch (rows) {                                                                                         \
        TILE_CASE(F, 1) TILE_CASE(F, 2) TILE_CASE(F, 3) TILE_CASE(F, 4) TILE_CASE(F, 5) TILE_CASE(F, 6) \
        TILE_CASE(F, 7) default: tile(F, MR, wu, dmu, blocks, xq + r0 * k, k, sx + r0 * blocks,       \
                                      xs + r0 * blocks, acc);                                           \
    }

/* 0, -1 for a K not a multiple of 32 or an unknown format, -2 when x's int16 copy could not be
 * allocated. packed: vnni_gemm_pack_*'s buffer; scale: int8's [N] (NULL for int4). */
int vnni_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, int fmt, const uint8_t *packed,
              const float *scale, const float *bias, float *y, int64_t ldy, int64_t n) {
    if (k % GROUP || (fmt != VNNI_I8 && fmt != VNNI_Q4)) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t blocks = k / GROUP, units = units_of(n);
    int16_t *xq = (int16_t *)malloc((size_t)(m * k) * sizeof(int16_t) + (size_t)(2 * m * blocks) * sizeof(float));
    if (xq == NULL) return -2;
    float *sx = (float *)(xq + m * k), *xs = sx + m * blocks;
    quantize_rows(x, m, k, ldx, xq, sx, xs);
    const uint16_t *dm_all = fmt == VNNI_Q4 ? (const uint16_t *)(packed + units * blocks * Q4_NIBBLES) : NULL;
    const int64_t unit_bytes = blocks * (fmt == VNNI_I8 ? I8_BLOCK : Q4_NIBBLES);
    /* Rows in chunks whose int16 x stays in L2 while every unit passes over it (one pass of
     * all rows per unit would read x from memory once per 16 channels). */
    for (int64_t c0 = 0; c0 < m; c0 += ROW_CHUNK) {
    const int64_t c1 = m - c0 < ROW_CHUNK ? m : c0 + ROW_CHUNK;
#pragma omp parallel for schedule(static) if ((c1 - c0) * n * k >= 32768)
    for (int64_t u = 0; u < units; ++u) {
        const uint8_t *wu = packed + u * unit_bytes;
        const uint16_t *dmu = dm_all ? dm_all + u * blocks * 2 * LANES : NULL;
        const int64_t n0 = u * LANES, cols = n - n0 < LANES ? n - n0 : LANES;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        const __m512 sc = fmt == VNNI_I8 ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.0f);
        const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int64_t r0 = c0; r0 < c1; r0 += MR) {
            const int rows = c1 - r0 < MR ? (int)(c1 - r0) : MR;
            __m512 acc[MR];
            if (fmt == VNNI_I8) {
                TILES(VNNI_I8)
            } else {
                TILES(VNNI_Q4)
            }
            for (int r = 0; r < rows; ++r)
                _mm512_mask_storeu_ps(y + (r0 + r) * ldy + n0, mask, _mm512_fmadd_ps(acc[r], sc, bi));
        }
    }
    }
    free(xq);
    return 0;
}
#else
int vnni_gemm_ready(void) { return 0; }
int vnni_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, int fmt, const uint8_t *packed,
              const float *scale, const float *bias, float *y, int64_t ldy, int64_t n) {
    (void)x, (void)m, (void)k, (void)ldx, (void)fmt, (void)packed, (void)scale, (void)bias, (void)y, (void)ldy, (void)n;
    return -1;
}
#endif
