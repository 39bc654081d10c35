// The draft layer's norms on CUDA (specs: dflash_ext.reference.rms_norm, qk_norm_rope).
// Bound by memory and small (a draft step's rows), so plain SIMT kernels, fp32 math, one
// cast at each store, coalesced element-wise loads (no 16-byte vector loads: the rows are
// a few KB and a step has few of them):
//   rms_norm_kernel      one CTA per row: the sum of squares reduced over the CTA, then the
//                        row re-read, scaled and stored (with a residual: the rounded sum
//                        x + residual is stored first, and normed, as a separate add would);
//   qk_norm_rope_kernel  one warp per (row, q or k head): the head's sum of squares reduced
//                        over the warp, then each lane rotates pairs (i, i + D/2).
// Compiled and SASS-checked for sm_80 / sm_90a / sm_100; not yet run on a GPU.
#pragma once
#include "dflash/cuda/common.cuh"
#include "dflash/cuda/norm_params.h"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kNormWarps = kSimtThreads / 32;

template <class T>
__global__ void __launch_bounds__(kSimtThreads) rms_norm_kernel(const RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const bool add = p.residual != nullptr;
  const T* x = static_cast<const T*>(p.x) + row * p.H;
  const T* residual = add ? static_cast<const T*>(p.residual) + row * p.H : nullptr;
  T* sum = add ? static_cast<T*>(p.sum) + row * p.H : nullptr;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + row * p.H;
  float squares = 0.f;
  for (int c = threadIdx.x; c < p.H; c += blockDim.x) {
    float v = to_float(x[c]);
    if (add) {
      const T s = from_float<T>(v + to_float(residual[c]));
      sum[c] = s;  // read back below by this same thread
      v = to_float(s);
    }
    squares += v * v;
  }
  __shared__ float partial[kNormWarps];
  squares = warp_sum(squares);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormWarps; ++i) total += partial[i];
  const float inv = rsqrtf(total / static_cast<float>(p.H) + p.eps);
  const T* normed = add ? sum : x;
  for (int c = threadIdx.x; c < p.H; c += blockDim.x)
    out[c] = from_float<T>(to_float(normed[c]) * inv * to_float(w[c]));
}

template <class T>
__global__ void __launch_bounds__(kSimtThreads) qk_norm_rope_kernel(const QkNormRopeParams p) {
  const int heads = p.Hq + p.Hkv;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;  // (row, head)
  if (item >= p.M * heads) return;  // whole warps only: no CTA barrier below
  const int lane = threadIdx.x % 32;
  const int64_t m = item / heads;
  const int j = static_cast<int>(item % heads);
  const bool is_q = j < p.Hq;
  const T* src = static_cast<const T*>(p.qkv) + m * p.ld + static_cast<int64_t>(j) * p.D;
  const T* w = static_cast<const T*>(is_q ? p.q_norm_weight : p.k_norm_weight);
  T* dst = is_q ? static_cast<T*>(p.q) + (m * p.Hq + j) * p.D : static_cast<T*>(p.k) + (m * p.Hkv + j - p.Hq) * p.D;
  const T* cos = static_cast<const T*>(p.cos) + m * p.D;
  const T* sin = static_cast<const T*>(p.sin) + m * p.D;
  float squares = 0.f;
  for (int i = lane; i < p.D; i += 32) {
    const float v = to_float(src[i]);
    squares += v * v;
  }
  const float inv = rsqrtf(warp_sum(squares) / static_cast<float>(p.D) + p.eps);
  const int half = p.D / 2;
  for (int i = lane; i < half; i += 32) {  // rotate_half: [-x2, x1]
    const float x1 = to_float(src[i]) * inv * to_float(w[i]);
    const float x2 = to_float(src[i + half]) * inv * to_float(w[i + half]);
    dst[i] = from_float<T>(x1 * to_float(cos[i]) - x2 * to_float(sin[i]));
    dst[i + half] = from_float<T>(x2 * to_float(cos[i + half]) + x1 * to_float(sin[i + half]));
  }
}

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    rms_norm_kernel<T><<<static_cast<unsigned>(p.rows), kSimtThreads, 0, stream>>>(p);
    check_launch("rms_norm_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

void qk_norm_rope(const QkNormRopeParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    const unsigned blocks = static_cast<unsigned>(ceil_div(p.M * (p.Hq + p.Hkv), kNormWarps));
    qk_norm_rope_kernel<T><<<blocks, kSimtThreads, 0, stream>>>(p);
    check_launch("qk_norm_rope_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
