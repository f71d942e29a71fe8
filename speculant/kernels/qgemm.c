/* Weight-quantized matrix products on int8 activations (AVX2 + F16C), llama.cpp's block dot products.
 *
 *   y[m, n] = sum_g  wd[n, g] * xd[m, g] * (sum_{i<32} q[n, g, i] * xq[m, g, i])  +  wm[n, g] * xs[m, g]
 *
 * Weights: blocks of 32 along the input dimension (GGUF Q4_0 / Q4_1 / Q8_0), scale wd and min wm per block in fp16 (as
 * GGUF stores them).  4-bit codes are packed two per byte, byte j of a block holding code j (low nibble) and code
 * j + 16 (high nibble), as in GGUF.  Activations: quantized per row and block of 32 to int8 (llama.cpp's Q8_1):
 * xd = max|x| / 127, xq = round(x / xd) (to nearest even), xs = xd * sum(xq), float32.
 *
 * Layout: outputs in groups of 8 ("lanes"), the group's blocks interleaved so that one 256-bit vector holds 4
 * consecutive codes of each of the 8 outputs (one 32-bit lane per output).  With the 4 matching activation bytes
 * broadcast to every lane, vpmaddubsw + vpmaddwd leave in lane j the dot product of output n0 + j over those 4
 * inputs, so a block's integer sum is built by vertical adds and no horizontal sum is ever needed; the float work
 * (convert, scale, accumulate) is one vector operation per 8 outputs, row and block.  Per group of 8 outputs n0..n0+7
 * and block g, in the rows n0..n0+7 of the buffers (which keep their [N, ...] shape):
 *   Q4_1 codes: 128 bytes: for L = 0..3, for j = 0..7: GGUF bytes 4L..4L+3 of output n0+j's block g (codes
 *               4L..4L+3 in the low nibbles, 16+4L..16+4L+3 in the high ones);
 *   Q8_0 codes: 256 bytes: for c = 0..7, for j = 0..7: codes 4c..4c+3 of output n0+j's block g;
 *   wd, wm:     8 fp16: output n0+j's value for block g at j.
 * The last N % 8 outputs (a reduced-vocabulary LM head's, say) are stored as they are in GGUF, row by row.
 *
 * Exactness: each output element y[m, n] is computed by one thread with this float sequence, whatever M is, wherever
 * row m falls in a tile of rows and whether output n is in a group of 8 or among the last N % 8:
 *     acc = 0;  for g = 0 .. G-1:  acc = fma((float)isum[g], wd[g] * xd[g], acc);  [Q4_1: acc = fma(wm[g], xs[g], acc)]
 *     y[m, n] = acc
 * where isum[g] is the block's exact integer dot product (|isum| < 2^24: exact in float; the int16 partial sums
 * cannot saturate or wrap, see below), so each row of a product gets the bits it gets alone (batch invariance),
 * which greedy speculative decoding's exactness rests on.  A vector lane does exactly what the scalar code for the
 * last N % 8 outputs does (fmaf, one float multiply), so a reduced-vocabulary head's rows get the bits they get in
 * the full head.  No float multiply is ever followed by an add (GCC's default -ffp-contract=fast could fuse them,
 * differently in differently unrolled copies).
 * Integer sums on CPUs with VNNI (SPEC_DPBUSD, set by build.py from the CPU's flags): vpdpbusd adds 4 products of
 * unsigned and signed bytes into each int32 lane in one instruction, where AVX2 needs vpmaddubsw + vpmaddwd (or
 * vpaddw into int16, then one vpmaddwd per block).  The integer sums are exact either way (no partial sum can
 * saturate, see the group functions), so every variant computes the same bits; SPEC_DPBUSD = 3 runs the VNNI code
 * with vpdpbusd emulated exactly by AVX2 instructions, which is how machines without VNNI test that code.
 * Weight stream: a one-row product reads every weight once from DRAM, so each group's loop asks for its codes a
 * fixed number of bytes ahead (the products' last argument, `ahead`; 0: none), without which the hardware
 * prefetchers restart at every 4 KB page.  The distance is measured per machine (speculant.runtime.tune) and passed
 * by the caller: no state here.  Prefetches never change a result (and never fault, even past a buffer's end).
 * Build: cc -O3 -mavx2 -mfma -mf16c -fopenmp (no -ffast-math: it would let the compiler reorder the sums).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define QK 32
#define LANES 8          /* outputs per interleaved group */
#ifndef MB
#ifdef __AVX512F__
#define MB 8             /* rows per tile: a group's unpacked weights are reused from registers for up to MB rows (with
                          * AVX-512's 32 vector registers, 8 rows' sums and accumulators fit) */
#else
#define MB 5             /* (5: the most whose sums and accumulators fit AVX2's 16 registers; 4 + 1 tiles cost 15% more
                          * at M = 5) */
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

#ifdef SPEC_DPBUSD
/* acc + (in each int32 lane) the sum of the 4 products u[4j+i] * s[4j+i], u unsigned and s signed bytes: vpdpbusd
 * (1: AVX512-VNNI on 256-bit vectors (AVX512VL), 2: AVX-VNNI), or (3) the same sum from AVX2 instructions, exact
 * while each pair u0 s0 + u1 s1 fits int16 (|.| <= 2 * 128 * 127 < 2^15 for every operand this file passes). */
INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if SPEC_DPBUSD == 1
    return _mm256_dpbusd_epi32(acc, u, s);
#elif SPEC_DPBUSD == 2
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

/* Prefetch `lines` cache lines from p + ahead on (non-temporal: each weight is read once per product); nothing when
 * ahead is 0. */
INLINE void prefetch_ahead(const void *p, int64_t ahead, int lines) {
    if (ahead)
        for (int i = 0; i < lines; i++) _mm_prefetch((const char *)p + ahead + 64 * i, _MM_HINT_NTA);
}

/* An empty asm that "changes" v: keeps GCC from reassociating a row's integer sums into a tree over all of a block's
 * products (which then spills them); the sums are exact in any order, this is for speed only. */
#define PIN(v) __asm__("" : "+x"(v))


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

/* 4 activation bytes at p in every 32-bit lane */
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* 8 fp16 -> 8 float32 (exact) */
INLINE __m256 load_h8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* 8 scales from element i of p on: float32 (f32, the K-quant layouts) or fp16 (converted exactly) */
INLINE __m256 load_s8(const void *p, int64_t i, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)p + i) : load_h8((const uint16_t *)p + i);
}

/* Q6_K's 6-bit layout (spec_w6a8k; below): word c (0..7) of a block's 8-bit layout, codes q in -32..31, from the
 * block's 4 vectors of low nibbles nib (word c in nib[c % 4]'s low nibbles for c < 4, high ones after) and 2 of high
 * bit pairs hb (word c's at bits 2 (c % 4), + 1 of hb[c / 4]).  The 16-bit shifts move bits across a byte boundary
 * only into bits the 0x30 mask clears. */
INLINE __m256i q6_word(const __m256i *nib, const __m256i *hb, int c) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i lo = c < 4 ? _mm256_and_si256(nib[c], m4) : _mm256_and_si256(_mm256_srli_epi16(nib[c - 4], 4), m4);
    const int k = c % 4;
    const __m256i h = hb[c / 4];
    const __m256i hi = _mm256_and_si256(k == 3 ? _mm256_srli_epi16(h, 2) : k == 2 ? h
                                        : _mm256_slli_epi16(h, 4 - 2 * k), m2);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* The 8 outputs' float32 scales of the first (half 0) or last 16 inputs of block g in the 6-bit layout: int8 sub-block
 * scales sc (16 per block: the first half's 8, then the last half's) times float32 super-block scales dd (8 per 8
 * blocks); the product is exact (an fp16 value times an integer of at most 8 bits), so it is the 8-bit layout's
 * stored float32 scale bit for bit. */
INLINE __m256 q6_scales(const int8_t *sc, const float *dd, int64_t g, int half) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)(sc + g * 16 + 8 * half));
    return _mm256_mul_ps(_mm256_loadu_ps(dd + (g / 8) * LANES), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
}

/* Q5_0's 5-bit layout (spec_w5a8; below): word c (0..7) of a block's 8-bit layout, codes q in -16..15, from the
 * block's 4 vectors of low nibbles nib (word c in nib[c % 4]'s low nibbles for c < 4, high ones after) and 1 of high
 * bits hb (word c's at bit c).  The 16-bit shifts move bits across a byte boundary only into bits the 0x10 mask
 * clears. */
INLINE __m256i q5_word(const __m256i *nib, __m256i hb, int c) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(0x10);
    const __m256i lo = c < 4 ? _mm256_and_si256(nib[c], m4) : _mm256_and_si256(_mm256_srli_epi16(nib[c - 4], 4), m4);
    const __m256i hi = _mm256_and_si256(c < 4 ? _mm256_slli_epi16(hb, 4 - c) : c == 4 ? hb
                                        : _mm256_srli_epi16(hb, c - 4), m1);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(16));
}

/* The scale layouts of 4-bit codes (q4_group's, q4_pair's and amx_pair's sk; a constant after inlining):
 *   SK_F16: scales wd and mins wm per block of 32 in fp16 (Q4_0, Q4_1: the file's values);
 *   SK_F32: the same in float32 (Q4_K's super-block scales folded: d * sc_j and -(dmin * m_j));
 *   SK_Q4K: Q4_K as stored: wd int8, per group of 8 outputs and block the 8 outputs' 6-bit sub-block scales sc_j
 *           then their mins m_j (16 bytes); wm float32, per group and super-block of 256 the 8 outputs' d then their
 *           -dmin (16 floats).  d * sc_j and -dmin * m_j are exact in float32 (an fp16 value times an integer of 6
 *           bits), so the scales are SK_F32's bit for bit, from 0.59 bytes a weight instead of 0.75;
 *   SK_Q40: Q4_0 as stored: wd fp16 d per block, no wm; the mins -8 d are computed (exact in float32), SK_F16's bits
 *           on the mins -8 d stored in fp16, from 0.56 bytes a weight instead of 0.63. */
#define SK_F16 0
#define SK_F32 1
#define SK_Q4K 2
#define SK_Q40 3         /* Q4_0: fp16 scales d per 32 in wd, no wm: the mins are -8 d (exact in float32) */

/* SK_Q4K: the 8 outputs' float32 scales (dw) and mins (mw) of block g from the group's 16 int8 of the block (sm)
 * and the super-block's d and -dmin (sd, smn) */
INLINE void q4k_block(const void *sm, int64_t g, __m256 sd, __m256 smn, __m256 *dw, __m256 *mw) {
    const __m128i v = _mm_loadu_si128((const __m128i *)((const int8_t *)sm + g * 16));
    *dw = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    *mw = _mm256_mul_ps(smn, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))));
}

/* The 8 outputs' scales (dw) and mins (mw) of block g in scale layout sk (wd, wm: the group's buffers) */
INLINE void q4_scales(const void *wd, const void *wm, int64_t g, int sk, __m256 *dw, __m256 *mw) {
    if (sk == SK_Q4K) {
        const float *s = (const float *)wm + (g / 8) * 16;
        q4k_block(wd, g, _mm256_loadu_ps(s), _mm256_loadu_ps(s + 8), dw, mw);
    } else if (sk == SK_Q40) {
        *dw = load_h8((const uint16_t *)wd + g * LANES);
        *mw = _mm256_mul_ps(*dw, _mm256_set1_ps(-8.0f));
    } else {
        *dw = load_s8(wd, g * LANES, sk == SK_F32);
        *mw = load_s8(wm, g * LANES, sk == SK_F32);
    }
}

/* Q4_1, one group of 8 outputs (codes wc, scales wd and mins wm of the group in scale layout sk: G x 128 bytes of
 * codes) by R rows starting at row m0 (R <= MB, a constant after inlining);
 * writes y[m0 + r, n0 .. n0+7].
 * Int16 partial sums: each vpmaddubsw lane is 2 products of a code (0..15) and an activation (|xq| <= 127), so
 * |.| <= 3810, and 8 of them (a lane's whole block) stay <= 30480 < 2^15. */
INLINE void q4_group(const uint8_t *wc, const void *wd, const void *wm, const int8_t *xq, const float *xd,
                     const float *xs, int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0,
                     int64_t ahead, int sk) {
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    (void)ones;                       /* unused with VNNI */
    __m256 acc[MB], sd = _mm256_setzero_ps(), smn = sd;      /* SK_Q4K: the super-block's d and -dmin */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = wc + g * 128;
        prefetch_ahead(b, ahead, 2);
        __m256i s[MB];                /* the block's integer sums: int16 pairs (AVX2) or int32 lanes (VNNI) */
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
#ifdef SPEC_DPBUSD
        __m256i s2[MB];               /* VNNI: the high nibbles' sums apart (two chains of vpdpbusd's latency) */
        for (int r = 0; r < R; r++) s2[r] = _mm256_setzero_si256();
#endif
        for (int L = 0; L < 4; L++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 32 * L));
            const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + (m0 + r) * K + g * QK;
#ifdef SPEC_DPBUSD
                s[r] = dpbusd(s[r], lo, bcast4(x + 4 * L));
                s2[r] = dpbusd(s2[r], hi, bcast4(x + 16 + 4 * L));
                PIN(s2[r]);
#else
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + 4 * L)),
                                                   _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * L)));
                s[r] = _mm256_add_epi16(s[r], p);
#endif
                PIN(s[r]);
            }
        }
        __m256 dw, mw;
        if (sk == SK_Q4K) {
            if (g % 8 == 0) {
                sd = _mm256_loadu_ps((const float *)wm + (g / 8) * 16);
                smn = _mm256_loadu_ps((const float *)wm + (g / 8) * 16 + 8);
            }
            q4k_block(wd, g, sd, smn, &dw, &mw);
        } else {
            q4_scales(wd, wm, g, sk, &dw, &mw);
        }
        for (int r = 0; r < R; r++) {
            const int64_t mg = (m0 + r) * G + g;
#ifdef SPEC_DPBUSD
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s[r], s2[r]));
#else
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones));
#endif
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[mg])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[mg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* Q8_0, one group of 8 outputs (G x 256 bytes of codes, G x 8 scales) by R rows from m0.  Signed codes times signed
 * activations as llama.cpp does: vpmaddubsw(|w|, sign(x, w)), each int16 lane <= 2 * 128 * 127 < 2^15. */
INLINE void q8_group(const int8_t *wc, const uint16_t *wd, const int8_t *xq, const float *xd, int64_t m0, int R,
                     int64_t K, int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[MB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *b = wc + g * 256;
        prefetch_ahead(b, ahead, 4);
        __m256i s32[MB];
        for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();
#ifdef SPEC_DPBUSD
        __m256i s2[MB];               /* VNNI: odd c's sums apart (two chains of vpdpbusd's latency) */
        for (int r = 0; r < R; r++) s2[r] = _mm256_setzero_si256();
#endif
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 32 * c)), aw = _mm256_sign_epi8(w, w);
            for (int r = 0; r < R; r++) {
                const __m256i xb = bcast4(xq + (m0 + r) * K + g * QK + 4 * c);
#ifdef SPEC_DPBUSD
                if (c % 2) s2[r] = dpbusd(s2[r], aw, _mm256_sign_epi8(xb, w));
                else s32[r] = dpbusd(s32[r], aw, _mm256_sign_epi8(xb, w));
#else
                const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w));
                s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(p, ones));
#endif
                PIN(s32[r]);
            }
        }
        const __m256 dw = load_h8(wd + g * LANES);
        for (int r = 0; r < R; r++) {
#ifdef SPEC_DPBUSD
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s32[r], s2[r]));
#else
            const __m256 isum = _mm256_cvtepi32_ps(s32[r]);
#endif
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(m0 + r) * G + g])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* The exact integer dot product of a 32-code block (qu: unsigned codes, or w: signed) with 32 activations. */
INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
INLINE int32_t block_isum_u(const uint8_t *b, const int8_t *x) {     /* GGUF Q4 block: 16 bytes */
    const __m128i raw = _mm_loadu_si128((const __m128i *)b), mask = _mm_set1_epi8(0x0F);
    const __m256i qu = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    const __m256i p = _mm256_maddubs_epi16(qu, _mm256_loadu_si256((const __m256i *)x));
    return hsum_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
INLINE int32_t block_isum_s(const int8_t *b, const int8_t *x) {      /* Q8_0 block: 32 codes */
    const __m256i w = _mm256_loadu_si256((const __m256i *)b), xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
    return hsum_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* The last N % 8 outputs (stored row by row), every row: the same float sequence as a vector lane. */
static void tail_outputs(const uint8_t *c4, const int8_t *c8, const uint16_t *wd, const uint16_t *wm,
                         const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, int64_t N, float *y) {
    const int64_t G = K / QK;
    for (int64_t n = N / LANES * LANES; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *x = xq + m * K + g * QK;
                const int32_t isum = c4 ? block_isum_u(c4 + n * (K / 2) + g * (QK / 2), x) : block_isum_s(c8 + n * K + g * QK, x);
                const float s = _cvtsh_ss(wd[n * G + g]) * xd[m * G + g];
                acc = fmaf((float)isum, s, acc);
                if (c4)           /* Q4: the min, stored (Q4_1) or -8 d (Q4_0 without stored mins) */
                    acc = fmaf(wm ? _cvtsh_ss(wm[n * G + g]) : -8.0f * _cvtsh_ss(wd[n * G + g]), xs[m * G + g], acc);
            }
            y[m * N + n] = acc;
        }
}

#ifdef SPEC_ZMM
#include "qgemm_pairs.h"
#define PAIRS 1          /* groups t, t + 1 by one 512-bit product */
#else
#define PAIRS 0
#endif
#ifdef SPEC_AMX
#include "qgemm_amx.h"   /* groups t, t + 1 by AMX tiles from AMX_MIN_ROWS rows on */
#endif

/* The cases of a switch on a row tile's size 1 .. MB, each calling CALL with that size as a constant. */
#if MB == 8
#define ROW_CASES(CALL)                                                                              \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break;  \
    case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; case 1: CALL(1); break;
#elif MB == 5
#define ROW_CASES(CALL)                                                                              \
    case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break;  \
    case 1: CALL(1); break;
#else
#error "MB must be 5 or 8"
#endif

/* Rows m0 = 0 .. M-1 in ceil(M / MB) tiles of near-equal sizes (the first M % tiles one row larger: 6 rows are 3 + 3,
 * not 5 + 1, whose 1-row tile unpacks the weights for a single row).  Tiling changes which registers hold an
 * element, never its operations. */
#define ROW_TILES(CALL)                                                                               \
    do {                                                                                             \
        const int64_t tiles_ = (M + MB - 1) / MB, base_ = M / (tiles_ + !tiles_), extra_ = M - base_ * tiles_; \
        int64_t m0 = 0;                                                                              \
        for (int64_t i_ = 0; i_ < tiles_; i_++) {                                                    \
            const int64_t rows_ = base_ + (i_ < extra_);                                             \
            switch (rows_) { ROW_CASES(CALL) }                                                       \
            m0 += rows_;                                                                             \
        }                                                                                            \
    } while (0)

/* Products of fewer rows than this run on 256-bit groups only, from this many on on 512-bit pairs too (512-bit
 * variants; set by spec_set_pair_rows, measured per machine by build.py: a pair reads two groups' codes as two
 * streams, which DRAM serves more slowly than one where a product of few rows is bound by memory traffic, while
 * products of many rows are bound by arithmetic, where pairs pay).  Routes compute the same bits: a speed choice. */
static int64_t pair_min_rows = 1;

void spec_set_pair_rows(int64_t rows) { pair_min_rows = rows < 1 ? 1 : rows; }
int64_t spec_pair_rows(void) { return pair_min_rows; }

/* Units of work split between threads: P pairs of groups of 8 outputs (512-bit variants from pair_min_rows rows on;
 * none otherwise), then the groups left, one per unit, then the last N % 8 outputs as one unit.  With AMX (SPEC_AMX) the pairs are AMX_CALL
 * (qgemm_amx.h's AMX_ROW_TILES), each thread with its own tile configuration (shaped: its row count, 0: none). */
#ifdef SPEC_AMX
#define FOR_GROUPS(GROUP_CALL, PAIR_CALL, TAIL_CALL, AMX_CALL)                                        \
    do {                                                                                             \
        const int amx = M >= AMX_MIN_ROWS && amx_permitted();                                        \
        const int64_t T = N / LANES, P = amx || M >= pair_min_rows ? T / 2 : 0;                      \
        const int64_t U = T - P + (N % LANES != 0);                                                  \
        _Pragma("omp parallel")                                                                      \
        {                                                                                            \
            int shaped = 0;                                                                          \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t u = 0; u < U; u++) {                                                        \
                if (u >= T - P) { TAIL_CALL; continue; }                                             \
                const int64_t t = u < P ? 2 * u : u + P;                                             \
                if (u < P) AMX_CALL; else ROW_TILES(GROUP_CALL);                                     \
            }                                                                                        \
            if (shaped) amx_release();                                                               \
        }                                                                                            \
    } while (0)
#else
#define FOR_GROUPS(GROUP_CALL, PAIR_CALL, TAIL_CALL, AMX_CALL)                                        \
    do {                                                                                             \
        const int64_t T = N / LANES, P = PAIRS && M >= pair_min_rows ? T / 2 : 0;                    \
        const int64_t U = T - P + (N % LANES != 0);                                                  \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t u = 0; u < U; u++) {                                                            \
            if (u >= T - P) { TAIL_CALL; continue; }                                                 \
            const int64_t t = u < P ? 2 * u : u + P;                                                 \
            if (PAIRS && u < P) ROW_TILES(PAIR_CALL); else ROW_TILES(GROUP_CALL);                    \
        }                                                                                            \
    } while (0)
#endif

/* y [M, N] = dequant(codes [N, K/2] uint8, wd, wm [N, K/32] fp16; the layout above) applied to the quantized rows;
 * wm NULL: Q4_0 without stored mins (SK_Q40: the mins -8 wd, computed) */
void spec_w4a8(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
               const uint8_t *codes, const uint16_t *wd, const uint16_t *wm, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q4_CALL(R) q4_group(codes + t * LANES * (K / 2), wd + t * LANES * G, wm + t * LANES * G, xq, xd, xs, m0, R, K, G, \
                            y, N, t * LANES, ahead, SK)
#ifdef SPEC_ZMM
#define Q4_PAIR(R) q4_pair(codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), wd + t * LANES * G,      \
                           wd + (t + 1) * LANES * G, wm + t * LANES * G, wm + (t + 1) * LANES * G, xq, xd, xs, m0, R, \
                           K, G, y, N, t * LANES, ahead, SK)
#else
#define Q4_PAIR Q4_CALL  /* never reached: no pairs */
#endif
#define Q4_AMX AMX_ROW_TILES(4, codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), wd + t * LANES * G,   \
                              wd + (t + 1) * LANES * G, wm + t * LANES * G, wm + (t + 1) * LANES * G, xs, t * LANES, \
                              Q4_PAIR, SK)
    if (wm) {
        const int SK = SK_F16;
        FOR_GROUPS(Q4_CALL, Q4_PAIR, tail_outputs(codes, 0, wd, wm, xq, xd, xs, M, K, N, y), Q4_AMX);
    } else {             /* Q4_0 without stored mins */
        const int SK = SK_Q40;
        FOR_GROUPS(Q4_CALL, Q4_PAIR, tail_outputs(codes, 0, wd, wm, xq, xd, xs, M, K, N, y), Q4_AMX);
    }
#undef Q4_AMX
#undef Q4_CALL
#undef Q4_PAIR
}

/* y [M, N] = dequant(codes [N, K] int8, wd [N, K/32] fp16; the layout above) applied to the quantized rows */
void spec_w8a8(const int8_t *xq, const float *xd, int64_t M, int64_t K,
               const int8_t *codes, const uint16_t *wd, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q8_CALL(R) q8_group(codes + t * LANES * K, wd + t * LANES * G, xq, xd, m0, R, K, G, y, N, t * LANES, ahead)
#ifdef SPEC_ZMM
#define Q8_PAIR(R) q8_pair(codes + t * LANES * K, codes + (t + 1) * LANES * K, wd + t * LANES * G,                \
                           wd + (t + 1) * LANES * G, xq, xd, m0, R, K, G, y, N, t * LANES, ahead)
#else
#define Q8_PAIR Q8_CALL
#endif
#define Q8_AMX AMX_ROW_TILES(8, (const uint8_t *)codes + t * LANES * K, (const uint8_t *)codes + (t + 1) * LANES * K, \
                              wd + t * LANES * G, wd + (t + 1) * LANES * G, 0, 0, 0, t * LANES, Q8_PAIR, 0)
    FOR_GROUPS(Q8_CALL, Q8_PAIR, tail_outputs(0, codes, wd, 0, xq, xd, 0, M, K, N, y), Q8_AMX);
#undef Q8_AMX
#undef Q8_CALL
#undef Q8_PAIR
}

/* ---- K-quant layouts (GGUF Q4_K, Q5_0/Q5_1/Q5_K, Q6_K): the same blocks of 32 codes, float32 scales ----
 *
 * A K-quant super-block of 256 weights stores fp16 d (and dmin) and small integer scales per sub-block; its weight is
 * d * sc_j * q (- dmin * m_j) per sub-block j.  The products d * sc_j and dmin * m_j are exact in float32 (11 + 6 or
 * 11 + 8 significant bits), so the super-block folds exactly into per-sub-block float32 scales and offsets: the
 * kernels below read those (no requantization).  Layouts, per group of 8 outputs and block g of 32 inputs:
 *   4-bit codes (Q4_K): the Q4_1 layout above, with float32 scales wd and offsets wm (8 each) instead of fp16;
 *   8-bit codes (Q5_0, Q5_1, Q5_K: 0..31 or -16..15; Q6_K: -32..31; int8): the Q8_0 layout (256 bytes), then
 *       sub = 32: 8 float32 scales (output j's at j) [and 8 float32 offsets];
 *       sub = 16 (Q6_K): 16 float32 scales: the first 16 inputs' scale of outputs 0..7, then the last 16's.
 * The last N % 8 outputs row by row: codes [K] (or [K/2]), scales [K/sub], offsets [K/32].
 * Float sequence of an output (every variant, vector lane or tail; isum, isum_lo/hi: exact integer sums of the
 * block, of its first and last 16 inputs):
 *   sub = 32: acc = fma((float)isum, wd[g] * xd[g], acc);  [acc = fma(wm[g], xs[g], acc)]
 *   sub = 16: acc = fma((float)isum_lo, wd_lo[g] * xd[g], acc);  acc = fma((float)isum_hi, wd_hi[g] * xd[g], acc)
 * Q4_K runs as Q4_1 does (256-bit groups, 512-bit pairs, AMX tiles: the same float sequence per lane); the 8-bit K
 * layouts on 256-bit groups and, in the 512-bit variants, pairs (qgemm_pairs.h's q8k_pair), never on AMX tiles.
 * Every variant computes the same bits. */

/* Word c (4 signed codes of each of 8 outputs) of block g times rows m0 .. m0 + R - 1's activations, added to the
 * int32 lanes of s (c < 4: the block's first 16 inputs) or s2 (its last 16): vpmaddubsw(|w|, sign(x, w)) as
 * llama.cpp does, each int16 lane <= 2 * 128 * 127 < 2^15 (any int8 code but -128), or vpdpbusd. */
INLINE void word_sums(__m256i w, int c, const int8_t *xq, int64_t m0, int R, int64_t K, int64_t g, __m256i *s,
                      __m256i *s2) {
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; r++) {
        const __m256i p = _mm256_sign_epi8(bcast4(xq + (m0 + r) * K + g * QK + 4 * c), w);
#ifdef SPEC_DPBUSD
        if (c < 4) s[r] = dpbusd(s[r], aw, p);
        else s2[r] = dpbusd(s2[r], aw, p);
#else
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, p), _mm256_set1_epi16(1));
        if (c < 4) s[r] = _mm256_add_epi32(s[r], d);
        else s2[r] = _mm256_add_epi32(s2[r], d);
#endif
        PIN(s[r]);
        PIN(s2[r]);
    }
}

/* 8-bit codes with float32 scales per `sub` inputs (a constant after inlining) and optional float32 offsets wm
 * (NULL: none), one group of 8 outputs by R rows from m0.  Int16 partial sums (AVX2): |code| <= 32 here (any int8
 * code but -128 keeps each vpmaddubsw lane <= 2 * 127 * 128 < 2^15). */
INLINE void q8k_group(const int8_t *wc, const float *wd, const float *wm, const int8_t *xq, const float *xd,
                      const float *xs, int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0,
                      int64_t ahead, int sub) {
    __m256 acc[MB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *b = wc + g * 256;
        prefetch_ahead(b, ahead, 4);
        __m256i s[MB], s2[MB];        /* the first and the last 16 inputs' sums (int32 lanes) */
        for (int r = 0; r < R; r++) s[r] = s2[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) word_sums(_mm256_loadu_si256((const __m256i *)(b + 32 * c)), c, xq, m0, R, K, g, s, s2);
        const float *sc = wd + g * LANES * (QK / sub);
        const __m256 d0 = _mm256_loadu_ps(sc), d1 = sub == 16 ? _mm256_loadu_ps(sc + LANES) : d0;
        for (int r = 0; r < R; r++) {
            const int64_t mg = (m0 + r) * G + g;
            const __m256 x = _mm256_set1_ps(xd[mg]);
            if (sub == 16) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d0, x), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2[r]), _mm256_mul_ps(d1, x), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[r], s2[r])), _mm256_mul_ps(d0, x), acc[r]);
            }
            if (wm) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + g * LANES), _mm256_set1_ps(xs[mg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* Q6_K in 6 bits (the layout of spec_w6a8k), one group of 8 outputs by R rows from m0: q8k_group's operations with
 * sub = 16 on the words q6_word unpacks, so the same bits. */
INLINE void q6k_group(const uint8_t *wc, const int8_t *sc, const float *dd, const int8_t *xq, const float *xd,
                      int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead) {
    __m256 acc[MB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = wc + g * 192;
        prefetch_ahead(b, ahead, 3);
        __m256i nib[4], hb[2];
        for (int i = 0; i < 4; i++) nib[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i));
        for (int i = 0; i < 2; i++) hb[i] = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * i));
        __m256i s[MB], s2[MB];
        for (int r = 0; r < R; r++) s[r] = s2[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) word_sums(q6_word(nib, hb, c), c, xq, m0, R, K, g, s, s2);
        const __m256 d0 = q6_scales(sc, dd, g, 0), d1 = q6_scales(sc, dd, g, 1);
        for (int r = 0; r < R; r++) {
            const __m256 x = _mm256_set1_ps(xd[(m0 + r) * G + g]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d0, x), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2[r]), _mm256_mul_ps(d1, x), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* Q5_0 in 5 bits (the layout of spec_w5a8), one group of 8 outputs by R rows from m0: q8_group's float sequence on
 * the words q5_word unpacks (the block's integer sum split in its first and last 16 inputs is the same integer), so
 * the bits of the 8-bit layout on the same codes and fp16 scales. */
INLINE void q5_group(const uint8_t *wc, const uint16_t *wd, const int8_t *xq, const float *xd, int64_t m0, int R,
                     int64_t K, int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead) {
    __m256 acc[MB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = wc + g * 160;
        prefetch_ahead(b, ahead, 3);
        __m256i nib[4];
        for (int i = 0; i < 4; i++) nib[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128));
        __m256i s[MB], s2[MB];
        for (int r = 0; r < R; r++) s[r] = s2[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) word_sums(q5_word(nib, hb, c), c, xq, m0, R, K, g, s, s2);
        const __m256 dw = load_h8(wd + g * LANES);
        for (int r = 0; r < R; r++) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s[r], s2[r]));
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(m0 + r) * G + g])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* The exact integer dot product of n signed codes with n activations (the tails of the K layouts). */
static int32_t isum_s(const int8_t *w, const int8_t *x, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; i++) s += (int32_t)w[i] * (int32_t)x[i];
    return s;
}

/* The last N % 8 outputs of the K layouts (row by row), every row: a vector lane's float sequence.  bits 4: codes
 * [N, K/2], float32 scales and offsets [N, K/32]; bits 8: codes [N, K], scales [N, K/sub], offsets [N, K/32] or NULL. */
static void tail_outputs_k(int bits, const void *codes, const float *wd, const float *wm, int sub, const int8_t *xq,
                           const float *xd, const float *xs, int64_t M, int64_t K, int64_t N, float *y) {
    const int64_t G = K / QK, S = K / sub;
    for (int64_t n = N / LANES * LANES; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *x = xq + m * K + g * QK;
                const float xg = xd[m * G + g];
                if (bits == 4) {
                    const int32_t isum = block_isum_u((const uint8_t *)codes + n * (K / 2) + g * (QK / 2), x);
                    acc = fmaf((float)isum, wd[n * G + g] * xg, acc);
                } else {
                    const int8_t *w = (const int8_t *)codes + n * K + g * QK;
                    const int32_t lo = isum_s(w, x, 16), hi = isum_s(w + 16, x + 16, 16);
                    if (sub == 16) {
                        acc = fmaf((float)lo, wd[n * S + 2 * g] * xg, acc);
                        acc = fmaf((float)hi, wd[n * S + 2 * g + 1] * xg, acc);
                    } else {
                        acc = fmaf((float)(lo + hi), wd[n * S + g] * xg, acc);
                    }
                }
                if (wm) acc = fmaf(wm[n * G + g], xs[m * G + g], acc);
            }
            y[m * N + n] = acc;
        }
}

/* y [M, N] for 4-bit codes with float32 scales and offsets [N, K/32] (Q4_K; the layout above) */
void spec_w4a8k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *codes,
                const float *wd, const float *wm, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q4K_CALL(R) q4_group(codes + t * LANES * (K / 2), wd + t * LANES * G, wm + t * LANES * G, xq, xd, xs, m0, R, K, \
                             G, y, N, t * LANES, ahead, SK_F32)
#ifdef SPEC_ZMM
#define Q4K_PAIR(R) q4_pair(codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), wd + t * LANES * G,     \
                            wd + (t + 1) * LANES * G, wm + t * LANES * G, wm + (t + 1) * LANES * G, xq, xd, xs, m0, R, \
                            K, G, y, N, t * LANES, ahead, SK_F32)
#else
#define Q4K_PAIR Q4K_CALL
#endif
#define Q4K_AMX AMX_ROW_TILES(4, codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), wd + t * LANES * G,  \
                              wd + (t + 1) * LANES * G, wm + t * LANES * G, wm + (t + 1) * LANES * G, xs, t * LANES, \
                              Q4K_PAIR, SK_F32)
    FOR_GROUPS(Q4K_CALL, Q4K_PAIR, tail_outputs_k(4, codes, wd, wm, 32, xq, xd, xs, M, K, N, y), Q4K_AMX);
#undef Q4K_AMX
#undef Q4K_PAIR
#undef Q4K_CALL
}

/* The last N % 8 outputs of the Q4_K layout (row by row: codes [N, K/2], per block sc_j then m_j in sm, per
 * super-block d then -dmin in dm), every row: a vector lane's float sequence (tail_outputs_k's with bits 4). */
static void tail_outputs_q4k(const uint8_t *codes, const int8_t *sm, const float *dm, const int8_t *xq,
                             const float *xd, const float *xs, int64_t M, int64_t K, int64_t N, float *y) {
    const int64_t G = K / QK;
    for (int64_t n = N / LANES * LANES; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const int32_t isum = block_isum_u(codes + n * (K / 2) + g * (QK / 2), xq + m * K + g * QK);
                const float *s = dm + n * (G / 4) + 2 * (g / 8);
                const float d = s[0] * (float)sm[n * 2 * G + 2 * g], mn = s[1] * (float)sm[n * 2 * G + 2 * g + 1];
                acc = fmaf((float)isum, d * xd[m * G + g], acc);
                acc = fmaf(mn, xs[m * G + g], acc);
            }
            y[m * N + n] = acc;
        }
}

/* y [M, N] for Q4_K as stored (K a multiple of 256): codes [N, K/2] as spec_w4a8's, int8 sub-block scales and mins
 * sm [N, 2K/32] and float32 d, -dmin dm [N, 2K/256] (SK_Q4K's layout, rows interleaved by groups of 8 outputs; the
 * last N % 8 outputs row by row, per block sc_j, m_j and per super-block d, -dmin): spec_w4a8k's bits on the same
 * codes with the scales folded. */
void spec_w4a8q4k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *codes,
                  const int8_t *sm, const float *dm, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q4C_CALL(R) q4_group(codes + t * LANES * (K / 2), sm + t * LANES * 2 * G, dm + t * LANES * (G / 4), xq, xd, xs, \
                             m0, R, K, G, y, N, t * LANES, ahead, SK_Q4K)
#ifdef SPEC_ZMM
#define Q4C_PAIR(R) q4_pair(codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), sm + t * LANES * 2 * G,   \
                            sm + (t + 1) * LANES * 2 * G, dm + t * LANES * (G / 4), dm + (t + 1) * LANES * (G / 4), xq, \
                            xd, xs, m0, R, K, G, y, N, t * LANES, ahead, SK_Q4K)
#else
#define Q4C_PAIR Q4C_CALL
#endif
#define Q4C_AMX AMX_ROW_TILES(4, codes + t * LANES * (K / 2), codes + (t + 1) * LANES * (K / 2), sm + t * LANES * 2 * G, \
                              sm + (t + 1) * LANES * 2 * G, dm + t * LANES * (G / 4), dm + (t + 1) * LANES * (G / 4), xs,  \
                              t * LANES, Q4C_PAIR, SK_Q4K)
    FOR_GROUPS(Q4C_CALL, Q4C_PAIR, tail_outputs_q4k(codes, sm, dm, xq, xd, xs, M, K, N, y), Q4C_AMX);
#undef Q4C_AMX
#undef Q4C_PAIR
#undef Q4C_CALL
}

/* y [M, N] for 8-bit codes with float32 scales [N, K/sub] (sub 32 or 16) and float32 offsets [N, K/32] or NULL
 * (Q5_0, Q5_1, Q5_K, Q6_K; the layout above).  Returns 0, or -1 for a sub other than 16 or 32 (y untouched). */
int spec_w8a8k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const int8_t *codes,
               const float *wd, const float *wm, int64_t sub, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
    if (sub != 16 && sub != 32) return -1;
#define Q8K_CALL(R) q8k_group(codes + t * LANES * K, wd + t * LANES * (K / sub), wm ? wm + t * LANES * G : 0, xq, xd, \
                              xs, m0, R, K, G, y, N, t * LANES, ahead, S)
#ifdef SPEC_ZMM
#define Q8K_PAIR(R) q8k_pair(codes + t * LANES * K, codes + (t + 1) * LANES * K, wd + t * LANES * (K / sub),          \
                             wd + (t + 1) * LANES * (K / sub), wm ? wm + t * LANES * G : 0,                        \
                             wm ? wm + (t + 1) * LANES * G : 0, xq, xd, xs, m0, R, K, G, y, N, t * LANES, ahead, S)
#else
#define Q8K_PAIR Q8K_CALL
#endif
#define Q8K_AMX do { (void)amx; ROW_TILES(Q8K_PAIR); } while (0)   /* no AMX tiles for these layouts: 512-bit pairs */
    if (sub == 16) {
        const int S = 16;
        FOR_GROUPS(Q8K_CALL, Q8K_PAIR, tail_outputs_k(8, codes, wd, wm, S, xq, xd, xs, M, K, N, y), Q8K_AMX);
    } else {
        const int S = 32;
        FOR_GROUPS(Q8K_CALL, Q8K_PAIR, tail_outputs_k(8, codes, wd, wm, S, xq, xd, xs, M, K, N, y), Q8K_AMX);
    }
#undef Q8K_AMX
#undef Q8K_PAIR
#undef Q8K_CALL
    return 0;
}

/* y [M, N] for Q6_K in 6 bits: codes [N, K * 3/4] uint8, sub-block scales sc [N, K/16] int8, super-block scales dd
 * [N, K/256] float32 (K a multiple of 256), per group of 8 outputs and block of 32 inputs 192 bytes of codes: the
 * 8-bit layout's 256 bytes as q + 32 (0..63), 128 bytes of low nibbles (word c < 4 low, word c + 4 high) and 64 of
 * high bit pairs (bits 2k, 2k + 1 of byte 32h + j: word 4h + k's byte j); sc and dd interleaved as the 8-bit layout's
 * float32 scales are.  The last N % 8 outputs row by row: per block 16 bytes of nibbles (code j low, j + 16 high),
 * 8 of high pairs (bits 2k, 2k + 1 of byte j: code j + 8k's), sc [K/16], dd [K/256].  The float sequence of the 8-bit
 * layout with sub = 16 on the same codes and scales: its bits, from 0.82 bytes a weight instead of 1.25. */
static void tail_outputs_q6(const uint8_t *codes, const int8_t *sc, const float *dd, const int8_t *xq, const float *xd,
                            int64_t M, int64_t K, int64_t N, float *y) {
    const int64_t G = K / QK;
    for (int64_t n = N / LANES * LANES; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *b = codes + n * G * 24 + g * 24;
                const int8_t *x = xq + m * K + g * QK;
                int32_t half[2] = {0, 0};
                for (int i = 0; i < QK; i++) {
                    const int q = (((b[i % 16] >> (4 * (i / 16))) & 0x0F) | (((b[16 + i % 8] >> (2 * (i / 8))) & 3) << 4)) - 32;
                    half[i / 16] += q * (int32_t)x[i];
                }
                const float xg = xd[m * G + g], d = dd[n * (K / 256) + g / 8];
                acc = fmaf((float)half[0], (d * (float)sc[n * (K / 16) + 2 * g]) * xg, acc);
                acc = fmaf((float)half[1], (d * (float)sc[n * (K / 16) + 2 * g + 1]) * xg, acc);
            }
            y[m * N + n] = acc;
        }
}

void spec_w6a8k(const int8_t *xq, const float *xd, int64_t M, int64_t K, const uint8_t *codes, const int8_t *sc,
                const float *dd, int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q6_CALL(R) q6k_group(codes + t * LANES * G * 24, sc + t * LANES * (K / 16), dd + t * LANES * (K / 256), xq, xd, \
                             m0, R, K, G, y, N, t * LANES, ahead)
#ifdef SPEC_ZMM
#define Q6_PAIR(R) q6k_pair(codes + t * LANES * G * 24, codes + (t + 1) * LANES * G * 24, sc + t * LANES * (K / 16),   \
                            sc + (t + 1) * LANES * (K / 16), dd + t * LANES * (K / 256), dd + (t + 1) * LANES * (K / 256), \
                            xq, xd, m0, R, K, G, y, N, t * LANES, ahead)
#else
#define Q6_PAIR Q6_CALL
#endif
#define Q6_AMX do { (void)amx; ROW_TILES(Q6_PAIR); } while (0)     /* no AMX tiles for this layout: 512-bit pairs */
    FOR_GROUPS(Q6_CALL, Q6_PAIR, tail_outputs_q6(codes, sc, dd, xq, xd, M, K, N, y), Q6_AMX);
#undef Q6_AMX
#undef Q6_PAIR
#undef Q6_CALL
}

/* y [M, N] for Q5_0 in 5 bits: codes [N, K * 5/8] uint8, fp16 scales wd [N, K/32] (interleaved as the 8-bit
 * layout's), per group of 8 outputs and block of 32 inputs 160 bytes of codes: the 8-bit layout's 256 bytes as
 * q + 16 (0..31), 128 bytes of low nibbles (word c < 4 low, word c + 4 high) and 32 of high bits (bit c of byte j:
 * word c's byte j's).  The last N % 8 outputs row by row: per block 16 bytes of nibbles (code j low, j + 16 high) and
 * 4 of high bits (bit i % 8 of byte i / 8: code i's, as GGUF's Q5_0 stores them).  spec_w8a8's float sequence on the
 * same codes and scales: its bits, from 0.69 bytes a weight instead of 1.06. */
static void tail_outputs_q5(const uint8_t *codes, const uint16_t *wd, const int8_t *xq, const float *xd, int64_t M,
                            int64_t K, int64_t N, float *y) {
    const int64_t G = K / QK;
    for (int64_t n = N / LANES * LANES; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *b = codes + n * G * 20 + g * 20;
                const int8_t *x = xq + m * K + g * QK;
                int32_t isum = 0;
                for (int i = 0; i < QK; i++) {
                    const int q = (((b[i % 16] >> (4 * (i / 16))) & 0x0F) | (((b[16 + i / 8] >> (i % 8)) & 1) << 4)) - 16;
                    isum += q * (int32_t)x[i];
                }
                acc = fmaf((float)isum, _cvtsh_ss(wd[n * G + g]) * xd[m * G + g], acc);
            }
            y[m * N + n] = acc;
        }
}

void spec_w5a8(const int8_t *xq, const float *xd, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *wd,
               int64_t N, float *y, int64_t ahead) {
    const int64_t G = K / QK;
#define Q5_CALL(R) q5_group(codes + t * LANES * G * 20, wd + t * LANES * G, xq, xd, m0, R, K, G, y, N, t * LANES, ahead)
#ifdef SPEC_ZMM
#define Q5_PAIR(R) q5_pair(codes + t * LANES * G * 20, codes + (t + 1) * LANES * G * 20, wd + t * LANES * G,          \
                           wd + (t + 1) * LANES * G, xq, xd, m0, R, K, G, y, N, t * LANES, ahead)
#else
#define Q5_PAIR Q5_CALL
#endif
#define Q5_AMX do { (void)amx; ROW_TILES(Q5_PAIR); } while (0)     /* no AMX tiles for this layout: 512-bit pairs */
    FOR_GROUPS(Q5_CALL, Q5_PAIR, tail_outputs_q5(codes, wd, xq, xd, M, K, N, y), Q5_AMX);
#undef Q5_AMX
#undef Q5_PAIR
#undef Q5_CALL
}

/* The same products on float32 rows x [M, K]: quantize (workspace of our own), then multiply. Returns 0, or -1 when
 * the workspace cannot be allocated (y is then untouched). */
static int quantized_workspace(const float *x, int64_t M, int64_t K, int8_t **xq, float **xd, float **xs) {
    const int64_t G = K / QK;
    *xq = (int8_t *)malloc((size_t)(M * K));
    *xd = (float *)malloc(sizeof(float) * (size_t)(2 * M * G));
    if (!*xq || !*xd) { free(*xq); free(*xd); return -1; }
    *xs = *xd + M * G;
    spec_quantize_rows(x, M, K, *xq, *xd, *xs);
    return 0;
}

/* The body of a product on float32 rows x [M, K]: quantize them into a workspace of our own, then CALL (xq, xd, xs
 * in scope); returns 0, or -1 when the workspace cannot be allocated (y untouched). */
#define ON_FLOAT_ROWS(CALL)                                                                           \
    do {                                                                                             \
        int8_t *xq; float *xd, *xs;                                                                  \
        if (quantized_workspace(x, M, K, &xq, &xd, &xs)) return -1;                                  \
        CALL;                                                                                        \
        free(xq); free(xd);                                                                          \
        return 0;                                                                                    \
    } while (0)

int spec_w4a8_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *wd, const uint16_t *wm,
                  int64_t N, float *y, int64_t ahead) {
    ON_FLOAT_ROWS(spec_w4a8(xq, xd, xs, M, K, codes, wd, wm, N, y, ahead));
}

int spec_w8a8_f32(const float *x, int64_t M, int64_t K, const int8_t *codes, const uint16_t *wd, int64_t N, float *y,
                  int64_t ahead) {
    ON_FLOAT_ROWS(spec_w8a8(xq, xd, M, K, codes, wd, N, y, ahead));
}

int spec_w4a8k_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *wd, const float *wm,
                   int64_t N, float *y, int64_t ahead) {
    ON_FLOAT_ROWS(spec_w4a8k(xq, xd, xs, M, K, codes, wd, wm, N, y, ahead));
}

int spec_w4a8q4k_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const int8_t *sm, const float *dm,
                     int64_t N, float *y, int64_t ahead) {
    ON_FLOAT_ROWS(spec_w4a8q4k(xq, xd, xs, M, K, codes, sm, dm, N, y, ahead));
}

int spec_w6a8k_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const int8_t *sc, const float *dd,
                   int64_t N, float *y, int64_t ahead) {
    ON_FLOAT_ROWS(spec_w6a8k(xq, xd, M, K, codes, sc, dd, N, y, ahead));
}

int spec_w5a8_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *wd, int64_t N, float *y,
                  int64_t ahead) {
    ON_FLOAT_ROWS(spec_w5a8(xq, xd, M, K, codes, wd, N, y, ahead));
}

/* Returns 0, -1 when the workspace cannot be allocated, -2 for a sub other than 16 or 32 (y untouched). */
int spec_w8a8k_f32(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *wd, const float *wm,
                   int64_t sub, int64_t N, float *y, int64_t ahead) {
    if (sub != 16 && sub != 32) return -2;
    ON_FLOAT_ROWS(spec_w8a8k(xq, xd, xs, M, K, codes, wd, wm, sub, N, y, ahead));
}
