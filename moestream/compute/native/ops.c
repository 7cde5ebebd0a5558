/* The decode step's small float32 ops: RMSNorm, a float32 gemv, RoPE, attention, the router's top-k and the
 * fused attention block. */
#include "internal.h"

/* The float vector the decode step's loops run on: 16 lanes with AVX-512, 8 with AVX2 + FMA; MS_VF unset
 * (scalar loops only) otherwise. */
#if defined(MS_VNNI)
#define MS_VF 16
typedef __m512 vf;
#define vf_zero _mm512_setzero_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_mul _mm512_mul_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_sum _mm512_reduce_add_ps
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(MS_AVX2_FMA)
#define MS_VF 8
typedef __m256 vf;
#define vf_zero _mm256_setzero_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_mul _mm256_mul_ps
#define vf_fmadd _mm256_fmadd_ps
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* ---------------------------------------------------------------------------------------------------- */
/* float32 helpers for the decode step's small ops (torch's dispatch per call costs more than a decode step's
 * small norms compute), and RMSNorm over a prompt span's rows on the lane pool */

/* rows [r0, r1) of out = x / sqrt(mean(x^2) + eps) * w, rows of `dim` floats (out may be x) */
static void rms_rows(const float *x, const float *w, int64_t r0, int64_t r1, int64_t dim, float eps, float *out) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        double ss = 0;
        int64_t i = 0;
#ifdef MS_VNNI
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= dim; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; i < dim; i++) ss += (double)xr[i] * xr[i];
        float scale = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (i = 0; i < dim; i++) o[i] = xr[i] * scale * w[i];
    }
}

static int rms_args_ok(const float *x, const float *w, int64_t rows, int64_t dim, const float *out) {
    if (!dim_ok(dim) || !count_ok(rows) || !prod_ok(rows, dim)) return MS_BAD_SHAPE;
    if (rows && (!x || !w || !out)) return MS_BAD_PTR;
    return MS_OK;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w on the caller's thread (the fused decode ops call it) */
int ms_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    int rc = rms_args_ok(x, w, rows, dim, out);
    if (rc == MS_OK) rms_rows(x, w, 0, rows, dim, eps, out);
    return rc;
}

/* Rows per task of ms_rms_norm_rows: enough floats that a task outweighs waking a worker. */
#define RMS_TASK_FLOATS 32768

typedef struct {
    const float *x, *w;
    int64_t rows, dim, per_task;
    float eps;
    float *out;
} rms_ctx;

static void rms_task(void *vctx, int64_t t) {
    const rms_ctx *c = vctx;
    const int64_t r0 = t * c->per_task, r1 = r0 + c->per_task < c->rows ? r0 + c->per_task : c->rows;
    rms_rows(c->x, c->w, r0, r1, c->dim, c->eps, c->out);
}

/* ms_rms_norm over the lane pool, for any number of rows (a prompt span's): each row computed as
 * ms_rms_norm computes it, so the bits do not depend on how many rows come in one call. */
int ms_rms_norm_rows(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    int rc = rms_args_ok(x, w, rows, dim, out);
    if (rc != MS_OK || rows == 0) return rc;
    rms_ctx c = {x, w, rows, dim, dim >= RMS_TASK_FLOATS ? 1 : RMS_TASK_FLOATS / dim, eps, out};
    ms_internal_dispatch(rms_task, &c, (rows + c.per_task - 1) / c.per_task);
    return MS_OK;
}

/* out[rows[i]] += y[i] * w[i] for i = 0 .. n - 1 in that order, rows of h floats, out having n_out rows: an
 * expert's weighted outputs added into its tokens' rows. The product is rounded before the add, as y * w and
 * then torch's index_add_ round it. One thread: torch's index_add_ wakes its thread pool for every call, which
 * costs more than the adds for the small row counts of a prompt's thousands of experts. */
int ms_add_weighted_rows(float *out, int64_t n_out, int64_t h, const int64_t *rows, const float *y, const float *w,
                         int64_t n) {
    if (!dim_ok(h) || !count_ok(n) || !count_ok(n_out) || !prod_ok(n_out, h) || !prod_ok(n, h)) return MS_BAD_SHAPE;
    if (n == 0) return MS_OK;
    if (!out || !rows || !y || !w) return MS_BAD_PTR;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= n_out) return MS_BAD_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        float *o = out + rows[i] * h;
        const float *yi = y + i * h, wi = w[i];
        for (int64_t j = 0; j < h; j++) {
            const float p = yi[j] * wi;
            o[j] += p;
        }
    }
    return MS_OK;
}

typedef struct {
    const float *w, *x;
    int64_t n, k, m;
    float *y;
} gemv_ctx;

#define GEMV_ROWS 16

static void gemv_task(void *vctx, int64_t t) {
    gemv_ctx *c = vctx;
    int64_t r0 = t * GEMV_ROWS, r1 = r0 + GEMV_ROWS < c->n ? r0 + GEMV_ROWS : c->n;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = c->w + r * c->k;
        for (int64_t i = 0; i < c->m; i++) {
            const float *xr = c->x + i * c->k;
            int64_t j = 0;
            float s = 0;
#ifdef MS_VF
            vf acc = vf_zero();
            for (; j + MS_VF <= c->k; j += MS_VF) {
                if (i == 0) _mm_prefetch((const char *)(wr + j) + PF_DIST, PF_HINT);
                acc = vf_fmadd(vf_load(wr + j), vf_load(xr + j), acc);
            }
            s = vf_sum(acc);
#endif
            for (; j < c->k; j++) s += wr[j] * xr[j];
            c->y[i * c->n + r] = s;
        }
    }
}

/* y[m, n] = x[m, k] @ W.T for a float32 W [n, k], on the pool (routers: exact weights, read once per token) */
int ms_gemv_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    if (!dims_ok(n, k) || !count_ok(m) || !prod_ok(m, k) || !prod_ok(m, n)) return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    gemv_ctx c = {w, x, n, k, m, y};
    ms_internal_dispatch(gemv_task, &c, (n + GEMV_ROWS - 1) / GEMV_ROWS);
    return MS_OK;
}

typedef struct {
    const uint16_t *w;
    const float *x;
    int64_t n, k, m;
    float *y;
} gemv16_ctx;

static void gemv_bf16_task(void *vctx, int64_t t) {
    gemv16_ctx *c = vctx;
    int64_t r0 = t * GEMV_ROWS, r1 = r0 + GEMV_ROWS < c->n ? r0 + GEMV_ROWS : c->n;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = c->w + r * c->k;
        for (int64_t i = 0; i < c->m; i++) {
            const float *xr = c->x + i * c->k;
            int64_t j = 0;
            float s = 0;
#ifdef MS_VF
            vf acc = vf_zero();
            for (; j + MS_VF <= c->k; j += MS_VF) {
                if (i == 0) _mm_prefetch((const char *)(wr + j) + PF_DIST, PF_HINT);
                acc = vf_fmadd(vf_load_bf16(wr + j), vf_load(xr + j), acc);
            }
            s = vf_sum(acc);
#endif
            for (; j < c->k; j++) {
                uint32_t b = (uint32_t)wr[j] << 16;
                float wf;
                memcpy(&wf, &b, 4);
                s += wf * xr[j];
            }
            c->y[i * c->n + r] = s;
        }
    }
}

/* y[m, n] = x[m, k] @ W.T for a bf16 W [n, k] (a weight with no lane kernel, widened), on the pool: a decode
 * step's few rows then run beside the lane kernels instead of in torch's threads */
int ms_gemv_bf16(const uint16_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    if (!dims_ok(n, k) || !count_ok(m) || !prod_ok(m, k) || !prod_ok(m, n)) return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    gemv16_ctx c = {w, x, n, k, m, y};
    ms_internal_dispatch(gemv_bf16_task, &c, (n + GEMV_ROWS - 1) / GEMV_ROWS);
    return MS_OK;
}

/* NeoX rotary embedding in place: x [T][H][D] float32, the first rot dims rotated as two halves, with
 * cos/sin tables [T][rot/2] for the T positions. */
int ms_rope_neox(float *x, int64_t t, int64_t h, int64_t d, int64_t rot, const float *cosv, const float *sinv) {
    if (!count_ok(t) || !count_ok(h) || !dim_ok(d) || rot < 0 || rot > d || rot % 2) return MS_BAD_SHAPE;
    if (!prod_ok(t, h) || !prod_ok(t * h, d) || !prod_ok(t, rot)) return MS_BAD_SHAPE;
    if (t && h && (!x || !cosv || !sinv)) return MS_BAD_PTR;
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < t; i++) {
        const float *c = cosv + i * half, *s = sinv + i * half;
        for (int64_t j = 0; j < h; j++) {
            float *v = x + (i * h + j) * d;
            for (int64_t e = 0; e < half; e++) {
                float x1 = v[e], x2 = v[e + half];
                v[e] = x1 * c[e] - x2 * s[e];
                v[e + half] = x2 * c[e] + x1 * s[e];
            }
        }
    }
    return MS_OK;
}

/* Attention of one new token: q [H][D] float32 over keys/values [S][Hkv][D] (of the cache's
 * kv_type), query head i reading kv head i / (H / Hkv); out [H][D]. One task per kv head on the pool. */
typedef struct {
    const float *q;
    const void *k, *v;
    int64_t s, h, hkv, d;
    int kv_type;
    float scale;
    const float *sinks; /* [H] or NULL: a logit per query head that joins its softmax and carries no value */
    float *out;
    _Atomic int rc;
} attn_ctx;

/* row p of scores (s of them) made the softmax's probabilities; a sink joins the denominator only */
static inline void softmax_row(float *p, int64_t s, const float *sink) {
    float mx = sink ? *sink : -INFINITY, sum = 0;
    for (int64_t t = 0; t < s; t++) mx = fmaxf(mx, p[t]);
    if (sink) sum = expf(*sink - mx);
    for (int64_t t = 0; t < s; t++) sum += (p[t] = expf(p[t] - mx));
    for (int64_t t = 0; t < s; t++) p[t] /= sum;
}

#ifdef MS_VF
static inline vf kv_vec(const void *p, int kv_type, int64_t i) {
    if (kv_type == MS_KV_F16) return vf_load_f16((const uint16_t *)p + i);
    return kv_type == MS_KV_BF16 ? vf_load_bf16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

/* the same loops, MS_VF lanes at a time (d a multiple of MS_VF, at most 256) */
static void attn_task_simd(attn_ctx *c, int64_t g) {
    const int64_t rep = c->h / c->hkv, d = c->d, s = c->s, stride = c->hkv * d, nv = d / MS_VF;
    float *sc = malloc(sizeof(float) * (size_t)(rep * s));
    if (!sc) {
        atomic_store(&c->rc, MS_NO_MEM);
        return;
    }
    vf row[256 / MS_VF];
    for (int64_t t = 0; t < s; t++) {
        for (int64_t e = 0; e < nv; e++) row[e] = kv_vec(c->k, c->kv_type, t * stride + g * d + MS_VF * e);
        for (int64_t r = 0; r < rep; r++) {
            const float *q = c->q + (g * rep + r) * d;
            vf acc = vf_mul(vf_load(q), row[0]);
            for (int64_t e = 1; e < nv; e++) acc = vf_fmadd(vf_load(q + MS_VF * e), row[e], acc);
            sc[r * s + t] = vf_sum(acc) * c->scale;
        }
    }
    for (int64_t r = 0; r < rep; r++) softmax_row(sc + r * s, s, c->sinks ? c->sinks + g * rep + r : NULL);
    for (int64_t r = 0; r < rep; r++) {
        vf o[256 / MS_VF];
        for (int64_t e = 0; e < nv; e++) o[e] = vf_zero();
        for (int64_t t = 0; t < s; t++) {
            vf p = vf_set1(sc[r * s + t]);
            for (int64_t e = 0; e < nv; e++) o[e] = vf_fmadd(p, kv_vec(c->v, c->kv_type, t * stride + g * d + MS_VF * e), o[e]);
        }
        float *out = c->out + (g * rep + r) * d;
        for (int64_t e = 0; e < nv; e++) vf_store(out + MS_VF * e, o[e]);
    }
    free(sc);
}
#endif

static void attn_task(void *vctx, int64_t g) {
    attn_ctx *c = vctx;
#ifdef MS_VF
    if (c->d % MS_VF == 0 && c->d <= 256) {
        attn_task_simd(c, g);
        return;
    }
#endif
    const int64_t rep = c->h / c->hkv, d = c->d, s = c->s, stride = c->hkv * d;
    float *sc = malloc(sizeof(float) * (size_t)(rep * s + d));
    if (!sc) {
        atomic_store(&c->rc, MS_NO_MEM);
        return;
    }
    float *row = sc + rep * s;
    for (int64_t t = 0; t < s; t++) { /* scores */
        for (int64_t e = 0; e < d; e++) row[e] = kv_load1(c->k, c->kv_type, t * stride + g * d + e);
        for (int64_t r = 0; r < rep; r++) {
            const float *q = c->q + (g * rep + r) * d;
            float acc = 0;
            for (int64_t e = 0; e < d; e++) acc += q[e] * row[e];
            sc[r * s + t] = acc * c->scale;
        }
    }
    for (int64_t r = 0; r < rep; r++) { /* softmax */
        softmax_row(sc + r * s, s, c->sinks ? c->sinks + g * rep + r : NULL);
        float *o = c->out + (g * rep + r) * d;
        for (int64_t e = 0; e < d; e++) o[e] = 0;
    }
    for (int64_t t = 0; t < s; t++) { /* weighted values */
        for (int64_t e = 0; e < d; e++) row[e] = kv_load1(c->v, c->kv_type, t * stride + g * d + e);
        for (int64_t r = 0; r < rep; r++) {
            float p = sc[r * s + t], *o = c->out + (g * rep + r) * d;
            for (int64_t e = 0; e < d; e++) o[e] += p * row[e];
        }
    }
    free(sc);
}

int ms_attn_decode_sinks(const float *q, const void *k, const void *v, int64_t s, int64_t h, int64_t hkv,
                         int64_t d, int kv_type, float scale, const float *sinks, float *out) {
    if (!dim_ok(s) || !dim_ok(h) || !dim_ok(hkv) || !dim_ok(d) || h % hkv) return MS_BAD_SHAPE;
    if (!kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!prod_ok(s, hkv) || !prod_ok(s * hkv, d) || !prod_ok(h, d) || !prod_ok(s, h / hkv)) return MS_BAD_SHAPE;
    if (!q || !k || !v || !out) return MS_BAD_PTR;
    attn_ctx c = {q, k, v, s, h, hkv, d, kv_type, scale, sinks, out, MS_OK};
    ms_internal_dispatch(attn_task, &c, hkv);
    return atomic_load(&c.rc);
}

int ms_attn_decode(const float *q, const void *k, const void *v, int64_t s, int64_t h, int64_t hkv, int64_t d,
                   int kv_type, float scale, float *out) {
    return ms_attn_decode_sinks(q, k, v, s, h, hkv, d, kv_type, scale, NULL, out);
}

/* Router: per row of logits [T][E], softmax, the k largest (ties: lower id first), weights renormalised to
 * sum to 1 when norm. ids [T][k] int64 and weights [T][k] float32, largest first.
 * A row with a NaN/inf logit has no meaningful choice: it gets ids 0..k-1 and weights 0 (in bounds, the same
 * every time) and the call returns MS_NOT_FINITE, which the caller reports as a broken model file. */
int ms_route_topk(const float *logits, int64_t t, int64_t e, int64_t k, int norm, int64_t *ids, float *w) {
    if (!dim_ok(e) || k < 1 || k > e || !count_ok(t) || !prod_ok(t, e)) return MS_BAD_SHAPE;
    if (t == 0) return MS_OK;
    if (!logits || !ids || !w) return MS_BAD_PTR;
    float *p = malloc(sizeof(float) * (size_t)e);
    if (!p) return MS_NO_MEM;
    int rc = MS_OK;
    for (int64_t i = 0; i < t; i++) {
        const float *l = logits + i * e;
        int64_t *id = ids + i * k;
        float *wi = w + i * k, mx = -INFINITY, sum = 0, tot = 0;
        int finite = 1;
        for (int64_t j = 0; j < e; j++) {
            finite &= isfinite(l[j]) != 0;
            mx = fmaxf(mx, l[j]);
        }
        if (!finite) {
            for (int64_t r = 0; r < k; r++) id[r] = r, wi[r] = 0.0f;
            rc = MS_NOT_FINITE;
            continue;
        }
        /* finite logits: every p[j] is finite and >= 0 and the max is 1, so each pass finds an expert */
        for (int64_t j = 0; j < e; j++) sum += (p[j] = expf(l[j] - mx));
        for (int64_t j = 0; j < e; j++) p[j] /= sum;
        for (int64_t r = 0; r < k; r++) { /* k passes: k is small (8) */
            int64_t best = -1;
            for (int64_t j = 0; j < e; j++)
                if (p[j] >= 0 && (best < 0 || p[j] > p[best])) best = j;
            if (best < 0) best = r; /* unreachable (k <= e); keeps the index in bounds regardless */
            id[r] = best;
            wi[r] = p[best];
            tot += p[best];
            p[best] = -1.0f;
        }
        if (norm)
            for (int64_t r = 0; r < k; r++) wi[r] /= tot;
    }
    free(p);
    return rc;
}

/* A whole grouped-query attention block for one decode token (qwen3moe): RMSNorm of x, the fused q|k|v
 * projection, RMSNorm of each q and k head, NeoX RoPE at `pos`, k and v appended to the layer's cache at
 * `pos`, attention over positions 0..pos, the output projection. out [hidden] is the block's output (the
 * caller adds the residual). Projections are in the lane layout; the cache's values are of kv_type.
 * One C call instead of ~15 torch ops, each of which costs more in dispatch here than its arithmetic. */
int ms_attn_block_decode(const float *x, const float *norm_w, int64_t hidden, float eps, int qkv_type,
                         const uint8_t *qkv_w, const float *q_norm, const float *k_norm, int64_t n_heads,
                         int64_t n_kv, int64_t head_dim, const float *cosv, const float *sinv, int64_t rot,
                         void *k_cache, void *v_cache, int kv_type, int64_t pos, int o_type, const uint8_t *o_w,
                         float *out) {
    return ms_attn_block_decode_rows(1, x, norm_w, hidden, eps, qkv_type, qkv_w, q_norm, k_norm, n_heads, n_kv,
                                     head_dim, &cosv, &sinv, rot, &k_cache, &v_cache, kv_type, &pos, o_type, o_w,
                                     out);
}

/* The same block for b decode tokens of b sequences at once (batched decode): row i has its own cache
 * (k_cache[i], v_cache[i]), position pos[i] and rope rows (cosv[i], sinv[i]). The projections run once on
 * all b rows (each weight read once a step); the lane kernels compute every row as they would alone, and
 * every other step is per row, so row i's result equals a call of ms_attn_block_decode for it alone. */
int ms_attn_block_decode_rows(int64_t b, const float *x, const float *norm_w, int64_t hidden, float eps,
                              int qkv_type, const uint8_t *qkv_w, const float *q_norm, const float *k_norm,
                              int64_t n_heads, int64_t n_kv, int64_t head_dim, const float *const *cosv,
                              const float *const *sinv, int64_t rot, void *const *k_cache, void *const *v_cache,
                              int kv_type, const int64_t *pos, int o_type, const uint8_t *o_w, float *out) {
    if (!dim_ok(hidden) || !dim_ok(n_heads) || !dim_ok(n_kv) || !dim_ok(head_dim) || n_heads % n_kv) return MS_BAD_SHAPE;
    if (b < 1 || b > 4096 || !prod_ok(n_heads, head_dim) || rot < 0 || rot > head_dim || rot % 2) return MS_BAD_SHAPE;
    if (!kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!x || !norm_w || !qkv_w || !q_norm || !k_norm || !cosv || !sinv || !k_cache || !v_cache || !pos || !o_w || !out)
        return MS_BAD_PTR;
    const int64_t nq = n_heads * head_dim, nkv = n_kv * head_dim, nqkv = nq + 2 * nkv;
    for (int64_t r = 0; r < b; r++) {
        if (pos[r] < 0 || !prod_ok(pos[r] + 1, nkv)) return MS_BAD_SHAPE;
        if (!cosv[r] || !sinv[r] || !k_cache[r] || !v_cache[r]) return MS_BAD_PTR;
    }
    if (!prod_ok(b, hidden + nqkv + nq)) return MS_BAD_SHAPE;
    float *buf = malloc(sizeof(float) * (size_t)(b * (hidden + nqkv + nq)));
    if (!buf) return MS_NO_MEM;
    float *xn = buf, *qkv_all = xn + b * hidden, *att_all = qkv_all + b * nqkv;
    int rc = ms_rms_norm(x, norm_w, b, hidden, eps, xn);
    if (rc == MS_OK) rc = ms_qmm(qkv_type, qkv_w, nqkv, hidden, xn, b, hidden, qkv_all, nqkv);
    for (int64_t r = 0; r < b && rc == MS_OK; r++) {
        float *q = qkv_all + r * nqkv, *k = q + nq, *v = k + nkv, *att = att_all + r * nq;
        const int64_t p = pos[r];
        rc = ms_rms_norm(q, q_norm, n_heads, head_dim, eps, q);
        if (rc == MS_OK) rc = ms_rms_norm(k, k_norm, n_kv, head_dim, eps, k);
        if (rc == MS_OK) rc = ms_rope_neox(q, 1, n_heads, head_dim, rot, cosv[r], sinv[r]);
        if (rc == MS_OK) rc = ms_rope_neox(k, 1, n_kv, head_dim, rot, cosv[r], sinv[r]);
        if (rc != MS_OK) break;
        for (int64_t i = 0; i < nkv; i++) {
            kv_store1(k_cache[r], kv_type, p * nkv + i, k[i]);
            kv_store1(v_cache[r], kv_type, p * nkv + i, v[i]);
        }
        rc = ms_attn_decode(q, k_cache[r], v_cache[r], p + 1, n_heads, n_kv, head_dim, kv_type,
                            1.0f / sqrtf((float)head_dim), att);
    }
    if (rc == MS_OK) rc = ms_qmm(o_type, o_w, hidden, nq, att_all, b, nq, out, hidden);
    free(buf);
    return rc;
}
