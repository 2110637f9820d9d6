/* What the kernels share: a vector of 8 floats (GCC / Clang vector types, lowered to whatever width the CPU has),
 * a dot product, and the panel product both quantized reads and the segment attention reduce to. */
#ifndef PYRAMIDKV_COMMON_H
#define PYRAMIDKV_COMMON_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }

/* sum_i a[i] b[i], in eight interleaved partial sums (one chain would wait on every add). */
static inline float dot(const float *a, const float *b, int64_t count) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) acc += load8(a + i) * load8(b + i);
    float sum = 0.0f;
    for (int k = 0; k < 8; ++k) sum += acc[k];
    for (; i < count; ++i) sum += a[i] * b[i];
    return sum;
}

/* The one product every kernel reduces to, a panel at a time: sums[r][0..16) = sum_i w[r * ws + i] m[i * ms + 0..16)
 * for r < rows <= 4, i < count. Each loaded row of m serves every r; the rows x 2 sums of 8 are independent
 * chains held in registers. */
#define PANEL 16
#define PANEL_ROWS 4

static inline void panel_rows(const float *w, int64_t ws, const float *m, int64_t ms, int64_t count,
                              float sums[PANEL_ROWS][PANEL], const int rows) {
    v8 acc[PANEL_ROWS][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = (v8){0};
    for (int64_t i = 0; i < count; ++i) {
        v8 lo = load8(m + i * ms), hi = load8(m + i * ms + 8);
        for (int r = 0; r < rows; ++r) {
            float x = w[r * ws + i];
            acc[r][0] += x * lo;
            acc[r][1] += x * hi;
        }
    }
    for (int r = 0; r < rows; ++r) {
        memcpy(sums[r], &acc[r][0], sizeof(v8));
        memcpy(sums[r] + 8, &acc[r][1], sizeof(v8));
    }
}

static void panel(const float *w, int64_t ws, const float *m, int64_t ms, int64_t count,
                  float sums[PANEL_ROWS][PANEL], int rows) {
    switch (rows) {                            /* constant row counts: the loop over r unrolls */
        case 1: panel_rows(w, ws, m, ms, count, sums, 1); break;
        case 2: panel_rows(w, ws, m, ms, count, sums, 2); break;
        case 3: panel_rows(w, ws, m, ms, count, sums, 3); break;
        default: panel_rows(w, ws, m, ms, count, sums, 4); break;
    }
}

/* The same sums for a panel narrower than 16 (a group size that is not a multiple of 16). */
static void narrow_panel(const float *w, int64_t ws, const float *m, int64_t ms, int64_t count, int64_t width,
                         float sums[PANEL_ROWS][PANEL], int rows) {
    for (int r = 0; r < rows; ++r)
        for (int64_t t = 0; t < width; ++t) {
            float sum = 0.0f;
            for (int64_t i = 0; i < count; ++i) sum += w[r * ws + i] * m[i * ms + t];
            sums[r][t] = sum;
        }
}

#endif
