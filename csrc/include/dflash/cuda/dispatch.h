// Host side shared by the CUDA dispatchers (csrc/cuda/ops_cuda.cpp, csrc/cuda/norms_cuda.cpp):
// every op's launchers of one compiled architecture, the lookup of a device's launchers and
// limits, and the dtype mapping. Host code only (it sees torch); the kernels never include it.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "dflash/cuda/norm_params.h"
#include "dflash/cuda/params.h"

namespace dflash::cuda {

// One compiled architecture's launchers (params.h, norm_params.h declare them per arch).
struct ArchLaunchers {
  bool (*project_features_plan)(ProjectFeaturesParams&, const DeviceLimits&);
  void (*project_features)(const ProjectFeaturesParams&, cudaStream_t);
  bool (*inject_context_kv_plan)(InjectParams&, const DeviceLimits&);
  void (*inject_context_kv)(const InjectParams&, cudaStream_t);
  bool (*block_attention_plan)(BlockAttentionParams&, const DeviceLimits&);
  void (*block_attention)(const BlockAttentionParams&, cudaStream_t);
  void (*block_conv)(const BlockConvParams&, cudaStream_t);
  void (*rms_norm)(const RmsNormParams&, cudaStream_t);
  void (*qk_norm_rope)(const QkNormRopeParams&, cudaStream_t);
};

struct DeviceInfo {
  const ArchLaunchers* launchers;
  DeviceLimits limits;
};

// The launchers of `device`'s kernel set (kernel_arch_for in plans.h: 9.0 -> sm_90a, 10.x ->
// sm_100, other 8.x and newer -> sm_80) and its limits, read once per device (defined in
// ops_cuda.cpp). Raises for compute capability below 8.0 and for a build without kernels that
// run on the device. Attribute queries only, no device work: callable while a CUDA graph is
// captured.
DeviceInfo device_info(const at::Device& device);

// The kernels' element type of a float32 / bfloat16 / float16 tensor.
DType dtype_of(const at::Tensor& t);

}  // namespace dflash::cuda
