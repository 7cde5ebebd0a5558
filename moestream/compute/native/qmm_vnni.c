/* The dot products of the lane layout against quantized activations (AVX-512 VNNI; empty without it). */
#include "internal.h"

/* ---------------------------------------------------------------------------------------------------- */
/* the dot products */


#ifdef MS_VNNI
/* The sum of a register's 16 floats, in GCC's _mm512_reduce_add_ps tree (written out: every kernel must add
 * in this one order, and hsum8 below adds in it too): halves, then quarters, then pairs. */
static inline float hsum(__m512 v) {
    const __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                    _mm512_castps512_ps256(v));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* hsum of 8 registers at once: each step of hsum's tree for several registers in one instruction (the same
 * pairs added, so the same bits) */
static inline void hsum8(const __m512 *a, float *out) {
    __m512 p[4], q[2];
    for (int i = 0; i < 4; i++) /* halves: [a0.lo + a0.hi | a1.lo + a1.hi] */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int i = 0; i < 2; i++) /* quarters: one 128-bit lane per register */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    /* pairs: lane i holds registers i's and i + 4's two partial sums, then their sums */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    float r[16];
    _mm512_storeu_ps(r, _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1))));
    for (int i = 0; i < 4; i++) {
        out[i] = r[4 * i];
        out[i + 4] = r[4 * i + 2];
    }
}

/* One token, two rows at a time: the activation loads are shared and the two rows' dot products are
 * independent chains (decode is this case: its speed is the speed of the engine). `T` is a constant at
 * every call site, so each type gets its own copy of the loop. */
/* 4 bytes at any alignment (a row of the lane layout need not start on a multiple of 4) */
static inline int32_t rd_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* an f16 per 8 lanes (L = 16: two) broadcast over its lanes */
static inline __attribute__((always_inline)) __m512 per8(const uint8_t *dd, int L) {
    if (L == 16) {
        __m512 d2 = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi32_si128(rd_i32(dd))));
        return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), d2);
    }
    return _mm512_set1_ps(rd_fp16((dd)));
}

/* Q2_K: dmin * m / 32 of each half, to multiply the activations' -32 * (half sums) */
static inline __attribute__((always_inline)) void q2k_mins(const uint8_t *g, int L, __mmask16 mf, __m512 *lo, __m512 *hi) {
    const uint8_t *scm = g + 8 * L;
    const __m512 mv = _mm512_mul_ps(per8(g + 10 * L + L / 4, L), _mm512_set1_ps(1.0f / 32));
    *lo = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, scm)), 4)));
    *hi = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, scm + L)), 4)));
}

/* Q2_K / Q3_K step s's weights from its pair byte v (Q3_K: and its high-bit byte h) */
static inline __attribute__((always_inline)) __m512i q23_weights(int T, __m512i v, __m512i h, int s) {
    __m512i w = _mm512_and_si512(_mm512_srli_epi16(v, 2 * (s & 3)), _mm512_set1_epi8(3));
    if (T == QT_Q3_K) {
        const __m512i b2 = _mm512_set1_epi8(4);
        __m512i hb = s >= 2 ? _mm512_srli_epi16(h, s - 2) : _mm512_slli_epi16(h, 2 - s);
        w = _mm512_or_si512(w, _mm512_and_si512(hb, b2));
    }
    return w;
}

/* MXFP4's per-lane scales 2^(e - 128) from its exponent bytes (as mxfp4_scale in blocks.h) */
static inline __m512 mxfp4_scales(const uint8_t *e, __mmask16 mf) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, e));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(v, _mm512_set1_epi32(2)), big, small));
}

static inline __attribute__((always_inline)) void group_scales(int T, const uint8_t *g, int L, __mmask16 mf,
                                                               __m512 *scale, __m512 *mins) {
    if (T == QT_Q8_0) *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 32 * L));
    else if (T == QT_Q4_0) *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 16 * L));
    else if (T == QT_Q4_1) { /* d, and m in `mins` */
        *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 16 * L));
        *mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 18 * L));
    }
    else if (T == QT_MXFP4) *scale = mxfp4_scales(g + 16 * L, mf);
    else if (T == QT_Q5_0 || T == QT_Q5_1) { /* d, and Q5_1's m in `mins` */
        *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 20 * L));
        if (T == QT_Q5_1) *mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 22 * L));
    }
    else if (T == QT_Q6_K || T == QT_Q3_K || T == QT_IQ4_XS) {
        /* int8 scales per lane (Q6_K, Q3_K: per half, the second half's in `mins`), d per 8 lanes */
        const int halves = T == QT_IQ4_XS ? 1 : 2;
        const uint8_t *sc = g + (T == QT_Q6_K ? 24 : T == QT_Q3_K ? 12 : 16) * L, *dd = sc + halves * L;
        const __m512 dv = per8(dd, L);
        *scale = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mf, sc))));
        if (halves == 2)
            *mins = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mf, sc + L))));
    } else if (T == QT_Q2_K) { /* d * sc of each half (the second in `mins`); q2k_mins gives the mins */
        const uint8_t *scm = g + 8 * L;
        const __m512 dv = per8(g + 10 * L, L);
        const __m512i m4 = _mm512_set1_epi32(0xF);
        *scale = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, scm)), m4)));
        *mins = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, scm + L)), m4)));
    } else {
        const uint8_t *sc = g + (T == QT_Q5_K ? 20 : 16) * L, *mn = sc + L, *dd = mn + L, *dm = dd + L / 4;
        __m512 dv, mv;
        if (L == 16) {
            __m512 d2 = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi32_si128(rd_i32(dd))));
            __m512 m2 = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi32_si128(rd_i32(dm))));
            const __m512i sel = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            dv = _mm512_permutexvar_ps(sel, d2);
            mv = _mm512_permutexvar_ps(sel, m2);
        } else {
            dv = _mm512_set1_ps(rd_fp16((dd)));
            mv = _mm512_set1_ps(rd_fp16((dm)));
        }
        *scale = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, sc))));
        *mins = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mf, mn))));
    }
}

/* masks of a group's L lanes: over its int32 lanes, and over its bytes (4 a lane) */
#define LANES16(L) ((__mmask16)((L) == 16 ? 0xFFFF : (1u << (L)) - 1))
#define LANES64(L) ((L) == 16 ? ~(__mmask64)0 : ((__mmask64)1 << (4 * (L))) - 1)
/* a group's 4 L bytes, floats, int32s (L = 16 and 8 as plain loads; a per-32 type's last group masked) */
#define LDB(L, p) ((L) == 16 ? _mm512_loadu_si512((const void *)(p)) \
                   : (L) == 8 ? _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(p))) \
                              : _mm512_maskz_loadu_epi8(LANES64(L), (const void *)(p)))
#define LDF(L, p) ((L) == 16 ? _mm512_loadu_ps(p) : (L) == 8 ? _mm512_zextps256_ps512(_mm256_loadu_ps(p)) \
                                                   : _mm512_maskz_loadu_ps(LANES16(L), p))
#define LDI(L, p) ((L) == 16 ? _mm512_loadu_si512((const void *)(p)) \
                   : (L) == 8 ? _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(p))) \
                              : _mm512_maskz_loadu_epi32(LANES16(L), (const void *)(p)))

/* Q6_K chunk c of a group: its 6-bit weights for the even step (w0) and the odd step (w1), from the chunk's
 * nibbles v and its pair's high-bit bytes h (already shifted right by 4 for an odd chunk) */
/* IQ4_XS's values + 128 (unsigned, for vpdpbusd) in each 128-bit lane, for vpshufb lookups by nibble */
static inline __m512i iq4_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153,
                                                (char)166, (char)181, (char)197, (char)217, (char)241));
}

/* MXFP4's doubled e2m1 values + 128, as iq4_table */
static inline __m512i mxfp4_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132, (char)134,
                                                (char)136, (char)140, (char)128, 127, 126, 125, 124, 122, 120, 116));
}

static inline __attribute__((always_inline)) void q6_weights(__m512i v, __m512i h, __m512i *w0, __m512i *w1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    *w0 = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
    *w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
}

/* Q5_K chunk c: its nibbles v with their fifth bits from the group's fifth-bit bytes h */
static inline __attribute__((always_inline)) void q5_weights(__m512i v, __m512i h, int c, __m512i *w0, __m512i *w1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    h = _mm512_srli_epi16(h, 2 * c);
    *w0 = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m10));
    *w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(_mm512_slli_epi16(h, 3), m10));
}

/* One group (L = 16 or 8 lanes, a constant; any 1..16 for the last group of a per-32 type) of two rows
 * against one token. */
static inline __attribute__((always_inline)) void qmv2_group(int T, int L, const uint8_t *ga, const uint8_t *gb,
                                                             const int8_t *xq, const xprep *x, int64_t s0,
                                                             __m512 *acca, __m512 *accb) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __mmask16 mf = LANES16(L);
    const int cb = 4 * L;
    for (int64_t o = 0; o < group_bytes(T, L); o += 64) {
        _mm_prefetch((const char *)ga + PF_DIST + o, PF_HINT);
        _mm_prefetch((const char *)gb + PF_DIST + o, PF_HINT);
    }
    __m512i a0, a1, b0, b1;
    if (T == QT_Q4_K || T == QT_Q5_K || T == QT_Q2_K || T == QT_Q5_1 || T == QT_Q4_1) {
        a0 = b0 = _mm512_setzero_si512();
    } else if (T == QT_Q6_K) {
        a0 = b0 = LDI(L, x->n32lo + s0);
    } else if (T == QT_Q3_K) { /* -4 * (half sums) */
        a0 = b0 = _mm512_srai_epi32(LDI(L, x->n32lo + s0), 3);
    } else {
        a0 = LDI(L, x->n8sx + s0); /* -8 sum(x): Q4_0's offset; x2 Q5_0's, x16 the table types' and Q8_0's */
        if (T == QT_Q8_0 || T == QT_IQ4_XS || T == QT_MXFP4) a0 = _mm512_slli_epi32(a0, 4);
        if (T == QT_Q5_0) a0 = _mm512_slli_epi32(a0, 1);
        b0 = a0;
    }
    a1 = b1 = T == QT_Q6_K ? LDI(L, x->n32hi + s0)
              : T == QT_Q3_K ? _mm512_srai_epi32(LDI(L, x->n32hi + s0), 3)
                             : _mm512_setzero_si512();
    if (T == QT_Q2_K || T == QT_Q3_K) {
        const __m512i ha = T == QT_Q3_K ? LDB(L, ga + 8 * L) : _mm512_setzero_si512();
        const __m512i hb = T == QT_Q3_K ? LDB(L, gb + 8 * L) : _mm512_setzero_si512();
        for (int s = 0; s < 8; s += 2) {
            __m512i xl = LDB(L, xq + s * cb), xh = LDB(L, xq + (s + 1) * cb);
            __m512i va = LDB(L, ga + (s >> 2) * cb), vb = LDB(L, gb + (s >> 2) * cb);
            a0 = _mm512_dpbusd_epi32(a0, q23_weights(T, va, ha, s), xl);
            a1 = _mm512_dpbusd_epi32(a1, q23_weights(T, va, ha, s + 1), xh);
            b0 = _mm512_dpbusd_epi32(b0, q23_weights(T, vb, hb, s), xl);
            b1 = _mm512_dpbusd_epi32(b1, q23_weights(T, vb, hb, s + 1), xh);
        }
    } else if (T == QT_Q6_K) {
        for (int c = 0; c < 4; c++) {
            __m512i xl = LDB(L, xq + 2 * c * cb), xh = LDB(L, xq + (2 * c + 1) * cb);
            __m512i ha = LDB(L, ga + 16 * L + (c >> 1) * cb), hb = LDB(L, gb + 16 * L + (c >> 1) * cb);
            if (c & 1) {
                ha = _mm512_srli_epi16(ha, 4);
                hb = _mm512_srli_epi16(hb, 4);
            }
            __m512i wa0, wa1, wb0, wb1;
            q6_weights(LDB(L, ga + c * cb), ha, &wa0, &wa1);
            q6_weights(LDB(L, gb + c * cb), hb, &wb0, &wb1);
            a0 = _mm512_dpbusd_epi32(a0, wa0, xl);
            a1 = _mm512_dpbusd_epi32(a1, wa1, xh);
            b0 = _mm512_dpbusd_epi32(b0, wb0, xl);
            b1 = _mm512_dpbusd_epi32(b1, wb1, xh);
        }
    } else if (T == QT_Q5_K || T == QT_Q5_0 || T == QT_Q5_1) {
        const __m512i ha = LDB(L, ga + 16 * L), hb = LDB(L, gb + 16 * L);
        for (int c = 0; c < 4; c++) {
            __m512i xl = LDB(L, xq + 2 * c * cb), xh = LDB(L, xq + (2 * c + 1) * cb);
            __m512i wa0, wa1, wb0, wb1;
            q5_weights(LDB(L, ga + c * cb), ha, c, &wa0, &wa1);
            q5_weights(LDB(L, gb + c * cb), hb, c, &wb0, &wb1);
            a0 = _mm512_dpbusd_epi32(a0, wa0, xl);
            a1 = _mm512_dpbusd_epi32(a1, wa1, xh);
            b0 = _mm512_dpbusd_epi32(b0, wb0, xl);
            b1 = _mm512_dpbusd_epi32(b1, wb1, xh);
        }
    } else if (T == QT_IQ4_XS || T == QT_MXFP4) {
        const __m512i tbl = T == QT_MXFP4 ? mxfp4_table() : iq4_table();
        for (int c = 0; c < 4; c++) {
            __m512i xl = LDB(L, xq + 2 * c * cb), xh = LDB(L, xq + (2 * c + 1) * cb);
            __m512i va = LDB(L, ga + c * cb), vb = LDB(L, gb + c * cb);
            a0 = _mm512_dpbusd_epi32(a0, _mm512_shuffle_epi8(tbl, _mm512_and_si512(va, m4)), xl);
            a1 = _mm512_dpbusd_epi32(a1, _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(va, 4), m4)), xh);
            b0 = _mm512_dpbusd_epi32(b0, _mm512_shuffle_epi8(tbl, _mm512_and_si512(vb, m4)), xl);
            b1 = _mm512_dpbusd_epi32(b1, _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(vb, 4), m4)), xh);
        }
    } else if (T == QT_Q8_0) {
        for (int s = 0; s < 8; s += 2) {
            __m512i xl = LDB(L, xq + s * cb), xh = LDB(L, xq + (s + 1) * cb);
            a0 = _mm512_dpbusd_epi32(a0, LDB(L, ga + s * cb), xl);
            a1 = _mm512_dpbusd_epi32(a1, LDB(L, ga + (s + 1) * cb), xh);
            b0 = _mm512_dpbusd_epi32(b0, LDB(L, gb + s * cb), xl);
            b1 = _mm512_dpbusd_epi32(b1, LDB(L, gb + (s + 1) * cb), xh);
        }
    } else {
        for (int c = 0; c < 4; c++) {
            __m512i xl = LDB(L, xq + 2 * c * cb), xh = LDB(L, xq + (2 * c + 1) * cb);
            __m512i va = LDB(L, ga + c * cb), vb = LDB(L, gb + c * cb);
            a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(va, m4), xl);
            a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(va, 4), m4), xh);
            b0 = _mm512_dpbusd_epi32(b0, _mm512_and_si512(vb, m4), xl);
            b1 = _mm512_dpbusd_epi32(b1, _mm512_and_si512(_mm512_srli_epi16(vb, 4), m4), xh);
        }
    }
    __m512 sa, sb, ma = _mm512_setzero_ps(), mbv = _mm512_setzero_ps();
    group_scales(T, ga, L, mf, &sa, &ma);
    group_scales(T, gb, L, mf, &sb, &mbv);
    __m512 dxv = LDF(L, x->dx + s0);
    if (T == QT_Q6_K || T == QT_Q3_K || T == QT_Q2_K) { /* the second half's scale is in the mins slot */
        *acca = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(sa, dxv), *acca);
        *acca = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(ma, dxv), *acca);
        *accb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b0), _mm512_mul_ps(sb, dxv), *accb);
        *accb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b1), _mm512_mul_ps(mbv, dxv), *accb);
        if (T == QT_Q2_K) {
            __m512 lo_a, hi_a, lo_b, hi_b;
            q2k_mins(ga, L, mf, &lo_a, &hi_a);
            q2k_mins(gb, L, mf, &lo_b, &hi_b);
            __m512 nlo = _mm512_mul_ps(_mm512_cvtepi32_ps(LDI(L, x->n32lo + s0)), dxv);
            __m512 nhi = _mm512_mul_ps(_mm512_cvtepi32_ps(LDI(L, x->n32hi + s0)), dxv);
            *acca = _mm512_fmadd_ps(nlo, lo_a, _mm512_fmadd_ps(nhi, hi_a, *acca));
            *accb = _mm512_fmadd_ps(nlo, lo_b, _mm512_fmadd_ps(nhi, hi_b, *accb));
        }
        return;
    }
    *acca = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), _mm512_mul_ps(sa, dxv), *acca);
    *accb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)), _mm512_mul_ps(sb, dxv), *accb);
    if (T == QT_Q4_K || T == QT_Q5_K) {
        __m512 dxsx = LDF(L, x->dxsx + s0);
        *acca = _mm512_fnmadd_ps(ma, dxsx, *acca);
        *accb = _mm512_fnmadd_ps(mbv, dxsx, *accb);
    }
    if (T == QT_Q5_1 || T == QT_Q4_1) {
        __m512 dxsx = LDF(L, x->dxsx + s0);
        *acca = _mm512_fmadd_ps(ma, dxsx, *acca);
        *accb = _mm512_fmadd_ps(mbv, dxsx, *accb);
    }
}

static inline __attribute__((always_inline)) void qmv2(int T, const qmm_job *J, int64_t r0, int64_t r1) {
    const int64_t k = J->k, nsub = k / 32, rb = lane_row_bytes(T, k);
    int64_t r = r0;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *ga = J->w + r * rb, *gb = ga + rb;
        const int8_t *xq = J->x->q;
        __m512 acca = _mm512_setzero_ps(), accb = _mm512_setzero_ps();
        int64_t s0 = 0;
        for (; s0 + 16 <= nsub; s0 += 16) {
            qmv2_group(T, 16, ga, gb, xq, J->x, s0, &acca, &accb);
            ga += group_bytes(T, 16);
            gb += group_bytes(T, 16);
            xq += 32 * 16;
        }
        if (s0 < nsub) {
            const int rem = (int)(nsub - s0);
            if (!per32_type(T) || rem == 8) qmv2_group(T, 8, ga, gb, xq, J->x, s0, &acca, &accb);
            else qmv2_group(T, rem, ga, gb, xq, J->x, s0, &acca, &accb);
        }
        J->y[r] = hsum(acca);
        J->y[r + 1] = hsum(accb);
    }
    if (r < r1) ms_internal_qmm_rows(J, r, r1);
}

void ms_internal_qmv_rows(const qmm_job *J, int64_t r0, int64_t r1) { EACH_TYPE(qmv2, J, r0, r1); }

/* The many-token kernel: tiles of R weight rows x M tokens. A group's weights are unpacked once per tile and
 * used by its M tokens while in registers; each token's activation bytes by its R rows. Per (row, token) the
 * integer sums are the exact ones of qmv2_group (int32 addition is exact and wraps alike in any order) and the
 * float steps are its steps in its order, so each row of y has the bits the one-token kernel gives it. */

/* the types whose two halves of 16 take separate scales: two int32 sums per (row, token) */
#define TWO_HALF(T) ((T) == QT_Q6_K || (T) == QT_Q3_K || (T) == QT_Q2_K)
/* Tiles: R rows x M tokens, 8 (row, token) sums a tile. One int32 sum per (row, token) for most types, two
 * for TWO_HALF; with the float sums and the unpacked weights they fit the 32 registers (TWO_HALF's 2 x 4 tiles
 * too: their eight float sums share one hsum8, which 1 x 4 tiles did not; bench/RESULTS.md, "The VNNI tiles in
 * registers"). The one-sum types take MS_ONE_SUM_TOKENS tokens a tile: 4 (2 rows) by default, 8 (1 row) where
 * the loader's tuning for the CPU says so (native/__init__.py, cpu_tuning). The shape changes no bits. */
#ifndef MS_ONE_SUM_TOKENS
#define MS_ONE_SUM_TOKENS 4
#endif
#if MS_ONE_SUM_TOKENS != 4 && MS_ONE_SUM_TOKENS != 8
#error "MS_ONE_SUM_TOKENS is 4 or 8"
#endif
#define TILE_MAX 8
#define TILE_M(T) (TWO_HALF(T) ? 4 : MS_ONE_SUM_TOKENS)
#define TILE_R(T) (TILE_MAX / TILE_M(T))

/* a group's 4 L bytes of weights; bc (L = 8): the 32 bytes in both halves of the register */
#define LDW(L, bc, p) ((bc) ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const void *)(p))) : LDB(L, p))

/* chunk c's weights of group g: the even step's (w0) and the odd step's (w1) */
static inline __attribute__((always_inline)) void chunk_weights(int T, int L, int bc, const uint8_t *g, int c,
                                                                __m512i *w0, __m512i *w1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int cb = 4 * L;
    if (T == QT_Q8_0) {
        *w0 = LDW(L, bc, g + 2 * c * cb);
        *w1 = LDW(L, bc, g + (2 * c + 1) * cb);
    } else if (T == QT_Q2_K || T == QT_Q3_K) {
        const __m512i v = LDW(L, bc, g + (c >> 1) * cb);
        const __m512i h = T == QT_Q3_K ? LDW(L, bc, g + 8 * L) : _mm512_setzero_si512();
        *w0 = q23_weights(T, v, h, 2 * c);
        *w1 = q23_weights(T, v, h, 2 * c + 1);
    } else if (T == QT_Q5_K || T == QT_Q5_0 || T == QT_Q5_1) {
        q5_weights(LDW(L, bc, g + c * cb), LDW(L, bc, g + 16 * L), c, w0, w1);
    } else if (T == QT_Q6_K) {
        __m512i h = LDW(L, bc, g + 16 * L + (c >> 1) * cb);
        if (c & 1) h = _mm512_srli_epi16(h, 4);
        q6_weights(LDW(L, bc, g + c * cb), h, w0, w1);
    } else {
        const __m512i v = LDW(L, bc, g + c * cb);
        *w0 = _mm512_and_si512(v, m4);
        *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (T == QT_IQ4_XS || T == QT_MXFP4) {
            const __m512i tbl = T == QT_MXFP4 ? mxfp4_table() : iq4_table();
            *w0 = _mm512_shuffle_epi8(tbl, *w0);
            *w1 = _mm512_shuffle_epi8(tbl, *w1);
        }
    }
}

/* qmv2_group's float steps for one (row, token): its int32 sums a0 (and a1, TWO_HALF) into the float sum *a */
static inline __attribute__((always_inline)) void group_sum(int T, int L, __m512i a0, __m512i a1, __m512 sc,
                                                            __m512 mn, __m512 lo, __m512 hi, const xprep *x,
                                                            int64_t i, __m512 *a) {
    const __m512 dxv = LDF(L, x->dx + i);
    if (TWO_HALF(T)) {
        *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(sc, dxv), *a);
        *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(mn, dxv), *a);
        if (T == QT_Q2_K) {
            const __m512 nlo = _mm512_mul_ps(_mm512_cvtepi32_ps(LDI(L, x->n32lo + i)), dxv);
            const __m512 nhi = _mm512_mul_ps(_mm512_cvtepi32_ps(LDI(L, x->n32hi + i)), dxv);
            *a = _mm512_fmadd_ps(nlo, lo, _mm512_fmadd_ps(nhi, hi, *a));
        }
        return;
    }
    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(sc, dxv), *a);
    if (T == QT_Q4_K || T == QT_Q5_K) *a = _mm512_fnmadd_ps(mn, LDF(L, x->dxsx + i), *a);
    if (T == QT_Q5_1 || T == QT_Q4_1) *a = _mm512_fmadd_ps(mn, LDF(L, x->dxsx + i), *a);
}

/* the int32 sums' start for token index i (the activations' offset terms), as qmv2_group's */
static inline __attribute__((always_inline)) void sum_init(int T, int L, const xprep *x, int64_t i, __m512i *i0,
                                                           __m512i *i1) {
    *i1 = _mm512_setzero_si512();
    if (T == QT_Q4_K || T == QT_Q5_K || T == QT_Q2_K || T == QT_Q5_1 || T == QT_Q4_1) {
        *i0 = _mm512_setzero_si512();
    } else if (T == QT_Q6_K) {
        *i0 = LDI(L, x->n32lo + i);
        *i1 = LDI(L, x->n32hi + i);
    } else if (T == QT_Q3_K) {
        *i0 = _mm512_srai_epi32(LDI(L, x->n32lo + i), 3);
        *i1 = _mm512_srai_epi32(LDI(L, x->n32hi + i), 3);
    } else {
        *i0 = LDI(L, x->n8sx + i);
        if (T == QT_Q8_0 || T == QT_IQ4_XS || T == QT_MXFP4) *i0 = _mm512_slli_epi32(*i0, 4);
        if (T == QT_Q5_0) *i0 = _mm512_slli_epi32(*i0, 1);
    }
}

/* two registers' low halves as one: tokens t and t + 1 of an 8-lane group side by side */
static inline __m512i join8(__m512i lo, __m512i hi) { return _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1); }
/* half h of a joined register back as an 8-lane group's register (upper lanes zero) */
static inline __m512i half8(__m512i v, int h) {
    return _mm512_zextsi256_si512(h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
}

/* One group of R rows (g, rb bytes apart) x M tokens (xq, k bytes apart; xi: the first token's index into the
 * per-lane arrays, nsub apart). acc[r * M + t]. A stride of 0 repeats a row or a token (a partial tile). */
static inline __attribute__((always_inline)) void tile_group(int T, int L, int R, int M, const uint8_t *g,
                                                             int64_t rb, const int8_t *xq, int64_t k,
                                                             const xprep *x, int64_t xi, int64_t nsub,
                                                             __m512 *acc) {
    const __mmask16 mf = LANES16(L);
    const int cb = 4 * L;
    /* an 8-lane group fills half a register: two tokens share one, the weights in both halves */
    const int pk = L == 8 && M % 2 == 0, V = pk ? M / 2 : M;
    __m512i a0[TILE_MAX], a1[TILE_MAX]; /* fixed sizes: a VLA would live on the stack, not in registers */
#pragma GCC unroll 8
    for (int v = 0; v < V; v++) {
        __m512i i0, i1;
        if (pk) {
            __m512i j0, j1;
            sum_init(T, L, x, xi + 2 * v * nsub, &i0, &i1);
            sum_init(T, L, x, xi + (2 * v + 1) * nsub, &j0, &j1);
            i0 = join8(i0, j0);
            i1 = join8(i1, j1);
        } else {
            sum_init(T, L, x, xi + v * nsub, &i0, &i1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            a0[r * V + v] = i0;
            a1[r * V + v] = i1;
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512i w0[2], w1[2]; /* R <= 2 */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) chunk_weights(T, L, pk, g + r * rb, c, &w0[r], &w1[r]);
#pragma GCC unroll 8
        for (int v = 0; v < V; v++) {
            __m512i xl, xh;
            if (pk) {
                const int8_t *p0 = xq + 2 * v * k, *p1 = p0 + k;
                xl = join8(LDB(8, p0 + 2 * c * cb), LDB(8, p1 + 2 * c * cb));
                xh = join8(LDB(8, p0 + (2 * c + 1) * cb), LDB(8, p1 + (2 * c + 1) * cb));
            } else {
                xl = LDB(L, xq + v * k + 2 * c * cb);
                xh = LDB(L, xq + v * k + (2 * c + 1) * cb);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                a0[r * V + v] = _mm512_dpbusd_epi32(a0[r * V + v], w0[r], xl);
                /* one sum where the halves share a scale */
                if (TWO_HALF(T)) a1[r * V + v] = _mm512_dpbusd_epi32(a1[r * V + v], w1[r], xh);
                else a0[r * V + v] = _mm512_dpbusd_epi32(a0[r * V + v], w1[r], xh);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const uint8_t *gr = g + r * rb;
        __m512 sc, mn = _mm512_setzero_ps(), lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        group_scales(T, gr, L, mf, &sc, &mn);
        if (T == QT_Q2_K) q2k_mins(gr, L, mf, &lo, &hi);
#pragma GCC unroll 8
        for (int t = 0; t < M; t++) {
            const __m512i s0 = pk ? half8(a0[r * V + t / 2], t & 1) : a0[r * V + t];
            const __m512i s1 = pk ? half8(a1[r * V + t / 2], t & 1) : a1[r * V + t];
            group_sum(T, L, s0, s1, sc, mn, lo, hi, x, xi + t * nsub, &acc[r * M + t]);
        }
    }
}

/* rows r .. r + nr - 1 (nr <= R) against tokens t0 .. t0 + nt - 1 (nt <= M), whole rows; a partial tile
 * computes its last row or token again in the missing places and stores only the real ones (one copy of the
 * kernel per tile shape is what keeps the library's build short). pf: prefetch the rows' weights ahead. */
static inline __attribute__((always_inline)) void tile_rows(int T, int R, int M, const qmm_job *J, int64_t r,
                                                            int nr, int64_t t0, int nt, int pf) {
    const int64_t k = J->k, nsub = k / 32, rb = lane_row_bytes(T, k);
    const int64_t rs = nr > 1 ? rb : 0, tk = nt > 1 ? k : 0, tn = nt > 1 ? nsub : 0;
    __m512 acc[TILE_MAX];
#pragma GCC unroll 16
    for (int i = 0; i < R * M; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *g = J->w + r * rb;
    const int8_t *xq = J->x->q + t0 * k;
    int64_t s0 = 0;
    for (; s0 + 16 <= nsub; s0 += 16) {
        if (pf)
            for (int rr = 0; rr < nr; rr++)
                for (int64_t o = 0; o < group_bytes(T, 16); o += 64)
                    _mm_prefetch((const char *)g + rr * rb + PF_DIST + o, PF_HINT);
        tile_group(T, 16, R, M, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
        g += group_bytes(T, 16);
        xq += 32 * 16;
    }
    if (s0 < nsub) {
        const int rem = (int)(nsub - s0);
        if (!per32_type(T) || rem == 8) tile_group(T, 8, R, M, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
        else tile_group(T, rem, R, M, g, rs, xq, tk, J->x, t0 * nsub + s0, tn, acc);
    }
    float sums[TILE_MAX];
    if (R * M == 8) {
        hsum8(acc, sums);
    } else {
        for (int i = 0; i < R * M; i++) sums[i] = hsum(acc[i]);
    }
    for (int rr = 0; rr < nr; rr++)
        for (int t = 0; t < nt; t++) J->y[(t0 + t) * J->ldy + r + rr] = sums[rr * M + t];
}

/* rows r .. r + nr - 1 against tokens [t0, t1): whole tiles, then the last 1..M - 1 tokens in tiles of 2 */
static inline __attribute__((always_inline)) void tile_tokens(int T, const qmm_job *J, int64_t r, int nr,
                                                              int64_t t0, int64_t t1, int pf) {
    const int R = TILE_R(T), M = TILE_M(T);
    int64_t t = t0;
    for (; t + M <= t1; t += M, pf = 0) tile_rows(T, R, M, J, r, nr, t, M, pf);
    for (; t < t1; t += 2, pf = 0) tile_rows(T, R, 2, J, r, nr, t, t + 2 <= t1 ? 2 : 1, pf);
}

/* Tokens go in blocks whose activations stay in L1 while the rows [r0, r1) (in L2) pass over them. */
#define TOKEN_BLOCK_BYTES 4096

static inline __attribute__((always_inline)) void qmm_tiles(int T, const qmm_job *J, int64_t r0, int64_t r1) {
    const int M = TILE_M(T), R = TILE_R(T);
    int64_t tb = TOKEN_BLOCK_BYTES / J->k / M * M;
    if (tb < M) tb = M;
    for (int64_t b0 = 0; b0 < J->m; b0 += tb) {
        const int64_t b1 = J->m - b0 < tb ? J->m : b0 + tb;
        for (int64_t r = r0; r < r1; r += R) tile_tokens(T, J, r, r1 - r < R ? (int)(r1 - r) : R, b0, b1, b0 == 0);
    }
}

/* rows [r0, r1) of one job, all its tokens */
void ms_internal_qmm_rows(const qmm_job *J, int64_t r0, int64_t r1) { EACH_TYPE(qmm_tiles, J, r0, r1); }
#endif
