/*
 * Fused elementwise steps of a decoder layer on the CPU, float32. Each replaces a chain of
 * small PyTorch ops (one dispatch and one pass over memory each) with one pass:
 *   add_rmsnorm_f32   x += residual (optional), out = RMSNorm(x) * w
 *   qk_norm_rope_f32  per-head RMSNorm of q and k (optional weights), then rotary embedding,
 *                     read from the fused qkv projection and written contiguous.
 * The arithmetic follows the PyTorch path (transformers' order): mean of squares, times
 * 1/sqrt(mean + eps), times the weight; rotate-half RoPE with a [pos, 2, d] cos/sin table.
 */
#include <math.h>
#include <stdint.h>

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
