/*
 * The machine's float32 FMA ceiling, as a probe for the benchmarks: every thread runs ACC
 * independent chains of vector FMAs (more than the FMA latency times the FMA units, so the
 * chains never wait on each other) from registers, with no memory traffic. A product kernel's
 * GFLOP/s over this figure says how much of the arithmetic the machine has is left unused:
 * a prefill near it cannot be made faster by any kernel, only by fewer FLOPs.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ACC 12

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vfirst(vf v) { return _mm512_cvtss_f32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vfirst(vf v) { return _mm256_cvtss_f32(v); }
#else
#define LANES 1
typedef float vf;
#define VSET(x) (x)
#define VFMA(a, b, c) ((a) * (b) + (c))
static inline float vfirst(vf v) { return v; }
#endif

/* GFLOP/s of `iters` rounds per thread over all of OpenMP's threads (each FMA: 2 FLOPs a lane). */
double fma_peak_gflops(int64_t iters) {
    double seconds = 0.0;
    int threads = 1;
    volatile float sink = 0.0f;
#pragma omp parallel
    {
        vf acc[ACC];
        for (int j = 0; j < ACC; ++j) acc[j] = VSET(1.0f + 1e-3f * (float)j);
        const vf m = VSET(0.999999f), a = VSET(1e-7f);
#pragma omp barrier
#ifdef _OPENMP
        const double t0 = omp_get_wtime();
#endif
        for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
            for (int j = 0; j < ACC; ++j) acc[j] = VFMA(acc[j], m, a);
#pragma omp barrier
#ifdef _OPENMP
#pragma omp single
        {
            seconds = omp_get_wtime() - t0;
            threads = omp_get_num_threads();
        }
#endif
        float s = 0.0f;
        for (int j = 0; j < ACC; ++j) s += vfirst(acc[j]);
#pragma omp critical
        sink += s;
    }
    (void)sink;
    return seconds > 0.0 ? 2.0 * LANES * ACC * (double)iters * threads / seconds / 1e9 : 0.0;
}
