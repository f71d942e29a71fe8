/* Attention of query rows over a static KV cache with a boolean mask, each row computed on its own (AVX2).
 * The cache holds float32 or float16 keys and values (F16 = 1; float16: rounded to nearest even when written, read
 * back exactly as float32, half the bytes a step streams; llama.cpp's default cache type), all arithmetic in float32.
 *
 *   out[t, h] = sum_i softmax_i(scale * q[t, h] . k[s_i]) v[s_i],   s_0 < s_1 < ... the slots row t may attend
 *
 * Work: one unit per query row and key/value head (its heads split over the threads when there are fewer units than
 * threads); the H / HKV query heads sharing that key/value head (grouped-query
 * attention, Ainslie et al. 2023) are computed together, so each key and value row is read from the cache once for
 * all of them, and scores are computed for 4 keys and all those heads at a time (4 x 3 FMA chains, one transpose of
 * their lane sums per head instead of 4 horizontal sums).  SmolLM2's shape (9 heads, 3 key/value heads, 64 dims),
 * 2 threads, 300 cached slots: about 2x faster than one head at a time, and the 4-key tiles with the head size as a
 * constant another 12-20 % over 8 keys of one head at a time, the same bits (benchmarks/attention_cost.py).
 *
 * Exactness: a row's result depends only on its query and on the sequence of keys/values it attends, in slot
 * order: the visible slots are first listed densely, and every sum (over the head dimension, over the listed keys)
 * runs in a fixed order over that list, whichever heads or keys share a vector.  So a row of a verification block
 * or tree (its ancestors at scattered tree slots, the other slots masked) gets exactly the bits of the one-token
 * step that attends the same keys at contiguous slots, whatever T is: the batch invariance greedy speculative
 * decoding rests on, by construction, in float32 (no float64 cache needed).
 * Build: cc -O3 -mavx2 -mfma -fopenmp, no -ffast-math.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"
#include <omp.h>
#include <stdlib.h>


#define INLINE static inline __attribute__((always_inline))
#define HT_MAX 4         /* query heads of one key/value head handled together: each key/value row read once for them */

/* 8 floats of a cache row: element `off` of base (float32, or float16 when F16, a constant after inlining) on */
INLINE __m256 load_kv8(const void *base, int64_t off, int F16) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
    return _mm256_loadu_ps((const float *)base + off);
}

/* n floats from src to cache row dst (float32, or float16 rounded to nearest even when F16; n a multiple of 8) */
INLINE void store_kv(void *dst, const float *src, int64_t n, int F16) {
    for (int64_t c = 0; c < n; c += 8) {
        const __m256 x = _mm256_loadu_ps(src + c);
        if (F16) _mm_storeu_si128((__m128i *)((uint16_t *)dst + c), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        else _mm256_storeu_ps((float *)dst + c, x);
    }
}

/* The 4 lane sums of a0..a3 as one vector: lane j = ((a_j0 + a_j1) + (a_j2 + a_j3)) + ((a_j4 + a_j5) + (a_j6 + a_j7)),
 * the same order for every j (a transpose by horizontal adds; the order the 8-key version of this kernel used, so
 * the scores kept their bits). */
INLINE __m128 lane_sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of HT heads (queries q + h * D) over the n listed slots: p[h * pstride + i] = scale * q_h . k[slot[i]].
 * Keys 4 at a time for all HT heads (4 * HT FMA chains; each 8 floats of a key row are loaded once for the HT
 * heads): each dot product is one FMA chain over the head dimension (8 floats a step), then its 8 lanes are summed
 * in lane_sums4's order, the same for every key (a last partial group repeats its last key). */
INLINE void scores_d(const float *q, const void *kb, const int64_t *slot, int64_t n, int64_t D, int HT,
                   float scale, float *p, int64_t pstride, int F16) {
    const int64_t nd = D / 8;
    const __m128 vscale = _mm_set1_ps(scale);
    for (int64_t i0 = 0; i0 < n; i0 += 4) {
        const int64_t cnt = n - i0 < 4 ? n - i0 : 4;
        int64_t kr[4];                /* offsets of the 4 key rows */
        for (int j = 0; j < 4; j++) kr[j] = slot[i0 + (j < cnt ? j : cnt - 1)] * D;
        __m256 acc[HT_MAX][4];
        for (int h = 0; h < HT; h++)
            for (int j = 0; j < 4; j++) acc[h][j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nd; c++) {
            __m256 qv[HT_MAX];
            for (int h = 0; h < HT; h++) qv[h] = _mm256_loadu_ps(q + h * D + 8 * c);
            for (int j = 0; j < 4; j++) {
                const __m256 kv = load_kv8(kb, kr[j] + 8 * c, F16);
                for (int h = 0; h < HT; h++) acc[h][j] = _mm256_fmadd_ps(qv[h], kv, acc[h][j]);
            }
        }
        for (int h = 0; h < HT; h++) {
            const __m128 s = _mm_mul_ps(lane_sums4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), vscale);
            if (cnt == 4) {
                _mm_storeu_ps(p + h * pstride + i0, s);
            } else {
                float tmp[4];
                _mm_storeu_ps(tmp, s);
                for (int64_t j = 0; j < cnt; j++) p[h * pstride + i0 + j] = tmp[j];
            }
        }
    }
}

INLINE void scores(const float *q, const void *kb, const int64_t *slot, int64_t n, int64_t D, int HT,
                   float scale, float *p, int64_t pstride, int F16) {
    /* common head sizes as constants: the loops over the head dimension unroll (~15 % faster at SmolLM2's 64) */
    if (D == 64) scores_d(q, kb, slot, n, 64, HT, scale, p, pstride, F16);
    else if (D == 128) scores_d(q, kb, slot, n, 128, HT, scale, p, pstride, F16);
    else scores_d(q, kb, slot, n, D, HT, scale, p, pstride, F16);
}

/* p[0 .. n) <- exp(p - max p) in place (8 floats of padding at p + n); returns their sum (8 lanes, fixed order) */
static float softmax_numerators(float *p, int64_t n) {
    for (int64_t i = n; i < n + 8; i++) p[i] = -INFINITY;
    __m256 vmax = _mm256_set1_ps(-INFINITY);            /* the max is exact in any order (+0 vs -0 aside: same exps) */
    for (int64_t i = 0; i < n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + i));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    return hsum8(sv);
}

/* out[h] [D] (heads h < HT, stride D) = sum_i p[h][i] v[slot[i]] / sum[h], CV vectors of 8 floats of the head
 * dimension at a time (HT * CV accumulators in registers), each element one FMA chain over the slots in order. */
INLINE void weighted_values(const void *vb, const int64_t *slot, int64_t n, int64_t D, int HT, int CV, const float *p,
                            int64_t pstride, const float *sum, float *out, int F16) {
    for (int64_t c0 = 0; c0 < D / 8; c0 += CV) {
        __m256 acc[HT_MAX][4];
        for (int h = 0; h < HT; h++)
            for (int c = 0; c < CV; c++) acc[h][c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const int64_t vr = slot[i] * D + 8 * c0;
            __m256 w[HT_MAX];
            for (int h = 0; h < HT; h++) w[h] = _mm256_set1_ps(p[h * pstride + i]);
            for (int c = 0; c < CV; c++) {
                const __m256 vv = load_kv8(vb, vr + 8 * c, F16);
                for (int h = 0; h < HT; h++) acc[h][c] = _mm256_fmadd_ps(w[h], vv, acc[h][c]);
            }
        }
        for (int h = 0; h < HT; h++) {
            const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / sum[h] : 0.0f);
            for (int c = 0; c < CV; c++) _mm256_storeu_ps(out + h * D + 8 * (c0 + c), _mm256_mul_ps(acc[h][c], inv));
        }
    }
}

/* HT (a constant after inlining) query heads of one row, all of one key/value head (kb, vb [S, D]), over the n
 * listed slots; p: workspace of HT * pstride floats (pstride >= n + 8). */
INLINE void attend_heads(const float *q, const void *kb, const void *vb, const int64_t *slot, int64_t n, int64_t D,
                         int HT, float scale, float *p, int64_t pstride, float *out, int F16) {
    float sum[HT_MAX];
    scores(q, kb, slot, n, D, HT, scale, p, pstride, F16);
    for (int h = 0; h < HT; h++) sum[h] = softmax_numerators(p + h * pstride, n);
    const int64_t nd = D / 8;
    if (D == 64) weighted_values(vb, slot, n, 64, HT, HT > 3 ? 2 : 4, p, pstride, sum, out, F16);
    else if (D == 128) weighted_values(vb, slot, n, 128, HT, HT > 3 ? 2 : 4, p, pstride, sum, out, F16);
    else if (nd % 4 == 0) weighted_values(vb, slot, n, D, HT, HT > 3 ? 2 : 4, p, pstride, sum, out, F16);
    else if (nd % 2 == 0) weighted_values(vb, slot, n, D, HT, 2, p, pstride, sum, out, F16);
    else weighted_values(vb, slot, n, D, HT, 1, p, pstride, sum, out, F16);
}

/* The heads of one row that share key/value head kv (group g = H / HKV of them, in tiles of up to HT_MAX): the row
 * attends the slots of mask row mr [S] that are nonzero.  p, slot: workspaces of HT_MAX * (S + 8) floats and
 * S + 1 indices.  The only code that computes a row (both entry points), in two copies: float32 and float16 caches.
 *
 * Each head's result is a fixed sequence of operations over its query and the attended keys/values in slot order
 * (scores: one FMA chain per key; softmax sums: 8 lanes over the listed keys; values: one FMA chain per element),
 * the same whichever heads share a tile. */
INLINE void attend_row_group_t(const float *q, const void *kb, const void *vb, const uint8_t *mr, int64_t S,
                               int64_t D, int64_t g, float scale, float *p, int64_t *slot, float *out, int F16) {
    int64_t n = 0;
    for (int64_t s = 0; s < S; s++)
        if (mr[s]) slot[n++] = s;
    const int64_t pstride = S + 8;
    for (int64_t h0 = 0; h0 < g; h0 += HT_MAX) {
        const float *qh = q + h0 * D;
        float *oh = out + h0 * D;
        switch (g - h0 < HT_MAX ? g - h0 : HT_MAX) {
            case 1: attend_heads(qh, kb, vb, slot, n, D, 1, scale, p, pstride, oh, F16); break;
            case 2: attend_heads(qh, kb, vb, slot, n, D, 2, scale, p, pstride, oh, F16); break;
            case 3: attend_heads(qh, kb, vb, slot, n, D, 3, scale, p, pstride, oh, F16); break;
            default: attend_heads(qh, kb, vb, slot, n, D, 4, scale, p, pstride, oh, F16); break;
        }
    }
}

static void attend_row_group_f32(const float *q, const void *kb, const void *vb, const uint8_t *mr, int64_t S,
                                 int64_t D, int64_t g, float scale, float *p, int64_t *slot, float *out) {
    attend_row_group_t(q, kb, vb, mr, S, D, g, scale, p, slot, out, 0);
}

static void attend_row_group_f16(const float *q, const void *kb, const void *vb, const uint8_t *mr, int64_t S,
                                 int64_t D, int64_t g, float scale, float *p, int64_t *slot, float *out) {
    attend_row_group_t(q, kb, vb, mr, S, D, g, scale, p, slot, out, 1);
}

/* Several sequences' blocks in one call (a batched round): sequence j has rows[j] rows (query rows
 * q [sum rows, H, D], new keys/values kn, vn [sum rows, HKV, D] float32, in sequence order), its own cache whose
 * layer `layer` starts at element layer * lstride[j] of kc[j] (and likewise vc), laid out [HKV, smax[j], D] in
 * elements of kv_bytes bytes (4: float32, 2: float16, every cache of the call), and its mask
 * mask[j] [rows[j], start[j] + rows[j]].  The new keys/values kn, vn (unless NULL) are first written to slots
 * start[j] .. of their cache (float16: rounded to nearest even); then every row attends.  Returns 0, -1 if a
 * workspace cannot be allocated, -3 for a kv_bytes other than 4 or 2 (nothing written then). */
int spec_attention_ragged(int64_t nseq, const int64_t *rows, const int64_t *start, const int64_t *smax,
                          void *const *kc, void *const *vc, const int64_t *lstride, int64_t layer,
                          const uint8_t *const *mask, const float *q, const float *kn, const float *vn, int64_t H,
                          int64_t HKV, int64_t D, float scale, int64_t kv_bytes, float *out) {
    if (kv_bytes != 4 && kv_bytes != 2) return -3;
    const int F16 = kv_bytes == 2;
    const int64_t group = H / HKV;
    char *k[nseq > 0 ? nseq : 1], *v[nseq > 0 ? nseq : 1];
    for (int64_t j = 0; j < nseq; j++) {
        k[j] = (char *)kc[j] + layer * lstride[j] * kv_bytes;
        v[j] = (char *)vc[j] + layer * lstride[j] * kv_bytes;
    }
    int64_t total = 0, widest = 0;
    for (int64_t j = 0; j < nseq; j++) {
        for (int64_t t = 0; kn && t < rows[j]; t++)
            for (int64_t g = 0; g < HKV; g++) {
                const int64_t src = ((total + t) * HKV + g) * D, dst = ((g * smax[j] + start[j] + t) * D) * kv_bytes;
                store_kv(k[j] + dst, kn + src, D, F16);
                store_kv(v[j] + dst, vn + src, D, F16);
            }
        total += rows[j];
        widest = start[j] + rows[j] > widest ? start[j] + rows[j] : widest;
    }
    /* Fewer (row, key/value head) units than threads (a one-token step with one key/value head: Gemma 3 270M's 4
     * query heads on 1): each unit's heads split into `tiles` parts, run by different threads.  The same bits: a
     * head's result never depends on the heads computed beside it. */
    const int64_t units = total * HKV, threads = omp_get_max_threads();
    const int64_t tiles = units > 0 && units < threads ? (group < threads / units ? group : threads / units) : 1;
    const int64_t per = (group + tiles - 1) / tiles;
    int failed = 0;
    #pragma omp parallel
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(HT_MAX * (widest + 8)));
        int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(widest + 1));
        if (!p || !slot) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units * tiles; u++) {
            if (!p || !slot) continue;
            const int64_t rg = u / tiles, part = u % tiles;
            int64_t r = rg / HKV, j = 0, first = 0;
            while (r >= first + rows[j]) first += rows[j++];
            const int64_t t = r - first, kv = rg % HKV, S = start[j] + rows[j], h0 = kv * group + part * per;
            const int64_t heads = (part + 1) * per < group ? per : group - part * per;
            if (heads <= 0) continue;
            const int64_t off = kv * smax[j] * D * kv_bytes;
            (F16 ? attend_row_group_f16 : attend_row_group_f32)(q + (r * H + h0) * D, k[j] + off, v[j] + off,
                                                                mask[j] + t * S, S, D, heads, scale, p, slot,
                                                                out + (r * H + h0) * D);
        }
        free(p);
        free(slot);
    }
    return failed ? -1 : 0;
}

/* q [T, H, D]; k, v [HKV, smax, D] (one layer's cache, elements of kv_bytes bytes: 4 float32, 2 float16);
 * mask [T, S] (nonzero: may attend slot s < S); out [T, H, D].  D a multiple of 8, at most 256.  The ragged call's
 * code for one sequence, no KV write.  Returns as spec_attention_ragged. */
int spec_attention(const float *q, const void *k, const void *v, int64_t smax, const uint8_t *mask,
                   int64_t T, int64_t H, int64_t HKV, int64_t D, int64_t S, float scale, int64_t kv_bytes, float *out) {
    const int64_t rows = T, start = S - T, lstride = 0;
    void *kc = (void *)k, *vc = (void *)v;
    return spec_attention_ragged(1, &rows, &start, &smax, &kc, &vc, &lstride, 0, &mask, q, 0, 0, H, HKV, D, scale,
                                 kv_bytes, out);
}
