/* Decode attention's two products over uniformly quantized KV (KIVI's plain groups), reading the packed
 * codes directly: a code's level is made in a small buffer at the moment it is multiplied and never
 * written to memory. Built and loaded by pyramidkv/native, wrapped by quantization/native.py; kernels.py and cells.py hold the same products in
 * torch ops (the fallback) and their docstrings the algebra:
 *
 *   keys (per channel, groups of G tokens):
 *     score[n, r, j G + t] = sum_d (q[n, r, d] scale[d]) level[d, t] + sum_d q[n, r, d] zero[d]
 *   values (per token, groups of g channels):
 *     out[n, r, c] = sum_t (p[n, r, t] scale[t, c / g]) level[t, c] + sum_t p[n, r, t] zero[t, c / g]
 *
 * Group (n, j) of a block starts at byte n * sn + j * sj of the codes and at element n * ssn + j * ssj of
 * the scales and zeros, or, with `order`, at row order[n * J + j]: n * sn and n * ssn with n that row
 * (a stack of groups read as a grid of cells, quantization/cells.py). Scales and zeros are fp16.
 * Accumulation is float32, one output element at a time in d (keys) or t (values) order.
 */
#include "common.h"

#if defined(__FLT16_MANT_DIG__)
typedef _Float16 half_t;
static inline float half_to_float(const void *p) { return (float)*(const half_t *)p; }
#else
static inline float half_to_float(const void *p) {
    uint16_t h = *(const uint16_t *)p;
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {                                   /* subnormal: normalise */
        exponent = 113u;
        while (!(mantissa & 0x400u)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif

/* table[b * per + k]: the level of code k of byte value b (packing.py: little-endian fields). */
static void level_table(int nbits, float *table) {
    int per = 8 / nbits, mask = (1 << nbits) - 1;
    for (int b = 0; b < 256; ++b)
        for (int k = 0; k < per; ++k)
            table[b * per + k] = (float)((b >> (k * nbits)) & mask);
}

static inline void expand(const uint8_t *codes, int64_t nbytes, const float *table, int per, float *levels) {
    switch (per) {                             /* constant sizes: each copy is one move, not a call */
        case 4:
            for (int64_t b = 0; b < nbytes; ++b) memcpy(levels + 4 * b, table + 4 * (int64_t)codes[b], 16);
            break;
        case 2:
            for (int64_t b = 0; b < nbytes; ++b) memcpy(levels + 2 * b, table + 2 * (int64_t)codes[b], 8);
            break;
        default:
            for (int64_t b = 0; b < nbytes; ++b) levels[b] = table[codes[b]];
    }
}

static inline int64_t group_row(const int64_t *order, int64_t n, int64_t j, int64_t groups) {
    return order ? order[n * groups + j] : -1;
}

/* codes: channel layout; group (n, j) holds D channel rows of G codes, row d at + d * sd bytes.
 * scale, zero: fp16, channel d of group (n, j) at + d * ssd. queries: float32 [N, rows, D] (contiguous).
 * out: float32 [N, rows, J * G] (contiguous). Returns 0, or 1 when memory ran out. */
int pk_key_scores(const uint8_t *codes, int64_t sn, int64_t sj, int64_t sd,
                  const uint16_t *scale, const uint16_t *zero, int64_t ssn, int64_t ssj, int64_t ssd,
                  const int64_t *order, const float *queries, int64_t N, int64_t J, int64_t rows, int64_t D,
                  int64_t G, int nbits, float *out) {
    int per = 8 / nbits;
    float table[256 * 8], sums[PANEL_ROWS][PANEL], bias[PANEL_ROWS];
    level_table(nbits, table);
    float *levels = malloc(sizeof(float) * (size_t)(D * G + (2 + PANEL_ROWS) * D));  /* [D, G]; s, z; q * s */
    if (!levels) return 1;
    float *s = levels + D * G, *z = s + D, *scaled = z + D;
    for (int64_t n = 0; n < N; ++n) {
        const float *q = queries + n * rows * D;
        for (int64_t j = 0; j < J; ++j) {
            int64_t row = group_row(order, n, j, J);
            const uint8_t *c0 = row < 0 ? codes + n * sn + j * sj : codes + row * sn;
            int64_t s0 = row < 0 ? n * ssn + j * ssj : row * ssn;
            for (int64_t d = 0; d < D; ++d) {
                expand(c0 + d * sd, G / per, table, per, levels + d * G);
                s[d] = half_to_float(scale + s0 + d * ssd);
                z[d] = half_to_float(zero + s0 + d * ssd);
            }
            for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
                int rb = rows - r0 < PANEL_ROWS ? (int)(rows - r0) : PANEL_ROWS;
                for (int r = 0; r < rb; ++r) {
                    const float *qr = q + (r0 + r) * D;
                    for (int64_t d = 0; d < D; ++d) scaled[r * D + d] = qr[d] * s[d];
                    bias[r] = dot(qr, z, D);
                }
                for (int64_t t = 0; t < G; t += PANEL) {
                    int64_t width = G - t < PANEL ? G - t : PANEL;
                    if (width == PANEL) panel(scaled, D, levels + t, G, D, sums, rb);
                    else narrow_panel(scaled, D, levels + t, G, D, width, sums, rb);
                    for (int r = 0; r < rb; ++r) {
                        float *o = out + (n * rows + r0 + r) * J * G + j * G + t;
                        for (int64_t k = 0; k < width; ++k) o[k] = sums[r][k] + bias[r];
                    }
                }
            }
        }
    }
    free(levels);
    return 0;
}

/* codes: token layout; group (n, j) holds G token rows of D codes, token t at + t * st bytes.
 * scale, zero: fp16, channel group k of token t of group (n, j) at + t * sst + k (D / g groups).
 * probs: float32, p[n, r, j * G + t] at n * psn + r * psr + j * G + t. out: float32 [N, rows, D].
 * Tokens are read TOKENS at a time: their levels [TOKENS, D] made once, then every row's sums. */
#define TOKENS 32
int pk_weighted_values(const uint8_t *codes, int64_t sn, int64_t sj, int64_t st,
                       const uint16_t *scale, const uint16_t *zero, int64_t ssn, int64_t ssj, int64_t sst,
                       const int64_t *order, const float *probs, int64_t psn, int64_t psr, int64_t N, int64_t J,
                       int64_t rows, int64_t D, int64_t G, int64_t g, int nbits, float *out) {
    int per = 8 / nbits;
    int64_t groups = D / g;
    float table[256 * 8], sums[PANEL_ROWS][PANEL];
    level_table(nbits, table);
    /* levels [TOKENS, D]; s, z [groups, TOKENS]; weights [PANEL_ROWS, TOKENS] (p * scale) */
    float *levels = malloc(sizeof(float) * (size_t)(TOKENS * D + (2 * groups + PANEL_ROWS) * TOKENS));
    if (!levels) return 1;
    float *s = levels + TOKENS * D, *z = s + groups * TOKENS, *weights = z + groups * TOKENS;
    for (int64_t n = 0; n < N; ++n) {
        float *o = out + n * rows * D;
        memset(o, 0, sizeof(float) * (size_t)(rows * D));
        for (int64_t j = 0; j < J; ++j) {
            int64_t row = group_row(order, n, j, J);
            const uint8_t *c0 = row < 0 ? codes + n * sn + j * sj : codes + row * sn;
            int64_t s0 = row < 0 ? n * ssn + j * ssj : row * ssn;
            for (int64_t t0 = 0; t0 < G; t0 += TOKENS) {
                int64_t count = G - t0 < TOKENS ? G - t0 : TOKENS;
                for (int64_t t = 0; t < count; ++t) {
                    expand(c0 + (t0 + t) * st, D / per, table, per, levels + t * D);
                    for (int64_t k = 0; k < groups; ++k) {
                        s[k * TOKENS + t] = half_to_float(scale + s0 + (t0 + t) * sst + k);
                        z[k * TOKENS + t] = half_to_float(zero + s0 + (t0 + t) * sst + k);
                    }
                }
                for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
                    int rb = rows - r0 < PANEL_ROWS ? (int)(rows - r0) : PANEL_ROWS;
                    for (int64_t k = 0; k < groups; ++k) {
                        float offset[PANEL_ROWS];
                        for (int r = 0; r < rb; ++r) {
                            const float *p = probs + n * psn + (r0 + r) * psr + j * G + t0;
                            for (int64_t t = 0; t < count; ++t) weights[r * TOKENS + t] = p[t] * s[k * TOKENS + t];
                            offset[r] = dot(p, z + k * TOKENS, count);
                        }
                        for (int64_t c = k * g; c < (k + 1) * g; c += PANEL) {
                            int64_t width = (k + 1) * g - c < PANEL ? (k + 1) * g - c : PANEL;
                            if (width == PANEL) panel(weights, TOKENS, levels + c, D, count, sums, rb);
                            else narrow_panel(weights, TOKENS, levels + c, D, count, width, sums, rb);
                            for (int r = 0; r < rb; ++r)
                                for (int64_t i = 0; i < width; ++i) o[(r0 + r) * D + c + i] += sums[r][i] + offset[r];
                        }
                    }
                }
            }
        }
    }
    free(levels);
    return 0;
}
