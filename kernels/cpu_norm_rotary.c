/* A layer's small element-wise ops on the CPU in bfloat16, each one call instead of a chain of torch ops: the
 * residual add with RMSNorm, the rotary embedding of query and key, and the gated MLP's SiLU(gate) * up. Every
 * value is rounded to bfloat16 where the torch code it replaces rounds (engine/layers/norm.py's and rotary.py's
 * torch paths, F.silu(gate).mul_(up)), so the results match theirs except for the float32 sum order inside the
 * norm's mean and SiLU's exp (2e-7 relative against libm's, before the rounding to bfloat16).
 *
 * Shapes (row-major):
 *   add_rms_norm: hidden, residual, normed, summed [rows, size] contiguous; weight [size]; residual and summed
 *                 may be NULL (no residual: the norm of hidden itself)
 *   rotary:       x [tokens, heads, head_dim] with row stride x_stride (heads and dims contiguous, as q and k
 *                 split from one projection); cos_sin [tokens, head_dim]: cos | sin; out [tokens, heads, head_dim]
 *   silu_mul:     gate_up [rows, 2 * size] contiguous (gate | up, as one projection gives them); out [rows, size]
 * Rows are split over OpenMP threads when a call is large enough to pay for them.
 */
#include <math.h>
#include <stdint.h>
#include "cpu_math.h"

#define MIN_PARALLEL_ELEMENTS (1 << 16)

/* summed = bf16(hidden + residual); normed = bf16(weight * bf16(x * 1 / sqrt(mean(x^2) + eps))), x = summed */
static void norm_row(const uint16_t *hidden, const uint16_t *residual, const uint16_t *weight, uint16_t *normed,
                     uint16_t *summed, int size, float eps) {
    const uint16_t *source = hidden;
    if (residual) {
        for (int i = 0; i < size; i++) summed[i] = bf16_round(bf16_value(hidden[i]) + bf16_value(residual[i]));
        source = summed;
    }
    float lanes[16] = { 0 };
    int i = 0;
    for (; i + 16 <= size; i += 16)
        for (int lane = 0; lane < 16; lane++) {
            float x = bf16_value(source[i + lane]);
            lanes[lane] += x * x;
        }
    for (; i < size; i++) {
        float x = bf16_value(source[i]);
        lanes[0] += x * x;
    }
    float total = 0.0f;
    for (int lane = 0; lane < 16; lane++) total += lanes[lane];
    float scale = 1.0f / sqrtf(total / (float)size + eps);
    for (i = 0; i < size; i++)
        normed[i] = bf16_round(bf16_value(weight[i]) * bf16_value(bf16_round(bf16_value(source[i]) * scale)));
}

void pdserve_add_rms_norm_bf16(const uint16_t *hidden, const uint16_t *residual, const uint16_t *weight,
                               uint16_t *normed, uint16_t *summed, int rows, int size, float eps, int threads) {
    if ((int64_t)rows * size < MIN_PARALLEL_ELEMENTS) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int row = 0; row < rows; row++) {
        int64_t offset = (int64_t)row * size;
        norm_row(hidden + offset, residual ? residual + offset : 0, weight, normed + offset,
                 residual ? summed + offset : 0, size, eps);
    }
}

/* out = (first * cos - second * sin, second * cos + first * sin), each product and sum rounded to bfloat16 */
void pdserve_rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos_sin, uint16_t *out, int tokens,
                         int heads, int head_dim, int threads) {
    const int half = head_dim / 2;
    if ((int64_t)tokens * heads * head_dim < MIN_PARALLEL_ELEMENTS) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *c = cos_sin + (int64_t)t * head_dim, *s = c + half;
        for (int h = 0; h < heads; h++) {
            const uint16_t *row = x + t * x_stride + (int64_t)h * head_dim;
            uint16_t *target = out + ((int64_t)t * heads + h) * head_dim;
            for (int i = 0; i < half; i++) {
                float first = bf16_value(row[i]), second = bf16_value(row[i + half]);
                float cosine = bf16_value(c[i]), sine = bf16_value(s[i]);
                float a = bf16_value(bf16_round(first * cosine)), b = bf16_value(bf16_round(second * sine));
                float d = bf16_value(bf16_round(second * cosine)), e = bf16_value(bf16_round(first * sine));
                target[i] = bf16_round(a - b);
                target[i + half] = bf16_round(d + e);
            }
        }
    }
}

#if defined(__AVX512BF16__)
static inline __m512 widen_16(const uint16_t *bf16) {  /* 16 bfloat16 -> float32 (exact) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16)), 16));
}

static inline __m512 round_16(__m512 x) {  /* to bfloat16 and back: round to nearest even, as bf16_round */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif

/* out = bf16(bf16(silu(gate)) * up) for one row; silu(x) = x * sigmoid(x), the sigmoid from exp(-|x|) (no
 * overflow on either side) */
static void silu_mul_row(const uint16_t *gate, const uint16_t *up, uint16_t *out, int size) {
    int i = 0;
#if defined(__AVX512BF16__)
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (; i + 16 <= size; i += 16) {
        __m512 x = widen_16(gate + i);
        __m512 e = exp_nonpositive_16(_mm512_or_ps(x, sign));  /* exp(-|x|) */
        __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
        __m512 product = _mm512_mul_ps(round_16(_mm512_mul_ps(x, sigmoid)), widen_16(up + i));
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(product));
    }
#endif
    for (; i < size; i++) {
        float x = bf16_value(gate[i]);
        float e = exp_nonpositive(x < 0.0f ? x : -x);
        float sigmoid = (x < 0.0f ? e : 1.0f) / (1.0f + e);
        out[i] = bf16_round(bf16_value(bf16_round(x * sigmoid)) * bf16_value(up[i]));
    }
}

void pdserve_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int size, int threads) {
    if ((int64_t)rows * size < MIN_PARALLEL_ELEMENTS) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int row = 0; row < rows; row++) {
        const uint16_t *gate = gate_up + (int64_t)row * 2 * size;
        silu_mul_row(gate, gate + size, out + (int64_t)row * size, size);
    }
}
