/* fp32 matmul over panel-packed weights, for decode-sized batches (k3.ops.packed_mm).
 *
 * A weight W [K, N] (x @ W) is stored as ceil(N/NR) panels, each [K][NR] contiguous (columns past
 * N are zero). A tile of up to MR rows x NR columns keeps MR*NR/16 accumulators in registers and
 * streams its panel once, front to back, with a software prefetch AHEAD rows on: that is what keeps
 * the read stream going while the core is busy with the FMAs (batch 8: 1.6-1.8x MKL's sgemm here). A
 * tile of 1-4 rows streams 2-4 panels side by side instead, so more reads are in flight (batch 1:
 * 1.2-1.3x the one-panel tile; benchmarks/packed_mm.py). More rows than tile() takes (3 on 16-register
 * targets, AVX2; 9 with AVX-512) go one panel at a time in passes of 3 (AVX2) or 8 rows that prefetch
 * the next panel while they compute (tile_passes): 16 rows stream each panel once.
 *
 * Every output element is one FMA chain over k = 0..K-1 in order, whatever the number of rows or
 * threads: a row's result does not depend on its batch companions (bitwise).
 *
 * Threads: the (matrix, panel, row chunk) items are in panel-major order inside a matrix, so a thread
 * re-reads a panel for its next row chunk from cache rather than memory, and each thread takes a run
 * of consecutive items of about equal cost (run). It runs on the process's libgomp (torch's), with
 * the thread count the caller passes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "k3_kernels.h"
#include "k3_vec.h"

enum { NR = 32, MR = 8, AHEAD = 32, PN = 4 };
/* Rows per work item (tile_passes takes them RG at a time) */
enum { CHUNK = 16 };

/* y[m][0:nc] (+)= s[m] * (x[m] @ [panel_0 | .. | panel_{pn-1}]) for m < mr, over pn consecutive panels
 * (pn <= PN): x[m], y[m]: row pointers; s[m]: row scales. Few rows leave the FMA units idle while
 * one panel streams in, so they stream pn panels at once (more reads in flight); each output
 * element is still the same FMA chain over k in order. */
static inline __attribute__((always_inline)) void tile(const int mr, const int pn, const float *const *x,
                                                       const float *panel, int64_t K, float *const *y,
                                                       const float *s, int64_t nc, int acc) {
    v16 a0[PN][MR], a1[PN][MR];
    for (int p = 0; p < pn; p++)
        for (int m = 0; m < mr; m++) { a0[p][m] = (v16){0}; a1[p][m] = (v16){0}; }
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < pn; p++) {
            const float *w = panel + (p * K + k) * NR;
            __builtin_prefetch(w + AHEAD * NR);
            __builtin_prefetch(w + AHEAD * NR + 16);
            v16 w0 = load16(w), w1 = load16(w + 16);
            for (int m = 0; m < mr; m++) {
                float b = x[m][k];
                a0[p][m] = add16(a0[p][m], mul16(splat16(b), w0));
                a1[p][m] = add16(a1[p][m], mul16(splat16(b), w1));
            }
        }
    }
    for (int m = 0; m < mr; m++) {
        float t[PN * NR];
        for (int p = 0; p < pn; p++) {
            store16(t + p * NR, a0[p][m]);
            store16(t + p * NR + 16, a1[p][m]);
        }
        float *o = y[m];
        const float sm = s[m];
        if (acc) for (int64_t j = 0; j < nc; j++) o[j] += sm * t[j];
        else for (int64_t j = 0; j < nc; j++) o[j] = sm * t[j];
    }
}

/* More rows than tile() takes (tile_any) go one panel at a time, in passes of up to RG rows:
 * RG * NR / VW accumulators of VW floats, the RG rows' x[k] broadcast, and one register for each VW
 * columns of the panel row in turn. Loading each VW columns once for the RG rows (not once per row, as
 * GCC does for tile()'s loop, an FMA with a memory operand) keeps the loop on the FMA units.
 * - 16-register targets (AVX2, VW = 8): tile()'s 2 MR accumulators (4 MR registers) would spill on
 *   every k, so 3 rows or more go in passes of RG = 3 (16 registers): 7 loads per 12 FMAs, not 15.
 * - 32-register targets (AVX-512, VW = 16): tile() takes up to MR = 8 rows; 9-16 go in passes of 8
 *   (16 accumulators, 8 broadcasts, 1 panel register), so a 16-row item streams each panel once.
 *
 * K goes in blocks of KB rows, the accumulators kept in a small buffer between blocks (a store and a
 * reload do not change a float: each output element is still the same FMA chain over k in order as
 * in tile(), so the same bits). While the passes over a panel compute, they prefetch the next panel
 * of the work (`next`; the next item's first panel after an item's last): the pass j of P prefetches
 * the rows k of the block with k mod P = j, so each row of the next panel is asked for once and the
 * memory stream runs under the FMAs instead of after them (tile() prefetches only its own panel, so a
 * second chunk of rows over a panel that is in cache left the memory idle). */
#if K3_WIDE_REGISTERS
enum { RG = MR, KB = 64, VW = 16, PASS_MIN = MR + 1 };
typedef v16 vw;
typedef v16_alias vw_alias;
static inline vw splat_vw(float t) { return splat16(t); }
#define K3_KEEP(v) __asm__("" : "+v"(v))   /* any of the 32 vector registers */
#else
enum { RG = 3, KB = 64, VW = 8, PASS_MIN = 3 };
typedef v8 vw;
typedef v8_alias vw_alias;
static inline vw splat_vw(float t) { return (vw){t, t, t, t, t, t, t, t}; }
#define K3_KEEP(v) __asm__("" : "+x"(v))
#endif

static inline __attribute__((always_inline)) void pass_rows(const int rg, const float *const *x, const float *w,
                                                            int64_t kn, float *part, int acc, const float *nx,
                                                            int64_t P, int64_t j) {
    vw a[RG][NR / VW];
    for (int m = 0; m < rg; m++)
        for (int c = 0; c < NR / VW; c++) a[m][c] = acc ? (vw)*(const vw_alias *)(part + m * NR + VW * c) : (vw){0};
    for (int64_t k = 0, kp = j; k < kn; k++) {   /* kp: the next k with k mod P = j (no division in the loop) */
        const float *wk = w + k * NR;
        if (k == kp) {
            __builtin_prefetch(nx + k * NR);
            __builtin_prefetch(nx + k * NR + 16);
            kp += P;
        }
        vw b[RG];
        for (int m = 0; m < rg; m++) b[m] = splat_vw(x[m][k]);
        for (int c = 0; c < NR / VW; c++) {
            vw wc = (vw)*(const vw_alias *)(wk + VW * c);
#if defined(__x86_64__)
            K3_KEEP(wc);   /* keep it in a register: one load for the RG rows */
#endif
            for (int m = 0; m < rg; m++) a[m][c] += b[m] * wc;
        }
    }
    for (int m = 0; m < rg; m++)
        for (int c = 0; c < NR / VW; c++) *(vw_alias *)(part + m * NR + VW * c) = a[m][c];
}
#undef K3_KEEP

/* Rows mr <= CHUNK of pn consecutive panels, pass by pass (above). */
static void tile_passes(int mr, int pn, const float *const *x, const float *panel, int64_t K, float *const *y,
                        const float *s, int64_t nc, int acc, const float *next) {
    const int64_t P = (mr + RG - 1) / RG;
    float part[CHUNK * NR];
    for (int p = 0; p < pn; p++) {
        const int64_t c0 = (int64_t)p * NR, cn = nc - c0 < NR ? nc - c0 : NR;
        const float *w = panel + c0 * K;
        /* a single pass (RG rows) is bound by the read: it streams its own panel, AHEAD rows on */
        const float *nx = P == 1 ? w + AHEAD * NR : p + 1 < pn ? w + K * NR : next;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kn = K - k0 < KB ? K - k0 : KB;
            const float *xk[CHUNK], *wk = w + k0 * NR, *nk = nx + k0 * NR;
            for (int m = 0; m < mr; m++) xk[m] = x[m] + k0;
            for (int64_t j = 0; j < P; j++) {
                const int m0 = (int)j * RG, rg = mr - m0 < RG ? mr - m0 : RG;
                float *pt = part + m0 * NR;
                /* one specialisation per row count: the accumulators stay in registers */
#define K3_PASS(r) case r: pass_rows(r, xk + m0, wk, kn, pt, k0 > 0, nk, P, j); break;
                switch (rg) {
                K3_PASS(1) K3_PASS(2)
#if K3_WIDE_REGISTERS
                K3_PASS(3) K3_PASS(4) K3_PASS(5) K3_PASS(6) K3_PASS(7)
#endif
                default: pass_rows(RG, xk + m0, wk, kn, pt, k0 > 0, nk, P, j); break;
                }
#undef K3_PASS
            }
        }
        for (int m = 0; m < mr; m++) {
            float *o = y[m] + c0;
            const float sm = s[m], *t = part + m * NR;
            if (acc) for (int64_t c = 0; c < cn; c++) o[c] += sm * t[c];
            else for (int64_t c = 0; c < cn; c++) o[c] = sm * t[c];
        }
    }
}

/* next: the panel the thread's next item starts with (for the prefetch of tile_passes). */
static void tile_any(int mr, int pn, const float *const *x, const float *panel, int64_t K, float *const *y,
                     const float *s, int64_t nc, int acc, const float *next) {
    /* AVX2, 1 or 2 rows: tile()'s 4 panels side by side (4 read streams) are bound by the read, not
     * the FMAs, even with 2 rows' accumulators spilling to the stack: [2, 256] @ 29 experts' [256, 512]
     * (2 threads) 0.72 -> 0.67 ms in passes -> tile(), 1 thread 18 -> 25 GB/s. 3 rows or more: passes.
     * AVX-512: tile() up to MR rows, passes above */
    if (mr >= PASS_MIN) {
        tile_passes(mr, pn, x, panel, K, y, s, nc, acc, next);
        return;
    }
    /* one specialisation per row and panel count: the accumulators stay in registers */
#define K3_TILE(r, n) case MR * (n - 1) + r: tile(r, n, x, panel, K, y, s, nc, acc); break;
    switch (MR * (pn - 1) + mr) {
    K3_TILE(1, 1) K3_TILE(2, 1) K3_TILE(3, 1) K3_TILE(4, 1) K3_TILE(5, 1) K3_TILE(6, 1) K3_TILE(7, 1)
    K3_TILE(1, 2) K3_TILE(2, 2) K3_TILE(3, 2) K3_TILE(4, 2)
    K3_TILE(1, 3) K3_TILE(2, 3) K3_TILE(1, 4) K3_TILE(2, 4)
    default: tile(MR, 1, x, panel, K, y, s, nc, acc); break;
    }
#undef K3_TILE
}

/* Panels per item for a chunk of `rows` rows: 4 for up to 2 rows, 2 for up to 4, else 1 (with 8 rows the
 * FMAs already cover a panel's read time); the matrix's last group may be shorter (item_panels). */
static inline int64_t group_panels(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }
static inline int64_t item_panels(int64_t rows, int64_t p, int64_t np) {
    const int64_t g = group_panels(rows);
    return np - p < g ? np - p : g;
}

/* One item's cost in the units of the split between threads: its weight reads (pn panels of K rows)
 * plus its FMAs, a panel row being worth about ITEM_READ rows of FMAs (20 GB/s and 32 FLOP a cycle
 * at 3 GHz: 128 bytes take the time of ~20 cycles, one row's 4 FMAs of 8 ~2). */
enum { ITEM_READ = 10 };
static inline int64_t item_cost(int64_t rows, int64_t pn, int64_t K) { return pn * K * (ITEM_READ + rows); }

/* The work: row chunk c (rows first[c] .. first[c]+len[c]-1 of the row lists, of matrix mat[c]) times
 * panels p .. p+pn-1, pn = item_panels(len[c], p, np), for each item (chunk[i], panel[i] = p); scale: one
 * factor per row of the lists, or NULL. Each thread takes a run of consecutive items of about equal
 * cost (items differ: a chunk of 2 rows takes 4 panels, one of 16 rows 1), so it goes through a
 * matrix's panels in order and knows the panel it reads next. */
static void run(const float *const *xrows, float *const *yrows, const float *scale, const int64_t *first,
                const int64_t *len,
                const int64_t *mat, int64_t items, const int64_t *chunk, const int64_t *panel, int64_t K,
                const float *W, int64_t N, int acc, int nthreads) {
    const int64_t np = (N + NR - 1) / NR, msize = np * K * NR;
    int64_t total = 0;
    for (int64_t i = 0; i < items; i++) total += item_cost(len[chunk[i]], item_panels(len[chunk[i]], panel[i], np), K);
    if (total < 1) total = 1;   /* K = 0: every item costs nothing */
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* this thread's items: those whose cost midpoint falls in [t, t+1) * total / nt */
        int64_t lo = items, hi = items, acc_cost = 0;
        for (int64_t i = 0; i < items; i++) {
            const int64_t cst = item_cost(len[chunk[i]], item_panels(len[chunk[i]], panel[i], np), K);
            const int64_t owner = (2 * acc_cost + cst) * nt / (2 * total);
            if (owner >= t && lo == items) lo = i;
            if (owner > t) { hi = i; break; }
            acc_cost += cst;
        }
        for (int64_t i = lo; i < hi; i++) {
            const int64_t c = chunk[i], p = panel[i], pn = item_panels(len[c], p, np);
            const int64_t nc = N - p * NR < pn * NR ? N - p * NR : pn * NR;
            const float *xs[CHUNK];
            float *ys[CHUNK], ss[CHUNK];
            for (int64_t m = 0; m < len[c]; m++) {
                xs[m] = xrows[first[c] + m];
                ys[m] = yrows[first[c] + m] + p * NR;
                ss[m] = scale ? scale[first[c] + m] : 1.0f;
            }
            const float *w = W + mat[c] * msize + p * K * NR, *next = w;
            /* the next panel this thread reads that is not this one (a panel's other row chunks come next) */
            for (int64_t n = i + 1; n < hi && next == w; n++) next = W + mat[chunk[n]] * msize + panel[n] * K * NR;
            tile_any((int)len[c], (int)pn, xs, w, K, ys, ss, nc, acc, next);
        }
    }
}

/* out[m] = 1 / sqrt(sum_k x[m][k]^2 + c) for M rows of K (row stride ldx). */
int k3_row_inv_norm(const float *x, int64_t ldx, int64_t M, int64_t K, float c, float *out) {
    for (int64_t m = 0; m < M; m++) {
        out[m] = 1.0f / sqrtf(sumsq_f(x + m * ldx, K) + c);
    }
    return 0;
}

/* Items in matrix order, then panel, then the matrix's chunks (a panel's chunks run back to back on
 * one thread; a chunk of few rows takes its panels in groups, group_panels); chunks of one matrix are
 * consecutive in mat. Returns the item count. */
static int64_t order_items(int64_t nchunks, const int64_t *len, const int64_t *mat, int64_t np, int64_t *chunk,
                           int64_t *panel) {
    int64_t i = 0;
    for (int64_t b = 0; b < nchunks;) {
        int64_t n = 1;
        while (b + n < nchunks && mat[b + n] == mat[b]) n++;
        for (int64_t p = 0; p < np; p++)
            for (int64_t c = b; c < b + n; c++) {
                if (p % group_panels(len[c])) continue;   /* the group that starts before p covers it */
                chunk[i] = c; panel[i] = p; i++;
            }
        b += n;
    }
    return i;
}

/* y [M, N] (row stride ldy) (+)= n(x) @ W, x [M, K] (row stride ldx), W one packed matrix; with
 * norm_c >= 0, n(x_m) = x_m / sqrt(sum_k x_mk^2 + norm_c) (the RMSNorm of the decode step, whose
 * weight and sqrt(K) are in W), applied to the product; else n(x) = x.
 * Returns -1 when memory for the work lists is not there. */
int k3_packed_mm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *W, int64_t N, float *y,
                 int64_t ldy, int acc, float norm_c, int nthreads) {
    if (M <= 0) return 0;
    const int64_t nchunks = (M + CHUNK - 1) / CHUNK, np = (N + NR - 1) / NR;
    const float **xr = malloc(sizeof *xr * M);
    float **yr = malloc(sizeof *yr * M);
    float *scale = norm_c >= 0 ? malloc(sizeof *scale * M) : NULL;
    int64_t *meta = malloc(sizeof *meta * (3 * nchunks + 2 * nchunks * np));
    if (!xr || !yr || !meta || (norm_c >= 0 && !scale)) {
        free(xr); free(yr); free(meta); free(scale);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) { xr[m] = x + m * ldx; yr[m] = y + m * ldy; }
    if (scale) k3_row_inv_norm(x, ldx, M, K, norm_c, scale);
    int64_t *first = meta, *len = meta + nchunks, *mat = meta + 2 * nchunks;
    int64_t *chunk = meta + 3 * nchunks, *panel = chunk + nchunks * np;
    for (int64_t c = 0; c < nchunks; c++) {
        first[c] = c * CHUNK;
        len[c] = M - c * CHUNK < CHUNK ? M - c * CHUNK : CHUNK;
        mat[c] = 0;
    }
    int64_t items = order_items(nchunks, len, mat, np, chunk, panel);
    run(xr, yr, scale, first, len, mat, items, chunk, panel, K, W, N, acc, nthreads);
    free(xr); free(yr); free(meta); free(scale);
    return 0;
}

/* Slot s: y[s] = x[rows[s]] @ W[experts[s]] (x: R rows of stride ldx; W: E packed matrices; y: [S, N]
 * contiguous). Slots are grouped by expert (stably), so each expert's panels are read once per CHUNK of
 * its slots. Returns 1 when a row index is outside [0, R), 2 when an expert index is outside [0, E),
 * -1 when memory for the work lists is not there. */
int k3_packed_rows_mm(const float *x, int64_t ldx, int64_t R, const int64_t *rows, const int64_t *experts,
                      int64_t S, int64_t K, const float *W, int64_t N, int64_t E, float *y, int nthreads) {
    for (int64_t s = 0; s < S; s++) {
        if (rows[s] < 0 || rows[s] >= R) return 1;
        if (experts[s] < 0 || experts[s] >= E) return 2;
    }
    if (S <= 0) return 0;
    const int64_t np = (N + NR - 1) / NR;   /* S slots make at most S chunks */
    int64_t *count = calloc((size_t)E + 1, sizeof *count);
    const float **xr = malloc(sizeof *xr * S);
    float **yr = malloc(sizeof *yr * S);
    int64_t *meta = malloc(sizeof *meta * (4 * S + 2 * S * np));
    if (!count || !xr || !yr || !meta) { free(count); free(xr); free(yr); free(meta); return -1; }
    int64_t *order = meta, *first = meta + S, *len = meta + 2 * S, *mat = meta + 3 * S;
    int64_t *chunk = meta + 4 * S, *panel = chunk + S * np;
    for (int64_t s = 0; s < S; s++) count[experts[s] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];        /* count[e]: first slot of e */
    for (int64_t s = 0; s < S; s++) order[count[experts[s]]++] = s;  /* count[e] now: end of e */
    for (int64_t j = 0; j < S; j++) { xr[j] = x + rows[order[j]] * ldx; yr[j] = y + order[j] * N; }
    int64_t nchunks = 0;
    for (int64_t e = 0, start = 0; e < E; start = count[e], e++)
        for (int64_t j = start; j < count[e]; j += CHUNK) {
            first[nchunks] = j;
            len[nchunks] = count[e] - j < CHUNK ? count[e] - j : CHUNK;
            mat[nchunks++] = e;
        }
    int64_t items = order_items(nchunks, len, mat, np, chunk, panel);
    run(xr, yr, NULL, first, len, mat, items, chunk, panel, K, W, N, 0, nthreads);
    free(count); free(xr); free(yr); free(meta);
    return 0;
}
