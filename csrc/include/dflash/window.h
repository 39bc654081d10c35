// The window rule of block_attention, shared by the op checks, the CPU kernels, the CUDA
// plans and the CUDA kernels (plain C++ that nvcc also compiles for the device).
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

// Cache rows a sequence with `len` context rows attends to: the last `window` (0 = all).
DFLASH_HOST_DEVICE constexpr int64_t visible_context(int64_t len, int64_t window) {
  return (window > 0 && len > window) ? window : len;
}

}  // namespace dflash
