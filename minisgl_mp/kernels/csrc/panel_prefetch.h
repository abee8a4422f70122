/*
 * The register-tiled panel kernels (packed_gemm.c, bf16dot_gemm.c) stream one unit of packed
 * weights per thread at a time: the first row group's pass over a unit reads it from memory,
 * the later passes compute from L2, and those later passes fetch the thread's next unit into
 * L2 as they go, so its first pass does not wait on memory either. This is how the next unit's
 * cache lines are shared out among them.
 */
#ifndef MINISGL_MP_PANEL_PREFETCH_H
#define MINISGL_MP_PANEL_PREFETCH_H
#include <stdint.h>

/* Lines per later row group: `next_lines` cache lines of the next unit over groups 1.. of
 * `groups` (0 when there is no next unit or only one group). */
static inline int64_t prefetch_share(int64_t next_lines, int64_t groups) {
    return groups > 1 ? (next_lines + groups - 2) / (groups - 1) : 0;
}

/* The run of lines row group g prefetches while it passes over inputs [k0, k0 + kc) of k:
 * its share, spread evenly over the blocks of K. Sets *start (a line index) and returns how
 * many lines, 0 for the first group. */
static inline int64_t prefetch_lines(int64_t g, int64_t share, int64_t next_lines, int64_t k0, int64_t kc,
                                     int64_t k, int64_t *start) {
    *start = 0;
    if (g == 0 || share == 0) return 0;
    *start = (g - 1) * share + share * k0 / k;
    const int64_t end = *start + (share * kc + k - 1) / k;
    const int64_t lines = (end < next_lines ? end : next_lines) - *start;
    return lines > 0 ? lines : 0;
}
#endif
