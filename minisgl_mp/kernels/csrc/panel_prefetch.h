/*
 * The register-tiled panel kernels (packed_gemm.c, bf16dot_gemm.c) stream one unit of packed
 * weights per thread at a time, the row groups of x passing over it one after another. While
 * they pass over a unit, every group fetches its share of the thread's next unit into L2, so
 * that memory is busy for the whole of the unit's passes and the next unit's first pass does
 * not wait on it. (The first group used to take no share, on the reading that its pass was the
 * one waiting on memory; but in steady state its unit is already in L2, fetched during the
 * previous unit, so memory sat idle through it: at 9-16 rows, two groups, a layer's products
 * ran 1.2-1.4x slower than with every group prefetching, docs/benchmarks.md section 24.) With
 * a single group there is no share: its pass reads the unit it computes on, prefetching a few
 * steps ahead, and adding the next unit's lines measured slower. This is how the lines are
 * shared out.
 */
#ifndef MINISGL_MP_PANEL_PREFETCH_H
#define MINISGL_MP_PANEL_PREFETCH_H
#include <stdint.h>

/* Lines per row group: `next_lines` cache lines of the next unit over the `groups` groups (0
 * when there is no next unit or only one group). */
static inline int64_t prefetch_share(int64_t next_lines, int64_t groups) {
    return groups > 1 ? (next_lines + groups - 1) / groups : 0;
}

/* The run of lines row group g prefetches while it passes over inputs [k0, k0 + kc) of k:
 * its share, spread evenly over the blocks of K. Sets *start (a line index) and returns how
 * many lines. */
static inline int64_t prefetch_lines(int64_t g, int64_t share, int64_t next_lines, int64_t k0, int64_t kc,
                                     int64_t k, int64_t *start) {
    *start = 0;
    if (share == 0) return 0;
    *start = g * share + share * k0 / k;
    const int64_t end = *start + (share * kc + k - 1) / k;
    const int64_t lines = (end < next_lines ? end : next_lines) - *start;
    return lines > 0 ? lines : 0;
}
#endif
