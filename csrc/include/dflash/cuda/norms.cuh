// The draft layer's norms on CUDA (specs: dflash_ext.ops.reference.rms_norm, qk_norm_rope).
// Bound by memory and small (a draft step's rows), so plain SIMT kernels, fp32 math, one
// cast at each store. Rows are read and written in 16-byte accesses (8 bf16 / fp16 or 4 fp32
// elements) when the host found every pointer 16-byte aligned and every row a whole number of
// them (p.vec); element by element otherwise (any H, any offset), with the same math:
//   rms_norm_kernel      one CTA per row: the sum of squares reduced over the CTA, then the
//                        row re-read, scaled and stored (with a residual: the rounded sum
//                        x + residual is stored first, and normed, as a separate add would);
//   qk_norm_rope_kernel  one warp per (row, q or k head): the head's sum of squares reduced
//                        over the warp, then each lane rotates the pairs (i, i + D/2) of its
//                        elements i (a 16-byte vector of each half, or one element).
// Compiled and SASS-checked for sm_80 / sm_90a / sm_100; not yet run on a GPU.
#pragma once
#include "dflash/cuda/common.cuh"
#include "dflash/cuda/norms_params.h"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kNormWarps = kSimtThreads / 32;

// N consecutive elements, moved in one access: a 16-byte vector (N = 16 / sizeof(T)) or one
// element (N = 1).
template <class T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

template <int N, class T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  static_assert(N == 1 || N * sizeof(T) == 16, "a pack is one element or 16 bytes");
  if constexpr (N == 1) {
    return {{*p}};
  } else {
    Pack<T, N> r;
    *reinterpret_cast<uint4*>(r.v) = *reinterpret_cast<const uint4*>(p);
    return r;
  }
}

template <int N, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& r) {
  if constexpr (N == 1) *p = r.v[0];
  else *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(r.v);
}

// Calls f.template operator()<N>() with N = 16 / sizeof(T) (16-byte accesses) or 1.
template <class T, class F>
__device__ __forceinline__ void with_pack_width(bool vec, F&& f) {
  if (vec) f.template operator()<16 / static_cast<int>(sizeof(T))>();
  else f.template operator()<1>();
}

template <class T>
__global__ void __launch_bounds__(kSimtThreads) rms_norm_kernel(const RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const bool add = p.residual != nullptr;
  const T* x = static_cast<const T*>(p.x) + row * p.H;
  const T* residual = add ? static_cast<const T*>(p.residual) + row * p.H : nullptr;
  T* sum = add ? static_cast<T*>(p.sum) + row * p.H : nullptr;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + row * p.H;
  // Thread t takes the packs at t, t + blockDim.x, ... in both passes.
  float squares = 0.f;
  with_pack_width<T>(p.vec, [&]<int N>() {
    for (int c = threadIdx.x * N; c < p.H; c += blockDim.x * N) {
      Pack<T, N> v = load_pack<N>(x + c);
      if (add) {
        const Pack<T, N> r = load_pack<N>(residual + c);
#pragma unroll
        for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(to_float(v.v[i]) + to_float(r.v[i]));
        store_pack(sum + c, v);  // read back below by this same thread
      }
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float f = to_float(v.v[i]);
        squares += f * f;
      }
    }
  });
  __shared__ float partial[kNormWarps];
  squares = warp_sum(squares);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormWarps; ++i) total += partial[i];
  const float inv = rsqrtf(total / static_cast<float>(p.H) + p.eps);
  const T* normed = add ? sum : x;
  with_pack_width<T>(p.vec, [&]<int N>() {
    for (int c = threadIdx.x * N; c < p.H; c += blockDim.x * N) {
      const Pack<T, N> v = load_pack<N>(normed + c), wv = load_pack<N>(w + c);
      Pack<T, N> o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(to_float(v.v[i]) * inv * to_float(wv.v[i]));
      store_pack(out + c, o);
    }
  });
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
  const int half = p.D / 2;
  // Lane l takes the packs at i = l·N, (l + 32)·N, ... of the first half and the same ones of
  // the second (i + half) in both passes.
  with_pack_width<T>(p.vec, [&]<int N>() {
    float squares = 0.f;
    for (int i = lane * N; i < half; i += 32 * N) {
      const Pack<T, N> lo = load_pack<N>(src + i), hi = load_pack<N>(src + i + half);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float a = to_float(lo.v[e]), b = to_float(hi.v[e]);
        squares += a * a;
        squares += b * b;
      }
    }
    const float inv = rsqrtf(warp_sum(squares) / static_cast<float>(p.D) + p.eps);
    for (int i = lane * N; i < half; i += 32 * N) {  // rotate_half: [-x2, x1]
      const Pack<T, N> lo = load_pack<N>(src + i), hi = load_pack<N>(src + i + half);
      const Pack<T, N> w_lo = load_pack<N>(w + i), w_hi = load_pack<N>(w + i + half);
      const Pack<T, N> c_lo = load_pack<N>(cos + i), c_hi = load_pack<N>(cos + i + half);
      const Pack<T, N> s_lo = load_pack<N>(sin + i), s_hi = load_pack<N>(sin + i + half);
      Pack<T, N> o_lo, o_hi;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float x1 = to_float(lo.v[e]) * inv * to_float(w_lo.v[e]);
        const float x2 = to_float(hi.v[e]) * inv * to_float(w_hi.v[e]);
        o_lo.v[e] = from_float<T>(x1 * to_float(c_lo.v[e]) - x2 * to_float(s_lo.v[e]));
        o_hi.v[e] = from_float<T>(x2 * to_float(c_hi.v[e]) + x1 * to_float(s_hi.v[e]));
      }
      store_pack(dst + i, o_lo);
      store_pack(dst + i + half, o_hi);
    }
  });
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

// This architecture's launcher table (norms_params.h), read by csrc/cuda/norms.cpp.
extern const NormsLaunchers norms_launchers{&rms_norm, &qk_norm_rope};

}  // namespace dflash::cuda::DFLASH_ARCH_NS
