/* What the native CPU kernels share: a thread's place in its OpenMP team, bfloat16 conversions, and exp in plain C
 * that the compiler vectorizes (no libm call in the loops) and on 16 AVX-512 lanes. */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* this thread's place in the running OpenMP team: *team threads, this one number *me (1 and 0 without OpenMP) */
static inline void thread_place(int *team, int *me) {
#if defined(_OPENMP)
    *team = omp_get_num_threads();
    *me = omp_get_thread_num();
#else
    *team = 1;
    *me = 0;
#endif
}

static inline int built_with_avx512_bf16(void) {  /* 1 where this build runs AVX512-BF16 code (-march=native has it) */
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

static inline float bf16_value(uint16_t bits) {  /* exact */
    union { uint32_t u; float f; } value = { (uint32_t)bits << 16 };
    return value.f;
}

static inline uint16_t bf16_round(float value) {  /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } bits = { value };
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (logits minus their maximum, or -|x|), vectorizable: 2^n * 2^f with a degree-6 polynomial
 * for 2^f, f in [-0.5, 0.5]; relative error about 2e-7. Below -87 it returns 0. */
static inline float exp_nonpositive(float x) {
    float y = x * 1.44269504088896341f;
    if (y < -126.0f) y = -126.0f;
    float n = (y + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 pushes the fraction out */
    float f = y - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale = { (uint32_t)((int32_t)n + 127) << 23 };
    float result = p * scale.f;
    return x < -87.0f ? 0.0f : result;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_nonpositive on 16 lanes of AVX-512 (the same polynomial; 2^n by VSCALEFPS); 0 below -87 and for NaN (a row's
 * masked logits minus a masked maximum) */
static inline __m512 exp_nonpositive_16(__m512 x) {
    __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}
#endif

#endif
