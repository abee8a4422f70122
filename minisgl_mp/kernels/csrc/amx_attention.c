/*
 * Causal attention of long query runs (prefill chunks, extends over a cached prefix) on AMX
 * tiles, for models whose linear products run there (bfloat16 weights, amx_gemm.c). Same
 * arguments as extend_attention.c's kernel: q, out [T, Hq, D] float32; k, v [S, Hkv, D] the
 * float32 pool of one layer, read through kv_index [B, stride]; q_start, q_len, kv_len [B].
 * D a multiple of 32, at most 256; whole query groups.
 *
 * Q (times the softmax scale), K, V and the probabilities are rounded to bfloat16 for the two
 * products; the scores, the online softmax and the output accumulate in float32. The float32
 * kernel runs both products on the FMA units, about as slow as the linear products it sits
 * between were before the tiles.
 *
 * A work item is (request, kv head): its keys and values are packed once into tiles (K as the
 * B operand of Q K^T, 16 keys by 32 dims a tile; V as the B operand of P V, 32 keys by 16 dims),
 * then blocks of RB query rows (query tokens times the head's query heads, which share those
 * keys) meet blocks of KB keys: scores in four float32 tiles per 32 keys, the softmax row by
 * row in memory, and P V added into the float32 output rows, loaded into tiles and stored back
 * per key block. Key blocks past a query block's last position are skipped.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpos.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <math.h>

int amx_gemm_ready(void); /* amx_gemm.c */

#define RB 32 /* query rows per block: two 16-row tiles */
#define KB 64 /* keys per block */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} att_tile_config;

static inline uint16_t bf16_round(float f) { /* nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint32_t bf16_pair(float lo, float hi) {
    return (uint32_t)bf16_round(lo) | ((uint32_t)bf16_round(hi) << 16);
}

/* exp_nonpos on 16 lanes: the same range reduction and polynomial. */
static inline __m512 vexp_nonpos(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-80.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

static inline void store_bf16x16(uint16_t *dst, __m512 x) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(x));
}

/* K of keys [0, nk) of one head into tiles: tile (key16, c) holds pairs of dims 32c + 2r + p
 * for its 16 keys n: word [r][n]. Keys past nk are zeros (masked later). */
static void pack_k(const float *k, const int64_t *idx, int64_t nk, int64_t nkeys, int64_t hkv, int64_t h,
                   int64_t d, uint32_t *kp) {
    const int64_t dc = d / 32;
    for (int64_t key = 0; key < nkeys; ++key) {
        uint32_t *tile0 = kp + (key / 16) * dc * 256 + key % 16;
        const float *row = key < nk ? k + (idx[key] * hkv + h) * d : NULL;
        for (int64_t c = 0; c < dc; ++c)
            for (int r = 0; r < 16; ++r)
                tile0[c * 256 + r * 16] = row ? bf16_pair(row[32 * c + 2 * r], row[32 * c + 2 * r + 1]) : 0;
    }
}

/* V into tiles: tile (key32, dt) holds, for the key pair (2r, 2r + 1) of its 32 keys and dim
 * 16 dt + n, word [r][n]. */
static void pack_v(const float *v, const int64_t *idx, int64_t nk, int64_t nkeys, int64_t hkv, int64_t h,
                   int64_t d, uint32_t *vp) {
    const int64_t dt_n = d / 16;
    for (int64_t key = 0; key < nkeys; key += 2) {
        const float *r0 = key < nk ? v + (idx[key] * hkv + h) * d : NULL;
        const float *r1 = key + 1 < nk ? v + (idx[key + 1] * hkv + h) * d : NULL;
        uint32_t *base = vp + (key / 32) * dt_n * 256 + ((key % 32) / 2) * 16;
        for (int64_t e = 0; e < d; ++e)
            base[(e / 16) * 256 + e % 16] = bf16_pair(r0 ? r0[e] : 0.0f, r1 ? r1[e] : 0.0f);
    }
}

/* 0, -1 when a thread could not allocate its scratch space, -2 when this build or CPU has no
 * AMX or the shapes are not ones it takes. */
int extend_attention_amx(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    if (!amx_gemm_ready() || d % 32 || d > 256 || hkv <= 0 || hq % hkv) return -2;
    const int64_t g = hq / hkv, dc = d / 32, dt_n = d / 16;
    int64_t max_kv = 0;
    for (int64_t b = 0; b < batch; ++b) max_kv = kv_len[b] > max_kv ? kv_len[b] : max_kv;
    const int64_t max_keys = (max_kv + KB - 1) / KB * KB;
    int failed = 0;
#pragma omp parallel
    {
        uint32_t *kp = aligned_alloc(64, (size_t)(max_keys * d * 2 + 64));
        uint32_t *vp = aligned_alloc(64, (size_t)(max_keys * d * 2 + 64));
        uint16_t *qp = aligned_alloc(64, RB * 256 * 2);
        uint16_t *pp = aligned_alloc(64, RB * KB * 2);
        float *s = aligned_alloc(64, RB * KB * 4);
        float *o = aligned_alloc(64, RB * 256 * 4);
        float m[RB], l[RB];
        const int ok = kp && vp && qp && pp && s && o;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        att_tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; ++i) {
            cfg.rows[i] = 16;
            cfg.colsb[i] = 64;
        }
        if (ok) _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < batch * hkv; ++item) {
            if (!ok) continue;
            const int64_t b = item / hkv, h = item % hkv;
            const int64_t nk = kv_len[b], nq = q_len[b], q0 = q_start[b], first = nk - nq;
            const int64_t *idx = kv_index + b * stride;
            const int64_t nkeys = (nk + KB - 1) / KB * KB;
            pack_k(k, idx, nk, nkeys, hkv, h, d, kp);
            pack_v(v, idx, nk, nkeys, hkv, h, d, vp);
            const int64_t nrows = nq * g;
            for (int64_t r0 = 0; r0 < nrows; r0 += RB) {
                const int64_t rows = nrows - r0 < RB ? nrows - r0 : RB;
                /* Q rows of this block (row = token * g + head of the group), scaled, as tiles
                 * (group of 16 rows, chunk c of 32 dims); rows past the run are zeros. */
                for (int64_t i = 0; i < RB; ++i) {
                    uint16_t *dst = qp + (i / 16) * dc * 512 + (i % 16) * 32;
                    const float *src = i < rows
                        ? q + ((q0 + (r0 + i) / g) * hq + h * g + (r0 + i) % g) * d : NULL;
                    for (int64_t e = 0; e < d; e += 16)
                        store_bf16x16(dst + (e / 32) * 512 + e % 32,
                                      src ? _mm512_mul_ps(_mm512_loadu_ps(src + e), _mm512_set1_ps(scale))
                                          : _mm512_setzero_ps());
                    m[i] = -INFINITY;
                    l[i] = 0.0f;
                }
                memset(o, 0, (size_t)(RB * d * 4));
                const int64_t limit = first + (r0 + rows - 1) / g + 1; /* keys the block's last row sees */
                for (int64_t kb = 0; kb * KB < limit; ++kb) {
                    for (int half = 0; half < KB / 32; ++half) {
                        const uint32_t *kt = kp + ((kb * KB + half * 32) / 16) * dc * 256;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int64_t c = 0; c < dc; ++c) {
                            _tile_loadd(4, qp + c * 512, 64);
                            _tile_loadd(5, qp + dc * 512 + c * 512, 64);
                            _tile_loadd(6, kt + c * 256, 64);
                            _tile_loadd(7, kt + dc * 256 + c * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                        _tile_stored(0, s + half * 32, KB * 4);
                        _tile_stored(1, s + half * 32 + 16, KB * 4);
                        _tile_stored(2, s + 16 * KB + half * 32, KB * 4);
                        _tile_stored(3, s + 16 * KB + half * 32 + 16, KB * 4);
                    }
                    /* The online softmax, a row at a time; P as A tiles (group, chunk of 32 keys). */
                    for (int64_t i = 0; i < RB; ++i) {
                        uint16_t *prow = pp + (i / 16) * (KB / 32) * 512 + (i % 16) * 32;
                        /* the last key of this block row i may see (-1: none) */
                        int64_t last = i < rows ? first + (r0 + i) / g - kb * KB : -1;
                        if (last > KB - 1) last = KB - 1;
                        const float *srow = s + i * KB;
                        if (last < 0) {
                            for (int j = 0; j < KB; j += 16) store_bf16x16(prow + (j / 32) * 512 + j % 32, _mm512_setzero_ps());
                            continue;
                        }
                        __m512 sv[KB / 16];
                        __mmask16 mask[KB / 16];
                        __m512 vmax = _mm512_set1_ps(m[i]);
                        for (int u = 0; u < KB / 16; ++u) {
                            const int64_t n = last + 1 - 16 * u; /* visible lanes of this vector */
                            mask[u] = n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                            sv[u] = _mm512_loadu_ps(srow + 16 * u);
                            vmax = _mm512_mask_max_ps(vmax, mask[u], vmax, sv[u]);
                        }
                        const float mx = _mm512_reduce_max_ps(vmax);
                        const float alpha = m[i] == -INFINITY ? 0.0f : exp_nonpos(m[i] - mx);
                        __m512 vsum = _mm512_setzero_ps();
                        for (int u = 0; u < KB / 16; ++u) {
                            const __m512 p = _mm512_maskz_mov_ps(mask[u], vexp_nonpos(_mm512_sub_ps(sv[u], _mm512_set1_ps(mx))));
                            vsum = _mm512_add_ps(vsum, p);
                            store_bf16x16(prow + ((16 * u) / 32) * 512 + (16 * u) % 32, p);
                        }
                        l[i] = l[i] * alpha + _mm512_reduce_add_ps(vsum);
                        m[i] = mx;
                        if (alpha != 1.0f) {
                            float *orow = o + i * d;
                            for (int64_t e = 0; e < d; e += 16)
                                _mm512_storeu_ps(orow + e, _mm512_mul_ps(_mm512_loadu_ps(orow + e), _mm512_set1_ps(alpha)));
                        }
                    }
                    for (int64_t dp = 0; dp < d / 32; ++dp) {
                        float *oc = o + dp * 32;
                        _tile_loadd(0, oc, d * 4);
                        _tile_loadd(1, oc + 16, d * 4);
                        _tile_loadd(2, oc + 16 * d, d * 4);
                        _tile_loadd(3, oc + 16 * d + 16, d * 4);
                        for (int kc = 0; kc < KB / 32; ++kc) {
                            const uint32_t *vt = vp + ((kb * KB) / 32 + kc) * dt_n * 256 + 2 * dp * 256;
                            _tile_loadd(4, pp + kc * 512, 64);
                            _tile_loadd(5, pp + (KB / 32) * 512 + kc * 512, 64);
                            _tile_loadd(6, vt, 64);
                            _tile_loadd(7, vt + 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                        _tile_stored(0, oc, d * 4);
                        _tile_stored(1, oc + 16, d * 4);
                        _tile_stored(2, oc + 16 * d, d * 4);
                        _tile_stored(3, oc + 16 * d + 16, d * 4);
                    }
                }
                for (int64_t i = 0; i < rows; ++i) {
                    float *dst = out + ((q0 + (r0 + i) / g) * hq + h * g + (r0 + i) % g) * d;
                    const float inv = 1.0f / l[i];
                    for (int64_t e = 0; e < d; ++e) dst[e] = o[i * d + e] * inv;
                }
            }
        }
        if (ok) _tile_release();
        free(kp);
        free(vp);
        free(qp);
        free(pp);
        free(s);
        free(o);
    }
    return failed ? -1 : 0;
}
#else
int extend_attention_amx(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale) {
    (void)q, (void)k, (void)v, (void)kv_index, (void)stride, (void)q_start, (void)q_len, (void)kv_len, (void)out;
    (void)batch, (void)hq, (void)hkv, (void)d, (void)scale;
    return -2;
}
#endif
