/* The float32 product of a decoding step: y = x W^T (+ b) for a few input rows, split over threads.
 *
 * PyTorch hands a product of one or a few rows to its BLAS's matrix-vector routine, which runs on one thread: on a
 * CPU of a few cores that leaves most of the memory bandwidth unused, and reading the weights is all a decoding step's
 * product does. Here the output rows are split over PyTorch's OpenMP threads, each weight row read once for every
 * input row. Sums are accumulated in another order than PyTorch's (16 or 8 partial sums, then added up): the results
 * agree to float rounding. The portable variant adds in the order written; AVX2 and AVX-512 use fused multiply-adds.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

enum { TILE = 4 };  /* input rows a weight row is read for at once */

static void rows_portable(const float *x, int64_t count, int64_t n, const float *w, float *sums)
{
    for (int64_t r = 0; r < count; r++) {
        float part[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++)
                part[j] += x[r * n + i + j] * w[i + j];
        float total = 0.0f;
        for (int j = 0; j < 8; j++)
            total += part[j];
        for (; i < n; i++)
            total += x[r * n + i] * w[i];
        sums[r] = total;
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static void rows_avx2(const float *x, int64_t count, int64_t n, const float *w,
                                                          float *sums)
{
    __m256 acc[TILE];
    for (int64_t r = 0; r < count; r++)
        acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 wv = _mm256_loadu_ps(w + i);
        for (int64_t r = 0; r < count; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * n + i), wv, acc[r]);
    }
    for (int64_t r = 0; r < count; r++) {
        __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        half = _mm_add_ps(half, _mm_movehl_ps(half, half));
        half = _mm_add_ss(half, _mm_movehdup_ps(half));
        float total = _mm_cvtss_f32(half);
        for (int64_t k = i; k < n; k++)
            total += x[r * n + k] * w[k];
        sums[r] = total;
    }
}

__attribute__((target("avx512f"))) static void rows_avx512(const float *x, int64_t count, int64_t n, const float *w,
                                                           float *sums)
{
    __m512 acc[TILE];
    for (int64_t r = 0; r < count; r++)
        acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 wv = _mm512_loadu_ps(w + i);
        for (int64_t r = 0; r < count; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * n + i), wv, acc[r]);
    }
    for (int64_t r = 0; r < count; r++) {
        float total = _mm512_reduce_add_ps(acc[r]);
        for (int64_t k = i; k < n; k++)
            total += x[r * n + k] * w[k];
        sums[r] = total;
    }
}
#endif

typedef void (*rows_fn)(const float *, int64_t, int64_t, const float *, float *);

static rows_fn rows_of(int variant)
{
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        return rows_avx512;
    if (variant == AVX2)
        return rows_avx2;
#else
    (void)variant;
#endif
    return rows_portable;
}

/* y (rows, m) = x (rows, n) W^T with W (m, n) row-major, plus bias (m) unless NULL. Returns 0, or -1 for a variant
 * this CPU does not run. */
int qkv_linear_f32(int variant, const float *x, int64_t rows, int64_t n, const float *w, const float *bias, int64_t m,
                   float *y)
{
    if (!qkv_runs_variant(variant))
        return -1;
    rows_fn dot = rows_of(variant);
#pragma omp parallel for schedule(static) if (m * n > (1 << 15))
    for (int64_t o = 0; o < m; o++) {
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int64_t count = rows - r0 < TILE ? rows - r0 : TILE;
            float sums[TILE];
            dot(x + r0 * n, count, n, w + o * n, sums);
            for (int64_t r = 0; r < count; r++)
                y[(r0 + r) * m + o] = bias == NULL ? sums[r] : sums[r] + bias[o];
        }
    }
    return 0;
}
