/* qkv's int4 x int8 product: y = x W^T for weights of 4 bits and activations quantized to 8 bits, per block of 32.
 *
 * PyTorch's int4 kernel widens every 4-bit code to a float and multiplies in floats. Here, as llama.cpp does, the
 * activation row is first quantized to int8 per block of 32 inputs (one float scale each), and each block of a
 * weight row is multiplied by it in integers: 32 products of a 4-bit code and an 8-bit value summed exactly in
 * 32 bits, then one float multiply per block. With
 *
 *     w_j = d * q_j + m          (q_j in 0..15: the weight block's scale d and offset m, GGUF's Q4_1; qkv's
 *                                 Int4Linear keeps (q_j - 8) s + z in bfloat16, so d = s and m = z - 8 s)
 *     x_j ~ e * p_j              (p_j in -127..127: the activation block's scale e = max|x| / 127)
 *
 * a block contributes  sum_j w_j x_j ~ d e (sum_j q_j p_j) + m e (sum_j p_j),  the integer sum the only work per
 * input; e * sum_j p_j is computed once per activation block, for every row.
 *
 * Layouts (row-major, contiguous):
 *   codes   (rows, n / 2) bytes: for block b of a row, bytes 16 b .. 16 b + 15; byte i holds input 32 b + i in its low
 *           nibble and input 32 b + 16 + i in its high one (GGUF's Q4_0 and Q4_1 order)
 *   s, z    (rows, n / 32) bfloat16: each block's scale s and zero point z, w_j = (q_j - 8) s + z
 *   xq      (batch, n) int8, xd and xs (batch, n / 32) floats: the activations' codes, scales e, and e * sum_j p_j
 *   y       (batch, rows) floats
 *
 * Variants: portable C, AVX2 (vpmaddubsw: unsigned x signed bytes into 16-bit pairs, then vpmaddwd into 32 bits) and
 * AVX-512 VNNI (vpdpbusd: four byte products into 32 bits in one instruction), chosen by what the CPU reports. The
 * rows are split over OpenMP threads: the library is built with -fopenmp but not linked to an OpenMP runtime, so it
 * runs on the one PyTorch loaded (its threads, torch.get_num_threads()), never a second pool beside it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32

enum { PORTABLE = 0, AVX2 = 1, AVX512_VNNI = 2 };

int qkv_best_variant(void);

/* A bfloat16 (the top half of a float32's bits) as a float. */
static inline float bf16(uint16_t h)
{
    union {
        uint32_t bits;
        float value;
    } v = {(uint32_t)h << 16};
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

static int32_t block_sum_portable(const uint8_t *c, const int8_t *p)
{
    int32_t sum = 0;
    for (int i = 0; i < BLOCK / 2; i++)
        sum += (c[i] & 15) * p[i] + (c[i] >> 4) * p[i + BLOCK / 2];
    return sum;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* The 32 codes of a block as bytes 0..15, inputs 0..15 in the low 128 bits and 16..31 in the high ones. */
__attribute__((target("avx2"))) static inline __m256i codes_avx2(const uint8_t *c)
{
    __m128i packed = _mm_loadu_si128((const __m128i *)c);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* Eight 32-bit partial sums of a block's 32 products: its codes (as codes_avx2 gives them) times 32 activations. */
__attribute__((target("avx2"))) static inline __m256i products_avx2(__m256i codes, const int8_t *p)
{
    __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)p));  /* <= 2 * 15 * 127 */
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static inline __m256i products_vnni(__m256i codes,
                                                                                             const int8_t *p)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, _mm256_loadu_si256((const __m256i *)p));
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

/* One weight row against `count` (1 to TILE) activation rows, `n` apart: each block's codes unpacked once for all
 * of them; per activation row, the blocks' integer sums turned to floats and scaled by d e in eight lanes, then
 * m e sum p. A row's arithmetic is the same whatever `count` is, so a row in a batch gets what it gets alone. */
#define TILE 4
#define ROWS_DOT(name, products, targets)                                                                            \
    __attribute__((target(targets), always_inline)) static inline void name##_body(                                  \
        const uint8_t *c, const uint16_t *ws, const uint16_t *wz, const int8_t *p, const float *e, const float *s,   \
        int64_t blocks, int64_t n, const int count, float *out)                                                      \
    {                                                                                                                \
        __m256 acc[TILE];                                                                                            \
        float offsets[TILE];                                                                                         \
        for (int k = 0; k < count; k++) {                                                                           \
            acc[k] = _mm256_setzero_ps();                                                                            \
            offsets[k] = 0.0f;                                                                                       \
        }                                                                                                            \
        for (int64_t b = 0; b < blocks; b++) {                                                                       \
            float d = bf16(ws[b]), m = bf16(wz[b]) - 8.0f * d;                                                       \
            __m256i codes = codes_avx2(c + b * (BLOCK / 2));                                                         \
            for (int k = 0; k < count; k++) {                                                                        \
                __m256 sums = _mm256_cvtepi32_ps(products(codes, p + k * n + b * BLOCK));                            \
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * e[k * blocks + b]), sums, acc[k]);                       \
                offsets[k] += m * s[k * blocks + b];                                                                 \
            }                                                                                                        \
        }                                                                                                            \
        for (int k = 0; k < count; k++)                                                                              \
            out[k] = sum8_ps(acc[k]) + offsets[k];                                                                   \
    }                                                                                                                \
    /* the count a constant in each call below: the loops over rows unrolled, the sums kept in registers */          \
    __attribute__((target(targets))) static void name(const uint8_t *c, const uint16_t *ws, const uint16_t *wz,     \
                                                      const int8_t *p, const float *e, const float *s,               \
                                                      int64_t blocks, int64_t n, int count, float *out)              \
    {                                                                                                                \
        switch (count) {                                                                                             \
        case 1: name##_body(c, ws, wz, p, e, s, blocks, n, 1, out); break;                                           \
        case 2: name##_body(c, ws, wz, p, e, s, blocks, n, 2, out); break;                                           \
        case 3: name##_body(c, ws, wz, p, e, s, blocks, n, 3, out); break;                                           \
        default: name##_body(c, ws, wz, p, e, s, blocks, n, TILE, out);                                              \
        }                                                                                                            \
    }

ROWS_DOT(rows_avx2, products_avx2, "avx2,fma")
ROWS_DOT(rows_vnni, products_vnni, "avx2,fma,avx512f,avx512vl,avx512vnni")

__attribute__((target("avx2"))) static int32_t block_sum_avx2(const uint8_t *c, const int8_t *p)
{
    return sum8_epi32(products_avx2(codes_avx2(c), p));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static int32_t block_sum_vnni(const uint8_t *c,
                                                                                        const int8_t *p)
{
    return sum8_epi32(products_vnni(codes_avx2(c), p));
}
#endif

static void rows_portable(const uint8_t *c, const uint16_t *ws, const uint16_t *wz, const int8_t *p, const float *e,
                          const float *s, int64_t blocks, int64_t n, int count, float *out)
{
    for (int k = 0; k < count; k++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            float d = bf16(ws[b]), m = bf16(wz[b]) - 8.0f * d;
            int32_t sum = block_sum_portable(c + b * (BLOCK / 2), p + k * n + b * BLOCK);
            acc += d * e[k * blocks + b] * (float)sum + m * s[k * blocks + b];
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
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
        return AVX512_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return AVX2;
#endif
    return PORTABLE;
}

/* Whether this CPU runs `variant`. */
int qkv_runs_variant(int variant)
{
    return variant >= PORTABLE && variant <= qkv_best_variant();
}

typedef void (*rows_dot)(const uint8_t *, const uint16_t *, const uint16_t *, const int8_t *, const float *,
                         const float *, int64_t, int64_t, int, float *);

static rows_dot variant_rows(int variant)
{
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        return rows_vnni;
    if (variant == AVX2)
        return rows_avx2;
#endif
    return rows_portable;
}

/* y (batch, rows) = the product of `batch` quantized activation rows and the int4 weights; returns 0, or -1 for a
 * variant this CPU does not run. */
int qkv_q4_matmul(int variant, const uint8_t *codes, const uint16_t *s, const uint16_t *z, int64_t rows, int64_t n,
                  const int8_t *xq, const float *xd, const float *xs, int64_t batch, float *y)
{
    if (!qkv_runs_variant(variant))
        return -1;
    rows_dot dot = variant_rows(variant);
    int64_t blocks = n / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < batch; i += TILE) {  /* TILE activation rows at a time: the codes unpacked once */
            int count = batch - i < TILE ? (int)(batch - i) : TILE;
            float out[TILE];
            dot(codes + r * (n / 2), s + r * blocks, z + r * blocks, xq + i * n, xd + i * blocks, xs + i * blocks,
                blocks, n, count, out);
            for (int k = 0; k < count; k++)
                y[(i + k) * rows + r] = out[k];
        }
    return 0;
}

/* y (batch, rows) = x (batch, n) floats times the int4 weights: the activations quantized here, then
 * qkv_q4_matmul; returns 0, -1 for a variant this CPU does not run, -2 out of memory. */
int qkv_q4_linear(int variant, const uint8_t *codes, const uint16_t *s, const uint16_t *z, int64_t rows, int64_t n,
                  const float *x, int64_t batch, float *y)
{
    int64_t blocks = batch * (n / BLOCK);
    int8_t *xq = malloc((size_t)(batch * n) + 2 * sizeof(float) * (size_t)blocks + 16);
    if (xq == NULL)
        return -2;
    float *xd = (float *)(((uintptr_t)(xq + batch * n) + 15) & ~(uintptr_t)15), *xs = xd + blocks;
    qkv_quantize_q8(x, batch, n, xq, xd, xs);
    int status = qkv_q4_matmul(variant, codes, s, z, rows, n, xq, xd, xs, batch, y);
    free(xq);
    return status;
}

/* One block's 32 weights as floats: (q - 8) s + z, a multiply and an add each rounded (the reference's order). */
static void widen_block_portable(const uint8_t *c, float scale, float zero, float *w)
{
    for (int i = 0; i < BLOCK / 2; i++) {
        w[i] = ((float)(c[i] & 15) - 8.0f) * scale + zero;
        w[i + BLOCK / 2] = ((float)(c[i] >> 4) - 8.0f) * scale + zero;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void widen_block_avx2(const uint8_t *c, float scale, float zero, float *w)
{
    __m256i codes = codes_avx2(c);  /* inputs 0..31, a byte each */
    __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero), eight = _mm256_set1_ps(8.0f);
    for (int k = 0; k < 4; k++) {
        __m128i bytes = k < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k % 2 ? _mm_srli_si128(bytes, 8) : bytes));
        _mm256_storeu_ps(w + 8 * k, _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, eight), s), z));
    }
}
#endif

/* The weights of `rows` rows as floats, out (rows, n): (q - 8) s + z, rounded as written (the reference
 * Int4Linear._decoded computes the same). For many input rows at once: widened a tile at a time, then a float
 * matrix product, which beats taking the rows a few at a time. */
void qkv_q4_dequantize(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int64_t rows, int64_t n, float *out)
{
    int64_t blocks = n / BLOCK;
    void (*widen)(const uint8_t *, float, float, float *) = widen_block_portable;
#if defined(__x86_64__)
    if (qkv_best_variant() >= AVX2)
        widen = widen_block_avx2;
#endif
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++)
            widen(codes + r * (n / 2) + b * (BLOCK / 2), bf16(s[r * blocks + b]), bf16(z[r * blocks + b]),
                  out + r * n + b * BLOCK);
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
 * one and a reference in Python exactly). */
int qkv_q4_block_sums(int variant, const uint8_t *codes, int64_t rows, int64_t n, const int8_t *xq, int32_t *sums)
{
    if (!qkv_runs_variant(variant))
        return -1;
    int64_t blocks = n / BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *c = codes + r * (n / 2) + b * (BLOCK / 2);
            const int8_t *p = xq + b * BLOCK;
            int32_t sum = block_sum_portable(c, p);
#if defined(__x86_64__)
            if (variant == AVX2)
                sum = block_sum_avx2(c, p);
            else if (variant == AVX512_VNNI)
                sum = block_sum_vnni(c, p);
#endif
            sums[r * blocks + b] = sum;
        }
    return 0;
}
