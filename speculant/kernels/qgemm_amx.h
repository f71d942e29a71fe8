/* qgemm.c's pair products (two groups of 8 outputs) on AMX-INT8 tiles, for row tiles of AMX_MIN_ROWS .. 16 rows.
 *
 * Included by qgemm.c when SPEC_AMX is defined (build.py's variant "amx-int8", with qgemm_pairs.h's 512-bit code
 * for fewer rows; "amx-emulated" runs this code on AVX2 with the tile instructions emulated in C, which is how
 * machines without AMX test it).  Per block g of 32 inputs and groups t, t + 1 (outputs n0 .. n0 + 15):
 *   B tile (8 rows of 64 bytes): row kq holds inputs 4kq .. 4kq + 3 of each of the 16 outputs (4 bytes an output):
 *       Q4: the low nibbles of the layout's word L = kq (kq < 4) or its high nibbles (kq = 4 + L), unpacked to bytes;
 *       Q8: word c = kq as stored.  Group t's bytes fill a row's first 32 bytes, group t + 1's the last 32.
 *   A tile (R rows of 32 bytes): the rows' int8 activations of block g, read in place (stride K).
 *   C = A . B (tdpbsud: signed activations by unsigned Q4 codes; tdpbssd: by signed Q8 codes) is, in row r and
 *   column j, the exact integer dot product isum[g] of row m0 + r with output n0 + j: the value vpdpbusd's lanes
 *   hold in qgemm_pairs.h (32 products of at most 128 * 127 in magnitude: no overflow).
 * After it each lane runs qgemm.c's float sequence unchanged (acc = fma((float)isum, wd * xd, acc), Q4: acc =
 * fma(wm, xs, acc)), so every row gets the bits of the one-row product, which the 512-bit code computes.
 * A tile multiply and store cost about as much for 16 rows as for 1, so tiles pay from a few rows on; the weight
 * bytes are unpacked once per block for all rows of the tile, not once per row group.
 * Tiles are configured per call and thread (another library on the thread, oneDNN say, may configure its own) and
 * released after; the kernel asks Linux once for the AMX state (arch_prctl ARCH_REQ_XCOMP_PERM) and, refused, runs
 * the 512-bit code (same bits).
 */
#ifndef SPECULANT_QGEMM_AMX_H
#define SPECULANT_QGEMM_AMX_H

#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8   /* row tiles of fewer rows take qgemm_pairs.h's vpdpbusd code (measured on a 2-core Xeon with AMX:
                          * tiles were slower at 3..8 rows, faster at 16) */
#endif
#define AMX_ROWS 16      /* rows of a tile at most */
#define AMX_CHUNK 8      /* blocks whose tile products are stored before their float steps run */

#include <stdatomic.h>

typedef struct {         /* the tile configuration LDTILECFG reads (palette 1) */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

#define TC 0             /* tiles: C (R x 64 bytes of int32), A (R x 32 bytes), B (8 x 64 bytes) */
#define TA 1
#define TB 2

#if SPEC_AMX == 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this process may use AMX tiles (asked once), 0 where Linux refused. */
static int amx_permitted(void) {
    static atomic_int state = 0;               /* 0: not asked, 1: permitted, -1: refused */
    int s = atomic_load(&state);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&state, s);
    }
    return s > 0;
}
INLINE void amx_configure(const amx_config *c) { _tile_loadconfig(c); }
INLINE void amx_release(void) { _tile_release(); }
#define AMX_ZERO_C() _tile_zero(TC)
#define AMX_LOAD_A(p, stride) _tile_loadd(TA, p, stride)
#define AMX_LOAD_B(p) _tile_loadd(TB, p, 64)
#define AMX_DP_SU() _tile_dpbsud(TC, TA, TB)
#define AMX_DP_SS() _tile_dpbssd(TC, TA, TB)
#define AMX_STORE_C(p) _tile_stored(TC, p, 64)
#else
/* Emulated tiles (one set per thread), exactly the instructions' results. */
static _Thread_local struct { int rows; int32_t c[AMX_ROWS][16]; int8_t a[AMX_ROWS][32]; uint8_t b[8][64]; } amx_emu;
static int amx_permitted(void) { return 1; }
INLINE void amx_configure(const amx_config *c) { amx_emu.rows = c->rows[TC]; }
INLINE void amx_release(void) {}
INLINE void amx_emu_load_a(const int8_t *p, int64_t stride) {
    for (int r = 0; r < amx_emu.rows; r++) memcpy(amx_emu.a[r], p + r * stride, 32);
}
INLINE void amx_emu_dp(int b_signed) {
    for (int r = 0; r < amx_emu.rows; r++)
        for (int j = 0; j < 16; j++)
            for (int k = 0; k < 32; k++) {
                const uint8_t w = amx_emu.b[k / 4][4 * j + k % 4];
                amx_emu.c[r][j] += (int32_t)amx_emu.a[r][k] * (b_signed ? (int32_t)(int8_t)w : (int32_t)w);
            }
}
#define AMX_ZERO_C() memset(amx_emu.c, 0, sizeof amx_emu.c)
#define AMX_LOAD_A(p, stride) amx_emu_load_a(p, stride)
#define AMX_LOAD_B(p) memcpy(amx_emu.b, p, sizeof amx_emu.b)
#define AMX_DP_SU() amx_emu_dp(0)
#define AMX_DP_SS() amx_emu_dp(1)
#define AMX_STORE_C(p) memcpy(p, amx_emu.c, sizeof(int32_t) * 16 * amx_emu.rows)
#endif

/* The tile shapes for row tiles of R rows. */
INLINE void amx_shape(amx_config *c, int R) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    c->rows[TC] = (uint8_t)R, c->colsb[TC] = 64;
    c->rows[TA] = (uint8_t)R, c->colsb[TA] = 32;
    c->rows[TB] = 8, c->colsb[TB] = 64;
}

/* B tile of block g, groups t, t + 1 (codes wa, wb): Q4 (bits 4) unpacked to one byte a code, Q8 as stored. */
INLINE void amx_weights(uint8_t *bt, const uint8_t *wa, const uint8_t *wb, int bits, int64_t g) {
    if (bits == 4) {
        const v16i mask = v16_set1_i8(0x0F);
        for (int L = 0; L < 4; L++) {
            const v16i raw = v16_load2(wa + g * 128 + 32 * L, wb + g * 128 + 32 * L);
            v16_store_i(bt + 64 * L, v16_and(raw, mask));
            v16_store_i(bt + 64 * (4 + L), v16_high_nibbles(raw, mask));
        }
    } else {
        for (int c = 0; c < 8; c++) v16_store_i(bt + 64 * c, v16_load2(wa + g * 256 + 32 * c, wb + g * 256 + 32 * c));
    }
}

/* Groups t and t + 1 by R rows from m0 (AMX_MIN_ROWS <= R <= 16), tiles configured for R rows: Q4 (bits 4; codes
 * wa, wb, scales da, db, mins ma, mb in scale layout sk, qgemm.c's SK_*) or Q8 (bits 8; no mins; fp16 scales, sk
 * SK_F16);
 * writes y[m0 + r, n0 .. n0 + 15]. */
static void amx_pair(int bits, const uint8_t *wa, const uint8_t *wb, const void *da, const void *db,
                     const void *ma, const void *mb, const int8_t *xq, const float *xd, const float *xs,
                     int64_t m0, int R, int64_t K, int64_t G, float *y, int64_t N, int64_t n0, int64_t ahead, int sk) {
    _Alignas(64) uint8_t bt[AMX_CHUNK][8 * 64];          /* the chunk's B tiles */
    _Alignas(64) int32_t isum[AMX_CHUNK][AMX_ROWS][16];  /* the chunk's integer sums */
    _Alignas(64) float acc[AMX_ROWS][16];
    const int64_t wbytes = bits == 4 ? 128 : 256;
    for (int r = 0; r < R; r++) v16_store(acc[r], v16_zero_f());
    for (int64_t g0 = 0; g0 < G; g0 += AMX_CHUNK) {
        const int64_t n = G - g0 < AMX_CHUNK ? G - g0 : AMX_CHUNK;
        /* three passes over the chunk (B tiles, tile products, float steps), so that no tile load waits for the
         * stores just before it, nor a vector load for the tile store */
        for (int64_t i = 0; i < n; i++) {
            prefetch_ahead(wa + (g0 + i) * wbytes, ahead, (int)(wbytes / 64));
            prefetch_ahead(wb + (g0 + i) * wbytes, ahead, (int)(wbytes / 64));
            amx_weights(bt[i], wa, wb, bits, g0 + i);
        }
        for (int64_t i = 0; i < n; i++) {
            AMX_LOAD_B(bt[i]);
            AMX_LOAD_A(xq + m0 * K + (g0 + i) * QK, K);
            AMX_ZERO_C();
            if (bits == 4) AMX_DP_SU(); else AMX_DP_SS();
            AMX_STORE_C(isum[i]);
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t g = g0 + i;
            v16f dw, mw;
            if (bits == 4) {
                v16_q4_scales(da, db, ma, mb, g, sk, &dw, &mw);
                for (int r = 0; r < R; r++) {
                    const int64_t mg = (m0 + r) * G + g;
                    v16f a = v16_fma(v16_cvt(v16_load_i(isum[i][r])), v16_mul(dw, v16_set1_f(xd[mg])), v16_load_f(acc[r]));
                    v16_store(acc[r], v16_fma(mw, v16_set1_f(xs[mg]), a));
                }
            } else {
                dw = v16_load_s16(da, db, g * LANES, 0);
                for (int r = 0; r < R; r++) {
                    const int64_t mg = (m0 + r) * G + g;
                    v16_store(acc[r], v16_fma(v16_cvt(v16_load_i(isum[i][r])), v16_mul(dw, v16_set1_f(xd[mg])),
                                              v16_load_f(acc[r])));
                }
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(y + (m0 + r) * N + n0, acc[r], sizeof acc[r]);
}

/* Rows 0 .. M-1 of groups t, t + 1 (outputs N0 ..) in near-equal tiles of at most 16 rows (more than 16 rows: tiles
 * of 9 or more): by tiles when they have AMX_MIN_ROWS or more and amx is set (configuring the tiles when the size
 * changes; shaped: the size configured on this thread, 0: none), else by PAIR_CALL (qgemm_pairs.h). */
#define AMX_ROW_TILES(BITS, WA, WB, DA, DB, MA, MB_, XS, N0, PAIR_CALL, SK)                          \
    do {                                                                                             \
        const int64_t tiles_ = (M + AMX_ROWS - 1) / AMX_ROWS, base_ = M / (tiles_ + !tiles_);          \
        const int64_t extra_ = M - base_ * tiles_;                                                   \
        if (!amx || base_ < AMX_MIN_ROWS) { ROW_TILES(PAIR_CALL); break; }                           \
        int64_t m0 = 0;                                                                              \
        for (int64_t i_ = 0; i_ < tiles_; i_++) {                                                    \
            const int rows_ = (int)(base_ + (i_ < extra_));                                          \
            if (shaped != rows_) { amx_config c_; amx_shape(&c_, rows_); amx_configure(&c_); shaped = rows_; } \
            amx_pair(BITS, WA, WB, DA, DB, MA, MB_, xq, xd, XS, m0, rows_, K, G, y, N, N0, ahead, SK);    \
            m0 += rows_;                                                                             \
        }                                                                                            \
    } while (0)

#endif
