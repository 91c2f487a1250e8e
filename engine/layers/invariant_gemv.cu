// Deterministic inference's GEMV (1-8 rows of x) on the tensor cores, as CUDA C++: out[M, N] =
// x[M, K] @ w[N, K]^T (+ bias), bf16, each output element summed exactly as invariant_gemm.py's
// triton tiles sum it: K in tiles of 64 taken in order, each tile four k16 tensor-core steps
// chained on one float32 accumulator, in `split` slices of `per` K tiles each summed from zero,
// the slices then added in order to a zero, then the bias, then one rounding to bf16.
//
// Why not triton: triton's tensor-core GEMV stages the weight through shared memory for wgmma and
// streams it at ~3.2 TB/s on an H200, against ~3.9 for the mode-off FMA GEMV (docs/PERF.md). Here a
// warp owns 16 weight rows of one K slice with its own cp.async ring (no block barrier in the loop)
// and the legacy mma.sync m16n8k16 (operands in registers by ldmatrix), so each warp streams on its
// own and the K slices of a row block meet in shared memory, not in a global workspace with atomics.
// mma.sync's k16 step gives wgmma's bits on an H100 (docs/PERF.md, thirty-eighth session); the GPU
// test (tests/gpu/test_invariant_gemm_gpu.py) checks every projection shape against the prefill tiles.
//
// SwiGLU's gate_up (`half` > 0: w = [gate | up], `half` rows each): a block's row blocks come in pairs,
// gate rows i..i+15 and up rows half+i..half+i+15, and the epilogue stores silu(gate) * up [M, half]
// from the two bf16-rounded sums, as flashinfer's act_and_mul kernel computes it from the GEMM's bf16
// output (silu_times): the unfused path's bits, one launch (the activation's) fewer a layer. Its PDL
// trigger follows the waves (launch): H100, Llama-3.1-8B batch 1 6.05 against 6.17 ms unfused.
//
// The residual-stream RMSNorm folded (deterministic inference on the GPUs whose tuning says so:
// models/llama.py's fold_norms): with NORM each output is scaled by rsqrt(mean(x_row^2) + eps) of its x
// row before the one rounding (the norm's weight is folded into w at load). The sum of squares comes
// from the B fragments the K loop already holds (no read of x beyond the ring's, nothing before the
// loop): lane (g, q) adds the squares of its four x values of row g, k16 step by k16 step (`add_squares`),
// the quad's four meet as (q0 + q1) + (q2 + q3), the K slices in order (`scale_of`); the order depends
// on the weight's K split only, so strata_row_scale, given the split, gives the prefill tiles the same
// scales. With `res` the output is bf16(bf16(sum) + res): the residual add after o_proj / down. So a
// layer runs without a norm launch (docs/architecture.md, "Norms folded").
//
// Layout: a block is `groups` row blocks x `split` warps (warp = one 16-row block's one K slice);
// each warp's ring holds STAGES K tiles of its 16 weight rows (2 KB) and of x's 8 rows (1 KB),
// 16-byte chunks XOR-swizzled by row so ldmatrix reads are conflict-free.
//
// Tried on an H100 and dropped (docs/PERF.md, thirty-eighth session): x straight to the B fragments
// in registers (each tile waited on its loads: Llama-3.1-8B batch 1 11.7 ms against 6.4); the first
// weight tiles before the PDL wait (even on Llama, Qwen3-0.6B 1.32 against 1.28 ms); silu(gate) * up
// on the down projection's B fragments (every block recomputed its K slice's activations: Llama 6.35
// against 6.10 ms), which the gate_up epilogue now does once per element. Also (forty-sixth session) the
// folded norm's squares summed in a prologue (each block re-reading its x rows before its K loop, on the
// critical path): Llama-3.1-8B batch 1 5.88 against 5.84 ms unfolded, batch 8 6.54 against 6.34; hence
// the squares from the B fragments above.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int BK = 64;                    // K tile (invariant_gemm.BLOCK_K)
constexpr int ROWS = 16;                  // weight rows a warp: the mma's 16-row side
constexpr int COLS = 8;                   // rows of x: the mma's 8-column side (1-8 rows)
constexpr int W_BYTES = ROWS * BK * 2;    // a stage's weight tile
constexpr int X_BYTES = COLS * BK * 2;    // a stage's x tile
constexpr int STAGE = W_BYTES + X_BYTES;
constexpr int MAX_THREADS = 1024;
constexpr int ROW_SCALE_THREADS = 128;  // strata_row_scale's block: 4 x split threads a row

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; bytes < 16 zero-fill the rest (0: all zeros, src not read). The L2 fetches
// 256 bytes around it: the next K tile of the row is on its way (H100: Llama-3.1-8B batch 1 6.06 against
// 6.11 ms, batch 8 6.48 against 6.55; Qwen3-0.6B even; docs/PERF.md, thirty-eighth session)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// d = a b + d, a 16 x 16 (row), b 16 x 8 (col), float32 accumulators
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// the 16-byte chunk c (0..7) of a 128-byte smem row r, swizzled
__device__ __forceinline__ uint32_t chunk_at(uint32_t base, int r, int c) {
  return base + r * 128 + ((c ^ (r & 7)) << 4);
}

// silu(g) * u as flashinfer's act_and_mul kernel computes it: built with -use_fast_math, its silu is
// these PTX instructions (val / (1 + __expf(-val))); bit-equal to it on an H100 (thirty-eighth session)
__device__ __forceinline__ float silu_times(float g, float u) {
  float t, e, d, s, r;
  asm("mul.ftz.f32 %0, %1, 0fBFB8AA3B;" : "=f"(t) : "f"(g));
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  asm("add.ftz.f32 %0, %1, 0f3F800000;" : "=f"(d) : "f"(e));
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(s) : "f"(g), "f"(d));
  asm("mul.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(u), "f"(s));
  return r;
}

// acc + the squares of the four bf16 values of a B fragment (b0's two, then b1's), each square exact in
// float32, the adds rounded in turn (explicit _rn: no contraction, so every caller has these bits)
__device__ __forceinline__ float add_squares(float acc, uint32_t b0, uint32_t b1) {
  const float v[4] = {__uint_as_float(b0 << 16), __uint_as_float(b0 & 0xffff0000u), __uint_as_float(b1 << 16),
                      __uint_as_float(b1 & 0xffff0000u)};
#pragma unroll
  for (int j = 0; j < 4; ++j) acc = __fadd_rn(acc, __fmul_rn(v[j], v[j]));
  return acc;
}

// a quad's four partial sums of squares as the folded norm adds them
__device__ __forceinline__ float quad_sum(float q0, float q1, float q2, float q3) {
  return __fadd_rn(__fadd_rn(q0, q1), __fadd_rn(q2, q3));
}

// rsqrt(ss / K + eps), the folded norm's row scale
__device__ __forceinline__ float norm_scale(float ss, int K, float eps) {
  float r;
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(__fdiv_rn(ss, float(K)), eps)));
  return r;
}

constexpr int RES_REGS = 4;  // residual values a thread prefetches: (4 / split) x 16 x 8 rows / (4 x 32) at most

template <int STAGES, bool NORM>
__global__ void __launch_bounds__(MAX_THREADS) invariant_gemv_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias,
    __nv_bfloat16* __restrict__ out, int M, int N, int K, long long sx, long long sw, long long so, int split,
    int per, int groups, int half, int late, float eps, const __nv_bfloat16* __restrict__ res, long long sr) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warps = groups * split;
  const int group = warp / split, slice = warp % split;
  // the row block's first weight row and the end of its rows (a pair's gate block, then its up block)
  const int pair = blockIdx.x * (groups / 2) + group / 2;
  const int row0 = half ? (group & 1) * half + pair * ROWS : (blockIdx.x * groups + group) * ROWS;
  const int row_end = half ? (group & 1) * half + half : N;
  const int kt = (K + BK - 1) / BK;
  const int t0 = slice * per;
  const int t1 = min(t0 + per, kt);
  const int count = max(t1 - t0, 0);
  const uint32_t ring = smem_addr(smem + warp * STAGES * STAGE);
  float* parts = reinterpret_cast<float*>(smem + warps * STAGES * STAGE);  // [warps][ROWS][COLS]
  float* squares = parts + warps * ROWS * COLS;  // NORM: [split][COLS], each K slice's sums of squares

#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // x: the previous launch's output (PDL)
  // the dependents may start now, unless `late` (see the launch)
  if (!late) asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif

  // x's rows past M stay zero in every stage: written once, never loaded
  for (int i = lane; i < STAGES * COLS * 8; i += 32) {
    const int s = i / (COLS * 8), r = (i / 8) % COLS, c = i % 8;
    if (r >= M) {
      const uint32_t a = chunk_at(ring + s * STAGE + W_BYTES, r, c);
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0));
    }
  }

  auto load = [&](int i) {  // K tile t0 + i into stage i % STAGES
    const uint32_t base = ring + (i % STAGES) * STAGE;
    const int k0 = (t0 + i) * BK;
#pragma unroll
    for (int j = 0; j < ROWS * 8 / 32; ++j) {
      const int c = lane + 32 * j, r = c >> 3, k = k0 + (c & 7) * 8;
      const int row = row0 + r;
      const int bytes = (row < row_end && k < K) ? min(16, (K - k) * 2) : 0;
      cp_async16(chunk_at(base, r, c & 7), bytes ? w + row * sw + k : w, bytes);
    }
#pragma unroll
    for (int j = 0; j < COLS * 8 / 32; ++j) {
      const int c = lane + 32 * j, r = c >> 3, k = k0 + (c & 7) * 8;
      if (r < M) {
        const int bytes = k < K ? min(16, (K - k) * 2) : 0;
        cp_async16(chunk_at(base + W_BYTES, r, c & 7), bytes ? x + r * sx + k : x, bytes);
      }
    }
  };

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) load(i);
    cp_commit();
  }
  float resv[RES_REGS];
  if (res != nullptr) {
#pragma unroll
    for (int j = 0; j < RES_REGS; ++j) {
      const int e = threadIdx.x + j * warps * 32;
      const int gr = e / (ROWS * M), r = (e / M) % ROWS, col = e % M;
      const int row = (blockIdx.x * groups + gr) * ROWS + r;
      resv[j] = (e < groups * ROWS * M && row < N) ? __bfloat162float(res[col * sr + row]) : 0.0f;
    }
  }

  float acc[4] = {};
  float sq = 0.0f;  // NORM: this lane's squares of x row lane / 4 (k 2q, 2q + 1, 2q + 8, 2q + 9 of each k16 step)
  const int m = lane >> 3, rr = lane & 7;  // ldmatrix: lane's matrix and row in it
  for (int i = 0; i < count; ++i) {
    cp_wait<STAGES - 2>();
    __syncwarp();
    const uint32_t wt = ring + (i % STAGES) * STAGE, xt = wt + W_BYTES;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {  // the k16 steps, in order
      uint32_t a[4];
      // matrices: rows 0-7 / 8-15 (m & 1) x k 0-7 / 8-15 (m >> 1): a0..a3 of mma's A fragment
      ldmatrix_x4(chunk_at(wt, rr + ((m & 1) << 3), kk * 2 + (m >> 1)), a);
      uint32_t b[2];  // x rows 0-7 x k 0-7 / 8-15 (lanes 0-15 address them): b0, b1 of mma's B fragment
      ldmatrix_x2(chunk_at(xt, rr, kk * 2 + ((lane >> 3) & 1)), b);
      mma_bf16(acc, a, b);
      if constexpr (NORM) sq = add_squares(sq, b[0], b[1]);
    }
    __syncwarp();  // every lane has read stage i % STAGES before it is loaded again
    if (i + STAGES - 1 < count) load(i + STAGES - 1);
    cp_commit();
  }
  cp_wait<0>();
#if __CUDA_ARCH__ >= 900
  if (late) asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif

  // this slice's [16, COLS] partial: c0, c1 at (row g, cols 2q, 2q+1), c2, c3 at row g + 8
  const int g = lane >> 2, q = lane & 3;
  float* part = parts + warp * ROWS * COLS;
  part[g * COLS + 2 * q] = acc[0];
  part[g * COLS + 2 * q + 1] = acc[1];
  part[(g + 8) * COLS + 2 * q] = acc[2];
  part[(g + 8) * COLS + 2 * q + 1] = acc[3];
  if constexpr (NORM) {  // the quad's partials of row g; one row block's warps store their slice's
    const int base = lane & ~3;
    const float s0 = __shfl_sync(0xffffffffu, sq, base), s1 = __shfl_sync(0xffffffffu, sq, base + 1);
    const float s2 = __shfl_sync(0xffffffffu, sq, base + 2), s3 = __shfl_sync(0xffffffffu, sq, base + 3);
    if (group == 0 && q == 0) squares[slice * COLS + g] = quad_sum(s0, s1, s2, s3);
  }
  __syncthreads();
  // the folded norm's scale of x row `col`: the slices' squares added in order to a zero
  auto scale_of = [&](int col) {
    float ss = 0.0f;
    for (int s = 0; s < split; ++s) ss = __fadd_rn(ss, squares[s * COLS + col]);
    return norm_scale(ss, K, eps);
  };
  // the slices added in order to a zero (as the triton split grid's epilogue), then the bias
  auto total = [&](int gr, int r, int col) {
    float sum = 0.0f;
    for (int s = 0; s < split; ++s) sum += parts[((gr * split + s) * ROWS + r) * COLS + col];
    return sum;
  };
  if (half) {  // silu(gate) * up from the bf16-rounded sums (no bias)
    for (int e = threadIdx.x; e < groups / 2 * ROWS * M; e += warps * 32) {
      const int p = e / (ROWS * M), r = (e / M) % ROWS, col = e % M;
      const int i = (blockIdx.x * (groups / 2) + p) * ROWS + r;
      if (i >= half) continue;
      float gs = total(2 * p, r, col), us = total(2 * p + 1, r, col);
      if constexpr (NORM) {
        const float sc = scale_of(col);
        gs = __fmul_rn(gs, sc), us = __fmul_rn(us, sc);
      }
      const float g = __bfloat162float(__float2bfloat16_rn(gs));
      const float u = __bfloat162float(__float2bfloat16_rn(us));
      out[col * so + i] = __float2bfloat16_rn(silu_times(g, u));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < RES_REGS; ++j) {  // e < groups x ROWS x M <= RES_REGS x the block's threads
    const int e = threadIdx.x + j * warps * 32;
    const int gr = e / (ROWS * M), r = (e / M) % ROWS, col = e % M;
    const int row = (blockIdx.x * groups + gr) * ROWS + r;
    if (e >= groups * ROWS * M || row >= N) continue;
    float sum = total(gr, r, col);
    if constexpr (NORM) sum = __fmul_rn(sum, scale_of(col));  // (no bias with the norm: the launch refuses it)
    if (bias != nullptr) sum += __bfloat162float(bias[row]);
    if (res != nullptr) sum = __fadd_rn(__bfloat162float(__float2bfloat16_rn(sum)), resv[j]);
    out[col * so + row] = __float2bfloat16_rn(sum);
  }
}

template <int STAGES, bool NORM>
cudaError_t launch(const void* x, const void* w, const void* bias, void* out, int M, int N, int K, long long sx,
                   long long sw, long long so, int split, int half, int pdl, float eps, const void* res, long long sr,
                   cudaStream_t stream) {
  // row blocks a block: four warps at least; with `half` a gate and an up block per pair
  const int plain = split >= 4 ? 1 : 4 / split;
  const int groups = half ? (plain > 2 ? plain : 2) : plain;
  const int warps = groups * split;
  const int kt = (K + BK - 1) / BK;
  const int per = (kt + split - 1) / split;
  const size_t smem = size_t(warps) * STAGES * STAGE + size_t(warps) * ROWS * COLS * 4 + (NORM ? split * COLS * 4 : 0);
  auto kernel = invariant_gemv_kernel<STAGES, NORM>;
  const int rows = ROWS * (half ? groups / 2 : groups);  // output rows a block
  const int blocks = ((half ? half : N) + rows - 1) / rows;
  static size_t smem_allowed = 48 << 10;  // raised once per instantiation (not a stream operation)
  if (smem > smem_allowed) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    smem_allowed = smem;
  }
  // PDL: a dependent's blocks may be resident (waiting) from the trigger on. Where this grid takes
  // more than one wave and the dependent is the down GEMV (the SwiGLU form), they would take the
  // slots of this grid's later waves: the trigger waits for the end of the K loop there (H100,
  // Llama-3.1-8B batch 1 6.06 against 6.21 ms early; Qwen3-0.6B, one wave, 1.28 against 1.31 late)
  int late = 0;
  if (half && pdl) {
    static int sms = 0, resident[MAX_THREADS / 32 + 1] = {};  // per instantiation, by warps
    if (sms == 0) {
      int device = 0;
      cudaError_t err = cudaGetDevice(&device);
      if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      if (err != cudaSuccess) return err;
    }
    if (resident[warps] == 0) {
      cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident[warps], kernel, warps * 32, smem);
      if (err != cudaSuccess) return err;
    }
    late = blocks > sms * resident[warps];
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(warps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<const __nv_bfloat16*>(x),
                            static_cast<const __nv_bfloat16*>(w), static_cast<const __nv_bfloat16*>(bias),
                            static_cast<__nv_bfloat16*>(out), M, N, K, sx, sw, so, split, per, groups, half, late, eps,
                            static_cast<const __nv_bfloat16*>(res), sr);
}

// out[r] = the folded norm's scale of x row r, its squares summed in the order of the GEMV whose weight
// has `split` K slices (add_squares, quad_sum, then the slices in order): the scales of the prefill
// tiles (invariant_gemm.py multiplies its sums by them). A thread per row, slice and quad lane q: the
// k16 steps of its slice's K tiles in order, in each its four values k 2q, 2q + 1, 2q + 8, 2q + 9.
__global__ void row_scale_kernel(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int M, int K,
                                 long long sx, int split, int per, float eps) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
  __shared__ float parts[ROW_SCALE_THREADS];
  const int per_row = 4 * split, t = threadIdx.x;
  const int row = blockIdx.x * (ROW_SCALE_THREADS / per_row) + t / per_row;
  const int s = (t % per_row) / 4, q = t & 3;
  const int kt = (K + BK - 1) / BK, t1 = min((s + 1) * per, kt);
  float sq = 0.0f;
  if (row < M) {
    const __nv_bfloat16* xr = x + row * sx;
    for (int tile = s * per; tile < t1; ++tile) {
      for (int kk = 0; kk < BK / 16; ++kk) {
        const int k = tile * BK + kk * 16 + 2 * q;
        uint32_t b[2] = {};
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // b0: k, k + 1; b1: k + 8, k + 9 (zeros past K, as the ring's)
          const int k0 = k + 8 * h;
          const uint32_t lo = k0 < K ? __bfloat16_as_ushort(xr[k0]) : 0u;
          const uint32_t hi = k0 + 1 < K ? __bfloat16_as_ushort(xr[k0 + 1]) : 0u;
          b[h] = lo | (hi << 16);
        }
        sq = add_squares(sq, b[0], b[1]);
      }
    }
  }
  parts[t] = sq;
  __syncthreads();
  if (row < M && t % per_row == 0) {
    float ss = 0.0f;
    for (int j = 0; j < split; ++j) {
      const float* p = parts + t + 4 * j;
      ss = __fadd_rn(ss, quad_sum(p[0], p[1], p[2], p[3]));
    }
    out[row] = norm_scale(ss, K, eps);
  }
}

}  // namespace

// out[M, N] = x[M, K] @ w[N, K]^T (+ bias): M <= 8, bf16, 16-byte aligned rows; split K slices (a
// power of two, at most 32); stages 2, 3 or 4. half > 0: w is [gate | up] (N = 2 half, half a multiple
// of 16, no bias, split at most 16) and out[M, half] = silu(gate) * up. eps >= 0: each sum scaled by its
// x row's norm scale first (no bias); res (not with half): out = bf16(bf16(sum) + res[M, N] (row stride
// sr)), out not res. Returns the launch's cudaError_t.
extern "C" int strata_invariant_gemv(const void* x, const void* w, const void* bias, void* out, int M, int N, int K,
                                     long long sx, long long sw, long long so, int split, int stages, int half,
                                     int pdl, float eps, const void* res, long long sr, void* stream) {
  if (M < 1 || M > COLS || split < 1 || split > 32 || (split & (split - 1)) != 0) return int(cudaErrorInvalidValue);
  if (half && (half < 0 || N != 2 * half || half % ROWS != 0 || bias != nullptr || split > 16))
    return int(cudaErrorInvalidValue);
  if ((eps >= 0.0f && bias != nullptr) || (res != nullptr && (half || res == out))) return int(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  const bool norm = eps >= 0.0f;
  switch (stages * 2 + norm) {
    case 4: return int(launch<2, false>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    case 5: return int(launch<2, true>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    case 6: return int(launch<3, false>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    case 7: return int(launch<3, true>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    case 8: return int(launch<4, false>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    case 9: return int(launch<4, true>(x, w, bias, out, M, N, K, sx, sw, so, split, half, pdl, eps, res, sr, s));
    default: return int(cudaErrorInvalidValue);
  }
}

// out[M] (float32) = the folded norm's scale of each row of x[M, K] (bf16), its squares in the order of
// the GEMV of a weight of `split` K slices (a power of two, at most 32). Returns the launch's cudaError_t.
extern "C" int strata_row_scale(const void* x, void* out, int M, int K, long long sx, int split, float eps, int pdl,
                                void* stream) {
  if (M < 1 || K < 1 || split < 1 || split > 32 || (split & (split - 1)) != 0 || eps < 0.0f)
    return int(cudaErrorInvalidValue);
  const int kt = (K + BK - 1) / BK, per = (kt + split - 1) / split;
  const int rows = ROW_SCALE_THREADS / (4 * split);  // a block's
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((M + rows - 1) / rows);
  config.blockDim = dim3(ROW_SCALE_THREADS);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attr;
  config.numAttrs = 1;
  return int(cudaLaunchKernelEx(&config, row_scale_kernel, static_cast<const __nv_bfloat16*>(x),
                                static_cast<float*>(out), M, K, sx, split, per, eps));
}
