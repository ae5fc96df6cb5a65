/* The per-row math of a CPU decode step (k3.ops.decode_rows), each sublayer part one call instead of
 * a few dozen tensor ops. The formulas are those of k3.infer.prepared; the model's own modules
 * are the reference the tests hold these to.
 *
 * A row's result never depends on the other rows: every sum runs in one fixed order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { KDA_MAX_D = 256, KDA_ND_MAX = 8 };

/* The state update of one (row, head) for d = 16 ND (ND <= KDA_ND_MAX): the formulas of the scalar loop in
 * kda_state, element for element in the same order, with k^T S', u and o held in registers. */
static inline __attribute__((always_inline)) void kda_state_v(const int ND, int64_t d, const float *Si, float *So,
                                                              const float *e, const float *k, const float *q,
                                                              const float *v, float beta, float *o_out,
                                                              const float *Snext) {
    v16 ks[KDA_ND_MAX], u[KDA_ND_MAX], o[KDA_ND_MAX];
    for (int n = 0; n < ND; n++) ks[n] = splat16(0.0f);
    for (int64_t i = 0; i < d; i++) {
        const float ei = e[i], ki = k[i];
        if (Snext)   /* the next (row, head)'s state, while this one is read from memory */
            for (int n = 0; n < ND; n++) __builtin_prefetch(Snext + i * d + 16 * n);
        for (int n = 0; n < ND; n++)
            ks[n] = add16(ks[n], mul16(splat16(ki), mul16(load16(Si + i * d + 16 * n), splat16(ei))));
    }
    for (int n = 0; n < ND; n++) {
        u[n] = mul16(splat16(beta), sub16(load16(v + 16 * n), ks[n]));
        o[n] = splat16(0.0f);
    }
    /* the second pass in column groups of G vectors: u and o of a group stay in registers (AVX2 has
     * room for 2 of each: ND = 4 at once spilled both on every row); each column's sums are the same */
    enum { G = K3_WIDE_REGISTERS ? KDA_ND_MAX : 2 };
    for (int n0 = 0; n0 < ND; n0 += G) {
        const int n1 = n0 + G < ND ? n0 + G : ND;
        for (int64_t i = 0; i < d; i++) {
            const float ei = e[i], ki = k[i], qi = q[i];
            for (int n = n0; n < n1; n++) {
                const v16 s = add16(mul16(load16(Si + i * d + 16 * n), splat16(ei)), mul16(splat16(ki), u[n]));
                store16(So + i * d + 16 * n, s);
                o[n] = add16(o[n], mul16(splat16(qi), s));
            }
        }
    }
    for (int n = 0; n < ND; n++) store16(o_out + 16 * n, o[n]);
}

/* S_out = diag(e) S + k u^T with u = beta (v - k^T diag(e) S), and o = q^T S_out, for one (row, head). */
static void kda_state(int64_t d, const float *Si, float *So, const float *e, const float *k, const float *q,
                      const float *v, float beta, float *o, const float *Snext) {
    switch (d % 16 ? 0 : d / 16) {
#define K3_ND(n) case n: kda_state_v(n, d, Si, So, e, k, q, v, beta, o, Snext); return;
    K3_ND(1) K3_ND(2) K3_ND(3) K3_ND(4) K3_ND(5) K3_ND(6) K3_ND(7) K3_ND(8)
#undef K3_ND
    default: break;
    }
    float ks[KDA_MAX_D], u[KDA_MAX_D];
    for (int64_t j = 0; j < d; j++) ks[j] = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        const float ei = e[i], ki = k[i];
        for (int64_t j = 0; j < d; j++) ks[j] += ki * (Si[i * d + j] * ei);
    }
    for (int64_t j = 0; j < d; j++) { u[j] = beta * (v[j] - ks[j]); o[j] = 0.0f; }
    for (int64_t i = 0; i < d; i++) {
        const float ei = e[i], ki = k[i], qi = q[i];
        for (int64_t j = 0; j < d; j++) {
            const float s = Si[i * d + j] * ei + ki * u[j];
            So[i * d + j] = s;
            o[j] += qi * s;
        }
    }
}

/* The short convolution of n channels at one step (T = Kc - 1 cached inputs each, cs [n, T]; weights
 * w [n, Kc]; this step's inputs x [n]): h[j] = sum_t w[j, t] cs[j, t] + w[j, T] x[j], summed in t
 * order, and co [n, T] the last T inputs. T a constant where it can be, so the loops unroll. */
static inline __attribute__((always_inline)) void conv_taps(const int64_t T, int64_t n, const float *cs,
                                                            const float *w, const float *x, float *h, float *co) {
    for (int64_t j = 0; j < n; j++, cs += T, w += T + 1, co += T) {
        float acc = 0.0f;
        for (int64_t t = 0; t < T; t++) acc += w[t] * cs[t];
        h[j] = acc + w[T] * x[j];
        for (int64_t t = 0; t + 1 < T; t++) co[t] = cs[t + 1];
        co[T - 1] = x[j];
    }
}

/* One KDA recurrent step after the input projections, for B rows of nh heads of size d (P = nh d):
 *
 *   h = SiLU(sum_t conv_w[c, t] [conv[b, c, :] | qkv[b, c]]_t)    c < 3P  (conv_out: the last Kc-1 inputs)
 *   q = h_q / sqrt(|h_q|^2 + c_qk) * q_scale,  k = h_k / sqrt(|h_k|^2 + c_qk),  v = h_v   (per head)
 *   e = exp(lb * sigmoid(g))             (mode 0)   or   exp(neg_a * softplus(g))   (mode 1), g = dec_in
 *   S' = diag(e) S;  u = sigmoid(beta_in) (v - k^T S');  S_out = S' + k u^T;  o = q^T S_out
 *   o_out = o / sqrt(|o|^2 + c_o) * sigmoid(gate)
 *
 * qkv [B, 3P], dec_in [B, P], beta_in [B, nh], gate [B, P]: rows of strides ld_*, unit column stride;
 * conv, conv_out [B, 3P, Kc-1], S, S_out [B, nh, d, d], o_out [B, P], conv_w [3P, Kc]: contiguous.
 * Returns 1 when d > KDA_MAX_D or Kc < 2. */
int k3_kda_step(int64_t B, int64_t nh, int64_t d, int64_t Kc, const float *qkv, int64_t ld_qkv, const float *conv,
                float *conv_out, const float *conv_w, const float *dec_in, int64_t ld_dec, int mode, float lb,
                const float *neg_a, const float *beta_in, int64_t ld_beta, const float *gate, int64_t ld_gate,
                const float *S, float *S_out, float c_qk, float q_scale, float c_o, float *o_out, int nthreads) {
    if (d > KDA_MAX_D || Kc < 2) return 1;
    const int64_t P = nh * d, T = Kc - 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * nh; item++) {
        const int64_t b = item / nh, h = item % nh;
        float hq[3 * KDA_MAX_D], e[KDA_MAX_D], o[KDA_MAX_D], g[KDA_MAX_D];
        for (int64_t part = 0; part < 3; part++) {
            const int64_t ch = part * P + h * d;
            const float *cs = conv + (b * 3 * P + ch) * T, *w = conv_w + ch * Kc, *x = qkv + b * ld_qkv + ch;
            float *co = conv_out + (b * 3 * P + ch) * T;
            if (T == 3) conv_taps(3, d, cs, w, x, hq + part * d, co);   /* the usual kernel of 4: unrolled */
            else conv_taps(T, d, cs, w, x, hq + part * d, co);
        }
        map_silu(hq, 3 * d);
        float *q = hq, *k = hq + d, *v = hq + 2 * d;
        const float sq = q_scale / sqrtf(sumsq_f(q, d) + c_qk), sk = 1.0f / sqrtf(sumsq_f(k, d) + c_qk);
        for (int64_t j = 0; j < d; j++) { q[j] *= sq; k[j] *= sk; }
        const float *gi = dec_in + b * ld_dec + h * d;
        if (mode == 0) {
            for (int64_t i = 0; i < d; i++) e[i] = gi[i];
            map_sigmoid(e, d);
            for (int64_t i = 0; i < d; i++) e[i] *= lb;
        } else {
            for (int64_t i = 0; i < d; i++) {
                const float x = gi[i];
                e[i] = neg_a[h * d + i] * (x > 20.0f ? x : log1pf(expf(x)));
            }
        }
        map_exp(e, d);
        const float beta = 1.0f / (1.0f + expf(-beta_in[b * ld_beta + h]));
        const float *Si = S + item * d * d;
        float *So = S_out + item * d * d;
        /* S' = diag(e) S is recomputed in the second pass rather than stored, so S_out is written
         * once (the first pass reads S from memory, the second from the cache) */
        kda_state(d, Si, So, e, k, q, v, beta, o, item + 1 < B * nh ? Si + d * d : NULL);
        const float so = 1.0f / sqrtf(sumsq_f(o, d) + c_o);
        const float *gg = gate + b * ld_gate + h * d;
        for (int64_t j = 0; j < d; j++) g[j] = gg[j];
        map_sigmoid(g, d);
        float *out = o_out + b * P + h * d;
        for (int64_t j = 0; j < d; j++) out[j] = o[j] * so * g[j];
    }
    return 0;
}

/* x[i] = f(x[i]) for i < n: kind 0 exp, 1 sigmoid, 2 tanh, 3 silu (the helpers every kernel here uses).
 * Returns 1 for an unknown kind. */
int k3_map(int kind, float *x, int64_t n) {
    switch (kind) {
    case 0: map_exp(x, n); return 0;
    case 1: map_sigmoid(x, n); return 0;
    case 2: map_tanh(x, n); return 0;
    case 3: map_silu(x, n); return 0;
    default: return 1;
    }
}

/* The gated activation of an expert or MLP row, times an optional per-row weight:
 *   silu:  out = SiLU(g) * u;   else (SiTU):  out = tanh(g * inv_beta) * sigmoid(g) * (tanh(u) if tanh_up else u)
 * g, u: rows of strides ldg, ldu (unit column stride); row_w: NULL or [rows]; out [rows, F] contiguous.
 * Rows are split between threads when there are enough elements to pay for it (each element's value
 * is the same either way). */
int k3_gated_act(int64_t rows, int64_t F, const float *g, int64_t ldg, const float *u, int64_t ldu, int silu,
                 float inv_beta, int tanh_up, const float *row_w, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1 && rows * F >= 4096)
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = g + r * ldg, *ur = u + r * ldu;
        float *o = out + r * F;
        const float w = row_w ? row_w[r] : 1.0f;
        for (int64_t j = 0; j < F; j += 16) {
            const int64_t n = F - j < 16 ? F - j : 16;
            float tg[16] = {0}, tu[16] = {0};
            memcpy(tg, gr + j, (size_t)n * sizeof(float));
            memcpy(tu, ur + j, (size_t)n * sizeof(float));
            const v16 gv = load16(tg), uv = load16(tu);
            v16 y;
            if (silu) y = mul16(vsilu(gv), uv);
            else y = mul16(mul16(vtanh(mul16(gv, splat16(inv_beta))), vsigmoid(gv)), (tanh_up ? vtanh(uv) : uv));
            store16(tg, mul16(y, splat16(w)));
            memcpy(o + j, tg, (size_t)n * sizeof(float));
        }
    }
    return 0;
}

/* Router of N tokens over E experts: s = sigmoid(logits) (or softmax over E), the k experts of
 * largest s + bias (descending; ties to the lower index; NaN above every number), their weights s
 * (divided by their sum + tiny when renorm). logits: rows of stride ld; idx [N, k] int64, w [N, k].
 * Returns 1 when k is not in [1, E] or E > 4096. */
int k3_route(int64_t N, int64_t E, const float *logits, int64_t ld, const float *bias, int64_t k, int softmax,
             int renorm, float tiny, int64_t *idx, float *w) {
    enum { EMAX = 4096 };
    if (k < 1 || k > E || E > EMAX) return 1;
    for (int64_t t = 0; t < N; t++) {
        float s[EMAX], key[EMAX];
        const float *z = logits + t * ld;
        if (softmax) {
            float mx = -INFINITY, total = 0.0f;
            for (int64_t e = 0; e < E; e++) mx = z[e] > mx ? z[e] : mx;
            for (int64_t e = 0; e < E; e++) { s[e] = expf(z[e] - mx); total += s[e]; }
            for (int64_t e = 0; e < E; e++) s[e] /= total;
        } else {
            for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-z[e]));
        }
        unsigned char taken[EMAX];
        for (int64_t e = 0; e < E; e++) { key[e] = s[e] + bias[e]; taken[e] = 0; }
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {   /* NaN ranks above every number, as in torch.topk */
                if (taken[e]) continue;
                if (best < 0 || key[e] > key[best] || (isnan(key[e]) && !isnan(key[best]))) best = e;
            }
            taken[best] = 1;
            idx[t * k + j] = best;
            w[t * k + j] = s[best];
            sum += s[best];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++) w[t * k + j] /= sum + tiny;
    }
    return 0;
}

/* Each row of x [rows, n] sorted descending, stably (equal values keep their index order), as
 * torch.sort(descending=True, stable=True) orders them: NaN above +inf, -0.0 equal to +0.0.
 * vals [rows, n], idx [rows, n] int64. LSD radix sort on the values' bits, 4 passes of 8 bits, so a
 * row costs O(n) instead of O(n log n). Returns -1 when memory for a row's work is not there. */
int k3_sort_desc(const float *x, int64_t rows, int64_t n, float *vals, int64_t *idx, int nthreads) {
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *key = malloc(sizeof(uint32_t) * (size_t)(2 * n));
        int64_t *ord = malloc(sizeof(int64_t) * (size_t)(2 * n));
        if (!key || !ord) {
            free(key); free(ord);
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *xr = x + r * n;
        uint32_t *ka = key, *kb = key + n;
        int64_t *oa = ord, *ob = ord + n;
        for (int64_t i = 0; i < n; i++) {
            float v = xr[i];
            uint32_t u;
            if (v != v) u = 0xFFFFFFFFu;                       /* every NaN: above everything */
            else {
                v = v + 0.0f;                                  /* -0.0 -> +0.0 */
                memcpy(&u, &v, sizeof u);
                u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   /* ascending with the value */
            }
            ka[i] = ~u;                                        /* ascending key = descending value */
            oa[i] = i;
        }
        for (int shift = 0; shift < 32; shift += 8) {          /* stable counting passes */
            int64_t count[257] = {0};
            for (int64_t i = 0; i < n; i++) count[((ka[i] >> shift) & 0xFF) + 1]++;
            for (int b = 0; b < 256; b++) count[b + 1] += count[b];
            for (int64_t i = 0; i < n; i++) {
                const int64_t at = count[(ka[i] >> shift) & 0xFF]++;
                kb[at] = ka[i];
                ob[at] = oa[i];
            }
            uint32_t *kt = ka; ka = kb; kb = kt;
            int64_t *ot = oa; oa = ob; ob = ot;
        }
        for (int64_t i = 0; i < n; i++) {
            idx[r * n + i] = oa[i];
            vals[r * n + i] = xr[oa[i]];
        }
        free(key);
        free(ord);
    }
    return failed ? -1 : 0;
}

/* 1 when k3_vec.h's v16 is one 16-float register here (AVX-512), 0 when a pair of 8-float halves. */
int k3_wide_registers(void) { return K3_WIDE_REGISTERS; }
