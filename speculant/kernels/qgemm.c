/* Weight-quantized matrix products on int8 activations (AVX2), the dot products llama.cpp's CPU backend uses.
 *
 *   y[m, n] = sum_g  wd[n, g] * xd[m, g] * (sum_{i<32} q[n, g, i] * xq[m, g, i])  +  wm[n, g] * xs[m, g]
 *
 * Weights: blocks of 32 along the input dimension (GGUF Q4_0 / Q4_1 / Q8_0).  4-bit codes are packed two per
 * byte, byte j of a block holding code j (low nibble) and code j + 16 (high nibble), as in GGUF.
 * Activations: quantized per row and block of 32 to int8 (llama.cpp's Q8_1): xd = max|x| / 127,
 * xq = round(x / xd) (to nearest even), xs = xd * sum(xq).
 *
 * Exactness: every output element is computed by one thread with the same sequence of operations whatever
 * M (rows) is and wherever the row falls in a block of rows: integer block sums are exact, the float
 * accumulation runs over the blocks in order, then a fixed horizontal sum.  So each row of a product gets the
 * bits it gets alone (batch invariance), which greedy speculative decoding's exactness rests on.
 * Build: cc -O3 -mavx2 -mfma -fopenmp (no -ffast-math: it would let the compiler reorder the sums).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define QK 32
#define MB 4


/* x [M, K] float32 -> xq [M, K] int8, xd [M, K/32], xs [M, K/32] */
void spec_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t G = K / QK;
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M * G; r++) {
        const float *src = x + r * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(src + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q32[4];
        for (int j = 0; j < 4; j++)
            q32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]), _mm256_add_epi32(q32[2], q32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        __m256i p01 = _mm256_packs_epi32(q32[0], q32[1]), p23 = _mm256_packs_epi32(q32[2], q32[3]);
        __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + r * QK), p);
        xd[r] = d;
        xs[r] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

static inline __m256i unpack_q4(const uint8_t *b) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)b);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

static inline __m256 block_dot_u(__m256i qu, const int8_t *y) {   /* unsigned codes x signed activations */
    const __m256i p16 = _mm256_maddubs_epi16(qu, _mm256_loadu_si256((const __m256i *)y));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static inline __m256 block_dot_s(__m256i w, const int8_t *y) {    /* signed codes x signed activations */
    const __m256i yv = _mm256_loadu_si256((const __m256i *)y);
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(yv, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

/* Outputs n0 .. n0+NB-1 by rows m0 .. m0+R-1: one float accumulator per output element, blocks in order, then
 * a fixed horizontal sum and the offset term; the operations on an element do not depend on NB, R or M. */
#define TILE(N0, NB, R, LOAD, DOT, HAS_MIN)                                                          \
    do {                                                                                         \
        __m256 acc[NB][R];                                                                       \
        for (int a = 0; a < (NB); a++)                                                           \
            for (int r = 0; r < (R); r++) acc[a][r] = _mm256_setzero_ps();                       \
        for (int64_t g = 0; g < G; g++) {                                                        \
            for (int a = 0; a < (NB); a++) {                                                     \
                const int64_t n = (N0) + a;                                                      \
                const __m256i w = LOAD;                                                          \
                const float dw = wd[n * G + g];                                                  \
                for (int r = 0; r < (R); r++) {                                                  \
                    const int64_t m = m0 + r;                                                    \
                    const __m256 s = _mm256_set1_ps(dw * xd[m * G + g]);                         \
                    acc[a][r] = _mm256_fmadd_ps(DOT(w, xq + m * K + g * QK), s, acc[a][r]);      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int a = 0; a < (NB); a++)                                                           \
            for (int r = 0; r < (R); r++) {                                                      \
                const int64_t n = (N0) + a, m = m0 + r;                                          \
                y[m * N + n] = hsum8(acc[a][r]) + (HAS_MIN ? offset_sum(wm + n * G, xs + m * G, G) : 0.0f); \
            }                                                                                    \
    } while (0)

/* sum_g wm[g] * xs[g] in a fixed order */
static inline float offset_sum(const float *wm, const float *xs, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wm + g), _mm256_loadu_ps(xs + g), acc);
    float s = hsum8(acc);
    for (; g < G; g++) s += wm[g] * xs[g];
    return s;
}

/* All rows of x for outputs 4t .. 4t+3: tiles of 2 outputs x 4 rows, then the last 1-3 rows in one tile; outputs past a
 * multiple of 4 one by one.  Tiling changes which registers hold an element, never its operations. */
#define ALL_ROWS(LOAD, DOT, HAS_MIN)                                                             \
    do {                                                                                         \
        const int64_t n0 = 4 * t;                                                                \
        int64_t m0 = 0;                                                                          \
        if (n0 + 4 <= N) {                                                                       \
            for (; m0 + MB <= M; m0 += MB) {                                                     \
                TILE(n0, 2, MB, LOAD, DOT, HAS_MIN);                                             \
                TILE(n0 + 2, 2, MB, LOAD, DOT, HAS_MIN);                                         \
            }                                                                                    \
            if (M - m0 == 3) {                                                                   \
                TILE(n0, 2, 3, LOAD, DOT, HAS_MIN);                                              \
                TILE(n0 + 2, 2, 3, LOAD, DOT, HAS_MIN);                                          \
            } else if (M - m0 == 2) {                                                            \
                TILE(n0, 4, 2, LOAD, DOT, HAS_MIN);                                              \
            } else if (M - m0 == 1) {                                                            \
                TILE(n0, 4, 1, LOAD, DOT, HAS_MIN);                                              \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t n1 = n0; n1 < N; n1++)                                                  \
                for (m0 = 0; m0 < M; m0++) TILE(n1, 1, 1, LOAD, DOT, HAS_MIN);                   \
        }                                                                                        \
    } while (0)

/* y [M, N] = dequant(codes [N, K/2] uint8, wd, wm [N, K/32]) applied to the quantized rows of x */
void spec_w4a8(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
               const uint8_t *codes, const float *wd, const float *wm, int64_t N, float *y) {
    const int64_t G = K / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (N + 3) / 4; t++)
        ALL_ROWS(unpack_q4(codes + n * (K / 2) + g * (QK / 2)), block_dot_u, 1);
}

/* y [M, N] = dequant(codes [N, K] int8, wd [N, K/32]) applied to the quantized rows of x */
void spec_w8a8(const int8_t *xq, const float *xd, int64_t M, int64_t K,
               const int8_t *codes, const float *wd, int64_t N, float *y) {
    const int64_t G = K / QK;
    const float *wm = 0, *xs = 0;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (N + 3) / 4; t++)
        ALL_ROWS(_mm256_loadu_si256((const __m256i *)(codes + n * K + g * QK)), block_dot_s, 0);
    (void)wm; (void)xs;
}

/* The same products on float32 rows x [M, K]: quantize (workspace of our own), then multiply. Returns 0, or -1 when
 * the workspace cannot be allocated (y is then untouched). */
#include <stdlib.h>
static int quantized_workspace(const float *x, int64_t M, int64_t K, int8_t **xq, float **xd, float **xs) {
    const int64_t G = K / QK;
    *xq = (int8_t *)malloc((size_t)(M * K));
    *xd = (float *)malloc(sizeof(float) * (size_t)(2 * M * G));
    if (!*xq || !*xd) { free(*xq); free(*xd); return -1; }
    *xs = *xd + M * G;
    spec_quantize_rows(x, M, K, *xq, *xd, *xs);
    return 0;
}

int spec_w4a8_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *wd, const float *wm,
                  int64_t N, float *y) {
    int8_t *xq; float *xd, *xs;
    if (quantized_workspace(x, M, K, &xq, &xd, &xs)) return -1;
    spec_w4a8(xq, xd, xs, M, K, codes, wd, wm, N, y);
    free(xq); free(xd);
    return 0;
}

int spec_w8a8_f32(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *wd, int64_t N, float *y) {
    int8_t *xq; float *xd, *xs;
    if (quantized_workspace(x, M, K, &xq, &xd, &xs)) return -1;
    spec_w8a8(xq, xd, M, K, codes, wd, N, y);
    free(xq); free(xd);
    return 0;
}
