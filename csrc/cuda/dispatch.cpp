// The host side every CUDA op family shares (declared in dflash/cuda/dispatch.h): the kernel
// set and limits of a device, the dtype mapping, 32-bit sizes, the GEMV workspace.
#include <ATen/ATen.h>

#include <mutex>
#include <vector>

#include "dflash/cuda/dispatch.h"

namespace dflash::cuda {

static void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "dflash_ext: ", what, " failed: ", cudaGetErrorString(err));
}

// Looked up once per device and returned by value (the cache may grow while another thread
// uses an entry).
DeviceInfo device_info(const at::Device& device) {
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache;
  const int index = device.index();
  std::lock_guard<std::mutex> lock(mutex);
  if (index >= static_cast<int>(cache.size())) cache.resize(index + 1, DeviceInfo{KernelArch::kNone, {0, 0}});
  DeviceInfo& info = cache[index];
  if (info.arch == KernelArch::kNone) {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index), "reading the compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index), "reading the compute capability");
    check_cuda(cudaDeviceGetAttribute(&info.limits.num_sms, cudaDevAttrMultiProcessorCount, index), "reading the SM count");
    check_cuda(cudaDeviceGetAttribute(&info.limits.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, index),
               "reading the shared memory limit");
    TORCH_CHECK(major >= 8, "dflash_ext CUDA kernels need compute capability 8.0 or newer (Ampere+); ",
                device, " has ", major, ".", minor);
    const KernelArch arch = kernel_arch_for(major, minor, compiled_kernel_archs());
    TORCH_CHECK(arch != KernelArch::kNone, "dflash_ext was built without kernels for ", device, " (compute capability ",
                major, ".", minor, "): rebuild with DFLASH_CUDA_ARCHS including sm80 (runs on every 8.0+ GPU) or "
                "this GPU's own set (python -m dflash_ext info lists what was built)");
    info.arch = arch;
  }
  return info;
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

int32_t narrow(int64_t value, const char* what) {
  TORCH_CHECK(value <= INT32_MAX, "dflash_ext CUDA kernels take ", what, " up to 2^31 - 1, got ", value);
  return static_cast<int32_t>(value);
}

std::pair<at::Tensor, at::Tensor> gemv_workspace(GemvSchedule& s, const at::TensorOptions& options) {
  auto workspace = at::empty({s.workspace_floats}, options.dtype(at::kFloat));
  auto counters = at::zeros({s.counter_count}, options.dtype(at::kInt));
  bind_gemv_workspace(s, workspace.data_ptr<float>(), counters.data_ptr<int>());
  return {workspace, counters};
}

}  // namespace dflash::cuda
