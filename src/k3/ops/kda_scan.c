/* KDA's gated delta rule token by token over a whole sequence, forward and backward (k3.ops.kda's
 * chunk_kda on the CPU). Per head, state S [K, V] fp32, for t = 0 .. T-1, with qs = scale q_t:
 *
 *   S' = diag(e^g_t) S;   w = v_t - S'^T k_t;   u = beta_t w;   S <- S' + k_t u^T;   o_t = S^T qs
 *
 * Layout (fla's): q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; S0, S_final [B, H, K, V]
 * (S0 may be NULL: zeros); all contiguous fp32. The (b, h) heads run in parallel, each on one
 * thread from start to end, so a head's result does not depend on the thread count. A head's
 * state stays in the cache, read twice and written twice per token.
 *
 * For training the forward also writes the state entering every chunk of C tokens,
 * ckpt [B, H, ceil(T / C), K, V]. The backward walks the chunks from the last: it recomputes a
 * chunk's S' and w from its checkpoint with the forward's own token step (so the same bits), then
 * runs the chain rule token by token in reverse with dS = dL/dS_t:
 *
 *   dS += qs do^T;  dqs = S_t do;  du = dS^T k;  dk = dS u;                    (o and the write)
 *   dbeta = du . w;  dv = beta du;  dks = -beta du;                           (u = beta (v - ks))
 *   dS' = dS + k dks^T;  dk += S' dks;  dg = rowsum(dS' * S');  dS <- diag(e^g) dS'
 *
 * with S_t = S' + k u^T rebuilt on the fly. Every gradient row is written by the one thread that
 * owns its head. The functions return -1 when memory for a head's buffers is not there.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_vec.h"

/* One token: S <- S' + k u^T from S; writes e = e^g, u, and when not NULL w = v - S'^T k, S' [K, V]
 * and o (without o, the write only: the backward's recomputation, with the forward's arithmetic). */
static inline void token_step(float *restrict S, int64_t K, int64_t V, const float *restrict gt,
                              const float *restrict kt, const float *restrict qt, float scale,
                              const float *restrict vt, float bt, float *restrict e, float *restrict u,
                              float *restrict w, float *restrict Sp, float *restrict ot) {
    memcpy(e, gt, sizeof(float) * (size_t)K);
    map_exp(e, K);
    for (int64_t j = 0; j < V; j++) u[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {              /* decay, and S'^T k */
        float *Si = S + i * V;
        const float ei = e[i], ki = kt[i];
        for (int64_t j = 0; j < V; j++) {
            const float s = Si[j] * ei;
            Si[j] = s;
            u[j] += ki * s;
        }
        if (Sp) memcpy(Sp + i * V, Si, sizeof(float) * (size_t)V);
    }
    for (int64_t j = 0; j < V; j++) {
        const float wj = vt[j] - u[j];
        if (w) w[j] = wj;
        u[j] = bt * wj;
    }
    if (!ot) {                                     /* recomputation: the write only */
        for (int64_t i = 0; i < K; i++) {
            float *Si = S + i * V;
            const float ki = kt[i];
            for (int64_t j = 0; j < V; j++) Si[j] = Si[j] + ki * u[j];
        }
        return;
    }
    for (int64_t j = 0; j < V; j++) ot[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {              /* the write, and S^T qs */
        float *Si = S + i * V;
        const float ki = kt[i], qi = scale * qt[i];
        for (int64_t j = 0; j < V; j++) {
            const float s = Si[j] + ki * u[j];
            Si[j] = s;
            ot[j] += qi * s;
        }
    }
}

int k3_kda_scan(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, const float *q, const float *k,
                const float *v, const float *g, const float *beta, float scale, const float *S0, float *o,
                float *S_final, float *ckpt, int64_t C, int nthreads) {
    int failed = 0;
    const int64_t N = C > 0 ? (T + C - 1) / C : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * H; item++) {
        const int64_t b = item / H, h = item % H;
        float *S = malloc(sizeof(float) * (size_t)(K * V + K + V));
        if (!S) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *e = S + K * V, *u = e + K;
        if (S0) memcpy(S, S0 + item * K * V, sizeof(float) * (size_t)(K * V));
        else memset(S, 0, sizeof(float) * (size_t)(K * V));
        for (int64_t t = 0; t < T; t++) {
            if (ckpt && t % C == 0)
                memcpy(ckpt + (item * N + t / C) * K * V, S, sizeof(float) * (size_t)(K * V));
            const int64_t row = (b * T + t) * H + h;
            token_step(S, K, V, g + row * K, k + row * K, q + row * K, scale, v + row * V, beta[row], e, u,
                       NULL, NULL, o + row * V);
        }
        if (S_final) memcpy(S_final + item * K * V, S, sizeof(float) * (size_t)(K * V));
        free(S);
    }
    return failed ? -1 : 0;
}

int k3_kda_scan_bwd(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, const float *q, const float *k,
                    const float *v, const float *g, const float *beta, float scale, const float *ckpt, int64_t C,
                    const float *dO, const float *dS_final, float *dq, float *dk, float *dv, float *dg,
                    float *dbeta, float *dS0, int nthreads) {
    int failed = 0;
    const int64_t N = (T + C - 1) / C;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * H; item++) {
        const int64_t b = item / H, h = item % H;
        /* per head: the chunk's S' and w, its decays e, the running state, dS, and vectors */
        const size_t n = (size_t)(C * K * V + C * V + C * K + 2 * K * V + 3 * V + 2 * K);
        float *Sp = malloc(sizeof(float) * n);
        if (!Sp) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *W = Sp + C * K * V, *E = W + C * V, *S = E + C * K, *dS = S + K * V;
        float *u = dS + K * V, *du = u + V, *dks = du + V, *dqs = dks + V, *dka = dqs + K;
        if (dS_final) memcpy(dS, dS_final + item * K * V, sizeof(float) * (size_t)(K * V));
        else memset(dS, 0, sizeof(float) * (size_t)(K * V));
        for (int64_t c = N - 1; c >= 0; c--) {
            const int64_t t0 = c * C, t1 = t0 + C < T ? t0 + C : T;
            memcpy(S, ckpt + (item * N + c) * K * V, sizeof(float) * (size_t)(K * V));
            for (int64_t t = t0; t < t1; t++) {       /* recompute each token's S', e and w */
                const int64_t row = (b * T + t) * H + h, r = t - t0;
                token_step(S, K, V, g + row * K, k + row * K, NULL, 0.0f, v + row * V, beta[row], E + r * K, u,
                           W + r * V, Sp + r * K * V, NULL);
            }
            for (int64_t t = t1 - 1; t >= t0; t--) {  /* the chain rule, newest token first */
                const int64_t row = (b * T + t) * H + h, r = t - t0;
                const float *Spr = Sp + r * K * V, *er = E + r * K, *wr = W + r * V;
                const float *kt = k + row * K, *qt = q + row * K, *dot = dO + row * V;
                const float bt = beta[row];
                for (int64_t j = 0; j < V; j++) { u[j] = bt * wr[j]; du[j] = 0.0f; }
                for (int64_t i = 0; i < K; i++) {
                    const float ki = kt[i], qi = scale * qt[i];
                    const float *Pi = Spr + i * V;
                    float *dSi = dS + i * V;
                    v16 aq16 = {0}, ak16 = {0};              /* fixed-order sums over j: lanes, then a tail */
                    int64_t j = 0;
                    for (; j + 16 <= V; j += 16) {
                        const v16 U = load16(u + j), Do = load16(dot + j);
                        const v16 d = load16(dSi + j) + qi * Do;
                        store16(dSi + j, d);
                        aq16 += (load16(Pi + j) + ki * U) * Do;
                        store16(du + j, load16(du + j) + d * ki);
                        ak16 += d * U;
                    }
                    float aq = hsum16(aq16), ak = hsum16(ak16);
                    for (; j < V; j++) {
                        const float d = dSi[j] + qi * dot[j];
                        dSi[j] = d;
                        aq += (Pi[j] + ki * u[j]) * dot[j];
                        du[j] += d * ki;
                        ak += d * u[j];
                    }
                    dqs[i] = aq;
                    dka[i] = ak;
                }
                for (int64_t j = 0; j < V; j++) {
                    dv[row * V + j] = bt * du[j];
                    dks[j] = -bt * du[j];
                }
                dbeta[row] = dot_f(du, wr, V);
                for (int64_t i = 0; i < K; i++) {
                    const float ki = kt[i], ei = er[i];
                    const float *Pi = Spr + i * V;
                    float *dSi = dS + i * V;
                    v16 ab16 = {0}, ag16 = {0};
                    int64_t j = 0;
                    for (; j + 16 <= V; j += 16) {
                        const v16 P = load16(Pi + j), Dk = load16(dks + j);
                        const v16 dsp = load16(dSi + j) + ki * Dk;
                        ab16 += P * Dk;
                        ag16 += dsp * P;
                        store16(dSi + j, ei * dsp);
                    }
                    float ab = hsum16(ab16), ag = hsum16(ag16);
                    for (; j < V; j++) {
                        const float dsp = dSi[j] + ki * dks[j];
                        ab += Pi[j] * dks[j];
                        ag += dsp * Pi[j];
                        dSi[j] = ei * dsp;
                    }
                    dg[row * K + i] = ag;
                    dk[row * K + i] = dka[i] + ab;
                    dq[row * K + i] = scale * dqs[i];
                }
            }
        }
        if (dS0) memcpy(dS0 + item * K * V, dS, sizeof(float) * (size_t)(K * V));
        free(Sp);
    }
    return failed ? -1 : 0;
}
