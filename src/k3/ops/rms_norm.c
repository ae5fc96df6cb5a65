/* RMSNorm (k3.ops.norm) forward and backward over M rows of D (x [M, D] contiguous, weight w [D]):
 *
 *   r_i = 1 / sqrt(sum_j x_ij^2 / D + eps),   y_ij = w_j x_ij r_i
 *
 * Backward, from dy, with h_ij = x_ij r_i and g_ij = dy_ij w_j:
 *   dx_ij = r_i (g_ij - h_ij c_i),   c_i = sum_j g_ij h_ij / D,      dw_j = sum_i dy_ij h_ij
 *
 * A row's sums run 16 lanes wide in a fixed order, so r, y and dx of a row depend on that row only.
 * dw sums over rows in blocks of NORM_BLOCK rows, each block on its own, the blocks then added in
 * order: no value depends on the thread count. A block's sums are whole vectors (D rounded up to 16),
 * loaded and stored without a tail branch: with one, GCC split the update at the branch in the 64-byte
 * form only, and the product g h was no longer fused into its add there (k3_vec.h). The backward
 * returns -1 without memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { NORM_BLOCK = 64 };

static float row_rinv(const float *x, int64_t D, float eps) {
    return 1.0f / sqrtf(sumsq_f(x, D) / (float)D + eps);
}

int k3_rms_norm(int64_t M, int64_t D, const float *x, const float *w, float eps, float *y, float *rinv,
                int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < M; i++) {
        const float *xi = x + i * D;
        const float r = row_rinv(xi, D, eps);
        rinv[i] = r;
        for (int64_t j = 0; j < D; j += 16)
            store16_part(y + i * D, j, D,
                         mul16(load16_pad(w, j, D, 0.0f), mul16(load16_pad(xi, j, D, 0.0f), splat16(r))));
    }
    return 0;
}

int k3_rms_norm_bwd(int64_t M, int64_t D, const float *x, const float *w, const float *rinv, const float *dy,
                    float *dx, float *dw, int nthreads) {
    const int64_t nblk = (M + NORM_BLOCK - 1) / NORM_BLOCK, Dv = (D + 15) / 16 * 16;
    float *part = alloc_parts(nblk, Dv);
    if (!part) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblk; b++) {
        float *acc = part + b * Dv;
        const int64_t i1 = (b + 1) * NORM_BLOCK < M ? (b + 1) * NORM_BLOCK : M;
        for (int64_t i = b * NORM_BLOCK; i < i1; i++) {
            const float *xi = x + i * D, *gi = dy + i * D;
            const float r = rinv[i];
            v16 c = splat16(0.0f);
            for (int64_t j = 0; j < D; j += 16) {
                const v16 h = mul16(load16_pad(xi, j, D, 0.0f), splat16(r)), g = load16_pad(gi, j, D, 0.0f);
                c = add16(c, mul16(mul16(g, load16_pad(w, j, D, 0.0f)), h));
                store16(acc + j, add16(load16(acc + j), mul16(g, h)));
            }
            const float ci = hsum16(c) / (float)D;
            for (int64_t j = 0; j < D; j += 16) {
                const v16 h = mul16(load16_pad(xi, j, D, 0.0f), splat16(r));
                const v16 g = mul16(load16_pad(gi, j, D, 0.0f), load16_pad(w, j, D, 0.0f));
                store16_part(dx + i * D, j, D, mul16(splat16(r), sub16(g, mul16(h, splat16(ci)))));
            }
        }
    }
    sum_parts(part, nblk, Dv, D, dw);
    free(part);
    return 0;
}
