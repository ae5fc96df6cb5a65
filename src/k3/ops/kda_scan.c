/* KDA's gated delta rule token by token over a whole sequence, forward and backward (k3.ops.kda's
 * chunk_kda on the CPU). Per head, state S [K, V] fp32, for t = 0 .. T-1, with qs = scale q_t:
 *
 *   S' = diag(e^g_t) S;   w = v_t - S'^T k_t;   u = beta_t w;   S <- S' + k_t u^T;   o_t = S^T qs
 *
 * Layout (fla's): q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; S0, S_final [B, H, K, V]
 * (S0 may be NULL: zeros); all contiguous fp32. The (b, h) heads run in parallel, each on one
 * thread from start to end, so a head's result does not depend on the thread count. A head's
 * state stays in the cache. For V a multiple of 16 up to 128 (every preset) the vector forms keep a
 * head's V-vectors in registers and fuse each token's write with the next token's decay, so the state
 * is read and written once per token (forward and recomputation 2x faster than the two passes of
 * token_step; the same arithmetic in the same order, so the same bits); other V use token_step.
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
 * with S_t = S' + k u^T rebuilt on the fly. Its vector form reduces the row sums of 16 rows at once
 * (hsum16x16, the bits of 16 hsum16). Every gradient row is written by the one thread that owns its
 * head. The functions return -1 when memory for a head's buffers is not there.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

/* e = e^g over a row of K. */
static inline void exp_row(float *e, const float *gt, int64_t K) {
    memcpy(e, gt, sizeof(float) * (size_t)K);
    map_exp(e, K);
}

/* One token: S <- S' + k u^T from S; writes e = e^g, u, and when not NULL w = v - S'^T k, S' [K, V]
 * and o (without o, the write only: the backward's recomputation, with the forward's arithmetic). */
static inline void token_step(float *restrict S, int64_t K, int64_t V, const float *restrict gt,
                              const float *restrict kt, const float *restrict qt, float scale,
                              const float *restrict vt, float bt, float *restrict e, float *restrict u,
                              float *restrict w, float *restrict Sp, float *restrict ot) {
    exp_row(e, gt, K);
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

enum { NV_MAX = 8 };   /* the vector forms: V = 16 NV <= 128 */

/* With 32 vector registers of 16 floats (AVX-512) a head's NV column blocks of the running sums stay
 * in registers while a state row is read once. With 16 registers of 8 floats (AVX2) the same loop
 * spills them on every row (the forward ran at a tenth of the FMA rate on an AMD EPYC), so there
 * (K3_WIDE_REGISTERS 0) the loops go over one column block at a time: each sum still adds the same
 * terms in the same order. */

/* NV when V = 16 NV with NV <= NV_MAX (the vector forms), else 0 (the scalar token_step / chain_step). */
static inline int vector_count(int64_t V) { return V % 16 || V / 16 > NV_MAX ? 0 : (int)(V / 16); }

/* Vector forms for V = 16 NV: the arithmetic of token_step in the same order (so the same bits),
 * with a head's V-vectors (the running sums, u) in registers, and one token's write fused with the
 * next token's decay: row i of S_t = S'_t + k u^T is decayed into row i of S'_{t+1} while it is in
 * registers, so a token reads and writes the state once rather than twice. */

/* dst = diag(e) src (dst may be src), and a = dst^T k. */
static inline __attribute__((always_inline)) void decay_v(const int NV, const float *src, float *dst, int64_t K,
                                                          const float *e, const float *kt, v16 *a) {
    const int64_t V = 16 * NV;
#if K3_WIDE_REGISTERS
    for (int n = 0; n < NV; n++) a[n] = (v16){0};
    for (int64_t i = 0; i < K; i++) {
        const float ei = e[i], ki = kt[i];
        for (int n = 0; n < NV; n++) {
            const v16 s = mul16(load16(src + i * V + 16 * n), splat16(ei));
            store16(dst + i * V + 16 * n, s);
            a[n] = add16(a[n], mul16(splat16(ki), s));
        }
    }
#else
    for (int n = 0; n < NV; n++) {   /* one column block at a time: the same sums in the same order */
        v16 an = {0};
        for (int64_t i = 0; i < K; i++) {
            const v16 s = mul16(load16(src + i * V + 16 * n), splat16(e[i]));
            store16(dst + i * V + 16 * n, s);
            an = add16(an, mul16(splat16(kt[i]), s));
        }
        a[n] = an;
    }
#endif
}

/* S_t = src + k U^T (U = u), with o = S_t^T qs when OUT; written to dst, or with FUSE decayed by the
 * next token's e2 first (dst = S'_{t+1}) and a2 = dst^T k2. dst may be src. */
static inline __attribute__((always_inline)) void write_v(const int NV, const int OUT, const int FUSE,
                                                          const float *src, float *dst, int64_t K, const float *kt,
                                                          const v16 *U, const float *qt, float scale, float *ot,
                                                          const float *e2, const float *k2, v16 *a2) {
    const int64_t V = 16 * NV;
#if K3_WIDE_REGISTERS
    v16 acc[NV_MAX];
    for (int n = 0; n < NV; n++) {
        acc[n] = (v16){0};
        if (FUSE) a2[n] = (v16){0};
    }
    for (int64_t i = 0; i < K; i++) {
        const float ki = kt[i], qi = OUT ? scale * qt[i] : 0.0f;
        const float ei = FUSE ? e2[i] : 0.0f, k2i = FUSE ? k2[i] : 0.0f;
        for (int n = 0; n < NV; n++) {
            const v16 s = add16(load16(src + i * V + 16 * n), mul16(splat16(ki), U[n]));
            if (OUT) acc[n] = add16(acc[n], mul16(splat16(qi), s));
            if (FUSE) {
                const v16 s2 = mul16(s, splat16(ei));
                store16(dst + i * V + 16 * n, s2);
                a2[n] = add16(a2[n], mul16(splat16(k2i), s2));
            } else {
                store16(dst + i * V + 16 * n, s);
            }
        }
    }
    if (OUT)
        for (int n = 0; n < NV; n++) store16(ot + 16 * n, acc[n]);
#else
    for (int n = 0; n < NV; n++) {   /* one column block at a time: the same sums in the same order */
        const v16 Un = U[n];
        v16 accn = {0}, a2n = {0};
        for (int64_t i = 0; i < K; i++) {
            const v16 s = add16(load16(src + i * V + 16 * n), mul16(splat16(kt[i]), Un));
            if (OUT) accn = add16(accn, mul16(splat16(scale * qt[i]), s));
            if (FUSE) {
                const v16 s2 = mul16(s, splat16(e2[i]));
                store16(dst + i * V + 16 * n, s2);
                a2n = add16(a2n, mul16(splat16(k2[i]), s2));
            } else {
                store16(dst + i * V + 16 * n, s);
            }
        }
        if (OUT) store16(ot + 16 * n, accn);
        if (FUSE) a2[n] = a2n;
    }
#endif
}

/* U = bt (v - a), and w = v - a when w is not NULL. */
static inline __attribute__((always_inline)) void update_v(const int NV, const float *vt, float bt, const v16 *a,
                                                           float *w, v16 *U) {
    for (int n = 0; n < NV; n++) {
        const v16 wn = sub16(load16(vt + 16 * n), a[n]);
        if (w) store16(w + 16 * n, wn);
        U[n] = mul16(splat16(bt), wn);
    }
}

/* The forward of one head (k3_kda_scan's loop body) for V = 16 NV: S [K, V] in (the initial state)
 * and out (the final one); e [K] scratch; ckpt: the head's checkpoints or NULL. */
static inline __attribute__((always_inline)) void scan_head_v(const int NV, float *S, int64_t T, int64_t H,
                                                              int64_t K, int64_t b, int64_t h, const float *q,
                                                              const float *k, const float *v, const float *g,
                                                              const float *beta, float scale, float *o,
                                                              float *ckpt, int64_t C, float *e) {
    const int64_t V = 16 * NV;
    v16 a[NV_MAX], U[NV_MAX];
    int decayed = 0;                               /* S holds S'_t (and a its sums), not S_{t-1} */
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = (b * T + t) * H + h;
        if (!decayed) {
            if (ckpt && t % C == 0) memcpy(ckpt + t / C * K * V, S, sizeof(float) * (size_t)(K * V));
            exp_row(e, g + row * K, K);
            decay_v(NV, S, S, K, e, k + row * K, a);
        }
        update_v(NV, v + row * V, beta[row], a, NULL, U);
        decayed = t + 1 < T && !(ckpt && (t + 1) % C == 0);   /* a checkpoint needs S_t itself */
        if (decayed) {
            exp_row(e, g + (row + H) * K, K);
            write_v(NV, 1, 1, S, S, K, k + row * K, U, q + row * K, scale, o + row * V, e, k + (row + H) * K, a);
        } else {
            write_v(NV, 1, 0, S, S, K, k + row * K, U, q + row * K, scale, o + row * V, NULL, NULL, NULL);
        }
    }
}

/* The backward's recomputation of tokens t0 .. t1-1 of one head for V = 16 NV, from the state S0
 * entering t0: each token's S' (Sp [t1-t0, K, V]), e^g (E) and w (W). */
static inline __attribute__((always_inline)) void recompute_v(const int NV, const float *S0, int64_t t0, int64_t t1,
                                                              int64_t T, int64_t H, int64_t K, int64_t b, int64_t h,
                                                              const float *k, const float *v, const float *g,
                                                              const float *beta, float *Sp, float *E, float *W) {
    const int64_t V = 16 * NV;
    v16 a[NV_MAX], U[NV_MAX];
    const int64_t row0 = (b * T + t0) * H + h;
    exp_row(E, g + row0 * K, K);
    decay_v(NV, S0, Sp, K, E, k + row0 * K, a);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t row = (b * T + t) * H + h, r = t - t0;
        update_v(NV, v + row * V, beta[row], a, W + r * V, U);
        if (t + 1 < t1) {
            exp_row(E + (r + 1) * K, g + (row + H) * K, K);
            write_v(NV, 0, 1, Sp + r * K * V, Sp + (r + 1) * K * V, K, k + row * K, U, NULL, 0.0f, NULL,
                    E + (r + 1) * K, k + (row + H) * K, a);
        }
    }
}

/* chain_step (below) for V = 16 NV: the same arithmetic in the same order (the same bits), with u, do,
 * du and dks in registers, and the row sums of 16 rows reduced together (hsum16x16). */
static inline __attribute__((always_inline)) void chain_step_v(
    const int NV, int64_t K, const float *restrict Spr, const float *restrict er, const float *restrict wr,
    const float *restrict kt, const float *restrict qt, const float *restrict dot, float bt, float scale,
    float *restrict dS, float *restrict dqs, float *restrict dka, float *restrict dq, float *restrict dk,
    float *restrict dv, float *restrict dg, float *restrict dbeta) {
    const int64_t V = 16 * NV;
    v16 U[NV_MAX], Do[NV_MAX], du[NV_MAX], Dk[NV_MAX], sa[16], sb[16];
    for (int n = 0; n < NV; n++) {
        U[n] = mul16(splat16(bt), load16(wr + 16 * n));
        Do[n] = load16(dot + 16 * n);
        du[n] = (v16){0};
    }
    for (int64_t i0 = 0; i0 < K; i0 += 16) {
        const int rows = K - i0 < 16 ? (int)(K - i0) : 16;
        for (int r = 0; r < rows; r++) {
            const int64_t i = i0 + r;
            const float ki = kt[i], qi = scale * qt[i];
            const float *Pi = Spr + i * V;
            float *dSi = dS + i * V;
            v16 aq = {0}, ak = {0};
            for (int n = 0; n < NV; n++) {
                const v16 d = add16(load16(dSi + 16 * n), mul16(splat16(qi), Do[n]));
                store16(dSi + 16 * n, d);
                aq = add16(aq, mul16(add16(load16(Pi + 16 * n), mul16(splat16(ki), U[n])), Do[n]));
                du[n] = add16(du[n], mul16(d, splat16(ki)));
                ak = add16(ak, mul16(d, U[n]));
            }
            sa[r] = aq;
            sb[r] = ak;
        }
        if (rows == 16) {
            store16(dqs + i0, hsum16x16(sa));
            store16(dka + i0, hsum16x16(sb));
        } else {
            for (int r = 0; r < rows; r++) { dqs[i0 + r] = hsum16(sa[r]); dka[i0 + r] = hsum16(sb[r]); }
        }
    }
    v16 acc = {0};
    for (int n = 0; n < NV; n++) {
        store16(dv + 16 * n, mul16(splat16(bt), du[n]));
        Dk[n] = mul16(splat16(-bt), du[n]);
        acc = add16(acc, mul16(du[n], load16(wr + 16 * n)));
    }
    *dbeta = hsum16(acc);
    for (int64_t i0 = 0; i0 < K; i0 += 16) {
        const int rows = K - i0 < 16 ? (int)(K - i0) : 16;
        for (int r = 0; r < rows; r++) {
            const int64_t i = i0 + r;
            const float ki = kt[i], ei = er[i];
            const float *Pi = Spr + i * V;
            float *dSi = dS + i * V;
            v16 ab = {0}, ag = {0};
            for (int n = 0; n < NV; n++) {
                const v16 P = load16(Pi + 16 * n);
                const v16 dsp = add16(load16(dSi + 16 * n), mul16(splat16(ki), Dk[n]));
                ab = add16(ab, mul16(P, Dk[n]));
                ag = add16(ag, mul16(dsp, P));
                store16(dSi + 16 * n, mul16(splat16(ei), dsp));
            }
            sa[r] = ab;
            sb[r] = ag;
        }
        float hb[16], hg[16];
        if (rows == 16) {
            store16(hb, hsum16x16(sa));
            store16(hg, hsum16x16(sb));
        } else {
            for (int r = 0; r < rows; r++) { hb[r] = hsum16(sa[r]); hg[r] = hsum16(sb[r]); }
        }
        for (int r = 0; r < rows; r++) {
            const int64_t i = i0 + r;
            dg[i] = hg[r];
            dk[i] = dka[i] + hb[r];
            dq[i] = scale * dqs[i];
        }
    }
}

/* One token of the chain rule (the header's formulas), any K and V (through chain_step_v when V is a
 * multiple of 16 up to 16 NV_MAX). Spr, er, wr: the token's S', e^g and w; kt, qt, dot: its k, q and
 * do; dS [K, V] in and out; u, du, dks [V], dqs, dka [K]: scratch; dq, dk, dg [K], dv [V], dbeta: the
 * token's gradient rows. */
static void chain_step(int64_t K, int64_t V, const float *restrict Spr, const float *restrict er,
                       const float *restrict wr, const float *restrict kt, const float *restrict qt,
                       const float *restrict dot, float bt, float scale, float *restrict dS, float *restrict u,
                       float *restrict du, float *restrict dks, float *restrict dqs, float *restrict dka,
                       float *restrict dq, float *restrict dk, float *restrict dv, float *restrict dg,
                       float *restrict dbeta) {
    switch (vector_count(V)) {
#define K3_NV(n)                                                                                    \
    case n: chain_step_v(n, K, Spr, er, wr, kt, qt, dot, bt, scale, dS, dqs, dka, dq, dk, dv, dg, dbeta); return;
    K3_NV(1) K3_NV(2) K3_NV(3) K3_NV(4) K3_NV(5) K3_NV(6) K3_NV(7) K3_NV(8)
#undef K3_NV
    default: break;
    }
    for (int64_t j = 0; j < V; j++) { u[j] = bt * wr[j]; du[j] = 0.0f; }
    for (int64_t i = 0; i < K; i++) {
        const float ki = kt[i], qi = scale * qt[i];
        const float *Pi = Spr + i * V;
        float *dSi = dS + i * V;
        v16 aq16 = {0}, ak16 = {0};              /* fixed-order sums over j: lanes, then a tail */
        int64_t j = 0;
        for (; j + 16 <= V; j += 16) {
            const v16 U = load16(u + j), Do = load16(dot + j);
            const v16 d = add16(load16(dSi + j), mul16(splat16(qi), Do));
            store16(dSi + j, d);
            aq16 = add16(aq16, mul16(add16(load16(Pi + j), mul16(splat16(ki), U)), Do));
            store16(du + j, add16(load16(du + j), mul16(d, splat16(ki))));
            ak16 = add16(ak16, mul16(d, U));
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
        dv[j] = bt * du[j];
        dks[j] = -bt * du[j];
    }
    *dbeta = dot_f(du, wr, V);
    for (int64_t i = 0; i < K; i++) {
        const float ki = kt[i], ei = er[i];
        const float *Pi = Spr + i * V;
        float *dSi = dS + i * V;
        v16 ab16 = {0}, ag16 = {0};
        int64_t j = 0;
        for (; j + 16 <= V; j += 16) {
            const v16 P = load16(Pi + j), Dk = load16(dks + j);
            const v16 dsp = add16(load16(dSi + j), mul16(splat16(ki), Dk));
            ab16 = add16(ab16, mul16(P, Dk));
            ag16 = add16(ag16, mul16(dsp, P));
            store16(dSi + j, mul16(splat16(ei), dsp));
        }
        float ab = hsum16(ab16), ag = hsum16(ag16);
        for (; j < V; j++) {
            const float dsp = dSi[j] + ki * dks[j];
            ab += Pi[j] * dks[j];
            ag += dsp * Pi[j];
            dSi[j] = ei * dsp;
        }
        dg[i] = ag;
        dk[i] = dka[i] + ab;
        dq[i] = scale * dqs[i];
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
        float *ck = ckpt ? ckpt + item * N * K * V : NULL;
        switch (vector_count(V)) {
#define K3_NV(n) case n: scan_head_v(n, S, T, H, K, b, h, q, k, v, g, beta, scale, o, ck, C, e); break;
        K3_NV(1) K3_NV(2) K3_NV(3) K3_NV(4) K3_NV(5) K3_NV(6) K3_NV(7) K3_NV(8)
#undef K3_NV
        default:
            for (int64_t t = 0; t < T; t++) {
                if (ck && t % C == 0) memcpy(ck + t / C * K * V, S, sizeof(float) * (size_t)(K * V));
                const int64_t row = (b * T + t) * H + h;
                token_step(S, K, V, g + row * K, k + row * K, q + row * K, scale, v + row * V, beta[row], e, u,
                           NULL, NULL, o + row * V);
            }
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
            const float *S0 = ckpt + (item * N + c) * K * V;
            switch (vector_count(V)) {                /* recompute each token's S', e and w */
#define K3_NV(n) case n: recompute_v(n, S0, t0, t1, T, H, K, b, h, k, v, g, beta, Sp, E, W); break;
            K3_NV(1) K3_NV(2) K3_NV(3) K3_NV(4) K3_NV(5) K3_NV(6) K3_NV(7) K3_NV(8)
#undef K3_NV
            default:
                memcpy(S, S0, sizeof(float) * (size_t)(K * V));
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t row = (b * T + t) * H + h, r = t - t0;
                    token_step(S, K, V, g + row * K, k + row * K, NULL, 0.0f, v + row * V, beta[row], E + r * K, u,
                               W + r * V, Sp + r * K * V, NULL);
                }
            }
            for (int64_t t = t1 - 1; t >= t0; t--) {  /* the chain rule, newest token first */
                const int64_t row = (b * T + t) * H + h, r = t - t0;
                const float *Spr = Sp + r * K * V, *er = E + r * K, *wr = W + r * V;
                const float *kt = k + row * K, *qt = q + row * K, *dot = dO + row * V;
                chain_step(K, V, Spr, er, wr, kt, qt, dot, beta[row], scale, dS, u, du, dks, dqs, dka,
                           dq + row * K, dk + row * K, dv + row * V, dg + row * K, dbeta + row);
            }
        }
        if (dS0) memcpy(dS0 + item * K * V, dS, sizeof(float) * (size_t)(K * V));
        free(Sp);
    }
    return failed ? -1 : 0;
}
