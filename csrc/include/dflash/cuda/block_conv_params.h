// block_conv's parameter block and launcher table: the host side is csrc/cuda/block_conv.cpp,
// the kernel dflash/cuda/block_conv.cuh.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/cuda/params.h"

namespace dflash::cuda {

// block_conv (DFlash2): out[m, i, c] = sum_{t <= i, t < T} (base[t, c] + delta[m, i, t, c / (H / G)])
// * x[m, i - t, c].
struct BlockConvParams {
  const void* x;      // [M, B, H]
  const void* base;   // [T, H]
  const void* delta;  // [M, B, T, G]
  void* out;          // [M, B, H]
  int64_t M;
  int B, H, T, G;
  DType dtype;
};

struct BlockConvLaunchers {
  void (*launch)(const BlockConvParams& p, cudaStream_t stream);
};
DFLASH_DECLARE_ARCH_LAUNCHERS(BlockConvLaunchers, block_conv_launchers)

}  // namespace dflash::cuda
