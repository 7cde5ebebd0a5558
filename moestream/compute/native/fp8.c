/* FP8 e4m3 weights with one float32 scale per block of rows x columns (DeepSeek-V3's `weight_scale_inv`,
 * 128 x 128 blocks) -> bf16 or float32, the form the bf16 / f32 matmuls take. Run per cache fill on each
 * expert matrix (and once per resident weight), so a checkpoint's FP8 experts are never widened by numpy.
 * The value is fp8 * scale rounded once to the output type: what dequantizing in float32 then casting gives. */
#include "internal.h"

/* round to nearest even, NaN stays a (quiet) NaN (pack.c's rule) */
static inline uint16_t fp8_bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

/* e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN,
 * there is no infinity */
static float e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) {
        uint32_t nan = 0x7fc00000u;
        memcpy(&v, &nan, 4);
        return v;
    }
    if (e == 0) v = (float)m / 8.0f / 64.0f;
    else {
        uint32_t bits = (uint32_t)(e - 7 + 127) << 23 | (uint32_t)m << 20;
        memcpy(&v, &bits, 4);
    }
    return b & 0x80 ? -v : v;
}

/* src: n x k bytes; scales: float32 [ceil(n/bn), ceil(k/bk)]; dst: bf16 or float32 [n, k] */
int ms_fp8_block_decode(const uint8_t *src, int64_t n, int64_t k, const float *scales, int64_t bn, int64_t bk,
                        void *dst, int out_bf16) {
    if (!src || !scales || !dst || (uintptr_t)scales % 4 || (uintptr_t)dst % (out_bf16 ? 2 : 4)) return MS_BAD_PTR;
    if (n < 1 || k < 1 || bn < 1 || bk < 1 || n * k > MS_MAX_ELEMS) return MS_BAD_SHAPE;
    float table[256];
    for (int i = 0; i < 256; i++) table[i] = e4m3_value((uint8_t)i);
    const int64_t kb = (k + bk - 1) / bk;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = src + r * k;
        const float *srow = scales + (r / bn) * kb;
        if (out_bf16) {
            uint16_t *o = (uint16_t *)dst + r * k;
            for (int64_t c = 0; c < k; c++) o[c] = fp8_bf16_bits(table[row[c]] * srow[c / bk]);
        } else {
            float *o = (float *)dst + r * k;
            for (int64_t c = 0; c < k; c++) o[c] = table[row[c]] * srow[c / bk];
        }
    }
    return MS_OK;
}

/* ---------------------------------------------------------------------------------------------------- */
/* The FP8 compute form: FP8 weights kept at 1 byte a weight and multiplied in registers.
 *
 * A row of k (a multiple of 128) is k / 128 blocks of 132 bytes: [scale f32][128 e4m3 bytes], the scale that
 * of the checkpoint's row block and column block (so a row block's scales are repeated on each of its rows:
 * 1/32 of the weights' bytes, and rows stay independent). The kernel widens e4m3 to f16 by moving bits
 * (sign to bit 15, exponent and mantissa to bits 7..14: the same value times 2^-8, subnormals included),
 * then f16 to float32 (vcvtph2ps), and multiplies by float32 activations: each product is exact, so the
 * result is the bf16-decoded weights' up to rounding of the sums and of the decoded weights. The 2^8 is
 * folded into the block's scale. e4m3's NaN bytes (S.1111.111) would read as 480: the packer refuses them.
 *
 * Every build sums in the same order: 16 partial sums per x row, each fed by an FMA per 16 columns and
 * scaled into a running total once per block, the 16 totals added as a fixed tree. So the AVX-512 build
 * (16 lanes), the AVX2 one (two halves of 8) and the scalar one (fmaf) give the same bits. */

#define FP8_BLOCK 128
#define FP8_BLOCK_BYTES 132
#define FP8_ROWS 8 /* weight rows a pool task takes */
#define FP8_XT 4   /* x rows multiplied by one decoded weight vector */

/* e4m3 byte -> its value times 2^-8, the f16 the kernel makes of it (scalar build and the decoder) */
static float e4m3_scaled(uint8_t b) { return fp16_to_fp32((uint16_t)((b & 0x80) << 8 | (b & 0x7f) << 7)); }

/* raw e4m3 [n, k] and block scales [ceil(n/bn), k/128] -> the form (row r: its k/128 blocks, each the scale
 * of r's row block and the block's 128 bytes); MS_NOT_FINITE for a NaN byte or a non-finite scale */
int ms_fp8_pack(const uint8_t *src, int64_t n, int64_t k, const float *scales, int64_t bn, uint8_t *dst) {
    if (!src || !scales || !dst || (uintptr_t)scales % 4) return MS_BAD_PTR;
    if (!dims_ok(n, k) || k % FP8_BLOCK || bn < 1) return MS_BAD_SHAPE;
    const int64_t kb = k / FP8_BLOCK;
    uint8_t nan = 0;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = src + r * k;
        const float *s = scales + (r / bn) * kb;
        uint8_t *o = dst + r * kb * FP8_BLOCK_BYTES;
        for (int64_t b = 0; b < kb; b++, o += FP8_BLOCK_BYTES) {
            if (!isfinite(s[b])) return MS_NOT_FINITE;
            memcpy(o, &s[b], 4);
            memcpy(o + 4, row + b * FP8_BLOCK, FP8_BLOCK);
            for (int j = 0; j < FP8_BLOCK; j++) nan |= (uint8_t)((row[b * FP8_BLOCK + j] & 0x7f) == 0x7f);
        }
    }
    return nan ? MS_NOT_FINITE : MS_OK;
}

static void unpack_block(const uint8_t *blk, float *v);

/* the form [n, k] -> bf16 or float32 [n, k] (fp8 x scale rounded once, as ms_fp8_block_decode gives it) */
int ms_fp8_unpack(const uint8_t *w, int64_t n, int64_t k, void *dst, int out_bf16) {
    if (!w || !dst || (uintptr_t)dst % (out_bf16 ? 2 : 4)) return MS_BAD_PTR;
    if (!dims_ok(n, k) || k % FP8_BLOCK) return MS_BAD_SHAPE;
    for (int64_t i = 0; i < n * k / FP8_BLOCK; i++) {
        float v[FP8_BLOCK];
        unpack_block(w + i * FP8_BLOCK_BYTES, v);
        if (out_bf16)
            for (int j = 0; j < FP8_BLOCK; j++) ((uint16_t *)dst)[i * FP8_BLOCK + j] = fp8_bf16_bits(v[j]);
        else
            memcpy((float *)dst + i * FP8_BLOCK, v, sizeof v);
    }
    return MS_OK;
}

typedef struct {
    const uint8_t *w;
    const float *x;
    int64_t n, k, m;
    float *y;
} fp8_ctx;

/* the 16 totals of one x row added as a fixed tree (every build) */
static float sum16(const float t[16]) {
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = t[i] + t[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(MS_VNNI)
/* 16 e4m3 bytes -> 16 floats (times 2^-8) */
static inline __m512 e4m3x16(const uint8_t *p) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); /* sign in bit 15 */
    const __m256i h = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16((short)0x8000)),
                                      _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80)));
    return _mm512_cvtph_ps(h);
}

/* one block's 128 values, fp8 x scale: the same product as the scalar table's (the 2^-8 and 2^8 are exact) */
static void unpack_block(const uint8_t *blk, float *v) {
    float sc;
    memcpy(&sc, blk, 4);
    const __m512 sv = _mm512_set1_ps(sc * 256.0f);
    for (int s = 0; s < FP8_BLOCK / 16; s++) _mm512_storeu_ps(v + 16 * s, _mm512_mul_ps(e4m3x16(blk + 4 + 16 * s), sv));
}

/* y[i, r] for x rows i0..i0+mt (mt <= FP8_XT) */
static void fp8_row(const fp8_ctx *c, int64_t r, int64_t i0, int mt) {
    const uint8_t *row = c->w + r * (c->k / FP8_BLOCK) * FP8_BLOCK_BYTES;
    __m512 tot[FP8_XT];
    for (int i = 0; i < mt; i++) tot[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < c->k / FP8_BLOCK; b++) {
        const uint8_t *blk = row + b * FP8_BLOCK_BYTES;
        _mm_prefetch((const char *)blk + PF_DIST, PF_HINT);
        __m512 acc[FP8_XT];
        for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
        for (int s = 0; s < FP8_BLOCK / 16; s++) {
            const __m512 wv = e4m3x16(blk + 4 + 16 * s);
            for (int i = 0; i < mt; i++)
                acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(c->x + (i0 + i) * c->k + b * FP8_BLOCK + 16 * s), acc[i]);
        }
        float sc;
        memcpy(&sc, blk, 4);
        const __m512 sv = _mm512_set1_ps(sc * 256.0f);
        for (int i = 0; i < mt; i++) tot[i] = _mm512_fmadd_ps(sv, acc[i], tot[i]);
    }
    float t[16];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(t, tot[i]);
        c->y[(i0 + i) * c->n + r] = sum16(t);
    }
}
#elif defined(MS_AVX2_FMA)
/* 8 e4m3 bytes -> 8 floats (times 2^-8) */
static inline __m256 e4m3x8(const uint8_t *p) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16((short)0x8000)),
                                   _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)));
    return _mm256_cvtph_ps(h);
}

static void unpack_block(const uint8_t *blk, float *v) {
    float sc;
    memcpy(&sc, blk, 4);
    const __m256 sv = _mm256_set1_ps(sc * 256.0f);
    for (int s = 0; s < FP8_BLOCK / 8; s++) _mm256_storeu_ps(v + 8 * s, _mm256_mul_ps(e4m3x8(blk + 4 + 8 * s), sv));
}

/* qmm_avx2.c's way: the 16 lanes as two halves of 8, each taking the same FMAs */
static void fp8_row(const fp8_ctx *c, int64_t r, int64_t i0, int mt) {
    const uint8_t *row = c->w + r * (c->k / FP8_BLOCK) * FP8_BLOCK_BYTES;
    __m256 tot[FP8_XT][2];
    for (int i = 0; i < mt; i++) tot[i][0] = tot[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c->k / FP8_BLOCK; b++) {
        const uint8_t *blk = row + b * FP8_BLOCK_BYTES;
        _mm_prefetch((const char *)blk + PF_DIST, PF_HINT);
        __m256 acc[FP8_XT][2];
        for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int s = 0; s < FP8_BLOCK / 16; s++) {
            const __m256 lo = e4m3x8(blk + 4 + 16 * s), hi = e4m3x8(blk + 12 + 16 * s);
            for (int i = 0; i < mt; i++) {
                const float *xp = c->x + (i0 + i) * c->k + b * FP8_BLOCK + 16 * s;
                acc[i][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp), acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + 8), acc[i][1]);
            }
        }
        float sc;
        memcpy(&sc, blk, 4);
        const __m256 sv = _mm256_set1_ps(sc * 256.0f);
        for (int i = 0; i < mt; i++) {
            tot[i][0] = _mm256_fmadd_ps(sv, acc[i][0], tot[i][0]);
            tot[i][1] = _mm256_fmadd_ps(sv, acc[i][1], tot[i][1]);
        }
    }
    float t[16];
    for (int i = 0; i < mt; i++) {
        _mm256_storeu_ps(t, tot[i][0]);
        _mm256_storeu_ps(t + 8, tot[i][1]);
        c->y[(i0 + i) * c->n + r] = sum16(t);
    }
}
#else
static void unpack_block(const uint8_t *blk, float *v) {
    float sc;
    memcpy(&sc, blk, 4);
    for (int j = 0; j < FP8_BLOCK; j++) v[j] = e4m3_value(blk[4 + j]) * sc;
}

/* the portable build: the same sums, lane by lane */
static void fp8_row(const fp8_ctx *c, int64_t r, int64_t i0, int mt) {
    const uint8_t *row = c->w + r * (c->k / FP8_BLOCK) * FP8_BLOCK_BYTES;
    for (int i = 0; i < mt; i++) {
        const float *x = c->x + (i0 + i) * c->k;
        float tot[16] = {0};
        for (int64_t b = 0; b < c->k / FP8_BLOCK; b++) {
            const uint8_t *blk = row + b * FP8_BLOCK_BYTES;
            float acc[16] = {0}, sc;
            for (int s = 0; s < FP8_BLOCK / 16; s++)
                for (int l = 0; l < 16; l++)
                    acc[l] = fmaf(e4m3_scaled(blk[4 + 16 * s + l]), x[b * FP8_BLOCK + 16 * s + l], acc[l]);
            memcpy(&sc, blk, 4);
            for (int l = 0; l < 16; l++) tot[l] = fmaf(sc * 256.0f, acc[l], tot[l]);
        }
        c->y[(i0 + i) * c->n + r] = sum16(tot);
    }
}
#endif

static void fp8_task(void *vctx, int64_t t) {
    const fp8_ctx *c = vctx;
    const int64_t r1 = (t + 1) * FP8_ROWS < c->n ? (t + 1) * FP8_ROWS : c->n;
    for (int64_t r = t * FP8_ROWS; r < r1; r++)
        for (int64_t i = 0; i < c->m; i += FP8_XT) fp8_row(c, r, i, c->m - i < FP8_XT ? (int)(c->m - i) : FP8_XT);
}

/* y[m, n] = x[m, k] @ W.T for W [n, k] in the FP8 form, on the pool */
int ms_fp8_mm(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    if (!dims_ok(n, k) || k % FP8_BLOCK || !count_ok(m) || !prod_ok(m, k) || !prod_ok(m, n)) return MS_BAD_SHAPE;
    if (m == 0) return MS_OK;
    if (!w || !x || !y) return MS_BAD_PTR;
    fp8_ctx c = {w, x, n, k, m, y};
    ms_internal_dispatch(fp8_task, &c, (n + FP8_ROWS - 1) / FP8_ROWS);
    return MS_OK;
}
