/* The gated activations of the MLPs and experts (k3.ops.situ), forward and backward, elementwise over
 * n floats of g (gate) and u (up), both contiguous and of one shape:
 *
 *   SwiGLU (silu = 1):  y = g s u,                         s = sigmoid(g)
 *   SiTU   (silu = 0):  y = [beta tanh(g / beta) s] [lb tanh(u / lb)]   (lb <= 0: the second factor is u)
 *
 * Backward, from dy and the inputs g, u alone (the forward saves nothing else):
 *   SwiGLU: dg = dy u s (1 + g (1 - s)),                   du = dy g s
 *   SiTU:   with t = tanh(g / beta), a = beta t, gate = a s, v = tanh(u / lb), up = lb v,
 *           dg = dy up [(1 - t^2) s + a s (1 - s)],         du = dy gate (1 - v^2)   (lb <= 0: up = u, du = dy gate)
 *
 * Every element goes through the same 16-wide vector code (the tail through a zero-padded vector), so
 * a value does not depend on its position, the thread count or the other elements.
 */
#include <stdint.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { GLU_CHUNK = 4096 };

static inline v16 glu_fwd16(v16 g, v16 u, int silu, float beta, float lb) {
    const v16 s = vsigmoid(g);
    if (silu) return mul16(mul16(g, s), u);
    const v16 gate = mul16(mul16(splat16(beta), vtanh(mul16(g, splat16(1.0f / beta)))), s);
    return lb > 0.0f ? mul16(gate, mul16(splat16(lb), vtanh(mul16(u, splat16(1.0f / lb))))) : mul16(gate, u);
}

static inline void glu_bwd16(v16 g, v16 u, v16 dy, int silu, float beta, float lb, v16 *dg, v16 *du) {
    const v16 s = vsigmoid(g);
    if (silu) {
        *dg = mul16(mul16(mul16(dy, u), s), add16(splat16(1.0f), mul16(g, sub16(splat16(1.0f), s))));
        *du = mul16(mul16(dy, g), s);
        return;
    }
    const v16 t = vtanh(mul16(g, splat16(1.0f / beta))), a = mul16(splat16(beta), t), gate = mul16(a, s);
    const v16 dgate = add16(mul16(sub16(splat16(1.0f), mul16(t, t)), s), mul16(mul16(a, s), sub16(splat16(1.0f), s)));
    if (lb > 0.0f) {
        const v16 v = vtanh(mul16(u, splat16(1.0f / lb)));
        *dg = mul16(mul16(dy, mul16(splat16(lb), v)), dgate);
        *du = mul16(mul16(dy, gate), sub16(splat16(1.0f), mul16(v, v)));
    } else {
        *dg = mul16(mul16(dy, u), dgate);
        *du = mul16(dy, gate);
    }
}

int k3_glu(int64_t n, const float *g, const float *u, int silu, float beta, float lb, float *y, int nthreads) {
    const int64_t nchunk = (n + GLU_CHUNK - 1) / GLU_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunk; c++) {
        const int64_t end = (c + 1) * GLU_CHUNK < n ? (c + 1) * GLU_CHUNK : n;
        for (int64_t i = c * GLU_CHUNK; i < end; i += 16) {
            const v16 gv = load16_pad(g, i, end, 0.0f), uv = load16_pad(u, i, end, 0.0f);
            store16_part(y, i, end, glu_fwd16(gv, uv, silu, beta, lb));
        }
    }
    return 0;
}

int k3_glu_bwd(int64_t n, const float *g, const float *u, const float *dy, int silu, float beta, float lb,
               float *dg, float *du, int nthreads) {
    const int64_t nchunk = (n + GLU_CHUNK - 1) / GLU_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunk; c++) {
        const int64_t end = (c + 1) * GLU_CHUNK < n ? (c + 1) * GLU_CHUNK : n;
        for (int64_t i = c * GLU_CHUNK; i < end; i += 16) {
            v16 a, b;
            const v16 gv = load16_pad(g, i, end, 0.0f), uv = load16_pad(u, i, end, 0.0f);
            glu_bwd16(gv, uv, load16_pad(dy, i, end, 0.0f), silu, beta, lb, &a, &b);
            store16_part(dg, i, end, a);
            store16_part(du, i, end, b);
        }
    }
    return 0;
}
