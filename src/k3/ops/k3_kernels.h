/* The entry points of the CPU kernels and the structs they take (k3.ops.cpu_kernels). Every .c file
 * includes this, so each definition is checked against its prototype here; cpu_kernels.py reads the
 * prototypes to set the ctypes argument types, and decode_layers.py checks its ctypes structs against
 * k3_struct_layout. Only `int k3_...(...)` prototypes and `typedef struct {...} name;` belong here. */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include <stdint.h>

typedef struct {     /* a packed matrix (k3.ops.packed_mm): K rows in, N columns out; E stacked */
    const float *w;
    int64_t K, N, E;
} k3_mat;

typedef struct {
    k3_mat w_in, w_f, w_gb, w_o;              /* w_gb.w NULL: the gate is full rank (read from w_in's output) */
    const float *conv_w, *f_bias, *neg_a;     /* neg_a NULL: the lower-bounded gate exp(lb sigmoid(.)) */
    int64_t nh, d, Kc, fa, G;                 /* fa: f_a's width; G: the gate's width in w_in's output */
    float lb, c_in, c_qk, q_scale, c_o;
} k3_kda_layer;

typedef struct {
    k3_mat w_in, w_q, w_o;                    /* w_q.w NULL: no q LoRA (the query is in w_in's output) */
    const float *w_uv_t, *kv_w;               /* w_uv_t [nh, r, v]: the latent to each head's values */
    int64_t nh, r, p, vd, qdim, gated;        /* qdim: the query part's width in w_in's output */
    float c_in, c_q, c_kv;
} k3_mla_layer;

typedef struct {
    k3_mat w_in, w13, w2, w_up, w_sd;         /* w_up.w NULL: not latent; w_sd.w NULL: no shared experts */
    const float *bias, *gamma;                /* router bias [E] (live); gamma [H]: z = n(x) gamma when not latent */
    int64_t E, k, F, Fs, ell, softmax, renorm, silu, tanh_up;
    float tiny, inv_beta, c_in, c_u;          /* c_u < 0: no latent norm */
} k3_moe_layer;

/* packed_mm.c */
int k3_packed_mm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *W, int64_t N, float *y,
                 int64_t ldy, int acc, float norm_c, int nthreads);
int k3_packed_rows_mm(const float *x, int64_t ldx, int64_t R, const int64_t *rows, const int64_t *experts,
                      int64_t S, int64_t K, const float *W, int64_t N, int64_t E, float *y, int nthreads);
int k3_row_inv_norm(const float *x, int64_t ldx, int64_t M, int64_t K, float c, float *out);

/* decode_rows.c */
int k3_kda_step(int64_t B, int64_t nh, int64_t d, int64_t Kc, const float *qkv, int64_t ld_qkv, const float *conv,
                float *conv_out, const float *conv_w, const float *dec_in, int64_t ld_dec, int mode, float lb,
                const float *neg_a, const float *beta_in, int64_t ld_beta, const float *gate, int64_t ld_gate,
                const float *S, float *S_out, float c_qk, float q_scale, float c_o, float *o_out, int nthreads);
int k3_map(int kind, float *x, int64_t n);
int k3_gated_act(int64_t rows, int64_t F, const float *g, int64_t ldg, const float *u, int64_t ldu, int silu,
                 float inv_beta, int tanh_up, const float *row_w, float *out, int nthreads);
int k3_route(int64_t N, int64_t E, const float *logits, int64_t ld, const float *bias, int64_t k, int softmax,
             int renorm, float tiny, int64_t *idx, float *w);
int k3_sort_desc(const float *x, int64_t rows, int64_t n, float *vals, int64_t *idx, int nthreads);
int k3_wide_registers(void);

/* decode_layers.c */
int k3_kda_layer_step(const k3_kda_layer *L, int64_t B, const float *x, const float *res, const float *conv,
                      const float *S, float *out, float *conv_out, float *S_out, int nthreads);
int k3_moe_layer_step(const k3_moe_layer *L, int64_t N, const float *x, const float *res, float *out,
                      int nthreads);
int k3_mla_layer_step(const k3_mla_layer *L, int64_t B, const float *x, const float *res, const float *c_buf,
                      int64_t ldc, const float *pe_buf, int64_t ldp, int64_t S, const int64_t *lengths, float *out,
                      float *c_new, float *pe_new, int nthreads);
int k3_struct_layout(int which, int64_t *out, int64_t n);

/* kda_scan.c */
int k3_kda_scan(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, const float *q, const float *k,
                const float *v, const float *g, const float *beta, float scale, const float *S0, float *o,
                float *S_final, float *ckpt, int64_t C, int nthreads);
int k3_kda_scan_bwd(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, const float *q, const float *k,
                    const float *v, const float *g, const float *beta, float scale, const float *ckpt, int64_t C,
                    const float *dO, const float *dS_final, float *dq, float *dk, float *dv, float *dg,
                    float *dbeta, float *dS0, int nthreads);

/* attn_res.c */
int k3_attn_res_mix(int64_t n, const float *const *src, const int64_t *ld, int64_t B, int64_t H, const float *q,
                    float c, float *out);
int k3_attn_res_fwd(int64_t n, const float *const *src, const int64_t *ld, int64_t M, int64_t H, const float *q,
                    float c, float *out, float *alpha, float *r, float *p, int nthreads);
int k3_attn_res_bwd(int64_t n, const float *const *src, const int64_t *ld, int64_t M, int64_t H, const float *q,
                    const float *alpha, const float *r, const float *p, const float *dout, float *const *dsrc,
                    float *dq, int nthreads);

/* short_conv.c */
int k3_short_conv_silu(int64_t B, int64_t T, int64_t C, int64_t K, const float *x, const float *prev,
                       const float *wT, float *y, int nthreads);
int k3_short_conv_silu_bwd(int64_t B, int64_t T, int64_t C, int64_t K, const float *x, const float *prev,
                           const float *wT, const float *dy, float *dx, float *dprev, float *dwT, int nthreads);

/* glu.c */
int k3_glu(int64_t n, const float *g, const float *u, int silu, float beta, float lb, float *y, int nthreads);
int k3_glu_bwd(int64_t n, const float *g, const float *u, const float *dy, int silu, float beta, float lb,
               float *dg, float *du, int nthreads);

/* cross_entropy.c */
int k3_cross_entropy(int64_t N, int64_t V, const float *z, const int64_t *y, int64_t ignore, float *loss,
                     float *lse, int nthreads);
int k3_cross_entropy_bwd(int64_t N, int64_t V, const float *z, const int64_t *y, int64_t ignore,
                         const float *lse, const float *g, float *dz, int nthreads);

/* rms_norm.c */
int k3_rms_norm(int64_t M, int64_t D, const float *x, const float *w, float eps, float *y, float *rinv,
                int nthreads);
int k3_rms_norm_bwd(int64_t M, int64_t D, const float *x, const float *w, const float *rinv, const float *dy,
                    float *dx, float *dw, int nthreads);

#endif
