#ifndef MS_GEMM_H
#define MS_GEMM_H

/* Float vectors and the register-tiled float GEMM shared by the delta rule (deltanet.c) and the prompt's
 * attention (attn.c). The vectors are GCC vector extensions of 8 floats, and of 16 in gemm_acc's tiles where
 * AVX-512 holds them in one register: each sum is taken in the same order either way, so the bits are the same
 * with AVX2 and with AVX-512; without FMA a product and a sum round apart. Include after internal.h. */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */

static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 bc8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 fma8(v8 a, v8 b, v8 c) {
#if (defined(MS_VNNI) || defined(MS_AVX2_FMA)) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline float fma1(float a, float b, float c) {
#if (defined(MS_VNNI) || defined(MS_AVX2_FMA)) && defined(__FMA__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* An empty asm that takes v in a register: GCC then multiplies by that register instead of folding a load of
 * v into every FMA that reads it (which made a tile of 4 rows load b four times a step). */
#if defined(__AVX__)
#define keep_in_register(v) __asm__("" : "+x"(v))
#else
#define keep_in_register(v) (void)(v)
#endif

/* the first 4-row tile of a column strip starting at j that gemm_acc computes: the first that reaches the
 * strip's first column (the diagonal) when it computes only the lower tiles */
static inline int first_tile_row(int lower, int j) { return lower && j > 3 ? (j - 3) / 4 * 4 : 0; }

/* where a column strip's 6-row tiles end, from its first row i: as many as leave a multiple of 4 rows (M - i
 * is one) for the 4-row tiles; none in the lower case */
static inline int six_row_end(int lower, int i, int M) { return lower ? i : i + (M - i) / 12 * 12; }

#if defined(MS_VNNI)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static inline v16 ld16(const float *p) { return *(const v16u *)p; }
static inline void st16(float *p, v16 v) { *(v16u *)p = v; }
static inline v16 bc16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
/* one rounding per lane, as fma8 */
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }

/* Rows [i, i + R) (R = 4 or 6) of c's columns [j, j + 16 V) (V = 1 or 2 vectors a row) += a b, each sum taken
 * over p in order. Inlined with R and V constant: the sums stay in registers (fixed-size arrays). 6 rows x 2
 * vectors are 12 independent sums, which two FMA pipes need through a 4-cycle latency; b stays in registers. */
static inline __attribute__((always_inline)) void tile16(int R, int V, int K, const float *a, int lda,
                                                         const float *b, int ldb, float *c, int ldc, int i, int j) {
    v16 s[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) s[r][v] = ld16(c + (i + r) * ldc + j + 16 * v);
    for (int p = 0; p < K; p++) {
        v16 bv[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) {
            bv[v] = ld16(b + p * ldb + j + 16 * v);
            keep_in_register(bv[v]);
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const v16 x = bc16(a[(i + r) * lda + p]);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) s[r][v] = fma16(x, bv[v], s[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) st16(c + (i + r) * ldc + j + 16 * v, s[r][v]);
}
#endif

#if !defined(MS_VNNI)
/* Rows [i, i + R) (R = 4 or 6) of c's columns [j, j + 16) += a b, each sum over p in order: 2R independent
 * sums, which 6 rows need to keep two FMA pipes busy through a 5-cycle latency. */
static inline __attribute__((always_inline)) void tile8x2(int R, int K, const float *a, int lda, const float *b,
                                                          int ldb, float *c, int ldc, int i, int j) {
    v8 s[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        s[r][0] = ld8(c + (i + r) * ldc + j);
        s[r][1] = ld8(c + (i + r) * ldc + j + 8);
    }
    for (int p = 0; p < K; p++) {
        v8 b0 = ld8(b + p * ldb + j), b1 = ld8(b + p * ldb + j + 8);
        keep_in_register(b0);
        keep_in_register(b1);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const v8 x = bc8(a[(i + r) * lda + p]);
            s[r][0] = fma8(x, b0, s[r][0]);
            s[r][1] = fma8(x, b1, s[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        st8(c + (i + r) * ldc + j, s[r][0]);
        st8(c + (i + r) * ldc + j + 8, s[r][1]);
    }
}
#endif

/* c[M][N] += a[M][K] b[K][N] (row-major, leading dimensions lda, ldb, ldc): M a multiple of 4, N of 8. Tiles
 * of 6 (or 4) rows x 32 columns with AVX-512, of 6 (or 4) rows x 16 columns with 256-bit registers: 12
 * independent sums, a broadcast of a per row and step, b's columns loaded once a step. All the row tiles of a
 * column strip run in turn, so that the strip of b stays in L1; the last 16 and 8 columns in narrower strips.
 * lower: only the 16-column halves that reach the diagonal or below it (a causal product; the others are left
 * as they are), in 4-row tiles. Any tile computes each sum over p in order: the same bits whatever the width. */
static void gemm_acc(int M, int N, int K, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                     int lower) {
    int j = 0;
#if defined(MS_VNNI)
    for (; j + 32 <= N; j += 32) {
        int i = first_tile_row(lower, j);
        const int six = six_row_end(lower, i, M);
        for (; i < six; i += 6) tile16(6, 2, K, a, lda, b, ldb, c, ldc, i, j);
        for (; i < M; i += 4) {
            if (i < first_tile_row(lower, j + 16)) tile16(4, 1, K, a, lda, b, ldb, c, ldc, i, j);
            else tile16(4, 2, K, a, lda, b, ldb, c, ldc, i, j);
        }
    }
    if (j + 16 <= N) {
        for (int i = first_tile_row(lower, j); i < M; i += 4) tile16(4, 1, K, a, lda, b, ldb, c, ldc, i, j);
        j += 16;
    }
#else /* 256-bit registers: two vectors of 8 a row */
    for (; j + 16 <= N; j += 16) {
        int i = first_tile_row(lower, j);
        const int six = six_row_end(lower, i, M);
        for (; i < six; i += 6) tile8x2(6, K, a, lda, b, ldb, c, ldc, i, j);
        for (; i < M; i += 4) tile8x2(4, K, a, lda, b, ldb, c, ldc, i, j);
    }
#endif
    if (j < N) /* the last 8 columns */
        for (int i = first_tile_row(lower, j); i < M; i += 4) {
            v8 s[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) s[r] = ld8(c + (i + r) * ldc + j);
            for (int p = 0; p < K; p++) {
                const v8 b0 = ld8(b + p * ldb + j);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) s[r] = fma8(bc8(a[(i + r) * lda + p]), b0, s[r]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) st8(c + (i + r) * ldc + j, s[r]);
        }
}

#endif
