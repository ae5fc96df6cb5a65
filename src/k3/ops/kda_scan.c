/* KDA's gated delta rule token by token over a whole sequence, for inference (k3.ops.kda's
 * chunk_kda without autograd on the CPU). Per head, state S [K, V] fp32, for t = 0 .. T-1:
 *
 *   S <- diag(exp g_t) S;   u = beta_t (v_t - S^T k_t);   S <- S + k_t u^T;   o_t = S^T (scale q_t)
 *
 * Layout (fla's): q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; S0, S_final [B, H, K, V]
 * (S0 may be NULL: zeros); all contiguous fp32. The (b, h) heads run in parallel; a head's state
 * stays in the cache, read twice and written twice per token. Returns -1 when memory for a state
 * is not there.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_vec.h"

int k3_kda_scan(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, const float *q, const float *k,
                const float *v, const float *g, const float *beta, float scale, const float *S0, float *o,
                float *S_final, int nthreads) {
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * H; item++) {
        const int64_t b = item / H, h = item % H;
        float *S = malloc(sizeof(float) * (size_t)(K * V + 3 * K + 2 * V));
        if (!S) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *e = S + K * V, *kt = e + K, *qt = kt + K, *ks = qt + K, *ot = ks + V;
        if (S0) memcpy(S, S0 + item * K * V, sizeof(float) * (size_t)(K * V));
        else memset(S, 0, sizeof(float) * (size_t)(K * V));
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = (b * T + t) * H + h;
            memcpy(e, g + row * K, sizeof(float) * (size_t)K);
            map_exp(e, K);
            memcpy(kt, k + row * K, sizeof(float) * (size_t)K);
            for (int64_t i = 0; i < K; i++) qt[i] = scale * q[row * K + i];
            const float *vt = v + row * V;
            const float bt = beta[row];
            for (int64_t j = 0; j < V; j++) ks[j] = 0.0f;
            for (int64_t i = 0; i < K; i++) {          /* decay, and S'^T k */
                float *Si = S + i * V;
                const float ei = e[i], ki = kt[i];
                for (int64_t j = 0; j < V; j++) {
                    const float s = Si[j] * ei;
                    Si[j] = s;
                    ks[j] += ki * s;
                }
            }
            for (int64_t j = 0; j < V; j++) { ks[j] = bt * (vt[j] - ks[j]); ot[j] = 0.0f; }   /* ks: u now */
            for (int64_t i = 0; i < K; i++) {          /* the write, and S^T q */
                float *Si = S + i * V;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < V; j++) {
                    const float s = Si[j] + ki * ks[j];
                    Si[j] = s;
                    ot[j] += qi * s;
                }
            }
            memcpy(o + row * V, ot, sizeof(float) * (size_t)V);
        }
        if (S_final) memcpy(S_final + item * K * V, S, sizeof(float) * (size_t)(K * V));
        free(S);
    }
    return failed ? -1 : 0;
}
