/* Multi-head latent attention of one new token in the absorbed form (DeepSeek-V2/V3, Kimi-K2: models/mla.py).
 *
 * Per head h: q_lat = K_b[h] q_nope[h] (K_b[h] is [L][nope]), scores over the cached positions
 * s_t = scale (q_lat . c_t + q_pe[h] . kpe_t), p = softmax(s), o_lat = sum_t p_t c_t, out[h] = V_b[h] o_lat
 * (V_b[h] is [vd][L]). The up-projections are bf16 or float32 (w_type), the cache float32, bf16 or f16 (kv_type);
 * everything accumulates in float32. One task per group of MLA_HEADS heads on the lane pool: the decode step
 * runs here instead of as ~10 torch ops whose threads would compete with the pool's. */
#include "internal.h"

#define MLA_HEADS 4
_Static_assert(MLA_HEADS == 4, "dots() and latent_out() hold four heads' accumulators");

typedef struct {
    const float *q_nope, *q_pe; /* [H][nope], [H][R] */
    const void *k_b, *v_b;      /* [H][L][nope], [H][vd][L] */
    const void *lat, *kpe;      /* [S][L], [S][R] */
    int64_t s, h, L, R, nope, vd;
    int w_type, kv_type; /* MS_KV_F32, MS_KV_BF16 or MS_KV_F16 */
    float scale;
    float *out; /* [H][vd] */
    _Atomic int rc;
} mla_ctx;

#ifdef MS_VNNI
static inline __m512 at16(const void *p, int type, int64_t i) {
    if (type == MS_KV_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (type == MS_KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* sum_j a[off + j] b[j] over n values; pf: a is a weight streamed from RAM, prefetched PF_DIST ahead (as the
 * lane kernels do: the hardware prefetcher alone streams it slower than this loop consumes it) */
static inline float dot(const void *a, int type, int64_t off, const float *b, int64_t n, int pf) {
    int64_t j = 0;
    float s = 0;
#ifdef MS_VNNI
    const int64_t size = type == MS_KV_F32 ? 4 : 2;
    const char *base = (const char *)a + off * size;
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        if (pf) _mm_prefetch(base + j * size + PF_DIST, PF_HINT);
        acc = _mm512_fmadd_ps(at16(a, type, off + j), _mm512_loadu_ps(b + j), acc);
    }
    s = _mm512_reduce_add_ps(acc);
#else
    (void)pf;
#endif
    for (; j < n; j++) s += kv_load1(a, type, off + j) * b[j];
    return s;
}

/* y[j] += p a[off + j] over n values */
static inline void axpy(float p, const void *a, int type, int64_t off, float *y, int64_t n) {
    int64_t j = 0;
#ifdef MS_VNNI
    __m512 pv = _mm512_set1_ps(p);
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(y + j, _mm512_fmadd_ps(pv, at16(a, type, off + j), _mm512_loadu_ps(y + j)));
#endif
    for (; j < n; j++) y[j] += p * kv_load1(a, type, off + j);
}

#ifdef MS_VNNI
/* sum_j a[off + j] b_i[j] for MLA_HEADS heads' b_i = b + i * stride at once, each in its own accumulator (the
 * FMAs of one head in the order dot() does them, so the sums are dot()'s to the bit), the shared row a converted
 * once for every head instead of once a head; n a multiple of 16 */
static inline void dots(const void *a, int type, int64_t off, const float *b, int64_t stride, int64_t n, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < n; j += 16) {
        __m512 k = at16(a, type, off + j);
        a0 = _mm512_fmadd_ps(k, _mm512_loadu_ps(b + j), a0);
        a1 = _mm512_fmadd_ps(k, _mm512_loadu_ps(b + stride + j), a1);
        a2 = _mm512_fmadd_ps(k, _mm512_loadu_ps(b + 2 * stride + j), a2);
        a3 = _mm512_fmadd_ps(k, _mm512_loadu_ps(b + 3 * stride + j), a3);
    }
    out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}
#endif

/* sc[i][t] = scale (q_lat[i] . c_t + q_pe[h0 + i] . kpe_t): one shared key [c_t | kpe_t] for every head */
static void scores(const mla_ctx *c, const float *qlat, int64_t h0, int64_t G, float *sc) {
    const int64_t L = c->L, R = c->R, S = c->s;
#ifdef MS_VNNI
    if (G == MLA_HEADS && L % 16 == 0 && R % 16 == 0) {
        float dl[MLA_HEADS], dr[MLA_HEADS];
        for (int64_t t = 0; t < S; t++) {
            dots(c->lat, c->kv_type, t * L, qlat, L, L, dl);
            dots(c->kpe, c->kv_type, t * R, c->q_pe + h0 * R, R, R, dr);
            for (int64_t i = 0; i < G; i++) sc[i * S + t] = (dl[i] + dr[i]) * c->scale;
        }
        return;
    }
#endif
    for (int64_t t = 0; t < S; t++)
        for (int64_t i = 0; i < G; i++)
            sc[i * S + t] = (dot(c->lat, c->kv_type, t * L, qlat + i * L, L, 0) +
                             dot(c->kpe, c->kv_type, t * R, c->q_pe + (h0 + i) * R, R, 0)) * c->scale;
}

/* olat[i] = sum_t p[i][t] c_t, in the order of t (axpy's sums to the bit), each c_t converted once for the G heads */
static void latent_out(const mla_ctx *c, const float *p, int64_t G, float *olat) {
    const int64_t L = c->L, S = c->s;
#ifdef MS_VNNI
    if (G == MLA_HEADS && L % 16 == 0) {
        for (int64_t t = 0; t < S; t++) {
            const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[S + t]);
            const __m512 p2 = _mm512_set1_ps(p[2 * S + t]), p3 = _mm512_set1_ps(p[3 * S + t]);
            float *y0 = olat, *y1 = olat + L, *y2 = olat + 2 * L, *y3 = olat + 3 * L;
            for (int64_t j = 0; j < L; j += 16) {
                __m512 k = at16(c->lat, c->kv_type, t * L + j);
                _mm512_storeu_ps(y0 + j, _mm512_fmadd_ps(p0, k, _mm512_loadu_ps(y0 + j)));
                _mm512_storeu_ps(y1 + j, _mm512_fmadd_ps(p1, k, _mm512_loadu_ps(y1 + j)));
                _mm512_storeu_ps(y2 + j, _mm512_fmadd_ps(p2, k, _mm512_loadu_ps(y2 + j)));
                _mm512_storeu_ps(y3 + j, _mm512_fmadd_ps(p3, k, _mm512_loadu_ps(y3 + j)));
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < S; t++)
        for (int64_t i = 0; i < G; i++) axpy(p[i * S + t], c->lat, c->kv_type, t * L, olat + i * L, L);
}

static void mla_task(void *vctx, int64_t g) {
    mla_ctx *c = vctx;
    const int64_t L = c->L, S = c->s, h0 = g * MLA_HEADS;
    const int64_t G = c->h - h0 < MLA_HEADS ? c->h - h0 : MLA_HEADS;
    float *buf = malloc(sizeof(float) * (size_t)(G * (2 * L + S)));
    if (!buf) {
        atomic_store(&c->rc, MS_NO_MEM);
        return;
    }
    float *qlat = buf, *olat = buf + G * L, *sc = buf + 2 * G * L;
    for (int64_t i = 0; i < G; i++) { /* the query absorbed into the latent space */
        const float *qn = c->q_nope + (h0 + i) * c->nope;
        for (int64_t l = 0; l < L; l++) qlat[i * L + l] = dot(c->k_b, c->w_type, ((h0 + i) * L + l) * c->nope, qn, c->nope, 1);
    }
    scores(c, qlat, h0, G, sc);
    for (int64_t i = 0; i < G; i++) {
        float *p = sc + i * S, mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t < S; t++) mx = fmaxf(mx, p[t]);
        for (int64_t t = 0; t < S; t++) sum += (p[t] = expf(p[t] - mx));
        for (int64_t t = 0; t < S; t++) p[t] /= sum;
    }
    memset(olat, 0, sizeof(float) * (size_t)(G * L));
    latent_out(c, sc, G, olat);
    for (int64_t i = 0; i < G; i++) { /* and up to the head's values */
        float *o = c->out + (h0 + i) * c->vd;
        for (int64_t r = 0; r < c->vd; r++) o[r] = dot(c->v_b, c->w_type, ((h0 + i) * c->vd + r) * L, olat + i * L, L, 1);
    }
    free(buf);
}

int ms_mla_decode(const float *q_nope, const float *q_pe, const void *k_b, const void *v_b, int w_type,
                  const void *lat, const void *kpe, int kv_type, int64_t s, int64_t h, int64_t L, int64_t R,
                  int64_t nope, int64_t vd, float scale, float *out) {
    if (!dim_ok(s) || !dim_ok(h) || !dim_ok(L) || !dim_ok(R) || !dim_ok(nope) || !dim_ok(vd)) return MS_BAD_SHAPE;
    if (!prod_ok(h, L) || !prod_ok(h, vd) || !prod_ok(h * L, nope) || !prod_ok(h * vd, L) || !prod_ok(s, L) || !prod_ok(s, R) || !prod_ok(2 * L + s, MLA_HEADS))
        return MS_BAD_SHAPE;
    if (!kv_type_ok(w_type) || !kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!q_nope || !q_pe || !k_b || !v_b || !lat || !kpe || !out) return MS_BAD_PTR;
    mla_ctx c = {q_nope, q_pe, k_b, v_b, lat, kpe, s, h, L, R, nope, vd, w_type, kv_type, scale, out, MS_OK};
    ms_internal_dispatch(mla_task, &c, (h + MLA_HEADS - 1) / MLA_HEADS);
    return atomic_load(&c.rc);
}
