#ifndef MS_INTERNAL_H
#define MS_INTERNAL_H

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
 *   Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and MXFP4 have one scale per 32 weights, so their rows need only be a multiple
 *   of 32:
 *   a row's last group may then hold any number of lanes from 1 to 16 (the kernels load it masked).
 *     Q4_1: nibbles [4][L][4] | d f16 [L] | m f16 [L]                                 20 L bytes (as GGUF)
 *     Q5_0: nibbles [4][L][4] | fifth bits [L][4] | d f16 [L]                         22 L bytes (as GGUF)
 *     Q5_1: nibbles [4][L][4] | fifth bits [L][4] | d f16 [L] | m f16 [L]             24 L bytes (as GGUF)
 *     MXFP4: nibbles [4][L][4] | e u8 [L]                                             17 L bytes (as GGUF)
 *   Q4_1 weight = d q + m, q 0..15; Q5_0 weight = d (q - 16); Q5_1 weight = d q + m, with q 0..31 (the fifth bits
 *   as Q5_K's below).
 *   MXFP4 weight = 2^(e - 128) v[q], v the doubled e2m1 values (integers -12..12), looked up by nibble as
 *   IQ4_XS's are.
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

/* What the lane-layout files share (lane_pack.c: the layout and packing, pool.c: the worker pool, qmm.c: the
 * activations and entry points, qmm_vnni.c / qmm_avx2.c: the dot-product kernels, ops.c: the decode step's small ops).
 * Functions declared MS_INTERNAL are hidden: the library exports only the ms_* entry points. */

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>

#include "blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(MS_SCALAR)
#include <immintrin.h>
#define MS_VNNI 1
#endif

/* CPUs with AVX2, FMA and F16C but no AVX-512 VNNI: the lane kernels in qmm_avx2.c, and 8-wide float paths
 * for the decode step's small ops (ops.c) */
#if !defined(MS_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MS_SCALAR)
#include <immintrin.h>
#define MS_AVX2_FMA 1
#endif

/* the lane kernels: qmm_vnni.c with AVX-512 VNNI, qmm_avx2.c with AVX2 + FMA (the same results) */
#if defined(MS_VNNI) || defined(MS_AVX2_FMA)
#define MS_LANE 1
#endif

/* The KV cache's element types (kv_type arguments): float32 in exact mode, otherwise 16 bits a value. f16
 * keeps three more mantissa bits than bf16 in the same bytes, which a cache of large keys (attention biases,
 * sharp heads) needs; bf16 caches are still read. */
enum { MS_KV_F32 = 0, MS_KV_BF16 = 1, MS_KV_F16 = 2 };

static inline int kv_type_ok(int kv_type) { return kv_type == MS_KV_F32 || kv_type == MS_KV_BF16 || kv_type == MS_KV_F16; }

static inline float kv_load1(const void *p, int kv_type, int64_t i) {
    if (kv_type == MS_KV_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (kv_type == MS_KV_F16) return fp16_to_fp32(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x stored as the cache's type, rounded to nearest even as torch's .to(dtype) rounds; f16 saturates, as
 * models/kv_cache.py's as_cached does */
static inline void kv_store1(void *p, int kv_type, int64_t i, float x) {
    if (kv_type == MS_KV_F32) {
        ((float *)p)[i] = x;
    } else if (kv_type == MS_KV_F16) {
        const _Float16 h = (_Float16)(x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x);
        memcpy((uint16_t *)p + i, &h, 2);
    } else {
        uint32_t b;
        memcpy(&b, &x, 4);
        ((uint16_t *)p)[i] = (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
    }
}

/* Software prefetch into L2, 16 KiB ahead: with only the hardware prefetcher a core streams weights from RAM
 * well below the rate at which it computes with them, so a one-token matvec would wait on memory. */
#define PF_DIST 16384
#define PF_HINT _MM_HINT_T1

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_MXFP4 = 39, QT_Q8_0 = 8, QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_IQ4_XS = 23 };

#define MS_INTERNAL __attribute__((visibility("hidden")))

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
    case QT_Q5_0: return 22 * L;
    case QT_Q5_1: return 24 * L;
    case QT_Q4_1: return 20 * L;
    case QT_MXFP4: return 17 * L;
    default: return 26 * L + L / 4; /* Q6_K */
    }
}

static inline int64_t super_bytes(int type) { /* bytes per 256 weights (8 lanes) of a row */
    switch (type) {
    case QT_Q4_0: return 144;
    case QT_Q4_K: return 148;
    case QT_Q5_K: return 180;
    case QT_Q8_0: return 272;
    case QT_Q6_K: return 210;
    case QT_IQ4_XS: return 138;
    case QT_Q3_K: return 114;
    case QT_Q2_K: return 84;
    case QT_Q5_0: return 176;
    case QT_Q5_1: return 192;
    case QT_Q4_1: return 160;
    case QT_MXFP4: return 136;
    default: return -1;
    }
}

/* the types whose rows need only be whole blocks of 32 (any group may then hold fewer than 8 lanes) */
static inline int per32_type(int type) {
    return type == QT_Q4_0 || type == QT_Q4_1 || type == QT_Q8_0 || type == QT_Q5_0 || type == QT_Q5_1 ||
           type == QT_MXFP4;
}

/* lanes of the group starting at sub-block s0 of a row of nsub */
static inline int group_lanes(int64_t nsub, int64_t s0) { return nsub - s0 >= 16 ? 16 : (int)(nsub - s0); }

int64_t ms_lane_row_bytes(int type, int64_t k);
/* ms_lane_row_bytes of a shape already checked: inlined, so a kernel with its type as a constant pays a multiply
 * (exact: a per-32 type's block bytes are a multiple of 8) */
static inline int64_t lane_row_bytes(int type, int64_t k) { return super_bytes(type) * k / 256; }
int ms_qmm(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx, float *y,
           int64_t ldy);
int ms_attn_block_decode_rows(int64_t b, const float *x, const float *norm_w, int64_t hidden, float eps,
                              int qkv_type, const uint8_t *qkv_w, const float *q_norm, const float *k_norm,
                              int64_t n_heads, int64_t n_kv, int64_t head_dim, const float *const *cosv,
                              const float *const *sinv, int64_t rot, void *const *k_cache, void *const *v_cache,
                              int kv_type, const int64_t *pos, int o_type, const uint8_t *o_w, float *out);

/* ---------------------------------------------------------------------------------------------------- */
/* the worker pool (pool.c) */

typedef void (*task_fn)(void *ctx, int64_t task);

/* Run fn(ctx, t) for t in [0, ntasks) on the pool and the calling thread; returns when all are done. */
MS_INTERNAL void ms_internal_dispatch(task_fn fn, void *ctx, int64_t ntasks);
/* threads a dispatch runs on: the caller plus the workers */
MS_INTERNAL int ms_internal_threads(void);

/* ---------------------------------------------------------------------------------------------------- */
/* quantized activations and matmul jobs (qmm.c prepares them, qmm_vnni.c or qmm_avx2.c computes them) */

typedef struct {
    int8_t *q;    /* [M][K] in step order per group */
    float *dx;    /* [M][K/32] lane scales */
    float *dxsx;  /* [M][K/32] dx * sum(q) (Q4_K mins) */
    int32_t *n8sx;/* [M][K/32] -8 * sum(q) (Q4_0 offset; x16 for Q8_0) */
    int32_t *n32lo, *n32hi; /* [M][K/32] -32 * sum(q) over each half of 16 (Q6_K offset) */
} xprep;

typedef struct {
    int type;
    const uint8_t *w;   /* lane layout, [N] rows of ms_lane_row_bytes */
    int64_t n, k;
    const xprep *x;     /* M rows prepared */
    int64_t m;
    float *y;           /* y[i * ldy + r] */
    int64_t ldy;
} qmm_job;

#ifdef MS_LANE
/* F(T, J, r0, r1) with the job's type as a constant T: each type gets its own copy of the kernel */
#define EACH_TYPE(F, J, r0, r1)                                     \
    do {                                                            \
        if ((J)->type == QT_Q4_0) F(QT_Q4_0, J, r0, r1);            \
        else if ((J)->type == QT_Q4_K) F(QT_Q4_K, J, r0, r1);       \
        else if ((J)->type == QT_Q5_K) F(QT_Q5_K, J, r0, r1);       \
        else if ((J)->type == QT_Q6_K) F(QT_Q6_K, J, r0, r1);       \
        else if ((J)->type == QT_IQ4_XS) F(QT_IQ4_XS, J, r0, r1);   \
        else if ((J)->type == QT_Q3_K) F(QT_Q3_K, J, r0, r1);       \
        else if ((J)->type == QT_Q2_K) F(QT_Q2_K, J, r0, r1);       \
        else if ((J)->type == QT_Q5_0) F(QT_Q5_0, J, r0, r1);       \
        else if ((J)->type == QT_Q5_1) F(QT_Q5_1, J, r0, r1);       \
        else if ((J)->type == QT_Q4_1) F(QT_Q4_1, J, r0, r1);       \
        else if ((J)->type == QT_MXFP4) F(QT_MXFP4, J, r0, r1);     \
        else F(QT_Q8_0, J, r0, r1);                                 \
    } while (0)

/* rows [r0, r1) of one job: one token (qmv), any number of tokens (qmm) */
MS_INTERNAL void ms_internal_qmv_rows(const qmm_job *J, int64_t r0, int64_t r1);
MS_INTERNAL void ms_internal_qmm_rows(const qmm_job *J, int64_t r0, int64_t r1);
#endif

#endif
