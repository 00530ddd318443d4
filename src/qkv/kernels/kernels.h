/* What qkv's native files share (q4.c: the block products; f32.c: the float32 product of a decoding step; ops.c:
 * the fused operations of a decoding step).
 *
 * Each speed-critical loop is written for three instruction sets, the variants, and the caller names the one to
 * run (qkv.kernels passes the best this CPU runs, or the one QKV_KERNEL names; the tests run each): portable C
 * everywhere, AVX2 with FMA and F16C, and AVX-512 (with VNNI for the integer products). */
#ifndef QKV_KERNELS_H
#define QKV_KERNELS_H

#include <stdint.h>

enum { PORTABLE = 0, AVX2 = 1, AVX512_VNNI = 2 };  /* the variants, in the order qkv.kernels.VARIANTS names them */

int qkv_best_variant(void);            /* the best variant this CPU runs */
int qkv_runs_variant(int variant);     /* whether this CPU runs `variant` */

#endif
