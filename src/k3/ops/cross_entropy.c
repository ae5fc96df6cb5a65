/* Softmax cross-entropy of N rows of logits z [N, V] (contiguous) against targets y [N] (k3.ops.loss):
 *
 *   lse_i = m_i + log sum_j exp(z_ij - m_i),  m_i = max_j z_ij,     loss_i = lse_i - z_i,y_i
 *
 * and rows whose target is ignore_index get loss 0 (lse is still written). Backward, from the
 * per-row loss gradient g [N]:  dz_ij = g_i (exp(z_ij - lse_i) - [j = y_i]), 0 on ignored rows.
 *
 * Each row is one task, reduced in a fixed order (16 lanes, then a fixed tree), so a row's values do
 * not depend on the thread count or on the rows beside it. Both functions return 0, or 1 when a target
 * is outside [0, V) and not ignore_index (nothing is written then).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

static inline float hmax16(v16 v) {
    float t[16];
    store16(t, v);
    float m = t[0];
    for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
    return m;
}

static float row_lse(const float *z, int64_t V) {
    v16 mv = splat16(-INFINITY);
    for (int64_t j = 0; j < V; j += 16) {
        const v16 x = load16_pad(z, j, V, -INFINITY);
        mv = select16(gt16(x, mv), x, mv);
    }
    const float m = hmax16(mv);
    if (!isfinite(m)) return m;                  /* +inf or NaN logits: the sum is meaningless */
    v16 s = splat16(0.0f);
    for (int64_t j = 0; j < V; j += 16) s = add16(s, vexp(sub16(load16_pad(z, j, V, -INFINITY), splat16(m))));
    return m + logf(hsum16(s));
}

static int bad_target(const int64_t *y, int64_t N, int64_t V, int64_t ignore) {
    for (int64_t i = 0; i < N; i++)
        if (y[i] != ignore && (y[i] < 0 || y[i] >= V)) return 1;
    return 0;
}

int k3_cross_entropy(int64_t N, int64_t V, const float *z, const int64_t *y, int64_t ignore, float *loss,
                      float *lse, int nthreads) {
    if (bad_target(y, N, V, ignore)) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < N; i++) {
        const float *zi = z + i * V;
        lse[i] = row_lse(zi, V);
        loss[i] = y[i] == ignore ? 0.0f : lse[i] - zi[y[i]];
    }
    return 0;
}

int k3_cross_entropy_bwd(int64_t N, int64_t V, const float *z, const int64_t *y, int64_t ignore,
                         const float *lse, const float *g, float *dz, int nthreads) {
    if (bad_target(y, N, V, ignore)) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < N; i++) {
        float *di = dz + i * V;
        if (y[i] == ignore) {
            memset(di, 0, sizeof(float) * (size_t)V);
            continue;
        }
        const float *zi = z + i * V;
        const float gi = g[i], li = lse[i];
        for (int64_t j = 0; j < V; j += 16)
            store16_part(di, j, V, mul16(splat16(gi), vexp(sub16(load16_pad(zi, j, V, 0.0f), splat16(li)))));
        di[y[i]] -= gi;
    }
    return 0;
}
