/* qkv's block products: y = x W^T for weights of 4 or 8 bits and activations quantized to 8 bits, per block of 32.
 *
 * PyTorch's int4 kernel widens every 4-bit code to a float and multiplies in floats. Here, as llama.cpp does, the
 * activation row is first quantized to int8 per block of 32 inputs (one float scale each), and each block of a
 * weight row is multiplied by it in integers: 32 products of a weight code and an 8-bit value summed exactly in
 * 32 bits, then one float multiply per block. With
 *
 *     w_j = d * q_j + m          the weight block: its scale d and offset m both fp16, as GGUF stores them;
 *                                Q4 (Q4_1): q_j in 0..15; a Q4_0 block is d (q_j - 8): m = -8 d, also exact in fp16;
 *                                Q8 (Q8_0): q_j in -128..127 and no offset, m = 0
 *     x_j ~ e * p_j              (p_j in -127..127: the activation block's scale e = max|x| / 127)
 *
 * a block contributes  sum_j w_j x_j ~ d e (sum_j q_j p_j) + m e (sum_j p_j),  the integer sum the only work per
 * input; e * sum_j p_j is computed once per activation block, for every row.
 *
 * Layouts (row-major, contiguous):
 *   codes   Q4: (rows, n / 2) bytes: for block b of a row, bytes 16 b .. 16 b + 15; byte i holds input 32 b + i in
 *           its low nibble and input 32 b + 16 + i in its high one (GGUF's Q4_0 and Q4_1 order);
 *           Q8: (rows, n) signed bytes, in input order;
 *           Q4X8: Q4's blocks with the rows interleaved eight at a time, what qkv's 4-bit layers hold (below);
 *           Q6: GGUF's Q6_K, 6-bit codes with a scale per 16 inputs (below), 48 bytes a pair of blocks;
 *           Q5: GGUF's Q5_K, 5-bit codes with a scale and a minimum per block (below), 40 bytes a pair of blocks
 *   d, m    (rows, n / 32) fp16: each block's scale d and offset m (Q4 only; Q4X8: (rows / 8, n / 32, 8); Q6: d
 *           (rows, n / 256) fp16, and in m's place the int8 scales (rows, n / 16); Q5: d and dmin (rows, n / 256,
 *           2) fp16, and in m's place the blocks' scales, then their minimums, (rows, 2, n / 32) bytes)
 *   xq      (batch, n) int8, xd and xs (batch, n / 32) floats: the activations' codes, scales e, and e * sum_j p_j
 *   y       (batch, rows) floats
 *
 * Variants: portable C, AVX2 (vpmaddubsw: unsigned x signed bytes into 16-bit pairs, then vpmaddwd into 32 bits) and
 * AVX-512 VNNI (vpdpbusd: four byte products into 32 bits in one instruction; Q4 and Q8 rows two blocks at a time
 * in 512-bit registers, Q4X8 in 256-bit ones), both with F16C for the fp16 scales, chosen by what the CPU reports.
 * Both instructions take one unsigned operand: Q4's codes are; a Q8 block is taken as |q_j| times p_j with q_j's
 * sign. The rows (Q4X8: the groups of eight) are split over OpenMP threads: the library is built with -fopenmp but
 * not linked to an OpenMP runtime, so it runs on the one PyTorch loaded (its threads, torch.get_num_threads()),
 * never a second pool beside it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define BLOCK 32
#define TILE 4  /* activation rows taken at once: each weight block read and unpacked once for them */
/* The SIMD variants ask for the codes this many bytes ahead of those they multiply (prefetch): the hardware's own
 * prefetching leaves the weights' stream from memory at about two thirds of its speed on the CPUs measured (one
 * decoding step's products of a 360M and a 1.7B model: 30-35% less time; 2 to 8 KB ahead all did about as well). */
#define AHEAD 4096

enum { Q4 = 0, Q8 = 1, Q4X8 = 2, Q6 = 3, Q5 = 4 };  /* the weight blocks' formats */
#define GROUP 8                                     /* Q4X8: rows interleaved eight at a time */

/* An IEEE fp16 as a float (exact: every fp16 is a float), without F16C. */
static float half_portable(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    union {
        uint32_t bits;
        float value;
    } v;
    if (exponent == 31)  /* infinity or NaN */
        v.bits = sign | 0x7f800000u | mantissa << 13;
    else if (exponent != 0)  /* normal: rebias the exponent from 15 to 127 */
        v.bits = sign | (exponent + 112) << 23 | mantissa << 13;
    else {  /* zero or subnormal: mantissa * 2^-24, exact in a float */
        v.value = (float)mantissa * 0x1p-24f;
        v.bits |= sign;
    }
    return v.value;
}

/* ------------------------------------------------------------------------------------------------- activations */

/* A block of 32 activations' scale e = max|x| / 127, and in `inverse` what p = round(x * inverse) multiplies by,
 * 127 / max|x| (0 for a block of zeros). */
static float block_scale(const float *v, float *inverse)
{
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++)
        amax = fmaxf(amax, fabsf(v[j]));
    *inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    return amax / 127.0f;
}

/* Quantize `batch` rows of `n` floats to int8 per block of 32: e = max|x| / 127, p = round(x * 127 / max|x|)
 * (halves to even, as torch.round), and the block's e * sum p. */
void qkv_quantize_q8(const float *x, int64_t batch, int64_t n, int8_t *xq, float *xd, float *xs)
{
    int64_t blocks = batch * (n / BLOCK);
    for (int64_t i = 0; i < blocks; i++) {
        const float *v = x + i * BLOCK;
        float inverse;
        xd[i] = block_scale(v, &inverse);
        int32_t sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            int32_t p = (int32_t)nearbyintf(v[j] * inverse);
            xq[i * BLOCK + j] = (int8_t)p;
            sum += p;
        }
        xs[i] = xd[i] * (float)sum;
    }
}

/* ------------------------------------------------------------------------------------ one block: the integer sum */

static int32_t block_sum_portable(int format, const uint8_t *c, const int8_t *p)
{
    int32_t sum = 0;
    if (format == Q8)
        for (int i = 0; i < BLOCK; i++)
            sum += (int8_t)c[i] * p[i];
    else
        for (int i = 0; i < BLOCK / 2; i++)
            sum += (c[i] & 15) * p[i] + (c[i] >> 4) * p[i + BLOCK / 2];
    return sum;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* A Q4 block's 32 codes as bytes 0..15, inputs 0..15 in the low 128 bits and 16..31 in the high ones. */
__attribute__((target("avx2"))) static inline __m256i codes_q4(const uint8_t *c)
{
    __m128i packed = _mm_loadu_si128((const __m128i *)c);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* A Q8 block's 32 codes as stored. */
__attribute__((target("avx2"))) static inline __m256i codes_q8(const uint8_t *c)
{
    return _mm256_loadu_si256((const __m256i *)c);
}

/* Eight 32-bit partial sums of a block's 32 products: its codes (as codes_q4 or codes_q8 give them) times 32
 * activations; Q8's as |q| times p with q's sign, |q| <= 128 and |p| <= 127, so that the unsigned x signed
 * instructions take them. */
__attribute__((target("avx2"))) static inline __m256i products_avx2(int format, __m256i codes, const int8_t *p)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    if (format == Q8) {
        x = _mm256_sign_epi8(x, codes);
        codes = _mm256_sign_epi8(codes, codes);
    }
    __m256i pairs = _mm256_maddubs_epi16(codes, x);  /* <= 2 * 128 * 127: no 16-bit saturation */
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static inline __m256i products_vnni(int format,
                                                                                             __m256i codes,
                                                                                             const int8_t *p)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    if (format == Q8) {
        x = _mm256_sign_epi8(x, codes);
        codes = _mm256_sign_epi8(codes, codes);
    }
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x);
}

__attribute__((target("avx2"))) static inline int32_t sum8_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2,fma"))) static inline float sum8_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* An fp16 as a float, by F16C's instruction. */
__attribute__((target("f16c"))) static inline float half_f16c(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* One weight row against `count` (1 to TILE) activation rows, `n` apart: each block's codes unpacked once for all
 * of them; per activation row, the blocks' integer sums turned to floats and scaled by d e in eight lanes (two
 * accumulators, alternate blocks), then (Q4) m e sum p. The scales and offsets of eight blocks are widened and
 * multiplied at once, in eight lanes; the last blocks of a row (fewer than eight) one by one. A row's arithmetic is
 * the same whatever `count` is, so a row in a batch gets what it gets alone (the AVX2 variant; ROWS below makes
 * its function). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void avx2_body(
    const int format, const uint8_t *c, const uint16_t *wd, const uint16_t *wm, const int8_t *p, const float *e,
    const float *s, int64_t blocks, int64_t n, const int count, float *out)
{
    const int64_t bytes = format == Q8 ? BLOCK : BLOCK / 2; /* a block's codes */
    __m256 acc[TILE][2], offsets[TILE];
    float tail[TILE];
    for (int k = 0; k < count; k++) {
        acc[k][0] = acc[k][1] = offsets[k] = _mm256_setzero_ps();
        tail[k] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
        for (int64_t k = 0; k < 8 * bytes; k += 64)
            __builtin_prefetch(c + b * bytes + AHEAD + k, 0, 3);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b)));
        float scale[TILE][8];
        for (int k = 0; k < count; k++)
            _mm256_storeu_ps(scale[k], _mm256_mul_ps(d, _mm256_loadu_ps(e + k * blocks + b)));
        if (format == Q4) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b)));
            for (int k = 0; k < count; k++)
                offsets[k] = _mm256_fmadd_ps(m, _mm256_loadu_ps(s + k * blocks + b), offsets[k]);
        }
        for (int j = 0; j < 8; j++) {
            __m256i codes = format == Q8 ? codes_q8(c + (b + j) * bytes) : codes_q4(c + (b + j) * bytes);
            for (int k = 0; k < count; k++) {
                __m256 sums = _mm256_cvtepi32_ps(products_avx2(format, codes, p + k * n + (b + j) * BLOCK));
                acc[k][j & 1] = _mm256_fmadd_ps(_mm256_set1_ps(scale[k][j]), sums, acc[k][j & 1]);
            }
        }
    }
    for (; b < blocks; b++) {
        float d = half_f16c(wd[b]);
        __m256i codes = format == Q8 ? codes_q8(c + b * bytes) : codes_q4(c + b * bytes);
        for (int k = 0; k < count; k++) {
            __m256 sums = _mm256_cvtepi32_ps(products_avx2(format, codes, p + k * n + b * BLOCK));
            acc[k][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d * e[k * blocks + b]), sums, acc[k][b & 1]);
            if (format == Q4)
                tail[k] += half_f16c(wm[b]) * s[k * blocks + b];
        }
    }
    for (int k = 0; k < count; k++)
        out[k] = sum8_ps(_mm256_add_ps(acc[k][0], acc[k][1])) + sum8_ps(offsets[k]) + tail[k];
}

/* A variant's function: its body called with the format and the count as constants, so that the branches on them
 * vanish, the loops over rows unroll and the sums stay in registers. */
#define ROWS(name, body, targets)                                                                                    \
    __attribute__((target(targets))) static void name(int format, const uint8_t *c, const uint16_t *wd,             \
                                                      const uint16_t *wm, const int8_t *p, const float *e,           \
                                                      const float *s, int64_t blocks, int64_t n, int count,          \
                                                      float *out)                                                    \
    {                                                                                                                \
        if (format == Q8) {                                                                                          \
            switch (count) {                                                                                         \
            case 1: body(Q8, c, wd, wm, p, e, s, blocks, n, 1, out); break;                                          \
            case 2: body(Q8, c, wd, wm, p, e, s, blocks, n, 2, out); break;                                          \
            case 3: body(Q8, c, wd, wm, p, e, s, blocks, n, 3, out); break;                                          \
            default: body(Q8, c, wd, wm, p, e, s, blocks, n, TILE, out);                                             \
            }                                                                                                        \
            return;                                                                                                  \
        }                                                                                                            \
        switch (count) {                                                                                             \
        case 1: body(Q4, c, wd, wm, p, e, s, blocks, n, 1, out); break;                                              \
        case 2: body(Q4, c, wd, wm, p, e, s, blocks, n, 2, out); break;                                              \
        case 3: body(Q4, c, wd, wm, p, e, s, blocks, n, 3, out); break;                                              \
        default: body(Q4, c, wd, wm, p, e, s, blocks, n, TILE, out);                                                 \
        }                                                                                                            \
    }

ROWS(rows_avx2, avx2_body, "avx2,fma,f16c")

/* The VNNI variant's products in 512-bit registers: two blocks at a time, one vpdpbusd for the 64 products of both
 * (block b's sums in lanes 0..7, block b + 1's in lanes 8..15), each half scaled by its own block's d e. Lanes 0..7
 * so gather the even blocks and 8..15 the odd ones, one multiply-add each as avx2_body's two accumulators do, in the
 * same order: the sums are the AVX2 variant's, bit for bit, with half the instructions. A Q8 pair is taken as |q|
 * times p with q's sign, as there, the sign put on p by a masked subtraction (AVX-512 has no vpsignb). */
#define VNNI_TARGETS "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
__attribute__((target(VNNI_TARGETS), always_inline)) static inline void vnni512_body(
    const int format, const uint8_t *c, const uint16_t *wd, const uint16_t *wm, const int8_t *p, const float *e,
    const float *s, int64_t blocks, int64_t n, const int count, float *out)
{
    const int64_t bytes = format == Q8 ? BLOCK : BLOCK / 2; /* a block's codes */
    __m512 acc[TILE];
    __m256 offsets[TILE], even[TILE], odd[TILE];
    float tail[TILE];
    for (int k = 0; k < count; k++) {
        acc[k] = _mm512_setzero_ps();
        offsets[k] = _mm256_setzero_ps();
        tail[k] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
        for (int64_t k = 0; k < 8 * bytes; k += 64)
            __builtin_prefetch(c + b * bytes + AHEAD + k, 0, 3);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b)));
        __m256 scale[TILE];
        for (int k = 0; k < count; k++)
            scale[k] = _mm256_mul_ps(d, _mm256_loadu_ps(e + k * blocks + b));
        if (format == Q4) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b)));
            for (int k = 0; k < count; k++)
                offsets[k] = _mm256_fmadd_ps(m, _mm256_loadu_ps(s + k * blocks + b), offsets[k]);
        }
        for (int j = 0; j < 8; j += 2) {
            __m512i codes;
            __mmask64 negative = 0;
            if (format == Q8) {
                codes = _mm512_loadu_si512((const void *)(c + (b + j) * bytes));
                negative = _mm512_movepi8_mask(codes);
                codes = _mm512_abs_epi8(codes);  /* -128 stays 0x80: 128 read unsigned */
            } else {
                codes = _mm512_inserti64x4(_mm512_castsi256_si512(codes_q4(c + (b + j) * bytes)),
                                           codes_q4(c + (b + j + 1) * bytes), 1);
            }
            /* lanes 0..7 take scale j, lanes 8..15 scale j + 1 */
            __m512i pick = _mm512_set_epi32(j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j, j, j, j, j, j, j, j);
            for (int k = 0; k < count; k++) {
                __m512i x = _mm512_loadu_si512((const void *)(p + k * n + (b + j) * BLOCK));
                if (format == Q8)
                    x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
                __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x));
                __m512 both = _mm512_permutexvar_ps(pick, _mm512_castps256_ps512(scale[k]));
                acc[k] = _mm512_fmadd_ps(both, sums, acc[k]);
            }
        }
    }
    for (int k = 0; k < count; k++) {
        even[k] = _mm512_castps512_ps256(acc[k]);
        odd[k] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[k]), 1));
    }
    for (; b < blocks; b++) {  /* the last blocks (fewer than eight) one by one, as avx2_body takes them */
        float d = half_f16c(wd[b]);
        __m256i codes = format == Q8 ? codes_q8(c + b * bytes) : codes_q4(c + b * bytes);
        for (int k = 0; k < count; k++) {
            __m256 sums = _mm256_cvtepi32_ps(products_vnni(format, codes, p + k * n + b * BLOCK));
            __m256 *into = b & 1 ? &odd[k] : &even[k];
            *into = _mm256_fmadd_ps(_mm256_set1_ps(d * e[k * blocks + b]), sums, *into);
            if (format == Q4)
                tail[k] += half_f16c(wm[b]) * s[k * blocks + b];
        }
    }
    for (int k = 0; k < count; k++)
        out[k] = sum8_ps(_mm256_add_ps(even[k], odd[k])) + sum8_ps(offsets[k]) + tail[k];
}

ROWS(rows_vnni, vnni512_body, VNNI_TARGETS)

__attribute__((target("avx2"))) static int32_t block_sum_avx2(int format, const uint8_t *c, const int8_t *p)
{
    return sum8_epi32(products_avx2(format, format == Q8 ? codes_q8(c) : codes_q4(c), p));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static int32_t block_sum_vnni(int format,
                                                                                        const uint8_t *c,
                                                                                        const int8_t *p)
{
    return sum8_epi32(products_vnni(format, format == Q8 ? codes_q8(c) : codes_q4(c), p));
}
#endif

/* ------------------------------------------------------------------------- Q4X8: eight rows interleaved, block by block
 *
 * The same Q4 blocks, laid out for decoding: the rows in groups of eight, and in a group, block b's 8 x 16 bytes in
 * 128, as four quads of 32 bytes: quad k holds, row after row, each row's bytes 4k .. 4k + 3 of block b (inputs
 * 4k .. 4k + 3 in the low nibbles, 16 + 4k .. 16 + 4k + 3 in the high ones); d and m (rows / 8, n / 32, 8), the
 * group's eight rows' fp16 numbers for block b together. One 256-bit load so holds four inputs' codes of eight
 * rows, and one integer instruction multiplies them by four activations broadcast: each row's block sum lands in
 * its own lane, with no sum across lanes, and each row's float arithmetic is that of the portable row variant,
 * block after block: acc += (d e) sum, then acc += m (e sum p). Every variant so gives, bit for bit, what
 * rows_portable gives for the same rows in the Q4 layout. */

/* Four activations (p[0..3]) as one 32-bit number, to broadcast. */
static inline int32_t four(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void x8_portable(const uint8_t *c, const uint16_t *wd, const void *m, const int8_t *p, const float *e,
                        const float *s, int64_t blocks, int64_t n, int count, float *out)
{
    const uint16_t *wm = m;
    for (int k = 0; k < count; k++)
        for (int r = 0; r < GROUP; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *block = c + b * GROUP * BLOCK / 2;
                const int8_t *x = p + k * n + b * BLOCK;
                int32_t sum = 0;
                for (int q = 0; q < 4; q++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = block[32 * q + 4 * r + i];
                        sum += (byte & 15) * x[4 * q + i] + (byte >> 4) * x[BLOCK / 2 + 4 * q + i];
                    }
                acc += half_portable(wd[b * GROUP + r]) * e[k * blocks + b] * (float)sum;
                acc += half_portable(wm[b * GROUP + r]) * s[k * blocks + b];
            }
            out[k * GROUP + r] = acc;
        }
}

#if defined(__x86_64__)
/* Eight rows' block sums, a row a lane: the block's four quads (low and high nibbles apart, as `lo` and `hi`)
 * times the activation block x. AVX2: unsigned x signed byte pairs into 16 bits (each <= 2 * 15 * 127, eight of them
 * summed <= 30480: no overflow), then into 32 bits; VNNI: four byte products into 32 bits at once. */
__attribute__((target("avx2"))) static inline __m256i x8_sums_avx2(const __m256i *lo, const __m256i *hi,
                                                                   const int8_t *x)
{
    __m256i pairs = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[q], _mm256_set1_epi32(four(x + 4 * q))));
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[q], _mm256_set1_epi32(four(x + BLOCK / 2 + 4 * q))));
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static inline __m256i x8_sums_vnni(const __m256i *lo,
                                                                                              const __m256i *hi,
                                                                                              const int8_t *x)
{
    __m256i sums = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        sums = _mm256_dpbusd_epi32(sums, lo[q], _mm256_set1_epi32(four(x + 4 * q)));
        sums = _mm256_dpbusd_epi32(sums, hi[q], _mm256_set1_epi32(four(x + BLOCK / 2 + 4 * q)));
    }
    return sums;
}

/* A group of eight rows against `count` (1 to TILE) activation rows: each block's codes split into nibbles once
 * for all of them; the float steps those of x8_portable, eight rows at once. */
#define X8_BODY(name, sums, targets)                                                                                 \
    __attribute__((target(targets), always_inline)) static inline void name(                                         \
        const uint8_t *c, const uint16_t *wd, const uint16_t *wm, const int8_t *p, const float *e, const float *s,   \
        int64_t blocks, int64_t n, const int count, float *out)                                                      \
    {                                                                                                                \
        __m256 acc[TILE];                                                                                            \
        const __m256i low = _mm256_set1_epi8(15);                                                                    \
        for (int k = 0; k < count; k++)                                                                              \
            acc[k] = _mm256_setzero_ps();                                                                            \
        for (int64_t b = 0; b < blocks; b++) {                                                                       \
            const uint8_t *block = c + b * GROUP * BLOCK / 2;                                                        \
            __builtin_prefetch(block + AHEAD, 0, 3);                                                                 \
            __builtin_prefetch(block + AHEAD + 64, 0, 3);                                                            \
            __m256i lo[4], hi[4];                                                                                    \
            for (int q = 0; q < 4; q++) {                                                                            \
                __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * q));                                   \
                lo[q] = _mm256_and_si256(v, low);                                                                    \
                hi[q] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                                              \
            }                                                                                                        \
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b * GROUP)));                          \
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b * GROUP)));                          \
            for (int k = 0; k < count; k++) {                                                                        \
                __m256 total = _mm256_cvtepi32_ps(sums(lo, hi, p + k * n + b * BLOCK));                              \
                __m256 de = _mm256_mul_ps(d, _mm256_set1_ps(e[k * blocks + b]));                                     \
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(de, total));                                            \
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(m, _mm256_set1_ps(s[k * blocks + b])));                 \
            }                                                                                                        \
        }                                                                                                            \
        for (int k = 0; k < count; k++)                                                                              \
            _mm256_storeu_ps(out + k * GROUP, acc[k]);                                                               \
    }

X8_BODY(x8_avx2_body, x8_sums_avx2, "avx2,fma,f16c")
X8_BODY(x8_vnni_body, x8_sums_vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")

/* A variant's function: its body (a group of eight rows, a Q6 or a Q5 row) with the count a constant, so that the
 * loops over activation rows unroll and the sums stay in registers; `m` is the format's own (Q4X8's offsets, Q6's
 * int8 scales, Q5's scales and minimums). */
#define BY_COUNT(name, body, targets)                                                                                \
    __attribute__((target(targets))) static void name(const uint8_t *c, const uint16_t *wd, const void *m,           \
                                                      const int8_t *p, const float *e, const float *s,               \
                                                      int64_t blocks, int64_t n, int count, float *out)              \
    {                                                                                                                \
        switch (count) {                                                                                             \
        case 1: body(c, wd, m, p, e, s, blocks, n, 1, out); break;                                                   \
        case 2: body(c, wd, m, p, e, s, blocks, n, 2, out); break;                                                   \
        case 3: body(c, wd, m, p, e, s, blocks, n, 3, out); break;                                                   \
        default: body(c, wd, m, p, e, s, blocks, n, TILE, out);                                                      \
        }                                                                                                            \
    }

BY_COUNT(x8_avx2, x8_avx2_body, "avx2,fma,f16c")
BY_COUNT(x8_vnni, x8_vnni_body, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#endif

/* A variant's function (BY_COUNT, or a portable one): its weights, their scales d, the format's `m`, and the
 * activations' codes, scales e and e * sum p. */
typedef void (*counted_dot)(const uint8_t *, const uint16_t *, const void *, const int8_t *, const float *,
                            const float *, int64_t, int64_t, int, float *);

/* ------------------------------------------------------------------------------------- Q6: GGUF's Q6_K as stored
 *
 * A super-block of 256 weights w_j = d sc_h (q_j - 32): q_j in 0..63, sc_h an int8 scale for each 16 inputs, d one
 * fp16 for the 256. Held two blocks of 32 inputs (b even, b + 1) in 48 bytes, laid out so that few instructions
 * unpack them: bytes 0..31 the codes' low four bits, byte i holding input i of block b in its low nibble and input i
 * of block b + 1 in its high one; bytes 32..39 block b's high two bits and 40..47 block b + 1's (byte i: inputs i,
 * 8 + i, 16 + i and 24 + i at bits 0, 2, 4 and 6). A block contributes
 *
 *     d e (sc_0 sum_{j < 16} (q_j - 32) p_j + sc_1 sum_{j >= 16} (q_j - 32) p_j),
 *
 * the integer sum exact in 32 bits (|q - 32| <= 32: at most 32 * 32 * 127 * 128), then one float multiply, as a Q8
 * block's. q - 32 is taken as |q - 32| times p with q - 32's sign, as Q8's codes are. */
#define Q6_PAIR 48
#define SUPER 8  /* blocks of 32 in a super-block: one d */

/* Block b's 32 codes, in input order. */
static void q6_unpacked(const uint8_t *c, int64_t b, int *q)
{
    const uint8_t *pair = c + b / 2 * Q6_PAIR, *high = pair + BLOCK + 8 * (b & 1);
    for (int i = 0; i < BLOCK; i++)
        q[i] = (pair[i] >> (4 * (b & 1))) & 15;
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 4; k++)
            q[8 * k + i] |= (high[i] >> (2 * k) & 3) << 4;
}

static int32_t block_sum_q6_portable(const uint8_t *c, int64_t b, const int8_t *sc, const int8_t *p)
{
    int q[BLOCK];
    int32_t half[2] = {0, 0};
    q6_unpacked(c, b, q);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < BLOCK / 2; i++)
            half[h] += (q[16 * h + i] - 32) * p[16 * h + i];
    return sc[0] * half[0] + sc[1] * half[1];
}

static void q6_portable(const uint8_t *c, const uint16_t *wd, const void *m, const int8_t *p, const float *e,
                        const float *s, int64_t blocks, int64_t n, int count, float *out)
{
    const int8_t *sc = m;
    (void)s;  /* no offsets */
    for (int k = 0; k < count; k++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            int32_t sum = block_sum_q6_portable(c, b, sc + 2 * b, p + k * n + b * BLOCK);
            acc += half_portable(wd[b / SUPER]) * e[k * blocks + b] * (float)sum;
        }
        out[k] = acc;
    }
}

#if defined(__x86_64__)
/* A pair's two blocks' codes less 32, signed bytes in input order, block b in `even` and b + 1 in `odd`. The high
 * bits: a block's eight bytes in each 64-bit lane, lane k shifted right by 2 k, so that input 8 k + i finds its two
 * bits at the bottom of byte i. */
__attribute__((target("avx2"))) static inline void codes_q6_pair(const uint8_t *pair, __m256i *even, __m256i *odd)
{
    const __m256i low = _mm256_set1_epi8(15), shifts = _mm256_set_epi64x(6, 4, 2, 0);
    __m256i nibbles = _mm256_loadu_si256((const __m256i *)pair);
    __m128i bits = _mm_loadu_si128((const __m128i *)(pair + BLOCK));
    __m256i high[2] = {_mm256_broadcastq_epi64(bits), _mm256_broadcastq_epi64(_mm_unpackhi_epi64(bits, bits))};
    for (int h = 0; h < 2; h++)
        high[h] = _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi64(high[h], shifts), _mm256_set1_epi8(3)), 4);
    *even = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(nibbles, low), high[0]), _mm256_set1_epi8(32));
    *odd = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low), high[1]),
                           _mm256_set1_epi8(32));
}

/* Eight 32-bit sums of a Q6 block's products, lane i over inputs 4 i .. 4 i + 3 times its half's scale (lanes 0..3
 * sc_0, 4..7 sc_1): byte pairs into 16 bits (<= 2 * 32 * 127), then vpmaddwd by the scales. */
__attribute__((target("avx2"))) static inline __m256i q6_products_avx2(__m256i codes, const int8_t *p,
                                                                       const int8_t *sc)
{
    __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)p), codes);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), x);
    return _mm256_madd_epi16(pairs, _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0])));
}

/* One Q6 row against `count` (1 to TILE) activation rows: each pair of blocks unpacked once for all of them, each
 * block's lanes scaled by d e into two accumulators (even and odd blocks), as avx2_body does for Q8. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q6_avx2_body(
    const uint8_t *c, const uint16_t *wd, const int8_t *sc, const int8_t *p, const float *e, const float *s,
    int64_t blocks, int64_t n, const int count, float *out)
{
    (void)s;  /* no offsets */
    __m256 acc[TILE][2];
    for (int k = 0; k < count; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint8_t *pair = c + b / 2 * Q6_PAIR;
        if (b % SUPER == 0)
            for (int64_t k = 0; k < SUPER / 2 * Q6_PAIR; k += 64)
                __builtin_prefetch(pair + AHEAD + k, 0, 3);
        __m256i codes[2];
        codes_q6_pair(pair, &codes[0], &codes[1]);
        float d = half_f16c(wd[b / SUPER]);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < count; k++) {
                __m256i sums = q6_products_avx2(codes[h], p + k * n + (b + h) * BLOCK, sc + 2 * (b + h));
                acc[k][h] = _mm256_fmadd_ps(_mm256_set1_ps(d * e[k * blocks + b + h]), _mm256_cvtepi32_ps(sums),
                                            acc[k][h]);
            }
    }
    for (int k = 0; k < count; k++)
        out[k] = sum8_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

/* The AVX-512 K-quant bodies' float steps: d e of block b in lanes 0..7 and of b + 1 in 8..15 (e: the two blocks'
 * activation scales), and at the end an accumulator's halves (the even blocks', the odd ones') added and summed, as
 * the AVX2 bodies add their two accumulators. */
__attribute__((target(VNNI_TARGETS))) static inline __m512 pair_scales(__m512 d, const float *e)
{
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)e));
    return _mm512_mul_ps(d, _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(two)));
}

__attribute__((target(VNNI_TARGETS))) static inline float pair_total(__m512 acc)
{
    __m256 even = _mm512_castps512_ps256(acc);
    __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return sum8_ps(_mm256_add_ps(even, odd));
}

/* The AVX-512 variant's Q6 rows: a pair of blocks in 512-bit registers (block b in lanes 0..7, b + 1 in 8..15), the
 * same integer lanes as q6_products_avx2's, each half scaled by its own block's d e: lanes 0..7 so gather the even
 * blocks and 8..15 the odd ones, as q6_avx2_body's two accumulators do, in the same order (the outputs are its own,
 * bit for bit). The high bits come to bits 4 and 5 by one rotation of each 64-bit lane (lane k of a block by
 * 4 - 2 k), the scales of a super-block are widened once and spread a pair at a time. */
__attribute__((target(VNNI_TARGETS), always_inline)) static inline void q6_vnni_body(
    const uint8_t *c, const uint16_t *wd, const int8_t *sc, const int8_t *p, const float *e, const float *s,
    int64_t blocks, int64_t n, const int count, float *out)
{
    (void)s;  /* no offsets */
    const __m512i rotations = _mm512_set_epi64(62, 0, 2, 4, 62, 0, 2, 4);
    const __m512i twice = _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0);  /* block b's high bytes, then b + 1's */
    __m512 acc[TILE];
    for (int k = 0; k < count; k++)
        acc[k] = _mm512_setzero_ps();
    __m512i wide = _mm512_setzero_si512();  /* the super-block's 16 scales as 16-bit numbers */
    __m512 d = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint8_t *pair = c + b / 2 * Q6_PAIR;
        if (b % SUPER == 0) {
            for (int64_t k = 0; k < SUPER / 2 * Q6_PAIR; k += 64)
                __builtin_prefetch(pair + AHEAD + k, 0, 3);
            wide = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + 2 * b))));
            d = _mm512_set1_ps(half_f16c(wd[b / SUPER]));
        }
        __m256i nibbles = _mm256_loadu_si256((const __m256i *)pair);
        __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles), _mm256_srli_epi16(nibbles, 4), 1);
        __m128i bits = _mm_loadu_si128((const __m128i *)(pair + BLOCK));
        __m512i high = _mm512_permutexvar_epi64(twice, _mm512_castsi128_si512(bits));
        high = _mm512_and_si512(_mm512_rolv_epi64(high, rotations), _mm512_set1_epi8(0x30));
        codes = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi8(15), high, 0xea);  /* (codes & 15) | high */
        codes = _mm512_sub_epi8(codes, _mm512_set1_epi8(32));
        __mmask64 negative = _mm512_movepi8_mask(codes);
        codes = _mm512_abs_epi8(codes);
        /* the pair's four scales, each over its half-block's eight 16-bit lanes */
        int j = (int)(b % SUPER) * 2;
        __m512i spread = _mm512_set_epi16(j + 3, j + 3, j + 3, j + 3, j + 3, j + 3, j + 3, j + 3,
                                          j + 2, j + 2, j + 2, j + 2, j + 2, j + 2, j + 2, j + 2,
                                          j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1,
                                          j, j, j, j, j, j, j, j);
        __m512i scales = _mm512_permutexvar_epi16(spread, wide);
        for (int k = 0; k < count; k++) {
            __m512i x = _mm512_loadu_si512((const void *)(p + k * n + b * BLOCK));
            x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            __m512i sums = _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), scales);
            acc[k] = _mm512_fmadd_ps(pair_scales(d, e + k * blocks + b), _mm512_cvtepi32_ps(sums), acc[k]);
        }
    }
    for (int k = 0; k < count; k++)
        out[k] = pair_total(acc[k]);
}

BY_COUNT(q6_avx2, q6_avx2_body, "avx2,fma,f16c")
BY_COUNT(q6_vnni, q6_vnni_body, VNNI_TARGETS)

__attribute__((target("avx2"))) static int32_t block_sum_q6_avx2(const uint8_t *c, int64_t b, const int8_t *sc,
                                                                 const int8_t *p)
{
    __m256i codes[2];
    codes_q6_pair(c + b / 2 * Q6_PAIR, &codes[0], &codes[1]);
    return sum8_epi32(q6_products_avx2(codes[b & 1], p, sc));
}
#endif

/* ------------------------------------------------------------------------------------- Q5: GGUF's Q5_K as stored
 *
 * A super-block of 256 weights w_j = d sc_b q_j - dmin m_b: q_j in 0..31, sc_b and m_b six-bit numbers for each
 * block of 32, d and dmin fp16 for the 256. Held two blocks (b even, b + 1) in 40 bytes: bytes 0..31 the codes' low
 * four bits as Q6 holds them (byte i: input i of block b low, of block b + 1 high), then each block's fifth bits, a
 * 32-bit word (bit i: input i); d and dmin (rows, n / 256, 2) fp16; sc_b, then m_b, (rows, 2, n / 32) bytes. A block
 * contributes, as a Q4 block,
 *
 *     d e (sc_b sum_j q_j p_j) - (dmin m_b) (e sum_j p_j),
 *
 * the integer sum exact in 32 bits (at most 63 * 32 * 31 * 127), the offsets' products exact in floats. */
#define Q5_PAIR 40

/* Block b's 32 codes, in input order. */
static void q5_unpacked(const uint8_t *c, int64_t b, int *q)
{
    const uint8_t *pair = c + b / 2 * Q5_PAIR, *high = pair + BLOCK + 4 * (b & 1);
    for (int i = 0; i < BLOCK; i++)
        q[i] = ((pair[i] >> (4 * (b & 1))) & 15) | ((high[i / 8] >> (i % 8)) & 1) << 4;
}

static int32_t block_sum_q5_portable(const uint8_t *c, int64_t b, int sc, const int8_t *p)
{
    int q[BLOCK];
    int32_t sum = 0;
    q5_unpacked(c, b, q);
    for (int i = 0; i < BLOCK; i++)
        sum += q[i] * p[i];
    return sc * sum;
}

static void q5_portable(const uint8_t *c, const uint16_t *wd, const void *m, const int8_t *p, const float *e,
                        const float *s, int64_t blocks, int64_t n, int count, float *out)
{
    const uint8_t *sm = m;
    for (int k = 0; k < count; k++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            int32_t sum = block_sum_q5_portable(c, b, sm[b], p + k * n + b * BLOCK);
            acc += half_portable(wd[2 * (b / SUPER)]) * e[k * blocks + b] * (float)sum;
            acc += -half_portable(wd[2 * (b / SUPER) + 1]) * (float)sm[blocks + b] * s[k * blocks + b];
        }
        out[k] = acc;
    }
}

#if defined(__x86_64__)
/* A block's 32 fifth bits (a 32-bit word) as bytes of 16 or 0, input by input: byte i of the word copied to
 * bytes 8 i .. 8 i + 7, each kept if its own bit is set. */
__attribute__((target("avx2"))) static inline __m256i q5_high(const uint8_t *bits)
{
    int32_t word;
    memcpy(&word, bits, sizeof word);
    const __m256i spread = _mm256_set_epi8(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                           1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(word), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(16));
}

/* A pair's two blocks' codes (0..31), block b in `even` and b + 1 in `odd`. */
__attribute__((target("avx2"))) static inline void codes_q5_pair(const uint8_t *pair, __m256i *even, __m256i *odd)
{
    const __m256i low = _mm256_set1_epi8(15);
    __m256i nibbles = _mm256_loadu_si256((const __m256i *)pair);
    *even = _mm256_or_si256(_mm256_and_si256(nibbles, low), q5_high(pair + BLOCK));
    *odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low), q5_high(pair + BLOCK + 4));
}

/* Eight 32-bit sums of a Q5 block's products times its scale: byte pairs into 16 bits (<= 2 * 31 * 127), then
 * vpmaddwd by the scale. */
__attribute__((target("avx2"))) static inline __m256i q5_products_avx2(__m256i codes, const int8_t *p, int sc)
{
    __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)p));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16((int16_t)sc));
}

/* A super-block's offsets: its eight blocks' -dmin m_b, in floats (exact), times each activation row's e sum p. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q5_offsets(
    const uint16_t *wd, const uint8_t *mins, const float *s, int64_t b, int64_t blocks, int count, __m256 *offsets)
{
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mins + b))));
    m = _mm256_mul_ps(_mm256_set1_ps(-half_f16c(wd[2 * (b / SUPER) + 1])), m);
    for (int k = 0; k < count; k++)
        offsets[k] = _mm256_fmadd_ps(m, _mm256_loadu_ps(s + k * blocks + b), offsets[k]);
}

/* One Q5 row against `count` (1 to TILE) activation rows, as q6_avx2_body, and the offsets a super-block at a time,
 * as avx2_body's. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q5_avx2_body(
    const uint8_t *c, const uint16_t *wd, const uint8_t *sm, const int8_t *p, const float *e, const float *s,
    int64_t blocks, int64_t n, const int count, float *out)
{
    __m256 acc[TILE][2], offsets[TILE];
    for (int k = 0; k < count; k++)
        acc[k][0] = acc[k][1] = offsets[k] = _mm256_setzero_ps();
    float d = 0.0f;
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint8_t *pair = c + b / 2 * Q5_PAIR;
        if (b % SUPER == 0) {
            for (int64_t k = 0; k < SUPER / 2 * Q5_PAIR; k += 64)
                __builtin_prefetch(pair + AHEAD + k, 0, 3);
            d = half_f16c(wd[2 * (b / SUPER)]);
            q5_offsets(wd, sm + blocks, s, b, blocks, count, offsets);
        }
        __m256i codes[2];
        codes_q5_pair(pair, &codes[0], &codes[1]);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < count; k++) {
                __m256i sums = q5_products_avx2(codes[h], p + k * n + (b + h) * BLOCK, sm[b + h]);
                acc[k][h] = _mm256_fmadd_ps(_mm256_set1_ps(d * e[k * blocks + b + h]), _mm256_cvtepi32_ps(sums),
                                            acc[k][h]);
            }
    }
    for (int k = 0; k < count; k++)
        out[k] = sum8_ps(_mm256_add_ps(acc[k][0], acc[k][1])) + sum8_ps(offsets[k]);
}

/* The AVX-512 variant's Q5 rows: a pair of blocks in 512-bit registers, as q6_vnni_body; the fifth bits are a mask
 * register's 64 bits, one instruction makes them bytes of 16. The sums and the float steps are q5_avx2_body's, bit
 * for bit. */
__attribute__((target(VNNI_TARGETS), always_inline)) static inline void q5_vnni_body(
    const uint8_t *c, const uint16_t *wd, const uint8_t *sm, const int8_t *p, const float *e, const float *s,
    int64_t blocks, int64_t n, const int count, float *out)
{
    __m512 acc[TILE];
    __m256 offsets[TILE];
    for (int k = 0; k < count; k++) {
        acc[k] = _mm512_setzero_ps();
        offsets[k] = _mm256_setzero_ps();
    }
    __m512i wide = _mm512_setzero_si512();  /* the super-block's eight scales as 16-bit numbers */
    __m512 d = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint8_t *pair = c + b / 2 * Q5_PAIR;
        if (b % SUPER == 0) {
            for (int64_t k = 0; k < SUPER / 2 * Q5_PAIR; k += 64)
                __builtin_prefetch(pair + AHEAD + k, 0, 3);
            wide = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sm + b))));
            d = _mm512_set1_ps(half_f16c(wd[2 * (b / SUPER)]));
            q5_offsets(wd, sm + blocks, s, b, blocks, count, offsets);
        }
        uint64_t fifth;
        memcpy(&fifth, pair + BLOCK, sizeof fifth);
        __m256i nibbles = _mm256_loadu_si256((const __m256i *)pair);
        __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles), _mm256_srli_epi16(nibbles, 4), 1);
        __m512i high = _mm512_maskz_mov_epi8((__mmask64)fifth, _mm512_set1_epi8(16));
        codes = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi8(15), high, 0xea);  /* (codes & 15) | high */
        int j = (int)(b % SUPER);
        __m512i scales = _mm512_permutexvar_epi16(
            _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)j), _mm512_set1_epi16((short)(j + 1))),
            wide);
        for (int k = 0; k < count; k++) {
            __m512i x = _mm512_loadu_si512((const void *)(p + k * n + b * BLOCK));
            __m512i sums = _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), scales);
            acc[k] = _mm512_fmadd_ps(pair_scales(d, e + k * blocks + b), _mm512_cvtepi32_ps(sums), acc[k]);
        }
    }
    for (int k = 0; k < count; k++)
        out[k] = pair_total(acc[k]) + sum8_ps(offsets[k]);
}

BY_COUNT(q5_avx2, q5_avx2_body, "avx2,fma,f16c")
BY_COUNT(q5_vnni, q5_vnni_body, VNNI_TARGETS)

__attribute__((target("avx2"))) static int32_t block_sum_q5_avx2(const uint8_t *c, int64_t b, int sc,
                                                                 const int8_t *p)
{
    __m256i codes[2];
    codes_q5_pair(c + b / 2 * Q5_PAIR, &codes[0], &codes[1]);
    return sum8_epi32(q5_products_avx2(codes[b & 1], p, sc));
}
#endif

/* qkv_matmul for Q6 and Q5 weights: the rows split over the threads, TILE activation rows at a time. */
static void matmul_k(int format, int variant, const uint8_t *codes, const uint16_t *d, const uint8_t *m,
                     int64_t rows, int64_t n, const int8_t *xq, const float *xd, const float *xs, int64_t batch,
                     float *y)
{
    counted_dot dot = format == Q6 ? q6_portable : q5_portable;
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        dot = format == Q6 ? q6_vnni : q5_vnni;
    else if (variant == AVX2)
        dot = format == Q6 ? q6_avx2 : q5_avx2;
#else
    (void)variant;  /* one variant only */
#endif
    int64_t blocks = n / BLOCK, pair = format == Q6 ? Q6_PAIR : Q5_PAIR, halves = format == Q6 ? 1 : 2;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < batch; i += TILE) {  /* d: one fp16 (Q5: two) a super-block; m: two bytes a block */
            int count = batch - i < TILE ? (int)(batch - i) : TILE;
            float out[TILE];
            dot(codes + r * blocks / 2 * pair, d + r * halves * (blocks / SUPER), m + r * 2 * blocks, xq + i * n,
                xd + i * blocks, xs + i * blocks, blocks, n, count, out);
            for (int k = 0; k < count; k++)
                y[(i + k) * rows + r] = out[k];
        }
}

static void rows_portable(int format, const uint8_t *c, const uint16_t *wd, const uint16_t *wm, const int8_t *p,
                          const float *e, const float *s, int64_t blocks, int64_t n, int count, float *out)
{
    int64_t bytes = format == Q8 ? BLOCK : BLOCK / 2;
    for (int k = 0; k < count; k++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            int32_t sum = block_sum_portable(format, c + b * bytes, p + k * n + b * BLOCK);
            acc += half_portable(wd[b]) * e[k * blocks + b] * (float)sum;
            if (format == Q4)
                acc += half_portable(wm[b]) * s[k * blocks + b];
        }
        out[k] = acc;
    }
}

/* ---------------------------------------------------------------------------------------------------- the API */

/* The best variant this CPU runs. */
int qkv_best_variant(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return AVX512_VNNI;
    if (avx2)
        return AVX2;
#endif
    return PORTABLE;
}

/* Whether this CPU runs `variant`. */
int qkv_runs_variant(int variant)
{
    return variant >= PORTABLE && variant <= qkv_best_variant();
}

typedef void (*rows_dot)(int, const uint8_t *, const uint16_t *, const uint16_t *, const int8_t *, const float *,
                         const float *, int64_t, int64_t, int, float *);

static rows_dot variant_rows(int variant)
{
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        return rows_vnni;
    if (variant == AVX2)
        return rows_avx2;
#else
    (void)variant;  /* one variant only */
#endif
    return rows_portable;
}

/* A row's bytes of codes. */
static int64_t row_bytes(int format, int64_t n)
{
    return format == Q8 ? n : n / 2;
}

/* The Q4X8 dot product of a variant. */
static counted_dot x8_dot(int variant)
{
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        return x8_vnni;
    if (variant == AVX2)
        return x8_avx2;
#else
    (void)variant;  /* one variant only */
#endif
    return x8_portable;
}

/* qkv_matmul for Q4X8 weights: the groups of eight rows split over the threads; a last group of fewer rows (its
 * other lanes zeros) gives only its rows' outputs. */
static void matmul_x8(int variant, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t rows,
                      int64_t n, const int8_t *xq, const float *xd, const float *xs, int64_t batch, float *y)
{
    counted_dot dot = x8_dot(variant);
    int64_t blocks = n / BLOCK, groups = (rows + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int lanes = rows - g * GROUP < GROUP ? (int)(rows - g * GROUP) : GROUP;
        for (int64_t i = 0; i < batch; i += TILE) {
            int count = batch - i < TILE ? (int)(batch - i) : TILE;
            float out[TILE * GROUP];
            dot(codes + g * GROUP * (n / 2), d + g * GROUP * blocks, m + g * GROUP * blocks, xq + i * n,
                xd + i * blocks, xs + i * blocks, blocks, n, count, out);
            for (int k = 0; k < count; k++)
                memcpy(y + (i + k) * rows + g * GROUP, out + k * GROUP, sizeof(float) * (size_t)lanes);
        }
    }
}

/* y (batch, rows) = the product of `batch` quantized activation rows and the weights in `format` (m NULL for Q8,
 * Q6's int8 scales for Q6, Q5's scales and minimums for Q5); returns 0, or -1 for a variant this CPU does not run,
 * an unknown format or Q6 or Q5 weights whose rows are not whole super-blocks. */
int qkv_matmul(int format, int variant, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t rows,
               int64_t n, const int8_t *xq, const float *xd, const float *xs, int64_t batch, float *y)
{
    if (!qkv_runs_variant(variant) || format < Q4 || format > Q5 || (format >= Q6 && n % (SUPER * BLOCK)))
        return -1;
    if (format == Q6 || format == Q5) {
        matmul_k(format, variant, codes, d, (const uint8_t *)m, rows, n, xq, xd, xs, batch, y);
        return 0;
    }
    if (format == Q4X8) {
        matmul_x8(variant, codes, d, m, rows, n, xq, xd, xs, batch, y);
        return 0;
    }
    rows_dot dot = variant_rows(variant);
    int64_t blocks = n / BLOCK, stride = row_bytes(format, n);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < batch; i += TILE) {  /* TILE activation rows at a time: the codes unpacked once */
            int count = batch - i < TILE ? (int)(batch - i) : TILE;
            float out[TILE];
            dot(format, codes + r * stride, d + r * blocks, format == Q4 ? m + r * blocks : NULL, xq + i * n,
                xd + i * blocks, xs + i * blocks, blocks, n, count, out);
            for (int k = 0; k < count; k++)
                y[(i + k) * rows + r] = out[k];
        }
    return 0;
}

/* y (batch, rows) = x (batch, n) floats times the weights: the activations quantized here, then qkv_matmul;
 * returns 0, -1 as qkv_matmul does, -2 out of memory. */
int qkv_linear(int format, int variant, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t rows,
               int64_t n, const float *x, int64_t batch, float *y)
{
    int64_t blocks = batch * (n / BLOCK);
    int8_t *xq = malloc((size_t)(batch * n) + 2 * sizeof(float) * (size_t)blocks + 16);
    if (xq == NULL)
        return -2;
    float *xd = (float *)(((uintptr_t)(xq + batch * n) + 15) & ~(uintptr_t)15), *xs = xd + blocks;
    qkv_quantize_q8(x, batch, n, xq, xd, xs);
    int status = qkv_matmul(format, variant, codes, d, m, rows, n, xq, xd, xs, batch, y);
    free(xq);
    return status;
}

/* One block's 32 weights as floats: q d + m, a multiply and an add each rounded (the reference's order). */
static void widen_block_portable(const uint8_t *c, float d, float m, float *w)
{
    for (int i = 0; i < BLOCK / 2; i++) {
        w[i] = (float)(c[i] & 15) * d + m;
        w[i + BLOCK / 2] = (float)(c[i] >> 4) * d + m;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void widen_block_avx2(const uint8_t *c, float d, float m, float *w)
{
    __m256i codes = codes_q4(c);  /* inputs 0..31, a byte each */
    __m256 scale = _mm256_set1_ps(d), offset = _mm256_set1_ps(m);
    for (int k = 0; k < 4; k++) {
        __m128i bytes = k < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k % 2 ? _mm_srli_si128(bytes, 8) : bytes));
        _mm256_storeu_ps(w + 8 * k, _mm256_add_ps(_mm256_mul_ps(q, scale), offset));
    }
}
#endif

/* Where row `row`'s block b lies in Q4X8 weights of n inputs: its group's block (the row's 4 bytes of quad q at
 * 32 q + 4 (row % 8) in it) as an offset into the codes, and in `at` the index of its d and m. */
static int64_t x8_block(int64_t n, int64_t row, int64_t b, int64_t *at)
{
    int64_t g = row / GROUP, r = row % GROUP;
    *at = (g * (n / BLOCK) + b) * GROUP + r;
    return g * GROUP * (n / 2) + b * (GROUP * BLOCK / 2) + 4 * r;
}

/* A mixture of experts' products in one go: `count` activation rows (one row for all when `shared`), row j times
 * the Q4X8 weights `picked[j]` of a table of weights of one shape (`codes`, `d`, `m`: each weight's pointers, `rows`
 * rows of n inputs each): y (count, rows). The k experts of a decoding step then cost one parallel region and one
 * quantization of their common input, not k of each. Returns 0, -1 for a variant this CPU does not run, -2 out of
 * memory. */
int qkv_linear_x8_picked(int variant, const uint8_t *const *codes, const uint16_t *const *d,
                         const uint16_t *const *m, const int64_t *picked, int64_t count, int64_t rows, int64_t n,
                         const float *x, int shared, float *y)
{
    if (!qkv_runs_variant(variant))
        return -1;
    counted_dot dot = x8_dot(variant);
    int64_t inputs = shared ? 1 : count, blocks = n / BLOCK, groups = (rows + GROUP - 1) / GROUP;
    int8_t *xq = malloc((size_t)(inputs * n) + 2 * sizeof(float) * (size_t)(inputs * blocks) + 16);
    if (xq == NULL)
        return -2;
    float *xd = (float *)(((uintptr_t)(xq + inputs * n) + 15) & ~(uintptr_t)15), *xs = xd + inputs * blocks;
    qkv_quantize_q8(x, inputs, n, xq, xd, xs);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < count * groups; t++) {
        int64_t j = t / groups, g = t % groups, e = picked[j], i = shared ? 0 : j;
        int lanes = rows - g * GROUP < GROUP ? (int)(rows - g * GROUP) : GROUP;
        float out[TILE * GROUP];
        dot(codes[e] + g * GROUP * (n / 2), d[e] + g * GROUP * blocks, m[e] + g * GROUP * blocks, xq + i * n,
            xd + i * blocks, xs + i * blocks, blocks, n, 1, out);
        memcpy(y + j * rows + g * GROUP, out, sizeof(float) * (size_t)lanes);
    }
    free(xq);
    return 0;
}

/* Rows `start` to `start + count` of Q4X8 weights written from the Q4 layout: `pairs` (count, n / 2) the rows'
 * code bytes, `pd` and `pm` (count, n / 32) their fp16 scales and offsets. */
void qkv_q4x8_write_rows(uint8_t *codes, uint16_t *d, uint16_t *m, int64_t n, int64_t start, int64_t count,
                         const uint8_t *pairs, const uint16_t *pd, const uint16_t *pm)
{
    int64_t blocks = n / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *from = pairs + i * (n / 2) + b * (BLOCK / 2);
            int64_t at;
            uint8_t *to = codes + x8_block(n, start + i, b, &at);
            for (int q = 0; q < 4; q++)
                memcpy(to + 32 * q, from + 4 * q, 4);
            d[at] = pd[i * blocks + b];
            m[at] = pm[i * blocks + b];
        }
}

/* Rows `start` to `end` of Q4X8 weights as floats, out (end - start, n): q d + m, rounded as written (the reference
 * KernelInt4Linear._decoded computes the same). For many input rows at once: widened a tile at a time, then a float
 * matrix product, which beats taking the rows a few at a time. */
void qkv_q4x8_dequantize(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t n, int64_t start,
                         int64_t end, float *out)
{
    int64_t blocks = n / BLOCK;
    void (*widen)(const uint8_t *, float, float, float *) = widen_block_portable;
#if defined(__x86_64__)
    if (qkv_best_variant() >= AVX2)
        widen = widen_block_avx2;
#endif
#pragma omp parallel for schedule(static)
    for (int64_t row = start; row < end; row++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t at;
            const uint8_t *from = codes + x8_block(n, row, b, &at);
            uint8_t block[BLOCK / 2];
            for (int q = 0; q < 4; q++)
                memcpy(block + 4 * q, from + 32 * q, 4);
            widen(block, half_portable(d[at]), half_portable(m[at]), out + (row - start) * n + b * BLOCK);
        }
}

/* The activations as the kernel sees them, out (batch, n): each block's codes times its scale, p e. */
void qkv_q8_rounded(const float *x, int64_t batch, int64_t n, float *out)
{
    int64_t blocks = batch * (n / BLOCK);
    for (int64_t i = 0; i < blocks; i++) {
        const float *v = x + i * BLOCK;
        float inverse, scale = block_scale(v, &inverse);
        for (int j = 0; j < BLOCK; j++)
            out[i * BLOCK + j] = nearbyintf(v[j] * inverse) * scale;
    }
}

/* The integer sum of every (row, block): sums (rows, n / 32), for the tests (each variant must equal the portable
 * one and a reference in Python exactly); `sc` Q6's int8 scales (rows, n / 16), else unread. */
int qkv_block_sums(int format, int variant, const uint8_t *codes, const int8_t *sc, int64_t rows, int64_t n,
                   const int8_t *xq, int32_t *sums)
{
    if (!qkv_runs_variant(variant) || format == Q4X8 || format < Q4 || format > Q5)
        return -1;
    int64_t blocks = n / BLOCK, bytes = row_bytes(format, n) / blocks;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *p = xq + b * BLOCK;
            if (format == Q5) {  /* one product for both SIMD variants; sc the scales (rows, n / 32) */
                const uint8_t *row = codes + r * blocks / 2 * Q5_PAIR;
                int scale = (uint8_t)sc[r * blocks + b];
                sums[r * blocks + b] = block_sum_q5_portable(row, b, scale, p);
#if defined(__x86_64__)
                if (variant != PORTABLE)
                    sums[r * blocks + b] = block_sum_q5_avx2(row, b, scale, p);
#endif
                continue;
            }
            if (format == Q6) {  /* one product for both SIMD variants */
                const uint8_t *row = codes + r * blocks / 2 * Q6_PAIR;
                const int8_t *s = sc + 2 * (r * blocks + b);
                sums[r * blocks + b] = block_sum_q6_portable(row, b, s, p);
#if defined(__x86_64__)
                if (variant != PORTABLE)
                    sums[r * blocks + b] = block_sum_q6_avx2(row, b, s, p);
#endif
                continue;
            }
            const uint8_t *c = codes + (r * blocks + b) * bytes;
            int32_t sum = block_sum_portable(format, c, p);
#if defined(__x86_64__)
            if (variant == AVX2)
                sum = block_sum_avx2(format, c, p);
            else if (variant == AVX512_VNNI)
                sum = block_sum_vnni(format, c, p);
#endif
            sums[r * blocks + b] = sum;
        }
    return 0;
}
