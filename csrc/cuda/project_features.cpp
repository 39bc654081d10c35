// CUDA host side of project_features: the shared input checks, contiguous operands, the
// launch (project_features_plan: the fused GEMV at T <= kGemvMaxRows) or the cuBLAS path
// (every other case), and the GEMV's workspace. Kernel: dflash/cuda/project_features.cuh.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/project_features_params.h"

namespace dflash::cuda {
namespace {

constexpr ArchTable<ProjectFeaturesLaunchers> kLaunchers = DFLASH_ARCH_TABLE(project_features_launchers);

// The cuBLAS path of project_features (project_features_path in plans.h: prefill-sized T,
// fp32, inputs the GEMV does not take): at::mm with an fp32 result (16-bit inputs: the
// same numerics as the kernel, fp32 sums normed in fp32), then at::rms_norm.
at::Tensor project_features_library(at::TensorList features, const at::Tensor& fc_weight,
                                    const at::Tensor& norm_weight, double eps) {
  const auto x = features.size() == 1 ? features[0] : at::cat(features, 1);
  const auto y = x.scalar_type() == at::kFloat ? at::mm(x, fc_weight.t()) : at::mm(x, fc_weight.t(), at::kFloat);
  return at::rms_norm(y, {y.size(1)}, norm_weight.to(at::kFloat), eps).to(x.scalar_type());
}

at::Tensor project_features_cuda(at::TensorList features, const at::Tensor& fc_weight,
                                 const at::Tensor& norm_weight, double eps) {
  const auto dims = check_project_features(features, fc_weight, norm_weight, eps);
  const c10::cuda::CUDAGuard guard(features[0].device());
  auto out = at::empty({dims.T, dims.H_out}, features[0].options());
  if (out.numel() == 0) return out;
  if (dims.T > kGemvMaxRows) return project_features_library(features, fc_weight, norm_weight, eps);
  std::vector<at::Tensor> feats;
  for (const auto& f : features) feats.push_back(f.contiguous());
  if (static_cast<int>(feats.size()) > kMaxFeatures) feats = {at::cat(feats, 1)};  // rare: many layers
  const auto weight = fc_weight.contiguous(), norm = norm_weight.contiguous();
  const auto info = device_info(out.device());
  const ProjectFeaturesLaunchers& kernels = kLaunchers[info.arch];
  ProjectFeaturesParams p{};
  for (size_t j = 0; j < feats.size(); ++j) p.features[j] = feats[j].data_ptr();
  p.k = static_cast<int>(feats.size());
  p.T = static_cast<int>(dims.T);
  p.H = narrow(feats[0].size(1), "H");
  p.H_out = narrow(dims.H_out, "H_out");
  narrow(p.k * static_cast<int64_t>(p.H), "k * H");
  p.fc_weight = weight.data_ptr();
  p.norm_weight = norm.data_ptr();
  p.out = out.data_ptr();
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(out);
  if (!kernels.plan(p, info.limits))
    return project_features_library(features, fc_weight, norm_weight, eps);
  const auto workspace = gemv_workspace(p.gemv, out.options());
  kernels.launch(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("project_features", &dflash::cuda::project_features_cuda);
}
