/* A decode step's small per-layer ops on the CPU in bfloat16, each one call instead of a chain of torch ops:
 * the residual add with RMSNorm, and the rotary embedding of query and key. Every value is rounded to
 * bfloat16 where the torch code it replaces rounds (engine/layers/norm.py's and rotary.py's torch paths), so the
 * results match theirs except for the float32 sum order inside the norm's mean.
 *
 * Shapes (row-major):
 *   add_rms_norm: hidden, residual, normed, summed [rows, size] contiguous; weight [size]; residual and summed
 *                 may be NULL (no residual: the norm of hidden itself)
 *   rotary:       x [tokens, heads, head_dim] with row stride x_stride (heads and dims contiguous, as q and k
 *                 split from one projection); cos_sin [tokens, head_dim]: cos | sin; out [tokens, heads, head_dim]
 * Rows are split over OpenMP threads when a call is large enough to pay for them.
 */
#include <math.h>
#include <stdint.h>

#define MIN_PARALLEL_ELEMENTS (1 << 16)

static inline float bf16_value(uint16_t bits) {
    union { uint32_t u; float f; } value = { (uint32_t)bits << 16 };
    return value.f;
}

static inline uint16_t bf16_round(float value) {  /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } bits = { value };
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}

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
