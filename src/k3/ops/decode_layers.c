/* Whole decode sublayers in one call (k3.infer.prepared): the KDA attention, the MLA attention
 * and the LatentMoE of one layer, for B rows, over weights packed once (k3.ops.packed_mm) and
 * described by a struct the caller fills at preparation. Each is the sequence of the kernels it is
 * made of (the packed matmuls, k3_kda_step, k3_route, k3_gated_act) with its intermediates in one
 * scratch buffer, so a sublayer costs one call from Python instead of a dozen.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_vec.h"

/* y [M, N] = (res or nothing) + n(x) @ W, res: [M, N] rows (ld N) or NULL; bias_row: a row [N] added to every
 * row instead (NULL: none). */
static int mat_mm(const k3_mat *m, const float *x, int64_t ldx, int64_t M, const float *res, const float *bias_row,
                  float *y, float norm_c, int nthreads) {
    int acc = 0;
    if (res) { memcpy(y, res, sizeof(float) * (size_t)(M * m->N)); acc = 1; }
    else if (bias_row) {
        for (int64_t r = 0; r < M; r++) memcpy(y + r * m->N, bias_row, sizeof(float) * (size_t)m->N);
        acc = 1;
    }
    return k3_packed_mm(x, ldx, M, m->K, m->w, m->N, y, m->N, acc, norm_c, nthreads);
}

/* out [B, H] = res + KDA(n(x)) (res NULL: no residual); conv, S -> conv_out, S_out (the cache's next). */
int k3_kda_layer_step(const k3_kda_layer *L, int64_t B, const float *x, const float *res, const float *conv,
                      const float *S, float *out, float *conv_out, float *S_out, int nthreads) {
    const int64_t P = L->nh * L->d, W = L->w_in.N;
    float *buf = malloc(sizeof(float) * (size_t)(B * (W + 3 * P)));
    if (!buf) return -1;
    float *y = buf, *dec = y + B * W, *gate = dec + B * P, *o = gate + B * P;
    int rc = mat_mm(&L->w_in, x, L->w_in.K, B, NULL, NULL, y, L->c_in, nthreads);
    const float *qkv = y, *fa = y + 3 * P, *b = fa + L->fa, *g = b + L->nh;
    if (!rc) rc = mat_mm(&L->w_f, fa, W, B, NULL, L->f_bias, dec, -1.0f, nthreads);
    const float *gt = g;
    int64_t ld_gate = W;
    if (!rc && L->w_gb.w) {
        rc = mat_mm(&L->w_gb, g, W, B, NULL, NULL, gate, -1.0f, nthreads);
        gt = gate, ld_gate = P;
    }
    if (!rc) rc = k3_kda_step(B, L->nh, L->d, L->Kc, qkv, W, conv, conv_out, L->conv_w, dec, P, L->neg_a ? 1 : 0,
                              L->lb, L->neg_a, b, W, gt, ld_gate, S, S_out, L->c_qk, L->q_scale, L->c_o, o, nthreads);
    if (!rc) rc = mat_mm(&L->w_o, o, P, B, res, NULL, out, -1.0f, nthreads);
    free(buf);
    return rc;
}

/* out [N, H] = res + LatentMoE(n(x)) (res NULL: no residual). */
int k3_moe_layer_step(const k3_moe_layer *L, int64_t N, const float *x, const float *res, float *out,
                      int nthreads) {
    const int64_t W = L->w_in.N, H = L->w_in.K, S = N * L->k, latent = L->w_up.w != NULL;
    const int64_t zw = L->w13.K;   /* the experts' input width: the latent, or H */
    const size_t floats = (size_t)(N * W + N * H + S * 2 * L->F + S * L->F + S * L->ell + N * L->ell
                                   + N * L->Fs + S);
    float *buf = malloc(sizeof(float) * floats);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(2 * S));
    if (!buf || !ids) { free(buf); free(ids); return -1; }
    float *y = buf, *zn = y + N * W, *h13 = zn + N * H, *h = h13 + S * 2 * L->F, *ys = h + S * L->F;
    float *u = ys + S * L->ell, *hs = u + N * L->ell, *w = hs + N * L->Fs;
    int64_t *idx = ids, *tok = ids + S;
    int rc = mat_mm(&L->w_in, x, H, N, NULL, NULL, y, L->c_in, nthreads);
    const float *logits = y, *z = y + L->E;
    int64_t ldz = W;
    if (!rc && !latent) {   /* z = n(x) gamma, the experts' input (their weights read x's width) */
        float *scale = malloc(sizeof(float) * (size_t)N);
        if (!scale) rc = -1;
        else {
            k3_row_inv_norm(x, H, N, H, L->c_in, scale);
            for (int64_t r = 0; r < N; r++)
                for (int64_t j = 0; j < H; j++) zn[r * H + j] = x[r * H + j] * scale[r] * L->gamma[j];
            free(scale);
            z = zn, ldz = H;
        }
    }
    if (!rc) rc = k3_route(N, L->E, logits, W, L->bias, L->k, (int)L->softmax, (int)L->renorm, L->tiny, idx, w);
    for (int64_t s = 0; s < S; s++) tok[s] = s / L->k;
    if (!rc) rc = k3_packed_rows_mm(z, ldz, N, tok, idx, S, zw, L->w13.w, 2 * L->F, L->E, h13, nthreads);
    if (!rc) rc = k3_gated_act(S, L->F, h13, 2 * L->F, h13 + L->F, 2 * L->F, (int)L->silu, L->inv_beta,
                               (int)L->tanh_up, w, h, nthreads);
    for (int64_t s = 0; s < S; s++) tok[s] = s;
    if (!rc) rc = k3_packed_rows_mm(h, L->F, S, tok, idx, S, L->F, L->w2.w, L->ell, L->E, ys, nthreads);
    if (!rc)
        for (int64_t r = 0; r < N; r++) {    /* u = the sum of each token's k slots, in slot order */
            float *ur = u + r * L->ell;
            memcpy(ur, ys + r * L->k * L->ell, sizeof(float) * (size_t)L->ell);
            for (int64_t j = 1; j < L->k; j++) {
                const float *yj = ys + (r * L->k + j) * L->ell;
                for (int64_t c = 0; c < L->ell; c++) ur[c] += yj[c];
            }
        }
    if (!rc) {
        if (latent) rc = mat_mm(&L->w_up, u, L->ell, N, res, NULL, out, L->c_u, nthreads);
        else
            for (int64_t i = 0; i < N * H; i++) out[i] = res ? res[i] + u[i] : u[i];
    }
    if (!rc && L->w_sd.w) {
        const int64_t off = L->E + (latent ? L->ell : 0);
        rc = k3_gated_act(N, L->Fs, y + off, W, y + off + L->Fs, W, (int)L->silu, L->inv_beta, (int)L->tanh_up,
                          NULL, hs, nthreads);
        if (!rc) rc = k3_packed_mm(hs, L->Fs, N, L->Fs, L->w_sd.w, L->w_sd.N, out, H, 1, -1.0f, nthreads);
    }
    free(buf);
    free(ids);
    return rc;
}

/* Heads of one MLA row at a time, MLA_HB together: the latent row (or a run of 16 of its floats) is read
 * once for them, and their sums are independent chains. */
enum { MLA_HB = 4 };

/* s[hh * lds] = q_pe[hh] . pe + q_lat[hh] . c for hh < nb heads (q_lat rows of stride r, q_pe of p;
 * r, p multiples of 16): dot2_f's sums, term for term in its order, so the same bits. */
static inline __attribute__((always_inline)) void head_scores_n(const int nb, const float *ql, const float *qp,
                                                                int64_t r, int64_t p, const float *c,
                                                                const float *pe, float *s, int64_t lds) {
    v16 acc[MLA_HB];
    for (int hh = 0; hh < nb; hh++) acc[hh] = splat16(0.0f);
    for (int64_t k = 0; k < p; k += 16) {
        const v16 v = load16(pe + k);
        for (int hh = 0; hh < nb; hh++) acc[hh] = add16(acc[hh], mul16(load16(qp + hh * p + k), v));
    }
    for (int64_t k = 0; k < r; k += 16) {
        const v16 v = load16(c + k);
        for (int hh = 0; hh < nb; hh++) acc[hh] = add16(acc[hh], mul16(load16(ql + hh * r + k), v));
    }
    for (int hh = 0; hh < nb; hh++) s[hh * lds] = hsum16(acc[hh]);
}

/* o[hh] = sum_j a[hh][j] c_j (j < ns: the n cached latents cb, then this token's cn) for hh < nb heads, a
 * rows of stride ns, o rows of r: each element the chain o = 0; o += a_j c_j over j in order, as the
 * loop it replaces, with the nb heads' sums kept in registers across j, 16 floats of r at a time. */
static inline __attribute__((always_inline)) void head_mix_n(const int nb, const float *a, int64_t ns, int64_t n,
                                                             const float *cb, const float *cn, int64_t r,
                                                             float *o) {
    int64_t i = 0;
    for (; i + 16 <= r; i += 16) {
        v16 acc[MLA_HB];
        for (int hh = 0; hh < nb; hh++) acc[hh] = splat16(0.0f);
        for (int64_t j = 0; j < ns; j++) {
            const v16 c = load16((j < n ? cb + j * r : cn) + i);
            for (int hh = 0; hh < nb; hh++) acc[hh] = add16(acc[hh], mul16(splat16(a[hh * ns + j]), c));
        }
        for (int hh = 0; hh < nb; hh++) store16(o + hh * r + i, acc[hh]);
    }
    for (; i < r; i++)
        for (int hh = 0; hh < nb; hh++) {
            float t = 0.0f;
            for (int64_t j = 0; j < ns; j++) t += a[hh * ns + j] * (j < n ? cb + j * r : cn)[i];
            o[hh * r + i] = t;
        }
}

/* The two above with nb a constant, so that their sums stay in registers. */
static void head_scores(int nb, const float *ql, const float *qp, int64_t r, int64_t p, const float *c,
                        const float *pe, float *s, int64_t lds) {
    switch (nb) {
    case 1: head_scores_n(1, ql, qp, r, p, c, pe, s, lds); break;
    case 2: head_scores_n(2, ql, qp, r, p, c, pe, s, lds); break;
    case 3: head_scores_n(3, ql, qp, r, p, c, pe, s, lds); break;
    default: head_scores_n(MLA_HB, ql, qp, r, p, c, pe, s, lds); break;
    }
}

static void head_mix(int nb, const float *a, int64_t ns, int64_t n, const float *cb, const float *cn, int64_t r,
                     float *o) {
    switch (nb) {
    case 1: head_mix_n(1, a, ns, n, cb, cn, r, o); break;
    case 2: head_mix_n(2, a, ns, n, cb, cn, r, o); break;
    case 3: head_mix_n(3, a, ns, n, cb, cn, r, o); break;
    default: head_mix_n(MLA_HB, a, ns, n, cb, cn, r, o); break;
    }
}

/* out [B, H] = res + MLA(n(x)) over the cached latents of each row (c_buf [B, S, r], pe_buf [B, S, p]:
 * batch strides ldc, ldp, row b's first lengths[b] entries valid) and this token's; c_new [B, r],
 * pe_new [B, p]: this token's latents (normed), for the caller to append. The query has W_UK and the
 * softmax scale absorbed, so a score is q_lat . c + q_pe . pe. */
int k3_mla_layer_step(const k3_mla_layer *L, int64_t B, const float *x, const float *res, const float *c_buf,
                      int64_t ldc, const float *pe_buf, int64_t ldp, int64_t S, const int64_t *lengths, float *out,
                      float *c_new, float *pe_new, int nthreads) {
    const int64_t W = L->w_in.N, nh = L->nh, r = L->r, p = L->p, vd = L->vd, Q = nh * (r + p);
    float *buf = malloc(sizeof(float) * (size_t)(B * W + B * Q + B * nh * vd + B * nh * (S + 1 + r)));  /* + work */
    if (!buf) return -1;
    float *y = buf, *qb = y + B * W, *o = qb + B * Q, *work = o + B * nh * vd;
    int rc = mat_mm(&L->w_in, x, L->w_in.K, B, NULL, NULL, y, L->c_in, nthreads);
    const float *q = y;
    int64_t ldq = W;
    if (!rc && L->w_q.w) {
        rc = mat_mm(&L->w_q, y, W, B, NULL, NULL, qb, L->c_q, nthreads);
        q = qb, ldq = Q;
    }
    if (rc) { free(buf); return rc; }
    for (int64_t b = 0; b < B; b++) {      /* this token's latent: RMSNorm (weight kv_w), and its rope part */
        const float *ckv = y + b * W + L->qdim;
        float s = 0.0f;
        k3_row_inv_norm(ckv, r, 1, r, L->c_kv, &s);
        for (int64_t i = 0; i < r; i++) c_new[b * r + i] = ckv[i] * s * L->kv_w[i];
        memcpy(pe_new + b * p, ckv + r, sizeof(float) * (size_t)p);
    }
    /* items: (row, group of heads); a row's cached latents are read once per group, for all its heads
     * (a row alone is split into as many head groups as there are threads) */
    const int64_t groups = B >= nthreads ? 1 : (nthreads / B < nh ? nthreads / B : nh);
    const int64_t per = (nh + groups - 1) / groups;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < B * groups; item++) {
        const int64_t b = item / groups, h0 = item % groups * per, h1 = h0 + per < nh ? h0 + per : nh;
        const int64_t n = lengths[b] < S ? (lengths[b] > 0 ? lengths[b] : 0) : S, ns = n + 1;
        const float *cb = c_buf + b * ldc, *pb = pe_buf + b * ldp, *cn = c_new + b * r, *pn = pe_new + b * p;
        float *sc = work + b * nh * (S + 1 + r);          /* [nh][ns] scores, then [nh][r] latents */
        float *ol = sc + nh * (S + 1);
        const float *qrow = q + b * ldq;
        for (int64_t j = 0; j < ns; j++) {
            const float *cj = j < n ? cb + j * r : cn, *pj = j < n ? pb + j * p : pn;
            if (p % 16 == 0 && r % 16 == 0)
                for (int64_t h = h0; h < h1; h += MLA_HB)
                    head_scores(h1 - h < MLA_HB ? (int)(h1 - h) : MLA_HB, qrow + h * r, qrow + nh * r + h * p, r, p,
                                cj, pj, sc + h * ns + j, ns);
            else
                for (int64_t h = h0; h < h1; h++)
                    sc[h * ns + j] = dot2_f(qrow + nh * r + h * p, pj, p, qrow + h * r, cj, r);
        }
        for (int64_t h = h0; h < h1; h++) {
            float *sh = sc + h * ns, mx = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < ns; j++) mx = sh[j] > mx ? sh[j] : mx;
            for (int64_t j = 0; j < ns; j++) sh[j] -= mx;
            map_exp(sh, ns);
            for (int64_t j = 0; j < ns; j++) total += sh[j];
            const float inv = 1.0f / total;
            for (int64_t j = 0; j < ns; j++) sh[j] *= inv;
        }
        for (int64_t h = h0; h < h1; h += MLA_HB)
            head_mix(h1 - h < MLA_HB ? (int)(h1 - h) : MLA_HB, sc + h * ns, ns, n, cb, cn, r, ol + h * r);
        for (int64_t h = h0; h < h1; h++) {
            float *oh = o + b * nh * vd + h * vd;
            const float *wu = L->w_uv_t + h * r * vd, *lh = ol + h * r;
            for (int64_t v = 0; v < vd; v++) oh[v] = 0.0f;
            for (int64_t i = 0; i < r; i++) {
                const float li = lh[i];
                for (int64_t v = 0; v < vd; v++) oh[v] += li * wu[i * vd + v];
            }
            if (L->gated) {
                const float *g = y + b * W + L->qdim + r + p + h * vd;
                for (int64_t v = 0; v < vd; v++) oh[v] *= 1.0f / (1.0f + expf(-g[v]));
            }
        }
    }
    rc = mat_mm(&L->w_o, o, nh * vd, B, res, NULL, out, -1.0f, nthreads);
    free(buf);
    return rc;
}

/* The layout of struct `which` (0 k3_mat, 1 k3_kda_layer, 2 k3_mla_layer, 3 k3_moe_layer), for
 * k3.ops.kernel_structs to check its ctypes structs against: out = its sizeof, then the offsetof and the
 * sizeof of each field in declaration order. Returns the count written; -1 for an unknown struct or
 * when n is too small. */
#define K3_FIELD(T, f) offsetof(T, f), sizeof(((T *)0)->f)
int k3_struct_layout(int which, int64_t *out, int64_t n) {
    static const size_t mat[] = {sizeof(k3_mat), K3_FIELD(k3_mat, w), K3_FIELD(k3_mat, K), K3_FIELD(k3_mat, N),
                                 K3_FIELD(k3_mat, E)};
    static const size_t kda[] = {
        sizeof(k3_kda_layer), K3_FIELD(k3_kda_layer, w_in), K3_FIELD(k3_kda_layer, w_f),
        K3_FIELD(k3_kda_layer, w_gb), K3_FIELD(k3_kda_layer, w_o), K3_FIELD(k3_kda_layer, conv_w),
        K3_FIELD(k3_kda_layer, f_bias), K3_FIELD(k3_kda_layer, neg_a), K3_FIELD(k3_kda_layer, nh),
        K3_FIELD(k3_kda_layer, d), K3_FIELD(k3_kda_layer, Kc), K3_FIELD(k3_kda_layer, fa),
        K3_FIELD(k3_kda_layer, G), K3_FIELD(k3_kda_layer, lb), K3_FIELD(k3_kda_layer, c_in),
        K3_FIELD(k3_kda_layer, c_qk), K3_FIELD(k3_kda_layer, q_scale), K3_FIELD(k3_kda_layer, c_o)};
    static const size_t mla[] = {
        sizeof(k3_mla_layer), K3_FIELD(k3_mla_layer, w_in), K3_FIELD(k3_mla_layer, w_q),
        K3_FIELD(k3_mla_layer, w_o), K3_FIELD(k3_mla_layer, w_uv_t), K3_FIELD(k3_mla_layer, kv_w),
        K3_FIELD(k3_mla_layer, nh), K3_FIELD(k3_mla_layer, r), K3_FIELD(k3_mla_layer, p),
        K3_FIELD(k3_mla_layer, vd), K3_FIELD(k3_mla_layer, qdim), K3_FIELD(k3_mla_layer, gated),
        K3_FIELD(k3_mla_layer, c_in), K3_FIELD(k3_mla_layer, c_q), K3_FIELD(k3_mla_layer, c_kv)};
    static const size_t moe[] = {
        sizeof(k3_moe_layer), K3_FIELD(k3_moe_layer, w_in), K3_FIELD(k3_moe_layer, w13),
        K3_FIELD(k3_moe_layer, w2), K3_FIELD(k3_moe_layer, w_up), K3_FIELD(k3_moe_layer, w_sd),
        K3_FIELD(k3_moe_layer, bias), K3_FIELD(k3_moe_layer, gamma), K3_FIELD(k3_moe_layer, E),
        K3_FIELD(k3_moe_layer, k), K3_FIELD(k3_moe_layer, F), K3_FIELD(k3_moe_layer, Fs),
        K3_FIELD(k3_moe_layer, ell), K3_FIELD(k3_moe_layer, softmax), K3_FIELD(k3_moe_layer, renorm),
        K3_FIELD(k3_moe_layer, silu), K3_FIELD(k3_moe_layer, tanh_up), K3_FIELD(k3_moe_layer, tiny),
        K3_FIELD(k3_moe_layer, inv_beta), K3_FIELD(k3_moe_layer, c_in), K3_FIELD(k3_moe_layer, c_u)};
    static const size_t *const tables[] = {mat, kda, mla, moe};
    static const int64_t counts[] = {sizeof mat / sizeof *mat, sizeof kda / sizeof *kda, sizeof mla / sizeof *mla,
                                     sizeof moe / sizeof *moe};
    if (which < 0 || which > 3 || !out || n < counts[which]) return -1;
    for (int64_t i = 0; i < counts[which]; i++) out[i] = (int64_t)tables[which][i];
    return (int)counts[which];
}
#undef K3_FIELD
