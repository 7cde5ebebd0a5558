/* moestream quantized matmul: y = x @ W.T with W kept at 4 or 8 bits, x quantized to int8 per 32 values.
 *
 * Weights are held in a "lane" layout made from GGUF Q4_0 / Q4_K / Q8_0 blocks by a cheap reshuffle
 * (ms_lane_pack, about a memcpy's cost, so it can sit on the cache-miss path):
 *
 *   A row is cut into groups of 16 sub-blocks of 32 weights (the last group of a row may hold 8).
 *   In a group, int32 lane j of every 64-byte vector belongs to sub-block j, so one VNNI dot product
 *   (vpdpbusd, 4 u8 x s8 products per lane) advances all 16 sub-blocks by 4 weights, and after 8 of them
 *   each lane holds the whole integer dot product of its sub-block: one convert and one fused multiply-add
 *   with the lane's scale per 512 weights, instead of a scale step per block.
 *
 *   4-bit chunk c (0..3), lane j, byte t: low nibble = weight 4c+t of sub-block j, high = weight 16+4c+t
 *   (exactly the byte qs[4c+t] of a Q4_0 block, so Q4_0 packs by moving dwords).
 *   8-bit step s = 2h+... see x_step(): step s holds weights 16*(s&1) + 4*(s>>1) + t, stored as u8 (w ^ 0x80).
 *
 *   per group of L lanes:
 *     Q4_0: nibbles [4][L][4] | d f16 [L]                                   18 L bytes (as GGUF)
 *     Q4_K: nibbles [4][L][4] | sc u8 [L] | m u8 [L] | d f16 [L/8] | dmin f16 [L/8]   18.5 L bytes
 *     Q8_0: bytes   [8][L][4] | d f16 [L]                                   34 L bytes (as GGUF)
 *     Q5_K: nibbles [4][L][4] | fifth bits [L][4] | then as Q4_K                     22.5 L bytes (GGUF: 22)
 *     Q6_K: nibbles [4][L][4] | high bits [2][L][4] | sc s8 [2][L] | d f16 [L/8]   26.25 L bytes (as GGUF)
 *     IQ4_XS: nibbles [4][L][4] | sc s8 [L] | d f16 [L/8]                           17.25 L bytes (GGUF: 17)
 *     Q3_K: pairs [2][L][4] | high bits [L][4] | sc s8 [2][L] | d f16 [L/8]         14.25 L bytes (GGUF: 13.75)
 *     Q2_K: pairs [2][L][4] | sc|m<<4 u8 [2][L] | d f16 [L/8] | dmin f16 [L/8]      10.5 L bytes (as GGUF)
 *
 *   Q4_0 weight = d (q - 8); Q4_K and Q5_K weight = d sc q - dmin m; Q8_0 weight = d q;
 *   Q6_K weight = d sc (q - 32); IQ4_XS weight = d sc kvalues[q].
 *
 *   Q2_K and Q3_K keep 2 bits a weight: pair byte (p, j, t) holds in bits 2i, 2i+1 the weight of step 4p + i.
 *   Q3_K's high-bit byte (j, t) holds in bit s the third bit of step s's weight, so its weights are 0..7 and
 *   weight = d sc (q - 4). Both have a scale per 16 weights, kept for the two halves apart as Q6_K's;
 *   Q2_K weight = d sc q - dmin m, its mins taken off with the activations' per-half sums.
 *
 *   IQ4_XS's nibbles index a table of 16 int8 values; the kernel looks them up (vpshufb) as kvalues + 128,
 *   unsigned as the VNNI product wants, and takes 128 * sum(x) back off, as Q8_0 does.
 *
 *   Q5_K's fifth-bit byte (j, t) holds, in bits 2c and 2c+1, the fifth bit of the weights of chunk c's low
 *   and high nibble.
 *
 *   Q6_K has a scale per 16 weights. Even steps hold weights 0..15 of a sub-block and odd steps 16..31, so
 *   the two halves accumulate apart (sc [0][L] is the first half's scale, sc [1][L] the second's) and the
 *   -32 offset uses the activations' per-half sums. Its 6-bit values keep their low 4 bits where Q4_K keeps
 *   its nibbles; high-bit byte (h, j, t) holds the top 2 bits of the weights of chunk 2h (bits 0-3: low then
 *   high nibble's weight) and of chunk 2h+1 (bits 4-7).
 *
 * Activations: each row of x is quantized to int8 with one scale per 32 values (like llama.cpp's q8_0)
 * and laid out in the same step order, with the per-sub-block sums the offsets need.
 *
 * Work is spread over a small pool of pthreads (ms_set_threads); the calling thread works too. Workers spin
 * briefly between calls (a decode step issues several back to back), then sleep on a futex.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(MS_SCALAR)
#include <immintrin.h>
#define MS_VNNI 1
#endif

/* Software prefetch into L2, 16 KiB ahead: with only the hardware prefetcher a core streamed weights from RAM
 * at about half the rate it computes them (16 vs 32 G weights/s measured on the 2-core EPYC). */
#define PF_DIST 16384
#define PF_HINT _MM_HINT_T1

enum { QT_Q4_0 = 2, QT_Q8_0 = 8, QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_IQ4_XS = 23 };

/* IQ4_NL / IQ4_XS's 16 non-linear values (ggml's kvalues_iq4nl) */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---------------------------------------------------------------------------------------------------- */
/* layout sizes */

/* bytes of one group of L lanes (see the layout above) */
static inline int64_t group_bytes(int type, int L) {
    switch (type) {
    case QT_Q8_0: return 34 * L;
    case QT_Q4_0: return 18 * L;
    case QT_Q4_K: return 18 * L + L / 2;
    case QT_Q5_K: return 22 * L + L / 2;
    case QT_IQ4_XS: return 17 * L + L / 4;
    case QT_Q3_K: return 14 * L + L / 4;
    case QT_Q2_K: return 10 * L + L / 2;
    default: return 26 * L + L / 4; /* Q6_K */
    }
}

static int64_t super_bytes(int type) { /* bytes per 256 weights (8 lanes) of a row */
    switch (type) {
    case QT_Q4_0: return 144;
    case QT_Q4_K: return 148;
    case QT_Q5_K: return 180;
    case QT_Q8_0: return 272;
    case QT_Q6_K: return 210;
    case QT_IQ4_XS: return 138;
    case QT_Q3_K: return 114;
    case QT_Q2_K: return 84;
    default: return -1;
    }
}

int64_t ms_lane_row_bytes(int type, int64_t k) {
    if (super_bytes(type) < 0) return MS_BAD_TYPE;
    if (!dim_ok(k) || k % 256) return MS_BAD_SHAPE;
    return super_bytes(type) * (k / 256);
}

int ms_lane_supported(void) {
#ifdef MS_VNNI
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

#ifdef MS_VNNI
/* Four lanes j..j+3 at once: their 16-byte rows transposed as 4x4 dwords, so each chunk gets one 16-byte
 * store (the miss path packs every expert read from disk: this runs at memory speed, the scalar loop did
 * ~5 GB/s). */
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
        int L = nsub - s0 >= 16 ? 16 : 8;
        uint8_t *nib = dst, *d = dst + 16 * L;
        int j = 0;
#ifdef MS_VNNI
        for (; j < L; j += 4) {
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
        int L = nsub - s0 >= 16 ? 16 : 8;
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
#ifdef MS_VNNI
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
#ifdef MS_VNNI
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
#ifdef MS_VNNI
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

static const int64_t gguf_block_bytes[] = {[QT_Q4_0] = 18, [QT_Q8_0] = 34, [QT_Q2_K] = 84, [QT_Q3_K] = 110,
                                           [QT_Q4_K] = 144, [QT_Q5_K] = 176, [QT_Q6_K] = 210, [QT_IQ4_XS] = 136};
static const int64_t gguf_block_elems[] = {[QT_Q4_0] = 32, [QT_Q8_0] = 32, [QT_Q2_K] = 256, [QT_Q3_K] = 256,
                                           [QT_Q4_K] = 256, [QT_Q5_K] = 256, [QT_Q6_K] = 256, [QT_IQ4_XS] = 256};

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
            int L = nsub - s0 >= 16 ? 16 : 8;
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
                        } else if (type == QT_IQ4_XS) {
                            uint8_t byte = g[((s >> 1) * L + j) * 4 + t];
                            const int8_t *sc = (const int8_t *)(g + 16 * L);
                            v = rd_fp16((g + 17 * L + 2 * (j / 8))) * (float)sc[j] * (float)iq4_values[(s & 1) ? byte >> 4 : byte & 0xF];
                        } else {
                            uint8_t byte = g[((s >> 1) * L + j) * 4 + t];
                            int q = (s & 1) ? byte >> 4 : byte & 0xF;
                            if (type == QT_Q5_K) q |= ((g[16 * L + j * 4 + t] >> s) & 1) << 4; /* bit 2c + (s & 1) = s */
                            if (type == QT_Q4_0) v = (float)(q - 8) * rd_fp16((g + 16 * L + 2 * j));
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
/* thread pool */

#define MAX_THREADS 64
typedef void (*task_fn)(void *ctx, int64_t task);

static struct {
    int n;                      /* workers (not counting the caller) */
    pthread_t th[MAX_THREADS];
    _Atomic uint32_t gen;       /* bumped per dispatch; workers futex-wait on it */
    _Atomic int64_t next;       /* next task index to claim */
    _Atomic int active;         /* workers still inside the current dispatch */
    _Atomic int sleepers;
    task_fn fn;
    void *ctx;
    int64_t ntasks;
    pthread_mutex_t mu;         /* one dispatch at a time (callers from several Python threads) */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER};

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* How long an idle worker spins before sleeping on the futex. Long in decode (the next call comes within
 * a few hundred us, and waking from the futex costs more than that here); short when other threads need
 * the cores between calls (reader threads packing a prompt's misses). */
static _Atomic double spin_s = 2e-3;

void ms_set_spin_us(double us) { atomic_store(&spin_s, us >= 0 && us <= 1e6 ? us * 1e-6 : us > 1e6 ? 1.0 : 0.0); }

static void run_tasks(void) {
    int64_t t;
    while ((t = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed)) < P.ntasks) P.fn(P.ctx, t);
}

static void *worker(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the generation when it was created: never miss a dispatch */
    for (;;) {
        uint32_t g;
        double t0 = 0;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < 64) { cpu_relax(); continue; }
            spins = 0;
            double el = 0;
            if (t0 == 0) t0 = now_s();
            else el = now_s() - t0;
            /* past the first 50 us, offer the core to any runnable thread (reader threads submitting reads
             * or packing) while still answering the next call within a few us */
            if (el > 50e-6) sched_yield();
            if (el > atomic_load_explicit(&spin_s, memory_order_relaxed)) {
                atomic_fetch_add(&P.sleepers, 1);
                syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = 0;
            }
        }
        seen = g;
        run_tasks();
        atomic_fetch_sub_explicit(&P.active, 1, memory_order_release);
    }
    return NULL;
}

/* Use `n` threads in all (the caller plus n - 1 workers). Threads are only ever added. */
int ms_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&P.mu);
    while (P.n < n - 1) {
        void *gen = (void *)(uintptr_t)atomic_load(&P.gen);
        if (pthread_create(&P.th[P.n], NULL, worker, gen) != 0) break;
        pthread_detach(P.th[P.n]);
        P.n++;
    }
    pthread_mutex_unlock(&P.mu);
    return P.n + 1;
}

static void dispatch(task_fn fn, void *ctx, int64_t ntasks) {
    if (P.n == 0 || ntasks == 1) {
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&P.mu);
    P.fn = fn;
    P.ctx = ctx;
    P.ntasks = ntasks;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    atomic_store_explicit(&P.active, P.n, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (atomic_load(&P.sleepers)) syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    run_tasks();
    int spins = 0;
    while (atomic_load_explicit(&P.active, memory_order_acquire) > 0) {
        if (++spins < 4096) cpu_relax();
        else sched_yield(); /* a worker was descheduled: let it run */
    }
    pthread_mutex_unlock(&P.mu);
}

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
    int threads = P.n + 1;
    pack_many_ctx x = {types, srcs, ns, ks, dsts, count >= 2 * threads ? 1 : (2 * threads + count - 1) / count, MS_OK};
    dispatch(pack_many_task, &x, count * x.parts);
    return atomic_load(&x.rc);
}

/* ---------------------------------------------------------------------------------------------------- */
/* activations */

typedef struct {
    int8_t *q;    /* [M][K] in step order per group */
    float *dx;    /* [M][K/32] lane scales */
    float *dxsx;  /* [M][K/32] dx * sum(q) (Q4_K mins) */
    int32_t *n8sx;/* [M][K/32] -8 * sum(q) (Q4_0 offset; x16 for Q8_0) */
    int32_t *n32lo, *n32hi; /* [M][K/32] -32 * sum(q) over each half of 16 (Q6_K offset) */
} xprep;

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

/* one row of x (K floats) -> int8 in lane step order */
#ifdef MS_VNNI
static void quantize_row(const float *x, int64_t k, const xprep *p, int64_t row) {
    const xprep r = xprep_from(p, row, k);
    int8_t *q = r.q;
    int64_t nsub = k / 32;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
        int L = nsub - s0 >= 16 ? 16 : 8;
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
            int lo_sum = _mm512_reduce_add_epi32(i0), hi_sum = _mm512_reduce_add_epi32(i1), sum = lo_sum + hi_sum;
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
            r.dx[s0 + j] = d;
            r.dxsx[s0 + j] = d * (float)sum;
            r.n8sx[s0 + j] = -8 * sum;
            r.n32lo[s0 + j] = -32 * lo_sum;
            r.n32hi[s0 + j] = -32 * hi_sum;
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
        int L = nsub - s0 >= 16 ? 16 : 8;
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
            int sum = half[0] + half[1];
            for (int s = 0; s < 8; s++) memcpy(q + (s * L + j) * 4, qq + 16 * (s & 1) + 4 * (s >> 1), 4);
            r.dx[s0 + j] = d;
            r.dxsx[s0 + j] = d * (float)sum;
            r.n8sx[s0 + j] = -8 * sum;
            r.n32lo[s0 + j] = -32 * half[0];
            r.n32hi[s0 + j] = -32 * half[1];
        }
        q += 32 * L;
    }
}
#endif

/* ---------------------------------------------------------------------------------------------------- */
/* the dot products */

typedef struct {
    int type;
    const uint8_t *w;   /* lane layout, [N] rows of ms_lane_row_bytes */
    int64_t n, k;
    const xprep *x;     /* M rows prepared */
    int64_t m;
    float *y;           /* y[i * ldy + r] */
    int64_t ldy;
} qmm_job;

#define MT 4 /* tokens per register tile */

#ifdef MS_VNNI
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static void qmm_rows(const qmm_job *J, int64_t r0, int64_t r1);

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

static inline __attribute__((always_inline)) void group_scales(int T, const uint8_t *g, int L, __mmask16 mf,
                                                               __m512 *scale, __m512 *mins) {
    if (T == QT_Q8_0) *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 32 * L));
    else if (T == QT_Q4_0) *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mf, g + 16 * L));
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


#define LDB(L, p) ((L) == 16 ? _mm512_loadu_si512((const void *)(p)) : _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(p))))
#define LDF(L, p) ((L) == 16 ? _mm512_loadu_ps(p) : _mm512_zextps256_ps512(_mm256_loadu_ps(p)))
#define LDI(L, p) ((L) == 16 ? _mm512_loadu_si512((const void *)(p)) : _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(p))))

/* Q6_K chunk c of a group: its 6-bit weights for the even step (w0) and the odd step (w1), from the chunk's
 * nibbles v and its pair's high-bit bytes h (already shifted right by 4 for an odd chunk) */
/* IQ4_XS's values + 128 (unsigned, for vpdpbusd) in each 128-bit lane, for vpshufb lookups by nibble */
static inline __m512i iq4_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153,
                                                (char)166, (char)181, (char)197, (char)217, (char)241));
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

/* One group (L = 16 or 8 lanes, a constant) of two rows against one token. */
static inline __attribute__((always_inline)) void qmv2_group(int T, int L, const uint8_t *ga, const uint8_t *gb,
                                                             const int8_t *xq, const xprep *x, int64_t s0,
                                                             __m512 *acca, __m512 *accb) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __mmask16 mf = L == 16 ? 0xFFFF : 0x00FF;
    const int cb = 4 * L;
    for (int64_t o = 0; o < group_bytes(T, L); o += 64) {
        _mm_prefetch((const char *)ga + PF_DIST + o, PF_HINT);
        _mm_prefetch((const char *)gb + PF_DIST + o, PF_HINT);
    }
    __m512i a0, a1, b0, b1;
    if (T == QT_Q4_K || T == QT_Q5_K || T == QT_Q2_K) {
        a0 = b0 = _mm512_setzero_si512();
    } else if (T == QT_Q6_K) {
        a0 = b0 = LDI(L, x->n32lo + s0);
    } else if (T == QT_Q3_K) { /* -4 * (half sums) */
        a0 = b0 = _mm512_srai_epi32(LDI(L, x->n32lo + s0), 3);
    } else {
        a0 = LDI(L, x->n8sx + s0);
        if (T == QT_Q8_0 || T == QT_IQ4_XS) a0 = _mm512_slli_epi32(a0, 4);
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
    } else if (T == QT_Q5_K) {
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
    } else if (T == QT_IQ4_XS) {
        const __m512i tbl = iq4_table();
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
}

static inline __attribute__((always_inline)) void qmv2(int T, const qmm_job *J, int64_t r0, int64_t r1) {
    const int64_t k = J->k, nsub = k / 32, rb = ms_lane_row_bytes(T, k);
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
        if (s0 < nsub) qmv2_group(T, 8, ga, gb, xq, J->x, s0, &acca, &accb);
        J->y[r] = hsum(acca);
        J->y[r + 1] = hsum(accb);
    }
    if (r < r1) qmm_rows(J, r, r1);
}

static void qmv_rows(const qmm_job *J, int64_t r0, int64_t r1) {
    if (J->type == QT_Q4_0) qmv2(QT_Q4_0, J, r0, r1);
    else if (J->type == QT_Q4_K) qmv2(QT_Q4_K, J, r0, r1);
    else if (J->type == QT_Q5_K) qmv2(QT_Q5_K, J, r0, r1);
    else if (J->type == QT_Q6_K) qmv2(QT_Q6_K, J, r0, r1);
    else if (J->type == QT_IQ4_XS) qmv2(QT_IQ4_XS, J, r0, r1);
    else if (J->type == QT_Q3_K) qmv2(QT_Q3_K, J, r0, r1);
    else if (J->type == QT_Q2_K) qmv2(QT_Q2_K, J, r0, r1);
    else qmv2(QT_Q8_0, J, r0, r1);
}

/* rows [r0, r1) of one job, all its tokens */
static void qmm_rows(const qmm_job *J, int64_t r0, int64_t r1) {
    const int type = J->type;
    const int64_t k = J->k, nsub = k / 32, rb = ms_lane_row_bytes(type, k);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = J->w + r * rb;
        for (int64_t m0 = 0; m0 < J->m; m0 += MT) {
            const int mt = J->m - m0 < MT ? (int)(J->m - m0) : MT;
            __m512 acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
            const uint8_t *g = row;
            int8_t *xq[MT];
            for (int i = 0; i < mt; i++) xq[i] = J->x->q + (m0 + i) * k;
            for (int64_t s0 = 0; s0 < nsub; s0 += 16) {
                const int L = nsub - s0 >= 16 ? 16 : 8;
                const __mmask64 mb = L == 16 ? ~(__mmask64)0 : 0xFFFFFFFFull;
                const __mmask16 mf = L == 16 ? 0xFFFF : 0x00FF;
                const int cb = 4 * L; /* bytes per chunk / step */
                if (m0 == 0)
                    for (int64_t o = 0; o < 34 * L; o += 64) _mm_prefetch((const char *)g + PF_DIST + o, PF_HINT);
                __m512i w[8];
                __m512 scale, mins = _mm512_setzero_ps();
                if (type == QT_Q8_0) {
                    for (int s = 0; s < 8; s++) w[s] = _mm512_maskz_loadu_epi8(mb, g + s * cb);
                } else if (type == QT_Q2_K || type == QT_Q3_K) {
                    const __m512i h = type == QT_Q3_K ? _mm512_maskz_loadu_epi8(mb, g + 8 * L) : _mm512_setzero_si512();
                    for (int s = 0; s < 8; s++) {
                        const __m512i v = _mm512_maskz_loadu_epi8(mb, g + (s >> 2) * cb);
                        w[s] = type == QT_Q3_K ? q23_weights(QT_Q3_K, v, h, s) : q23_weights(QT_Q2_K, v, h, s);
                    }
                } else if (type == QT_Q5_K) {
                    __m512i h = _mm512_maskz_loadu_epi8(mb, g + 16 * L);
                    for (int c = 0; c < 4; c++)
                        q5_weights(_mm512_maskz_loadu_epi8(mb, g + c * cb), h, c, &w[2 * c], &w[2 * c + 1]);
                } else if (type == QT_Q6_K) {
                    for (int c = 0; c < 4; c++) {
                        __m512i h = _mm512_maskz_loadu_epi8(mb, g + 16 * L + (c >> 1) * cb);
                        if (c & 1) h = _mm512_srli_epi16(h, 4);
                        q6_weights(_mm512_maskz_loadu_epi8(mb, g + c * cb), h, &w[2 * c], &w[2 * c + 1]);
                    }
                } else {
                    for (int c = 0; c < 4; c++) {
                        __m512i v = _mm512_maskz_loadu_epi8(mb, g + c * cb);
                        w[2 * c] = _mm512_and_si512(v, m4);
                        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        if (type == QT_IQ4_XS) {
                            w[2 * c] = _mm512_shuffle_epi8(iq4_table(), w[2 * c]);
                            w[2 * c + 1] = _mm512_shuffle_epi8(iq4_table(), w[2 * c + 1]);
                        }
                    }
                }
                group_scales(type, g, L, mf, &scale, &mins);
                __m512 q2lo = _mm512_setzero_ps(), q2hi = _mm512_setzero_ps();
                if (type == QT_Q2_K) q2k_mins(g, L, mf, &q2lo, &q2hi);
                g += group_bytes(type, L);
                for (int i = 0; i < mt; i++) {
                    const int64_t xi = (m0 + i) * nsub + s0;
                    const int8_t *xp = xq[i];
                    __m512i a0, a1;
                    if (type == QT_Q4_K || type == QT_Q5_K || type == QT_Q2_K) {
                        a0 = _mm512_setzero_si512();
                    } else if (type == QT_Q6_K) {
                        a0 = _mm512_maskz_loadu_epi32(mf, J->x->n32lo + xi);
                    } else if (type == QT_Q3_K) {
                        a0 = _mm512_srai_epi32(_mm512_maskz_loadu_epi32(mf, J->x->n32lo + xi), 3);
                    } else {
                        a0 = _mm512_maskz_loadu_epi32(mf, J->x->n8sx + xi);
                        if (type == QT_Q8_0 || type == QT_IQ4_XS) a0 = _mm512_slli_epi32(a0, 4);
                    }
                    a1 = type == QT_Q6_K   ? _mm512_maskz_loadu_epi32(mf, J->x->n32hi + xi)
                         : type == QT_Q3_K ? _mm512_srai_epi32(_mm512_maskz_loadu_epi32(mf, J->x->n32hi + xi), 3)
                                           : _mm512_setzero_si512();
                    for (int s = 0; s < 8; s += 2) {
                        a0 = _mm512_dpbusd_epi32(a0, w[s], _mm512_maskz_loadu_epi8(mb, xp + s * cb));
                        a1 = _mm512_dpbusd_epi32(a1, w[s + 1], _mm512_maskz_loadu_epi8(mb, xp + (s + 1) * cb));
                    }
                    __m512 dxv = _mm512_maskz_loadu_ps(mf, J->x->dx + xi);
                    if (type == QT_Q6_K || type == QT_Q3_K || type == QT_Q2_K) { /* the second half's scale is in mins */
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(scale, dxv), acc[i]);
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(mins, dxv), acc[i]);
                        if (type == QT_Q2_K) {
                            __m512 nlo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mf, J->x->n32lo + xi)), dxv);
                            __m512 nhi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mf, J->x->n32hi + xi)), dxv);
                            acc[i] = _mm512_fmadd_ps(nlo, q2lo, _mm512_fmadd_ps(nhi, q2hi, acc[i]));
                        }
                        xq[i] += 32 * L;
                        continue;
                    }
                    __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
                    acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, dxv), acc[i]);
                    if (type == QT_Q4_K || type == QT_Q5_K)
                        acc[i] = _mm512_fnmadd_ps(mins, _mm512_maskz_loadu_ps(mf, J->x->dxsx + xi), acc[i]);
                    xq[i] += 32 * L;
                }
            }
            for (int i = 0; i < mt; i++) J->y[(m0 + i) * J->ldy + r] = hsum(acc[i]);
        }
    }
}
#endif

/* ---------------------------------------------------------------------------------------------------- */
/* entry points */

#define ROWS_PER_TASK 256

typedef struct {
    const qmm_job *jobs;
    int njobs;
    int64_t *first_task; /* [njobs + 1] prefix sums of tasks per job */
} multi_ctx;

static void multi_task(void *vctx, int64_t t) {
#ifdef MS_VNNI
    multi_ctx *c = vctx;
    int j = 0;
    while (c->first_task[j + 1] <= t) j++;
    const qmm_job *J = &c->jobs[j];
    int64_t r0 = (t - c->first_task[j]) * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
    if (r1 > J->n) r1 = J->n;
    if (J->m == 1) qmv_rows(J, r0, r1);
    else qmm_rows(J, r0, r1);
#else
    (void)vctx;
    (void)t;
#endif
}

static void run_jobs(const qmm_job *jobs, int njobs) {
    int64_t first[njobs + 1];
    first[0] = 0;
    for (int j = 0; j < njobs; j++) first[j + 1] = first[j] + (jobs[j].n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    multi_ctx c = {jobs, njobs, first};
    dispatch(multi_task, &c, first[njobs]);
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
#ifndef MS_VNNI
    (void)type; (void)w; (void)n; (void)k; (void)x; (void)m; (void)ldx; (void)y; (void)ldy;
    return MS_NO_SIMD;
#else
    if (super_bytes(type) < 0) return MS_BAD_TYPE;
    if (!dims_ok(n, k) || k % 256 || !count_ok(m) || !prod_ok(m, ldx) || ldx < k || ldy < n) return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    void *mem = scratch_get(xprep_bytes(m, k));
    if (!mem) return MS_NO_MEM;
    xprep xp;
    xprep_bind(&xp, mem, m, k);
    quant_ctx qc = {x, k, ldx, &xp};
    dispatch(quant_task, &qc, m);
    qmm_job job = {type, w, n, k, &xp, m, y, ldy};
    run_jobs(&job, 1);
    return MS_OK;
#endif
}

/* SwiGLU experts: for each expert e, out_e[m_e, h] = down_e(silu(gate_e(x_e)) * up_e(x_e)), where gate_up_e
 * holds the gate rows then the up rows ([2f, h], one type) and down_e is [h, f]. All experts' gate/up rows
 * run in one parallel pass, then all down rows in another (a decode step: one call per layer). */
typedef struct {
    float *act;      /* [sum m][2f] */
    int64_t f;
    const int64_t *row0; /* first row of expert e in act */
    xprep *xp;
} swiglu_ctx;

static void swiglu_task(void *vctx, int64_t t) {
    swiglu_ctx *c = vctx;
    float *a = c->act + t * 2 * c->f;
    for (int64_t i = 0; i < c->f; i++) {
        float g = a[i];
        a[i] = g / (1.0f + expf(-g)) * a[c->f + i];
    }
    const xprep *p = c->xp;
    quantize_row(a, c->f, p, t);
}

int64_t ms_moe_scratch_bytes(int64_t rows, int64_t h, int64_t f) {
    if (!count_ok(rows) || !dim_ok(h) || !dim_ok(f) || !prod_ok(rows, 2 * (h > f ? h : f))) return MS_BAD_SHAPE;
    return (int64_t)(xprep_bytes(rows, h) + xprep_bytes(rows, f) + (size_t)rows * 2 * f * 4 + 256);
}

typedef struct {
    const float *const *x;
    const int64_t *row0;
    int n_exp;
    int64_t h;
    xprep *xp;
} moe_quant_ctx;

static void moe_quant_task(void *vctx, int64_t t) {
    moe_quant_ctx *c = vctx;
    int e = 0;
    while (c->row0[e + 1] <= t) e++;
    const xprep *p = c->xp;
    quantize_row(c->x[e] + (t - c->row0[e]) * c->h, c->h, p, t);
}

/* x[e]: expert e's m[e] input rows [m[e], h]; out[e]: its output rows [m[e], h] (pointers may repeat for x:
 * a decode step passes the same token to every expert). */
int ms_moe_ffn(int n_exp, const int *type_gu, const uint8_t *const *w_gu, const int *type_d, const uint8_t *const *w_d,
               int64_t h, int64_t f, const float *const *x, const int64_t *m, float *const *out) {
#ifndef MS_VNNI
    (void)n_exp; (void)type_gu; (void)w_gu; (void)type_d; (void)w_d; (void)h; (void)f; (void)x; (void)m; (void)out;
    return MS_NO_SIMD;
#else
    if (!dim_ok(h) || !dim_ok(f) || h % 256 || f % 256) return MS_BAD_SHAPE;
    if (n_exp < 1 || n_exp > 1024) return MS_BAD_SHAPE;
    if (!type_gu || !w_gu || !type_d || !w_d || !x || !m || !out) return MS_BAD_PTR;
    int64_t rows = 0, row0[n_exp + 1];
    for (int e = 0; e < n_exp; e++) {
        if (super_bytes(type_gu[e]) < 0 || super_bytes(type_d[e]) < 0) return MS_BAD_TYPE;
        if (!count_ok(m[e])) return MS_BAD_SHAPE;
        if (m[e] && (!w_gu[e] || !w_d[e] || !x[e] || !out[e])) return MS_BAD_PTR;
        row0[e] = rows;
        rows += m[e];
    }
    row0[n_exp] = rows;
    if (rows < 1) return MS_OK;
    if (!prod_ok(rows, 2 * (h > f ? h : f))) return MS_BAD_SHAPE;
    uint8_t *mem = scratch_get(ms_moe_scratch_bytes(rows, h, f));
    if (!mem) return MS_NO_MEM;
    xprep xin, xact;
    xprep_bind(&xin, mem, rows, h);
    mem += (xprep_bytes(rows, h) + 63) / 64 * 64;
    xprep_bind(&xact, mem, rows, f);
    mem += (xprep_bytes(rows, f) + 63) / 64 * 64;
    float *act = (float *)mem;

    moe_quant_ctx qc = {x, row0, n_exp, h, &xin};
    dispatch(moe_quant_task, &qc, rows);

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

    swiglu_ctx sc = {act, f, row0, &xact};
    dispatch(swiglu_task, &sc, rows);

    nj = 0;
    for (int e = 0; e < n_exp; e++) {
        if (!m[e]) continue;
        int64_t r = row0[e];
        xacts[e] = xprep_from(&xact, r, f);
        jobs[nj++] = (qmm_job){type_d[e], w_d[e], h, f, &xacts[e], m[e], out[e], h};
    }
    run_jobs(jobs, nj);
    return MS_OK;
#endif
}

/* ---------------------------------------------------------------------------------------------------- */
/* float32 helpers for the decode step's small ops (torch spends ~25 us of dispatch on a 2048-float norm) */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of `dim` floats (out may be x) */
int ms_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    if (!dim_ok(dim) || !count_ok(rows) || !prod_ok(rows, dim)) return MS_BAD_SHAPE;
    if (rows && (!x || !w || !out)) return MS_BAD_PTR;
    for (int64_t r = 0; r < rows; r++) {
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
#ifdef MS_VNNI
            __m512 acc = _mm512_setzero_ps();
            for (; j + 16 <= c->k; j += 16) {
                if (i == 0) _mm_prefetch((const char *)(wr + j) + PF_DIST, PF_HINT);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(wr + j), _mm512_loadu_ps(xr + j), acc);
            }
            s = _mm512_reduce_add_ps(acc);
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
    dispatch(gemv_task, &c, (n + GEMV_ROWS - 1) / GEMV_ROWS);
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

/* Attention of one new token: q [H][D] float32 over keys/values [S][Hkv][D] (bf16 when kv_bf16, else
 * float32), query head i reading kv head i / (H / Hkv); out [H][D]. One task per kv head on the pool. */
typedef struct {
    const float *q;
    const void *k, *v;
    int64_t s, h, hkv, d;
    int bf16;
    float scale;
    float *out;
    _Atomic int rc;
} attn_ctx;

static inline float kv_at(const void *p, int bf16, int64_t i) {
    if (bf16) {
        uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    return ((const float *)p)[i];
}

#ifdef MS_VNNI
static inline __m512 kv16(const void *p, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* the same loops, 16 lanes at a time (d a multiple of 16, at most 256) */
static void attn_task_simd(attn_ctx *c, int64_t g) {
    const int64_t rep = c->h / c->hkv, d = c->d, s = c->s, stride = c->hkv * d, nv = d / 16;
    float *sc = malloc(sizeof(float) * (size_t)(rep * s));
    if (!sc) {
        atomic_store(&c->rc, MS_NO_MEM);
        return;
    }
    __m512 row[16];
    for (int64_t t = 0; t < s; t++) {
        for (int64_t e = 0; e < nv; e++) row[e] = kv16(c->k, c->bf16, t * stride + g * d + 16 * e);
        for (int64_t r = 0; r < rep; r++) {
            const float *q = c->q + (g * rep + r) * d;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), row[0]);
            for (int64_t e = 1; e < nv; e++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * e), row[e], acc);
            sc[r * s + t] = _mm512_reduce_add_ps(acc) * c->scale;
        }
    }
    for (int64_t r = 0; r < rep; r++) {
        float *p = sc + r * s, mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t < s; t++) mx = fmaxf(mx, p[t]);
        for (int64_t t = 0; t < s; t++) sum += (p[t] = expf(p[t] - mx));
        for (int64_t t = 0; t < s; t++) p[t] /= sum;
    }
    for (int64_t r = 0; r < rep; r++) {
        __m512 o[16];
        for (int64_t e = 0; e < nv; e++) o[e] = _mm512_setzero_ps();
        for (int64_t t = 0; t < s; t++) {
            __m512 p = _mm512_set1_ps(sc[r * s + t]);
            for (int64_t e = 0; e < nv; e++) o[e] = _mm512_fmadd_ps(p, kv16(c->v, c->bf16, t * stride + g * d + 16 * e), o[e]);
        }
        float *out = c->out + (g * rep + r) * d;
        for (int64_t e = 0; e < nv; e++) _mm512_storeu_ps(out + 16 * e, o[e]);
    }
    free(sc);
}
#endif

static void attn_task(void *vctx, int64_t g) {
    attn_ctx *c = vctx;
#ifdef MS_VNNI
    if (c->d % 16 == 0 && c->d <= 256) {
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
        for (int64_t e = 0; e < d; e++) row[e] = kv_at(c->k, c->bf16, t * stride + g * d + e);
        for (int64_t r = 0; r < rep; r++) {
            const float *q = c->q + (g * rep + r) * d;
            float acc = 0;
            for (int64_t e = 0; e < d; e++) acc += q[e] * row[e];
            sc[r * s + t] = acc * c->scale;
        }
    }
    for (int64_t r = 0; r < rep; r++) { /* softmax */
        float *p = sc + r * s, mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t < s; t++) mx = fmaxf(mx, p[t]);
        for (int64_t t = 0; t < s; t++) sum += (p[t] = expf(p[t] - mx));
        for (int64_t t = 0; t < s; t++) p[t] /= sum;
        float *o = c->out + (g * rep + r) * d;
        for (int64_t e = 0; e < d; e++) o[e] = 0;
    }
    for (int64_t t = 0; t < s; t++) { /* weighted values */
        for (int64_t e = 0; e < d; e++) row[e] = kv_at(c->v, c->bf16, t * stride + g * d + e);
        for (int64_t r = 0; r < rep; r++) {
            float p = sc[r * s + t], *o = c->out + (g * rep + r) * d;
            for (int64_t e = 0; e < d; e++) o[e] += p * row[e];
        }
    }
    free(sc);
}

int ms_attn_decode(const float *q, const void *k, const void *v, int64_t s, int64_t h, int64_t hkv, int64_t d,
                   int kv_bf16, float scale, float *out) {
    if (!dim_ok(s) || !dim_ok(h) || !dim_ok(hkv) || !dim_ok(d) || h % hkv) return MS_BAD_SHAPE;
    if (!prod_ok(s, hkv) || !prod_ok(s * hkv, d) || !prod_ok(h, d) || !prod_ok(s, h / hkv)) return MS_BAD_SHAPE;
    if (!q || !k || !v || !out) return MS_BAD_PTR;
    attn_ctx c = {q, k, v, s, h, hkv, d, kv_bf16, scale, out, MS_OK};
    dispatch(attn_task, &c, hkv);
    return atomic_load(&c.rc);
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
 * caller adds the residual). Projections are in the lane layout; the cache is bf16 when kv_bf16 else f32.
 * One C call instead of ~15 torch ops, each of which costs more in dispatch here than its arithmetic. */
int ms_attn_block_decode(const float *x, const float *norm_w, int64_t hidden, float eps, int qkv_type,
                         const uint8_t *qkv_w, const float *q_norm, const float *k_norm, int64_t n_heads,
                         int64_t n_kv, int64_t head_dim, const float *cosv, const float *sinv, int64_t rot,
                         void *k_cache, void *v_cache, int kv_bf16, int64_t pos, int o_type, const uint8_t *o_w,
                         float *out) {
    if (!dim_ok(hidden) || !dim_ok(n_heads) || !dim_ok(n_kv) || !dim_ok(head_dim) || n_heads % n_kv) return MS_BAD_SHAPE;
    if (!prod_ok(n_heads, head_dim) || rot < 0 || rot > head_dim || rot % 2 || pos < 0) return MS_BAD_SHAPE;
    if (!prod_ok(pos + 1, n_kv * head_dim)) return MS_BAD_SHAPE;
    if (!x || !norm_w || !qkv_w || !q_norm || !k_norm || !cosv || !sinv || !k_cache || !v_cache || !o_w || !out)
        return MS_BAD_PTR;
    const int64_t nq = n_heads * head_dim, nkv = n_kv * head_dim, nqkv = nq + 2 * nkv;
    float *buf = malloc(sizeof(float) * (size_t)(hidden + nqkv + nq));
    if (!buf) return MS_NO_MEM;
    float *xn = buf, *qkv = xn + hidden, *att = qkv + nqkv;
    int rc = ms_rms_norm(x, norm_w, 1, hidden, eps, xn);
    if (rc == MS_OK) rc = ms_qmm(qkv_type, qkv_w, nqkv, hidden, xn, 1, hidden, qkv, nqkv);
    if (rc != MS_OK) {
        free(buf);
        return rc;
    }
    float *q = qkv, *k = qkv + nq, *v = k + nkv;
    rc = ms_rms_norm(q, q_norm, n_heads, head_dim, eps, q);
    if (rc == MS_OK) rc = ms_rms_norm(k, k_norm, n_kv, head_dim, eps, k);
    if (rc == MS_OK) rc = ms_rope_neox(q, 1, n_heads, head_dim, rot, cosv, sinv);
    if (rc == MS_OK) rc = ms_rope_neox(k, 1, n_kv, head_dim, rot, cosv, sinv);
    if (rc != MS_OK) {
        free(buf);
        return rc;
    }
    for (int64_t i = 0; i < nkv; i++) {
        if (kv_bf16) { /* round to nearest even, as torch's .to(bfloat16) */
            uint32_t bk, bv;
            memcpy(&bk, &k[i], 4);
            memcpy(&bv, &v[i], 4);
            ((uint16_t *)k_cache)[pos * nkv + i] = (uint16_t)((bk + 0x7FFF + ((bk >> 16) & 1)) >> 16);
            ((uint16_t *)v_cache)[pos * nkv + i] = (uint16_t)((bv + 0x7FFF + ((bv >> 16) & 1)) >> 16);
        } else {
            ((float *)k_cache)[pos * nkv + i] = k[i];
            ((float *)v_cache)[pos * nkv + i] = v[i];
        }
    }
    rc = ms_attn_decode(q, k_cache, v_cache, pos + 1, n_heads, n_kv, head_dim, kv_bf16, 1.0f / sqrtf((float)head_dim), att);
    if (rc == MS_OK) rc = ms_qmm(o_type, o_w, hidden, nq, att, 1, nq, out, hidden);
    free(buf);
    return rc;
}
