// inject_context_kv for one architecture: projects the context rows to K and V of every
// drafter layer, RMS-norms and rotates K (per head), and scatters the rows into k_cache /
// v_cache by `slots`.
//   - T <= kGemvMaxRows (bf16/fp16, D in {64, 128}): the weight-streaming GEMV
//     (weight_stream_gemv.cuh) over all layers' K and V weight rows; an epilogue group is
//     one (layer, k|v, head): the CTA that completes its D rows writes the cache rows;
//   - tensor cores (T > kGemvMaxRows, same inputs, the weight-streaming GEMM): one launch for
//     all layers; each CTA owns one (layer, k|v, head) N-tile of width D, so its epilogue
//     applies the per-head k RMSNorm and RoPE and scatters the rows. Few tokens give few
//     CTAs, so the plan may split K (grid.z): the splits then write fp32 partials and the
//     finalize kernel adds them before the same epilogue (store_kv_row) sees the full sum.
//     Rows of skipped tokens (slot -1, or a bad index with validation off) are not read
//     (zero filled), and a tile with no written row does no work;
//   - SIMT (every dtype and shape): one block per (token, layer, k|v, head);
//   - host side: kernel choice, split-K plan, launch.
#pragma once
#include "dflash/cuda/inject_context_kv_params.h"
#include "dflash/cuda/plans.h"
#include "dflash/cuda/weight_stream_gemm.cuh"
#include "dflash/cuda/weight_stream_gemv.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

// ---------------------------------------------------------------- kernels
// inject_context_kv's index guard (params.h): token t is written only where its slot is
// in [0, S) and its position in [0, P); -1 (skip) and, with validation off, bad values
// write nothing.
__device__ __forceinline__ bool inject_row_valid(const InjectParams& p, int t) {
  const int64_t slot = p.slots[t], pos = p.positions[t];
  return slot >= 0 && slot < p.S && pos >= 0 && pos < p.P;
}

// The inject epilogue of one (layer, k|v, head) row of token t, by one warp, from its D
// fp32 projections x (shared memory): V as it is, K RMS-normed with k_norm_weight and
// rotated (rotate_half RoPE at positions[t]). Shared by every inject kernel.
template <class T>
__device__ void store_kv_row(const InjectParams& p, int layer, bool is_v, int head, int t, const float* x) {
  const int lane = threadIdx.x % 32, D = p.D;
  T* dst = static_cast<T*>(is_v ? p.v_cache : p.k_cache) +
           ((static_cast<int64_t>(layer) * p.S + p.slots[t]) * p.Hkv + head) * D;
  if (is_v) {
    for (int d = lane; d < D; d += 32) dst[d] = from_float<T>(x[d]);
    return;
  }
  float ss = 0.f;
  for (int d = lane; d < D; d += 32) ss += x[d] * x[d];
  const float inv = rsqrtf(warp_sum(ss) / D + p.eps);
  const T* nw = static_cast<const T*>(p.k_norm_weight) + static_cast<int64_t>(layer) * D;
  const int64_t pos = p.positions[t];
  const T* cos_row = static_cast<const T*>(p.cos) + pos * D;
  const T* sin_row = static_cast<const T*>(p.sin) + pos * D;
  for (int d = lane; d < D; d += 32) {
    const int pd = d < D / 2 ? d + D / 2 : d - D / 2;  // rotate_half partner
    const float xd = x[d] * inv * to_float(nw[d]);
    const float xp = x[pd] * inv * to_float(nw[pd]);
    dst[d] = from_float<T>(xd * to_float(cos_row[d]) + (d < D / 2 ? -xp : xp) * to_float(sin_row[d]));
  }
}

// Tensor cores: one CTA per (row tile, layer, k|v, head), grid.z the K splits.
template <class T, int D>
__global__ void __launch_bounds__(kTileThreads)
inject_context_kv_tc_kernel(const __grid_constant__ InjectParams p) {
  constexpr int BM = kGemmBM;
  using Gemm = TileGemm<T, BM, D, kGemmBK, false, kGemmWarpsM>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // the swizzle period
  T* smem = reinterpret_cast<T*>(smem_raw);
  // blockIdx.y = (layer, k|v, head); the N-tile is exactly one head of D columns.
  const int layer = blockIdx.y / (2 * p.Hkv);
  const bool is_v = (blockIdx.y % (2 * p.Hkv)) >= p.Hkv;
  const int head = blockIdx.y % p.Hkv;
  const int m0 = blockIdx.x * BM;
  bool any_row = false;
  for (int r = threadIdx.x; r < BM; r += kTileThreads) any_row |= m0 + r < p.T && inject_row_valid(p, m0 + r);
  if (!__syncthreads_or(any_row)) return;  // nothing to write (with splits > 1 the finalize skips these rows too)
  const T* w = static_cast<const T*>(is_v ? p.v_weight : p.k_weight) +
               (static_cast<int64_t>(layer) * p.Hkv + head) * D * p.H;
  const T* ctx = static_cast<const T*>(p.ctx);
  auto a_src = [&](int r, int kk) -> const void* {
    const int t = m0 + r;
    return (t < p.T && kk < p.H && inject_row_valid(p, t)) ? ctx + static_cast<int64_t>(t) * p.H + kk : nullptr;
  };
  auto b_src = [&](int r, int kk) -> const void* {
    return kk < p.H ? w + static_cast<int64_t>(r) * p.H + kk : nullptr;
  };
  const int kt_total = (p.H + kGemmBK - 1) / kGemmBK;
  const int kt_begin = blockIdx.z * p.k_tiles_per_split;
  const int kt_end = min(kt_total, kt_begin + p.k_tiles_per_split);
  auto acc = Gemm::make_acc();
  weight_stream_mainloop<Gemm, T, BM, D>(acc, a_src, b_src, w, kt_begin, kt_end, smem);
  auto coords = Gemm::acc_coords(threadIdx.x);

  if (p.splits > 1) {  // fp32 partials [split][layer, k|v, head][T][D]; the finalize pass does the rest
    float* ws = p.workspace + ((static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * p.T) * D;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int t = m0 + get<0>(coords(i));
      if (t < p.T) ws[static_cast<int64_t>(t) * D + get<1>(coords(i))] = acc(i);
    }
    return;
  }

  // Epilogue: the fp32 tile goes through shared memory so that a warp owns whole rows
  // (RMSNorm needs the row sum; RoPE pairs column d with d +- D/2).
  constexpr int kStride = D + 4;
  float* tile = reinterpret_cast<float*>(smem_raw);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) tile[get<0>(coords(i)) * kStride + get<1>(coords(i))] = acc(i);
  __syncthreads();
  for (int r = threadIdx.x / 32; r < BM; r += kTileThreads / 32) {
    const int t = m0 + r;
    if (t >= p.T) break;
    if (inject_row_valid(p, t)) store_kv_row<T>(p, layer, is_v, head, t, tile + r * kStride);
  }
}

inline constexpr int kInjectGemvMaxD = 128;  // a warp's head row of fp32 in the GEMV's scratch
static_assert(kGemvWarps * kInjectGemvMaxD <= kGemvScratchFloats);

// The GEMV path: weight row r is row r % D of group r / D = (layer, k|v, head), the
// grouping of the tensor-core kernel's blockIdx.y.
template <class T>
struct InjectGemv {
  static constexpr bool kSumSquares = false;  // store_kv_row norms each head itself
  const InjectParams& p;
  int tokens, rows, K;

  __device__ const T* weight_row(int r) const {
    const int group = r / p.D, layer = group / (2 * p.Hkv), head = group % p.Hkv;
    const bool is_v = (group % (2 * p.Hkv)) >= p.Hkv;
    return static_cast<const T*>(is_v ? p.v_weight : p.k_weight) +
           ((static_cast<int64_t>(layer) * p.Hkv + head) * p.D + r % p.D) * p.H;
  }
  __device__ bool token_valid(int t) const { return t < tokens && inject_row_valid(p, t); }
  __device__ const void* act(int t, int k) const { return static_cast<const T*>(p.ctx) + static_cast<int64_t>(t) * p.H + k; }
  // The cache rows of group (layer, k|v, head): one warp per token.
  __device__ void finish_group(int group, float* scratch, const GemvSchedule& s) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int layer = group / (2 * p.Hkv), head = group % p.Hkv;
    const bool is_v = (group % (2 * p.Hkv)) >= p.Hkv;
    float* x = scratch + warp * kInjectGemvMaxD;
    const float* y = s.y + static_cast<int64_t>(group) * p.D;
    const int64_t y_cols = static_cast<int64_t>(s.row_blocks) * kGemvRowBlock;
    for (int t = warp; t < tokens; t += kGemvWarps) {
      if (!inject_row_valid(p, t)) continue;
      for (int d = lane; d < p.D; d += 32) x[d] = __ldcg(y + t * y_cols + d);
      __syncwarp();
      store_kv_row<T>(p, layer, is_v, head, t, x);
      __syncwarp();
    }
  }
};

template <class T, int NT>
__global__ void __launch_bounds__(kGemvThreads, 2)
inject_context_kv_gemv_kernel(const __grid_constant__ InjectParams p) {
  const InjectGemv<T> problem{p, p.T, p.N * 2 * p.Hkv * p.D, p.H};
  gemv_stream<T, NT>(problem, p.gemv);
}

// One block per (token, layer, k|v, head): the warps compute the D projections into
// shared memory, then warp 0 writes the cache row.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
inject_context_kv_simt_kernel(const __grid_constant__ InjectParams p) {
  extern __shared__ float y[];  // [D]
  const int t = blockIdx.x;
  if (!inject_row_valid(p, t)) return;
  const int layer = blockIdx.y / (2 * p.Hkv);
  const bool is_v = (blockIdx.y % (2 * p.Hkv)) >= p.Hkv;
  const int head = blockIdx.y % p.Hkv, D = p.D;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* x = static_cast<const T*>(p.ctx) + static_cast<int64_t>(t) * p.H;
  const T* w = static_cast<const T*>(is_v ? p.v_weight : p.k_weight) +
               (static_cast<int64_t>(layer) * p.Hkv + head) * D * p.H;
  for (int d = warp; d < D; d += kSimtThreads / 32) {
    float acc = 0.f;
    for (int h = lane; h < p.H; h += 32) acc += to_float(x[h]) * to_float(w[static_cast<int64_t>(d) * p.H + h]);
    acc = warp_sum(acc);
    if (lane == 0) y[d] = acc;
  }
  __syncthreads();
  if (warp == 0) store_kv_row<T>(p, layer, is_v, head, t, y);
}

// Split-K inject (splits > 1): adds the fp32 partial projections of one (token, layer,
// k|v, head) row over the splits, then the same epilogue. One warp per block.
template <class T>
__global__ void __launch_bounds__(32)
inject_context_kv_finalize_kernel(const __grid_constant__ InjectParams p) {
  extern __shared__ float y[];  // [D]
  const int t = blockIdx.x, row = blockIdx.y;
  if (!inject_row_valid(p, t)) return;
  const int64_t plane = static_cast<int64_t>(gridDim.y) * p.T * p.D;  // one split's partials
  const float* ws = p.workspace + (static_cast<int64_t>(row) * p.T + t) * p.D;
  for (int d = threadIdx.x; d < p.D; d += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.splits; ++s) acc += ws[s * plane + d];
    y[d] = acc;
  }
  __syncwarp();
  store_kv_row<T>(p, row / (2 * p.Hkv), (row % (2 * p.Hkv)) >= p.Hkv, row % p.Hkv, t, y);
}

// ---------------------------------------------------------------- plan and launch
template <class T, int D>
int inject_tc_ctas_per_sm() {
  return prepare_kernel<&inject_context_kv_tc_kernel<T, D>>(kTileThreads, weight_stream_smem_bytes<kGemmBM, D>(sizeof(T)),
                                                           "inject_context_kv");
}

template <class T, int NT>
int inject_gemv_ctas_per_sm() {
  return prepare_kernel<&inject_context_kv_gemv_kernel<T, NT>>(kGemvThreads, 0, "inject_context_kv");
}

// Sets p.path (GemmPath) and its schedule: p.gemv for the GEMV (the caller allocates its
// workspace), p.splits / p.k_tiles_per_split for the tensor-core kernel (the caller
// allocates p.workspace when splits > 1). Returns whether a tensor-core path runs.
bool inject_context_kv_plan(InjectParams& p, const DeviceLimits& dev) {
  const bool inputs = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && p.H % 8 == 0 &&
                      aligned16(p.ctx) && aligned16(p.k_weight) && aligned16(p.v_weight) &&
                      weight_stream_smem_bytes<kGemmBM, 128>(2) <= dev.max_smem_per_block;
  const GemmPath path = inject_context_kv_path(inputs, p.T);
  const int k_tiles = ceil_div(p.H, kGemmBK);
  p.path = static_cast<int>(path);
  p.splits = 1;
  p.k_tiles_per_split = k_tiles;
  p.gemv = GemvSchedule{};
  if (path == GemmPath::kSimt) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (path == GemmPath::kGemv) per_sm = p.T <= 8 ? inject_gemv_ctas_per_sm<T, 1>() : inject_gemv_ctas_per_sm<T, 2>();
      else per_sm = p.D == 64 ? inject_tc_ctas_per_sm<T, 64>() : inject_tc_ctas_per_sm<T, 128>();
    }
  };
  dispatch_all_types(p.dtype, occupancy);
  if (path == GemmPath::kGemv) {  // an epilogue group is one head's D rows
    p.gemv = gemv_schedule(p.T, static_cast<int64_t>(p.N) * 2 * p.Hkv * p.D, p.H, p.D, dev, per_sm);
    return true;
  }
  // One CTA per (row tile, layer, k|v, head) streams a whole D x H weight slice: with few
  // row tiles that is too few CTAs for the SMs, so split K (within one wave).
  const int64_t ctas = static_cast<int64_t>(ceil_div(p.T, kGemmBM)) * p.N * 2 * p.Hkv;
  const SplitPlan plan = gemm_split_plan(ctas, k_tiles, static_cast<int64_t>(dev.num_sms) * per_sm);
  p.splits = plan.splits;
  p.k_tiles_per_split = plan.units_per_split;
  return true;
}

template <class T, int D>
void launch_inject_tc(const InjectParams& p, cudaStream_t stream) {
  constexpr int smem = weight_stream_smem_bytes<kGemmBM, D>(sizeof(T));
  inject_tc_ctas_per_sm<T, D>();  // the shared-memory opt-in (once per device)
  const dim3 grid(ceil_div(p.T, kGemmBM), p.N * 2 * p.Hkv, p.splits);
  inject_context_kv_tc_kernel<T, D><<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("inject_context_kv_tc_kernel");
  if (p.splits > 1) {
    const dim3 rows(p.T, p.N * 2 * p.Hkv);
    inject_context_kv_finalize_kernel<T><<<rows, 32, p.D * sizeof(float), stream>>>(p);
    check_launch("inject_context_kv_finalize_kernel");
  }
}

void inject_context_kv(const InjectParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.path == static_cast<int>(GemmPath::kGemv)) {
        if (p.T <= 8) inject_context_kv_gemv_kernel<T, 1><<<p.gemv.ctas, kGemvThreads, 0, stream>>>(p);
        else inject_context_kv_gemv_kernel<T, 2><<<p.gemv.ctas, kGemvThreads, 0, stream>>>(p);
        check_launch("inject_context_kv_gemv_kernel");
        return;
      }
      if (p.path == static_cast<int>(GemmPath::kTensorCores)) {
        if (p.D == 64) launch_inject_tc<T, 64>(p, stream);
        else launch_inject_tc<T, 128>(p, stream);
        return;
      }
    }
    // D <= kInjectMaxHeadDim floats (checked by the dispatcher): no shared-memory opt-in.
    const dim3 grid(p.T, p.N * 2 * p.Hkv);
    inject_context_kv_simt_kernel<T><<<grid, kSimtThreads, p.D * sizeof(float), stream>>>(p);
    check_launch("inject_context_kv_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

// This architecture's launcher table (inject_context_kv_params.h), read by csrc/cuda/inject_context_kv.cpp.
extern const InjectLaunchers inject_context_kv_launchers{&inject_context_kv_plan, &inject_context_kv};

}  // namespace dflash::cuda::DFLASH_ARCH_NS
