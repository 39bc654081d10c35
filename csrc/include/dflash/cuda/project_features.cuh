// Host side of project_features for one architecture: kernel choice, split-K plan, launch.
#pragma once
#include "dflash/cuda/weight_stream_gemm.cuh"
#include "dflash/cuda/plans.h"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

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
