/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias[N]) on Intel's AMX matrix units, for bfloat16 weights:
 * x (float32) is rounded to bfloat16 once per call (nearest even), the tiles multiply
 * bfloat16 pairs and accumulate in float32, and y is the float32 accumulator itself (no
 * rounding of the output). On CPUs without 16-bit matrix units the same weights go through
 * weight_gemm.c, widened to float32; with AMX a 16-row product runs on the tiles at about the
 * weights' memory rate, where the float32 FMAs of the widening kernel are the bound.
 *
 * Built only where the compiler targets AMX (-march=native on such a CPU); elsewhere every
 * entry point reports the kernel unavailable. Linux hands a process the tile registers'
 * state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM), which `amx_gemm_ready` does once.
 *
 * Packed weight: for each block j of 32 output channels and each chunk c of 32 inputs, two
 * 1 KiB B tiles (channels 0-15, then 16-31 of the block) in the tiles' pair layout:
 *   packed[j][c][t][r][n][p] = W[32 j + 16 t + n][32 c + 2 r + p]
 * so a thread streaming block j reads one contiguous run. N and K must be multiples of 32.
 *
 * Tiles: 0-3 the accumulators of a 32 x 32 block of y (rows 0-15 / 16-31, channels 0-15 /
 * 16-31), 4-5 the two 16-row A tiles, 6-7 the two B tiles. Threads split the channel blocks;
 * rows are taken in chunks whose bfloat16 copy stays in L2 while a thread's blocks pass over it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int amx_gemm_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    if (n % 32 || k % 32) return -1;
    const int64_t nc = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n / 32; ++j)
        for (int64_t c = 0; c < nc; ++c) {
            uint16_t *dst = out + (j * nc + c) * 1024;
            for (int t = 0; t < 2; ++t)
                for (int r = 0; r < 16; ++r)
                    for (int col = 0; col < 16; ++col) {
                        const uint16_t *src = w + (j * 32 + t * 16 + col) * k + c * 32 + 2 * r;
                        dst[((t * 16 + r) * 16 + col) * 2] = src[0];
                        dst[((t * 16 + r) * 16 + col) * 2 + 1] = src[1];
                    }
        }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define A_CHUNK_BYTES (512 * 1024) /* a row chunk's bfloat16 copy, kept in L2 */
#define B_PREFETCH 4                /* chunks of B tiles ahead (2 KiB each) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int ready = -1;

int amx_gemm_ready(void) {
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* Rows of the accumulators and A tiles: `lo` for rows 0-15 of a block, `hi` for 16-31. */
static void config(tile_config *cfg, int lo, int hi) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    const int rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
    for (int i = 0; i < 8; ++i) {
        cfg->rows[i] = (uint8_t)rows[i];
        cfg->colsb[i] = 64;
    }
}

/* One block of y from A's 16-row groups a0 (and a1 when `two`: more than 16 rows, tiles 2, 3
 * and 5 in use), each a run of 1 KiB tiles, one per chunk of 32 inputs. */
static inline void block(const uint16_t *a0, const uint16_t *a1, int64_t nc, const uint16_t *b, float *y,
                         int64_t ldy, int two) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t c = 0; c < nc; ++c) {
        /* The weights stream from memory: a tile load waits out the whole latency (the tiles
         * are not renamed, so little else runs meanwhile) unless its lines are on their way. */
        const char *next = (const char *)(b + (c + B_PREFETCH) * 1024);
        for (int l = 0; l < 2048; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
        _tile_loadd(6, b + c * 1024, 64);
        _tile_loadd(7, b + c * 1024 + 512, 64);
        _tile_loadd(4, a0 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + c * 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, y, ldy * 4);
    _tile_stored(1, y + 16, ldy * 4);
    if (two) {
        _tile_stored(2, y + 16 * ldy, ldy * 4);
        _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
    }
}

static inline uint16_t to_bf16(float f) { /* nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x rows `ldx` floats apart, y rows `ldy` apart. Returns 0, or -1 (no AMX here, bad shapes,
 * or no memory for x's bfloat16 copy). */
int amx_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                  const float *bias, float *y, int64_t ldy) {
    if (!amx_gemm_ready() || n % 32 || k % 32 || m <= 0) return -1;
    /* x in bfloat16, as A tiles: for each group of 16 rows and chunk c of 32 inputs, 16 rows of
     * 64 bytes in a row (a row-major copy would put a tile's rows 2K bytes apart, few L1 sets). */
    const int64_t nc = k / 32, groups = (m + 15) / 16;
    uint16_t *a = aligned_alloc(64, (size_t)(groups * nc * 1024));
    if (!a) return -1;
    const int64_t nb = n / 32;
    int64_t chunk = A_CHUNK_BYTES / (2 * k) / 32 * 32; /* a multiple of 32: only the last block is short */
    if (chunk < 32) chunk = 32;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) {
            const float *xr = x + i * ldx;
            uint16_t *ar = a + (i / 16) * nc * 512 + (i % 16) * 32;
            for (int64_t c = 0; c < nc; ++c, xr += 32, ar += 512) {
#ifdef __AVX512BF16__
                _mm256_storeu_si256((__m256i *)ar, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr)));
                _mm256_storeu_si256((__m256i *)(ar + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + 16)));
#else
                for (int e = 0; e < 32; ++e) ar[e] = to_bf16(xr[e]);
#endif
            }
        }
        /* the implicit barrier: every row of a is written */
        const int64_t rem = m % 32;
        tile_config full, tail;
        config(&full, 16, 16);
        config(&tail, rem > 16 ? 16 : (rem ? (int)rem : 1), rem > 16 ? (int)(rem - 16) : 1);
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
#else
        const int64_t nt = 1, tid = 0;
#endif
        const int64_t j0 = nb * tid / nt, j1 = nb * (tid + 1) / nt;
        int loaded = 0; /* 1: full, 2: tail */
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            for (int64_t j = j0; j < j1; ++j) {
                const uint16_t *bj = packed + j * nc * 1024;
                int64_t i = m0;
                for (; i + 32 <= m1; i += 32) {
                    if (loaded != 1) _tile_loadconfig(&full), loaded = 1;
                    block(a + i / 16 * nc * 512, a + (i / 16 + 1) * nc * 512, nc, bj, y + i * ldy + j * 32, ldy, 1);
                }
                if (i < m1) { /* the last rem rows of y */
                    if (loaded != 2) _tile_loadconfig(&tail), loaded = 2;
                    block(a + i / 16 * nc * 512, rem > 16 ? a + (i / 16 + 1) * nc * 512 : NULL, nc, bj,
                          y + i * ldy + j * 32, ldy, rem > 16);
                }
                if (bias)
                    for (int64_t r = m0; r < m1; ++r)
                        for (int64_t col = j * 32; col < j * 32 + 32; ++col) y[r * ldy + col] += bias[col];
            }
        }
        if (loaded) _tile_release();
    }
    free(a);
    return 0;
}
#else
int amx_gemm_ready(void) { return 0; }

int amx_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                  const float *bias, float *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)y, (void)ldy;
    return -1;
}
#endif
