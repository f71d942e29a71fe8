/* qgemm.c's group products on 512-bit vectors (AVX-512 with VNNI): two groups of 8 outputs at a time.
 *
 * Included by qgemm.c when SPEC_ZMM is defined (build.py's variant "avx512-vnni"; "zmm-emulated" runs this code on
 * AVX2, each 512-bit value a pair of 256-bit halves and vpdpbusd emulated exactly, which is how machines without
 * AVX-512 test it).  Consecutive groups t and t + 1 are outputs n0 .. n0 + 15, so a vector's low half takes group
 * t's bytes exactly as qgemm.c's 256-bit code does and its high half group t + 1's: no new weight layout.  Every
 * output lane runs the float sequence of qgemm.c's header (acc = fma(isum, wd * xd, acc) [+ fma(wm, xs)] per
 * block), so all variants compute the same bits.
 */
#ifndef SPECULANT_QGEMM_PAIRS_H
#define SPECULANT_QGEMM_PAIRS_H

#if SPEC_ZMM == 1
typedef __m512i v16i;
typedef __m512 v16f;
INLINE v16i v16_load2(const void *a, const void *b) {      /* 32 bytes at a (low half), 32 at b (high half) */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
INLINE v16i v16_and(v16i a, v16i b) { return _mm512_and_si512(a, b); }
INLINE v16i v16_high_nibbles(v16i a, v16i mask) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), mask); }
INLINE v16i v16_set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
INLINE v16i v16_set1_i8(char v) { return _mm512_set1_epi8(v); }
INLINE v16i v16_zero(void) { return _mm512_setzero_si512(); }
INLINE v16i v16_dpbusd(v16i acc, v16i u, v16i s) { return _mm512_dpbusd_epi32(acc, u, s); }
INLINE v16i v16_add32(v16i a, v16i b) { return _mm512_add_epi32(a, b); }
INLINE v16i v16_abs8(v16i w) { return _mm512_abs_epi8(w); }
/* x negated where w < 0 (where w = 0 the product with |w| is 0 either way): what vpsignb does, which has no
 * 512-bit form */
INLINE v16i v16_sign8(v16i x, v16i w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
INLINE v16f v16_cvt(v16i a) { return _mm512_cvtepi32_ps(a); }
INLINE v16f v16_cvt_i8(__m128i a) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)); }  /* 16 int8 -> float */
INLINE v16i v16_join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
INLINE v16i v16_or(v16i a, v16i b) { return _mm512_or_si512(a, b); }
INLINE v16i v16_sub8(v16i a, v16i b) { return _mm512_sub_epi8(a, b); }
INLINE v16i v16_srli16(v16i a, int n) { return _mm512_srli_epi16(a, n); }
INLINE v16i v16_slli16(v16i a, int n) { return _mm512_slli_epi16(a, n); }
INLINE v16f v16_join_f(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}
INLINE v16f v16_load_h16(const uint16_t *a, const uint16_t *b) {   /* 8 fp16 at a, 8 at b -> 16 float32 (exact) */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
INLINE v16f v16_load_f2(const float *a, const float *b) {        /* 8 float32 at a, 8 at b */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
INLINE v16f v16_set1_f(float v) { return _mm512_set1_ps(v); }
INLINE v16f v16_zero_f(void) { return _mm512_setzero_ps(); }
INLINE v16f v16_mul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
INLINE v16f v16_fma(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
INLINE void v16_store(float *p, v16f v) { _mm512_storeu_ps(p, v); }
INLINE void v16_store_i(void *p, v16i v) { _mm512_storeu_si512(p, v); }
INLINE v16i v16_load_i(const void *p) { return _mm512_loadu_si512(p); }
INLINE v16f v16_load_f(const float *p) { return _mm512_loadu_ps(p); }
#define V16_PIN(v) __asm__("" : "+v"(v))
#else
typedef struct { __m256i lo, hi; } v16i;
typedef struct { __m256 lo, hi; } v16f;
INLINE v16i v16_load2(const void *a, const void *b) {
    return (v16i){_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b)};
}
INLINE v16i v16_and(v16i a, v16i b) { return (v16i){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
INLINE v16i v16_high_nibbles(v16i a, v16i mask) {
    return (v16i){_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), mask.lo), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), mask.hi)};
}
INLINE v16i v16_set1_i32(int32_t v) { return (v16i){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
INLINE v16i v16_set1_i8(char v) { return (v16i){_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
INLINE v16i v16_zero(void) { return (v16i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
INLINE v16i v16_dpbusd(v16i acc, v16i u, v16i s) { return (v16i){dpbusd(acc.lo, u.lo, s.lo), dpbusd(acc.hi, u.hi, s.hi)}; }
INLINE v16i v16_add32(v16i a, v16i b) { return (v16i){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
INLINE v16i v16_abs8(v16i w) { return (v16i){_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi)}; }
/* the native form's operation (negate where w < 0, keep x elsewhere), not vpsignb's (which also zeroes) */
INLINE v16i v16_sign8(v16i x, v16i w) {
    const __m256i z = _mm256_setzero_si256();
    return (v16i){_mm256_blendv_epi8(x.lo, _mm256_sub_epi8(z, x.lo), w.lo),
                  _mm256_blendv_epi8(x.hi, _mm256_sub_epi8(z, x.hi), w.hi)};
}
INLINE v16f v16_cvt(v16i a) { return (v16f){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
INLINE v16f v16_cvt_i8(__m128i a) {
    return (v16f){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)))};
}
INLINE v16i v16_join(__m256i a, __m256i b) { return (v16i){a, b}; }
INLINE v16i v16_or(v16i a, v16i b) { return (v16i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
INLINE v16i v16_sub8(v16i a, v16i b) { return (v16i){_mm256_sub_epi8(a.lo, b.lo), _mm256_sub_epi8(a.hi, b.hi)}; }
INLINE v16i v16_srli16(v16i a, int n) { return (v16i){_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
INLINE v16i v16_slli16(v16i a, int n) { return (v16i){_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
INLINE v16f v16_join_f(__m256 a, __m256 b) { return (v16f){a, b}; }
INLINE v16f v16_load_h16(const uint16_t *a, const uint16_t *b) { return (v16f){load_h8(a), load_h8(b)}; }
INLINE v16f v16_load_f2(const float *a, const float *b) { return (v16f){_mm256_loadu_ps(a), _mm256_loadu_ps(b)}; }
INLINE v16f v16_set1_f(float v) { return (v16f){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
INLINE v16f v16_zero_f(void) { return (v16f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INLINE v16f v16_mul(v16f a, v16f b) { return (v16f){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
INLINE v16f v16_fma(v16f a, v16f b, v16f c) {
    return (v16f){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
INLINE void v16_store(float *p, v16f v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
INLINE void v16_store_i(void *p, v16i v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
}
INLINE v16i v16_load_i(const void *p) {
    return (v16i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
INLINE v16f v16_load_f(const float *p) { return (v16f){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
#define V16_PIN(v) do { PIN((v).lo); PIN((v).hi); } while (0)
#endif

/* 8 scales from element i of a and 8 from element i of b: float32 (f32: the K layouts) or fp16 (exact) */
INLINE v16f v16_load_s16(const void *a, const void *b, int64_t i, int f32) {
    return f32 ? v16_load_f2((const float *)a + i, (const float *)b + i)
               : v16_load_h16((const uint16_t *)a + i, (const uint16_t *)b + i);
}

/* SK_Q4K: the 16 outputs' scales (dw) and mins (mw) of block g of groups a and b from their 16 int8 of the block
 * (sa, sb) and the super-block's d and -dmin of both groups (sd, smn) */
INLINE void v16_q4k_block(const void *sa, const void *sb, int64_t g, v16f sd, v16f smn, v16f *dw, v16f *mw) {
    const __m128i a = _mm_loadu_si128((const __m128i *)((const int8_t *)sa + g * 16));
    const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)sb + g * 16));
    *dw = v16_mul(sd, v16_cvt_i8(_mm_unpacklo_epi64(a, b)));
    *mw = v16_mul(smn, v16_cvt_i8(_mm_unpackhi_epi64(a, b)));
}

/* SK_Q4K: the super-block's d (which 0) or -dmin (which 1) of block g of groups a and b (ma, mb: their supers) */
INLINE v16f v16_q4k_super(const void *ma, const void *mb, int64_t g, int which) {
    return v16_load_f2((const float *)ma + (g / 8) * 16 + 8 * which, (const float *)mb + (g / 8) * 16 + 8 * which);
}

/* The 16 outputs' scales (dw) and mins (mw) of block g of groups a and b in scale layout sk (qgemm.c's SK_*) */
INLINE void v16_q4_scales(const void *da, const void *db, const void *ma, const void *mb, int64_t g, int sk,
                          v16f *dw, v16f *mw) {
    if (sk == SK_Q4K) {
        v16_q4k_block(da, db, g, v16_q4k_super(ma, mb, g, 0), v16_q4k_super(ma, mb, g, 1), dw, mw);
    } else if (sk == SK_Q40) {
        *dw = v16_load_h16((const uint16_t *)da + g * LANES, (const uint16_t *)db + g * LANES);
        *mw = v16_mul(*dw, v16_set1_f(-8.0f));
    } else {
        *dw = v16_load_s16(da, db, g * LANES, sk == SK_F32);
        *mw = v16_load_s16(ma, mb, g * LANES, sk == SK_F32);
    }
}

/* 4 activation bytes at p in every 32-bit lane */
INLINE v16i v16_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v16_set1_i32(v);
}

/* Q4_1, groups t and t + 1 (codes wa, wb; scales da, db and mins ma, mb in scale layout sk, qgemm.c's SK_*) by R rows from m0: q4_group's operations, with int32 sums by vpdpbusd; writes y[m0 + r, n0 .. n0 + 15]. */
INLINE void q4_pair(const uint8_t *wa, const uint8_t *wb, const void *da, const void *db, const void *ma,
                    const void *mb, const int8_t *xq, const float *xd, const float *xs, int64_t m0, int R,
                    int64_t K, int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead, int sk) {
    const v16i mask = v16_set1_i8(0x0F);
    v16f acc[MB], sd = v16_zero_f(), smn = sd;             /* SK_Q4K: the super-block's d and -dmin */
    for (int r = 0; r < R; r++) acc[r] = v16_zero_f();
    for (int64_t g = 0; g < G; g++) {
        prefetch_ahead(wa + g * 128, ahead, 2);
        prefetch_ahead(wb + g * 128, ahead, 2);
        v16i s[MB], s2[MB];           /* low and high nibbles' sums: two chains of vpdpbusd's latency */
        for (int r = 0; r < R; r++) s[r] = s2[r] = v16_zero();
        for (int L = 0; L < 4; L++) {
            const v16i raw = v16_load2(wa + g * 128 + 32 * L, wb + g * 128 + 32 * L);
            const v16i lo = v16_and(raw, mask), hi = v16_high_nibbles(raw, mask);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + (m0 + r) * K + g * QK;
                s[r] = v16_dpbusd(s[r], lo, v16_bcast4(x + 4 * L));
                s2[r] = v16_dpbusd(s2[r], hi, v16_bcast4(x + 16 + 4 * L));
                V16_PIN(s[r]);
                V16_PIN(s2[r]);
            }
        }
        v16f dw, mw;
        if (sk == SK_Q4K) {
            if (g % 8 == 0) {
                sd = v16_q4k_super(ma, mb, g, 0);
                smn = v16_q4k_super(ma, mb, g, 1);
            }
            v16_q4k_block(da, db, g, sd, smn, &dw, &mw);
        } else {
            v16_q4_scales(da, db, ma, mb, g, sk, &dw, &mw);
        }
        for (int r = 0; r < R; r++) {
            const int64_t mg = (m0 + r) * G + g;
            acc[r] = v16_fma(v16_cvt(v16_add32(s[r], s2[r])), v16_mul(dw, v16_set1_f(xd[mg])), acc[r]);
            acc[r] = v16_fma(mw, v16_set1_f(xs[mg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) v16_store(y + (m0 + r) * N + n0, acc[r]);
}

/* Q8_0, groups t and t + 1 by R rows from m0: q8_group's operations (|w| times x signed by w). */
INLINE void q8_pair(const int8_t *wa, const int8_t *wb, const uint16_t *da, const uint16_t *db, const int8_t *xq,
                    const float *xd, int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0,
                    int64_t ahead) {
    v16f acc[MB];
    for (int r = 0; r < R; r++) acc[r] = v16_zero_f();
    for (int64_t g = 0; g < G; g++) {
        prefetch_ahead(wa + g * 256, ahead, 4);
        prefetch_ahead(wb + g * 256, ahead, 4);
        v16i s[MB], s2[MB];           /* even and odd c's sums: two chains of vpdpbusd's latency */
        for (int r = 0; r < R; r++) s[r] = s2[r] = v16_zero();
        for (int c = 0; c < 8; c++) {
            const v16i w = v16_load2(wa + g * 256 + 32 * c, wb + g * 256 + 32 * c), aw = v16_abs8(w);
            for (int r = 0; r < R; r++) {
                const v16i p = v16_sign8(v16_bcast4(xq + (m0 + r) * K + g * QK + 4 * c), w);
                if (c % 2) s2[r] = v16_dpbusd(s2[r], aw, p);
                else s[r] = v16_dpbusd(s[r], aw, p);
                V16_PIN(s[r]);
                V16_PIN(s2[r]);
            }
        }
        const v16f dw = v16_load_h16(da + g * LANES, db + g * LANES);
        for (int r = 0; r < R; r++)
            acc[r] = v16_fma(v16_cvt(v16_add32(s[r], s2[r])), v16_mul(dw, v16_set1_f(xd[(m0 + r) * G + g])), acc[r]);
    }
    for (int r = 0; r < R; r++) v16_store(y + (m0 + r) * N + n0, acc[r]);
}

/* The 8-bit K layouts (qgemm.c: float32 scales per `sub` inputs, optional float32 offsets), groups t and t + 1
 * (codes wa, wb; scales da, db; offsets ma, mb or NULL) by R rows from m0: q8k_group's operations; writes
 * y[m0 + r, n0 .. n0 + 15]. */
INLINE void q8k_pair(const int8_t *wa, const int8_t *wb, const float *da, const float *db, const float *ma,
                     const float *mb, const int8_t *xq, const float *xd, const float *xs, int64_t m0, int R, int64_t K,
                     int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead, int sub) {
    v16f acc[MB];
    for (int r = 0; r < R; r++) acc[r] = v16_zero_f();
    for (int64_t g = 0; g < G; g++) {
        prefetch_ahead(wa + g * 256, ahead, 4);
        prefetch_ahead(wb + g * 256, ahead, 4);
        v16i s[MB], s2[MB];           /* the first and the last 16 inputs' sums */
        for (int r = 0; r < R; r++) s[r] = s2[r] = v16_zero();
        for (int c = 0; c < 8; c++) {
            const v16i w = v16_load2(wa + g * 256 + 32 * c, wb + g * 256 + 32 * c), aw = v16_abs8(w);
            for (int r = 0; r < R; r++) {
                const v16i p = v16_sign8(v16_bcast4(xq + (m0 + r) * K + g * QK + 4 * c), w);
                if (c < 4) s[r] = v16_dpbusd(s[r], aw, p);
                else s2[r] = v16_dpbusd(s2[r], aw, p);
                V16_PIN(s[r]);
                V16_PIN(s2[r]);
            }
        }
        const float *sa = da + g * LANES * (QK / sub), *sb = db + g * LANES * (QK / sub);
        const v16f d0 = v16_load_f2(sa, sb), d1 = sub == 16 ? v16_load_f2(sa + LANES, sb + LANES) : d0;
        for (int r = 0; r < R; r++) {
            const int64_t mg = (m0 + r) * G + g;
            const v16f x = v16_set1_f(xd[mg]);
            if (sub == 16) {
                acc[r] = v16_fma(v16_cvt(s[r]), v16_mul(d0, x), acc[r]);
                acc[r] = v16_fma(v16_cvt(s2[r]), v16_mul(d1, x), acc[r]);
            } else {
                acc[r] = v16_fma(v16_cvt(v16_add32(s[r], s2[r])), v16_mul(d0, x), acc[r]);
            }
            if (ma) acc[r] = v16_fma(v16_load_f2(ma + g * LANES, mb + g * LANES), v16_set1_f(xs[mg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) v16_store(y + (m0 + r) * N + n0, acc[r]);
}

/* Q6_K in 6 bits (qgemm.c's spec_w6a8k layout), groups t and t + 1 (codes wa, wb; int8 sub-block scales sa, sb;
 * float32 super-block scales da, db) by R rows from m0: the words unpacked as q6k_group does (q6_word's operations
 * on both groups' bytes in one 512-bit vector), then q8k_pair's operations with sub = 16; writes y[m0 + r, n0 .. n0 + 15]. */
INLINE void q6k_pair(const uint8_t *wa, const uint8_t *wb, const int8_t *sa, const int8_t *sb, const float *da,
                     const float *db, const int8_t *xq, const float *xd, int64_t m0, int R, int64_t K, int64_t G,
                     float *y, int64_t N, int64_t n0, int64_t ahead) {
    v16f acc[MB];
    for (int r = 0; r < R; r++) acc[r] = v16_zero_f();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *a = wa + g * 192, *b = wb + g * 192;
        prefetch_ahead(a, ahead, 3);
        prefetch_ahead(b, ahead, 3);
        v16i nib[4], hbits[2];        /* each: group t's 32 bytes (low half), group t + 1's (high half) */
        for (int i = 0; i < 4; i++) nib[i] = v16_load2(a + 32 * i, b + 32 * i);
        for (int i = 0; i < 2; i++) hbits[i] = v16_load2(a + 128 + 32 * i, b + 128 + 32 * i);
        const v16i m4 = v16_set1_i8(0x0F), m2 = v16_set1_i8(0x30), bias = v16_set1_i8(32);
        v16i s[MB], s2[MB];           /* the first and the last 16 inputs' sums */
        for (int r = 0; r < R; r++) s[r] = s2[r] = v16_zero();
        for (int c = 0; c < 8; c++) {
            /* q6_word's operations on both halves at once */
            const v16i lo = c < 4 ? v16_and(nib[c], m4) : v16_and(v16_srli16(nib[c - 4], 4), m4);
            const int k = c % 4;
            const v16i h = hbits[c / 4];
            const v16i hi = v16_and(k == 3 ? v16_srli16(h, 2) : k == 2 ? h : v16_slli16(h, 4 - 2 * k), m2);
            const v16i w = v16_sub8(v16_or(lo, hi), bias), aw = v16_abs8(w);
            for (int r = 0; r < R; r++) {
                const v16i p = v16_sign8(v16_bcast4(xq + (m0 + r) * K + g * QK + 4 * c), w);
                if (c < 4) s[r] = v16_dpbusd(s[r], aw, p);
                else s2[r] = v16_dpbusd(s2[r], aw, p);
                V16_PIN(s[r]);
                V16_PIN(s2[r]);
            }
        }
        const v16f d0 = v16_join_f(q6_scales(sa, da, g, 0), q6_scales(sb, db, g, 0));
        const v16f d1 = v16_join_f(q6_scales(sa, da, g, 1), q6_scales(sb, db, g, 1));
        for (int r = 0; r < R; r++) {
            const v16f x = v16_set1_f(xd[(m0 + r) * G + g]);
            acc[r] = v16_fma(v16_cvt(s[r]), v16_mul(d0, x), acc[r]);
            acc[r] = v16_fma(v16_cvt(s2[r]), v16_mul(d1, x), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) v16_store(y + (m0 + r) * N + n0, acc[r]);
}

/* Q5_0 in 5 bits (qgemm.c's spec_w5a8 layout), groups t and t + 1 (codes wa, wb; fp16 scales da, db) by R rows from
 * m0: the words unpacked as q5_group does (q5_word's operations on both groups' bytes in one 512-bit vector), then
 * q8_pair's float sequence; writes y[m0 + r, n0 .. n0 + 15]. */
INLINE void q5_pair(const uint8_t *wa, const uint8_t *wb, const uint16_t *da, const uint16_t *db, const int8_t *xq,
                    const float *xd, int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0,
                    int64_t ahead) {
    v16f acc[MB];
    for (int r = 0; r < R; r++) acc[r] = v16_zero_f();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *a = wa + g * 160, *b = wb + g * 160;
        prefetch_ahead(a, ahead, 3);
        prefetch_ahead(b, ahead, 3);
        v16i nib[4];                  /* each: group t's 32 bytes (low half), group t + 1's (high half) */
        for (int i = 0; i < 4; i++) nib[i] = v16_load2(a + 32 * i, b + 32 * i);
        const v16i hb = v16_load2(a + 128, b + 128);
        const v16i m4 = v16_set1_i8(0x0F), m1 = v16_set1_i8(0x10), bias = v16_set1_i8(16);
        v16i s[MB], s2[MB];           /* the first and the last 16 inputs' sums */
        for (int r = 0; r < R; r++) s[r] = s2[r] = v16_zero();
        for (int c = 0; c < 8; c++) {
            /* q5_word's operations on both halves at once */
            const v16i lo = c < 4 ? v16_and(nib[c], m4) : v16_and(v16_srli16(nib[c - 4], 4), m4);
            const v16i hi = v16_and(c < 4 ? v16_slli16(hb, 4 - c) : c == 4 ? hb : v16_srli16(hb, c - 4), m1);
            const v16i w = v16_sub8(v16_or(lo, hi), bias), aw = v16_abs8(w);
            for (int r = 0; r < R; r++) {
                const v16i p = v16_sign8(v16_bcast4(xq + (m0 + r) * K + g * QK + 4 * c), w);
                if (c < 4) s[r] = v16_dpbusd(s[r], aw, p);
                else s2[r] = v16_dpbusd(s2[r], aw, p);
                V16_PIN(s[r]);
                V16_PIN(s2[r]);
            }
        }
        const v16f dw = v16_load_h16(da + g * LANES, db + g * LANES);
        for (int r = 0; r < R; r++)
            acc[r] = v16_fma(v16_cvt(v16_add32(s[r], s2[r])), v16_mul(dw, v16_set1_f(xd[(m0 + r) * G + g])), acc[r]);
    }
    for (int r = 0; r < R; r++) v16_store(y + (m0 + r) * N + n0, acc[r]);
}

#endif
