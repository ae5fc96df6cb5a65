/* Vector helpers shared by the CPU kernels (k3.ops.cpu_kernels): 16-float vectors (one AVX-512
 * register, or a pair of 8-float vectors elsewhere), fixed-order reductions, and exp / sigmoid /
 * tanh / silu accurate to a few ulp (Cody-Waite range reduction and a degree-6 polynomial for exp).
 * Every function gives the same bits for the same inputs wherever it is called. */
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

/* Arithmetic on v16 goes through add16 / sub16 / mul16 / div16 / neg16 (and splat16 for a scalar
 * operand), comparisons through lt16 / gt16, never through C's operators, so that one source serves
 * both forms:
 *
 * - with AVX-512, v16 is GCC's 64-byte vector and the macros are its operators;
 * - elsewhere, v16 is a struct of two 32-byte vectors (lanes 0-7, 8-15), operated on half by half.
 *   GCC has no machine mode for a 64-byte vector there: it kept every such value in the stack frame
 *   and moved it through general-purpose registers on each update (a four-accumulator dot product:
 *   172 instructions for 8 FMAs, 96 of them stack references); a struct of two is split into two
 *   registers.
 *
 * Every lane sees the same operations either way. -ffp-contract=fast fuses a product into the add
 * that uses it, and which of two products is fused depends on the order they are computed in: the
 * pair macros evaluate their left operand first (K3_LEFT_FIRST; a function call's arguments are
 * evaluated right to left here), the order GCC took for the 64-byte form's operators in every kernel
 * here (tests/ops/test_vec_forms.py compares the two builds bit for bit). Forcing that order on the
 * 64-byte form as well gave the same bits but other code for the KDA scan, whose forward + backward
 * measured 3-10 % slower in three alternated runs, so the 64-byte form keeps the operators.
 *
 * GCC fuses a product and an add only inside one basic block, so a kernel keeps branches out from
 * between them. In rms_norm.c, a padded load of an accumulator (load16_pad, store16_part) let GCC
 * split the update at the tail test in the 64-byte form only, and RMSNorm's weight gradient
 * differed in the last bits between the two forms. */
#if K3_WIDE_REGISTERS
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));
/* Loads and stores go through a may_alias vector type, not memcpy: GCC expands a 64-byte memcpy as
 * two 32-byte moves on targets that prefer 256-bit vectors (-march=native on Sapphire Rapids), and a
 * v16 built that way goes through the stack (two stores, one reload that waits for them). In the
 * packed matmul's inner loop that cost 3x; the loads themselves are the same. */
typedef float v16_alias __attribute__((vector_size(64), aligned(4), may_alias));
static inline v16 load16(const float *p) { return *(const v16_alias *)p; }
static inline void store16(float *p, v16 v) { *(v16_alias *)p = v; }
static inline v16 splat16(float a) { return (v16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }
#define add16(a, b) ((a) + (b))
#define sub16(a, b) ((a) - (b))
#define mul16(a, b) ((a) * (b))
#define div16(a, b) ((a) / (b))
#define lt16(a, b) ((a) < (b))
#define gt16(a, b) ((a) > (b))
/* m ? a : b lane by lane (m: all ones or all zeros per lane, as comparisons give). */
static inline v16 select16(i16v m, v16 a, v16 b) { return (v16)(((i16v)a & m) | ((i16v)b & ~m)); }
/* 2^n for whole-numbered n in [-126, 127] (exp's scale): the exponent bits built directly. */
static inline v16 pow2i16(v16 n) {
    const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
    v16 r;
    memcpy(&r, &e, sizeof e);
    return r;
}
#else
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32), aligned(4)));
typedef float v8_alias __attribute__((vector_size(32), aligned(4), may_alias));
typedef struct { v8 lo, hi; } v16;
typedef struct { i8v lo, hi; } i16v;
static inline v16 load16(const float *p) { return (v16){*(const v8_alias *)p, *(const v8_alias *)(p + 8)}; }
static inline void store16(float *p, v16 v) {
    *(v8_alias *)p = v.lo;
    *(v8_alias *)(p + 8) = v.hi;
}
static inline v16 splat16(float a) { return (v16){(v8){a, a, a, a, a, a, a, a}, (v8){a, a, a, a, a, a, a, a}}; }
static inline v16 k3_add16(v16 a, v16 b) { return (v16){a.lo + b.lo, a.hi + b.hi}; }
static inline v16 k3_sub16(v16 a, v16 b) { return (v16){a.lo - b.lo, a.hi - b.hi}; }
static inline v16 k3_mul16(v16 a, v16 b) { return (v16){a.lo * b.lo, a.hi * b.hi}; }
static inline v16 k3_div16(v16 a, v16 b) { return (v16){a.lo / b.lo, a.hi / b.hi}; }
static inline i16v k3_lt16(v16 a, v16 b) { return (i16v){a.lo < b.lo, a.hi < b.hi}; }
static inline i16v k3_gt16(v16 a, v16 b) { return (i16v){a.lo > b.lo, a.hi > b.hi}; }
#define K3_LEFT_FIRST(f, a, b) ({ const v16 k3_left_ = (a); f(k3_left_, (b)); })
#define add16(a, b) K3_LEFT_FIRST(k3_add16, a, b)
#define sub16(a, b) K3_LEFT_FIRST(k3_sub16, a, b)
#define mul16(a, b) K3_LEFT_FIRST(k3_mul16, a, b)
#define div16(a, b) K3_LEFT_FIRST(k3_div16, a, b)
#define lt16(a, b) K3_LEFT_FIRST(k3_lt16, a, b)
#define gt16(a, b) K3_LEFT_FIRST(k3_gt16, a, b)
static inline v16 select16(i16v m, v16 a, v16 b) {
    return (v16){(v8)(((i8v)a.lo & m.lo) | ((i8v)b.lo & ~m.lo)), (v8)(((i8v)a.hi & m.hi) | ((i8v)b.hi & ~m.hi))};
}
static inline v16 pow2i16(v16 n) {
    const i8v lo = (__builtin_convertvector(n.lo, i8v) + 127) << 23;
    const i8v hi = (__builtin_convertvector(n.hi, i8v) + 127) << 23;
    v16 r;
    memcpy(&r.lo, &lo, sizeof lo);
    memcpy(&r.hi, &hi, sizeof hi);
    return r;
}
#endif

#if K3_WIDE_REGISTERS
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
#else
/* The same trees over the halves: lanes l and l + 8 are added first (lo + hi), then within 8 lanes
 * l + 4, l + 2, l + 1, so every sum pairs the same terms in the same order as the wide form. */
static inline float hsum8_of(v8 t) {
    t = t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3);
    t = t + __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5);
    t = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
    return t[0];
}
static inline float hsum16(v16 v) { return hsum8_of(v.lo + v.hi); }

/* Lane r of the result is hsum16(x[r]): y[r] = lanes l + (l + 8) of row r; then rows two at a time
 * (l + 4: four lanes each), four at a time (l + 2: two lanes each), eight at a time (l + 1). */
static inline v16 hsum16x16(const v16 *x) {
    v8 y[16], z[8], w[4], f[2];
    for (int r = 0; r < 16; r++) y[r] = x[r].lo + x[r].hi;
    for (int m = 0; m < 8; m++)      /* lanes 0-3: row 2m, 4-7: row 2m + 1 */
        z[m] = __builtin_shufflevector(y[2 * m], y[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(y[2 * m], y[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int n = 0; n < 4; n++)      /* lanes 2j, 2j + 1: row 4n + j */
        w[n] = __builtin_shufflevector(z[2 * n], z[2 * n + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(z[2 * n], z[2 * n + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    for (int p = 0; p < 2; p++)      /* lane j: row 8p + j */
        f[p] = __builtin_shufflevector(w[2 * p], w[2 * p + 1], 0, 2, 4, 6, 8, 10, 12, 14)
             + __builtin_shufflevector(w[2 * p], w[2 * p + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    return (v16){f[0], f[1]};
}
#endif

#if K3_WIDE_REGISTERS
#define neg16(a) (-(a))
#else
static inline v16 neg16(v16 a) { return (v16){-a.lo, -a.hi}; }
#endif

/* sum of a[k] * b[k], k < n, in 16 lanes then a tail: one fixed order per n. */
static inline float dot_f(const float *a, const float *b, int64_t n) {
    v16 acc = splat16(0.0f);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) acc = add16(acc, mul16(load16(a + k), load16(b + k)));
    float s = hsum16(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

static inline float sumsq_f(const float *a, int64_t n) { return dot_f(a, a, n); }

/* dot_f(a, b, n) + dot_f(c, d, m) with one reduction. */
static inline float dot2_f(const float *a, const float *b, int64_t n, const float *c, const float *d, int64_t m) {
    v16 acc = splat16(0.0f);
    int64_t k = 0, l = 0;
    for (; k + 16 <= n; k += 16) acc = add16(acc, mul16(load16(a + k), load16(b + k)));
    for (; l + 16 <= m; l += 16) acc = add16(acc, mul16(load16(c + l), load16(d + l)));
    float s = hsum16(acc);
    for (; k < n; k++) s += a[k] * b[k];
    for (; l < m; l++) s += c[l] * d[l];
    return s;
}

/* exp(x), x clamped to [-87.3, 88.7] (exp's fp32 range; below it, 0 is returned). */
static inline v16 vexp(v16 x) {
    const v16 hi = splat16(88.7f), lo = splat16(-87.3f);
    const i16v under = lt16(x, lo);
    x = select16(gt16(x, hi), hi, x);
    x = select16(under, lo, x);
    const v16 magic = splat16(12582912.0f);               /* 1.5 * 2^23: round to nearest */
    v16 n = sub16(add16(mul16(x, splat16(1.44269504088896341f)), magic), magic);
    v16 r = sub16(x, mul16(n, splat16(0.693359375f)));     /* ln 2 = 0.693359375 - 2.12194440e-4 */
    r = add16(r, mul16(n, splat16(2.12194440e-4f)));
    v16 p = splat16(1.9875691500e-4f);
    p = add16(mul16(p, r), splat16(1.3981999507e-3f));
    p = add16(mul16(p, r), splat16(8.3334519073e-3f));
    p = add16(mul16(p, r), splat16(4.1665795894e-2f));
    p = add16(mul16(p, r), splat16(1.6666665459e-1f));
    p = add16(mul16(p, r), splat16(5.0000001201e-1f));
    p = add16(add16(mul16(mul16(p, r), r), r), splat16(1.0f));
    return select16(under, splat16(0.0f), mul16(p, pow2i16(n)));
}

static inline v16 vsigmoid(v16 x) { return div16(splat16(1.0f), add16(splat16(1.0f), vexp(neg16(x)))); }
static inline v16 vsilu(v16 x) { return div16(x, add16(splat16(1.0f), vexp(neg16(x)))); }
static inline v16 vtanh(v16 x) {
    /* |x| < 0.625: x + x^3 P(x^2) (Cephes' tanhf); else sign(x) (1 - 2 / (exp(2|x|) + 1)) */
    const i16v neg = lt16(x, splat16(0.0f));
    const v16 a = select16(neg, neg16(x), x);
    v16 t = sub16(splat16(1.0f), div16(splat16(2.0f), add16(vexp(mul16(splat16(2.0f), a)), splat16(1.0f))));
    t = select16(neg, neg16(t), t);
    const v16 z = mul16(x, x);
    v16 p = splat16(-5.70498872745e-3f);
    p = add16(mul16(p, z), splat16(2.06390887954e-2f));
    p = sub16(mul16(p, z), splat16(5.37397155531e-2f));
    p = add16(mul16(p, z), splat16(1.33314422036e-1f));
    p = sub16(mul16(p, z), splat16(3.33332819422e-1f));
    return select16(lt16(a, splat16(0.625f)), add16(mul16(mul16(p, z), x), x), t);
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
 * and their total out[j] = sum over b of part[b * stride + j] for j < w, the blocks added in order, so
 * the result does not depend on which thread ran which block (stride >= w: a block's row may be padded
 * to whole vectors). */
static inline float *alloc_parts(int64_t n, int64_t w) {
    return calloc((size_t)(n > 0 ? n : 1) * (size_t)w, sizeof(float));
}

static inline void sum_parts(const float *part, int64_t n, int64_t stride, int64_t w, float *out) {
    memset(out, 0, sizeof(float) * (size_t)w);
    for (int64_t b = 0; b < n; b++)
        for (int64_t j = 0; j < w; j++) out[j] += part[b * stride + j];
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
