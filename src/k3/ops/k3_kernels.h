/* The entry points of the CPU kernels (k3.ops.cpu_kernels), for kernels that call each other. */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include <stdint.h>

int k3_packed_mm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *W, int64_t N, float *y,
                 int64_t ldy, int acc, float norm_c, int nthreads);
int k3_packed_rows_mm(const float *x, int64_t ldx, int64_t R, const int64_t *rows, const int64_t *experts,
                      int64_t S, int64_t K, const float *W, int64_t N, int64_t E, float *y, int nthreads);
int k3_row_inv_norm(const float *x, int64_t ldx, int64_t M, int64_t K, float c, float *out);
int k3_kda_step(int64_t B, int64_t nh, int64_t d, int64_t Kc, const float *qkv, int64_t ld_qkv, const float *conv,
                float *conv_out, const float *conv_w, const float *dec_in, int64_t ld_dec, int mode, float lb,
                const float *neg_a, const float *beta_in, int64_t ld_beta, const float *gate, int64_t ld_gate,
                const float *S, float *S_out, float c_qk, float q_scale, float c_o, float *o_out, int nthreads);
int k3_gated_act(int64_t rows, int64_t F, const float *g, int64_t ldg, const float *u, int64_t ldu, int silu,
                 float inv_beta, int tanh_up, const float *row_w, float *out, int nthreads);
int k3_route(int64_t N, int64_t E, const float *logits, int64_t ld, const float *bias, int64_t k, int softmax,
             int renorm, float tiny, int64_t *idx, float *w);

#endif
