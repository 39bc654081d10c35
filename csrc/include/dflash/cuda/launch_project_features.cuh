// Host side of project_features for one architecture: kernel choice, split-K plan, launch.
#pragma once
#include "dflash/cuda/gemm_kernels.cuh"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kProjectBN = 128;
inline constexpr int kProjectMinKTilesPerSplit = 4;

inline constexpr int kProjectSmemBytes = weight_stream_smem_bytes<kGemmBM, kProjectBN>(2);  // 16-bit only

bool project_features_plan(ProjectFeaturesParams& p, const DeviceLimits& dev) {
  bool tc = p.dtype != DType::kFloat32 && p.H % 8 == 0 && aligned16(p.fc_weight) &&
            kProjectSmemBytes <= dev.max_smem_per_block;
  for (int j = 0; j < p.k; ++j) tc = tc && aligned16(p.features[j]);
  p.splits = 1;
  p.k_tiles_per_split = 0;
  p.tensor_cores = tc;
  if (!tc) return false;
  // T <= 16 leaves few output tiles: split K until the grid fills the SMs twice, keeping
  // each split long enough to stream its weights efficiently.
  const int tiles = ceil_div(p.H_out, kProjectBN) * ceil_div(p.T, kGemmBM);
  const int k_tiles = ceil_div(static_cast<int64_t>(p.k) * p.H, kGemmBK);
  const int max_splits = std::max(1, k_tiles / kProjectMinKTilesPerSplit);
  const int want = std::min(max_splits, std::max(1, ceil_div(2 * dev.num_sms, tiles)));
  p.k_tiles_per_split = std::max(1, ceil_div(k_tiles, want));
  p.splits = std::max(1, ceil_div(k_tiles, p.k_tiles_per_split));
  return true;
}

void project_features(const ProjectFeaturesParams& p, cudaStream_t stream) {
  auto partial_sums = [&]<class T>() {  // into p.workspace
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        auto* kernel = &project_features_tc_kernel<T, kProjectBN>;
        set_smem_limit(reinterpret_cast<const void*>(kernel), kProjectSmemBytes, "project_features");
        const dim3 grid(ceil_div(p.T, kGemmBM), ceil_div(p.H_out, kProjectBN), p.splits);
        kernel<<<grid, kTileThreads, kProjectSmemBytes, stream>>>(p);
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
    project_features_finalize_kernel<T><<<p.T, kSimtThreads, 0, stream>>>(p);
    check_launch("project_features_finalize_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
