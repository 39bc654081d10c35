// project_features' parameter block and launcher table: the host side is
// csrc/cuda/project_features.cpp, the kernel dflash/cuda/project_features.cuh.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/cuda/params.h"

namespace dflash::cuda {

// project_features: out = rms_norm(concat(features) @ fc_weight^T) * norm_weight. The
// kernel (the GEMV) runs for T <= kGemvMaxRows; the host file runs every other case
// through cuBLAS (project_features_path in plans.h).
inline constexpr int kMaxFeatures = 16;  // more are concatenated on the host first
struct ProjectFeaturesParams {
  const void* features[kMaxFeatures];  // k tensors [T, H]
  int k, T, H, H_out;
  const void* fc_weight;    // [H_out, k*H]
  const void* norm_weight;  // [H_out]
  void* out;                // [T, H_out]
  GemvSchedule gemv;        // set by project_features_plan, workspace by the host file
  float eps;
  DType dtype;
};

// The plan returns whether the kernel (the GEMV) runs; false: the host file's cuBLAS path.
using ProjectFeaturesLaunchers = PlannedLaunchers<ProjectFeaturesParams>;
DFLASH_DECLARE_ARCH_LAUNCHERS(ProjectFeaturesLaunchers, project_features_launchers)

}  // namespace dflash::cuda
