// project_features for one architecture: out = RMSNorm(cat(features) * fc_weight^T) * norm_weight
// at T <= kGemvMaxRows tokens (bf16/fp16, 16-byte aligned, H % 8 == 0): the weight-streaming
// GEMV (weight_stream_gemv.cuh) walks the k feature tensors as K segments (never
// concatenated), and the CTA that completes the last row block applies the RMSNorm over
// H_out. Every other case runs cuBLAS + at::rms_norm in the host file (csrc/cuda/project_features.cpp;
// the rule: project_features_path in plans.h).
#pragma once
#include "dflash/cuda/plans.h"
#include "dflash/cuda/project_features_params.h"
#include "dflash/cuda/weight_stream_gemv.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

template <class T>
struct ProjectGemv {
  static constexpr bool kSumSquares = true;
  const ProjectFeaturesParams& p;
  int tokens, rows;
  int64_t K;

  __device__ const T* weight_row(int r) const { return static_cast<const T*>(p.fc_weight) + r * K; }
  __device__ bool token_valid(int t) const { return t < tokens; }
  __device__ const void* act(int t, int k) const {  // k % 8 == 0 and H % 8 == 0: 8 elements of one segment
    const int j = k / p.H;
    return static_cast<const T*>(p.features[j]) + static_cast<int64_t>(t) * p.H + (k - j * p.H);
  }
  // out[t] = y[t] * rsqrt(mean(y[t]^2) + eps) * norm_weight, the mean from the blocks' sums of
  // squares (added in block order: deterministic).
  __device__ void finish_group(int, float* scratch, const GemvSchedule& s) const {
    float* inv_rms = scratch;  // [tokens]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int t = warp; t < tokens; t += kGemvWarps) {
      float ss = 0.f;
      for (int b = lane; b < s.row_blocks; b += 32) ss += __ldcg(s.ss + static_cast<int64_t>(b) * tokens + t);
      ss = warp_sum(ss);
      if (lane == 0) inv_rms[t] = rsqrtf(ss / rows + p.eps);
    }
    __syncthreads();
    const int64_t y_cols = static_cast<int64_t>(s.row_blocks) * kGemvRowBlock;
    const T* nw = static_cast<const T*>(p.norm_weight);
    T* out = static_cast<T*>(p.out);
    if (rows % 4 == 0) {  // 16-byte reads of y: this pass is one SM's, its bandwidth is the limit
      const int quads = rows / 4;
#pragma unroll 4
      for (int i = threadIdx.x; i < tokens * quads; i += kGemvThreads) {
        const int t = i / quads, n = (i % quads) * 4;
        const float4 y = __ldcg(reinterpret_cast<const float4*>(s.y + t * y_cols + n));
        const float inv = inv_rms[t];
        T* o = out + static_cast<int64_t>(t) * rows + n;
        o[0] = from_float<T>(y.x * inv * to_float(nw[n]));
        o[1] = from_float<T>(y.y * inv * to_float(nw[n + 1]));
        o[2] = from_float<T>(y.z * inv * to_float(nw[n + 2]));
        o[3] = from_float<T>(y.w * inv * to_float(nw[n + 3]));
      }
    } else {
      for (int i = threadIdx.x; i < tokens * rows; i += kGemvThreads) {
        const int t = i / rows, n = i % rows;
        out[i] = from_float<T>(__ldcg(s.y + t * y_cols + n) * inv_rms[t] * to_float(nw[n]));
      }
    }
  }
};

// NT: 8-token MMA tiles (1 for T <= 8, 2 for T <= 16).
template <class T, int NT>
__global__ void __launch_bounds__(kGemvThreads, 2)
project_features_gemv_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  const ProjectGemv<T> problem{p, p.T, p.H_out, static_cast<int64_t>(p.k) * p.H};
  gemv_stream<T, NT>(problem, p.gemv);
}

// ---------------------------------------------------------------- plan and launch
template <class T, int NT>
int project_gemv_ctas_per_sm() {
  return prepare_kernel<&project_features_gemv_kernel<T, NT>>(kGemvThreads, 0, "project_features");
}

template <class T>
int project_gemv_ctas_per_sm(int tokens) {
  return tokens <= 8 ? project_gemv_ctas_per_sm<T, 1>() : project_gemv_ctas_per_sm<T, 2>();
}

bool project_features_plan(ProjectFeaturesParams& p, const DeviceLimits& dev) {
  bool inputs = p.dtype != DType::kFloat32 && p.H % 8 == 0 && aligned16(p.fc_weight);
  for (int j = 0; j < p.k; ++j) inputs = inputs && aligned16(p.features[j]);
  p.gemv = GemvSchedule{};
  if (project_features_path(inputs, p.T) != GemmPath::kGemv) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) per_sm = project_gemv_ctas_per_sm<T>(p.T);
  };
  dispatch_all_types(p.dtype, occupancy);
  // one group: the RMSNorm needs every output column
  p.gemv = gemv_schedule(p.T, p.H_out, static_cast<int64_t>(p.k) * p.H, p.H_out, dev, per_sm);
  return true;
}

// Runs the GEMV planned by project_features_plan (which returned true).
void project_features(const ProjectFeaturesParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.T <= 8) project_features_gemv_kernel<T, 1><<<p.gemv.ctas, kGemvThreads, 0, stream>>>(p);
      else project_features_gemv_kernel<T, 2><<<p.gemv.ctas, kGemvThreads, 0, stream>>>(p);
      check_launch("project_features_gemv_kernel");
    }
  };
  dispatch_all_types(p.dtype, run);
}

// This architecture's launcher table (project_features_params.h), read by csrc/cuda/project_features.cpp.
extern const ProjectFeaturesLaunchers project_features_launchers{&project_features_plan, &project_features};

}  // namespace dflash::cuda::DFLASH_ARCH_NS
