/* qkv's fused operations: what a decoding step does between its products, one call each instead of several of
 * PyTorch's small operations (each of which costs microseconds of dispatch on a vector of a few hundred numbers);
 * and training's GELU, whose tanh PyTorch computes a call per number.
 * The Python modules stay the reference (qkv.nn.norm.RMSNorm, qkv.nn.feedforward.StackedFeedForward,
 * qkv.nn.attention.StackedSelfAttention); these do the same arithmetic, and the tests hold them to it:
 *
 *   qkv_rms_norm          out = (x * 1/sqrt(mean(x^2) + eps)) * g, of x, or of sum = x + add (the residual stream
 *                         summed, then normed: one pass for what decoding does between two sub-layers)
 *   qkv_gated             out = act(gate) * up, for rows [gate | up]: act SiLU, x / (1 + e^-x), or GELU's tanh form
 *   qkv_gelu_tanh         training's GELU (tanh form) and its gradient, over whole activation tensors
 *   qkv_new_token_attention  a few new tokens a row (one, when decoding): their queries and keys turned by rotary
 *                         positions, their keys and values written into the KV cache, and each query's attention over
 *                         the row's cached positions up to its own (grouped key/value heads, an optional sliding
 *                         window), softmax(q k^T * scale) v
 *
 * The norm and the activation run on the calling thread (a fork and join of threads costs more than a row of a few
 * hundred numbers); attention splits its rows and heads over PyTorch's OpenMP threads when there is enough of it.
 * The activation and attention's loops over the cache come in the variants of kernels.h (portable, AVX2, AVX-512),
 * the caller naming one. Built with -ffp-contract=off, so that a product and a sum are each rounded as PyTorch
 * rounds them: the rotary turn and the residual sum are bit for bit PyTorch's; sums (the norm's mean, attention's
 * dot products, the softmax) are accumulated in another order, and the vector variants' exponential is a
 * polynomial within 2 ulps of expf: they agree to float rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* -------------------------------------------------------------------------------------------------- RMSNorm */

void qkv_rms_norm(const float *x, const float *add, const float *gains, float eps, int64_t rows, int64_t n,
                  float *sum, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        if (add != NULL) {  /* the residual stream's sum, which the norm then reads */
            for (int64_t i = 0; i < n; i++)
                sum[r * n + i] = v[i] + add[r * n + i];
            v = sum + r * n;
        }
        double part[8] = {0};  /* in double: the mean of a few thousand squares, rounded once; 8 partial sums */
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++)
                part[j] += (double)v[i + j] * (double)v[i + j];
        for (; i < n; i++)
            part[i % 8] += (double)v[i] * (double)v[i];
        double squares = 0.0;
        for (int j = 0; j < 8; j++)
            squares += part[j];
        float inverse = 1.0f / sqrtf((float)(squares / (double)n) + eps);
        for (i = 0; i < n; i++)
            out[r * n + i] = (v[i] * inverse) * gains[i];
    }
}

/* ------------------------------------------------------------------------------------------- exponentials */

/* e^x within 2 units in the last place of expf, in arithmetic the compiler keeps in registers (expf is a call per
 * number): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its series to r^7 (Cephes' expf coefficients), times 2^n
 * built in the exponent bits; x kept within [-87, 88] (e^-87 ~ 1.6e-38, a float's smallest normal order: below
 * it, as good as 0; e^88 near a float's largest). The same steps on one number, eight (AVX2) and sixteen
 * (AVX-512). */
static inline __attribute__((always_inline)) float exp_clamped(float x)
{
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;  /* ln 2 in two parts: r exact to a float's rounding */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } two = {.bits = ((int32_t)n + 127) << 23};
    return p * two.value;
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                             _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i two = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two));
}

__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_floor_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                             _mm512_set1_ps(0.5f)));
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                             _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i two = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two));
}

#endif

/* ---------------------------------------------------------------------------------------- gated activations */

enum { SILU = 0, GELU_TANH = 1 };

/* act(g): SiLU g / (1 + e^-g), or GELU's tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))). The portable
 * variant with expf and tanhf; the vector ones with exp8 / exp16, tanh(u) = 1 - 2 / (1 + e^2u). */
static float activation(float g, int act)
{
    if (act == SILU)
        return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

static void gated_portable(const float *gate, const float *up, int64_t d, int act, float *out)
{
    for (int64_t i = 0; i < d; i++)
        out[i] = activation(gate[i], act) * up[i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline __m256 activation8(__m256 g, int act)
{
    __m256 one = _mm256_set1_ps(1.0f);
    if (act == SILU)
        return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_add_ps(g, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g),
                                                            _mm256_mul_ps(g, g))));
    __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                _mm256_add_ps(one, exp8(_mm256_add_ps(u, u)))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

__attribute__((target("avx2,fma"))) static void gated_avx2(const float *gate, const float *up, int64_t d, int act,
                                                           float *out)
{
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(activation8(_mm256_loadu_ps(gate + i), act),
                                                _mm256_loadu_ps(up + i)));
    gated_portable(gate + i, up + i, d - i, act, out + i);
}

__attribute__((target("avx512f"))) static inline __m512 activation16(__m512 g, int act)
{
    __m512 one = _mm512_set1_ps(1.0f);
    if (act == SILU)
        return _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_add_ps(g, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g),
                                                            _mm512_mul_ps(g, g))));
    __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                _mm512_add_ps(one, exp16(_mm512_add_ps(u, u)))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
}

__attribute__((target("avx512f"))) static void gated_avx512(const float *gate, const float *up, int64_t d, int act,
                                                            float *out)
{
    for (int64_t i = 0; i < d; i += 16) {
        __mmask16 m = d - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(activation16(g, act), _mm512_maskz_loadu_ps(m, up + i)));
    }
}
#endif

/* out (rows, d) = act(gate) * up for rows [gate | up] (2 d floats each), in `variant`'s instruction set; returns 0,
 * or -1 for a variant this CPU does not run. */
int qkv_gated(int variant, const float *gate_up, int64_t rows, int64_t d, int act, float *out)
{
    if (!qkv_runs_variant(variant))
        return -1;
    void (*run)(const float *, const float *, int64_t, int, float *) = gated_portable;
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        run = gated_avx512;
    else if (variant == AVX2)
        run = gated_avx2;
#endif
    for (int64_t r = 0; r < rows; r++)
        run(gate_up + r * 2 * d, gate_up + r * 2 * d + d, d, act, out + r * d);
    return 0;
}

/* ------------------------------------------------------------------------------------------ GELU's tanh form */

/* Training's GELU (GPT-2's tanh form), forward and backward, elementwise over a whole activation tensor: PyTorch's
 * own computes tanh with a call per number, twice as slow as its exact GELU on the CPUs measured. With
 * u = k (x + c x^3), t = tanh(u), k = sqrt(2/pi), c = 0.044715:
 *   forward   y = 0.5 x (1 + t)
 *   backward  dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2))   (PyTorch's formula, its order of terms)
 * tanh as 1 - 2 / (1 + e^2u), e^ as exp_clamped / exp8 / exp16 (within 2 ulps of expf). */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

static void gelu_tanh_portable(const float *x, const float *dy, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i], t = 1.0f - 2.0f / (1.0f + exp_clamped(2.0f * (GELU_K * (v + GELU_C * v * v * v))));
        if (dy == NULL)
            out[i] = 0.5f * v * (1.0f + t);
        else
            out[i] = dy[i] * (0.5f * (1.0f + t) +
                              0.5f * v * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * v * v));
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void gelu_tanh_avx2(const float *x, const float *dy, int64_t n, float *out)
{
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), k = _mm256_set1_ps(GELU_K);
    const __m256 c = _mm256_set1_ps(GELU_C), c3 = _mm256_set1_ps(3.0f * GELU_C), two = _mm256_set1_ps(2.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i), v2 = _mm256_mul_ps(v, v);
        __m256 u = _mm256_mul_ps(k, _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(c, v), v2)));
        __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, exp8(_mm256_add_ps(u, u)))));
        __m256 r;
        if (dy == NULL) {
            r = _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, t));
        } else {
            __m256 left = _mm256_mul_ps(half, _mm256_add_ps(one, t));
            __m256 slope = _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_sub_ps(one, _mm256_mul_ps(t, t)));
            __m256 right = _mm256_mul_ps(slope, _mm256_mul_ps(k, _mm256_add_ps(one, _mm256_mul_ps(c3, v2))));
            r = _mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_add_ps(left, right));
        }
        _mm256_storeu_ps(out + i, r);
    }
    gelu_tanh_portable(x + i, dy == NULL ? NULL : dy + i, n - i, out + i);
}

__attribute__((target("avx512f"))) static void gelu_tanh_avx512(const float *x, const float *dy, int64_t n,
                                                                float *out)
{
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), k = _mm512_set1_ps(GELU_K);
    const __m512 c = _mm512_set1_ps(GELU_C), c3 = _mm512_set1_ps(3.0f * GELU_C), two = _mm512_set1_ps(2.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i), v2 = _mm512_mul_ps(v, v);
        __m512 u = _mm512_mul_ps(k, _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(c, v), v2)));
        __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, exp16(_mm512_add_ps(u, u)))));
        __m512 r;
        if (dy == NULL) {
            r = _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, t));
        } else {
            __m512 left = _mm512_mul_ps(half, _mm512_add_ps(one, t));
            __m512 slope = _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_sub_ps(one, _mm512_mul_ps(t, t)));
            __m512 right = _mm512_mul_ps(slope, _mm512_mul_ps(k, _mm512_add_ps(one, _mm512_mul_ps(c3, v2))));
            r = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + i), _mm512_add_ps(left, right));
        }
        _mm512_mask_storeu_ps(out + i, m, r);
    }
}
#endif

/* out = GELU_tanh(x) (dy NULL) or dy * GELU_tanh'(x), n numbers, split over PyTorch's threads in chunks of 16K;
 * returns 0, or -1 for a variant this CPU does not run. */
int qkv_gelu_tanh(int variant, const float *x, const float *dy, int64_t n, float *out)
{
    if (!qkv_runs_variant(variant))
        return -1;
    void (*run)(const float *, const float *, int64_t, float *) = gelu_tanh_portable;
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        run = gelu_tanh_avx512;
    else if (variant == AVX2)
        run = gelu_tanh_avx2;
#endif
    const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n > 4 * chunk)
    for (int64_t start = 0; start < n; start += chunk) {
        int64_t count = n - start < chunk ? n - start : chunk;
        run(x + start, dy == NULL ? NULL : dy + start, count, out + start);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- decoding attention */

/* Rotary positions on one head's `dim` numbers (the first `rotary` turned, the rest as they are), into `out`:
 * "rotate half" (pairs i and i + rotary/2): out_i = x_i cos_i + x_{(i + rotary/2) mod rotary} sin_i with cos and
 * sin `rotary` long ((cos, cos) and (-sin, sin), as qkv.nn.position lays them out); interleaved (pairs 2i, 2i + 1):
 * out_2i = a cos_i - b sin_i, out_2i+1 = a sin_i + b cos_i with cos and sin rotary/2 long. No table: a copy. */
static void turn(const float *x, int64_t dim, const float *cos, const float *sin, int64_t rotary, int interleaved,
                 float *out)
{
    int64_t i = 0;
    if (cos != NULL && interleaved) {
        for (; i < rotary / 2; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            out[2 * i] = a * cos[i] - b * sin[i];
            out[2 * i + 1] = a * sin[i] + b * cos[i];
        }
        i = rotary;
    } else if (cos != NULL) {
        int64_t half = rotary / 2;
        for (; i < rotary; i++)
            out[i] = x[i] * cos[i] + x[(i + half) % rotary] * sin[i];
    }
    for (; i < dim; i++)
        out[i] = x[i];
}

/* The two loops of attention that read the cache, in each variant:
 *   dot           q . k over n numbers (a query and a key)
 *   weighted_sum  out = sum_t p_t v_t over `count` values of n numbers each, `n` apart
 * The portable ones sum in a fixed order of LANES partial sums; the vector ones in their registers' lanes (with
 * FMA): equal to float rounding, as any two orders of a sum are. */
#define LANES 16

static float dot_portable(const float *q, const float *k, int64_t n)
{
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += q[i + j] * k[i + j];
    for (; i < n; i++)
        part[i % LANES] += q[i] * k[i];
    for (int w = LANES / 2; w > 0; w /= 2)  /* the partial sums added pairwise */
        for (int j = 0; j < w; j++)
            part[j] += part[j + w];
    return part[0];
}

static void weighted_sum_portable(const float *p, const float *values, int64_t count, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = 0.0f;
    for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < n; i++)
            out[i] += p[t] * values[t * n + i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static float dot_avx2(const float *q, const float *k, int64_t n)
{
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), b);
    }
    a = _mm256_add_ps(a, b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++)
        total += q[i] * k[i];
    return total;
}

__attribute__((target("avx2,fma"))) static void weighted_sum_avx2(const float *p, const float *values, int64_t count,
                                                                   int64_t n, float *out)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {  /* eight of the output's numbers in a register, over every value */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < count; t++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(values + t * n + i), acc);
        _mm256_storeu_ps(out + i, acc);
    }
    for (; i < n; i++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < count; t++)
            acc += p[t] * values[t * n + i];
        out[i] = acc;
    }
}

__attribute__((target("avx512f"))) static float dot_avx512(const float *q, const float *k, int64_t n)
{
    __m512 a = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
    if (i < n) {  /* the last numbers, masked */
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), _mm512_maskz_loadu_ps(m, k + i), a);
    }
    return _mm512_reduce_add_ps(a);
}

__attribute__((target("avx512f"))) static void weighted_sum_avx512(const float *p, const float *values,
                                                                   int64_t count, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i += 16) {  /* sixteen of the output's numbers in a register, over every value */
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t t = 0; t < count; t++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_maskz_loadu_ps(m, values + t * n + i), acc);
        _mm512_mask_storeu_ps(out + i, m, acc);
    }
}
#endif

typedef float (*dot_fn)(const float *, const float *, int64_t);
typedef void (*weighted_sum_fn)(const float *, const float *, int64_t, int64_t, float *);

/* softmax over `count` scores in place: e^(s - max) / sum; the vector variants take the exponentials eight or
 * sixteen at a time (exp8, exp16). */
static float largest(const float *scores, int64_t count)
{
    float top = -INFINITY;
    for (int64_t t = 0; t < count; t++)
        top = scores[t] > top ? scores[t] : top;
    return top;
}

static void normalize(float *scores, int64_t count)
{
    float total = 0.0f;
    for (int64_t t = 0; t < count; t++)
        total += scores[t];
    float inverse = 1.0f / total;
    for (int64_t t = 0; t < count; t++)
        scores[t] *= inverse;
}

static void softmax_portable(float *scores, int64_t count)
{
    float top = largest(scores, count);
    for (int64_t t = 0; t < count; t++)
        scores[t] = exp_clamped(scores[t] - top);
    normalize(scores, count);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void softmax_avx2(float *scores, int64_t count)
{
    __m256 top = _mm256_set1_ps(largest(scores, count));
    int64_t t = 0;
    for (; t + 8 <= count; t += 8)
        _mm256_storeu_ps(scores + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), top)));
    for (; t < count; t++)
        scores[t] = exp_clamped(scores[t] - _mm256_cvtss_f32(top));
    normalize(scores, count);
}

__attribute__((target("avx512f"))) static void softmax_avx512(float *scores, int64_t count)
{
    __m512 top = _mm512_set1_ps(largest(scores, count));
    for (int64_t t = 0; t < count; t += 16) {
        __mmask16 m = count - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), top));
        _mm512_mask_storeu_ps(scores + t, m, e);
    }
    normalize(scores, count);
}
#endif

typedef void (*softmax_fn)(float *, int64_t);

/* The loops of one variant. */
typedef struct {
    dot_fn dot;
    weighted_sum_fn weighted_sum;
    softmax_fn softmax;
} attention_loops;

static attention_loops loops_of(int variant)
{
#if defined(__x86_64__)
    if (variant == AVX512_VNNI)
        return (attention_loops){dot_avx512, weighted_sum_avx512, softmax_avx512};
    if (variant == AVX2)
        return (attention_loops){dot_avx2, weighted_sum_avx2, softmax_avx2};
#else
    (void)variant;
#endif
    return (attention_loops){dot_portable, weighted_sum_portable, softmax_portable};
}

/* One query head's attention over keys and values [first, last] of its row's cache (each `dim` long):
 * out = sum_t softmax_t(q k_t * scale) v_t. */
static void attend(const float *q, const float *keys, const float *values, int64_t first, int64_t last, int64_t dim,
                   float scale, const attention_loops *run, float *scores, float *out)
{
    int64_t count = last - first + 1;
    for (int64_t t = 0; t < count; t++)
        scores[t] = run->dot(q, keys + (first + t) * dim, dim) * scale;
    run->softmax(scores, count);
    run->weighted_sum(scores, values + first * dim, count, dim, out);
}

/* A decoding step's attention for `batch` rows of `tokens` new tokens each (one; or a few: speculative decoding's
 * drafts, each computed exactly as it would be alone, one step after the other):
 *   qkv      (batch, tokens, (heads + 2 kv_heads) dim): the stacked projection's output, queries, keys, values
 *   cos, sin the rotary tables of the new positions, `table` floats a row apart (0: one for every row) and
 *            `token_table` a token apart; NULL: none
 *   keys, values  the cache: `room` positions of `dim` numbers for each row and key/value head, a row `row_stride`
 *            floats apart and a head `head_stride` (a contiguous (batch, kv_heads, room, dim) cache: kv_heads room dim
 *            and room dim); positions `length` to `length + tokens - 1` are written, and new token j reads positions
 *            starts[b] (0 when starts is NULL) to `length + j`, at most the last `window` of them (0: all)
 *   out      (batch, tokens, heads dim): each head's output, heads side by side
 * Query head h reads key/value head h / (heads / kv_heads); `scratch` (batch tokens heads, room) floats holds the
 * scores. `variant`: the instruction set its loops over the cache run in (kernels.h). Returns 0, or -1 for a cache
 * with no room for the new positions, heads that kv_heads do not divide, a variant this CPU does not run, or a start
 * past the first new position. */
int qkv_new_token_attention(int variant, const float *qkv, int64_t batch, int64_t tokens, int64_t heads,
                            int64_t kv_heads, int64_t dim, const float *cos, const float *sin, int64_t table,
                            int64_t token_table, int64_t rotary, int interleaved, float *keys, float *values,
                            int64_t room, int64_t row_stride, int64_t head_stride, int64_t length,
                            const int64_t *starts, int64_t window, float scale, float *scratch, float *out)
{
    if (tokens < 1 || length + tokens > room || heads % kv_heads || !qkv_runs_variant(variant))
        return -1;
    for (int64_t b = 0; starts != NULL && b < batch; b++)  /* refused before anything is written */
        if (starts[b] > length)
            return -1;
    attention_loops run = loops_of(variant);
    int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    for (int64_t bj = 0; bj < batch * tokens; bj++) {  /* the new keys turned, and they and the values written */
        int64_t b = bj / tokens, j = bj % tokens;
        const float *row = qkv + bj * width;
        const float *c = cos == NULL ? NULL : cos + b * table + j * token_table;
        const float *s = sin == NULL ? NULL : sin + b * table + j * token_table;
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t at = b * row_stride + g * head_stride + (length + j) * dim;
            turn(row + (heads + g) * dim, dim, c, s, rotary, interleaved, keys + at);
            const float *v = row + (heads + kv_heads + g) * dim;
            for (int64_t i = 0; i < dim; i++)
                values[at + i] = v[i];
        }
    }
    int64_t work = batch * tokens * heads * (length + tokens) * dim;
#pragma omp parallel for schedule(static) if (work > (1 << 14))
    for (int64_t bjh = 0; bjh < batch * tokens * heads; bjh++) {
        int64_t bj = bjh / heads, h = bjh % heads, g = h / group;
        int64_t b = bj / tokens, j = bj % tokens, last = length + j;
        const float *c = cos == NULL ? NULL : cos + b * table + j * token_table;
        const float *s = sin == NULL ? NULL : sin + b * table + j * token_table;
        float q[dim];
        turn(qkv + bj * width + h * dim, dim, c, s, rotary, interleaved, q);
        int64_t first = starts == NULL ? 0 : starts[b];
        if (window > 0 && last - window + 1 > first)
            first = last - window + 1;
        int64_t at = b * row_stride + g * head_stride;
        attend(q, keys + at, values + at, first, last, dim, scale, &run, scratch + bjh * room,
               out + bj * heads * dim + h * dim);
    }
    return 0;
}
