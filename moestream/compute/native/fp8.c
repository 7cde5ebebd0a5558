/* FP8 e4m3 weights with one float32 scale per block of rows x columns (DeepSeek-V3's `weight_scale_inv`,
 * 128 x 128 blocks) -> bf16 or float32, the form the bf16 / f32 matmuls take. Run per cache fill on each
 * expert matrix (and once per resident weight), so a checkpoint's FP8 experts are never widened by numpy.
 * The value is fp8 * scale rounded once to the output type: what dequantizing in float32 then casting gives. */
#include <stdint.h>
#include <string.h>

#include "blocks.h"

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
