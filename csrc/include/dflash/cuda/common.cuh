// Device helpers shared by the dflash CUDA kernels: element types, conversions, warp
// reductions, 16-byte cp.async with zero fill, launch error checks, the SIMT block size.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "dflash/cuda/params.h"

// Each CUDA source (setup.py generates <family>_<arch>.cu) includes its op family's header
// (<family>.cuh) once for one architecture and names that architecture's namespace here, so
// the kernels of different files never share a symbol.
#ifndef DFLASH_ARCH_NS
#error "define DFLASH_ARCH_NS (sm80, sm90a, sm100) before including the dflash CUDA kernels"
#endif

namespace dflash::cuda::DFLASH_ARCH_NS {

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("dflash_ext: launch of ") + what + " failed: " +
                             cudaGetErrorString(err));
}

// Per-device, once-per-kernel launch set-up: raises the kernel's dynamic shared-memory
// limit (above 48 KiB it must be opted into) and returns how many CTAs of `threads`
// threads and `smem` bytes stay resident per SM (the occupancy the split plans size the
// grid from). Cached per (kernel, device): cudaFuncSetAttribute once, not on every call.
// Where no device answers (the host checks build these plans without a GPU) it counts 1.
template <auto Kernel>
int prepare_kernel(int threads, int smem, const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 = not prepared yet on that device
  int devices = 0, device = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDevice(&device) != cudaSuccess ||
      device < 0 || device >= kMaxDevices) {
    cudaGetLastError();  // clear the (non-sticky) error of the failed query
    return 1;
  }
  if (const int known = cached[device].load(std::memory_order_relaxed)) return known;
  const void* fn = reinterpret_cast<const void*>(Kernel);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("dflash_ext: ") + what + " needs " + std::to_string(smem) +
                               " bytes of shared memory: " + cudaGetErrorString(err));
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem) != cudaSuccess) {
    cudaGetLastError();
    per_sm = 1;
  }
  per_sm = per_sm < 1 ? 1 : per_sm;
  cached[device].store(per_sm, std::memory_order_relaxed);
  return per_sm;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Block size of the SIMT kernels of every op: the plain CUDA-core path for every dtype
// (float32 in particular) and for shapes the tensor-core kernels do not take (odd widths,
// head dims other than 64 and 128, unaligned bases); fp32 accumulation, correctness over speed.
inline constexpr int kSimtThreads = 128;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(cutlass::bfloat16_t x) { return float(x); }
__device__ __forceinline__ float to_float(cutlass::half_t x) { return float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x) { return T(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// 16-byte global->shared copy; copies zeros when !pred (src is then not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}

// A 4-byte shared-memory store (a generic store through a CuTe smem tensor element
// compiles to 2-byte generic stores).
__device__ __forceinline__ void st_shared_4(void* smem, uint32_t v) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dst), "r"(v) : "memory");
}

// Calls f.template operator()<T>() with T the element type of `dtype` (float or CUTLASS's
// 16-bit types).
template <class F>
void dispatch_all_types(DType dtype, F&& f) {
  if (dtype == DType::kFloat32) f.template operator()<float>();
  else if (dtype == DType::kBFloat16) f.template operator()<cutlass::bfloat16_t>();
  else f.template operator()<cutlass::half_t>();
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
