/* The entry points our kernel sources call across files (qgemm.c, attention.c -> decode_step.c). */
#ifndef SPECULANT_KERNELS_H
#define SPECULANT_KERNELS_H
#include <stdint.h>

void spec_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs);
void spec_w4a8(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
               const uint8_t *codes, const uint16_t *wd, const uint16_t *wm, int64_t N, float *y, int64_t ahead);
void spec_w8a8(const int8_t *xq, const float *xd, int64_t M, int64_t K,
               const int8_t *codes, const uint16_t *wd, int64_t N, float *y, int64_t ahead);
void spec_w4a8k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *codes,
                const float *wd, const float *wm, int64_t N, float *y, int64_t ahead);
void spec_w4a8q4k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *codes,
                  const int8_t *sm, const float *dm, int64_t N, float *y, int64_t ahead);
int spec_w8a8k(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const int8_t *codes,
               const float *wd, const float *wm, int64_t sub, int64_t N, float *y, int64_t ahead);
void spec_w6a8k(const int8_t *xq, const float *xd, int64_t M, int64_t K, const uint8_t *codes, const int8_t *sc,
                const float *dd, int64_t N, float *y, int64_t ahead);
void spec_w5a8(const int8_t *xq, const float *xd, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *wd,
               int64_t N, float *y, int64_t ahead);
int spec_attention_ragged(int64_t nseq, const int64_t *rows, const int64_t *start, const int64_t *smax,
                          void *const *kc, void *const *vc, const int64_t *lstride, int64_t layer,
                          const uint8_t *const *mask, const float *q, const float *kn, const float *vn, int64_t H,
                          int64_t HKV, int64_t D, float scale, int64_t kv_bytes, float *out);

#endif
