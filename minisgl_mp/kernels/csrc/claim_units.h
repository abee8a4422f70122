/*
 * How the panel product kernels share out a product's columns (packed_gemm.c below its
 * packed-x path, so decode batches; bf16dot_gemm.c every product): the threads take runs of
 * units as they come, instead of a fixed share each.
 * A thread that starts late (woken from sleep: the server's OpenMP threads wait passively) or
 * is preempted by another process mid-product leaves its share to the others, where a fixed
 * split would keep the whole team waiting for it (docs/benchmarks.md sections 28 and 30).
 * Which thread computes a unit does not change its bits, so the product is the one-thread
 * product. (amx_gemm.c keeps a fixed split: taking runs measured no different there.)
 */
#ifndef MINISGL_MP_CLAIM_UNITS_H
#define MINISGL_MP_CLAIM_UNITS_H
#include <stdint.h>

/* Hands a thread the next run of units [start, *end): a share of what is left, at least one
 * unit. The runs shrink as the work runs out, so the first ones are long and contiguous (the
 * weight streams as one run) and the last ones balance the finish. Returns `units` (and sets
 * *end to it) when none is left. */
static inline int64_t claim_units(int64_t *claimed, int64_t units, int64_t threads, int64_t *end) {
    int64_t start = __atomic_load_n(claimed, __ATOMIC_RELAXED), take;
    do {
        if (start >= units) {
            *end = units;
            return units;
        }
        take = (units - start) / (2 * threads);
        if (take < 1) take = 1;
    } while (!__atomic_compare_exchange_n(claimed, &start, start + take, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *end = start + take;
    return start;
}
#endif
