/* The Gated DeltaNet's delta rule over a prompt: models/deltanet.py's chunk_delta_rule (the same algebra, the
 * same chunks of 64 tokens), key heads spread over the pool's threads: the value heads that read a key head
 * share its chunk's K K^T and Q K^T.
 *
 * Per head and chunk of C tokens (cum: the chunk's running sum of the log gates g):
 *   A[i][j] = beta_i (k_i . k_j) exp(cum_i - cum_j), j < i            (strictly lower)
 *   [U | W] = (I + A)^-1 [beta v | beta exp(cum) k]                   (forward substitution, 4 rows a block)
 *   V' = U - W S;   O = exp(cum) q S + tril((q k^T) exp(cum_i - cum_j)) V'
 *   S  = exp(cum_C) S + (k exp(cum_C - cum))^T V'
 * torch runs these as ~30 small ops a chunk, each a pass over memory with its own dispatch; here a head's chunk
 * stays in L2 and every product is one register-blocked loop (gemm.h). */
#include "internal.h"
#include "gemm.h"

#define DR_CHUNK 64

/* y[n] += a x[n] */
static inline void axpy(int n, float a, const float *x, float *y) {
    for (int j = 0; j < n; j += 8) st8(y + j, fma8(bc8(a), ld8(x + j), ld8(y + j)));
}

/* y[n] = a x[n] */
static inline void scale_to(int n, float a, const float *x, float *y) {
    for (int j = 0; j < n; j += 8) st8(y + j, bc8(a) * ld8(x + j));
}

/* Where each buffer of a task's scratch starts, in floats: a key head's chunk (Q, K, K^T, K K^T, Q K^T), then a
 * value head's. KK and QK, and Y and O, are adjacent (one memset clears each pair). */
typedef struct {
    int64_t Q, K, KT, KK, QK, X, Y, O, Qd, KDT, D, A, cum, ec, total;
} dr_layout;

static dr_layout dr_plan(int64_t dk, int64_t dv) {
    const int64_t C = DR_CHUNK;
    dr_layout l;
    int64_t at = 0;
    l.Q = at, at += C * dk;
    l.K = at, at += C * dk;
    l.KT = at, at += dk * C;
    l.KK = at, at += C * C;
    l.QK = at, at += C * C;
    l.X = at, at += C * (dv + dk);
    l.Y = at, at += C * dv;
    l.O = at, at += C * dv;
    l.Qd = at, at += C * dk;
    l.KDT = at, at += dk * C;
    l.D = at, at += C * C;
    l.A = at, at += C * C;
    l.cum = at, at += C;
    l.ec = at, at += C;
    l.total = at;
    return l;
}

typedef struct {
    int64_t T, Hk, Hv, dk, dv, ldqk;
    const float *q, *k, *v, *g, *beta;
    float *S, *out;
    float *scratch; /* lay.total floats per task */
    dr_layout lay;
    int tasks;
} dr_ctx;

/* The key head's part of a chunk, tokens [t0, t0 + n), n <= C, which its value heads share: Q, K (rows past n
 * zero, as torch pads them), K^T, and the products K K^T and Q K^T on and below the diagonal. */
static void dr_keys(const dr_ctx *c, float *scr, int64_t kh, int64_t t0, int n) {
    const int C = DR_CHUNK, dk = (int)c->dk;
    const dr_layout *l = &c->lay;
    float *Q = scr + l->Q, *K = scr + l->K, *KT = scr + l->KT, *KK = scr + l->KK, *QK = scr + l->QK;
    for (int i = 0; i < C; i++) {
        float *qi = Q + i * dk, *ki = K + i * dk;
        if (i < n) {
            memcpy(qi, c->q + (t0 + i) * c->ldqk + kh * dk, (size_t)dk * 4);
            memcpy(ki, c->k + (t0 + i) * c->ldqk + kh * dk, (size_t)dk * 4);
        } else {
            memset(qi, 0, (size_t)dk * 4);
            memset(ki, 0, (size_t)dk * 4);
        }
        for (int p = 0; p < dk; p++) KT[p * C + i] = ki[p];
    }
    memset(KK, 0, (size_t)2 * C * C * 4);
    gemm_acc(C, C, dk, K, dk, KT, C, KK, C, 1);
    gemm_acc(C, C, dk, Q, dk, KT, C, QK, C, 1);
}

/* Value head h's part of the chunk dr_keys prepared: its state S goes from the chunk's start to its end. */
static void dr_values(const dr_ctx *c, float *scr, int64_t h, int64_t t0, int n) {
    const int C = DR_CHUNK, dk = (int)c->dk, dv = (int)c->dv, ldx = dv + dk;
    const int64_t Hv = c->Hv;
    const dr_layout *l = &c->lay;
    const float *Q = scr + l->Q, *K = scr + l->K, *KT = scr + l->KT, *KK = scr + l->KK, *QK = scr + l->QK;
    float *X = scr + l->X, *Y = scr + l->Y, *O = scr + l->O, *Qd = scr + l->Qd, *KDT = scr + l->KDT;
    float *D = scr + l->D, *A = scr + l->A, *cum = scr + l->cum, *ec = scr + l->ec;
    float *S = c->S + h * dk * dv;

    float run = 0;
    for (int i = 0; i < C; i++) {
        float *xi = X + i * ldx;
        if (i < n) {
            const int64_t t = t0 + i;
            const float b = c->beta[t * Hv + h];
            run += c->g[t * Hv + h];
            cum[i] = run;
            ec[i] = expf(run);
            scale_to(dv, b, c->v + (t * Hv + h) * dv, xi);     /* beta v */
            scale_to(dk, b, K + i * dk, xi + dv);               /* beta k, then exp(cum) beta k */
            for (int p = 0; p < dk; p += 8) st8(xi + dv + p, bc8(ec[i]) * ld8(xi + dv + p));
        } else {
            memset(xi, 0, (size_t)ldx * 4);
            cum[i] = run;
            ec[i] = expf(run);
        }
    }
    /* D: minus A (strictly lower); A: the decayed causal scores of Q K^T (lower, with the diagonal) */
    for (int i = 0; i < C; i++) {
        const float b = i < n ? c->beta[(t0 + i) * Hv + h] : 0.0f;
        for (int j = 0; j < C; j++) {
            const float decay = j <= i ? expf(cum[i] - cum[j]) : 0.0f;
            D[i * C + j] = j < i ? -(b * KK[i * C + j]) * decay : 0.0f;
            A[i * C + j] = QK[i * C + j] * decay;
        }
    }
    /* forward substitution, 4 rows a block: the rows before the block in one product, then within it */
    for (int i0 = 0; i0 < C; i0 += 4) {
        if (i0) gemm_acc(4, ldx, i0, D + i0 * C, C, X, ldx, X + i0 * ldx, ldx, 0);
        for (int r = 1; r < 4; r++)
            for (int s = 0; s < r; s++) axpy(ldx, D[(i0 + r) * C + i0 + s], X + (i0 + s) * ldx, X + (i0 + r) * ldx);
    }
    /* Y = W S; O = (exp(cum) q) S */
    for (int i = 0; i < C; i++) scale_to(dk, ec[i], Q + i * dk, Qd + i * dk);
    memset(Y, 0, (size_t)2 * C * dv * 4);
    gemm_acc(C, dv, dk, X + dv, ldx, S, dv, Y, dv, 0);
    gemm_acc(C, dv, dk, Qd, dk, S, dv, O, dv, 0);
    /* V' = U - W S, in X's first dv columns */
    for (int i = 0; i < C; i++)
        for (int j = 0; j < dv; j += 8) st8(X + i * ldx + j, ld8(X + i * ldx + j) - ld8(Y + i * dv + j));
    /* O += A V', each block of rows against the rows of V' up to its last */
    for (int i0 = 0; i0 < C; i0 += 4) gemm_acc(4, dv, i0 + 4, A + i0 * C, C, X, ldx, O + i0 * dv, dv, 0);
    for (int i = 0; i < n; i++) memcpy(c->out + ((t0 + i) * Hv + h) * dv, O + i * dv, (size_t)dv * 4);
    /* S = exp(cum_C) S + (k exp(cum_C - cum))^T V' */
    const float last = cum[C - 1];
    for (int i = 0; i < C; i++) {
        const float e = expf(last - cum[i]);
        for (int p = 0; p < dk; p++) KDT[p * C + i] = KT[p * C + i] * e;
    }
    const float el = expf(last);
    for (int64_t j = 0; j < (int64_t)dk * dv; j += 8) st8(S + j, bc8(el) * ld8(S + j));
    gemm_acc(dk, dv, C, KDT, C, X, ldx, S, dv, 0);
}

/* task t: key heads t, t + tasks, ...; each chunk's key part once for all the value heads that read it */
static void dr_task(void *vctx, int64_t t) {
    const dr_ctx *c = vctx;
    float *scr = c->scratch + t * c->lay.total;
    for (int64_t kh = t; kh < c->Hk; kh += c->tasks)
        for (int64_t t0 = 0; t0 < c->T; t0 += DR_CHUNK) {
            const int n = c->T - t0 < DR_CHUNK ? (int)(c->T - t0) : DR_CHUNK;
            dr_keys(c, scr, kh, t0, n);
            for (int64_t h = kh; h < c->Hv; h += c->Hk) dr_values(c, scr, h, t0, n);
        }
}

/* The delta rule over T tokens: q, k [T][*] with key head j's dk values at row offset j * dk (rows ldqk floats
 * apart; value head h reads key head h % Hk), v [T][Hv][dv], g and beta [T][Hv], S [Hv][dk][dv] (updated in
 * place), out [T][Hv][dv]. dk and dv multiples of 8. */
int ms_delta_rule(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, const float *q, const float *k,
                  int64_t ldqk, const float *v, const float *g, const float *beta, float *S, float *out) {
    if (!count_ok(T) || Hk < 1 || Hv < 1 || Hv % Hk || dk < 8 || dv < 8 || dk % 8 || dv % 8 || dk > 4096 ||
        dv > 4096 || ldqk < Hk * dk || !prod_ok(T, ldqk) || !prod_ok(T * Hv, dv) || !prod_ok(Hv * dk, dv))
        return MS_BAD_SHAPE;
    if (T == 0) return MS_OK;
    if (!q || !k || !v || !g || !beta || !S || !out) return MS_BAD_PTR;
    const int threads = ms_internal_threads();
    const int tasks = (int)(Hk < threads ? Hk : threads);
    dr_ctx c = {T, Hk, Hv, dk, dv, ldqk, q, k, v, g, beta, S, out, NULL, dr_plan(dk, dv), tasks};
    c.scratch = malloc((size_t)(tasks * c.lay.total) * sizeof(float));
    if (!c.scratch) return MS_NO_MEM;
    ms_internal_dispatch(dr_task, &c, tasks);
    free(c.scratch);
    return MS_OK;
}

/* ---------------------------------------------------------------------------------------------------- */
/* the causal depthwise convolution before it */

typedef struct {
    const float *buf, *wt;
    float *out;
    int64_t T, C, K, per;
} conv_ctx;

static void conv_task(void *vctx, int64_t task) {
    const conv_ctx *c = vctx;
    const int64_t c0 = task * c->per, c1 = c0 + c->per < c->C ? c0 + c->per : c->C;
    for (int64_t t = 0; t < c->T; t++) {
        float *o = c->out + t * c->C;
        int64_t ch = c0;
        for (; ch + 8 <= c1; ch += 8) {
            v8 s = ld8(c->buf + t * c->C + ch) * ld8(c->wt + ch);
            for (int64_t j = 1; j < c->K; j++)
                s = fma8(ld8(c->buf + (t + j) * c->C + ch), ld8(c->wt + j * c->C + ch), s);
            st8(o + ch, s);
        }
        for (; ch < c1; ch++) {
            float s = c->buf[t * c->C + ch] * c->wt[ch];
            for (int64_t j = 1; j < c->K; j++) s = fma1(c->buf[(t + j) * c->C + ch], c->wt[j * c->C + ch], s);
            o[ch] = s;
        }
    }
}

/* out[t][c] = sum_j buf[t + j][c] wt[j][c] for t < T: buf [T + K - 1][C] (the K - 1 kept inputs, then the new
 * ones), wt [K][C] (the filter, transposed). Channels spread over the pool. */
int ms_causal_conv(const float *buf, int64_t T, int64_t C, int64_t K, const float *wt, float *out) {
    if (!count_ok(T) || !dim_ok(C) || K < 1 || K > 64 || !prod_ok(T + K, C)) return MS_BAD_SHAPE;
    if (T == 0) return MS_OK;
    if (!buf || !wt || !out) return MS_BAD_PTR;
    const int64_t tasks = T * C < 65536 ? 1 : 4 * ms_internal_threads();
    conv_ctx c = {buf, wt, out, T, C, K, ((C + tasks - 1) / tasks + 7) / 8 * 8};
    ms_internal_dispatch(conv_task, &c, (C + c.per - 1) / c.per);
    return MS_OK;
}
