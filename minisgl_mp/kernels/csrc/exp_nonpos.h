/* The softmax exponential shared by the attention kernels (paged_attention.c,
 * extend_attention.c). Included, not linked: each kernel inlines and vectorizes it. */
#ifndef MINISGL_MP_EXP_NONPOS_H
#define MINISGL_MP_EXP_NONPOS_H

#include <stdint.h>

/* exp(x) for x <= 0 (softmax inputs after subtracting the max), vectorizable: x = n ln2 + r,
 * e^r from a degree-6 polynomial (relative error ~2e-7), 2^n built in the exponent bits. */
static inline float exp_nonpos(float x) {
    /* Below e^-80 a probability is as good as 0; keeping it would only make products with V
     * denormal, and denormal arithmetic is ~100x slower on x86. */
    const float keep = x < -80.0f ? 0.0f : 1.0f;
    x = x < -80.0f ? -80.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } bits = {.i = ((int32_t)n + 127) << 23};
    return keep * p * bits.f;
}

#endif
