/* Deterministic paged attention on the CPU (engine/layers/cpu_kernels.py builds it, cpu_attention.py calls it).

   A query row (one token, one query head) is computed by the same sequence of float operations
   whatever else is in its call: its keys' scores are dot products summed over the head dim in
   order (explicit fmaf; the file is compiled with -ffp-contract=off), its maximum is exact over
   the keys it sees, its exp-scores are summed in 16 lanes by key position (lane j % 16, then a
   fixed tree), and its output sums the exp-scores times the values key after key from position
   0. Nothing depends on the batch, on how the row's prompt was chunked, on which of its keys came
   from a cache, on the block of tokens it was computed with, or on the thread that ran it.

   With bf16 queries and keys on a CPU with bf16 dot products (strata_bf16_dot: AMX's tiles, else
   AVX512-BF16's VDPBF16PS), scores and values are instead sums of bf16 pairs' products (exact in
   float32) in the unit's fixed order over the head dims (scores) or keys (values), per row: again
   nothing else. Which unit is fixed by the CPU the library is compiled for (-march=native). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define STRATA_AMX 1
#define STRATA_PAIRS 1
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__AVX512F__) && defined(__AVX512BF16__)
#define STRATA_DPBF16 1  /* AMD Zen 4 and later, Intel Cooper Lake: the same pairs, 16 lanes a step */
#define STRATA_PAIRS 1
#endif

#define CHUNK 64   /* keys per tile: scores are vectorised over a tile's keys */
#define LANES 16   /* partial sums of the exp-scores */

/* row `src` (n values of dtype 0 = float32, 1 = bfloat16) as float32 into dst */
static inline void load_row(const void *src, int dtype, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * 4);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

/* exp(x) for x <= 0 (a score minus its row's maximum); below -87.3 it is 0 */
static inline float exp_neg(float x) {
    const float e = exp_in_range(x < -87.3f ? -87.3f : x);
    return x < -87.3f ? 0.0f : e;
}

/* Two rows' scores against a tile of keys kt [dq, CHUNK] (transposed): out[j] = scale * sum_d
   q[d] kt[d][j], summed over d in order. Two rows at once for two independent chains of FMAs
   (a row's arithmetic is the same either way); not inlined, so their sums stay in registers */
static __attribute__((noinline)) void scores_tile(const float *restrict q0, const float *restrict q1,
                                                  const float *restrict kt, int dq, float scale,
                                                  float *restrict out0, float *restrict out1) {
    float a0[CHUNK] = {0}, a1[CHUNK] = {0};
    for (int d = 0; d < dq; d++) {
        const float x0 = q0[d], x1 = q1[d];
        const float *restrict kd = kt + (size_t)d * CHUNK;
        for (int j = 0; j < CHUNK; j++) {
            a0[j] = fmaf(x0, kd[j], a0[j]);
            a1[j] = fmaf(x1, kd[j], a1[j]);
        }
    }
    for (int j = 0; j < CHUNK; j++) {
        out0[j] = a0[j] * scale;
        out1[j] = a1[j] * scale;
    }
}

/* scores_tile for one row (an odd last row): the same sums */
static __attribute__((noinline)) void score_tile(const float *restrict q0, const float *restrict kt, int dq,
                                                 float scale, float *restrict out0) {
    float a0[CHUNK] = {0};
    for (int d = 0; d < dq; d++) {
        const float x0 = q0[d];
        const float *restrict kd = kt + (size_t)d * CHUNK;
        for (int j = 0; j < CHUNK; j++) a0[j] = fmaf(x0, kd[j], a0[j]);
    }
    for (int j = 0; j < CHUNK; j++) out0[j] = a0[j] * scale;
}

/* values_tile for one row (an odd last row): the same sums */
static __attribute__((noinline)) void value_tile(const float *restrict p0, const float *restrict vt, int n0, int dv,
                                                 float *restrict o0) {
    int d0 = 0;
    for (; d0 + CHUNK <= dv; d0 += CHUNK) {
        float a0[CHUNK];
        memcpy(a0, o0 + d0, sizeof a0);
        for (int j = 0; j < n0; j++) {
            const float x0 = p0[j];
            const float *restrict vj = vt + (size_t)j * dv + d0;
            for (int d = 0; d < CHUNK; d++) a0[d] = fmaf(x0, vj[d], a0[d]);
        }
        memcpy(o0 + d0, a0, sizeof a0);
    }
    for (; d0 < dv; d0++)
        for (int j = 0; j < n0; j++) o0[d0] = fmaf(p0[j], vt[(size_t)j * dv + d0], o0[d0]);
}

/* o[0:dv] += sum over keys j < n, in order, of p[j] * vt[j][0:dv] (a tile of values [CHUNK, dv]),
   for two rows: (p0, n0, o0) and (p1, n1, o1), n0 <= n1, the shared keys in one loop */
static __attribute__((noinline)) void values_tile(const float *restrict p0, const float *restrict p1,
                                                  const float *restrict vt, int n0, int n1, int dv,
                                                  float *restrict o0, float *restrict o1) {
    int d0 = 0;
    for (; d0 + CHUNK <= dv; d0 += CHUNK) {  /* 64 sums a row, held in registers over the keys */
        float a0[CHUNK], a1[CHUNK];
        memcpy(a0, o0 + d0, sizeof a0);
        memcpy(a1, o1 + d0, sizeof a1);
        int j = 0;
        for (; j < n0; j++) {
            const float x0 = p0[j], x1 = p1[j];
            const float *restrict vj = vt + (size_t)j * dv + d0;
            for (int d = 0; d < CHUNK; d++) {
                a0[d] = fmaf(x0, vj[d], a0[d]);
                a1[d] = fmaf(x1, vj[d], a1[d]);
            }
        }
        for (; j < n1; j++) {
            const float x1 = p1[j];
            const float *restrict vj = vt + (size_t)j * dv + d0;
            for (int d = 0; d < CHUNK; d++) a1[d] = fmaf(x1, vj[d], a1[d]);
        }
        memcpy(o0 + d0, a0, sizeof a0);
        memcpy(o1 + d0, a1, sizeof a1);
    }
    for (; d0 < dv; d0++) {
        for (int j = 0; j < n0; j++) o0[d0] = fmaf(p0[j], vt[(size_t)j * dv + d0], o0[d0]);
        for (int j = 0; j < n1; j++) o1[d0] = fmaf(p1[j], vt[(size_t)j * dv + d0], o1[d0]);
    }
}

#ifdef __AVX512F__
/* values d0..d0+15 of a key row as float32 (exactly: bf16 is float32's upper half); zeros for no row */
static inline __m512 load16(const char *row, int dtype, int d0) {
    if (!row) return _mm512_setzero_ps();
    if (dtype == 0) return _mm512_loadu_ps((const float *)row + d0);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d0));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* r[i][j] -> r[j][i] for a 16 x 16 block of floats held in 16 registers */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
        r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd);
    }
}
#endif

/* a tile's CHUNK key rows (NULL past the keys: zeros) transposed into kt [dq, CHUNK], as float32;
   a data movement only: the values are the keys' exactly, however it is done */
static void fill_keys(const char *const *rows, int dtype, int dq, float *restrict kt, float *restrict krow) {
#ifdef __AVX512F__
    if (dq % 16 == 0) {  /* 16 x 16 blocks through registers: ~4x fewer instructions than one value at a time */
        for (int j0 = 0; j0 < CHUNK; j0 += 16)
            for (int d0 = 0; d0 < dq; d0 += 16) {
                __m512 r[16];
                for (int jj = 0; jj < 16; jj++) r[jj] = load16(rows[j0 + jj], dtype, d0);
                transpose16(r);
                for (int dd = 0; dd < 16; dd++) _mm512_storeu_ps(kt + (size_t)(d0 + dd) * CHUNK + j0, r[dd]);
            }
        return;
    }
#endif
    for (int j = 0; j < CHUNK; j++) {
        if (!rows[j]) {
            for (int d = 0; d < dq; d++) kt[(size_t)d * CHUNK + j] = 0.0f;
            continue;
        }
        load_row(rows[j], dtype, dq, krow);
        for (int d = 0; d < dq; d++) kt[(size_t)d * CHUNK + j] = krow[d];
    }
}

typedef struct {
    const void *q;        /* [T, Hq, dq] float32 (or bf16: q_bf16), heads adjacent, tokens q_stride apart */
    int64_t q_stride;     /* elements between consecutive tokens' queries */
    const void *k, *v;    /* this layer's KV: row (slot, head) at (slot * heads + head) * stride */
    int64_t k_stride, v_stride;  /* elements between consecutive (slot, head) rows */
    int kv_dtype, kv_heads, q_heads, dq, dv, page_size;
    float scale;
    const int64_t *page_table;  /* [requests, pt_width] */
    int64_t pt_width;
    void *out;            /* [T, Hq, dv] float32, or bf16 (out_bf16: each value rounded once, as torch rounds) */
    int q_bf16;           /* q is bf16 [T, Hq, dq] (scores by the tile unit), else float32 */
    int out_bf16;
    float *lse;           /* [T, Hq] float32: each row's log-sum-exp of its scaled scores, or NULL */
} Args;

/* query row (token, query head) of q: q_bf16 ? uint16_t : float */
static inline const char *q_row(const Args *a, int64_t token, int head) {
    return (const char *)a->q + ((size_t)token * a->q_stride + (size_t)head * a->dq) * (a->q_bf16 ? 2 : 4);
}

/* out row (token, query head) = o / l, in the output's dtype (bf16: rounded to nearest even; NaN stays NaN);
   its LSE m + log(l) where asked (m: the row's maximum score, l: its exp-scores' sum) */
static void store_row(const Args *a, int64_t token, int head, const float *o, float l, float m) {
    const size_t at = ((size_t)token * a->q_heads + head) * a->dv;
    if (a->lse) a->lse[(size_t)token * a->q_heads + head] = m + logf(l);
    if (!a->out_bf16) {
        float *dst = (float *)a->out + at;
        for (int d = 0; d < a->dv; d++) dst[d] = o[d] / l;
        return;
    }
    uint16_t *dst = (uint16_t *)a->out + at;
    for (int d = 0; d < a->dv; d++) dst[d] = f32_to_bf16(o[d] / l);
}

/* Row si's scores (keys 0 .. seen - 1) as exp-scores, in place, zero to the next 16; returns their
   sum and the maximum in *max. The maximum is exact in any order; the exp-scores are summed in LANES
   lanes by key position, then a fixed tree */
static float softmax_row(float *si, int seen, float *max) {
    const int padded = (seen + LANES - 1) / LANES * LANES;
    for (int j = seen; j < padded; j++) si[j] = -INFINITY;
    float lane[LANES];
    for (int u = 0; u < LANES; u++) lane[u] = -INFINITY;
    for (int j = 0; j < padded; j += LANES)
        for (int u = 0; u < LANES; u++) lane[u] = si[j + u] > lane[u] ? si[j + u] : lane[u];
    float m = lane[0];
    for (int u = 1; u < LANES; u++) m = lane[u] > m ? lane[u] : m;
    *max = m;
    for (int j = 0; j < padded; j++) si[j] = exp_neg(si[j] - m);  /* exp(-inf) = 0 */
    for (int u = 0; u < LANES; u++) lane[u] = 0.0f;
    for (int j = 0; j < padded; j += LANES)
        for (int u = 0; u < LANES; u++) lane[u] += si[j + u];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int u = 0; u < w; u++) lane[u] += lane[u + w];
    return lane[0];
}

#ifdef STRATA_PAIRS
#ifdef STRATA_AMX
static int amx_granted = -1;

static int unit_ready(void) {  /* the kernel's permission for the tile state (Linux asks for it once) */
    if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return amx_granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static void amx_begin(void) {  /* every tile 16 rows of 64 bytes: 16 x 16 float32 sums, or 16 x 32 bf16 */
    TileConfig c = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}
#else
static int unit_ready(void) { return 1; }
#endif

/* Whether bf16 queries and keys take the pairs path here: bf16 keys, head dims in steps of 32,
   pages of whole 16-key tiles, and (AMX) the tile state granted */
int strata_bf16_dot(int dq, int dv, int page_size, int kv_dtype) {
    return kv_dtype == 1 && dq % 32 == 0 && dq <= 1024 && dv % 16 == 0 && page_size % 16 == 0 && unit_ready();
}

/* The item's query rows (bf16) packed as the A operands: qt [rows rounded up to 16][dq],
   rows past the item's zeros */
static void queries_pairs(const Args *a, int row0, int h, int rows, uint16_t *qt) {
    const int g = a->q_heads / a->kv_heads, dq = a->dq;
    for (int i = 0; i < (rows + 15) / 16 * 16; i++) {
        uint16_t *dst = qt + (size_t)i * dq;
        if (i < rows)
            memcpy(dst, q_row(a, row0 + i / g, h * g + i % g), (size_t)dq * 2);
        else
            memset(dst, 0, (size_t)dq * 2);
    }
}

/* Keys p0 .. p0 + 15 (a page's rows: a fixed stride), dims 32 st .. 32 st + 31, as B operands in r:
   r[k] = dim pair k of the 16 keys (a transpose of 32-bit pairs: bits moved only) */
static inline void key_block(const Args *a, const int64_t *pt, int h, int p0, int st, __m512 r[16]) {
    const int64_t stride = (int64_t)a->kv_heads * a->k_stride * 2;
    const int64_t slot = pt[p0 / a->page_size] * a->page_size + p0 % a->page_size;
    const char *k0 = (const char *)a->k + (slot * a->kv_heads + h) * a->k_stride * 2 + st * 64;
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps((const float *)(k0 + j * stride));
    transpose16(r);
}

/* The item's keys as B operands: for each 16 keys and 32-dim step, [16 dim pairs][16 keys] (key_block) */
static void keys_pairs(const Args *a, const int64_t *pt, int h, int keys, uint32_t *kt) {
    const int steps = a->dq / 32;
    for (int p0 = 0; p0 < keys; p0 += 16)
        for (int st = 0; st < steps; st++) {
            __m512 r[16];
            key_block(a, pt, h, p0, st, r);
            uint32_t *b = kt + ((size_t)(p0 / 16) * steps + st) * 256;
            for (int d = 0; d < 16; d++) _mm512_storeu_ps((float *)(b + d * 16), r[d]);
        }
}

/* Key pair pr's value rows (v[2 pr], v[2 pr + 1]), NULL past the keys */
static inline void value_rows(const Args *a, const int64_t *pt, int h, int keys, int pr, const uint16_t *v[2]) {
    for (int e = 0; e < 2; e++) {
        const int p = 2 * pr + e;
        const int64_t slot = p < keys ? pt[p / a->page_size] * a->page_size + p % a->page_size : 0;
        v[e] = p < keys ? (const uint16_t *)a->v + (slot * a->kv_heads + h) * a->v_stride : NULL;
    }
}

/* Dims d .. d + 15 of a key pair's values as a B operand: (v[0][d], v[1][d]) a lane, zeros for no row */
static inline __m512i value_pair(const uint16_t *const v[2], int d) {
    __m512i x[2];
    for (int e = 0; e < 2; e++)
        x[e] = v[e] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v[e] + d))) : _mm512_setzero_si512();
    return _mm512_or_si512(x[0], _mm512_slli_epi32(x[1], 16));
}

/* The item's values as B operands: vv[pair][d] = value_pair(pair's rows, d), zeros past the keys */
static void values_pairs(const Args *a, const int64_t *pt, int h, int keys, uint32_t *vv) {
    const int dv = a->dv;
    for (int pr = 0; pr < (keys + 31) / 32 * 16; pr++) {
        const uint16_t *v[2];
        value_rows(a, pt, h, keys, pr, v);
        for (int d0 = 0; d0 < dv; d0 += 16) _mm512_storeu_si512(vv + (size_t)pr * dv + d0, value_pair(v, d0));
    }
}

/* exp_neg on 16 lanes: the same operations as the scalar one (cpu_math.h), so the same bits */
static inline __m512 exp_neg16(__m512 x) {
    const __m512 floor_at = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, floor_at, _CMP_LT_OQ);
    const __m512 c = _mm512_mask_blend_ps(under, x, floor_at);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), c);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(p, _mm512_castsi512_ps(two_n)));
}

/* f32_to_bf16 on 16 lanes (round to nearest even; NaN stays NaN), as 32-bit lanes */
static inline __m512i to_bf16_16(__m512i u) {
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* Row si's scores (keys 0 .. seen - 1) times scale, then softmax_row's exp-scores and sum, in one
   pass each of 16-lane vectors (the float path's operations and lane order: the same bits), written
   in place as bf16 [hi | lo] (width each) for keys 0 .. n (zeros past seen): hi the upper half of
   each probability, lo the rest rounded (P = hi + lo to 2^-16 of P). Returns the sum, the maximum
   in *max; tmp holds [n] floats */
static float softmax_split_row(float *si, int seen, int n, int width, float scale, float *tmp, float *max) {
    const int padded = (seen + LANES - 1) / LANES * LANES;
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    __m512 lanes = minus_inf;
    for (int j = 0; j < padded; j += 16) {
        const __mmask16 in = seen - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - j)) - 1);
        const __m512 x = _mm512_mask_mul_ps(minus_inf, in, _mm512_maskz_loadu_ps(in, si + j), sc);
        _mm512_storeu_ps(si + j, x);
        lanes = _mm512_max_ps(x, lanes);  /* x > lane ? x : lane, as softmax_row */
    }
    float lane[LANES];
    _mm512_storeu_ps(lane, lanes);
    float m = lane[0];
    for (int u = 1; u < LANES; u++) m = lane[u] > m ? lane[u] : m;
    *max = m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < padded; j += 16) {
        const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv));
        _mm512_storeu_ps(tmp + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(lane, sum);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int u = 0; u < w; u++) lane[u] += lane[u + w];
    for (int j = seen; j < n; j++) tmp[j] = 0.0f;
    uint16_t *hi = (uint16_t *)si, *lo = hi + width;
    for (int j = 0; j < n; j += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(tmp + j));
        const __m512i h = _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u));
        const __m512 rest = _mm512_sub_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(h));  /* exact */
        _mm256_storeu_si256((__m256i *)(hi + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
        _mm256_storeu_si256((__m256i *)(lo + j), _mm512_cvtepi32_epi16(to_bf16_16(_mm512_castps_si512(rest))));
    }
    return lane[0];
}

#ifdef STRATA_AMX
/* A 16-row tile's scores against keys 0 .. need (16 at a time): s[i][key] = q row i . key, summed
   over the 32-dim steps in order (TDPBF16PS) */
static void tile_scores(const uint16_t *qa, int dq, const uint32_t *kt, int need, float *s, int width, int nr) {
    const int steps = dq / 32;
    (void)nr;  /* the tile's 16 rows: those past nr are zeros */
    for (int p0 = 0; p0 < need; p0 += 16) {
        _tile_zero(0);
        for (int st = 0; st < steps; st++) {
            _tile_loadd(1, qa + st * 32, dq * 2);
            _tile_loadd(2, kt + ((size_t)(p0 / 16) * steps + st) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s + p0, width * 4);
    }
}

/* A 16-row tile's outputs o[i][0:dv] = sum over key pairs, 32 keys a step, of hi . V, then lo . V
   (softmax_split_row's halves in s's rows) */
static void tile_values(const float *s, int width, const uint32_t *vv, int dv, int vsteps, float *o, int nr) {
    float c[256];
    for (int d0 = 0; d0 < dv; d0 += 64) {  /* 64 dims in four accumulators (tiles 0, 3, 4, 5) */
        const int nd = dv - d0 < 64 ? (dv - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int st = 0; st < vsteps; st++) {
            _tile_loadd(1, (const char *)s + st * 64, width * 4);                      /* hi */
            _tile_loadd(6, (const char *)s + 2 * (size_t)width + st * 64, width * 4);  /* lo */
            const uint32_t *b = vv + (size_t)st * 16 * dv + d0;
#define STRATA_PV(acc, k) if (nd > k) { _tile_loadd(2, b + 16 * k, dv * 4); _tile_dpbf16ps(acc, 1, 2); \
                                        _tile_dpbf16ps(acc, 6, 2); }
            STRATA_PV(0, 0) STRATA_PV(3, 1) STRATA_PV(4, 2) STRATA_PV(5, 3)
#undef STRATA_PV
        }
#define STRATA_OUT(acc, k) if (nd > k) { _tile_stored(acc, c, 64); \
            for (int i = 0; i < nr; i++) memcpy(o + (size_t)i * dv + d0 + 16 * k, c + i * 16, 64); }
        STRATA_OUT(0, 0) STRATA_OUT(3, 1) STRATA_OUT(4, 2) STRATA_OUT(5, 3)
#undef STRATA_OUT
    }
}
#else
/* R query rows x B blocks of 16 keys from block b0: each score lane += one dim pair's two products
   (VDPBF16PS), pairs in order; R x B independent sums in registers */
static inline __attribute__((always_inline)) void dot_scores(const uint16_t *qa, int dq, const uint32_t *kt, int b0,
                                                             float *s, int width, const int R, const int B) {
    const int steps = dq / 32;
    __m512 acc[16][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int st = 0; st < steps; st++)
        for (int k = 0; k < 16; k++) {
            __m512i kr[4];
            for (int b = 0; b < B; b++) kr[b] = _mm512_loadu_si512(kt + ((size_t)(b0 + b) * steps + st) * 256 + k * 16);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, qa + (size_t)r * dq + st * 32 + 2 * k, 4);
                const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
                for (int b = 0; b < B; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qb, (__m512bh)kr[b]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm512_storeu_ps(s + (size_t)r * width + (b0 + b) * 16, acc[r][b]);
}

/* tile_scores (AMX's above) on VDPBF16PS: a whole tile's 16 rows a block of keys at a time (the keys
   read once a tile), else rows in fours and keys in 64s; a row's sums are its own */
static void tile_scores(const uint16_t *qa, int dq, const uint32_t *kt, int need, float *s, int width, int nr) {
    const int blocks = (need + 15) / 16;
    int r = 0;
    if (nr == 16) {
        for (int b = 0; b < blocks; b++) dot_scores(qa, dq, kt, b, s, width, 16, 1);
        return;
    }
    for (; r + 4 <= nr; r += 4) {
        int b = 0;
        for (; b + 4 <= blocks; b += 4) dot_scores(qa + (size_t)r * dq, dq, kt, b, s + (size_t)r * width, width, 4, 4);
        for (; b < blocks; b++) dot_scores(qa + (size_t)r * dq, dq, kt, b, s + (size_t)r * width, width, 4, 1);
    }
    for (; r < nr; r++) {
        int b = 0;
        for (; b + 4 <= blocks; b += 4) dot_scores(qa + (size_t)r * dq, dq, kt, b, s + (size_t)r * width, width, 1, 4);
        for (; b < blocks; b++) dot_scores(qa + (size_t)r * dq, dq, kt, b, s + (size_t)r * width, width, 1, 1);
    }
}

/* R rows x B blocks of 16 dims from d0: each output lane += hi pair . V pair, then lo pair . V pair,
   key pairs in order */
static inline __attribute__((always_inline)) void dot_values(const float *s, int width, const uint32_t *vv, int dv,
                                                             int d0, int pairs, float *o, const int R, const int B) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int pr = 0; pr < pairs; pr++) {
        __m512i vr[4];
        for (int b = 0; b < B; b++) vr[b] = _mm512_loadu_si512(vv + (size_t)pr * dv + d0 + 16 * b);
        for (int r = 0; r < R; r++) {
            const uint32_t *row = (const uint32_t *)(s + (size_t)r * width);
            const __m512bh hi = (__m512bh)_mm512_set1_epi32((int32_t)row[pr]);
            const __m512bh lo = (__m512bh)_mm512_set1_epi32((int32_t)row[width / 2 + pr]);
            for (int b = 0; b < B; b++) {
                acc[r][b] = _mm512_dpbf16_ps(acc[r][b], hi, (__m512bh)vr[b]);
                acc[r][b] = _mm512_dpbf16_ps(acc[r][b], lo, (__m512bh)vr[b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm512_storeu_ps(o + (size_t)r * dv + d0 + 16 * b, acc[r][b]);
}

/* tile_values (AMX's above) on VDPBF16PS: rows in fours, dims in 64s (measured faster than a tile's
   16 rows 16 dims at a time) */
static void tile_values(const float *s, int width, const uint32_t *vv, int dv, int vsteps, float *o, int nr) {
    const int pairs = vsteps * 16;
    int r = 0;
#define STRATA_ROWS(R)                                                                                           \
    {                                                                                                            \
        int d0 = 0;                                                                                              \
        for (; d0 + 64 <= dv; d0 += 64)                                                                          \
            dot_values(s + (size_t)r * width, width, vv, dv, d0, pairs, o + (size_t)r * dv, R, 4);               \
        for (; d0 < dv; d0 += 16) dot_values(s + (size_t)r * width, width, vv, dv, d0, pairs, o + (size_t)r * dv, R, 1); \
    }
    for (; r + 4 <= nr; r += 4) STRATA_ROWS(4)
    for (; r < nr; r++) STRATA_ROWS(1)
#undef STRATA_ROWS
}
#endif

/* One item, 16 query rows at a time, each tile over only the keys its last row sees: scores
   (tile_scores), then times scale; the probabilities split into bf16 hi + lo (softmax_split_row) for the
   values (tile_values). A row's sums are independent of the other rows, and its keys past its own
   add exact zeros, so its bits are its own whatever the tile, block, batch or thread. */
static void attend_item_pairs(const Args *a, int req, int row0, int ntok, int pos0, int h, float *scratch) {
    const int g = a->q_heads / a->kv_heads, rows = ntok * g, dq = a->dq, dv = a->dv, steps = dq / 32;
    const int keys = pos0 + ntok, width = (keys + CHUNK - 1) / CHUNK * CHUNK;
    const int64_t *pt = a->page_table + (int64_t)req * a->pt_width;
    float *s = scratch;                                     /* [16, width]: a row tile's scores */
    float *o = s + (size_t)16 * width;                      /* [16, dv] */
    float *tmp = o + (size_t)16 * dv;                       /* [width] */
    uint16_t *qt = (uint16_t *)(tmp + width);               /* [rows rounded up to 16, dq] */
    uint32_t *kt = (uint32_t *)(qt + (size_t)(rows + 15) / 16 * 16 * dq);  /* [width / 16][steps][256] */
    uint32_t *vv = kt + (size_t)width / 16 * steps * 256;   /* [width / 2, dv] */
    float l[16], mx[16];
    queries_pairs(a, row0, h, rows, qt);
    keys_pairs(a, pt, h, keys, kt);
    values_pairs(a, pt, h, keys, vv);
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? rows - r0 : 16, need = pos0 + (r0 + nr - 1) / g + 1;
        tile_scores(qt + (size_t)r0 * dq, dq, kt, need, s, width, nr);
        const int vsteps = (need + 31) / 32;
        for (int i = 0; i < nr; i++) {
            const int seen = pos0 + (r0 + i) / g + 1;
            l[i] = softmax_split_row(s + (size_t)i * width, seen, vsteps * 32, width, a->scale, tmp, &mx[i]);
        }
        tile_values(s, width, vv, dv, vsteps, o, nr);
        for (int i = 0; i < nr; i++)
            store_row(a, row0 + (r0 + i) / g, h * g + (r0 + i) % g, o + (size_t)i * dv, l[i], mx[i]);
    }
}

#ifdef STRATA_DPBF16
/* R (1 to 4) rows' scores, keys 0 .. need: attend_item_pairs' products (the same operands, pairs in the
   same order), each 16 keys transposed in registers as they are used instead of packed into kt */
static inline __attribute__((always_inline)) void few_scores(const Args *a, const int64_t *pt, int h,
                                                             const uint16_t *qt, int need, float *s, int width,
                                                             const int R) {
    const int dq = a->dq, steps = dq / 32;
    for (int p0 = 0; p0 < need; p0 += 16) {
        __m512 acc[4];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int st = 0; st < steps; st++) {
            __m512 kr[16];
            key_block(a, pt, h, p0, st, kr);
            for (int k = 0; k < 16; k++)
                for (int r = 0; r < R; r++) {
                    int32_t pair;
                    memcpy(&pair, qt + (size_t)r * dq + st * 32 + 2 * k, 4);
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair),
                                              (__m512bh)_mm512_castps_si512(kr[k]));
                }
        }
        for (int r = 0; r < R; r++) _mm512_storeu_ps(s + (size_t)r * width + p0, acc[r]);
    }
}

/* R rows' outputs over key pairs 0 .. pairs: attend_item_pairs' products (hi . V, then lo . V a pair),
   each value pair interleaved in registers as it is used instead of packed into vv; 64 dims a pass */
static inline __attribute__((always_inline)) void few_values(const Args *a, const int64_t *pt, int h, int keys,
                                                             const float *s, int width, int pairs, float *o,
                                                             const int R) {
    const int dv = a->dv;
    for (int d0 = 0; d0 < dv; d0 += 64) {
        const int nb = dv - d0 < 64 ? (dv - d0) / 16 : 4;
        __m512 acc[4][4];
        for (int r = 0; r < R; r++)
            for (int b = 0; b < 4; b++) acc[r][b] = _mm512_setzero_ps();
        for (int pr = 0; pr < pairs; pr++) {
            const uint16_t *v[2];
            value_rows(a, pt, h, keys, pr, v);
            __m512bh vr[4];
            for (int b = 0; b < nb; b++) vr[b] = (__m512bh)value_pair(v, d0 + 16 * b);
            for (int r = 0; r < R; r++) {
                const uint32_t *row = (const uint32_t *)(s + (size_t)r * width);
                const __m512bh hi = (__m512bh)_mm512_set1_epi32((int32_t)row[pr]);
                const __m512bh lo = (__m512bh)_mm512_set1_epi32((int32_t)row[width / 2 + pr]);
                for (int b = 0; b < nb; b++) {
                    acc[r][b] = _mm512_dpbf16_ps(acc[r][b], hi, vr[b]);
                    acc[r][b] = _mm512_dpbf16_ps(acc[r][b], lo, vr[b]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int b = 0; b < nb; b++) _mm512_storeu_ps(o + (size_t)r * dv + d0 + 16 * b, acc[r][b]);
    }
}

/* An item of at most 4 query rows (a decode token's GQA group), on VDPBF16PS: attend_item_pairs'
   arithmetic, row for row, without its packed operands. Such an item reads each key and value once,
   so packing them (stores, then loads back) cost more than its products */
static void attend_item_few(const Args *a, int req, int row0, int ntok, int pos0, int h, float *scratch) {
    const int g = a->q_heads / a->kv_heads, rows = ntok * g;
    const int keys = pos0 + ntok, width = (keys + CHUNK - 1) / CHUNK * CHUNK;
    const int64_t *pt = a->page_table + (int64_t)req * a->pt_width;
    float *s = scratch;                          /* [4, width] */
    float *o = s + (size_t)4 * width;            /* [4, dv] */
    float *tmp = o + (size_t)4 * a->dv;          /* [width] */
    uint16_t *qt = (uint16_t *)(tmp + width);    /* [16, dq] */
    float l[4], mx[4];
    const int need = pos0 + (rows - 1) / g + 1, vsteps = (need + 31) / 32;
    queries_pairs(a, row0, h, rows, qt);
    switch (rows) {
        case 1: few_scores(a, pt, h, qt, need, s, width, 1); break;
        case 2: few_scores(a, pt, h, qt, need, s, width, 2); break;
        case 3: few_scores(a, pt, h, qt, need, s, width, 3); break;
        default: few_scores(a, pt, h, qt, need, s, width, 4); break;
    }
    for (int i = 0; i < rows; i++)
        l[i] = softmax_split_row(s + (size_t)i * width, pos0 + i / g + 1, vsteps * 32, width, a->scale, tmp, &mx[i]);
    switch (rows) {
        case 1: few_values(a, pt, h, keys, s, width, vsteps * 16, o, 1); break;
        case 2: few_values(a, pt, h, keys, s, width, vsteps * 16, o, 2); break;
        case 3: few_values(a, pt, h, keys, s, width, vsteps * 16, o, 3); break;
        default: few_values(a, pt, h, keys, s, width, vsteps * 16, o, 4); break;
    }
    for (int i = 0; i < rows; i++) store_row(a, row0 + i / g, h * g + i % g, o + (size_t)i * a->dv, l[i], mx[i]);
}

#endif

/* floats of scratch attend_item_pairs needs for a block of r rows and `width` keys */
static size_t scratch_pairs(size_t r, size_t width, int dq, int dv) {
    return 16 * width + 16 * (size_t)dv + width + (r + 15) / 16 * 16 * dq / 2 + width / 16 * (dq / 32) * 256 +
           width / 2 * dv;
}
#else
int strata_bf16_dot(int dq, int dv, int page_size, int kv_dtype) {
    (void)dq; (void)dv; (void)page_size; (void)kv_dtype;
    return 0;
}
#endif


/* one item: `ntok` new tokens of request `req` (q rows row0.., positions pos0..) x one KV head */
static void attend_item(const Args *a, int req, int row0, int ntok, int pos0, int h, float *scratch) {
    const int g = a->q_heads / a->kv_heads, rows = ntok * g, dq = a->dq, dv = a->dv;
    const int keys = pos0 + ntok, tiles = (keys + CHUNK - 1) / CHUNK, width = tiles * CHUNK;
    const int esz = a->kv_dtype == 0 ? 4 : 2;
    float *kt = scratch;                        /* [dq, CHUNK]: a tile's keys, transposed */
    float *vt = kt + (size_t)dq * CHUNK;        /* [CHUNK, dv] */
    float *s = vt + (size_t)CHUNK * dv;         /* [rows, width]: scores, then exp-scores */
    float *o = s + (size_t)rows * width;        /* [rows, dv] */
    float *l = o + (size_t)rows * dv;           /* [rows]: the exp-scores' sums */
    float *mx = l + rows;                       /* [rows]: the maximum scores */
    float krow[1024];                           /* one key (dq <= 1024, checked by the caller) */
    const int64_t *pt = a->page_table + (int64_t)req * a->pt_width;
    for (int t = 0; t < tiles; t++) {
        const char *rows_k[CHUNK];
        for (int j = 0; j < CHUNK; j++) {
            const int pos = t * CHUNK + j;
            rows_k[j] = NULL;
            if (pos >= keys) continue;  /* (and past the page table's row) */
            const int64_t slot = pt[pos / a->page_size] * a->page_size + pos % a->page_size;
            rows_k[j] = (const char *)a->k + ((slot * a->kv_heads + h) * a->k_stride) * esz;
        }
        fill_keys(rows_k, a->kv_dtype, dq, kt, krow);
        for (int i = 0; i < rows; i += 2) {  /* two rows at a time; an odd last row alone */
            const float *q0 = (const float *)q_row(a, row0 + i / g, h * g + i % g);
            if (i + 1 < rows)
                scores_tile(q0, (const float *)q_row(a, row0 + (i + 1) / g, h * g + (i + 1) % g), kt,
                            dq, a->scale, s + (size_t)i * width + t * CHUNK, s + (size_t)(i + 1) * width + t * CHUNK);
            else
                score_tile(q0, kt, dq, a->scale, s + (size_t)i * width + t * CHUNK);
        }
    }
    for (int i = 0; i < rows; i++) {
        l[i] = softmax_row(s + (size_t)i * width, pos0 + i / g + 1, &mx[i]);  /* keys 0..pos */
        memset(o + (size_t)i * dv, 0, sizeof(float) * dv);
    }
    for (int t = 0; t < tiles; t++) {
        const int n = keys - t * CHUNK < CHUNK ? keys - t * CHUNK : CHUNK;
        for (int j = 0; j < n; j++) {
            int pos = t * CHUNK + j;
            int64_t slot = pt[pos / a->page_size] * a->page_size + pos % a->page_size;
            load_row((const char *)a->v + ((slot * a->kv_heads + h) * a->v_stride) * esz, a->kv_dtype, dv,
                     vt + (size_t)j * dv);
        }
        for (int i = 0; i < rows; i += 2) {  /* rows by position: a row stops no later than the next */
            const int i1 = i + 1 < rows ? i + 1 : i;
            const int stop0 = pos0 + i / g + 1 - t * CHUNK, stop1 = pos0 + i1 / g + 1 - t * CHUNK;
            if (i1 > i)
                values_tile(s + (size_t)i * width + t * CHUNK, s + (size_t)i1 * width + t * CHUNK, vt,
                            stop0 < n ? stop0 : n, stop1 < n ? stop1 : n, dv, o + (size_t)i * dv, o + (size_t)i1 * dv);
            else
                value_tile(s + (size_t)i * width + t * CHUNK, vt, stop0 < n ? stop0 : n, dv, o + (size_t)i * dv);
        }
    }
    for (int i = 0; i < rows; i++) store_row(a, row0 + i / g, h * g + i % g, o + (size_t)i * dv, l[i], mx[i]);
}

/* The unit of this build's pairs path (the CPU's compiler flags): 1 AMX, 2 AVX512-BF16, 0 none */
int strata_bf16_dot_unit(void) {
#if defined(STRATA_AMX)
    return 1;
#elif defined(STRATA_DPBF16)
    return 2;
#else
    return 0;
#endif
}

/* floats of scratch that items [first, last) need (attend_item's layout, or attend_item_pairs', for
   their largest block); a range may start and end inside a block's KV heads */
size_t strata_scratch(const int32_t *blocks, int first, int last, int kv_heads, int g, int dq, int dv) {
    size_t scores = 0, rows = 0, pairs = 0;
    for (int blk = first / kv_heads; last > first && blk <= (last - 1) / kv_heads; blk++) {
        const int32_t *b = blocks + (size_t)blk * 4;
        const size_t r = (size_t)b[2] * g, width = (size_t)(b[3] + b[2] + CHUNK - 1) / CHUNK * CHUNK;
        scores = r * width > scores ? r * width : scores;
        rows = r > rows ? r : rows;
#ifdef STRATA_PAIRS
        const size_t need = scratch_pairs(r, width, dq, dv);
        pairs = need > pairs ? need : pairs;
#endif
    }
    const size_t fma = (size_t)dq * CHUNK + (size_t)CHUNK * dv + scores + rows * dv + 2 * rows;
    return fma > pairs ? fma : pairs;
}

/* items [first, last) of `blocks` (int32 [n, 4]: request, q row, tokens, position of the
   first) x KV heads, item = block * kv_heads + head, each row's LSE into lse where not NULL;
   returns 0, or -1 if scratch fails */
int strata_attend(const void *q, int64_t q_stride, const void *k, const void *v, int64_t k_stride,
                  int64_t v_stride, int kv_dtype, int kv_heads, int q_heads, int dq, int dv, int page_size,
                  float scale, const int64_t *page_table, int64_t pt_width, const int32_t *blocks, int first,
                  int last, void *out, int q_bf16, int out_bf16, float *lse) {
    Args a = {q, q_stride, k, v, k_stride, v_stride, kv_dtype, kv_heads, q_heads, dq, dv, page_size, scale,
              page_table, pt_width, out, q_bf16, out_bf16, lse};
    if (q_bf16 && !strata_bf16_dot(dq, dv, page_size, kv_dtype)) return -2;
    float *scratch = malloc(strata_scratch(blocks, first, last, kv_heads, q_heads / kv_heads, dq, dv) * sizeof(float));
    if (!scratch) return -1;
#ifdef STRATA_AMX
    if (q_bf16) amx_begin();  /* the tile configuration is the calling thread's */
#endif
    for (int it = first; it < last; it++) {
        const int32_t *b = blocks + (size_t)(it / kv_heads) * 4;
#ifdef STRATA_PAIRS
        if (q_bf16) {
#ifdef STRATA_DPBF16
            if (b[2] * (q_heads / kv_heads) <= 4) {
                attend_item_few(&a, b[0], b[1], b[2], b[3], it % kv_heads, scratch);
                continue;
            }
#endif
            attend_item_pairs(&a, b[0], b[1], b[2], b[3], it % kv_heads, scratch);
            continue;
        }
#endif
        attend_item(&a, b[0], b[1], b[2], b[3], it % kv_heads, scratch);
    }
#ifdef STRATA_AMX
    if (q_bf16) _tile_release();
#endif
    free(scratch);
    return 0;
}
