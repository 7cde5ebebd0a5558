/* moestream native kernels: GGUF weight bytes -> the forms torch computes from.
 *
 * Loaded with ctypes (no Python API), so every call runs without the GIL and reader threads convert
 * experts in parallel. All output goes to caller-provided memory; nothing here allocates.
 *
 * Built by moestream/compute/native/__init__.py with `cc -O3 -march=native -ffp-contract=off -fPIC -shared`.
 * fp-contract is off so the float32 decoders round exactly like the numpy reference (no fused a*b-c).
 * Define MS_SCALAR to build without SIMD intrinsics (tests compare both builds).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && !defined(MS_SCALAR)
#include <immintrin.h>
#define MS_AVX2 1
#endif

#include "blocks.h"

#define MS_ABI_VERSION 6

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39,
};

#define QK_K 256

/* ---------------------------------------------------------------------------------------------------- */
/* scalar conversions */

/* round to nearest even, NaN stays a (quiet) NaN: what torch's float -> bfloat16 does */
static inline uint16_t fp32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

/* ---------------------------------------------------------------------------------------------------- */
/* block decoders -> float32. Same operation order as moestream/quants.py so results match bit for bit. */

static void dq_q8_0(const uint8_t *b, float *y) {
    const float d = rd_fp16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
}

static void dq_q4_0(const uint8_t *b, float *y) {
    const float d = rd_fp16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 0x0f) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void dq_q4_1(const uint8_t *b, float *y) {
    const float d = rd_fp16(b), m = rd_fp16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0x0f) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void dq_q5_0(const uint8_t *b, float *y) {
    const float d = rd_fp16(b);
    const uint32_t qh = rd32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        /* qh is unsigned: take the 5-bit code as int before subtracting */
        y[j] = d * (float)((int)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
        y[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

static void dq_q5_1(const uint8_t *b, float *y) {
    const float d = rd_fp16(b), m = rd_fp16(b + 2);
    const uint32_t qh = rd32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) + m;
        y[j + 16] = d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}

static void dq_q4_k(const uint8_t *b, float *y) {
    const float d = rd_fp16(b), dmin = rd_fp16(b + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++) {
        const float s0 = d * (float)sc[2 * c], m0 = dmin * (float)mn[2 * c];
        const float s1 = d * (float)sc[2 * c + 1], m1 = dmin * (float)mn[2 * c + 1];
        for (int l = 0; l < 32; l++) {
            y[64 * c + l] = s0 * (float)(qs[32 * c + l] & 0x0f) - m0;
            y[64 * c + 32 + l] = s1 * (float)(qs[32 * c + l] >> 4) - m1;
        }
    }
}

static void dq_q5_k(const uint8_t *b, float *y) {
    const float d = rd_fp16(b), dmin = rd_fp16(b + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++) {
        const float s0 = d * (float)sc[2 * c], m0 = dmin * (float)mn[2 * c];
        const float s1 = d * (float)sc[2 * c + 1], m1 = dmin * (float)mn[2 * c + 1];
        const int b0 = 2 * c, b1 = 2 * c + 1;
        for (int l = 0; l < 32; l++) {
            const int q0 = (qs[32 * c + l] & 0x0f) | (((qh[l] >> b0) & 1) << 4);
            const int q1 = (qs[32 * c + l] >> 4) | (((qh[l] >> b1) & 1) << 4);
            y[64 * c + l] = s0 * (float)q0 - m0;
            y[64 * c + 32 + l] = s1 * (float)q1 - m1;
        }
    }
}

static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_fp16(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *l4 = ql + 64 * h, *h2 = qh + 32 * h;
        float *yh = y + 128 * h;
        const int8_t *sh = sc + 8 * h;
        for (int t = 0; t < 4; t++) {
            /* weights 32t..32t+31 of this half: two groups of 16 with their own scale */
            const float sa = d * (float)sh[2 * t], sb = d * (float)sh[2 * t + 1];
            const uint8_t *src = l4 + 32 * (t & 1);
            const int shift = 4 * (t >> 1);
            for (int l = 0; l < 32; l++) {
                const int q = (((src[l] >> shift) & 0x0f) | (((h2[l] >> (2 * t)) & 3) << 4)) - 32;
                yh[32 * t + l] = (l < 16 ? sa : sb) * (float)q;
            }
        }
    }
}

static void dq_mxfp4(const uint8_t *b, float *y) {
    static const int8_t v[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const float d = mxfp4_scale(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)v[b[1 + j] & 0xF];
        y[j + 16] = d * (float)v[b[1 + j] >> 4];
    }
}

typedef void (*dq_fn)(const uint8_t *, float *);

static int block_info(int type, int *bs, int *ts, dq_fn *fn) {
    switch (type) {
    case T_Q8_0: *bs = 32, *ts = 34, *fn = dq_q8_0; return MS_OK;
    case T_Q4_0: *bs = 32, *ts = 18, *fn = dq_q4_0; return MS_OK;
    case T_Q4_1: *bs = 32, *ts = 20, *fn = dq_q4_1; return MS_OK;
    case T_Q5_0: *bs = 32, *ts = 22, *fn = dq_q5_0; return MS_OK;
    case T_Q5_1: *bs = 32, *ts = 24, *fn = dq_q5_1; return MS_OK;
    case T_Q4_K: *bs = QK_K, *ts = 144, *fn = dq_q4_k; return MS_OK;
    case T_Q5_K: *bs = QK_K, *ts = 176, *fn = dq_q5_k; return MS_OK;
    case T_Q6_K: *bs = QK_K, *ts = 210, *fn = dq_q6_k; return MS_OK;
    case T_MXFP4: *bs = 32, *ts = 17, *fn = dq_mxfp4; return MS_OK;
    default: return MS_BAD_TYPE;
    }
}

static void f32_to_bf16_n(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fp32_to_bf16(x[i]);
}

/* Decode n_elems weights of `type` into dst: float32 if out_bf16 == 0, else bfloat16 (uint16 bits). */
int ms_dequant(int type, const uint8_t *src, int64_t n_elems, void *dst, int out_bf16) {
    if (!src || !dst) return MS_BAD_PTR;
    if (n_elems < 1 || n_elems > MS_MAX_ELEMS) return MS_BAD_SHAPE;
    /* F32/F16/BF16 are read and written as arrays of their type: they must be naturally aligned */
    const uintptr_t align = type == T_F32 ? 4 : type == T_F16 || type == T_BF16 ? 2 : 1;
    if ((uintptr_t)src % align || (uintptr_t)dst % (out_bf16 ? 2 : 4)) return MS_BAD_PTR;
    float *yf = (float *)dst;
    uint16_t *yb = (uint16_t *)dst;
    switch (type) {
    case T_F32:
        if (out_bf16) f32_to_bf16_n((const float *)src, yb, n_elems);
        else memcpy(dst, src, (size_t)n_elems * 4);
        return MS_OK;
    case T_BF16:
        if (out_bf16) {
            memcpy(dst, src, (size_t)n_elems * 2);
        } else {
            const uint16_t *s = (const uint16_t *)src;
            uint32_t *o = (uint32_t *)dst;
            for (int64_t i = 0; i < n_elems; i++) o[i] = (uint32_t)s[i] << 16;
        }
        return MS_OK;
    case T_F16: {
        const uint16_t *s = (const uint16_t *)src;
        float buf[256];
        for (int64_t i = 0; i < n_elems; i += 256) {
            const int64_t m = n_elems - i < 256 ? n_elems - i : 256;
            float *o = out_bf16 ? buf : yf + i;
#if defined(MS_AVX2) && defined(__F16C__)
            int64_t j = 0;
            for (; j + 8 <= m; j += 8)
                _mm256_storeu_ps(o + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i + j))));
            for (; j < m; j++) o[j] = fp16_to_fp32(s[i + j]);
#else
            for (int64_t j = 0; j < m; j++) o[j] = fp16_to_fp32(s[i + j]);
#endif
            if (out_bf16) f32_to_bf16_n(buf, yb + i, m);
        }
        return MS_OK;
    }
    default: break;
    }
    int bs, ts;
    dq_fn fn;
    if (block_info(type, &bs, &ts, &fn) != MS_OK) return MS_BAD_TYPE;
    if (n_elems % bs) return MS_BAD_SHAPE;
    const int64_t nb = n_elems / bs;
    if (!out_bf16) {
        for (int64_t i = 0; i < nb; i++) fn(src + i * ts, yf + i * bs);
        return MS_OK;
    }
    /* decode a few blocks into a small buffer, then convert them in one vectorised pass */
    float buf[4 * QK_K];
    const int per = 4 * QK_K / bs;
    for (int64_t i = 0; i < nb; i += per) {
        const int m = nb - i < per ? (int)(nb - i) : per;
        for (int j = 0; j < m; j++) fn(src + (i + j) * ts, buf + j * bs);
        f32_to_bf16_n(buf, yb + i * bs, (int64_t)m * bs);
    }
    return MS_OK;
}

/* ---------------------------------------------------------------------------------------------------- */
/* int4 packing for torch.ops.aten._weight_int4pack_mm_for_cpu (probed on torch 2.13): rows go in blocks
 * of B (64 where torch's kernels run AVX-512, 32 where they run AVX2), H = B/2; for block nb and column k
 * there are H bytes, byte d holding q[B*nb + d][k] in the low nibble and q[B*nb + d + H][k] in the high
 * one, at ((nb*K + k)*H + d). The loader finds B by checking against torch._convert_weight_to_int4pack_for_cpu
 * (native.int4_block) and passes it in.
 *
 * One tile = B rows x one group of 32 columns = 16*B output bytes. Its 32 nibbles per row come from
 * two 16-byte runs ("halves": columns 0-15 and 16-31) of the GGUF block, each run holding its
 * columns in the low (sel 0) or high (sel 1) nibble of consecutive bytes:
 *   Q4_0 block: half h = nibble h of qs[0..15]
 *   Q4_K sub-block j: half h = nibble (j & 1) of qs[32*(j/2) + 16h .. +15]
 * Combining rows d and d+H into one byte per column gives an H x 32 byte matrix [d][k]; the tile is
 * its transpose. */


#ifdef MS_AVX2
/* rows d (lane 0) and d+16 (lane 1) of the combined matrix for one half: 16 columns each */
static inline __m256i combine_pair(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                                   const uint8_t *p3, int sel) {
    /* p0: row d, p1: row d+32 (lane 0); p2: row d+16, p3: row d+48 (lane 1) */
    const __m256i a = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p2), _mm_loadu_si128((const __m128i *)p0));
    const __m256i b = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p3), _mm_loadu_si128((const __m128i *)p1));
    const __m256i lo4 = _mm256_set1_epi8(0x0f), hi4 = _mm256_set1_epi8((char)0xf0);
    if (sel)
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), _mm256_and_si256(b, hi4));
    return _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_and_si256(_mm256_slli_epi16(b, 4), hi4));
}

/* blocks of 32 rows: row d of the combined matrix (rows d and d+16) for half 0 in lane 0, half 1 in lane 1 */
static inline __m256i combine_halves(const uint8_t *a0, const uint8_t *b0, const uint8_t *a1, const uint8_t *b1,
                                     const int sel[2]) {
    const __m256i a = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)a1), _mm_loadu_si128((const __m128i *)a0));
    const __m256i b = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)b1), _mm_loadu_si128((const __m128i *)b0));
    const __m256i lo4 = _mm256_set1_epi8(0x0f), hi4 = _mm256_set1_epi8((char)0xf0);
    const __m256i low = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_and_si256(_mm256_slli_epi16(b, 4), hi4));
    const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), _mm256_and_si256(b, hi4));
    /* each lane takes the nibble its half's sel names */
    return _mm256_blend_epi32(sel[0] ? high : low, sel[1] ? high : low, 0xF0);
}

/* Transpose, in each 128-bit lane independently, a 16x16 byte matrix held as 16 rows.
 * unpack(r[i], r[i+8]) rotates the 8-bit (row, column) index left by one bit; four rounds swap
 * row and column. */
static inline void transpose16x16_lanes(__m256i r[16]) {
    __m256i t[16];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm256_unpacklo_epi8(r[i], r[i + 8]);
            t[2 * i + 1] = _mm256_unpackhi_epi8(r[i], r[i + 8]);
        }
        for (int i = 0; i < 16; i++) r[i] = t[i];
    }
}
#endif

/* base: first of 2*H rows (at this group's block), stride: bytes per row, off[h]/sel[h]: source run of
 * half h, dst: 32*H bytes */
static void pack_tile(const uint8_t *base, int64_t stride, const int off[2], const int sel[2], int H, uint8_t *dst) {
#ifdef MS_AVX2
    __m256i r[16];
    if (H == 32) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = base + off[h];
            for (int i = 0; i < 16; i++)
                r[i] = combine_pair(p + i * stride, p + (i + 32) * stride, p + (i + 16) * stride,
                                    p + (i + 48) * stride, sel[h]);
            transpose16x16_lanes(r);
            /* row ii of lane 0 = bytes d 0..15 of column 16h+ii; lane 1 = bytes d 16..31 */
            for (int ii = 0; ii < 16; ii++) _mm256_storeu_si256((__m256i *)(dst + (16 * h + ii) * 32), r[ii]);
        }
        return;
    }
    /* H == 16: both halves at once, one a lane */
    for (int d = 0; d < 16; d++)
        r[d] = combine_halves(base + d * stride + off[0], base + (d + 16) * stride + off[0],
                              base + d * stride + off[1], base + (d + 16) * stride + off[1], sel);
    transpose16x16_lanes(r);
    /* row ii: lane 0 = bytes d 0..15 of column ii, lane 1 = those of column 16 + ii */
    for (int ii = 0; ii < 16; ii++) {
        _mm_storeu_si128((__m128i *)(dst + ii * 16), _mm256_castsi256_si128(r[ii]));
        _mm_storeu_si128((__m128i *)(dst + (16 + ii) * 16), _mm256_extracti128_si256(r[ii], 1));
    }
#else
    for (int h = 0; h < 2; h++) {
        const int shift = 4 * sel[h];
        for (int d = 0; d < H; d++) {
            const uint8_t *a = base + d * stride + off[h], *b = base + (d + H) * stride + off[h];
            for (int ii = 0; ii < 16; ii++)
                dst[(16 * h + ii) * H + d] = (uint8_t)(((a[ii] >> shift) & 0x0f) | (((b[ii] >> shift) & 0x0f) << 4));
        }
    }
#endif
}

/* pack_tile backwards: a tile [column][d] of H bytes a column -> c[d][column] */
static void untile(const uint8_t *tile, int H, uint8_t c[32][32]) {
#ifdef MS_AVX2
    if (H == 32) {
        for (int h = 0; h < 2; h++) {
            __m256i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm256_loadu_si256((const __m256i *)(tile + (16 * h + i) * 32));
            transpose16x16_lanes(r);
            for (int ii = 0; ii < 16; ii++) {
                _mm_storeu_si128((__m128i *)(&c[ii][16 * h]), _mm256_castsi256_si128(r[ii]));
                _mm_storeu_si128((__m128i *)(&c[16 + ii][16 * h]), _mm256_extracti128_si256(r[ii], 1));
            }
        }
        return;
    }
#endif
    for (int kk = 0; kk < 32; kk++)
        for (int d = 0; d < H; d++) c[d][kk] = tile[kk * H + d];
}

/* W [n, k] as GGUF Q4_0 or Q4_K rows -> packed [n, k/2] uint8 and scales_and_zeros [k/32, n, 2] bf16
 * such that w = (q - 8) * scale + zero, in blocks of B rows (32 or 64). n must be a multiple of 64, k of the
 * block size. */
int ms_pack_int4(int type, const uint8_t *src, int64_t n, int64_t k, uint8_t *packed, uint16_t *sz, int B) {
    if (!src || !packed || !sz || (uintptr_t)sz % 2) return MS_BAD_PTR;
    if (!dims_ok(n, k) || n % 64 || k % 32 || (B != 32 && B != 64)) return MS_BAD_SHAPE;
    const int H = B / 2;
    if (type == T_Q4_0) {
        const int64_t stride = k / 32 * 18, ng = k / 32;
        const int off[2] = {2, 2}, sel[2] = {0, 1};
        for (int64_t nb = 0; nb < n / B; nb++) {
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *base = src + nb * B * stride + g * 18;
                pack_tile(base, stride, off, sel, H, packed + (nb * k + g * 32) * H);
                uint16_t *s = sz + (g * n + nb * B) * 2;
                for (int r = 0; r < B; r++) {
                    s[2 * r] = fp32_to_bf16(rd_fp16(base + r * stride));
                    s[2 * r + 1] = 0;
                }
            }
        }
        return MS_OK;
    }
    if (type == T_Q4_K) {
        if (k % QK_K) return MS_BAD_SHAPE;
        const int64_t stride = k / QK_K * 144, nsb = k / QK_K;
        for (int64_t nb = 0; nb < n / B; nb++) {
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *base = src + nb * B * stride + sb * 144;
                for (int j = 0; j < 8; j++) {
                    const int o = 16 + 32 * (j / 2);
                    const int off[2] = {o, o + 16}, sel[2] = {j & 1, j & 1};
                    pack_tile(base, stride, off, sel, H, packed + (nb * k + (sb * 8 + j) * 32) * H);
                }
                for (int r = 0; r < B; r++) {
                    const uint8_t *b = base + r * stride;
                    const float d = rd_fp16(b), dmin = rd_fp16(b + 2);
                    uint8_t sc[8], mn[8];
                    k_scale_min(b + 4, sc, mn);
                    for (int j = 0; j < 8; j++) {
                        /* d*sc*q - dmin*m = (q - 8)*scale + (8*scale - dmin*m) */
                        const float scale = d * (float)sc[j];
                        const float zero = 8.0f * scale - dmin * (float)mn[j];
                        uint16_t *s = sz + ((sb * 8 + j) * n + nb * B + r) * 2;
                        s[0] = fp32_to_bf16(scale);
                        s[1] = fp32_to_bf16(zero);
                    }
                }
            }
        }
        return MS_OK;
    }
    return MS_BAD_TYPE;
}

/* Rows [row0, row1) of the int4 form back to bf16, out [row1 - row0, k] (w = (q - 8) * scale + zero).
 * For many rows of activations (prefill) a bf16 GEMM beats the int4 kernel by more than this costs;
 * the row range lets callers expand a big matrix a slice at a time. row0, row1: multiples of 64. */
int ms_int4_to_bf16(const uint8_t *packed, const uint16_t *sz, int64_t n, int64_t k, int64_t row0,
                    int64_t row1, uint16_t *out, int B) {
    if (!packed || !sz || !out || (uintptr_t)sz % 2 || (uintptr_t)out % 2) return MS_BAD_PTR;
    if (!dims_ok(n, k) || n % 64 || k % 32 || row0 % 64 || row1 % 64 || row0 < 0 || row1 > n || row0 > row1 ||
        (B != 32 && B != 64))
        return MS_BAD_SHAPE;
    const int H = B / 2;
    uint8_t c[32][32]; /* [d][column]: low nibble row d, high nibble row d + H */
    for (int64_t nb = row0 / B; nb < row1 / B; nb++) {
        for (int64_t g = 0; g < k / 32; g++) {
            untile(packed + (nb * k + g * 32) * H, H, c);
            for (int half = 0; half < 2; half++) {
                const int shift = 4 * half;
                for (int d = 0; d < H; d++) {
                    const int64_t row = nb * B + H * half + d;
                    const uint16_t *s = sz + (g * n + row) * 2;
                    uint32_t sb = (uint32_t)s[0] << 16, zb = (uint32_t)s[1] << 16;
                    float scale, zero;
                    memcpy(&scale, &sb, 4);
                    memcpy(&zero, &zb, 4);
                    uint16_t *o = out + (row - row0) * k + g * 32;
                    for (int kk = 0; kk < 32; kk++)
                        o[kk] = fp32_to_bf16((float)(((c[d][kk] >> shift) & 0x0f) - 8) * scale + zero);
                }
            }
        }
    }
    return MS_OK;
}

int ms_abi_version(void) { return MS_ABI_VERSION; }

int ms_has_simd(void) {
#ifdef MS_AVX2
    return 1;
#else
    return 0;
#endif
}
