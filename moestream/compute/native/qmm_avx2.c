/* The dot products of the lane layout for CPUs with AVX2, FMA and F16C but no AVX-512 VNNI (empty elsewhere).
 *
 * The algorithm of qmm_vnni.c on half a group at a time: a group's lanes 0..7 and 8..15 each fill one 256-bit
 * register. Every lane's integer sum is the same exact integer, every lane's float steps are qmm_vnni.c's in
 * its order, and the two halves meet in the first step of its addition tree, so a row comes out with the bits
 * the VNNI kernels give it.
 *
 * vpdpbusd (4 u8 x s8 products into an int32 lane) becomes vpmaddubsw (pairs of products into int16, with
 * saturation) then vpmaddwd by ones (int16 pairs into int32). Activations are within +-127, so a pair stays
 * within int16 for weights up to 128 in magnitude:
 *   - weights 0..63 (Q4_*, Q5_*, Q6_K, Q2_K, Q3_K) multiply as stored;
 *   - weights the layout stores with +128 (Q8_0, IQ4_XS, MXFP4) are taken back to signed w and multiplied as
 *     |w| x (sign(w) x); the sum then needs no -128 sum(x) term, and is the same integer.
 * Where a half group's products cannot leave int16 (nibble weights, Q2_K, Q3_K, MXFP4), they add up in int16
 * and widen once per half group; the Q5 types and Q6_K widen every two chunks, Q8_0 and IQ4_XS every product. */
#include "internal.h"

#ifdef MS_AVX2_FMA

#define AI __attribute__((always_inline))

/* qmm_vnni.c's hsum on a 16-lane sum held as two halves: the halves added first, then its tree */
static inline float hsum2(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* ---------------------------------------------------------------------------------------------------- */
/* loads of n <= 8 lanes (8: plain loads; fewer only in the last group of a per-32 type), the rest zero */

static inline __m256i lanes_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* n lanes of 4 bytes */
static inline AI __m256i ld_b(int n, const void *p) {
    return n == 8 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, lanes_mask(n));
}

static inline AI __m256 ld_f(int n, const float *p) {
    return n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_mask(n));
}

/* n bytes, one a lane, for a widening convert */
static inline AI __m128i ld_bytes(int n, const uint8_t *p) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)n);
    return _mm_cvtsi64_si128((long long)v);
}

static inline AI __m256 u8_floats(int n, const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ld_bytes(n, p)));
}

static inline AI __m256 s8_floats(int n, const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld_bytes(n, p)));
}

/* n f16s */
static inline AI __m256 f16_floats(int n, const uint8_t *p) {
    if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint8_t b[16] = {0};
    memcpy(b, p, 2 * (size_t)n);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
}

/* the f16 of the 8 lanes of half h (the K types' d and dmin: one per 8 lanes) */
static inline AI __m256 per8(const uint8_t *dd, int h) { return _mm256_set1_ps(rd_fp16(dd + 2 * h)); }

/* ---------------------------------------------------------------------------------------------------- */
/* the types */

/* weights stored with +128: taken back to signed */
#define SIGNED_W(T) ((T) == QT_Q8_0 || (T) == QT_IQ4_XS || (T) == QT_MXFP4)
/* a half group's products add up in int16 without overflow: 8 pairs of at most 2 * 15 * 127 (nibbles,
 * MXFP4's |w| <= 12) or 4 per sum of at most 2 * 7 * 127 (Q2_K, Q3_K) */
#define SUM16(T) ((T) == QT_Q4_0 || (T) == QT_Q4_1 || (T) == QT_Q4_K || (T) == QT_MXFP4 || (T) == QT_Q2_K || (T) == QT_Q3_K)
/* the int32 types whose products of two chunks add up in int16 before they widen: Q5's 4 pairs of at most
 * 2 * 31 * 127 a sum, Q6_K's 2 pairs of at most 2 * 63 * 127 (one a half of 16) */
#define PAIRED(T) ((T) == QT_Q5_K || (T) == QT_Q5_0 || (T) == QT_Q5_1 || (T) == QT_Q6_K)
/* the types whose two halves of 16 take separate scales: two int32 sums per (row, token) */
#define TWO_HALF(T) ((T) == QT_Q6_K || (T) == QT_Q3_K || (T) == QT_Q2_K)

/* IQ4_XS's 16 values and MXFP4's doubled e2m1 values (signed), for vpshufb lookups by nibble */
static inline __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
}

static inline __m256i mxfp4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
}

/* MXFP4's per-lane scales 2^(e - 128) from its exponent bytes (as mxfp4_scale in blocks.h) */
static inline AI __m256 mxfp4_scales(int n, const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(ld_bytes(n, e));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, is_small));
}

/* half h (n lanes) of group g's scales (L lanes): as qmm_vnni.c's group_scales */
static inline AI void half_scales(int T, const uint8_t *g, int L, int h, int n, __m256 *scale, __m256 *mins) {
    const int o = 8 * h;
    if (T == QT_Q8_0) *scale = f16_floats(n, g + 32 * L + 2 * o);
    else if (T == QT_Q4_0) *scale = f16_floats(n, g + 16 * L + 2 * o);
    else if (T == QT_Q4_1) {
        *scale = f16_floats(n, g + 16 * L + 2 * o);
        *mins = f16_floats(n, g + 18 * L + 2 * o);
    }
    else if (T == QT_MXFP4) *scale = mxfp4_scales(n, g + 16 * L + o);
    else if (T == QT_Q5_0 || T == QT_Q5_1) {
        *scale = f16_floats(n, g + 20 * L + 2 * o);
        if (T == QT_Q5_1) *mins = f16_floats(n, g + 22 * L + 2 * o);
    } else if (T == QT_Q6_K || T == QT_Q3_K || T == QT_IQ4_XS) {
        const int halves = T == QT_IQ4_XS ? 1 : 2;
        const uint8_t *sc = g + (T == QT_Q6_K ? 24 : T == QT_Q3_K ? 12 : 16) * L, *dd = sc + halves * L;
        const __m256 dv = per8(dd, h);
        *scale = _mm256_mul_ps(dv, s8_floats(n, sc + o));
        if (halves == 2) *mins = _mm256_mul_ps(dv, s8_floats(n, sc + L + o));
    } else if (T == QT_Q2_K) { /* d * sc of each half (the second in `mins`) */
        const uint8_t *scm = g + 8 * L;
        const __m256 dv = per8(g + 10 * L, h);
        const __m256i m4 = _mm256_set1_epi32(0xF);
        *scale = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_cvtepu8_epi32(ld_bytes(n, scm + o)), m4)));
        *mins = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_cvtepu8_epi32(ld_bytes(n, scm + L + o)), m4)));
    } else {
        const uint8_t *sc = g + (T == QT_Q5_K ? 20 : 16) * L, *mn = sc + L, *dd = mn + L, *dm = dd + L / 4;
        *scale = _mm256_mul_ps(per8(dd, h), u8_floats(n, sc + o));
        *mins = _mm256_mul_ps(per8(dm, h), u8_floats(n, mn + o));
    }
}

/* Q2_K: dmin * m / 32 of each half, to multiply the activations' -32 * (half sums) */
static inline AI void q2k_mins(const uint8_t *g, int L, int h, int n, __m256 *lo, __m256 *hi) {
    const uint8_t *scm = g + 8 * L + 8 * h;
    const __m256 mv = _mm256_mul_ps(per8(g + 10 * L + L / 4, h), _mm256_set1_ps(1.0f / 32));
    *lo = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(ld_bytes(n, scm)), 4)));
    *hi = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(ld_bytes(n, scm + L)), 4)));
}

/* ---------------------------------------------------------------------------------------------------- */
/* weights */

static inline AI __m256i q23_weights(int T, __m256i v, __m256i h, int s) {
    __m256i w = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (s & 3)), _mm256_set1_epi8(3));
    if (T == QT_Q3_K) {
        const __m256i hb = s >= 2 ? _mm256_srli_epi16(h, s - 2) : _mm256_slli_epi16(h, 2 - s);
        w = _mm256_or_si256(w, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
    return w;
}

static inline AI void q6_weights(__m256i v, __m256i h, __m256i *w0, __m256i *w1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    *w0 = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    *w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
}

static inline AI void q5_weights(__m256i v, __m256i h, int c, __m256i *w0, __m256i *w1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
    h = _mm256_srli_epi16(h, 2 * c);
    *w0 = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m10));
    *w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 3), m10));
}

/* chunk c's weights of half h (n lanes) of group g (L lanes): the even step's (w0) and the odd step's (w1),
 * unsigned, or signed for SIGNED_W */
static inline AI void chunk_weights(int T, int L, int h, int n, const uint8_t *g, int c, __m256i *w0, __m256i *w1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int cb = 4 * L, o = 32 * h;
    if (T == QT_Q8_0) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *w0 = _mm256_xor_si256(ld_b(n, g + 2 * c * cb + o), flip);
        *w1 = _mm256_xor_si256(ld_b(n, g + (2 * c + 1) * cb + o), flip);
    } else if (T == QT_Q2_K || T == QT_Q3_K) {
        const __m256i v = ld_b(n, g + (c >> 1) * cb + o);
        const __m256i hb = T == QT_Q3_K ? ld_b(n, g + 8 * L + o) : _mm256_setzero_si256();
        *w0 = q23_weights(T, v, hb, 2 * c);
        *w1 = q23_weights(T, v, hb, 2 * c + 1);
    } else if (T == QT_Q5_K || T == QT_Q5_0 || T == QT_Q5_1) {
        q5_weights(ld_b(n, g + c * cb + o), ld_b(n, g + 16 * L + o), c, w0, w1);
    } else if (T == QT_Q6_K) {
        __m256i hb = ld_b(n, g + 16 * L + (c >> 1) * cb + o);
        if (c & 1) hb = _mm256_srli_epi16(hb, 4);
        q6_weights(ld_b(n, g + c * cb + o), hb, w0, w1);
    } else {
        const __m256i v = ld_b(n, g + c * cb + o);
        *w0 = _mm256_and_si256(v, m4);
        *w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (T == QT_IQ4_XS || T == QT_MXFP4) {
            const __m256i tbl = T == QT_MXFP4 ? mxfp4_table() : iq4_table();
            *w0 = _mm256_shuffle_epi8(tbl, *w0);
            *w1 = _mm256_shuffle_epi8(tbl, *w1);
        }
    }
}

/* pairs of products of weights w (|w| in wa for SIGNED_W) and activations x, as int16 */
static inline AI __m256i products(int T, __m256i w, __m256i wa, __m256i x) {
    return SIGNED_W(T) ? _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
}

/* The sum as of this step, in a register: without it GCC reassociates the integer adds, computes every chunk's
 * products first and adds them at the end, spilling the products of all tokens but one to the stack. */
static inline AI void settle(__m256i *sum) { __asm__("" : "+x"(*sum)); }

static inline AI __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }

/* ---------------------------------------------------------------------------------------------------- */
/* the tiles */

/* the int32 sums' start for the lanes at index i of the per-lane arrays (the activations' offset terms) */
static inline AI void sum_init(int T, int n, const xprep *x, int64_t i, __m256i *i0, __m256i *i1) {
    *i0 = *i1 = _mm256_setzero_si256();
    if (T == QT_Q6_K) {
        *i0 = ld_b(n, x->n32lo + i);
        *i1 = ld_b(n, x->n32hi + i);
    } else if (T == QT_Q3_K) { /* -4 * (half sums) */
        *i0 = _mm256_srai_epi32(ld_b(n, x->n32lo + i), 3);
        *i1 = _mm256_srai_epi32(ld_b(n, x->n32hi + i), 3);
    } else if (T == QT_Q4_0) {
        *i0 = ld_b(n, x->n8sx + i);
    } else if (T == QT_Q5_0) {
        *i0 = _mm256_slli_epi32(ld_b(n, x->n8sx + i), 1);
    }
}

/* qmm_vnni.c's group_sum for one (row, token): the int32 sums a0 (and a1, TWO_HALF) into the float sum *a */
static inline AI void group_sum(int T, int n, __m256i a0, __m256i a1, __m256 sc, __m256 mn, __m256 lo, __m256 hi,
                                const xprep *x, int64_t i, __m256 *a) {
    const __m256 dxv = ld_f(n, x->dx + i);
    if (TWO_HALF(T)) {
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(sc, dxv), *a);
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(mn, dxv), *a);
        if (T == QT_Q2_K) {
            const __m256 nlo = _mm256_mul_ps(_mm256_cvtepi32_ps(ld_b(n, x->n32lo + i)), dxv);
            const __m256 nhi = _mm256_mul_ps(_mm256_cvtepi32_ps(ld_b(n, x->n32hi + i)), dxv);
            *a = _mm256_fmadd_ps(nlo, lo, _mm256_fmadd_ps(nhi, hi, *a));
        }
        return;
    }
    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(sc, dxv), *a);
    if (T == QT_Q4_K || T == QT_Q5_K) *a = _mm256_fnmadd_ps(mn, ld_f(n, x->dxsx + i), *a);
    if (T == QT_Q5_1 || T == QT_Q4_1) *a = _mm256_fmadd_ps(mn, ld_f(n, x->dxsx + i), *a);
}

/* Half h (n lanes) of one group (L lanes) of R rows (g, rb bytes apart) x M tokens (xq, k bytes apart; xi: the
 * first token's index into the per-lane arrays, nsub apart). acc[(r * M + t) * 2 + h]. A stride of 0 repeats
 * a row or a token (a partial tile). */
static inline AI void tile_half(int T, int R, int M, int L, int h, int n, const uint8_t *g, int64_t rb,
                                const int8_t *xq, int64_t k, const xprep *x, int64_t xi, int64_t nsub,
                                __m256 *acc) {
    const int cb = 4 * L, o = 32 * h;
    const int64_t xo = xi + 8 * h;
    /* int16 sums (SUM16) or int32 sums from their start; fixed sizes (R * M <= 8), not variable-length arrays,
     * so that the compiler keeps them in registers */
    __m256i a0[8], a1[8];
#pragma GCC unroll 16
    for (int i = 0; i < R * M; i++) {
        if (SUM16(T)) a0[i] = a1[i] = _mm256_setzero_si256();
        else sum_init(T, n, x, xo + (i % M) * nsub, &a0[i], &a1[i]);
    }
    const int P = PAIRED(T) ? 2 : 1;
#pragma GCC unroll 4
    for (int c = 0; c < 4; c += P) {
        __m256i w0[4], w1[4], wa0[4], wa1[4]; /* [p * R + r] */
#pragma GCC unroll 4
        for (int j = 0; j < P * R; j++) {
            chunk_weights(T, L, h, n, g + (j % R) * rb, c + j / R, &w0[j], &w1[j]);
            wa0[j] = SIGNED_W(T) ? _mm256_abs_epi8(w0[j]) : w0[j];
            wa1[j] = SIGNED_W(T) ? _mm256_abs_epi8(w1[j]) : w1[j];
        }
#pragma GCC unroll 8
        for (int t = 0; t < M; t++) {
            __m256i xl[2], xh[2];
#pragma GCC unroll 2
            for (int p = 0; p < P; p++) {
                xl[p] = ld_b(n, xq + t * k + 2 * (c + p) * cb + o);
                xh[p] = ld_b(n, xq + t * k + (2 * (c + p) + 1) * cb + o);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int i = r * M + t;
                __m256i p0 = products(T, w0[r], wa0[r], xl[0]), p1 = products(T, w1[r], wa1[r], xh[0]);
                if (P == 2) {
                    p0 = _mm256_add_epi16(p0, products(T, w0[R + r], wa0[R + r], xl[1]));
                    p1 = _mm256_add_epi16(p1, products(T, w1[R + r], wa1[R + r], xh[1]));
                }
                if (SUM16(T) && TWO_HALF(T)) {
                    a0[i] = _mm256_add_epi16(a0[i], p0);
                    a1[i] = _mm256_add_epi16(a1[i], p1);
                } else if (SUM16(T)) {
                    a0[i] = _mm256_add_epi16(a0[i], _mm256_add_epi16(p0, p1));
                } else if (TWO_HALF(T)) {
                    a0[i] = _mm256_add_epi32(a0[i], widen(p0));
                    a1[i] = _mm256_add_epi32(a1[i], widen(p1));
                } else if (P == 2) {
                    a0[i] = _mm256_add_epi32(a0[i], widen(_mm256_add_epi16(p0, p1)));
                } else {
                    a0[i] = _mm256_add_epi32(a0[i], _mm256_add_epi32(widen(p0), widen(p1)));
                }
                settle(&a0[i]);
                if (TWO_HALF(T)) settle(&a1[i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const uint8_t *gr = g + r * rb;
        __m256 sc, mn = _mm256_setzero_ps(), lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        half_scales(T, gr, L, h, n, &sc, &mn);
        if (T == QT_Q2_K) q2k_mins(gr, L, h, n, &lo, &hi);
#pragma GCC unroll 8
        for (int t = 0; t < M; t++) {
            const int i = r * M + t;
            __m256i s0 = a0[i], s1 = a1[i];
            if (SUM16(T)) {
                __m256i i0, i1;
                sum_init(T, n, x, xo + t * nsub, &i0, &i1);
                s0 = _mm256_add_epi32(i0, widen(s0));
                if (TWO_HALF(T)) s1 = _mm256_add_epi32(i1, widen(s1));
            }
            group_sum(T, n, s0, s1, sc, mn, lo, hi, x, xo + t * nsub, &acc[2 * i + h]);
        }
    }
}

/* one group (L lanes) of the tile: its halves */
static inline AI void tile_group(int T, int R, int M, int L, const uint8_t *g, int64_t rb, const int8_t *xq,
                                 int64_t k, const xprep *x, int64_t xi, int64_t nsub, __m256 *acc) {
    tile_half(T, R, M, L, 0, L < 8 ? L : 8, g, rb, xq, k, x, xi, nsub, acc);
    if (L > 8) tile_half(T, R, M, L, 1, L - 8, g, rb, xq, k, x, xi, nsub, acc);
}

/* rows r .. r + nr - 1 (nr <= R) against tokens t0 .. t0 + nt - 1 (nt <= M), whole rows; a partial tile
 * computes its last row or token again in the missing places and stores only the real ones. pf: prefetch the
 * rows' weights ahead. */
static inline AI void tile_rows(int T, int R, int M, const qmm_job *J, int64_t r, int nr, int64_t t0, int nt,
                                int pf) {
    const int64_t k = J->k, nsub = k / 32, rb = lane_row_bytes(T, k);
    const int64_t rs = nr > 1 ? rb : 0, tk = nt > 1 ? k : 0, tn = nt > 1 ? nsub : 0;
    __m256 acc[16];
    for (int i = 0; i < 2 * R * M; i++) acc[i] = _mm256_setzero_ps();
    const uint8_t *g = J->w + r * rb;
    const int8_t *xq = J->x->q + t0 * k;
    int64_t s0 = 0;
    for (; s0 + 16 <= nsub; s0 += 16) {
        if (pf)
            for (int rr = 0; rr < nr; rr++)
                for (int64_t o = 0; o < group_bytes(T, 16); o += 64)
                    _mm_prefetch((const char *)g + rr * rb + PF_DIST + o, PF_HINT);
        tile_group(T, R, M, 16, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
        g += group_bytes(T, 16);
        xq += 32 * 16;
    }
    if (s0 < nsub) {
        const int rem = (int)(nsub - s0);
        if (!per32_type(T) || rem == 8) tile_group(T, R, M, 8, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
        else tile_group(T, R, M, rem, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
    }
    for (int rr = 0; rr < nr; rr++)
        for (int t = 0; t < nt; t++)
            J->y[(t0 + t) * J->ldy + r + rr] = hsum2(acc[2 * (rr * M + t)], acc[2 * (rr * M + t) + 1]);
}

/* Tiles: one row x 4 tokens, so that the sums, two chunks' unpacked weights and the activations fit the 16
 * registers (two-row tiles were no faster for any type; bench/RESULTS.md, "The AVX2 kernels, second round"). */
#define TILE_R(T) 1
#define TILE_M(T) 4

/* rows [r0, r1) of one token: two rows at a time (independent chains; decode streams the rows from RAM) */
static inline AI void qmv_tiles(int T, const qmm_job *J, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r += 2) tile_rows(T, 2, 1, J, r, r1 - r < 2 ? 1 : 2, 0, 1, 1);
}

/* Tokens go in blocks whose activations stay in L1 while the rows [r0, r1) (in L2) pass over them. */
#define TOKEN_BLOCK_BYTES 16384

static inline AI void qmm_tiles(int T, const qmm_job *J, int64_t r0, int64_t r1) {
    const int R = TILE_R(T), M = TILE_M(T);
    int64_t tb = TOKEN_BLOCK_BYTES / J->k / M * M;
    if (tb < M) tb = M;
    for (int64_t b0 = 0; b0 < J->m; b0 += tb) {
        const int64_t b1 = J->m - b0 < tb ? J->m : b0 + tb;
        for (int64_t r = r0; r < r1; r += R) {
            const int nr = r1 - r < R ? (int)(r1 - r) : R;
            int64_t t = b0;
            int pf = b0 == 0;
            for (; t + M <= b1; t += M, pf = 0) tile_rows(T, R, M, J, r, nr, t, M, pf);
            for (; t < b1; t += 2, pf = 0) tile_rows(T, R, 2, J, r, nr, t, t + 2 <= b1 ? 2 : 1, pf);
        }
    }
}

void ms_internal_qmv_rows(const qmm_job *J, int64_t r0, int64_t r1) { EACH_TYPE(qmv_tiles, J, r0, r1); }

void ms_internal_qmm_rows(const qmm_job *J, int64_t r0, int64_t r1) { EACH_TYPE(qmm_tiles, J, r0, r1); }
#endif
