/* Multi-head latent attention of one new token in the absorbed form (DeepSeek-V2/V3, Kimi-K2: models/mla.py).
 *
 * Per head h: q_lat = K_b[h] q_nope[h] (K_b[h] is [L][nope]), scores over the cached positions
 * s_t = scale (q_lat . c_t + q_pe[h] . kpe_t), p = softmax(s), o_lat = sum_t p_t c_t, out[h] = V_b[h] o_lat
 * (V_b[h] is [vd][L]). The up-projections are bf16 or float32 (w_type), or the caller's (held at a quantized file's
 * bits: the query comes in absorbed and the latent output goes out), the cache float32, bf16 or f16 (kv_type);
 * everything accumulates in float32. One task per group of MLA_HEADS heads on the lane pool: the decode step
 * runs here instead of as ~10 torch ops whose threads would compete with the pool's. */
#include "internal.h"

#define MLA_HEADS 4
#define MLA_BAND_MAX 16    /* heads a task at most: their scores and sums stay in this core's caches */
#define MLA_MAX_KEY 1024 /* latent + rotary values of a key scored from a float tile on the stack */
#define MLA_ROW_BLOCK 128  /* attended rows a block (128 KB of a 512-value bf16 latent): the band's heads share it */
#define EXPF_ZERO_BELOW -104.0f /* expf(x) is +0 for every x below about -103.97 */
_Static_assert(MLA_HEADS == 4, "dots() and latent_out() hold four heads' accumulators");

typedef struct {
    const float *q_nope, *q_pe; /* [H][nope], [H][R] */
    const void *k_b, *v_b;      /* [H][L][nope], [H][vd][L] */
    const void *lat, *kpe;      /* [rows][L], [rows][R] */
    const int64_t *rows;        /* the S cache rows attended, in order (NULL: rows 0..S-1) */
    int64_t s, h, L, R, nope, vd;
    int w_type, kv_type; /* MS_KV_F32, MS_KV_BF16 or MS_KV_F16 */
    float scale;
    float *out;   /* [H][vd] */
    int64_t band; /* heads a task, a multiple of MLA_HEADS */
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
/* lane 4 i + r of the result = the sum of the 16 lanes of v[4 r + i]: sixteen sums in a tree of 15 adds and 30
 * shuffles, instead of 16 reductions of a vector each */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int m = 0; m < 8; m++) /* 256-bit halves: lanes 0-7 hold v[2m]'s partial sums, 8-15 v[2m + 1]'s */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++) /* 128-bit quarter q holds v[4m + q]'s four partial sums */
        x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++) /* quarter q: two partial sums of v[8m + q], then two of v[8m + 4 + q] */
        y[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q] */
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* sixteen dot products of four rows against MLA_HEADS queries over two segments (a row's [a | a2] against a query's
 * [b | b2]; n2 may be 0): lane 4 i + r = sum_j a[off[r] + j] b[i * stride + j] + the same over a2, b2. Each row
 * chunk converted once for the four queries and each query chunk loaded once for the four rows; n, n2 multiples
 * of 16 */
static inline __attribute__((always_inline)) __m512 dots4x4_of(const void *a, const void *a2, const int type,
                                                              const int64_t off[4], const int64_t off2[4],
                                                              const float *b, const float *b2, int64_t stride,
                                                              int64_t stride2, int64_t n, int64_t n2) {
    __m512 acc[16];
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    for (int seg = 0; seg < 2; seg++) {
        const void *rows = seg ? a2 : a;
        const int64_t *o = seg ? off2 : off, len = seg ? n2 : n, st = seg ? stride2 : stride;
        const float *q0 = seg ? b2 : b;
        for (int64_t j = 0; j < len; j += 16) {
            __m512 k[4];
            /* each row chunk and each query chunk loaded once into a register: the compiler would fold one of
             * the two into every FMA, four loads where one does */
            for (int r = 0; r < 4; r++) {
                k[r] = at16(rows, type, o[r] + j);
                __asm__("" : "+v"(k[r]));
            }
            for (int i = 0; i < MLA_HEADS; i++) {
                __m512 q = _mm512_loadu_ps(q0 + i * st + j);
                __asm__("" : "+v"(q));
                for (int r = 0; r < 4; r++) acc[4 * r + i] = _mm512_fmadd_ps(k[r], q, acc[4 * r + i]);
            }
        }
    }
    return sum16(acc);
}

/* dots4x4_of compiled once per cache type, so that no type test sits in its loop */
static __m512 dots4x4(const void *a, const void *a2, int type, const int64_t off[4], const int64_t off2[4],
                      const float *b, const float *b2, int64_t stride, int64_t stride2, int64_t n, int64_t n2) {
    if (type == MS_KV_BF16) return dots4x4_of(a, a2, MS_KV_BF16, off, off2, b, b2, stride, stride2, n, n2);
    if (type == MS_KV_F16) return dots4x4_of(a, a2, MS_KV_F16, off, off2, b, b2, stride, stride2, n, n2);
    return dots4x4_of(a, a2, MS_KV_F32, off, off2, b, b2, stride, stride2, n, n2);
}
#endif

/* the cache row the t-th attended key is (rows: the indexer's choice, NULL: every row in order) */
static inline int64_t row_of(const int64_t *rows, int64_t t) { return rows ? rows[t] : t; }

#ifdef MS_VNNI
/* the next four chosen rows' latents and rotary keys on their way to this core's cache: chosen rows lie apart,
 * where the hardware prefetcher does not follow */
static inline void prefetch_rows(const mla_ctx *c, int64_t t) {
    const int64_t size = c->kv_type == MS_KV_F32 ? 4 : 2;
    for (int r = 0; r < 4; r++) {
        const char *lat = (const char *)c->lat + c->rows[t + r] * c->L * size;
        const char *kpe = (const char *)c->kpe + c->rows[t + r] * c->R * size;
        for (int64_t b = 0; b < c->L * size; b += 64) _mm_prefetch(lat + b, _MM_HINT_T0);
        for (int64_t b = 0; b < c->R * size; b += 64) _mm_prefetch(kpe + b, _MM_HINT_T0);
    }
}
#endif

/* sc[i][t] = scale (q_lat[i] . c_t + q_pe[h0 + i] . kpe_t) for the B heads of a band from h0 (rows S apart in
 * sc): one shared key [c_t | kpe_t] for every head. Four rows at a time are converted to float once, then scored
 * against the band's heads four at a time. */
static void scores(const mla_ctx *c, const float *qlat, int64_t h0, int64_t B, float *sc) {
    const int64_t L = c->L, R = c->R, S = c->s, K = L + R;
    int64_t t = 0;
#ifdef MS_VNNI
    if (L % 16 == 0 && R % 16 == 0 && K <= MLA_MAX_KEY) {
        float tile[4 * MLA_MAX_KEY] __attribute__((aligned(64)));
        const int64_t ol[4] = {0, K, 2 * K, 3 * K}, orr[4] = {L, K + L, 2 * K + L, 3 * K + L};
        const __m512 scale = _mm512_set1_ps(c->scale);
        for (; t + 4 <= S; t += 4) {
            if (c->rows && t + 12 <= S) prefetch_rows(c, t + 8);
            for (int r = 0; r < 4; r++) {
                const int64_t row = row_of(c->rows, t + r);
                for (int64_t j = 0; j < L; j += 16) _mm512_store_ps(tile + r * K + j, at16(c->lat, c->kv_type, row * L + j));
                for (int64_t j = 0; j < R; j += 16) _mm512_store_ps(tile + r * K + L + j, at16(c->kpe, c->kv_type, row * R + j));
            }
            int64_t g = 0;
            for (; g + MLA_HEADS <= B; g += MLA_HEADS) {
                const __m512 d = _mm512_mul_ps(
                    dots4x4(tile, tile, MS_KV_F32, ol, orr, qlat + g * L, c->q_pe + (h0 + g) * R, L, R, L, R), scale);
                /* quarter i: head g + i's scores of the four rows */
                _mm_storeu_ps(sc + g * S + t, _mm512_extractf32x4_ps(d, 0));
                _mm_storeu_ps(sc + (g + 1) * S + t, _mm512_extractf32x4_ps(d, 1));
                _mm_storeu_ps(sc + (g + 2) * S + t, _mm512_extractf32x4_ps(d, 2));
                _mm_storeu_ps(sc + (g + 3) * S + t, _mm512_extractf32x4_ps(d, 3));
            }
            for (; g < B; g++)
                for (int r = 0; r < 4; r++)
                    sc[g * S + t + r] = (dot(tile, MS_KV_F32, r * K, qlat + g * L, L, 0) +
                                         dot(tile, MS_KV_F32, r * K + L, c->q_pe + (h0 + g) * R, R, 0)) * c->scale;
        }
    }
#endif
    for (; t < S; t++) {
        const int64_t row = row_of(c->rows, t);
        for (int64_t i = 0; i < B; i++)
            sc[i * S + t] = (dot(c->lat, c->kv_type, row * L, qlat + i * L, L, 0) +
                             dot(c->kpe, c->kv_type, row * R, c->q_pe + (h0 + i) * R, R, 0)) * c->scale;
    }
}

#ifdef MS_VNNI
/* olat[i][j0 .. j0 + 16 W) += sum_t p[i][t] c_t[...] over t in [t0, t1) for MLA_HEADS heads: the 4 W sums stay
 * in registers over the rows (in the order of t, axpy's sums to the bit) and each c_t chunk is converted once
 * for the heads */
#define LATENT_BLOCK(W)                                                                                            \
    static inline __attribute__((always_inline)) void latent_block##W##_of(                                        \
        const mla_ctx *c, const int type, const float *p, int64_t t0, int64_t t1, int64_t j0, float *olat) {       \
        const int64_t L = c->L, S = c->s;                                                                      \
        __m512 acc[MLA_HEADS][W];                                                                                \
        for (int i = 0; i < MLA_HEADS; i++)                                                                      \
            for (int w = 0; w < W; w++) acc[i][w] = _mm512_loadu_ps(olat + i * L + j0 + 16 * w);                \
        for (int64_t t = t0; t < t1; t++) {                                                                      \
            const int64_t off = row_of(c->rows, t) * L + j0;                                                     \
            __m512 k[W];                                                                                          \
            for (int w = 0; w < W; w++) k[w] = at16(c->lat, type, off + 16 * w);                                 \
            for (int i = 0; i < MLA_HEADS; i++) {                                                                \
                const __m512 pv = _mm512_set1_ps(p[i * S + t]);                                                  \
                for (int w = 0; w < W; w++) acc[i][w] = _mm512_fmadd_ps(pv, k[w], acc[i][w]);                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < MLA_HEADS; i++)                                                                      \
            for (int w = 0; w < W; w++) _mm512_storeu_ps(olat + i * L + j0 + 16 * w, acc[i][w]);                 \
    }                                                                                                             \
    static void latent_block##W(const mla_ctx *c, const float *p, int64_t t0, int64_t t1, int64_t j0, float *olat) { \
        if (c->kv_type == MS_KV_BF16) latent_block##W##_of(c, MS_KV_BF16, p, t0, t1, j0, olat);                  \
        else if (c->kv_type == MS_KV_F16) latent_block##W##_of(c, MS_KV_F16, p, t0, t1, j0, olat);               \
        else latent_block##W##_of(c, MS_KV_F32, p, t0, t1, j0, olat);                                            \
    }
LATENT_BLOCK(4)
LATENT_BLOCK(1)
#endif

/* olat[i] += sum_t p[i][t] c_t over t in [t0, t1) for G <= MLA_HEADS heads, in the order of t (axpy's sums) */
static void latent_out(const mla_ctx *c, const float *p, int64_t G, int64_t t0, int64_t t1, float *olat) {
    const int64_t L = c->L, S = c->s;
#ifdef MS_VNNI
    if (G == MLA_HEADS && L % 16 == 0) {
        int64_t j = 0;
        for (; j + 64 <= L; j += 64) latent_block4(c, p, t0, t1, j, olat);
        for (; j < L; j += 16) latent_block1(c, p, t0, t1, j, olat);
        return;
    }
#endif
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < G; i++) axpy(p[i * S + t], c->lat, c->kv_type, row_of(c->rows, t) * L, olat + i * L, L);
}

#ifdef MS_VNNI
/* e^x for x <= 0 within 2 ulp (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n); +0 below
 * -104, where expf is +0 too */
static inline __m512 exp_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXPF_ZERO_BELOW));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* softmax of a head's scores in place */
static void softmax(float *p, int64_t S) {
    float mx = -INFINITY, sum = 0;
    int64_t t = 0;
#ifdef MS_VNNI
    __m512 m = _mm512_set1_ps(-INFINITY), acc = _mm512_setzero_ps();
    for (; t + 16 <= S; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + t));
    mx = _mm512_reduce_max_ps(m);
    for (int64_t u = t; u < S; u++) mx = fmaxf(mx, p[u]);
    const __m512 mv = _mm512_set1_ps(mx);
    for (t = 0; t + 16 <= S; t += 16) {
        const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(p + t), mv));
        _mm512_storeu_ps(p + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#else
    for (; t < S; t++) mx = fmaxf(mx, p[t]);
    t = 0;
#endif
    for (; t < S; t++) {
        const float d = p[t] - mx;
        sum += (p[t] = d < EXPF_ZERO_BELOW ? 0.0f : expf(d));
    }
    for (t = 0; t < S; t++) p[t] /= sum;
}

/* olat[i] = the attention output in the latent space of the band's B heads from b0 (their absorbed queries in
 * qlat [B][L]) over c's rows; sc holds [B][S] scores */
static void attend_band(const mla_ctx *c, const float *qlat, int64_t b0, int64_t B, float *sc, float *olat) {
    const int64_t L = c->L, S = c->s;
    scores(c, qlat, b0, B, sc);
    for (int64_t i = 0; i < B; i++) softmax(sc + i * S, S);
    memset(olat, 0, sizeof(float) * (size_t)(B * L));
    for (int64_t t0 = 0; t0 < S; t0 += MLA_ROW_BLOCK) {
        const int64_t t1 = t0 + MLA_ROW_BLOCK < S ? t0 + MLA_ROW_BLOCK : S;
        for (int64_t g = 0; g < B; g += MLA_HEADS)
            latent_out(c, sc + g * S, B - g < MLA_HEADS ? B - g : MLA_HEADS, t0, t1, olat + g * L);
    }
}

/* A task is a band of heads. Its heads go over the attended rows a block at a time, so that a block read into
 * this core's cache serves every head of the band instead of being read again for each group of MLA_HEADS. */
static void mla_task(void *vctx, int64_t band) {
    mla_ctx *c = vctx;
    const int64_t L = c->L, S = c->s, b0 = band * c->band;
    const int64_t B = c->h - b0 < c->band ? c->h - b0 : c->band;
    float *buf = malloc(sizeof(float) * (size_t)(B * (2 * L + S)));
    if (!buf) {
        atomic_store(&c->rc, MS_NO_MEM);
        return;
    }
    float *qlat = buf, *olat = buf + B * L, *sc = buf + 2 * B * L;
    if (!c->k_b) { /* the caller absorbed the query and takes the latent outputs (quantized up-projections) */
        attend_band(c, c->q_nope + b0 * L, b0, B, sc, c->out + b0 * L);
        free(buf);
        return;
    }
    for (int64_t i = 0; i < B; i++) { /* the query absorbed into the latent space */
        const float *qn = c->q_nope + (b0 + i) * c->nope;
        for (int64_t l = 0; l < L; l++) qlat[i * L + l] = dot(c->k_b, c->w_type, ((b0 + i) * L + l) * c->nope, qn, c->nope, 1);
    }
    attend_band(c, qlat, b0, B, sc, olat);
    for (int64_t i = 0; i < B; i++) { /* and up to the head's values */
        float *o = c->out + (b0 + i) * c->vd;
        for (int64_t r = 0; r < c->vd; r++) o[r] = dot(c->v_b, c->w_type, ((b0 + i) * c->vd + r) * L, olat + i * L, L, 1);
    }
    free(buf);
}

/* k_b and v_b both NULL: q_nope is the absorbed query [H][L] (nope == L) and out the latent output [H][L]
 * (vd == L), the up-projections being the caller's (held at their file's bits: ms_qmm_groups) */
int ms_mla_decode(const float *q_nope, const float *q_pe, const void *k_b, const void *v_b, int w_type,
                  const void *lat, const void *kpe, int kv_type, const int64_t *rows, int64_t n_rows, int64_t s,
                  int64_t h, int64_t L, int64_t R, int64_t nope, int64_t vd, float scale, float *out) {
    if (!dim_ok(s) || !dim_ok(h) || !dim_ok(L) || !dim_ok(R) || !dim_ok(nope) || !dim_ok(vd) || !dim_ok(n_rows))
        return MS_BAD_SHAPE;
    if (!prod_ok(h, L) || !prod_ok(h, vd) || !prod_ok(h * L, nope) || !prod_ok(h * vd, L) || !prod_ok(n_rows, L) ||
        !prod_ok(n_rows, R) || !prod_ok(2 * L + s, MLA_BAND_MAX))
        return MS_BAD_SHAPE;
    if (!kv_type_ok(w_type) || !kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!q_nope || !q_pe || !k_b != !v_b || !lat || !kpe || !out) return MS_BAD_PTR;
    if (!k_b && (nope != L || vd != L)) return MS_BAD_SHAPE; /* latent in, latent out */
    if (!rows && s > n_rows) return MS_BAD_SHAPE;
    for (int64_t t = 0; rows && t < s; t++)
        if (rows[t] < 0 || rows[t] >= n_rows) return MS_BAD_SHAPE;
    /* bands as wide as the threads allow, so that each thread reads the attended rows as few times as it can */
    const int64_t per_thread = (h + ms_internal_threads() - 1) / ms_internal_threads();
    int64_t band = (per_thread + MLA_HEADS - 1) / MLA_HEADS * MLA_HEADS;
    band = band > MLA_BAND_MAX ? MLA_BAND_MAX : band;
    mla_ctx c = {q_nope, q_pe, k_b, v_b, lat, kpe, rows, s, h, L, R, nope, vd, w_type, kv_type, scale, out, band,
                 MS_OK};
    ms_internal_dispatch(mla_task, &c, (h + band - 1) / band);
    return atomic_load(&c.rc);
}

/* Several queries of a prompt, each over its own chosen rows (DeepSeek Sparse Attention's prefill): o_lat[t][h] =
 * sum_s softmax_s(scale (q_lat[t][h] . c_s + q_pe[t][h] . kpe_s)) c_s over rows[t][0 .. counts[t]). The absorbed
 * queries come in and the latent outputs go out (the up-projections are matmuls of every query at once, done by
 * the caller). A task is one query's band of heads. */
typedef struct {
    mla_ctx base;
    const float *q_lat; /* [T][H][L] */
    const int64_t *rows, *counts; /* [T][K], [T] */
    int64_t k;
    float *o_lat; /* [T][H][L] */
} sparse_ctx;

static void sparse_task(void *vctx, int64_t task) {
    sparse_ctx *sp = vctx;
    const int64_t H = sp->base.h, L = sp->base.L, R = sp->base.R, bands = (H + sp->base.band - 1) / sp->base.band;
    const int64_t t = task / bands, b0 = task % bands * sp->base.band;
    const int64_t B = H - b0 < sp->base.band ? H - b0 : sp->base.band;
    mla_ctx c = sp->base;
    c.rows = sp->rows + t * sp->k, c.s = sp->counts[t], c.q_pe = sp->base.q_pe + t * H * R;
    float *sc = malloc(sizeof(float) * (size_t)(B * c.s));
    if (!sc) {
        atomic_store(&sp->base.rc, MS_NO_MEM);
        return;
    }
    attend_band(&c, sp->q_lat + (t * H + b0) * L, b0, B, sc, sp->o_lat + (t * H + b0) * L);
    free(sc);
}

int ms_mla_sparse(const float *q_lat, const float *q_pe, const void *lat, const void *kpe, int kv_type,
                  const int64_t *rows, const int64_t *counts, int64_t n_rows, int64_t t, int64_t k, int64_t h,
                  int64_t L, int64_t R, float scale, float *o_lat) {
    if (!dim_ok(t) || !dim_ok(k) || !dim_ok(h) || !dim_ok(L) || !dim_ok(R) || !dim_ok(n_rows)) return MS_BAD_SHAPE;
    if (!prod_ok(t, k) || !prod_ok(t * h, L) || !prod_ok(t * h, R) || !prod_ok(n_rows, L) || !prod_ok(n_rows, R) ||
        !prod_ok(k, MLA_BAND_MAX))
        return MS_BAD_SHAPE;
    if (!kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!q_lat || !q_pe || !lat || !kpe || !rows || !counts || !o_lat) return MS_BAD_PTR;
    for (int64_t i = 0; i < t; i++) {
        if (counts[i] < 1 || counts[i] > k) return MS_BAD_SHAPE;
        for (int64_t j = 0; j < counts[i]; j++)
            if (rows[i * k + j] < 0 || rows[i * k + j] >= n_rows) return MS_BAD_SHAPE;
    }
    const int64_t band = h < MLA_BAND_MAX ? (h + MLA_HEADS - 1) / MLA_HEADS * MLA_HEADS : MLA_BAND_MAX;
    sparse_ctx sp = {{NULL, q_pe, NULL, NULL, lat, kpe, NULL, 0, h, L, R, 0, 0, MS_KV_F32, kv_type, scale, NULL, band,
                      MS_OK},
                     q_lat, rows, counts, k, o_lat};
    ms_internal_dispatch(sparse_task, &sp, t * ((h + band - 1) / band));
    return atomic_load(&sp.base.rc);
}

/* DeepSeek Sparse Attention's lightning indexer for one query (models/sparse_attention.py, index_scores):
 * out[t] = sum_h w[h] relu(scale q[h] . k_t) over keys [S][D] in the cache's type, the heads in order. Tasks of
 * INDEX_ROWS keys; four keys against four heads at a time where D is a multiple of 16. */
#define INDEX_ROWS 256

typedef struct {
    const float *q, *w; /* [H][D], [H] */
    const void *keys;   /* [S][D] */
    int64_t s, h, d;
    int kv_type;
    float scale;
    float *out; /* [S] */
} index_ctx;

static void index_task(void *vctx, int64_t task) {
    const index_ctx *c = vctx;
    const int64_t D = c->d, H = c->h, t0 = task * INDEX_ROWS;
    const int64_t t1 = t0 + INDEX_ROWS < c->s ? t0 + INDEX_ROWS : c->s;
    int64_t t = t0;
#ifdef MS_VNNI
    if (D % 16 == 0 && H % MLA_HEADS == 0 && D <= MLA_MAX_KEY) {
        float tile[4 * MLA_MAX_KEY] __attribute__((aligned(64)));
        const int64_t off[4] = {0, D, 2 * D, 3 * D};
        const __m512 scale = _mm512_set1_ps(c->scale), zero = _mm512_setzero_ps();
        for (; t + 4 <= t1; t += 4) {
            __m128 sum = _mm_setzero_ps();
            for (int r = 0; r < 4; r++)
                for (int64_t j = 0; j < D; j += 16) _mm512_store_ps(tile + r * D + j, at16(c->keys, c->kv_type, (t + r) * D + j));
            for (int64_t h = 0; h < H; h += MLA_HEADS) {
                /* lane 4 i + r: head h + i's relu(scale q . k) of row t + r, times the head's weight */
                const __m512 w = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                       _mm512_castps128_ps512(_mm_loadu_ps(c->w + h)));
                const __m512 d = dots4x4(tile, tile, MS_KV_F32, off, off, c->q + h * D, c->q, D, D, D, 0);
                const __m512 v = _mm512_mul_ps(w, _mm512_max_ps(_mm512_mul_ps(d, scale), zero));
                sum = _mm_add_ps(sum, _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(v, 0), _mm512_extractf32x4_ps(v, 1)),
                                                 _mm_add_ps(_mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3))));
            }
            _mm_storeu_ps(c->out + t, sum);
        }
    }
#endif
    for (; t < t1; t++) {
        float sum = 0;
        for (int64_t h = 0; h < H; h++) {
            const float v = c->scale * dot(c->keys, c->kv_type, t * D, c->q + h * D, D, 0);
            sum += c->w[h] * (v > 0 ? v : 0.0f);
        }
        c->out[t] = sum;
    }
}

int ms_index_scores(const float *q, const float *w, int64_t h, int64_t d, const void *keys, int kv_type, int64_t s,
                    float scale, float *out) {
    if (!dim_ok(s) || !dim_ok(h) || !dim_ok(d) || !prod_ok(s, d) || !prod_ok(h, d)) return MS_BAD_SHAPE;
    if (!kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (!q || !w || !keys || !out) return MS_BAD_PTR;
    index_ctx c = {q, w, keys, s, h, d, kv_type, scale, out};
    ms_internal_dispatch(index_task, &c, (s + INDEX_ROWS - 1) / INDEX_ROWS);
    return MS_OK;
}

/* The k largest of x[0..n) as their positions in ascending order (the indexer's choice, in the order the
 * attention reads the rows): the k-th largest value found by quickselect on a copy, then one pass in order
 * takes every larger value and as many equal ones as k leaves room for, the first positions first. A NaN
 * score has no place in an order: the call refuses it. */
int ms_topk_positions(const float *x, int64_t n, int64_t k, int64_t *out) {
    if (!dim_ok(n) || k < 1 || k > n) return MS_BAD_SHAPE;
    if (!x || !out) return MS_BAD_PTR;
    float *v = malloc(sizeof(float) * (size_t)n);
    if (!v) return MS_NO_MEM;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) {
            free(v);
            return MS_NOT_FINITE;
        }
        v[i] = x[i];
    }
    int64_t lo = 0, hi = n - 1, want = k - 1; /* v[want] once ordered largest first */
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const float tmp = v[i];
                v[i++] = v[j], v[j--] = tmp;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    const float kth = v[want];
    int64_t above = 0;
    for (int64_t i = 0; i < n; i++) above += x[i] > kth;
    int64_t ties = k - above, m = 0;
    for (int64_t i = 0; i < n && m < k; i++)
        if (x[i] > kth || (x[i] == kth && ties-- > 0)) out[m++] = i;
    free(v);
    return MS_OK;
}
