/* qkv's fused operations: what a decoding step does between its products, one call each instead of several of
 * PyTorch's small operations (each of which costs microseconds of dispatch on a vector of a few hundred numbers).
 * The Python modules stay the reference (qkv.nn.norm.RMSNorm, qkv.nn.feedforward.StackedFeedForward,
 * qkv.nn.attention.StackedSelfAttention); these do the same arithmetic, and the tests hold them to it:
 *
 *   qkv_rms_norm          x <- x + add (in place, if an addition is given);  out = (x * 1/sqrt(mean(x^2) + eps)) * g
 *   qkv_gated             out = act(gate) * up, for rows [gate | up]: act SiLU, x / (1 + e^-x), or GELU's tanh form
 *   qkv_decode_attention  one new token a row: its query and key turned by rotary positions, its key and value
 *                         written into the KV cache, and the query's attention over the row's cached positions
 *                         (grouped key/value heads, an optional sliding window), softmax(q k^T * scale) v
 *
 * The norm and the activation run on the calling thread (a fork and join of threads costs more than a row of a few
 * hundred numbers); attention splits its rows and heads over PyTorch's OpenMP threads when there is enough of it.
 * Built with -ffp-contract=off, so that a product and a sum are each rounded as PyTorch rounds them: the rotary
 * turn is bit for bit PyTorch's; sums (the norm's mean, attention's dot products and softmax) are accumulated in
 * another order and agree to float rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* -------------------------------------------------------------------------------------------------- RMSNorm */

void qkv_rms_norm(float *x, const float *add, const float *gains, float eps, int64_t rows, int64_t n, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        float *v = x + r * n;
        if (add != NULL)
            for (int64_t i = 0; i < n; i++)
                v[i] += add[r * n + i];
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

/* ---------------------------------------------------------------------------------------- gated activations */

enum { SILU = 0, GELU_TANH = 1 };

static float activation(float g, int act)
{
    if (act == SILU)
        return g / (1.0f + expf(-g));
    /* 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) */
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

void qkv_gated(const float *gate_up, int64_t rows, int64_t d, int act, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * d, *up = gate + d;
        for (int64_t i = 0; i < d; i++)
            out[r * d + i] = activation(gate[i], act) * up[i];
    }
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

#define LANES 16  /* partial sums of a dot product: independent, so the compiler keeps them in vector registers */

/* q . k over n numbers: LANES partial sums (element i into sum i mod LANES), then those summed in order. */
static float dot(const float *q, const float *k, int64_t n)
{
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += q[i + j] * k[i + j];
    for (; i < n; i++)
        part[i % LANES] += q[i] * k[i];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++)
        s += part[j];
    return s;
}

/* One query head's attention over keys and values [first, last] of its row's cache (each `dim` long):
 * out = sum_t softmax_t(q k_t * scale) v_t. */
static void attend(const float *q, const float *keys, const float *values, int64_t first, int64_t last, int64_t dim,
                   float scale, float *scores, float *out)
{
    float top = -INFINITY;
    for (int64_t t = first; t <= last; t++) {
        scores[t - first] = dot(q, keys + t * dim, dim) * scale;
        top = fmaxf(top, scores[t - first]);
    }
    float total = 0.0f;
    for (int64_t t = first; t <= last; t++) {
        scores[t - first] = expf(scores[t - first] - top);
        total += scores[t - first];
    }
    for (int64_t i = 0; i < dim; i++)
        out[i] = 0.0f;
    for (int64_t t = first; t <= last; t++) {
        const float *v = values + t * dim;
        float p = scores[t - first] / total;
        for (int64_t i = 0; i < dim; i++)
            out[i] += p * v[i];
    }
}

/* A decoding step's attention for `batch` rows of one new token each:
 *   qkv      (batch, (heads + 2 kv_heads) dim): the stacked projection's output, queries, keys, values
 *   cos, sin the rotary tables of the new positions, `table` floats a row apart (0: one for every row); NULL: none
 *   keys, values  the cache: `room` positions of `dim` numbers for each row and key/value head, a row `row_stride`
 *            floats apart and a head `head_stride` (a contiguous (batch, kv_heads, room, dim) cache: kv_heads room dim
 *            and room dim); position `length` is written, positions starts[b] (0 when starts is NULL) to `length`
 *            are read, at most the last `window` of them (0: all)
 *   out      (batch, heads dim): each head's output, heads side by side
 * Query head h reads key/value head h / (heads / kv_heads); `scratch` (batch heads, room) floats holds the scores.
 * Returns 0, or -1 for a cache with no room for the new position, heads that kv_heads do not divide, or a start
 * past the new position. */
int qkv_decode_attention(const float *qkv, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                         const float *cos, const float *sin, int64_t table, int64_t rotary, int interleaved,
                         float *keys, float *values, int64_t room, int64_t row_stride, int64_t head_stride,
                         int64_t length, const int64_t *starts, int64_t window, float scale, float *scratch,
                         float *out)
{
    if (length >= room || heads % kv_heads)
        return -1;
    int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    for (int64_t b = 0; b < batch; b++) {  /* the new keys turned, and they and the values written: cheap, here */
        const float *row = qkv + b * width;
        const float *c = cos == NULL ? NULL : cos + b * table, *s = sin == NULL ? NULL : sin + b * table;
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t at = b * row_stride + g * head_stride + length * dim;
            turn(row + (heads + g) * dim, dim, c, s, rotary, interleaved, keys + at);
            const float *v = row + (heads + kv_heads + g) * dim;
            for (int64_t i = 0; i < dim; i++)
                values[at + i] = v[i];
        }
        if (starts != NULL && starts[b] > length)
            return -1;
    }
    int64_t work = batch * heads * (length + 1) * dim;
#pragma omp parallel for schedule(static) if (work > (1 << 17))
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        int64_t b = bh / heads, h = bh % heads, g = h / group;
        const float *c = cos == NULL ? NULL : cos + b * table, *s = sin == NULL ? NULL : sin + b * table;
        float q[dim];
        turn(qkv + b * width + h * dim, dim, c, s, rotary, interleaved, q);
        int64_t first = starts == NULL ? 0 : starts[b];
        if (window > 0 && length - window + 1 > first)
            first = length - window + 1;
        int64_t at = b * row_stride + g * head_stride;
        attend(q, keys + at, values + at, first, length, dim, scale, scratch + bh * room,
               out + b * heads * dim + h * dim);
    }
    return 0;
}
