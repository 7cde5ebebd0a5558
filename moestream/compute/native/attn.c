/* Causal attention of a prompt's queries over the cache, for every query chunk longer than one token (one token
 * runs ms_attn_decode): flash attention in float32, the query heads that read one key head stacked as the rows
 * of one product.
 *
 * The keys and values are first made float once a call, each block of AT_KEYS keys transposed as the product
 * reads it (the float copy the plan counts for a layer's attention). A task then takes a key head g and a block
 * of queries: its rows are (query, head of g's group), Q pre-scaled. It walks the keys in blocks from key 0
 * (boundaries at multiples of AT_KEYS, whatever the queries' positions), and per block:
 *   S = Q K^T                      (gemm_acc)
 *   masked: keys past a row's own position, or past the cache's end: -inf
 *   m' = max(m, max_j S), a = exp(m - m'), P = exp(S - m'), l = a l + sum_j P, O = a O + P V
 * and at the end out = O / l. A row's result depends only on its query and the keys it sees: not on the
 * other rows of its task, nor on how the caller cut the prompt into chunks. So a prompt span and the
 * micro-batches of the same tokens give the same bits, and AVX2 and AVX-512 do too (gemm.h; the sums of P
 * run over 8 lanes then a fixed tree in both). torch's SDPA, the path without this library, converts the whole
 * cache to float for every chunk. */
#include "internal.h"
#include "gemm.h"

#define AT_KEYS 64  /* keys a block */
#define AT_ROWS 64  /* rows a task aims for: queries x the heads of a group */
#define AT_MAX_D 512

typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of 8 floats: round(x log2 e) split off (Cody-Waite, two parts of ln 2), a degree-6 polynomial on the
 * rest, 2^n put into the exponent. Within ~2 ulp of expf over [-86, 0], the range softmax feeds it; below -86
 * it gives 0 (exp(-86) ~ 4e-38: nothing beside the row's largest term, which is 1). NaN stays NaN. Plain
 * vector arithmetic and fma8: the same bits at every width. */
static inline v8 exp8(v8 x) {
    const v8 lo = bc8(-86.0f), magic = bc8(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v8i under = x < lo;
    const v8 xc = (v8)((v8i)x & ~under) + (v8)((v8i)lo & under); /* x, or lo where x < lo (NaN kept) */
    const v8 t = fma8(xc, bc8(1.44269504088896341f), magic);
    const v8 n = t - magic;
    v8 r = fma8(n, bc8(-0.693359375f), xc);
    r = fma8(n, bc8(2.12194440e-4f), r);
    v8 p = bc8(1.9875691500e-4f);
    p = fma8(p, r, bc8(1.3981999507e-3f));
    p = fma8(p, r, bc8(8.3334519073e-3f));
    p = fma8(p, r, bc8(4.1665795894e-2f));
    p = fma8(p, r, bc8(1.6666665459e-1f));
    p = fma8(p, r, bc8(5.0000001201e-1f));
    p = fma8(p, r * r, r + bc8(1.0f));
    const v8i bits = (v8i)p + (((v8i)t - (v8i)magic) << 23);
    return (v8)(bits & ~under);
}

static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

typedef struct {
    const float *q;
    const void *k, *v;
    float *out;
    int64_t T, S, H, Hkv, D, pos;
    int kv_type;
    float scale;
    int64_t queries; /* a task's block of queries */
    int64_t blocks;  /* blocks of queries per key head */
    int64_t rows;    /* queries * heads a group, rounded up to 4 */
    int64_t key_blocks;
    float *KT;       /* [Hkv][key_blocks][D][AT_KEYS]: each block of keys transposed, as the product reads it */
    float *V;        /* [Hkv][key_blocks * AT_KEYS][D]; keys past the last query's position are 0 in both */
    int64_t scratch_floats;
    float *scratch;  /* scratch_floats a thread */
    _Atomic int64_t next;
} at_ctx;

/* item: key block kb of head g into KT and V, as floats. Keys no query sees (past the last query's position,
 * though the cache may hold more) are 0: a masked key's P is 0, and 0 x a NaN or inf left in the cache past
 * the prompt would make the row NaN. */
static void at_keys_task(void *vctx, int64_t item) {
    const at_ctx *c = vctx;
    const int64_t D = c->D, stride = c->Hkv * D, g = item / c->key_blocks, kb = item % c->key_blocks;
    float *KT = c->KT + item * D * AT_KEYS, *V = c->V + item * AT_KEYS * D;
    for (int j = 0; j < AT_KEYS; j++) {
        const int64_t s = kb * AT_KEYS + j;
        float *vr = V + j * D;
        if (s >= c->pos + c->T) {
            for (int64_t d = 0; d < D; d++) KT[d * AT_KEYS + j] = 0.0f;
            memset(vr, 0, (size_t)D * 4);
            continue;
        }
        const int64_t at = s * stride + g * D;
        for (int64_t d = 0; d < D; d++) KT[d * AT_KEYS + j] = kv_load1(c->k, c->kv_type, at + d);
        if (c->kv_type == MS_KV_F32)
            memcpy(vr, (const float *)c->v + at, (size_t)D * 4);
        else
            for (int64_t d = 0; d < D; d++) vr[d] = kv_load1(c->v, c->kv_type, at + d);
    }
}

static inline v8 max8(v8 a, v8 b) {
    const v8i gt = a > b;
    return (v8)(((v8i)a & gt) | ((v8i)b & ~gt));
}

/* One row's softmax step over a block of scores sc (visible: the first `seen` of them; the rest set to -inf):
 * sc becomes P, O is rescaled; m and l updated. */
static void softmax_step(float *sc, int seen, float *m, float *l, float *o, int64_t D) {
    for (int j = seen; j < AT_KEYS; j++) sc[j] = -INFINITY;
    v8 mx8 = ld8(sc);
    for (int j = 8; j < AT_KEYS; j += 8) mx8 = max8(mx8, ld8(sc + j));
    float mx = *m;
    for (int i = 0; i < 8; i++) mx = fmaxf(mx, mx8[i]);
    const float alpha = exp8(bc8(*m - mx))[0];
    v8 sum = bc8(0.0f);
    for (int j = 0; j < AT_KEYS; j += 8) {
        const v8 p = exp8(ld8(sc + j) - bc8(mx));
        st8(sc + j, p);
        sum += p;
    }
    *l = fma1(*l, alpha, hsum8(sum));
    *m = mx;
    if (alpha != 1.0f)
        for (int64_t d = 0; d < D; d += 8) st8(o + d, bc8(alpha) * ld8(o + d));
}

/* Queries [t0, t0 + n) of key head g. */
static void at_block(const at_ctx *c, float *scr, int64_t g, int64_t t0, int64_t n) {
    const int64_t D = c->D, rep = c->H / c->Hkv, M = c->rows;
    float *Q = scr, *O = Q + M * D, *P = O + M * D, *m = P + M * AT_KEYS, *l = m + M;
    for (int64_t i = 0; i < n; i++) {
        const float *qi = c->q + ((t0 + i) * c->H + g * rep) * D;
        for (int64_t e = 0; e < rep * D; e++) Q[i * rep * D + e] = qi[e] * c->scale;
    }
    memset(Q + n * rep * D, 0, (size_t)((M - n * rep) * D) * 4);
    memset(O, 0, (size_t)(M * D) * 4);
    for (int64_t r = 0; r < M; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const int64_t last = c->pos + t0 + n - 1; /* the last key any row sees */
    for (int64_t kb = 0; kb * AT_KEYS <= last; kb++) {
        const int64_t k0 = kb * AT_KEYS;
        const float *KT = c->KT + (g * c->key_blocks + kb) * D * AT_KEYS;
        const float *V = c->V + (g * c->key_blocks + kb) * AT_KEYS * D;
        memset(P, 0, (size_t)(M * AT_KEYS) * 4);
        gemm_acc((int)M, AT_KEYS, (int)D, Q, (int)D, KT, AT_KEYS, P, AT_KEYS, 0);
        for (int64_t r = 0; r < M; r++) {
            const int64_t i = r / rep < n ? r / rep : n - 1; /* padding rows follow the last query */
            int64_t seen = c->pos + t0 + i - k0 + 1;
            if (seen > AT_KEYS) seen = AT_KEYS;
            if (seen < 0) seen = 0;
            softmax_step(P + r * AT_KEYS, (int)seen, m + r, l + r, O + r * D, D);
        }
        gemm_acc((int)M, (int)D, AT_KEYS, P, AT_KEYS, V, (int)D, O, (int)D, 0);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < rep; r++) {
            const float *o = O + (i * rep + r) * D;
            float *out = c->out + ((t0 + i) * c->H + g * rep + r) * D;
            const v8 li = bc8(l[i * rep + r]);
            for (int64_t d = 0; d < D; d += 8) st8(out + d, ld8(o + d) / li);
        }
}

/* a thread: items taken in turn, the longest (last queries) first */
static void at_task(void *vctx, int64_t t) {
    at_ctx *c = vctx;
    float *scr = c->scratch + t * c->scratch_floats;
    const int64_t items = c->blocks * c->Hkv;
    for (int64_t it; (it = atomic_fetch_add(&c->next, 1)) < items;) {
        const int64_t b = c->blocks - 1 - it / c->Hkv, g = it % c->Hkv, t0 = b * c->queries;
        at_block(c, scr, g, t0, c->T - t0 < c->queries ? c->T - t0 : c->queries);
    }
}

/* out [T][H][D] = causal attention of q [T][H][D] (float32; query t at position pos + t) over keys and values
 * [S][Hkv][D] (of kv_type): query t sees keys 0 .. pos + t, and pos + T <= S. Scores
 * scaled by `scale`. D a multiple of 8, at most 512; H a multiple of Hkv. */
int ms_attn_prefill(const float *q, const void *k, const void *v, int64_t T, int64_t S, int64_t H, int64_t Hkv,
                    int64_t D, int64_t pos, int kv_type, float scale, float *out) {
    if (!count_ok(T) || !dim_ok(S) || !dim_ok(H) || !dim_ok(Hkv) || H % Hkv || D < 8 || D % 8 || D > AT_MAX_D ||
        pos < 0 || pos + T > S || !prod_ok(T, H) || !prod_ok(T * H, D) || !prod_ok(S + AT_KEYS, Hkv) ||
        !prod_ok((S + AT_KEYS) * Hkv, D))
        return MS_BAD_SHAPE;
    if (!kv_type_ok(kv_type)) return MS_BAD_TYPE;
    if (T == 0) return MS_OK;
    if (!q || !k || !v || !out) return MS_BAD_PTR;
    const int64_t rep = H / Hkv, queries = rep >= AT_ROWS ? 1 : AT_ROWS / rep;
    const int64_t rows = (queries * rep + 3) / 4 * 4, key_blocks = (pos + T + AT_KEYS - 1) / AT_KEYS;
    at_ctx c = {q, k, v, out, T, S, H, Hkv, D, pos, kv_type, scale, queries, (T + queries - 1) / queries,
                rows, key_blocks, NULL, NULL, 2 * rows * D + rows * AT_KEYS + 2 * rows, NULL, 0};
    const int64_t items = c.blocks * Hkv, threads = ms_internal_threads(), keys = key_blocks * AT_KEYS * D;
    const int tasks = (int)(items < threads ? items : threads);
    c.KT = malloc((size_t)(2 * Hkv * keys + tasks * c.scratch_floats) * sizeof(float));
    if (!c.KT) return MS_NO_MEM;
    c.V = c.KT + Hkv * keys;
    c.scratch = c.V + Hkv * keys;
    ms_internal_dispatch(at_keys_task, &c, Hkv * key_blocks);
    ms_internal_dispatch(at_task, &c, tasks);
    free(c.KT);
    return MS_OK;
}
