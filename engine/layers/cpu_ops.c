/* The CPU decoder's elementwise kernels: add + RMSNorm, SiLU-and-mul, rotary, in float32 or
   bfloat16 tensors (engine/layers/cpu_kernels.py builds this file with cpu_attention.c and calls it).

   Why: torch runs each as several passes over memory (RMSNorm alone: add, float, square, mean,
   scale, round, weight: 7 ops), which made the elementwise ops ~40% of a 2-core prefill step. Here
   a row is read once and written once. A row's arithmetic is float32, fixed by this code alone
   (the RMSNorm's sum of squares in 16 lanes by index, then a fixed tree), rounded to the tensor's
   dtype where torch's ops round, so its bits do not depend on the rows beside it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#define LANES 16

/* dtype 0: float32, 1: bfloat16; constant-folded where the callers pass a literal */
static inline float ld(const void *p, int64_t i, int dt) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int dt) {
    if (dt) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
static inline float rd(float v, int dt) { return dt ? bf16_to_f32(f32_to_bf16(v)) : v; }  /* rounded to dtype */

static inline float exp_clamped(float x) {  /* exp(-87.3) ~ 1e-38 stands for 0 where it is added to 1 */
    return exp_in_range(x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x));
}

static inline void add_rms_norm_rows(const void *x, const void *res, const void *w, void *out, void *sum,
                                     int64_t r0, int64_t r1, int dim, int64_t xs, int64_t xh, int heads, int64_t rs,
                                     float eps, int dt) {
    float h[8192];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t xi = (r / heads) * xs + (r % heads) * xh, ri = r * rs, oi = r * dim;
        float acc[LANES] = {0};
        if (res) {
            for (int i = 0; i < dim; i++) h[i] = rd(ld(x, xi + i, dt) + ld(res, ri + i, dt), dt);
            for (int i = 0; i < dim; i++) st(sum, oi + i, h[i], dt);
        } else {
            for (int i = 0; i < dim; i++) h[i] = ld(x, xi + i, dt);
        }
        int i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += h[i + j] * h[i + j];
        for (; i < dim; i++) acc[i % LANES] += h[i] * h[i];
        for (int s = LANES / 2; s > 0; s /= 2)
            for (int j = 0; j < s; j++) acc[j] += acc[j + s];
        const float k = 1.0f / sqrtf(acc[0] / (float)dim + eps);
        for (int i = 0; i < dim; i++) st(out, oi + i, ld(w, i, dt) * rd(h[i] * k, dt), dt);
    }
}

/* out = RMSNorm(x + res) * w (res NULL: of x), sum = x + res rounded to dtype; rows [r0, r1) of
   x, row r at (r / heads) * xs + (r % heads) * xh (a [T, heads, dim] view; heads 1: [T, dim]), of
   res (row stride rs), out and sum (contiguous, dim wide); dim <= 8192 */
void strata_add_rms_norm(const void *x, const void *res, const void *w, void *out, void *sum, int64_t r0,
                         int64_t r1, int dim, int64_t xs, int64_t xh, int heads, int64_t rs, float eps, int dt) {
    if (dt) add_rms_norm_rows(x, res, w, out, sum, r0, r1, dim, xs, xh, heads, rs, eps, 1);
    else add_rms_norm_rows(x, res, w, out, sum, r0, r1, dim, xs, xh, heads, rs, eps, 0);
}

static inline void silu_mul_rows(const void *x, void *out, int64_t r0, int64_t r1, int d, int64_t xs, int dt) {
    for (int64_t r = r0; r < r1; r++) {
        const int64_t xi = r * xs, oi = r * d;
        for (int i = 0; i < d; i++) {
            const float g = ld(x, xi + i, dt);
            const float s = rd(g / (1.0f + exp_clamped(-g)), dt);
            st(out, oi + i, s * ld(x, xi + d + i, dt), dt);
        }
    }
}

/* out [rows, d] = silu(x[:, :d]) * x[:, d:] (x's rows xs apart), silu rounded to dtype first (as
   torch's two ops) */
void strata_silu_mul(const void *x, void *out, int64_t r0, int64_t r1, int d, int64_t xs, int dt) {
    if (dt) silu_mul_rows(x, out, r0, r1, d, xs, 1);
    else silu_mul_rows(x, out, r0, r1, d, xs, 0);
}

static inline void rope_rows(void *x, const void *cos, const void *sin, int64_t r0, int64_t r1, int64_t xs,
                             int heads, int d, int dt) {
    const int half = d / 2;
    for (int64_t r = r0; r < r1; r++) {
        for (int hh = 0; hh < heads; hh++) {
            const int64_t b = r * xs + (int64_t)hh * d, c = r * d;
            for (int i = 0; i < half; i++) {
                const float a = ld(x, b + i, dt), e = ld(x, b + half + i, dt);
                const float o1 = a * ld(cos, c + i, dt) - e * ld(sin, c + i, dt);
                const float o2 = e * ld(cos, c + half + i, dt) + a * ld(sin, c + half + i, dt);
                st(x, b + i, o1, dt);
                st(x, b + half + i, o2, dt);
            }
        }
    }
}

/* the first `heads` heads (d values each) of rows [r0, r1) of x (row stride xs) rotated in place by
   cos, sin [rows, d] (rotate-half: x1 cos - x2 sin, x2 cos + x1 sin, each rounded once) */
void strata_rope(void *x, const void *cos, const void *sin, int64_t r0, int64_t r1, int64_t xs, int heads, int d,
                 int dt) {
    if (dt) rope_rows(x, cos, sin, r0, r1, xs, heads, d, 1);
    else rope_rows(x, cos, sin, r0, r1, xs, heads, d, 0);
}

/* dst row slots[i] = src row i, for i in [r0, r1): rows of `row_bytes`, src rows src_stride bytes
   apart (a view of the QKV projection), dst rows row_bytes apart (a KV pool layer's num_slots slots).
   Returns how many rows had a slot outside [0, num_slots) (those are not written) */
int64_t strata_scatter_rows(const void *src, int64_t src_stride, const int64_t *slots, void *dst, int64_t row_bytes,
                            int64_t num_slots, int64_t r0, int64_t r1) {
    int64_t bad = 0;
    for (int64_t r = r0; r < r1; r++) {
        if (slots[r] < 0 || slots[r] >= num_slots) {
            bad++;
            continue;
        }
        memcpy((char *)dst + slots[r] * row_bytes, (const char *)src + r * src_stride, (size_t)row_bytes);
    }
    return bad;
}

/* ---- the sampler's race noise (engine/run/sampler.py `_draw`; its torch twin `_log_exp_noise`) ---- */

static inline uint64_t mix64(uint64_t z) {  /* splitmix64's finaliser (engine/run/noise.py) */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* log(x) for a normal float x > 0, branch-free so that it vectorises (about 1 ulp): x = m 2^k with m in
   [sqrt(1/2), sqrt(2)) (musl's split), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172 */
static inline float log_normal(float x) {
    int32_t i;
    memcpy(&i, &x, 4);
    i += 0x3F800000 - 0x3F3504F3;
    const float k = (float)((i >> 23) - 0x7F);
    const int32_t mi = (i & 0x007FFFFF) + 0x3F3504F3;
    float m;
    memcpy(&m, &mi, 4);
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    float p = fmaf(s2, 1.0f / 11.0f, 1.0f / 9.0f);
    p = fmaf(p, s2, 1.0f / 7.0f);
    p = fmaf(p, s2, 1.0f / 5.0f);
    p = fmaf(p, s2, 1.0f / 3.0f);
    const float two_s = s + s, log_m = fmaf(two_s * s2, p, two_s);
    return fmaf(k, 0.693359375f, fmaf(k, -2.12194440e-4f, log_m));  /* k ln2, split as exp_in_range's */
}

/* cand[r, c] -= log(-log(u)) for rows [r0, r1), in place: u = (low `bits` bits of
   splitmix64(splitmix64(seed_r + (pos_r + 1) G) + (token + 1) G) + 0.5) / 2^bits, token = ids[r, c]
   (ids NULL: c). Each value is a pure function of (seed, position, token): no row's bits depend on its
   batch or on the split between threads */
void strata_race_noise(float *cand, int64_t cand_stride, const int64_t *seeds, const int64_t *positions,
                       const int64_t *ids, int64_t ids_stride, int64_t r0, int64_t r1, int64_t cols, int bits) {
    const uint64_t gamma = 0x9E3779B97F4A7C15ull, mask = (1ull << bits) - 1;
    const float scale = 1.0f / (float)(1 << bits), half = 0.5f / (float)(1 << bits);
    for (int64_t r = r0; r < r1; r++) {
        const uint64_t row = mix64((uint64_t)seeds[r] + ((uint64_t)positions[r] + 1) * gamma);
        float *x = cand + r * cand_stride;
        const int64_t *tok = ids ? ids + r * ids_stride : NULL;
        if (tok) {
            for (int64_t c = 0; c < cols; c++) {
                const float u = (float)(mix64(row + ((uint64_t)tok[c] + 1) * gamma) & mask) * scale + half;
                x[c] -= log_normal(-log_normal(u));
            }
        } else {
            for (int64_t c = 0; c < cols; c++) {
                const float u = (float)(mix64(row + ((uint64_t)c + 1) * gamma) & mask) * scale + half;
                x[c] -= log_normal(-log_normal(u));
            }
        }
    }
}
