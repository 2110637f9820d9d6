/* Decode attention over ragged full-precision segments, a whole layer in one call (core/layout.py's segment path:
 * a segment is one prompt's stored head, holding its own number of kept rows). For each segment s and each of its
 * query rows r (pre-scaled):
 *
 *   logits = q_r . keys[offsets[s] .. offsets[s + 1])  (rows marked gone: the lowest float), then the tail's logits
 *   p      = softmax(logits) in float32
 *   out_r  = p[:L] @ values[segment rows] + p[L:] @ tail_values[s]
 *
 * as the torch ops do it (the same float32 operands; exp by the polynomial below, within 2 ulp of expf; the sums in
 * another order). Logits come plain: a soft-capped model reads through the torch ops. */
#include <float.h>
#include "common.h"

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error below
 * 2e-8 there), times 2^n made in the exponent bits. Below -87.3 (where expf leaves the normal range) 0, as the
 * masked logits need: exp(lowest - max) is exactly 0. */
static inline v8i bits_of(v8 x) { v8i b; memcpy(&b, &x, sizeof b); return b; }
static inline v8 floats_of(v8i b) { v8 x; memcpy(&x, &b, sizeof x); return x; }
static inline v8 select8(v8i mask, v8 a, v8 b) { return floats_of((mask & bits_of(a)) | (~mask & bits_of(b))); }

static inline v8 exp8(v8 x) {
    const v8 low = (v8){0} - 87.3f, high = (v8){0} + 88.0f;
    v8i under = x < low;
    x = select8(under, low, x);
    x = select8(x > high, high, x);
    v8 t = x * 1.44269504088896341f;
    v8 n = (t + 12582912.0f) - 12582912.0f;              /* round to nearest: 1.5 * 2^23 */
    v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v8 p = (v8){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i exponent = (__builtin_convertvector(n, v8i) + 127) << 23;
    return floats_of(~under & bits_of(p * floats_of(exponent)));
}

/* p[0..count) = exp(p - max) / sum, in place; max and sum over the row. */
static void softmax_row(float *p, int64_t count) {
    float most = -FLT_MAX;
    for (int64_t i = 0; i < count; ++i) most = p[i] > most ? p[i] : most;
    v8 sums = {0};
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        v8 e = exp8(load8(p + i) - most);
        memcpy(p + i, &e, sizeof e);
        sums += e;
    }
    float total = 0.0f;
    for (int k = 0; k < 8; ++k) total += sums[k];
    if (i < count) {
        float rest[8];
        for (int k = 0; k < 8; ++k) rest[k] = i + k < count ? p[i + k] : -FLT_MAX;
        v8 e = exp8(load8(rest) - most);
        for (int k = 0; i + k < count; ++k) {
            p[i + k] = e[k];
            total += e[k];
        }
    }
    float inverse = 1.0f / total;
    for (int64_t k = 0; k < count; ++k) p[k] *= inverse;
}

/* queries [S, rows, D] (pre-scaled), keys and values [R, D] (segment-major, segment s at rows offsets[s] ..
 * offsets[s + 1]), gone: uint8 [R] or NULL (1: the row's token left), tail_logits [S, rows, t] (masked where
 * needed), tail_values [S, t, D], out [S, rows, D]; all float32 and contiguous. Returns 0, or 1 when memory ran
 * out. */
int pk_segment_attend(const float *queries, const float *keys, const float *values, const int64_t *offsets,
                      const uint8_t *gone, const float *tail_logits, const float *tail_values, int64_t S,
                      int64_t rows, int64_t D, int64_t t, float *out) {
    int64_t longest = 0;
    for (int64_t s = 0; s < S; ++s)
        longest = offsets[s + 1] - offsets[s] > longest ? offsets[s + 1] - offsets[s] : longest;
    int64_t width = longest + t;
    float *probs = malloc(sizeof(float) * (size_t)(PANEL_ROWS * width));
    if (!probs) return 1;
    float sums[PANEL_ROWS][PANEL], tail_sums[PANEL_ROWS][PANEL];
    for (int64_t s = 0; s < S; ++s) {
        int64_t first = offsets[s], length = offsets[s + 1] - first, span = length + t;
        const float *k0 = keys + first * D, *v0 = values + first * D, *tv = tail_values + s * t * D;
        for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
            int rb = rows - r0 < PANEL_ROWS ? (int)(rows - r0) : PANEL_ROWS;
            for (int r = 0; r < rb; ++r) {
                const float *q = queries + (s * rows + r0 + r) * D;
                float *p = probs + r * span;
                for (int64_t l = 0; l < length; ++l)
                    p[l] = gone && gone[first + l] ? -FLT_MAX : dot(q, k0 + l * D, D);
                memcpy(p + length, tail_logits + (s * rows + r0 + r) * t, sizeof(float) * (size_t)t);
                softmax_row(p, span);
            }
            for (int64_t c = 0; c < D; c += PANEL) {
                int64_t cols = D - c < PANEL ? D - c : PANEL;
                if (cols == PANEL) {
                    panel(probs, span, v0 + c, D, length, sums, rb);
                    panel(probs + length, span, tv + c, D, t, tail_sums, rb);
                } else {
                    narrow_panel(probs, span, v0 + c, D, length, cols, sums, rb);
                    narrow_panel(probs + length, span, tv + c, D, t, cols, tail_sums, rb);
                }
                for (int r = 0; r < rb; ++r)
                    for (int64_t i = 0; i < cols; ++i)
                        out[(s * rows + r0 + r) * D + c + i] = sums[r][i] + tail_sums[r][i];
            }
        }
    }
    free(probs);
    return 0;
}
