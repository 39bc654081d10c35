// project_features for one architecture: out = RMSNorm(cat(features) * fc_weight^T) * norm_weight.
//   - tensor cores (bf16/fp16, the weight-streaming GEMM): A is the k feature tensors walked
//     as K-segments (never concatenated); the split-K CTAs write fp32 partial sums;
//   - SIMT (every dtype and shape): one warp per (output column, group of rows), also into
//     the workspace;
//   - finalize (both paths): adds the splits and applies the RMSNorm over H_out;
//   - host side: kernel choice, split-K plan, launch.
#pragma once
#include "dflash/cuda/plans.h"
#include "dflash/cuda/weight_stream_gemm.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kSimtRowsPerWarp = 4;  // SIMT: rows sharing one weight read

// ---------------------------------------------------------------- kernels
// Tensor cores: one CTA per (row tile, BN output columns, K split): fp32 partial sums
// into p.workspace[split].
template <class T, int BN>
__global__ void __launch_bounds__(kTileThreads)
project_features_tc_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  constexpr int BM = kGemmBM;
  using Gemm = TileGemm<T, BM, BN, kGemmBK, false, kGemmWarpsM>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // the swizzle period
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, split = blockIdx.z;
  const int K = p.k * p.H;
  const int kt_total = (K + kGemmBK - 1) / kGemmBK;
  const int kt_begin = split * p.k_tiles_per_split;
  const int kt_end = min(kt_total, kt_begin + p.k_tiles_per_split);
  const T* w = static_cast<const T*>(p.fc_weight);
  auto a_src = [&](int r, int kk) -> const void* {
    const int t = m0 + r;
    if (t >= p.T || kk >= K) return nullptr;
    const int seg = kk / p.H;
    return static_cast<const T*>(p.features[seg]) + static_cast<int64_t>(t) * p.H + (kk - seg * p.H);
  };
  auto b_src = [&](int r, int kk) -> const void* {
    const int n = n0 + r;
    if (n >= p.H_out || kk >= K) return nullptr;
    return w + static_cast<int64_t>(n) * K + kk;
  };
  auto acc = Gemm::make_acc();
  weight_stream_mainloop<Gemm, T, BM, BN>(acc, a_src, b_src, w, kt_begin, kt_end, smem);
  auto coords = Gemm::acc_coords(threadIdx.x);
  float* ws = p.workspace + static_cast<int64_t>(split) * p.T * p.H_out;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int t = m0 + get<0>(coords(i)), n = n0 + get<1>(coords(i));
    if (t < p.T && n < p.H_out) ws[static_cast<int64_t>(t) * p.H_out + n] = acc(i);
  }
}

// workspace[t, n] = sum_j features[j][t] . fc_weight[n, j*H : (j+1)*H]; one warp per
// (n, group of kSimtRowsPerWarp rows).
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
project_features_simt_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int row_groups = (p.T + kSimtRowsPerWarp - 1) / kSimtRowsPerWarp;
  if (warp >= static_cast<int64_t>(p.H_out) * row_groups) return;
  const int n = static_cast<int>(warp / row_groups), t0 = static_cast<int>(warp % row_groups) * kSimtRowsPerWarp;
  const int64_t K = static_cast<int64_t>(p.k) * p.H;
  const T* w = static_cast<const T*>(p.fc_weight) + n * K;
  float acc[kSimtRowsPerWarp] = {};
  for (int j = 0; j < p.k; ++j) {
    const T* f = static_cast<const T*>(p.features[j]);
    for (int h = lane; h < p.H; h += 32) {
      const float wv = to_float(w[static_cast<int64_t>(j) * p.H + h]);
#pragma unroll
      for (int r = 0; r < kSimtRowsPerWarp; ++r)
        if (t0 + r < p.T) acc[r] += to_float(f[static_cast<int64_t>(t0 + r) * p.H + h]) * wv;
    }
  }
#pragma unroll
  for (int r = 0; r < kSimtRowsPerWarp; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0 && t0 + r < p.T) p.workspace[static_cast<int64_t>(t0 + r) * p.H_out + n] = v;
  }
}

// out[t] = rms_norm(sum of the split-K partial rows) * norm_weight; one block per row.
// Shared by the tensor-core and SIMT paths. A row of up to kFinalizeCachedCols outputs is
// kept in shared memory (launched with H_out floats of it), so the splits are added once.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
project_features_finalize_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  extern __shared__ float row_cache[];  // [H_out] when cached
  __shared__ float warp_ss[kSimtThreads / 32];
  const bool cached = p.H_out <= kFinalizeCachedCols;
  const int64_t t = blockIdx.x, plane = static_cast<int64_t>(p.T) * p.H_out;
  const float* ws = p.workspace + t * p.H_out;
  auto y_at = [&](int n) {
    float y = 0.f;
    for (int s = 0; s < p.splits; ++s) y += ws[s * plane + n];
    return y;
  };
  float ss = 0.f;
  for (int n = threadIdx.x; n < p.H_out; n += kSimtThreads) {
    const float y = y_at(n);
    if (cached) row_cache[n] = y;  // read back by this same thread below
    ss += y * y;
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) warp_ss[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kSimtThreads / 32; ++w) total += warp_ss[w];
  const float inv = rsqrtf(total / p.H_out + p.eps);
  const T* nw = static_cast<const T*>(p.norm_weight);
  T* out = static_cast<T*>(p.out) + t * p.H_out;
  for (int n = threadIdx.x; n < p.H_out; n += kSimtThreads)
    out[n] = from_float<T>((cached ? row_cache[n] : y_at(n)) * inv * to_float(nw[n]));
}

// ---------------------------------------------------------------- plan and launch
inline constexpr int kProjectBN = 128;

inline constexpr int kProjectSmemBytes = weight_stream_smem_bytes<kGemmBM, kProjectBN>(2);  // 16-bit only

template <class T>
int project_tc_ctas_per_sm() {
  return prepare_kernel<&project_features_tc_kernel<T, kProjectBN>>(kTileThreads, kProjectSmemBytes, "project_features");
}

bool project_features_plan(ProjectFeaturesParams& p, const DeviceLimits& dev) {
  bool tc = p.dtype != DType::kFloat32 && p.H % 8 == 0 && aligned16(p.fc_weight) &&
            kProjectSmemBytes <= dev.max_smem_per_block;
  for (int j = 0; j < p.k; ++j) tc = tc && aligned16(p.features[j]);
  p.splits = 1;
  p.k_tiles_per_split = 0;
  p.tensor_cores = tc;
  if (!tc) return false;
  // T <= 16 leaves few output tiles: split K until the grid fills one wave of resident
  // CTAs (SMs x occupancy), each split streaming enough K tiles of the weight.
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) per_sm = project_tc_ctas_per_sm<T>();
  };
  dispatch_all_types(p.dtype, occupancy);
  const int tiles = ceil_div(p.H_out, kProjectBN) * ceil_div(p.T, kGemmBM);
  const int k_tiles = ceil_div(static_cast<int64_t>(p.k) * p.H, kGemmBK);
  const SplitPlan plan = gemm_split_plan(tiles, k_tiles, static_cast<int64_t>(dev.num_sms) * per_sm);
  p.splits = plan.splits;
  p.k_tiles_per_split = plan.units_per_split;
  return true;
}

void project_features(const ProjectFeaturesParams& p, cudaStream_t stream) {
  auto partial_sums = [&]<class T>() {  // into p.workspace
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        project_tc_ctas_per_sm<T>();  // the shared-memory opt-in (once per device)
        const dim3 grid(ceil_div(p.T, kGemmBM), ceil_div(p.H_out, kProjectBN), p.splits);
        project_features_tc_kernel<T, kProjectBN><<<grid, kTileThreads, kProjectSmemBytes, stream>>>(p);
        check_launch("project_features_tc_kernel");
        return;
      }
    }
    const int64_t warps = static_cast<int64_t>(p.H_out) * ceil_div(p.T, kSimtRowsPerWarp);
    project_features_simt_kernel<T><<<ceil_div(warps * 32, kSimtThreads), kSimtThreads, 0, stream>>>(p);
    check_launch("project_features_simt_kernel");
  };
  auto run = [&]<class T>() {
    partial_sums.template operator()<T>();
    const int cached_bytes = p.H_out <= kFinalizeCachedCols ? p.H_out * static_cast<int>(sizeof(float)) : 0;
    project_features_finalize_kernel<T><<<p.T, kSimtThreads, cached_bytes, stream>>>(p);
    check_launch("project_features_finalize_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
