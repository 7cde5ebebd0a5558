/* moestream quantized matmul: y = x @ W.T with W kept at 4 or 8 bits (the lane layout, see internal.h), x
 * quantized to int8 per 32 values. Here: the activations, the entry points, the MoE FFN; the kernels are in
 * qmm_vnni.c and qmm_avx2.c. */
#include "internal.h"

/* ---------------------------------------------------------------------------------------------------- */
/* activations */

static size_t xprep_bytes(int64_t m, int64_t k) { return (size_t)(m * k + 5 * 4 * m * (k / 32) + 64); }

static void xprep_bind(xprep *x, void *mem, int64_t m, int64_t k) {
    uint8_t *p = mem;
    int64_t ns = m * (k / 32);
    x->dx = (float *)p;
    x->dxsx = x->dx + ns;
    x->n8sx = (int32_t *)(x->dxsx + ns);
    x->n32lo = x->n8sx + ns;
    x->n32hi = x->n32lo + ns;
    x->q = (int8_t *)(x->n32hi + ns);
}

/* x's rows from r on (rows of k values) */
static xprep xprep_from(const xprep *x, int64_t r, int64_t k) {
    int64_t ns = r * (k / 32);
    return (xprep){x->q + r * k, x->dx + ns, x->dxsx + ns, x->n8sx + ns, x->n32lo + ns, x->n32hi + ns};
}

/* A block's scale d and its inverse id. A block of subnormals (127 / amax overflows) quantizes to zeros. A
 * block holding NaN/inf is made zeros with a NaN scale by the caller: the product comes out NaN (reported
 * by the router check upstream) and the integer sums never overflow. */
static inline void block_scale(float amax, float *d, float *id) {
    *d = amax / 127.0f;
    *id = amax > 0 ? 127.0f / amax : 0.0f;
    if (*id > FLT_MAX) *d = *id = 0.0f;
}

/* block i's scale d and the sums of its quantized halves, in the forms the kernels' offset terms take */
static inline void put_block_sums(const xprep *r, int64_t i, float d, int lo_sum, int hi_sum) {
    const int sum = lo_sum + hi_sum;
    r->dx[i] = d;
    r->dxsx[i] = d * (float)sum;
    r->n8sx[i] = -8 * sum;
    r->n32lo[i] = -32 * lo_sum;
    r->n32hi[i] = -32 * hi_sum;
}

/* one row of x (K floats) -> int8 in lane step order */
#ifdef MS_VNNI
static void quantize_row(const float *x, int64_t k, const xprep *p, int64_t row) {
    const xprep r = xprep_from(p, row, k);
    int8_t *q = r.q;
    int64_t nsub = k / 32;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        for (int j = 0; j < L; j++) {
            const float *v = x + (s0 + j) * 32;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
            float d, id;
            block_scale(amax, &d, &id);
            __m512 idv = _mm512_set1_ps(id);
            __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
            /* NaN/inf converts to INT32_MIN, which no finite input reaches (|v * id| <= 127) */
            const __m512i nan_i = _mm512_set1_epi32(INT32_MIN);
            if (_mm512_cmpeq_epi32_mask(i0, nan_i) | _mm512_cmpeq_epi32_mask(i1, nan_i)) {
                i0 = i1 = _mm512_setzero_si512();
                d = NAN;
            }
            int lo_sum = _mm512_reduce_add_epi32(i0), hi_sum = _mm512_reduce_add_epi32(i1);
            __m128i lo = _mm512_cvtepi32_epi8(i0), hi = _mm512_cvtepi32_epi8(i1);
            int32_t *o = (int32_t *)q;
            o[0 * L + j] = _mm_extract_epi32(lo, 0);
            o[1 * L + j] = _mm_extract_epi32(hi, 0);
            o[2 * L + j] = _mm_extract_epi32(lo, 1);
            o[3 * L + j] = _mm_extract_epi32(hi, 1);
            o[4 * L + j] = _mm_extract_epi32(lo, 2);
            o[5 * L + j] = _mm_extract_epi32(hi, 2);
            o[6 * L + j] = _mm_extract_epi32(lo, 3);
            o[7 * L + j] = _mm_extract_epi32(hi, 3);
            put_block_sums(&r, s0 + j, d, lo_sum, hi_sum);
        }
        q += 32 * L;
    }
}
#elif defined(MS_AVX2_FMA)
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* as the VNNI version, 8 floats a register */
static void quantize_row(const float *x, int64_t k, const xprep *p, int64_t row) {
    const xprep r = xprep_from(p, row, k);
    int8_t *q = r.q;
    int64_t nsub = k / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i nan_i = _mm256_set1_epi32(INT32_MIN);
    /* the packed dwords (weights 8i..8i+3 at i, 8i+4..8i+7 at 4 + i) into step order (weights
     * 16 (s & 1) + 4 (s >> 1) .. + 3 at s) */
    const __m256i steps = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        for (int j = 0; j < L; j++) {
            const float *v = x + (s0 + j) * 32;
            __m256 a[4];
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                a[i] = _mm256_loadu_ps(v + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            float d, id;
            block_scale(amax, &d, &id);
            const __m256 idv = _mm256_set1_ps(id);
            __m256i qi[4], bad = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], idv));
                bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(qi[i], nan_i));
            }
            if (!_mm256_testz_si256(bad, bad)) { /* NaN/inf: zeros with a NaN scale */
                for (int i = 0; i < 4; i++) qi[i] = _mm256_setzero_si256();
                d = NAN;
            }
            int lo_sum = hsum_i32(_mm256_add_epi32(qi[0], qi[1])), hi_sum = hsum_i32(_mm256_add_epi32(qi[2], qi[3]));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            int32_t dw[8];
            _mm256_storeu_si256((__m256i *)dw, _mm256_permutevar8x32_epi32(bytes, steps));
            int32_t *o = (int32_t *)q;
            for (int s = 0; s < 8; s++) o[s * L + j] = dw[s];
            put_block_sums(&r, s0 + j, d, lo_sum, hi_sum);
        }
        q += 32 * L;
    }
}
#else
static void quantize_row(const float *x, int64_t k, const xprep *p, int64_t row) {
    const xprep r = xprep_from(p, row, k);
    int8_t *q = r.q;
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        for (int j = 0; j < L; j++) {
            const float *v = x + (s0 + j) * 32;
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d, id;
            block_scale(amax, &d, &id);
            int half[2] = {0, 0}, finite = 1;
            int8_t qq[32];
            for (int i = 0; i < 32; i++) finite &= fabsf(v[i] * id) <= 127.5f;
            if (!finite) { /* as the SIMD version: NaN/inf quantizes to zeros with a NaN scale */
                id = 0;
                d = NAN;
            }
            for (int i = 0; i < 32; i++) {
                int v8 = finite ? (int)lrintf(v[i] * id) : 0;
                qq[i] = (int8_t)v8;
                half[i >= 16] += v8;
            }
            for (int s = 0; s < 8; s++) memcpy(q + (s * L + j) * 4, qq + 16 * (s & 1) + 4 * (s >> 1), 4);
            put_block_sums(&r, s0 + j, d, half[0], half[1]);
        }
        q += 32 * L;
    }
}
#endif

/* ---------------------------------------------------------------------------------------------------- */
/* entry points */

/* Rows of W per task: a one-token job streams its rows once, so tasks are long; a many-token job computes
 * far longer per row, so shorter tasks keep the threads evenly loaded (an expert's 768 rows are 12 tasks, not
 * 3 for 2 threads). A multiple of the kernels' row tiles. */
#define ROWS_PER_TASK 256
#define ROWS_PER_TASK_MANY 64

static int64_t task_rows(const qmm_job *J) { return J->m == 1 ? ROWS_PER_TASK : ROWS_PER_TASK_MANY; }

typedef struct {
    const qmm_job *jobs;
    int njobs;
    int64_t *first_task; /* [njobs + 1] prefix sums of tasks per job */
} multi_ctx;

static void multi_task(void *vctx, int64_t t) {
#ifdef MS_LANE
    multi_ctx *c = vctx;
    int j = 0;
    while (c->first_task[j + 1] <= t) j++;
    const qmm_job *J = &c->jobs[j];
    int64_t r0 = (t - c->first_task[j]) * task_rows(J), r1 = r0 + task_rows(J);
    if (r1 > J->n) r1 = J->n;
    if (J->m == 1) ms_internal_qmv_rows(J, r0, r1);
    else ms_internal_qmm_rows(J, r0, r1);
#else
    (void)vctx;
    (void)t;
#endif
}

static void run_jobs(const qmm_job *jobs, int njobs) {
    int64_t first[njobs + 1];
    first[0] = 0;
    for (int j = 0; j < njobs; j++) first[j + 1] = first[j] + (jobs[j].n + task_rows(&jobs[j]) - 1) / task_rows(&jobs[j]);
    multi_ctx c = {jobs, njobs, first};
    ms_internal_dispatch(multi_task, &c, first[njobs]);
}

typedef struct {
    const float *x;
    int64_t k, ldx;
    xprep *xp;
} quant_ctx;

static void quant_task(void *vctx, int64_t t) {
    quant_ctx *c = vctx;
    const xprep *p = c->xp;
    quantize_row(c->x + t * c->ldx, c->k, p, t);
}

static _Thread_local void *scratch;
static _Thread_local size_t scratch_cap;

static void *scratch_get(size_t n) {
    if (n > scratch_cap) {
        free(scratch);
        scratch = NULL;
        scratch_cap = 0;
        if (posix_memalign(&scratch, 64, n) != 0) return NULL;
        scratch_cap = n;
    }
    return scratch;
}

/* Bytes of scratch a call with m rows of k (and for ms_moe_ffn, ffn f) holds while it runs. */
int64_t ms_qmm_scratch_bytes(int64_t m, int64_t k) {
    if (!count_ok(m) || !dim_ok(k) || !prod_ok(m, k)) return MS_BAD_SHAPE;
    return (int64_t)xprep_bytes(m, k);
}

/* y[m, n] = x[m, k] @ W.T for W in the lane layout. x rows are ldx floats apart, y rows ldy. */
int ms_qmm(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx, float *y,
           int64_t ldy) {
#ifndef MS_LANE
    (void)type; (void)w; (void)n; (void)k; (void)x; (void)m; (void)ldx; (void)y; (void)ldy;
    return MS_NO_SIMD;
#else
    if (super_bytes(type) < 0) return MS_BAD_TYPE;
    if (!dims_ok(n, k) || ms_lane_row_bytes(type, k) < 0 || !count_ok(m) || !prod_ok(m, ldx) || ldx < k || ldy < n)
        return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    void *mem = scratch_get(xprep_bytes(m, k));
    if (!mem) return MS_NO_MEM;
    xprep xp;
    xprep_bind(&xp, mem, m, k);
    quant_ctx qc = {x, k, ldx, &xp};
    ms_internal_dispatch(quant_task, &qc, m);
    qmm_job job = {type, w, n, k, &xp, m, y, ldy};
    run_jobs(&job, 1);
    return MS_OK;
#endif
}

/* Grouped products: y[g][t][0..n) = x[g][t][0..k) @ W_g.T for g < groups, t < m, where W_g is rows [g n, (g + 1) n)
 * of w (the per-head up-projections of latent attention: one matrix a head, each with its own inputs). x rows are
 * k floats, y rows n floats, both contiguous. All groups' rows run as one parallel pass. */
int ms_qmm_groups(int type, const uint8_t *w, int64_t groups, int64_t n, int64_t k, const float *x, int64_t m,
                  float *y) {
#ifndef MS_LANE
    (void)type; (void)w; (void)groups; (void)n; (void)k; (void)x; (void)m; (void)y;
    return MS_NO_SIMD;
#else
    if (super_bytes(type) < 0) return MS_BAD_TYPE;
    if (!count_ok(groups) || groups < 1 || groups > 4096 || !dims_ok(n, k) || !prod_ok(groups, n) ||
        ms_lane_row_bytes(type, k) < 0 || !count_ok(m) || !prod_ok(groups * m, k) || !prod_ok(groups * m, n))
        return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    void *mem = scratch_get(xprep_bytes(groups * m, k));
    if (!mem) return MS_NO_MEM;
    xprep xp;
    xprep_bind(&xp, mem, groups * m, k);
    quant_ctx qc = {x, k, k, &xp};
    ms_internal_dispatch(quant_task, &qc, groups * m);
    const int64_t rb = ms_lane_row_bytes(type, k);
    qmm_job *jobs = malloc(sizeof(qmm_job) * (size_t)groups);
    xprep *views = malloc(sizeof(xprep) * (size_t)groups);
    if (!jobs || !views) {
        free(jobs);
        free(views);
        return MS_NO_MEM;
    }
    for (int64_t g = 0; g < groups; g++) {
        views[g] = xprep_from(&xp, g * m, k);
        jobs[g] = (qmm_job){type, w + g * n * rb, n, k, &views[g], m, y + g * m * n, n};
    }
    run_jobs(jobs, (int)groups);
    free(jobs);
    free(views);
    return MS_OK;
#endif
}

/* A clamped SwiGLU: per-expert biases and the activation's constants; GPT-OSS's adds 1 to the clamped up
 * (up_shift 1), DeepSeek-V4's does not (up_shift 0, alpha 1, zero biases: silu(min(g, L)) * clamp(u, -L, L)) */
typedef struct {
    const float *const *b_gate, *const *b_up, *const *b_down;
    float alpha, limit, up_shift;
} clamp_act;

/* SwiGLU experts: for each expert e, out_e[m_e, h] = down_e(silu(gate_e(x_e)) * up_e(x_e)), where gate_up_e
 * holds the gate rows then the up rows ([2f, h], one type) and down_e is [h, f]. All experts' gate/up rows
 * run in one parallel pass, then all down rows in another (a decode step: one call per layer). */
typedef struct {
    float *act;      /* [sum m][2f] */
    int64_t f;
    const int64_t *row0; /* first row of expert e in act */
    xprep *xp;
    const clamp_act *clamp; /* NULL: the plain SwiGLU */
} swiglu_ctx;

static void swiglu_task(void *vctx, int64_t t) {
    swiglu_ctx *c = vctx;
    float *a = c->act + t * 2 * c->f;
    const clamp_act *k = c->clamp;
    if (!k) {
        for (int64_t i = 0; i < c->f; i++) {
            float g = a[i];
            a[i] = g / (1.0f + expf(-g)) * a[c->f + i];
        }
    } else {
        int e = 0;
        while (c->row0[e + 1] <= t) e++;
        const float *bg = k->b_gate[e], *bu = k->b_up[e];
        const float lim = k->limit, alpha = k->alpha, shift = k->up_shift;
        for (int64_t i = 0; i < c->f; i++) {
            /* written as comparisons so that NaN passes through, as torch's clamp lets it */
            float g = a[i] + bg[i], u = a[c->f + i] + bu[i];
            g = g > lim ? lim : g;
            u = u > lim ? lim : u < -lim ? -lim : u;
            float s = 1.0f / (1.0f + expf(-(g * alpha)));
            a[i] = g * s * (u + shift);
        }
    }
    const xprep *p = c->xp;
    quantize_row(a, c->f, p, t);
}

int64_t ms_moe_scratch_bytes(int64_t rows, int64_t h, int64_t f) {
    if (!count_ok(rows) || !dim_ok(h) || !dim_ok(f) || !prod_ok(rows, 2 * (h > f ? h : f))) return MS_BAD_SHAPE;
    return (int64_t)(xprep_bytes(rows, h) + xprep_bytes(rows, f) + (size_t)rows * 2 * f * 4 + 256);
}

/* Where the experts' input rows are: x[e], expert e's m[e] rows [m[e], h], quantized here; or, where idx is
 * given, row idx[r] of prep (nx rows of h, quantized once by ms_prep_rows) for the r-th row of all the
 * experts' rows in order: a prompt span quantizes each token once for its k experts, and a row's copy
 * replaces its quantization. */
typedef struct {
    const float *const *x;
    const xprep *prep;
    const int64_t *idx;
    int64_t nx;
} moe_rows;

typedef struct {
    const moe_rows *in;
    const int64_t *row0;
    int n_exp;
    int64_t h;
    xprep *xp;
} moe_quant_ctx;

/* row i of src into row t of dst (rows of k values): the same bytes quantize_row wrote there */
static void copy_prepped_row(const xprep *src, int64_t i, const xprep *dst, int64_t t, int64_t k) {
    const int64_t ns = k / 32;
    memcpy(dst->q + t * k, src->q + i * k, (size_t)k);
    memcpy(dst->dx + t * ns, src->dx + i * ns, (size_t)ns * sizeof(float));
    memcpy(dst->dxsx + t * ns, src->dxsx + i * ns, (size_t)ns * sizeof(float));
    memcpy(dst->n8sx + t * ns, src->n8sx + i * ns, (size_t)ns * sizeof(int32_t));
    memcpy(dst->n32lo + t * ns, src->n32lo + i * ns, (size_t)ns * sizeof(int32_t));
    memcpy(dst->n32hi + t * ns, src->n32hi + i * ns, (size_t)ns * sizeof(int32_t));
}

static void moe_quant_task(void *vctx, int64_t t) {
    moe_quant_ctx *c = vctx;
    const xprep *p = c->xp;
    if (c->in->idx) {
        copy_prepped_row(c->in->prep, c->in->idx[t], p, t, c->h);
        return;
    }
    int e = 0;
    while (c->row0[e + 1] <= t) e++;
    quantize_row(c->in->x[e] + (t - c->row0[e]) * c->h, c->h, p, t);
}

/* in: the experts' input rows (moe_rows; pointers may repeat for x: a decode step passes the same token to
 * every expert); out[e]: expert e's output rows [m[e], h]. */
static int moe_ffn_run(int n_exp, const int *type_gu, const uint8_t *const *w_gu, const int *type_d,
                       const uint8_t *const *w_d, int64_t h, int64_t f, const moe_rows *in, const int64_t *m,
                       float *const *out, const clamp_act *clamp) {
#ifndef MS_LANE
    (void)n_exp; (void)type_gu; (void)w_gu; (void)type_d; (void)w_d; (void)h; (void)f; (void)in; (void)m; (void)out;
    (void)clamp;
    return MS_NO_SIMD;
#else
    if (!dim_ok(h) || !dim_ok(f) || h % 32 || f % 32) return MS_BAD_SHAPE;
    if (n_exp < 1 || n_exp > 1024) return MS_BAD_SHAPE;
    if (!type_gu || !w_gu || !type_d || !w_d || !m || !out || (in->idx ? !in->prep : !in->x)) return MS_BAD_PTR;
    int64_t rows = 0, row0[n_exp + 1];
    for (int e = 0; e < n_exp; e++) {
        if (super_bytes(type_gu[e]) < 0 || super_bytes(type_d[e]) < 0) return MS_BAD_TYPE;
        if (ms_lane_row_bytes(type_gu[e], h) < 0 || ms_lane_row_bytes(type_d[e], f) < 0) return MS_BAD_SHAPE;
        if (!count_ok(m[e])) return MS_BAD_SHAPE;
        if (m[e] && (!w_gu[e] || !w_d[e] || !out[e] || (!in->idx && !in->x[e]))) return MS_BAD_PTR;
        if (m[e] && clamp && (!clamp->b_gate[e] || !clamp->b_up[e] || !clamp->b_down[e])) return MS_BAD_PTR;
        row0[e] = rows;
        rows += m[e];
    }
    row0[n_exp] = rows;
    if (rows < 1) return MS_OK;
    if (in->idx)
        for (int64_t r = 0; r < rows; r++)
            if (in->idx[r] < 0 || in->idx[r] >= in->nx) return MS_BAD_SHAPE;
    if (!prod_ok(rows, 2 * (h > f ? h : f))) return MS_BAD_SHAPE;
    uint8_t *mem = scratch_get(ms_moe_scratch_bytes(rows, h, f));
    if (!mem) return MS_NO_MEM;
    xprep xin, xact;
    xprep_bind(&xin, mem, rows, h);
    mem += (xprep_bytes(rows, h) + 63) / 64 * 64;
    xprep_bind(&xact, mem, rows, f);
    mem += (xprep_bytes(rows, f) + 63) / 64 * 64;
    float *act = (float *)mem;

    moe_quant_ctx qc = {in, row0, n_exp, h, &xin};
    ms_internal_dispatch(moe_quant_task, &qc, rows);

    qmm_job jobs[n_exp];
    xprep xins[n_exp], xacts[n_exp];
    int nj = 0;
    for (int e = 0; e < n_exp; e++) {
        if (!m[e]) continue;
        int64_t r = row0[e];
        xins[e] = xprep_from(&xin, r, h);
        jobs[nj++] = (qmm_job){type_gu[e], w_gu[e], 2 * f, h, &xins[e], m[e], act + r * 2 * f, 2 * f};
    }
    run_jobs(jobs, nj);

    swiglu_ctx sc = {act, f, row0, &xact, clamp};
    ms_internal_dispatch(swiglu_task, &sc, rows);

    nj = 0;
    for (int e = 0; e < n_exp; e++) {
        if (!m[e]) continue;
        int64_t r = row0[e];
        xacts[e] = xprep_from(&xact, r, f);
        jobs[nj++] = (qmm_job){type_d[e], w_d[e], h, f, &xacts[e], m[e], out[e], h};
    }
    run_jobs(jobs, nj);
    if (clamp)
        for (int e = 0; e < n_exp; e++)
            for (int64_t r = 0; r < m[e]; r++)
                for (int64_t i = 0; i < h; i++) out[e][r * h + i] += clamp->b_down[e][i];
    return MS_OK;
#endif
}

int ms_moe_ffn(int n_exp, const int *type_gu, const uint8_t *const *w_gu, const int *type_d, const uint8_t *const *w_d,
               int64_t h, int64_t f, const float *const *x, const int64_t *m, float *const *out) {
    const moe_rows in = {x, NULL, NULL, 0};
    return moe_ffn_run(n_exp, type_gu, w_gu, type_d, w_d, h, f, &in, m, out, NULL);
}

static int clamp_ok(const float *const *b_gate, const float *const *b_up, const float *const *b_down, float alpha,
                    float limit, float up_shift) {
    if (!b_gate || !b_up || !b_down) return MS_BAD_PTR;
    if (!isfinite(alpha) || !isfinite(limit) || limit < 0 || !isfinite(up_shift)) return MS_BAD_SHAPE;
    return MS_OK;
}

/* GPT-OSS's experts: as ms_moe_ffn, with per-expert biases (b_gate[e], b_up[e]: f floats; b_down[e]: h)
 * and the clamped activation: g = min(gate + b_gate, limit), u = clamp(up + b_up, -limit, limit),
 * out = down(g * sigmoid(alpha * g) * (u + up_shift)) + b_down (up_shift 1: GPT-OSS; 0: DeepSeek-V4). */
int ms_moe_ffn_clamped(int n_exp, const int *type_gu, const uint8_t *const *w_gu, const int *type_d,
                       const uint8_t *const *w_d, int64_t h, int64_t f, const float *const *x, const int64_t *m,
                       float *const *out, const float *const *b_gate, const float *const *b_up,
                       const float *const *b_down, float alpha, float limit, float up_shift) {
    const int rc = clamp_ok(b_gate, b_up, b_down, alpha, limit, up_shift);
    if (rc != MS_OK) return rc;
    clamp_act clamp = {b_gate, b_up, b_down, alpha, limit, up_shift};
    const moe_rows in = {x, NULL, NULL, 0};
    return moe_ffn_run(n_exp, type_gu, w_gu, type_d, w_d, h, f, &in, m, out, &clamp);
}

/* x [m, k] quantized once into prep (ms_qmm_scratch_bytes(m, k) bytes, 64-byte aligned), for
 * ms_moe_ffn_gather. */
int ms_prep_rows(const float *x, int64_t m, int64_t k, void *prep) {
#ifndef MS_LANE
    (void)x; (void)m; (void)k; (void)prep;
    return MS_NO_SIMD;
#else
    if (!count_ok(m) || !dim_ok(k) || k % 32 || !prod_ok(m, k)) return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!x || !prep || (uintptr_t)prep % 64) return MS_BAD_PTR;
    xprep xp;
    xprep_bind(&xp, prep, m, k);
    quant_ctx qc = {x, k, k, &xp};
    ms_internal_dispatch(quant_task, &qc, m);
    return MS_OK;
#endif
}

/* As ms_moe_ffn (b_gate NULL) or ms_moe_ffn_clamped, the inputs taken from prep (nx rows of h that
 * ms_prep_rows quantized): the r-th row of all the experts' rows in order is row idx[r] (each in [0, nx)). */
int ms_moe_ffn_gather(int n_exp, const int *type_gu, const uint8_t *const *w_gu, const int *type_d,
                      const uint8_t *const *w_d, int64_t h, int64_t f, const void *prep, int64_t nx,
                      const int64_t *idx, const int64_t *m, float *const *out, const float *const *b_gate,
                      const float *const *b_up, const float *const *b_down, float alpha, float limit,
                      float up_shift) {
    if (!prep || !idx || (uintptr_t)prep % 64) return MS_BAD_PTR;
    if (!count_ok(nx) || !dim_ok(h) || h % 32 || !prod_ok(nx, h)) return MS_BAD_SHAPE;
    xprep xp;
    xprep_bind(&xp, (void *)prep, nx, h);
    const moe_rows in = {NULL, &xp, idx, nx};
    if (!b_gate) return moe_ffn_run(n_exp, type_gu, w_gu, type_d, w_d, h, f, &in, m, out, NULL);
    const int rc = clamp_ok(b_gate, b_up, b_down, alpha, limit, up_shift);
    if (rc != MS_OK) return rc;
    clamp_act clamp = {b_gate, b_up, b_down, alpha, limit, up_shift};
    return moe_ffn_run(n_exp, type_gu, w_gu, type_d, w_d, h, f, &in, m, out, &clamp);
}
