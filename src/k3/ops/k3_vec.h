/* Vector helpers shared by the CPU kernels (k3.ops.cpu_kernels): 16-float vectors in GCC's vector
 * extension (one AVX-512 register, or two AVX2 ones), fixed-order reductions, and exp / sigmoid /
 * tanh / silu accurate to a few ulp (Cody-Waite range reduction and a degree-6 polynomial for
 * exp). Every function gives the same bits for the same inputs wherever it is called. */
#ifndef K3_VEC_H
#define K3_VEC_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 32 registers of 16 floats (AVX-512), or fewer and narrower (AVX2: 16 of 8): a kernel that keeps many
 * v16 accumulators live picks a narrower loop on the latter, with each sum's terms in the same order. */
#if defined(__AVX512F__)
#define K3_WIDE_REGISTERS 1
#else
#define K3_WIDE_REGISTERS 0
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

/* Loads and stores go through a may_alias vector type, not memcpy: GCC expands a 64-byte memcpy as
 * two 32-byte moves on targets that prefer 256-bit vectors (-march=native on Sapphire Rapids), and a
 * v16 built that way goes through the stack (two stores, one reload that waits for them). In the
 * packed matmul's inner loop that cost 3x; the loads themselves are the same. */
typedef float v16_alias __attribute__((vector_size(64), aligned(4), may_alias));
static inline v16 load16(const float *p) { return *(const v16_alias *)p; }
static inline void store16(float *p, v16 v) { *(v16_alias *)p = v; }
static inline v16 splat16(float a) { return (v16){0} + a; }

static inline float hsum16(v16 v) {   /* a fixed tree: halves, quarters, ... (4 dependent adds) */
    v16 t = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    t = t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    t = t + __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    t = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return t[0];
}

/* Sixteen hsum16 at once: lane r of the result is hsum16(x[r]), bit for bit (the same tree: the
 * pairs are added in the same order, and each add is commutative), with 30 shuffles and 15 adds
 * instead of 64 and 64. Level by level, each vector carries the partial sums of 2, 4, 8, 16 rows. */
static inline v16 hsum16x16(const v16 *x) {
    v16 y[8], z[4], w[2];
    for (int m = 0; m < 8; m++)      /* lanes l, l + 8: rows 2m (lanes 0-7) and 2m + 1 (8-15) */
        y[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7,
                                       16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * m], x[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int n = 0; n < 4; n++)      /* l, l + 4: rows 4n .. 4n + 3, four lanes each */
        z[n] = __builtin_shufflevector(y[2 * n], y[2 * n + 1], 0, 1, 2, 3, 8, 9, 10, 11,
                                       16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(y[2 * n], y[2 * n + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                       20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)      /* l, l + 2: rows 8p .. 8p + 7, two lanes each */
        w[p] = __builtin_shufflevector(z[2 * p], z[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13,
                                       16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(z[2 * p], z[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                       18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)   /* l, l + 1 */
         + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* sum of a[k] * b[k], k < n, in 16 lanes then a tail: one fixed order per n. */
static inline float dot_f(const float *a, const float *b, int64_t n) {
    v16 acc = {0};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) acc += load16(a + k) * load16(b + k);
    float s = hsum16(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

static inline float sumsq_f(const float *a, int64_t n) { return dot_f(a, a, n); }

/* dot_f(a, b, n) + dot_f(c, d, m) with one reduction. */
static inline float dot2_f(const float *a, const float *b, int64_t n, const float *c, const float *d, int64_t m) {
    v16 acc = {0};
    int64_t k = 0, l = 0;
    for (; k + 16 <= n; k += 16) acc += load16(a + k) * load16(b + k);
    for (; l + 16 <= m; l += 16) acc += load16(c + l) * load16(d + l);
    float s = hsum16(acc);
    for (; k < n; k++) s += a[k] * b[k];
    for (; l < m; l++) s += c[l] * d[l];
    return s;
}

/* m ? a : b lane by lane (m: all ones or all zeros per lane, as comparisons give). */
static inline v16 select16(i16v m, v16 a, v16 b) { return (v16)(((i16v)a & m) | ((i16v)b & ~m)); }

/* exp(x), x clamped to [-87.3, 88.7] (exp's fp32 range; below it, 0 is returned). */
static inline v16 vexp(v16 x) {
    const v16 hi = splat16(88.7f), lo = splat16(-87.3f);
    const i16v under = x < lo;
    x = select16(x > hi, hi, x);
    x = select16(under, lo, x);
    const v16 magic = splat16(12582912.0f);               /* 1.5 * 2^23: round to nearest */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693359375f;                          /* ln 2 = 0.693359375 - 2.12194440e-4 */
    r = r + n * 2.12194440e-4f;
    v16 p = splat16(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
    v16 two_n;
    memcpy(&two_n, &e, sizeof e);
    return select16(under, splat16(0.0f), p * two_n);
}

static inline v16 vsigmoid(v16 x) { return 1.0f / (1.0f + vexp(-x)); }
static inline v16 vsilu(v16 x) { return x / (1.0f + vexp(-x)); }
static inline v16 vtanh(v16 x) {
    /* |x| < 0.625: x + x^3 P(x^2) (Cephes' tanhf); else sign(x) (1 - 2 / (exp(2|x|) + 1)) */
    const i16v neg = x < 0.0f;
    const v16 a = select16(neg, -x, x);
    v16 t = 1.0f - 2.0f / (vexp(2.0f * a) + 1.0f);
    t = select16(neg, -t, t);
    const v16 z = x * x;
    v16 p = splat16(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return select16(a < 0.625f, p * z * x + x, t);
}

/* The 16 floats at p + i, or the n - i < 16 left with the rest of the vector set to pad. */
static inline v16 load16_pad(const float *p, int64_t i, int64_t n, float pad) {
    if (i + 16 <= n) return load16(p + i);
    float t[16];
    for (int64_t j = 0; j < 16; j++) t[j] = i + j < n ? p[i + j] : pad;
    return load16(t);
}

/* Store v at p + i, only its first n - i lanes when fewer than 16 are left. */
static inline void store16_part(float *p, int64_t i, int64_t n, v16 v) {
    if (i + 16 <= n) {
        store16(p + i, v);
        return;
    }
    float t[16];
    store16(t, v);
    memcpy(p + i, t, sizeof(float) * (size_t)(n - i));
}

/* Per-block partial sums of a reduction over rows: n blocks of w floats, zeroed (NULL without memory),
 * and their total out[j] = sum over b of part[b * w + j], the blocks added in order, so the result
 * does not depend on which thread ran which block. */
static inline float *alloc_parts(int64_t n, int64_t w) {
    return calloc((size_t)(n > 0 ? n : 1) * (size_t)w, sizeof(float));
}

static inline void sum_parts(const float *part, int64_t n, int64_t w, float *out) {
    memset(out, 0, sizeof(float) * (size_t)w);
    for (int64_t b = 0; b < n; b++)
        for (int64_t j = 0; j < w; j++) out[j] += part[b * w + j];
}

/* f applied to n floats in place (16 at a time, the tail through a padded vector). */
#define K3_MAP(name, f)                                                    \
    static inline void name(float *x, int64_t n) {                        \
        int64_t i = 0;                                                     \
        for (; i + 16 <= n; i += 16) store16(x + i, f(load16(x + i)));     \
        if (i < n) {                                                       \
            float t[16] = {0};                                             \
            memcpy(t, x + i, (size_t)(n - i) * sizeof(float));            \
            store16(t, f(load16(t)));                                      \
            memcpy(x + i, t, (size_t)(n - i) * sizeof(float));             \
        }                                                                  \
    }
K3_MAP(map_exp, vexp)
K3_MAP(map_sigmoid, vsigmoid)
K3_MAP(map_silu, vsilu)
K3_MAP(map_tanh, vtanh)

#endif
