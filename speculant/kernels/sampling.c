/* Sampling kernels: a temperature softmax over a vocabulary row and one inverse-CDF draw from a row or from the
 * residual distribution of speculative sampling, each in one call on the calling thread.
 *
 * After a decoding step has streamed the model's weights through the caches, every small tensor operation on a
 * vocabulary row costs several times its arithmetic (BENCHMARKS.md BO); these make the passes a sampled round needs
 * over a row in C, with no allocation.
 *
 *   spec_softmax_rows:  out[r] = softmax(logits[r] * inv_temp)  (float32 out, float64 sum)
 *   spec_draw:          one index from norm(max(0, p - q)) (q dense, sparse over ids, or absent), by inverse CDF
 *                       with the uniform u: token i when u * total falls in [c_{i-1}, c_i) (Leviathan et al. 2023,
 *                       Alg. 1's residual; a row of zeros after the subtraction draws from p itself, as
 *                       speculant.verification.rules.residual keeps r where r == q)
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define DRAW_BLOCK 256      /* entries per block of the two-level inverse CDF */

/* The sum of 8 floats as doubles, in a fixed order. */
static inline __m256d add_as_doubles(__m256d acc, __m256 v) {
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double hsum4d(__m256d v) {
    double l[4];
    _mm256_storeu_pd(l, v);
    return (l[0] + l[1]) + (l[2] + l[3]);
}

/* out [rows, V] = softmax(logits [rows, V] * inv_temp), row by row: max, exp(x - max) (simd.h's polynomial), a
 * float64 sum, a multiply by 1 / sum.  inv_temp > 0.  Logits of -inf give 0; a row of -inf gives NaNs (torch's
 * softmax does; a drafter reads such a row as proposing nothing).  Logits must not be NaN. */
void spec_softmax_rows(const float *logits, int64_t rows, int64_t V, float inv_temp, float *out) {
    const __m256 it = _mm256_set1_ps(inv_temp);
    for (int64_t r = 0; r < rows; r++) {
        const float *l = logits + r * V;
        float *o = out + r * V;
        float m = -INFINITY;
        int64_t i = 0;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= V; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(l + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        for (; i < V; i++) m = l[i] > m ? l[i] : m;
        if (!(m > -INFINITY)) {                       /* every logit -inf: NaNs, as torch.softmax gives */
            for (i = 0; i < V; i++) o[i] = NAN;
            continue;
        }
        const __m256 vm = _mm256_set1_ps(m);
        __m256d acc = _mm256_setzero_pd();
        double tail = 0.0;
        for (i = 0; i + 8 <= V; i += 8) {
            const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), vm), it));
            _mm256_storeu_ps(o + i, e);
            acc = add_as_doubles(acc, e);
        }
        for (; i < V; i++) {
            float x[8] = {(l[i] - m) * inv_temp, 0, 0, 0, 0, 0, 0, 0}, e[8];
            _mm256_storeu_ps(e, exp_nonpositive(_mm256_loadu_ps(x)));
            o[i] = e[0];
            tail += e[0];
        }
        const float inv = (float)(1.0 / (hsum4d(acc) + tail));
        const __m256 vi = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= V; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vi));
        for (; i < V; i++) o[i] *= inv;
    }
}

/* The residual's entry i: max(0, p_i - q_i) where q is dense (qd != NULL), p_i where it is absent. */
static inline float residual_at(const float *p, const float *qd, int64_t i) {
    if (!qd) return p[i];
    const float d = p[i] - qd[i];
    return d > 0.0f ? d : 0.0f;
}

/* Float64 sum of the residual's entries [s, e): 8 at a time (as doubles, 4 lanes, fixed order), then the tail. */
static double block_sum(const float *p, const float *qd, int64_t s, int64_t e) {
    __m256d acc = _mm256_setzero_pd();
    int64_t i = s;
    if (!qd) {
        for (; i + 8 <= e; i += 8) acc = add_as_doubles(acc, _mm256_loadu_ps(p + i));
    } else {
        const __m256 z = _mm256_setzero_ps();
        for (; i + 8 <= e; i += 8)
            acc = add_as_doubles(acc, _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(qd + i)), z));
    }
    double bs = hsum4d(acc);
    for (; i < e; i++) bs += residual_at(p, qd, i);
    return bs;
}

/* One draw from norm(max(0, p - q)) over V entries (see the header), in two levels: the float64 sums of blocks of
 * DRAW_BLOCK entries, the block the draw falls in, then that block's entries in order.  q: NULL (draw from p), dense
 * [V] (ids == NULL) or [nq] at token ids `ids` (sparse; distinct, in [0, V)).  scratch: V floats (used for a sparse
 * q only).  u in [0, 1).  Never returns an entry of zero residual: a draw that rounding puts past the last block
 * with mass takes that block's last positive entry.  A residual of zeros everywhere draws from p (no rejection was
 * possible there); a p of zeros returns V - 1. */
int64_t spec_draw(const float *p, int64_t V, const float *q, const int64_t *ids, int64_t nq, double u,
                  float *scratch) {
    const float *row = p, *qd = ids ? NULL : q;
    if (q && ids) {                                  /* the residual written out: p with its drafted entries reduced */
        memcpy(scratch, p, (size_t)V * sizeof(float));
        for (int64_t j = 0; j < nq; j++) {
            const float d = p[ids[j]] - q[j];
            scratch[ids[j]] = d > 0.0f ? d : 0.0f;
        }
        row = scratch;
    }
    const int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double sums[nb];
    double total = 0.0;
    for (int pass = 0; pass < 2; pass++) {
        total = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t s = b * DRAW_BLOCK, e = s + DRAW_BLOCK < V ? s + DRAW_BLOCK : V;
            sums[b] = block_sum(row, qd, s, e);
            total += sums[b];
        }
        if (total > 0.0 || (row == p && !qd)) break;
        row = p, qd = NULL;                          /* p == q: no rejection was possible; p itself */
    }
    if (!(total > 0.0)) return V - 1;
    const double target = u * total;
    double c = 0.0, c_last = 0.0;
    int64_t last = -1;
    for (int64_t b = 0; b < nb; b++) {
        if (sums[b] > 0.0) {
            last = b, c_last = c;
            if (c + sums[b] > target) break;
        }
        c += sums[b];
    }
    const int64_t s = last * DRAW_BLOCK, e = s + DRAW_BLOCK < V ? s + DRAW_BLOCK : V;
    double cc = c_last;
    int64_t pick = -1;
    for (int64_t k = s; k < e; k++) {
        const float r = residual_at(row, qd, k);
        if (r > 0.0f) {
            pick = k;
            cc += r;
            if (cc > target) return k;
        }
    }
    return pick;
}
