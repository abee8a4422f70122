/*
 * Fused elementwise steps of a decoder layer on the CPU, float32. Each replaces a chain of
 * small PyTorch ops (one dispatch and one pass over memory each) with one pass:
 *   add_rmsnorm_f32   x += residual (optional), out = RMSNorm(x) * w
 *   qk_norm_rope_f32  per-head RMSNorm of q and k (optional weights), then rotary embedding,
 *                     read from the fused qkv projection and written contiguous.
 *   silu_mul_f32      SwiGLU: silu(gate) * up from the fused gate/up projection.
 *   kv_store_f32      a step's new K and V rows scattered into the pool's slots.
 * The arithmetic follows the PyTorch path (transformers' order): mean of squares, times
 * 1/sqrt(mean + eps), times the weight; rotate-half RoPE with a [pos, 2, d] cos/sin table.
 */
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

static inline float inv_rms(const float *x, int64_t n, float eps) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
    return 1.0f / sqrtf(s / (float)n + eps);
}

void add_rmsnorm_f32(float *x, const float *residual, const float *w, float eps, float *out,
                     int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * dim;
        if (residual) {
            const float *rr = residual + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) xr[i] += rr[i];
        }
        const float inv = inv_rms(xr, dim, eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (xr[i] * inv);
    }
}

/* One head: y = norm(x) * w (when w), then rotate-half RoPE with cos/sin rows cs[0..d), cs[d..2d). */
static inline void head_norm_rope(const float *x, const float *w, float eps, const float *cs,
                                  int64_t d, float *out) {
    float y[1024];
    const float inv = w ? inv_rms(x, d, eps) : 1.0f;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) y[i] = w ? w[i] * (x[i] * inv) : x[i];
    const int64_t h = d / 2;
    const float *c = cs, *s = cs + d;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = y[i] * c[i] + (-y[i + h]) * s[i];
#pragma omp simd
    for (int64_t i = h; i < d; ++i) out[i] = y[i] * c[i] + y[i - h] * s[i];
}

/* qkv: [T, row_stride] with q heads at column 0, k heads at hq * d; q_out [T, hq, d],
 * k_out [T, hkv, d]; cos_sin: [max_pos, 2, d]; pos: [T]. d must be even and at most 1024. */
void qk_norm_rope_f32(const float *qkv, int64_t tokens, int64_t row_stride, int64_t hq, int64_t hkv,
                      int64_t d, const float *q_w, const float *k_w, float eps, const float *cos_sin,
                      const int64_t *pos, float *q_out, float *k_out) {
    const int64_t heads = hq + hkv;
#pragma omp parallel for schedule(static) if (tokens * heads * d >= 65536)
    for (int64_t w = 0; w < tokens * heads; ++w) {
        const int64_t t = w / heads, h = w % heads;
        const float *cs = cos_sin + pos[t] * 2 * d;
        const float *x = qkv + t * row_stride + h * d;
        if (h < hq)
            head_norm_rope(x, q_w, eps, cs, d, q_out + (t * hq + h) * d);
        else
            head_norm_rope(x, k_w, eps, cs, d, k_out + (t * hkv + (h - hq)) * d);
    }
}

/* silu(g) * u = g * u / (1 + e^-g). e^x for x in [-87, 88] (clamped), within ~2 ulp: Cephes'
 * polynomial after reducing by ln 2, then scaled by 2^n; in vector intrinsics where the CPU has
 * them (the compiler does not vectorise libm's expf without -ffast-math, which this library must
 * not be built with: see kernels/cpu.py). */
#define EXP_POLY(P, R, FMA, SET)                                                                    \
    P = FMA(SET(1.9875691500e-4f), R, SET(1.3981999507e-3f));                                       \
    P = FMA(P, R, SET(8.3334519073e-3f));                                                           \
    P = FMA(P, R, SET(4.1665795894e-2f));                                                           \
    P = FMA(P, R, SET(1.6666665459e-1f));                                                           \
    P = FMA(P, R, SET(5.0000001201e-1f));

static inline float silu_mul_one(float g, float u) {
    const float x = fminf(fmaxf(-g, -87.0f), 88.0f);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return g * u / (1.0f + ldexpf(p, (int)n));
}

static void silu_mul_row(const float *g, const float *u, float *o, int64_t d) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f), one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= d; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
        const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), lo), hi);
        const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                              _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
        r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
        __m512 p;
        EXP_POLY(p, r, _mm512_fmadd_ps, _mm512_set1_ps)
        p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), one);
        const __m512 e = _mm512_scalef_ps(p, n);
        _mm512_storeu_ps(o + i, _mm512_div_ps(_mm512_mul_ps(gv, uv), _mm512_add_ps(one, e)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= d; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
        const __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), lo), hi);
        const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
        __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
        r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
        __m256 p;
        EXP_POLY(p, r, _mm256_fmadd_ps, _mm256_set1_ps)
        p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), one);
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(gv, uv), _mm256_add_ps(one, e)));
    }
#endif
    for (; i < d; ++i) o[i] = silu_mul_one(g[i], u[i]);
}

/* SwiGLU over a fused gate/up projection: out[r, i] = silu(g) * u with g = gate_up[r, i],
 * u = gate_up[r, d + i]. One pass instead of PyTorch's (silu over a strided half, then the
 * product, each a pass over memory into a fresh tensor). */
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t d, int64_t row_stride, float *out) {
#pragma omp parallel for schedule(static) if (rows * d >= 65536)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * row_stride, gate_up + r * row_stride + d, out + r * d, d);
}

/* Round to nearest even, NaN kept quiet: what torch's float -> bfloat16 cast does. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* pool[loc[t]] = rows[t] for K and V alike: row floats a token (its kv heads), the sources'
 * rows `k_stride` / `v_stride` floats apart (v is a view into the fused qkv projection), the
 * pool's rows contiguous, float32 or (bf16) bfloat16. One call in place of two index_copy_
 * (and two casts) a layer; the slots come from the page allocator and are not checked here. */
void kv_store_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *loc,
                  int64_t tokens, int64_t row, void *k_pool, void *v_pool, int bf16) {
#pragma omp parallel for schedule(static) if (tokens * row >= 262144)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *ks = k + t * k_stride, *vs = v + t * v_stride;
        if (!bf16) {
            memcpy((float *)k_pool + loc[t] * row, ks, sizeof(float) * (size_t)row);
            memcpy((float *)v_pool + loc[t] * row, vs, sizeof(float) * (size_t)row);
        } else {
            uint16_t *kd = (uint16_t *)k_pool + loc[t] * row, *vd = (uint16_t *)v_pool + loc[t] * row;
#pragma omp simd
            for (int64_t i = 0; i < row; ++i) kd[i] = to_bf16(ks[i]);
#pragma omp simd
            for (int64_t i = 0; i < row; ++i) vd[i] = to_bf16(vs[i]);
        }
    }
}
