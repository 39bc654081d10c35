// Host side every CUDA op family's host file (csrc/cuda/<family>.cpp) shares: which kernel set
// runs on a device and the device's limits (device_info), the family's launcher tables per
// kernel set (ArchTable), the dtype mapping, 32-bit sizes and the GEMV workspace (defined in
// csrc/cuda/dispatch.cpp). Host code only (it sees torch); the kernels never include it.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>

#include "dflash/cuda/params.h"
#include "dflash/cuda/plans.h"

namespace dflash::cuda {

struct DeviceInfo {
  KernelArch arch;  // the kernel set that runs on the device: always one compiled in
  DeviceLimits limits;
};

// The kernel set of `device` (kernel_arch_for in plans.h: 9.0 -> sm_90a, 10.x -> sm_100, other
// 8.x and newer -> sm_80) and its limits, read once per device. Raises for compute capability
// below 8.0 and for a build without kernels that run on the device. Attribute queries only, no
// device work: callable while a CUDA graph is captured.
DeviceInfo device_info(const at::Device& device);

// An op family's launcher table of each kernel set (DFLASH_DECLARE_ARCH_LAUNCHERS in
// params.h); a set not compiled in (DFLASH_CUDA_ARCHS) is null, and device_info never picks it.
template <class Launchers>
struct ArchTable {
  const Launchers* sm80;
  const Launchers* sm90a;
  const Launchers* sm100;
  const Launchers& operator[](KernelArch arch) const {
    return *(arch == KernelArch::kSm90a ? sm90a : arch == KernelArch::kSm100 ? sm100 : sm80);
  }
};

#ifdef DFLASH_CUDA_ARCH_SM80
#define DFLASH_SM80_LAUNCHERS(name) &sm80::name
#else
#define DFLASH_SM80_LAUNCHERS(name) nullptr
#endif
#ifdef DFLASH_CUDA_ARCH_SM90A
#define DFLASH_SM90A_LAUNCHERS(name) &sm90a::name
#else
#define DFLASH_SM90A_LAUNCHERS(name) nullptr
#endif
#ifdef DFLASH_CUDA_ARCH_SM100
#define DFLASH_SM100_LAUNCHERS(name) &sm100::name
#else
#define DFLASH_SM100_LAUNCHERS(name) nullptr
#endif
// The ArchTable of a family's launcher tables `name`, e.g.
//   constexpr ArchTable<BlockConvLaunchers> kLaunchers = DFLASH_ARCH_TABLE(block_conv_launchers);
#define DFLASH_ARCH_TABLE(name) \
  { DFLASH_SM80_LAUNCHERS(name), DFLASH_SM90A_LAUNCHERS(name), DFLASH_SM100_LAUNCHERS(name) }

// The kernels' element type of a float32 / bfloat16 / float16 tensor.
DType dtype_of(const at::Tensor& t);

// `value` as the kernels' 32-bit size; raises naming `what` above 2^31 - 1.
int32_t narrow(int64_t value, const char* what);

// The fp32 workspace and zeroed counters of a GEMV schedule, bound into it (returned: they
// must outlive the launch).
std::pair<at::Tensor, at::Tensor> gemv_workspace(GemvSchedule& s, const at::TensorOptions& options);

}  // namespace dflash::cuda
