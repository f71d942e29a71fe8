/* Attention of query rows over a static KV cache with a boolean mask, each row computed on its own (AVX2).
 *
 *   out[t, h] = sum_i softmax_i(scale * q[t, h] . k[s_i]) v[s_i],   s_0 < s_1 < ... the slots row t may attend
 *
 * Exactness: a row's result depends only on its query and on the sequence of keys/values it attends, in slot
 * order: the visible slots are first listed densely, and every sum (over the head dimension, over the listed keys)
 * runs in a fixed order over that list.  So a row of a verification block or tree (its ancestors at scattered tree
 * slots, the other slots masked) gets exactly the bits of the one-token step that attends the same keys at
 * contiguous slots, whatever T is: the batch invariance greedy speculative decoding rests on, by construction,
 * in float32 (no float64 cache needed).  Build: cc -O3 -mavx2 -mfma -fopenmp, no -ffast-math.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"
#include <stdlib.h>


/* One query row qr [D] of head group kv over the slots of mask row mr [S] that are nonzero; p, slot: workspaces
 * of S + 8 floats and S + 1 indices; writes out [D].  The only code that computes a row (both entry points). */
static void attend_row(const float *qr, const float *kb, const float *vb, const uint8_t *mr, int64_t S, int64_t D,
                       float scale, float *p, int64_t *slot, float *out) {
    const int64_t nd = D / 8;
    int64_t n = 0;
    for (int64_t s = 0; s < S; s++)
        if (mr[s]) slot[n++] = s;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float *kr = kb + slot[i] * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < nd; c++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc);
        p[i] = hsum8(acc) * scale;
        m = p[i] > m ? p[i] : m;
    }
    for (int64_t i = n; i < n + 8; i++) p[i] = -INFINITY;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    const float sum = hsum8(sv);
    __m256 acc[32];
    for (int64_t c = 0; c < nd; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const __m256 w = _mm256_set1_ps(p[i]);
        const float *vr = vb + slot[i] * D;
        for (int64_t c = 0; c < nd; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
    }
    const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / sum : 0.0f);
    for (int64_t c = 0; c < nd; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

/* Several sequences' blocks in one call (a batched round): sequence j has rows[j] rows (query rows
 * q [sum rows, H, D], new keys/values kn, vn [sum rows, HKV, D], in sequence order), its own cache whose layer
 * `layer` starts at kc[j] + layer * lstride[j] (and likewise vc), laid out [HKV, smax[j], D], and its mask
 * mask[j] [rows[j], start[j] + rows[j]].  The new keys/values kn, vn (unless NULL) are first written to slots
 * start[j] .. of their cache; then every row attends.  Returns 0, or -1 if a workspace cannot be allocated. */
int spec_attention_ragged(int64_t nseq, const int64_t *rows, const int64_t *start, const int64_t *smax,
                          float *const *kc, float *const *vc, const int64_t *lstride, int64_t layer,
                          const uint8_t *const *mask, const float *q, const float *kn, const float *vn, int64_t H,
                          int64_t HKV, int64_t D, float scale, float *out) {
    const int64_t group = H / HKV;
    float *k[nseq > 0 ? nseq : 1], *v[nseq > 0 ? nseq : 1];
    for (int64_t j = 0; j < nseq; j++) { k[j] = kc[j] + layer * lstride[j]; v[j] = vc[j] + layer * lstride[j]; }
    int64_t total = 0, widest = 0;
    for (int64_t j = 0; j < nseq; j++) {
        for (int64_t t = 0; kn && t < rows[j]; t++)
            for (int64_t g = 0; g < HKV; g++) {
                const int64_t src = ((total + t) * HKV + g) * D, dst = (g * smax[j] + start[j] + t) * D;
                for (int64_t c = 0; c < D; c++) { k[j][dst + c] = kn[src + c]; v[j][dst + c] = vn[src + c]; }
            }
        total += rows[j];
        widest = start[j] + rows[j] > widest ? start[j] + rows[j] : widest;
    }
    int failed = 0;
    #pragma omp parallel
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(widest + 8));
        int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(widest + 1));
        if (!p || !slot) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t rh = 0; rh < total * H; rh++) {
            if (!p || !slot) continue;
            int64_t r = rh / H, j = 0, first = 0;
            while (r >= first + rows[j]) first += rows[j++];
            const int64_t t = r - first, kv = (rh % H) / group, S = start[j] + rows[j];
            attend_row(q + rh * D, k[j] + kv * smax[j] * D, v[j] + kv * smax[j] * D, mask[j] + t * S, S, D, scale,
                       p, slot, out + rh * D);
        }
        free(p);
        free(slot);
    }
    return failed ? -1 : 0;
}

/* q [T, H, D]; k, v [HKV, smax, D] (one layer's cache); mask [T, S] (nonzero: may attend slot s < S);
 * out [T, H, D].  D a multiple of 8, at most 256.  The ragged call's code for one sequence, no KV write. */
int spec_attention(const float *q, const float *k, const float *v, int64_t smax, const uint8_t *mask,
                   int64_t T, int64_t H, int64_t HKV, int64_t D, int64_t S, float scale, float *out) {
    const int64_t rows = T, start = S - T, lstride = 0;
    float *kc = (float *)k, *vc = (float *)v;
    return spec_attention_ragged(1, &rows, &start, &smax, &kc, &vc, &lstride, 0, &mask, q, 0, 0, H, HKV, D, scale,
                                 out);
}
