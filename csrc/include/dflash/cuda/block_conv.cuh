// block_conv on CUDA: DFlash2's dynamic depthwise convolution along each block of B slots,
//   out[m, i, c] = sum_{t <= i, t < T} (base[t, c] + delta[m, i, t, c / (H / G)]) * x[m, i - t, c].
// Elementwise over channels and bound by memory: one CTA per output row (m, i), its threads
// striding over the channels, the taps accumulated in fp32 and the result cast once. The
// x rows a tap reads are the block's previous rows, which the neighbouring CTAs read too
// (served from L2). Every dtype takes this one kernel (no tensor-core path: no GEMM here).
#pragma once
#include "dflash/cuda/block_conv_params.h"
#include "dflash/cuda/common.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

template <class T>
__global__ void __launch_bounds__(kSimtThreads) block_conv_kernel(const BlockConvParams p) {
  const int64_t row = blockIdx.x;  // m * B + i
  const int i = static_cast<int>(row % p.B);
  const int taps = min(p.T, i + 1);  // a tap before the block's first slot reads nothing
  const int group = p.H / p.G;
  const T* x = static_cast<const T*>(p.x);
  const T* base = static_cast<const T*>(p.base);
  const T* delta = static_cast<const T*>(p.delta) + row * p.T * p.G;
  T* out = static_cast<T*>(p.out) + row * p.H;
  for (int c = threadIdx.x; c < p.H; c += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < taps; ++t) {
      const float w = to_float(base[static_cast<int64_t>(t) * p.H + c]) + to_float(delta[t * p.G + c / group]);
      acc += w * to_float(x[(row - t) * p.H + c]);
    }
    out[c] = from_float<T>(acc);
  }
}

void block_conv(const BlockConvParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    block_conv_kernel<T><<<static_cast<unsigned>(p.M * p.B), kSimtThreads, 0, stream>>>(p);
    check_launch("block_conv_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

// This architecture's launcher table (block_conv_params.h), read by csrc/cuda/block_conv.cpp.
extern const BlockConvLaunchers block_conv_launchers{&block_conv};

}  // namespace dflash::cuda::DFLASH_ARCH_NS
