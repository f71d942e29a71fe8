/* Decoder layers first .. last-1 of a Llama-family model in one call: the decoding step, verification blocks,
 * tree frontiers and batched rounds (several sequences, each with its own KV cache and mask), on w4a8/w8a8 weights.
 *
 * Per layer, for the R rows of every sequence together (Touvron et al. 2023, Llama; Zhang & Sennrich 2019, RMSNorm;
 * Su et al. 2021, RoPE; Shazeer 2020, SwiGLU):
 *   h = rmsnorm(x) * w_in;  [q k v] = h Wqkv^T (+ b);  q, k = rope(q), rope(k);  write k, v to the cache;
 *   a = attention(q, cache, mask);  x = x + a Wo^T;  h = rmsnorm(x) * w_post;  [g u] = h Wgu^T;
 *   x = x + (silu(g) * u) Wd^T
 * Gemma 3 (Gemma Team 2025) in the same loop, by per-layer pointers and flags rather than another code path: its
 * norms' scales arrive as 1 + weight (the caller adds the 1 in float32, as the torch reference does), q/k norms as
 * Qwen3's, q times q_scale after RoPE (query_pre_attn_scalar), sandwich norms (attn_out_norm on a Wo^T before its
 * residual add, post_norm as the pre-feedforward norm, mlp_out_norm on the MLP's output before its residual add),
 * GeGLU (gelu with the tanh approximation for silu) and sliding-window (local) layers: their own RoPE rows and
 * their own masks (the global mask with keys at slots <= position - window dropped).
 * The projections are qgemm.c's (activations quantized per row and 32-block to int8), each in the layout of the type
 * its GGUF stores (Q4_0/Q4_1, Q8_0/Q5_0 with fp16 scales; Q4_K, Q5_1, Q5_K, Q6_K with float32 ones; a fused q|k|v or
 * gate|up whose tensors differ in type as a stack of parts), attention is attention.c's.
 *
 * Why in C: compiled (torch.compile) layers cost ~240 us of call path per layer on a 2-core CPU (guards, wrappers,
 * one dispatcher call per kernel): a SmolLM2 forward 13.4 ms compiled, 6.6 ms here (benchmarks/step_breakdown.py).
 *
 * Exactness: every operation is per row (norms, RoPE, SiLU, residuals), per output element with a fixed order
 * (qgemm.c) or per attended key list (attention.c), so a row gets the same bits whatever R is, whichever sequence
 * shares the call and wherever the row falls: verification rows equal the one-token step's rows and a batched
 * round equals each sequence alone.  Build: cc -O3 -mavx2 -mfma -fopenmp, no -ffast-math.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

typedef struct spec_projection {
    int64_t bits;                  /* 4: Q4_1 codes [N, K/2] uint8 + scales, offsets [N, K/32]; 8: Q8_0 codes [N, K];
                                    * 6: Q6_K in 6 bits (qgemm.c's spec_w6a8k: codes [N, 3K/4], int8 scales [N, K/16],
                                    * float32 super-block scales [N, K/256] in offsets); 5: Q5_0 in 5 bits (qgemm.c's
                                    * spec_w5a8: codes [N, 5K/8], fp16 scales [N, K/32]) */
    int64_t in_features, out_features;
    const void *codes;             /* in qgemm.c's layout (outputs interleaved by 8) */
    const void *scales, *offsets;  /* float16 (scale_bytes 2; offsets: 4-bit only, NULL for Q4_0's -8 d) or float32 (scale_bytes 4, the
                                    * K-quant layouts: offsets optional with 8-bit codes); 4-bit codes with scale_bytes
                                    * 1: Q4_K as stored (qgemm.c's spec_w4a8q4k: int8 scales and mins [N, 2K/32],
                                    * float32 d and -dmin [N, 2K/256] in offsets) */
    const float *bias;             /* [N] or NULL */
    int64_t scale_bytes;           /* 2 or 4, or 1 (int8: Q4_K, Q6_K as stored) */
    int64_t group;                 /* inputs per scale: 32, or 16 (8-bit codes, float32 scales: Q6_K) */
    const struct spec_projection *parts;  /* nparts > 0: a stacked projection (q|k|v or gate|up stored in different
                                           * types): its outputs are the parts' outputs in order, then bias */
    int64_t nparts;
} spec_projection;

typedef struct {
    const float *input_norm, *post_norm;   /* RMSNorm weights [D]; input_norm NULL: none (an EAGLE head's layer) */
    spec_projection qkv, o, gate_up, down;
    const float *q_norm, *k_norm;          /* per-head RMSNorm weights [head_dim] of q and k (Qwen3), or NULL */
    const float *attn_out_norm, *mlp_out_norm;  /* Gemma 3's norms [D] of the attention's and MLP's outputs before
                                                 * their residual adds, or NULL (Llama) */
    int64_t local;                 /* 1: a sliding-window layer (local RoPE rows and masks), 0: global */
} spec_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;              /* RMSNorm epsilon; softmax scale (head_dim^-1/2 as the caller rounds it) */
    const spec_layer *layers;
    int64_t weight_prefetch;       /* bytes ahead that the products prefetch their codes (0: none; qgemm.c) */
    int64_t gelu;                  /* MLP gate activation: 0 silu (SwiGLU), 1 gelu, tanh approximation (GeGLU) */
    int64_t window;                /* local layers' window: a row at position p attends slots > p - window */
    float q_scale;                 /* q multiplied after RoPE (Gemma: (head_dim / query_pre_attn_scalar)^1/2); 1: no */
} spec_model;

/* y [M, D] = x * rsqrt(mean(x^2) + eps) * w, row by row (fixed-order sum of squares) */
static void rms_norm(const float *x, const float *w, int64_t M, int64_t D, float eps, float *y) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; i < D; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (i = 0; i < D; i++) y[r * D + i] = xr[i] * inv * w[i];
    }
}

/* y [M, N] = x W^T of one projection without parts on rows already quantized (xq, xd, xs; qgemm.c's kernels by
 * layout) */
static void project_quantized(const spec_projection *p, int64_t M, const int8_t *xq, const float *xd, const float *xs,
                              float *y, int64_t ahead) {
    const int64_t K = p->in_features, N = p->out_features;
    if (p->bits == 5)
        spec_w5a8(xq, xd, M, K, (const uint8_t *)p->codes, p->scales, N, y, ahead);
    else if (p->bits == 6)
        spec_w6a8k(xq, xd, M, K, (const uint8_t *)p->codes, (const int8_t *)p->scales, (const float *)p->offsets, N, y,
                   ahead);
    else if (p->scale_bytes == 1 && p->bits == 4)
        spec_w4a8q4k(xq, xd, xs, M, K, (const uint8_t *)p->codes, (const int8_t *)p->scales, (const float *)p->offsets,
                     N, y, ahead);
    else if (p->scale_bytes == 4 && p->bits == 4)
        spec_w4a8k(xq, xd, xs, M, K, (const uint8_t *)p->codes, p->scales, p->offsets, N, y, ahead);
    else if (p->scale_bytes == 4)
        spec_w8a8k(xq, xd, xs, M, K, (const int8_t *)p->codes, p->scales, p->offsets, p->group, N, y, ahead);
    else if (p->bits == 4)
        spec_w4a8(xq, xd, xs, M, K, (const uint8_t *)p->codes, p->scales, p->offsets, N, y, ahead);
    else
        spec_w8a8(xq, xd, M, K, (const int8_t *)p->codes, p->scales, N, y, ahead);
}

/* y [M, N] = x [M, K] W^T (+ bias) on int8 activations; xq, xd, xs: workspaces of M*K, M*K/32, M*K/32.  A stacked
 * projection runs each part on the same quantized rows into a workspace of its own and places its columns.  Returns
 * 0, or -1 when that workspace cannot be allocated. */
static int project(const spec_projection *p, const float *x, int64_t M, int8_t *xq, float *xd, float *xs, float *y,
                   int64_t ahead) {
    const int64_t K = p->in_features, N = p->out_features;
    spec_quantize_rows(x, M, K, xq, xd, xs);
    if (p->nparts == 0) {
        project_quantized(p, M, xq, xd, xs, y, ahead);
    } else {
        int64_t n0 = 0;
        for (int64_t i = 0; i < p->nparts; i++) {
            const spec_projection *q = p->parts + i;
            float *part = malloc(sizeof(float) * (size_t)(M * q->out_features));
            if (!part) return -1;
            project_quantized(q, M, xq, xd, xs, part, ahead);
            for (int64_t r = 0; r < M; r++)
                memcpy(y + r * N + n0, part + r * q->out_features, sizeof(float) * (size_t)q->out_features);
            n0 += q->out_features;
            free(part);
        }
    }
    if (p->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) y[r * N + n] += p->bias[n];
    return 0;
}

/* x [M, D] += y [M, D] */
static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* out [Dh] = x * cos + roll(x, Dh/2) * sin  (sin carries rotate_half's sign: -sin on the first half) */
static void rope_head(const float *x, const float *cos, const float *sin, int64_t Dh, float *out) {
    const int64_t half = Dh / 2;
    for (int64_t i = 0; i < Dh; i++) {
        const float rolled = x[i < half ? i + half : i - half];
        out[i] = x[i] * cos[i] + rolled * sin[i];
    }
}

/* The argument z of the gate's sigmoid, act(g) = g * sigmoid(z): z = g (silu), or z = 2 sqrt(2/pi) (g + 0.044715 g^3)
 * (gelu's tanh approximation, 0.5 g (1 + tanh(y)) = g sigmoid(2y): no cancellation in either tail) */
static const float GELU_K0 = 1.5957691216057308f, GELU_K1 = 1.5957691216057308f * 0.044715f;

static inline __m256 gate_argument(__m256 g, int64_t gelu) {
    if (!gelu) return g;
    return _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_set1_ps(GELU_K1), _mm256_mul_ps(g, g), _mm256_set1_ps(GELU_K0)));
}

/* act [M, I] = act(gate) * up from gu [M, 2I] (gate first): silu(g) = g * sigmoid(g) (SwiGLU, Shazeer 2020) or
 * gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) (GeGLU, Gemma); sigmoid(z) from exp(-|z|) */
static void gated_activation(const float *gu, int64_t M, int64_t I, int64_t gelu, float *act) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i), z = gate_argument(gv, gelu);
            const __m256 e = exp_nonpositive(_mm256_or_ps(z, sign));                /* exp(-|z|) */
            const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);   /* z < 0: e / (1 + e) */
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            const float z = gelu ? g[i] * (GELU_K1 * (g[i] * g[i]) + GELU_K0) : g[i];
            const float e = expf(-fabsf(z)), inv = 1.0f / (1.0f + e);
            a[i] = g[i] * (z < 0.0f ? e * inv : inv) * u[i];
        }
    }
}

/* q [R, H, Dh], k and v [R, HKV, Dh] from the projected rows wide [R, (H + 2 HKV) Dh]: q/k norms (in place) where
 * the layer has them, RoPE at the rows' tables cos, sin [R, Dh], q times q_scale where it is not 1 */
static void split_heads(const spec_model *m, const spec_layer *L, float *wide, int64_t R, const float *cos,
                        const float *sin, float *q, float *k, float *v) {
    const int64_t H = m->heads, HKV = m->kv_heads, Dh = m->head_dim, QKV = (H + 2 * HKV) * Dh;
    if (L->q_norm)                   /* each head of q and of k RMS-normed before RoPE (in place, row by row) */
        for (int64_t r = 0; r < R; r++) {
            rms_norm(wide + r * QKV, L->q_norm, H, Dh, m->eps, wide + r * QKV);
            rms_norm(wide + r * QKV + H * Dh, L->k_norm, HKV, Dh, m->eps, wide + r * QKV + H * Dh);
        }
    for (int64_t r = 0; r < R; r++) {
        const float *row = wide + r * QKV, *c = cos + r * Dh, *s = sin + r * Dh;
        for (int64_t hd = 0; hd < H; hd++) rope_head(row + hd * Dh, c, s, Dh, q + (r * H + hd) * Dh);
        for (int64_t g = 0; g < HKV; g++) {
            rope_head(row + (H + g) * Dh, c, s, Dh, k + (r * HKV + g) * Dh);
            memcpy(v + (r * HKV + g) * Dh, row + (H + HKV + g) * Dh, sizeof(float) * (size_t)Dh);
        }
    }
    if (m->q_scale != 1.0f)
        for (int64_t i = 0; i < R * H * Dh; i++) q[i] *= m->q_scale;
}

/* Layers first .. last-1 over x [R, D] (in place), R = sum of rows[j]: sequence j's rows are x's rows in order,
 * their RoPE tables cos, sin [R, head_dim] (gathered at their positions), their new keys/values go to slots
 * start[j] .. start[j] + rows[j] - 1 of its cache (kc[j], vc[j]: [layers, HKV, smax[j], head_dim], layer stride
 * lstride[j] elements of kv_bytes bytes: 4 float32, 2 float16) and they attend where mask[j] [rows[j],
 * start[j] + rows[j]] is nonzero.  Local layers take local_mask, cos_local, sin_local instead (same shapes; NULL
 * where no layer of the range is local).
 * Returns 0, -1 when a workspace cannot be allocated (x is then partly updated: the caller passes a copy), -3 for
 * a kv_bytes other than 4 or 2, -4 for a local layer in the range without local masks and tables (nothing done). */
int spec_run_layers(const spec_model *m, int64_t first, int64_t last, int64_t nseq, const int64_t *rows,
                    const int64_t *start, const int64_t *smax, void *const *kc, void *const *vc,
                    const int64_t *lstride, int64_t kv_bytes, const uint8_t *const *mask, float *x, const float *cos,
                    const float *sin, const uint8_t *const *local_mask, const float *cos_local,
                    const float *sin_local) {
    const int64_t D = m->hidden, H = m->heads, HKV = m->kv_heads, Dh = m->head_dim, I = m->intermediate;
    const int64_t QKV = (H + 2 * HKV) * Dh;
    int64_t R = 0;
    for (int64_t j = 0; j < nseq; j++) R += rows[j];
    if (kv_bytes != 4 && kv_bytes != 2) return -3;
    for (int64_t l = first; l < last; l++)
        if (m->layers[l].local && !(local_mask && cos_local && sin_local)) return -4;
    if (R == 0 || first >= last) return 0;
    const int64_t widest_in = D > I ? (D > H * Dh ? D : H * Dh) : (I > H * Dh ? I : H * Dh);
    const int64_t widest_out = QKV > 2 * I ? QKV : 2 * I;
    float *h = malloc(sizeof(float) * (size_t)(R * (D > H * Dh ? D : H * Dh)));
    float *wide = malloc(sizeof(float) * (size_t)(R * widest_out));
    float *q = malloc(sizeof(float) * (size_t)(R * H * Dh));
    float *kv = malloc(sizeof(float) * (size_t)(2 * R * HKV * Dh));
    float *att = malloc(sizeof(float) * (size_t)(R * (H * Dh > I ? H * Dh : I)));
    int8_t *xq = malloc((size_t)(R * widest_in));
    float *xd = malloc(sizeof(float) * (size_t)(2 * R * (widest_in / 32)));
    int status = (h && wide && q && kv && att && xq && xd) ? 0 : -1;
    float *k = kv, *v = kv + R * HKV * Dh, *xs = xd ? xd + R * (widest_in / 32) : 0;
    for (int64_t l = first; l < last && status == 0; l++) {
        const spec_layer *L = m->layers + l;
        if (L->input_norm) rms_norm(x, L->input_norm, R, D, m->eps, h);
        else memcpy(h, x, sizeof(float) * (size_t)(R * D));     /* no input norm: an EAGLE head's layer */
        if (project(&L->qkv, h, R, xq, xd, xs, wide, m->weight_prefetch)) { status = -1; break; }
        split_heads(m, L, wide, R, L->local ? cos_local : cos, L->local ? sin_local : sin, q, k, v);
        status = spec_attention_ragged(nseq, rows, start, smax, kc, vc, lstride, l, L->local ? local_mask : mask,
                                       q, k, v, H, HKV, Dh, m->scale, kv_bytes, att);
        if (status) break;
        if (project(&L->o, att, R, xq, xd, xs, h, m->weight_prefetch)) { status = -1; break; }
        if (L->attn_out_norm) rms_norm(h, L->attn_out_norm, R, D, m->eps, h);     /* Gemma: in place, per row */
        add_rows(x, h, R * D);
        rms_norm(x, L->post_norm, R, D, m->eps, h);
        if (project(&L->gate_up, h, R, xq, xd, xs, wide, m->weight_prefetch)) { status = -1; break; }
        gated_activation(wide, R, I, m->gelu, att);
        if (project(&L->down, att, R, xq, xd, xs, h, m->weight_prefetch)) { status = -1; break; }
        if (L->mlp_out_norm) rms_norm(h, L->mlp_out_norm, R, D, m->eps, h);
        add_rows(x, h, R * D);
    }
    free(h); free(wide); free(q); free(kv); free(att); free(xq); free(xd);
    return status;
}

/* y [M, D] = rms_norm(x) * w, row by row: the final norm of a model whose layers run here (the same code as every
 * layer's norms). */
void spec_rms_norm(const float *x, const float *w, int64_t M, int64_t D, float eps, float *y) {
    rms_norm(x, w, M, D, eps, y);
}

/* One sequence's R rows x_in [R, D] through layers first .. last-1 (a decoding step, a verification block or tree):
 * the result goes to x_out [R, D] (x_in is not modified).  Row r is at RoPE position positions[r] (a row of the
 * tables rope_cos, rope_sin [rope_len, head_dim], and of rope_cos_local, rope_sin_local, the local layers' tables of
 * the same shape, or NULL for a model without local layers); its key/value go to slot start + r of the cache (kc,
 * vc: [layers, HKV, smax, head_dim], layer stride lstride elements of kv_bytes bytes); it attends where mask
 * [R, start + R] is nonzero, or, with mask NULL, slots 0 .. start + r (causal), in local layers only the slots
 * > positions[r] - window of those (a cache slot taken as its key's position, the torch reference's window_mask).
 * spec_run_layers for one sequence, with the gathers and the masks done here rather than by the caller.  Returns 0,
 * -1 when a workspace cannot be allocated, -2 when a position is outside the tables, -3 for a kv_bytes other than
 * 4 or 2, -4 for a local layer without local tables (nothing written in these cases). */
int spec_decode_layers(const spec_model *m, int64_t first, int64_t last, int64_t R, int64_t start, int64_t smax,
                       void *kc, void *vc, int64_t lstride, int64_t kv_bytes, const uint8_t *mask, const float *x_in,
                       float *x_out,
                       const float *rope_cos, const float *rope_sin, int64_t rope_len, const int64_t *positions,
                       const float *rope_cos_local, const float *rope_sin_local) {
    const int64_t Dh = m->head_dim, S = start + R;
    const int local = rope_cos_local && rope_sin_local;
    if (kv_bytes != 4 && kv_bytes != 2) return -3;
    if (R == 0) return 0;
    for (int64_t r = 0; r < R; r++)
        if (positions[r] < 0 || positions[r] >= rope_len) return -2;
    for (int64_t l = first; l < last; l++)
        if (m->layers[l].local && !local) return -4;
    float *cs = malloc(sizeof(float) * (size_t)((local ? 4 : 2) * R * Dh));
    uint8_t *causal = mask ? 0 : malloc((size_t)(R * S));
    uint8_t *windowed = local ? malloc((size_t)(R * S)) : 0;
    if (!cs || (!mask && !causal) || (local && !windowed)) { free(cs); free(causal); free(windowed); return -1; }
    for (int64_t r = 0; r < R; r++) {
        const size_t row = sizeof(float) * (size_t)Dh;
        memcpy(cs + r * Dh, rope_cos + positions[r] * Dh, row);
        memcpy(cs + (R + r) * Dh, rope_sin + positions[r] * Dh, row);
        if (local) {
            memcpy(cs + (2 * R + r) * Dh, rope_cos_local + positions[r] * Dh, row);
            memcpy(cs + (3 * R + r) * Dh, rope_sin_local + positions[r] * Dh, row);
        }
    }
    if (causal)
        for (int64_t r = 0; r < R; r++) {
            memset(causal + r * S, 1, (size_t)(start + r + 1));
            memset(causal + r * S + start + r + 1, 0, (size_t)(R - r - 1));
        }
    const uint8_t *mk = mask ? mask : causal;
    if (windowed)
        for (int64_t r = 0; r < R; r++)
            for (int64_t s = 0; s < S; s++)
                windowed[r * S + s] = mk[r * S + s] && s > positions[r] - m->window;
    memcpy(x_out, x_in, sizeof(float) * (size_t)(R * m->hidden));
    const uint8_t *wk = windowed;
    const int status = spec_run_layers(m, first, last, 1, &R, &start, &smax, &kc, &vc, &lstride, kv_bytes, &mk,
                                       x_out, cs, cs + R * Dh, local ? &wk : 0, local ? cs + 2 * R * Dh : 0,
                                       local ? cs + 3 * R * Dh : 0);
    free(cs);
    free(causal);
    free(windowed);
    return status;
}

/* The EAGLE draft head's forward (Li et al. 2024, Sec. 3; drafters/draft_head.py) for R rows in one call: row r reads
 * the embedding row tokens[r] of embed [V, D] and its feature features [R, D] (float32), and
 *   x = [embed[tokens[r]]; features[r]] Wfc^T + bfc;  f^ = layer 0 of m over x (spec_decode_layers: its input norm
 *   NULL, KV to slots start .. start + R - 1, mask [R, start + R] or causal, RoPE rows positions[r]);
 *   logits = (out_norm ? rms_norm(f^) * out_norm : f^) Wlm^T  (the draft vocabulary's LM-head rows)
 * into features_out [R, D] (f^) and logits [L, lm->out_features] of the last L = lm_rows rows (0 <= L <= R; a
 * catch-up over many rows needs the last one's only).  Every operation is per row, as in the layers.
 * Returns spec_decode_layers' status (0; -1 no workspace; -2 position outside the tables; -3 bad kv_bytes), or -5
 * for a token outside 0 .. vocab-1 or lm_rows outside 0 .. R (nothing written then). */
int spec_draft_head(const spec_model *m, const spec_projection *fc, const spec_projection *lm, const float *out_norm,
                    float out_eps, int64_t R, const int64_t *tokens, const float *embed, int64_t vocab,
                    const float *features, int64_t start, int64_t smax, void *kc, void *vc, int64_t lstride,
                    int64_t kv_bytes, const uint8_t *mask, const float *rope_cos, const float *rope_sin,
                    int64_t rope_len, const int64_t *positions, int64_t lm_rows, float *features_out,
                    float *logits) {
    const int64_t D = m->hidden, K = 2 * D;
    if (R == 0) return 0;
    if (lm_rows < 0 || lm_rows > R) return -5;
    for (int64_t r = 0; r < R; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab) return -5;
    float *xin = malloc(sizeof(float) * (size_t)(R * K));
    float *x = malloc(sizeof(float) * (size_t)(R * D));
    int8_t *xq = malloc((size_t)(R * K));
    float *xd = malloc(sizeof(float) * (size_t)(2 * R * (K / 32)));
    int status = (xin && x && xq && xd) ? 0 : -1;
    if (status == 0) {
        for (int64_t r = 0; r < R; r++) {
            memcpy(xin + r * K, embed + tokens[r] * D, sizeof(float) * (size_t)D);
            memcpy(xin + r * K + D, features + r * D, sizeof(float) * (size_t)D);
        }
        status = project(fc, xin, R, xq, xd, xd + R * (K / 32), x, m->weight_prefetch);
    }
    if (status == 0)
        status = spec_decode_layers(m, 0, 1, R, start, smax, kc, vc, lstride, kv_bytes, mask, x, features_out,
                                    rope_cos, rope_sin, rope_len, positions, 0, 0);
    if (status == 0) {
        const float *h = features_out + (R - lm_rows) * D;
        if (out_norm && lm_rows) {
            rms_norm(h, out_norm, lm_rows, D, out_eps, x);
            h = x;
        }
        if (lm_rows) status = project(lm, h, lm_rows, xq, xd, xd + lm_rows * (K / 32), logits, m->weight_prefetch);
    }
    free(xin); free(x); free(xq); free(xd);
    return status;
}
