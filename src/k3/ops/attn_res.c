/* Block AttnRes mixing (k3.ops.attn_res, SPEC 3.3) in the folded form: for n sources v_i, rows of H,
 * with q = sqrt(H) (gamma * w) and c = H eps,
 *
 *   p_i = <q, v_i>,   r_i = (|v_i|^2 + c)^(-1/2),   logit_i = p_i r_i,   alpha = softmax_i(logit),
 *   out = sum_i alpha_i v_i                         (= sum_i alpha_i v_i with logit_i = <w, RMSNorm(v_i)>)
 *
 * and its backward, with dalpha_i = <dout, v_i> and dl_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j):
 *
 *   dv_i = alpha_i dout + dl_i r_i q - dl_i p_i r_i^3 v_i,        dq = sum over rows and i of dl_i r_i v_i
 *
 * Source i's row m is at src[i] + m * ld[i]. A row's result never depends on the other rows (every
 * sum runs in one fixed order); dq is summed per block of 64 rows, then over the blocks in order,
 * so it does not depend on the thread count either. At most 64 sources.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { MIX_MAX = 64, MIX_BLOCK = 64 };

/* One row: alpha[i], r[i], p[i] for the n sources, and out = sum_i alpha_i v_i. */
static inline void mix_row(int64_t n, const float *const *src, const int64_t *ld, int64_t m, int64_t H,
                           const float *q, float c, float *o, float *alpha, float *r, float *p) {
    float mx = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float *v = src[i] + m * ld[i];
        const float root = sqrtf(sumsq_f(v, H) + c);
        p[i] = dot_f(q, v, H);
        r[i] = 1.0f / root;
        alpha[i] = p[i] / root;
        mx = alpha[i] > mx ? alpha[i] : mx;
    }
    for (int64_t i = 0; i < n; i++) {
        alpha[i] = expf(alpha[i] - mx);
        total += alpha[i];
    }
    for (int64_t i = 0; i < n; i++) alpha[i] = alpha[i] / total;
    const float *v0 = src[0] + m * ld[0];
    for (int64_t j = 0; j < H; j++) o[j] = alpha[0] * v0[j];
    for (int64_t i = 1; i < n; i++) {
        const float a = alpha[i], *v = src[i] + m * ld[i];
        for (int64_t j = 0; j < H; j++) o[j] += a * v[j];
    }
}

/* The decode step's mix: B rows, out [B, H] contiguous. Returns 1 for n outside 1..64. */
int k3_attn_res_mix(int64_t n, const float *const *src, const int64_t *ld, int64_t B, int64_t H, const float *q,
                    float c, float *out) {
    if (n <= 0 || n > MIX_MAX) return 1;
    float alpha[MIX_MAX], r[MIX_MAX], p[MIX_MAX];
    for (int64_t b = 0; b < B; b++) mix_row(n, src, ld, b, H, q, c, out + b * H, alpha, r, p);
    return 0;
}

/* Training forward over M rows: out [M, H]; alpha, r, p [M, n] kept for the backward. */
int k3_attn_res_fwd(int64_t n, const float *const *src, const int64_t *ld, int64_t M, int64_t H, const float *q,
                    float c, float *out, float *alpha, float *r, float *p, int nthreads) {
    if (n <= 0 || n > MIX_MAX) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) mix_row(n, src, ld, m, H, q, c, out + m * H, alpha + m * n, r + m * n, p + m * n);
    return 0;
}

/* Training backward: dsrc[i] rows [M, H] contiguous, dq [H]. Returns 1 for n outside 1..64, -1 when
 * memory for the per-block dq sums is not there. */
int k3_attn_res_bwd(int64_t n, const float *const *src, const int64_t *ld, int64_t M, int64_t H, const float *q,
                    const float *alpha, const float *r, const float *p, const float *dout, float *const *dsrc,
                    float *dq, int nthreads) {
    if (n <= 0 || n > MIX_MAX) return 1;
    const int64_t nb = (M + MIX_BLOCK - 1) / MIX_BLOCK;
    float *part = alloc_parts(nb, H);
    if (!part) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < nb; blk++) {
        float *acc = part + blk * H;
        const int64_t m1 = (blk + 1) * MIX_BLOCK < M ? (blk + 1) * MIX_BLOCK : M;
        for (int64_t m = blk * MIX_BLOCK; m < m1; m++) {
            const float *a = alpha + m * n, *rm = r + m * n, *pm = p + m * n, *d = dout + m * H;
            float da[MIX_MAX], s = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                da[i] = dot_f(d, src[i] + m * ld[i], H);
                s += a[i] * da[i];
            }
            for (int64_t i = 0; i < n; i++) {
                const float dl = a[i] * (da[i] - s);
                const float cq = dl * rm[i], cv = -dl * pm[i] * rm[i] * rm[i] * rm[i], ai = a[i];
                const float *v = src[i] + m * ld[i];
                float *dv = dsrc[i] + m * H;
                for (int64_t j = 0; j < H; j++) {
                    dv[j] = ai * d[j] + cq * q[j] + cv * v[j];
                    acc[j] += cq * v[j];
                }
            }
        }
    }
    sum_parts(part, nb, H, H, dq);
    free(part);
    return 0;
}
