/* What engine/layers/cpu_attention.c and cpu_ops.c share: bf16 conversions and exp. */
#ifndef STRATA_CPU_MATH_H
#define STRATA_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even, as torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* exp(x) for x in [-87.3, 88.7] (callers clamp): Cody-Waite reduction and a degree-6 polynomial
   (about 1 ulp), branch-free so that it vectorises */
static inline float exp_in_range(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float n = floorf(fmaf(x, log2e, 0.5f));
    float r = fmaf(n, -ln2_hi, x);
    r = fmaf(n, -ln2_lo, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

#endif
