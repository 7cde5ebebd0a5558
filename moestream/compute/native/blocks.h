/* GGUF block helpers shared by pack.c and qmm.c (static inline: each translation unit gets its own copy). */
#ifndef MS_BLOCKS_H
#define MS_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) && !defined(MS_SCALAR)
#include <immintrin.h>
#endif

/* Return codes of every entry point; the Python side raises ComputeError for each negative one. */
enum { MS_OK = 0, MS_BAD_TYPE = -1, MS_BAD_SHAPE = -2, MS_NO_SIMD = -3, MS_NO_MEM = -4, MS_BAD_PTR = -5, MS_NOT_FINITE = -6 };

/* Sizes an entry point accepts: each dimension in [1, 2^31] and a matrix at most 2^40 elements, so that no
 * size or offset computed from them can overflow int64. */
#define MS_MAX_DIM ((int64_t)1 << 31)
#define MS_MAX_ELEMS ((int64_t)1 << 40)

static inline int dim_ok(int64_t x) { return x >= 1 && x <= MS_MAX_DIM; }
static inline int count_ok(int64_t x) { return x >= 0 && x <= MS_MAX_DIM; } /* may be zero */
static inline int dims_ok(int64_t n, int64_t k) { return dim_ok(n) && dim_ok(k) && n * k <= MS_MAX_ELEMS; }
/* a * b <= MS_MAX_ELEMS for counts a, b >= 0, without overflowing */
static inline int prod_ok(int64_t a, int64_t b) { return a >= 0 && b >= 0 && (b == 0 || a <= MS_MAX_ELEMS / b); }

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__) && !defined(MS_SCALAR)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* zero or subnormal: man * 2^-24, exact */
        return sign ? -f : f;
    }
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else
        bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline float rd_fp16(const uint8_t *p) { return fp16_to_fp32(rd16(p)); }

/* MXFP4's exponent byte -> 2^(e - 128), half its scale as the value table is doubled (ggml_e8m0_to_fp32_half;
 * e < 2 gives a subnormal, exact) */
static inline float mxfp4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

#endif
