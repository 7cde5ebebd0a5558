/* The lane layout (described in internal.h): its sizes, GGUF rows packed into it, and back to floats. */
#include "internal.h"
#if defined(__BMI2__) && !defined(MS_SCALAR)
#include <immintrin.h>
#endif

/* IQ4_NL / IQ4_XS's 16 non-linear values (ggml's kvalues_iq4nl) */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's e2m1 values, doubled (ggml's kvalues_mxfp4) */
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---------------------------------------------------------------------------------------------------- */
/* layout sizes */

int64_t ms_lane_row_bytes(int type, int64_t k) {
    if (super_bytes(type) < 0) return MS_BAD_TYPE;
    if (!dim_ok(k) || k % (per32_type(type) ? 32 : 256)) return MS_BAD_SHAPE;
    return lane_row_bytes(type, k);
}

/* 2: the AVX-512 VNNI kernels, 1: the AVX2 ones, 0: none */
int ms_lane_supported(void) {
#if defined(MS_VNNI)
    return 2;
#elif defined(MS_AVX2_FMA)
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------------- */
/* packing GGUF rows into the lane layout (plain C: the compiler vectorizes the byte loops) */

/* 16 Q4_0-style bytes of one sub-block (byte i: weight i low, weight i+16 high) -> its lane in 4 chunks */
static inline void put_nibble_lane(const uint8_t qs[16], uint8_t *nib, int L, int j) {
    for (int c = 0; c < 4; c++) memcpy(nib + (c * L + j) * 4, qs + 4 * c, 4);
}

#ifdef MS_LANE
/* Four lanes j..j+3 at once: their 16-byte rows transposed as 4x4 dwords, so each chunk gets one 16-byte
 * store (the miss path packs every expert read from disk: this runs at memory speed, which the scalar loop
 * fell well short of). */
static inline void put_nibble_lanes4(__m128i r0, __m128i r1, __m128i r2, __m128i r3, uint8_t *nib, int L, int j) {
    __m128 a = _mm_castsi128_ps(r0), b = _mm_castsi128_ps(r1), c = _mm_castsi128_ps(r2), d = _mm_castsi128_ps(r3);
    _MM_TRANSPOSE4_PS(a, b, c, d);
    _mm_storeu_ps((float *)(nib + (0 * L + j) * 4), a);
    _mm_storeu_ps((float *)(nib + (1 * L + j) * 4), b);
    _mm_storeu_ps((float *)(nib + (2 * L + j) * 4), c);
    _mm_storeu_ps((float *)(nib + (3 * L + j) * 4), d);
}
#endif

static void pack_row_q4_0(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        uint8_t *nib = dst, *d = dst + 16 * L;
        int j = 0;
#ifdef MS_LANE
        for (; j + 4 <= L; j += 4) {
            const uint8_t *b = src + (s0 + j) * 18;
            put_nibble_lanes4(_mm_loadu_si128((const __m128i *)(b + 2)), _mm_loadu_si128((const __m128i *)(b + 20)),
                              _mm_loadu_si128((const __m128i *)(b + 38)), _mm_loadu_si128((const __m128i *)(b + 56)),
                              nib, L, j);
            memcpy(d + 2 * j, b, 2);
            memcpy(d + 2 * j + 2, b + 18, 2);
            memcpy(d + 2 * j + 4, b + 36, 2);
            memcpy(d + 2 * j + 6, b + 54, 2);
        }
#endif
        for (; j < L; j++) {
            const uint8_t *b = src + (s0 + j) * 18;
            put_nibble_lane(b + 2, nib, L, j);
            memcpy(d + 2 * j, b, 2);
        }
        dst += 18 * L;
    }
}

static void pack_row_q8_0(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        uint8_t *w = dst, *d = dst + 32 * L;
        for (int j = 0; j < L; j++) {
            const uint8_t *b = src + (s0 + j) * 34;
            for (int s = 0; s < 8; s++) {
                const uint8_t *q = b + 2 + 16 * (s & 1) + 4 * (s >> 1);
                uint8_t *o = w + (s * L + j) * 4;
                for (int t = 0; t < 4; t++) o[t] = q[t] ^ 0x80;
            }
            memcpy(d + 2 * j, b, 2);
        }
        dst += 34 * L;
    }
}

/* One K-quant super-block's 128 bytes of nibbles (q[32p..32p+32): sub-block 2p in the low nibbles, 2p+1 in
 * the high ones) -> lanes lane0..lane0+7 of a group's nibble chunks. */
static void k_nibble_lanes(const uint8_t *q, uint8_t *nib, int L, int lane0) {
#ifdef MS_LANE
    const __m128i m4 = _mm_set1_epi8(0x0F), m4h = _mm_set1_epi8((char)0xF0);
    __m128i lo[4], hi[4];
    for (int p = 0; p < 4; p++) {
        __m128i a0 = _mm_loadu_si128((const __m128i *)(q + 32 * p)), a1 = _mm_loadu_si128((const __m128i *)(q + 32 * p + 16));
        lo[p] = _mm_or_si128(_mm_and_si128(a0, m4), _mm_and_si128(_mm_slli_epi16(a1, 4), m4h));
        hi[p] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a0, 4), m4), _mm_and_si128(a1, m4h));
    }
    /* lanes lane0 + 2p (lo) and lane0 + 2p + 1 (hi) */
    put_nibble_lanes4(lo[0], hi[0], lo[1], hi[1], nib, L, lane0);
    put_nibble_lanes4(lo[2], hi[2], lo[3], hi[3], nib, L, lane0 + 4);
#else
    for (int p = 0; p < 4; p++) {
        uint8_t lo[16], hi[16];
        const uint8_t *a = q + 32 * p;
        for (int i = 0; i < 16; i++) {
            lo[i] = (a[i] & 0xF) | (uint8_t)((a[i + 16] & 0xF) << 4);
            hi[i] = (a[i] >> 4) | (uint8_t)(a[i + 16] & 0xF0);
        }
        put_nibble_lane(lo, nib, L, lane0 + 2 * p);
        put_nibble_lane(hi, nib, L, lane0 + 2 * p + 1);
    }
#endif
}

/* Q4_K (hb == NULL) and Q5_K rows: nibbles, then Q5_K's fifth bits, then scales, mins, d, dmin */
static void pack_row_k(const uint8_t *src, int64_t k, uint8_t *dst, int five) {
    int64_t nsup = k / 256;
    const int bb = five ? 176 : 144, qs = five ? 48 : 16;
    for (int64_t b0 = 0; b0 < nsup; b0 += 2) {
        int nb = nsup - b0 >= 2 ? 2 : 1, L = 8 * nb;
        uint8_t *nib = dst, *hb = dst + 16 * L, *sc = hb + (five ? 4 * L : 0), *mn = sc + L, *dd = mn + L, *dm = dd + 2 * nb;
        for (int bi = 0; bi < nb; bi++) {
            const uint8_t *b = src + (b0 + bi) * bb;
            k_scale_min(b + 4, sc + 8 * bi, mn + 8 * bi);
            memcpy(dd + 2 * bi, b, 2);
            memcpy(dm + 2 * bi, b + 2, 2);
            k_nibble_lanes(b + qs, nib, L, 8 * bi);
            if (!five) continue;
            const uint8_t *qh = b + 16; /* bit js of qh[l]: the fifth bit of weight l of sub-block js */
#ifdef MS_LANE
            {
                const __m128i one = _mm_set1_epi8(1), lo = _mm_loadu_si128((const __m128i *)qh);
                const __m128i hi = _mm_loadu_si128((const __m128i *)(qh + 16));
                for (int js = 0; js < 8; js++) {
                    __m128i v = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, js), one),
                                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hi, js), one), 1));
                    v = _mm_or_si128(v, _mm_slli_epi16(_mm_srli_epi64(v, 32), 2)); /* bytes t: v[t] | v[4+t] << 2 */
                    v = _mm_or_si128(v, _mm_slli_epi16(_mm_srli_si128(v, 8), 4));  /* | (v[8+t] | v[12+t] << 2) << 4 */
                    int32_t w = _mm_cvtsi128_si32(v);
                    memcpy(hb + (8 * bi + js) * 4, &w, 4);
                }
                continue;
            }
#endif
            for (int js = 0; js < 8; js++) {
                uint8_t *o = hb + (8 * bi + js) * 4;
                for (int t = 0; t < 4; t++) {
                    uint8_t v = 0;
                    for (int c = 0; c < 4; c++)
                        v |= (uint8_t)((((qh[4 * c + t] >> js) & 1) << (2 * c)) | (((qh[16 + 4 * c + t] >> js) & 1) << (2 * c + 1)));
                    o[t] = v;
                }
            }
        }
        dst += group_bytes(five ? QT_Q5_K : QT_Q4_K, L);
    }
}

/* Q6_K: its 256 six-bit values decoded, then each sub-block j of 32 put in lane 8 bi + j */
static void pack_row_q6_k(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsup = k / 256;
    for (int64_t b0 = 0; b0 < nsup; b0 += 2) {
        int nb = nsup - b0 >= 2 ? 2 : 1, L = 8 * nb;
        uint8_t *nib = dst, *hb = dst + 16 * L, *sc = hb + 8 * L, *dd = sc + 2 * L;
        for (int bi = 0; bi < nb; bi++) {
            const uint8_t *b = src + (b0 + bi) * 210, *scales = b + 192;
            memcpy(dd + 2 * bi, b + 208, 2);
            for (int js = 0; js < 8; js++) {
                sc[8 * bi + js] = scales[2 * js];
                sc[L + 8 * bi + js] = scales[2 * js + 1];
            }
#ifdef MS_LANE
            { /* as the loops below, 32 bytes at a time (this runs on the cache-miss path) */
                uint8_t q[256] __attribute__((aligned(32)));
                const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
                for (int n = 0; n < 2; n++) {
                    __m256i a0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
                    __m256i a1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
                    __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
                    __m256i *o = (__m256i *)(q + 128 * n);
                    for (int g = 0; g < 4; g++) {
                        __m256i a = (g & 1) ? a1 : a0;
                        if (g >= 2) a = _mm256_srli_epi16(a, 4);
                        __m256i hh = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), m3);
                        _mm256_store_si256(o + g, _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(hh, 4)));
                    }
                }
                const __m128i n4 = _mm_set1_epi8(0x0F), n4h = _mm_set1_epi8((char)0xF0), n3 = _mm_set1_epi8(3);
                __m128i rows[4];
                for (int js = 0; js < 8; js++) {
                    const int j = 8 * bi + js;
                    __m128i lo = _mm_load_si128((const __m128i *)(q + 32 * js)), hi = _mm_load_si128((const __m128i *)(q + 32 * js + 16));
                    rows[js & 3] = _mm_or_si128(_mm_and_si128(lo, n4), _mm_and_si128(_mm_slli_epi16(hi, 4), n4h));
                    __m128i v = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), n3), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hi, 4), n3), 2));
                    v = _mm_or_si128(v, _mm_slli_epi16(_mm_srli_epi64(v, 32), 4));
                    int32_t h0 = _mm_cvtsi128_si32(v), h1 = _mm_extract_epi32(v, 2);
                    memcpy(hb + j * 4, &h0, 4);
                    memcpy(hb + (L + j) * 4, &h1, 4);
                    if ((js & 3) == 3) put_nibble_lanes4(rows[0], rows[1], rows[2], rows[3], nib, L, j - 3);
                }
                continue;
            }
#endif
            uint8_t q[256];
            for (int n = 0; n < 2; n++) {
                const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
                uint8_t *o = q + 128 * n;
                for (int l = 0; l < 32; l++) {
                    o[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    o[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for (int js = 0; js < 8; js++) {
                const int j = 8 * bi + js;
                const uint8_t *w = q + 32 * js;
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < 4; t++)
                        nib[(c * L + j) * 4 + t] = (w[4 * c + t] & 0xF) | (uint8_t)((w[16 + 4 * c + t] & 0xF) << 4);
                for (int h = 0; h < 2; h++)
                    for (int t = 0; t < 4; t++)
                        hb[(h * L + j) * 4 + t] = (uint8_t)((w[8 * h + t] >> 4) | ((w[16 + 8 * h + t] >> 4) << 2) |
                                                            ((w[8 * h + 4 + t] >> 4) << 4) | ((w[16 + 8 * h + 4 + t] >> 4) << 6));
            }
        }
        dst += 26 * L + L / 4;
    }
}

/* IQ4_XS: its sub-blocks' 16 nibble bytes are laid out as Q4_0's; the 6-bit scales are unpacked to int8 */
static void pack_row_iq4_xs(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsup = k / 256;
    for (int64_t b0 = 0; b0 < nsup; b0 += 2) {
        int nb = nsup - b0 >= 2 ? 2 : 1, L = 8 * nb;
        uint8_t *nib = dst, *dd = dst + 17 * L;
        int8_t *sc = (int8_t *)(dst + 16 * L);
        for (int bi = 0; bi < nb; bi++) {
            const uint8_t *b = src + (b0 + bi) * 136;
            const uint16_t sh = rd16(b + 2);
            memcpy(dd + 2 * bi, b, 2);
            for (int ib = 0; ib < 8; ib++) {
                int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
                sc[8 * bi + ib] = (int8_t)(ls - 32);
                put_nibble_lane(b + 8 + 16 * ib, nib, L, 8 * bi + ib);
            }
        }
        dst += group_bytes(QT_IQ4_XS, L);
    }
}

/* Q2_K / Q3_K: the 256 values of a super-block (Q3_K: with its third bit, 0..7), then sub-block js's 32 of them
 * into lane j's pair bytes (and Q3_K's high-bit bytes) in step order */
static void put_pair_lanes(const uint8_t q[256], uint8_t *pairs, uint8_t *hb, int L, int lane0) {
    for (int js = 0; js < 8; js++) {
        const uint8_t *w = q + 32 * js;
        const int j = lane0 + js;
        for (int t = 0; t < 4; t++) {
            uint8_t p[2] = {0, 0}, h = 0;
            for (int s = 0; s < 8; s++) {
                uint8_t v = w[16 * (s & 1) + 4 * (s >> 1) + t];
                p[s >> 2] |= (uint8_t)((v & 3) << (2 * (s & 3)));
                h |= (uint8_t)(((v >> 2) & 1) << s);
            }
            pairs[j * 4 + t] = p[0];
            pairs[(L + j) * 4 + t] = p[1];
            if (hb) hb[j * 4 + t] = h;
        }
    }
}

static void pack_row_q2_q3(const uint8_t *src, int64_t k, uint8_t *dst, int three) {
    int64_t nsup = k / 256;
    for (int64_t b0 = 0; b0 < nsup; b0 += 2) {
        int nb = nsup - b0 >= 2 ? 2 : 1, L = 8 * nb;
        uint8_t *pairs = dst, *hb = three ? dst + 8 * L : NULL, *sc = dst + (three ? 12 : 8) * L, *dd = sc + 2 * L;
        for (int bi = 0; bi < nb; bi++) {
            const uint8_t *b = src + (b0 + bi) * (three ? 110 : 84);
            const uint8_t *qs = b + (three ? 32 : 16);
            uint8_t q[256];
            /* weight 128h + 32j + l: bits 2j of qs[32h + l]; Q3_K's third bit: bit 4h + j of hmask[l] */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        uint8_t v = (qs[32 * h + l] >> (2 * j)) & 3;
                        if (three) v |= (uint8_t)(((b[l] >> (4 * h + j)) & 1) << 2);
                        q[128 * h + 32 * j + l] = v;
                    }
            put_pair_lanes(q, pairs, hb, L, 8 * bi);
            /* scale i covers weights 16i..16i+15: sub-block i / 2, half i % 2 */
            for (int i = 0; i < 16; i++) {
                uint8_t v;
                if (three) {
                    const uint8_t *s3 = b + 96;
                    int lo = (s3[i & 7] >> (4 * (i >> 3))) & 0xF, hi = (s3[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
                    v = (uint8_t)(int8_t)((lo | (hi << 4)) - 32);
                } else {
                    v = b[i];
                }
                sc[(i & 1) * L + 8 * bi + i / 2] = v;
            }
            memcpy(dd + 2 * bi, b + (three ? 108 : 80), 2);
            if (!three) memcpy(dd + 2 * nb + 2 * bi, b + 82, 2);
        }
        dst += group_bytes(three ? QT_Q3_K : QT_Q2_K, L);
    }
}

/* Q5_0 / Q5_1's 32 fifth bits (bit i: weight i) -> the 4 fifth-bit bytes of its lane: byte t holds in bits 2c
 * and 2c + 1 the fifth bits of weights 4c + t and 16 + 4c + t (chunk c's low and high nibble) */
static inline uint32_t fifth_bit_bytes(uint32_t qh) {
    uint32_t out = 0;
#if defined(__BMI2__) && !defined(MS_SCALAR)
    for (int t = 0; t < 4; t++) { /* bits t + 4i: chunk 0..3's low-nibble weights, then their high ones */
        uint32_t x = _pext_u32(qh, 0x11111111u << t);
        out |= (_pdep_u32(x & 0xF, 0x55) | _pdep_u32(x >> 4, 0xAA)) << (8 * t);
    }
    return out;
#endif
    for (int t = 0; t < 4; t++) {
        uint32_t b = 0;
        for (int c = 0; c < 4; c++) b |= ((qh >> (4 * c + t)) & 1) << (2 * c) | ((qh >> (16 + 4 * c + t)) & 1) << (2 * c + 1);
        out |= b << (8 * t);
    }
    return out;
}

/* Q5_0 (one = 0) and Q5_1 rows: nibbles as Q4_0's, fifth bits, d (and Q5_1's m) */
static void pack_row_q5(const uint8_t *src, int64_t k, uint8_t *dst, int one) {
    const int bb = one ? 24 : 22, off = one ? 4 : 2; /* block bytes; where qh starts */
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        uint8_t *nib = dst, *hb = dst + 16 * L, *d = hb + 4 * L;
        for (int j = 0; j < L; j++) {
            const uint8_t *b = src + (s0 + j) * bb;
            uint32_t qh;
            memcpy(&qh, b + off, 4);
            qh = fifth_bit_bytes(qh);
            memcpy(hb + 4 * j, &qh, 4);
            put_nibble_lane(b + off + 4, nib, L, j);
            memcpy(d + 2 * j, b, 2);
            if (one) memcpy(d + 2 * L + 2 * j, b + 2, 2);
        }
        dst += group_bytes(one ? QT_Q5_1 : QT_Q5_0, L);
    }
}

/* Q4_1 rows: nibbles as Q4_0's (its qs bytes are laid out the same), then d, then m */
static void pack_row_q4_1(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        uint8_t *nib = dst, *d = dst + 16 * L;
        for (int j = 0; j < L; j++) {
            const uint8_t *b = src + (s0 + j) * 20;
            put_nibble_lane(b + 4, nib, L, j);
            memcpy(d + 2 * j, b, 2);
            memcpy(d + 2 * L + 2 * j, b + 2, 2);
        }
        dst += group_bytes(QT_Q4_1, L);
    }
}

/* MXFP4: nibbles as Q4_0's (its qs bytes are laid out the same), then the exponent bytes */
static void pack_row_mxfp4(const uint8_t *src, int64_t k, uint8_t *dst) {
    int64_t nsub = k / 32;
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = group_lanes(nsub, s0);
        uint8_t *nib = dst, *e = dst + 16 * L;
        int j = 0;
#ifdef MS_LANE
        for (; j + 4 <= L; j += 4) {
            const uint8_t *b = src + (s0 + j) * 17;
            put_nibble_lanes4(_mm_loadu_si128((const __m128i *)(b + 1)), _mm_loadu_si128((const __m128i *)(b + 18)),
                              _mm_loadu_si128((const __m128i *)(b + 35)), _mm_loadu_si128((const __m128i *)(b + 52)),
                              nib, L, j);
            e[j] = b[0], e[j + 1] = b[17], e[j + 2] = b[34], e[j + 3] = b[51];
        }
#endif
        for (; j < L; j++) {
            const uint8_t *b = src + (s0 + j) * 17;
            put_nibble_lane(b + 1, nib, L, j);
            e[j] = b[0];
        }
        dst += 17 * L;
    }
}

static const int64_t gguf_block_bytes[] = {[QT_Q4_0] = 18, [QT_Q8_0] = 34, [QT_Q2_K] = 84, [QT_Q3_K] = 110,
                                           [QT_Q4_K] = 144, [QT_Q5_K] = 176, [QT_Q6_K] = 210, [QT_IQ4_XS] = 136,
                                           [QT_Q5_0] = 22, [QT_Q5_1] = 24, [QT_MXFP4] = 17, [QT_Q4_1] = 20};
static const int64_t gguf_block_elems[] = {[QT_Q4_0] = 32, [QT_Q8_0] = 32, [QT_Q2_K] = 256, [QT_Q3_K] = 256,
                                           [QT_Q4_K] = 256, [QT_Q5_K] = 256, [QT_Q6_K] = 256, [QT_IQ4_XS] = 256,
                                           [QT_Q5_0] = 32, [QT_Q5_1] = 32, [QT_MXFP4] = 32, [QT_Q4_1] = 32};

/* rows [0, n) of a GGUF [n, k] tensor -> the lane layout at dst (ms_lane_row_bytes(type, k) per row) */
int ms_lane_pack(int type, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    int64_t rb = ms_lane_row_bytes(type, k);
    if (rb < 0) return (int)rb;
    if (!dims_ok(n, k)) return MS_BAD_SHAPE;
    if (!src || !dst) return MS_BAD_PTR;
    int64_t sb = k / gguf_block_elems[type] * gguf_block_bytes[type];
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *s = src + r * sb;
        uint8_t *d = dst + r * rb;
        if (type == QT_Q4_0) pack_row_q4_0(s, k, d);
        else if (type == QT_Q8_0) pack_row_q8_0(s, k, d);
        else if (type == QT_Q4_K || type == QT_Q5_K) pack_row_k(s, k, d, type == QT_Q5_K);
        else if (type == QT_IQ4_XS) pack_row_iq4_xs(s, k, d);
        else if (type == QT_Q2_K || type == QT_Q3_K) pack_row_q2_q3(s, k, d, type == QT_Q3_K);
        else if (type == QT_Q5_0 || type == QT_Q5_1) pack_row_q5(s, k, d, type == QT_Q5_1);
        else if (type == QT_MXFP4) pack_row_mxfp4(s, k, d);
        else if (type == QT_Q4_1) pack_row_q4_1(s, k, d);
        else pack_row_q6_k(s, k, d);
    }
    return MS_OK;
}

/* The float weights of the lane layout, row by row (tests and the bf16 expansion for long prompts). */
int ms_lane_unpack(int type, const uint8_t *w, int64_t n, int64_t k, float *out) {
    int64_t rb = ms_lane_row_bytes(type, k);
    if (rb < 0) return (int)rb;
    if (!dims_ok(n, k)) return MS_BAD_SHAPE;
    if (!w || !out || (uintptr_t)out % 4) return MS_BAD_PTR;
    int64_t nsub = k / 32;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *g = w + r * rb;
        float *y = out + r * k;
        for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
            int L = group_lanes(nsub, s0);
            for (int j = 0; j < L; j++) {
                float *o = y + (s0 + j) * 32;
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) {
                        int i = 16 * (s & 1) + 4 * (s >> 1) + t;
                        float v;
                        if (type == QT_Q8_0) {
                            v = (float)(int8_t)(g[(s * L + j) * 4 + t] ^ 0x80) * rd_fp16((g + 32 * L + 2 * j));
                        } else if (type == QT_Q6_K) {
                            int c = s >> 1;
                            uint8_t byte = g[(c * L + j) * 4 + t];
                            uint8_t h = (uint8_t)(g[16 * L + ((c >> 1) * L + j) * 4 + t] >> (4 * (c & 1)));
                            int q = (s & 1) ? (byte >> 4) | (((h >> 2) & 3) << 4) : (byte & 0xF) | ((h & 3) << 4);
                            const int8_t *sc = (const int8_t *)(g + 24 * L);
                            v = rd_fp16((g + 26 * L + 2 * (j / 8))) * (float)sc[(s & 1) * L + j] * (float)(q - 32);
                        } else if (type == QT_Q2_K || type == QT_Q3_K) {
                            int q = (g[((s >> 2) * L + j) * 4 + t] >> (2 * (s & 3))) & 3;
                            if (type == QT_Q3_K) {
                                q |= ((g[8 * L + j * 4 + t] >> s) & 1) << 2;
                                const int8_t *sc = (const int8_t *)(g + 12 * L);
                                v = rd_fp16((g + 14 * L + 2 * (j / 8))) * (float)sc[(s & 1) * L + j] * (float)(q - 4);
                            } else {
                                const uint8_t scm = g[8 * L + (s & 1) * L + j], *dd = g + 10 * L;
                                float d = rd_fp16((dd + 2 * (j / 8))), dmin = rd_fp16((dd + L / 4 + 2 * (j / 8)));
                                v = d * (float)(scm & 0xF) * (float)q - dmin * (float)(scm >> 4);
                            }
                        } else if (type == QT_MXFP4) {
                            uint8_t byte = g[((s >> 1) * L + j) * 4 + t];
                            v = mxfp4_scale(g[16 * L + j]) * (float)mxfp4_values[(s & 1) ? byte >> 4 : byte & 0xF];
                        } else if (type == QT_IQ4_XS) {
                            uint8_t byte = g[((s >> 1) * L + j) * 4 + t];
                            const int8_t *sc = (const int8_t *)(g + 16 * L);
                            v = rd_fp16((g + 17 * L + 2 * (j / 8))) * (float)sc[j] * (float)iq4_values[(s & 1) ? byte >> 4 : byte & 0xF];
                        } else {
                            uint8_t byte = g[((s >> 1) * L + j) * 4 + t];
                            int q = (s & 1) ? byte >> 4 : byte & 0xF;
                            if (type == QT_Q5_K || type == QT_Q5_0 || type == QT_Q5_1)
                                q |= ((g[16 * L + j * 4 + t] >> s) & 1) << 4; /* bit 2c + (s & 1) = s */
                            if (type == QT_Q4_0) v = (float)(q - 8) * rd_fp16((g + 16 * L + 2 * j));
                            else if (type == QT_Q5_0) v = rd_fp16(g + 20 * L + 2 * j) * (float)(q - 16);
                            else if (type == QT_Q5_1) v = rd_fp16(g + 20 * L + 2 * j) * (float)q + rd_fp16(g + 22 * L + 2 * j);
                            else if (type == QT_Q4_1) v = rd_fp16(g + 16 * L + 2 * j) * (float)q + rd_fp16(g + 18 * L + 2 * j);
                            else {
                                const uint8_t *sc = g + (type == QT_Q5_K ? 20 : 16) * L, *mn = sc + L, *dd = mn + L,
                                              *dm = dd + 2 * (L / 8);
                                float d = rd_fp16((dd + 2 * (j / 8))), dmin = rd_fp16((dm + 2 * (j / 8)));
                                v = d * (float)sc[j] * (float)q - dmin * (float)mn[j];
                            }
                        }
                        o[i] = v;
                    }
            }
            g += group_bytes(type, L);
        }
    }
    return MS_OK;
}

/* ---------------------------------------------------------------------------------------------------- */
/* packing on the pool */

/* Several GGUF segments -> the lane layout at once, their rows spread over the pool: the model's thread packs
 * a batch of finished reads while the pool's other threads would otherwise wait for its next call. */
typedef struct {
    const int *types;
    const uint8_t *const *srcs;
    const int64_t *ns, *ks;
    uint8_t *const *dsts;
    int64_t parts; /* row chunks per segment */
    _Atomic int rc;
} pack_many_ctx;

static void pack_many_task(void *c, int64_t t) {
    pack_many_ctx *x = c;
    int64_t s = t / x->parts, part = t % x->parts;
    int64_t n = x->ns[s], k = x->ks[s], per = (n + x->parts - 1) / x->parts;
    int64_t r0 = part * per, r1 = r0 + per < n ? r0 + per : n;
    if (r0 >= r1) return;
    int type = x->types[s];
    int64_t rb = ms_lane_row_bytes(type, k);
    int64_t sb = k / gguf_block_elems[type] * gguf_block_bytes[type];
    int rc = ms_lane_pack(type, x->srcs[s] + r0 * sb, r1 - r0, k, x->dsts[s] + r0 * rb);
    if (rc != MS_OK) atomic_store(&x->rc, rc);
}

int ms_lane_pack_many(int count, const int *types, const uint8_t *const *srcs, const int64_t *ns, const int64_t *ks,
                      uint8_t *const *dsts) {
    if (count < 0) return MS_BAD_SHAPE;
    if (count == 0) return MS_OK;
    if (!types || !srcs || !ns || !ks || !dsts) return MS_BAD_PTR;
    for (int i = 0; i < count; i++) {
        int64_t rb = ms_lane_row_bytes(types[i], ks[i]);
        if (rb < 0) return (int)rb;
        if (!dims_ok(ns[i], ks[i])) return MS_BAD_SHAPE;
        if (!srcs[i] || !dsts[i]) return MS_BAD_PTR;
    }
    int threads = ms_internal_threads();
    pack_many_ctx x = {types, srcs, ns, ks, dsts, count >= 2 * threads ? 1 : (2 * threads + count - 1) / count, MS_OK};
    ms_internal_dispatch(pack_many_task, &x, count * x.parts);
    return atomic_load(&x.rc);
}
