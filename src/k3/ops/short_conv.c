/* KDA's short convolution (k3.ops.short_conv): a causal depthwise conv of width K over time with SiLU,
 * forward and backward, on x [B, T, C] (channels contiguous), taps wT [K, C], left context
 * prev [B, C, K-1] (NULL: zeros):
 *
 *   z[b, t, c] = sum_k wT[k, c] xx(b, t - (K-1) + k, c),   y = SiLU(z) = z sigmoid(z)
 *   xx(b, s, c) = x[b, s, c] for s >= 0, prev[b, c, K-1+s] for s < 0
 *
 * Backward, from dy: dz = dy s (1 + z (1 - s)) with s = sigmoid(z) (z recomputed),
 *   dxx(b, s, c) = sum_k wT[k, c] dz[b, s + (K-1) - k, c]  (the terms with 0 <= t < T),
 *   dwT[k, c]    = sum over b, t of dz[b, t, c] xx(b, t - (K-1) + k, c).
 *
 * Work runs in blocks of 64 tokens of one row b; a block recomputes the K-1 dz rows after it that
 * its dx needs, and keeps its own dwT sum, added over the blocks in order at the end: no result
 * depends on the thread count. Functions return 1 for K outside 1..16, -1 without memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { CONV_BLOCK = 64, CONV_MAX_K = 16 };

static inline float xx_at(const float *x, const float *prev, int64_t T, int64_t C, int64_t K, int64_t b,
                          int64_t s, int64_t c) {
    if (s >= 0) return x[(b * T + s) * C + c];
    return prev ? prev[(b * C + c) * (K - 1) + (K - 1 + s)] : 0.0f;
}

/* z for tokens [t0, t1) of row b into z [(t1 - t0), C]. */
static void conv_rows(const float *x, const float *prev, const float *wT, int64_t T, int64_t C, int64_t K,
                      int64_t b, int64_t t0, int64_t t1, float *z) {
    for (int64_t t = t0; t < t1; t++) {
        float *zt = z + (t - t0) * C;
        for (int64_t c = 0; c < C; c++) zt[c] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const int64_t s = t - (K - 1) + k;
            const float *wk = wT + k * C;
            if (s >= 0) {
                const float *xs = x + (b * T + s) * C;
                for (int64_t c = 0; c < C; c++) zt[c] += wk[c] * xs[c];
            } else {
                for (int64_t c = 0; c < C; c++) zt[c] += wk[c] * xx_at(x, prev, T, C, K, b, s, c);
            }
        }
    }
}

int k3_short_conv_silu(int64_t B, int64_t T, int64_t C, int64_t K, const float *x, const float *prev,
                       const float *wT, float *y, int nthreads) {
    if (K < 1 || K > CONV_MAX_K) return 1;
    const int64_t nblk = (T + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * nblk; item++) {
        const int64_t b = item / nblk, t0 = (item % nblk) * CONV_BLOCK;
        const int64_t t1 = t0 + CONV_BLOCK < T ? t0 + CONV_BLOCK : T;
        float *yb = y + (b * T + t0) * C;
        conv_rows(x, prev, wT, T, C, K, b, t0, t1, yb);
        map_silu(yb, (t1 - t0) * C);
    }
    return 0;
}

int k3_short_conv_silu_bwd(int64_t B, int64_t T, int64_t C, int64_t K, const float *x, const float *prev,
                           const float *wT, const float *dy, float *dx, float *dprev, float *dwT, int nthreads) {
    if (K < 1 || K > CONV_MAX_K) return 1;
    const int64_t nblk = (T + CONV_BLOCK - 1) / CONV_BLOCK;
    const int64_t nitems = B * nblk;
    float *part = alloc_parts(nitems, K * C);
    if (!part) return -1;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < nitems; item++) {
        const int64_t b = item / nblk, t0 = (item % nblk) * CONV_BLOCK;
        const int64_t t1 = t0 + CONV_BLOCK < T ? t0 + CONV_BLOCK : T;
        const int64_t te = t1 + K - 1 < T ? t1 + K - 1 : T;      /* dz rows this block's dx reads */
        float *dz = malloc(sizeof(float) * (size_t)((te - t0) * C));
        if (!dz) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        conv_rows(x, prev, wT, T, C, K, b, t0, te, dz);        /* z, then dz in place */
        for (int64_t t = t0; t < te; t++) {
            float *r = dz + (t - t0) * C;
            const float *g = dy + (b * T + t) * C;
            int64_t c = 0;
            for (; c + 16 <= C; c += 16) {
                const v16 z = load16(r + c), s = vsigmoid(z);
                store16(r + c, mul16(mul16(load16(g + c), s), add16(splat16(1.0f), mul16(z, sub16(splat16(1.0f), s)))));
            }
            for (; c < C; c++) {
                const float z = r[c], s = 1.0f / (1.0f + expf(-z));
                r[c] = g[c] * s * (1.0f + z * (1.0f - s));
            }
        }
        float *acc = part + item * K * C;                          /* dwT over this block's tokens */
        for (int64_t t = t0; t < t1; t++) {
            const float *r = dz + (t - t0) * C;
            for (int64_t k = 0; k < K; k++) {
                const int64_t s = t - (K - 1) + k;
                float *ak = acc + k * C;
                if (s >= 0) {
                    const float *xs = x + (b * T + s) * C;
                    for (int64_t c = 0; c < C; c++) ak[c] += r[c] * xs[c];
                } else {
                    for (int64_t c = 0; c < C; c++) ak[c] += r[c] * xx_at(x, prev, T, C, K, b, s, c);
                }
            }
        }
        /* dx for s in [t0, t1), and for the block at t0 = 0 the left context s in [-(K-1), 0) */
        const int64_t s0 = (t0 == 0 && dprev) ? -(K - 1) : t0;
        float row[4096];
        float *tmp = C <= 4096 ? row : malloc(sizeof(float) * (size_t)C);
        if (!tmp) {
#pragma omp atomic write
            failed = 1;
            free(dz);
            continue;
        }
        for (int64_t s = s0; s < t1; s++) {
            for (int64_t c = 0; c < C; c++) tmp[c] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const int64_t t = s + (K - 1) - k;
                if (t < 0 || t >= T) continue;
                const float *r = dz + (t - t0) * C, *wk = wT + k * C;
                for (int64_t c = 0; c < C; c++) tmp[c] += wk[c] * r[c];
            }
            if (s >= 0) memcpy(dx + (b * T + s) * C, tmp, sizeof(float) * (size_t)C);
            else
                for (int64_t c = 0; c < C; c++) dprev[(b * C + c) * (K - 1) + (K - 1 + s)] = tmp[c];
        }
        if (tmp != row) free(tmp);
        free(dz);
    }
    if (!failed) sum_parts(part, nitems, K * C, K * C, dwT);
    free(part);
    return failed ? -1 : 0;
}
