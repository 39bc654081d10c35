// The simple path: plain CUDA-core kernels for every dtype (float32 in particular) and
// for shapes the tensor-core kernels do not take (odd widths, head dims other than 64 and
// 128, unaligned bases). fp32 accumulation throughout; correctness over speed.
#pragma once
#include <cmath>

#include "dflash/cuda/common.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kSimtThreads = 128;
inline constexpr int kSimtRowsPerWarp = 4;  // project_features: rows sharing one weight read

// workspace[t, n] = sum_j features[j][t] . fc_weight[n, j*H : (j+1)*H]; one warp per
// (n, group of kSimtRowsPerWarp rows).
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
project_features_simt_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int row_groups = (p.T + kSimtRowsPerWarp - 1) / kSimtRowsPerWarp;
  if (warp >= static_cast<int64_t>(p.H_out) * row_groups) return;
  const int n = static_cast<int>(warp / row_groups), t0 = static_cast<int>(warp % row_groups) * kSimtRowsPerWarp;
  const int64_t K = static_cast<int64_t>(p.k) * p.H;
  const T* w = static_cast<const T*>(p.fc_weight) + n * K;
  float acc[kSimtRowsPerWarp] = {};
  for (int j = 0; j < p.k; ++j) {
    const T* f = static_cast<const T*>(p.features[j]);
    for (int h = lane; h < p.H; h += 32) {
      const float wv = to_float(w[static_cast<int64_t>(j) * p.H + h]);
#pragma unroll
      for (int r = 0; r < kSimtRowsPerWarp; ++r)
        if (t0 + r < p.T) acc[r] += to_float(f[static_cast<int64_t>(t0 + r) * p.H + h]) * wv;
    }
  }
#pragma unroll
  for (int r = 0; r < kSimtRowsPerWarp; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0 && t0 + r < p.T) p.workspace[static_cast<int64_t>(t0 + r) * p.H_out + n] = v;
  }
}

// out[t] = rms_norm(sum of the split-K partial rows) * norm_weight; one block per row.
// Shared by the tensor-core and SIMT paths. A row of up to kFinalizeCachedCols outputs is
// kept in shared memory (launched with H_out floats of it), so the splits are added once.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
project_features_finalize_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  extern __shared__ float row_cache[];  // [H_out] when cached
  __shared__ float warp_ss[kSimtThreads / 32];
  const bool cached = p.H_out <= kFinalizeCachedCols;
  const int64_t t = blockIdx.x, plane = static_cast<int64_t>(p.T) * p.H_out;
  const float* ws = p.workspace + t * p.H_out;
  auto y_at = [&](int n) {
    float y = 0.f;
    for (int s = 0; s < p.splits; ++s) y += ws[s * plane + n];
    return y;
  };
  float ss = 0.f;
  for (int n = threadIdx.x; n < p.H_out; n += kSimtThreads) {
    const float y = y_at(n);
    if (cached) row_cache[n] = y;  // read back by this same thread below
    ss += y * y;
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) warp_ss[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kSimtThreads / 32; ++w) total += warp_ss[w];
  const float inv = rsqrtf(total / p.H_out + p.eps);
  const T* nw = static_cast<const T*>(p.norm_weight);
  T* out = static_cast<T*>(p.out) + t * p.H_out;
  for (int n = threadIdx.x; n < p.H_out; n += kSimtThreads)
    out[n] = from_float<T>((cached ? row_cache[n] : y_at(n)) * inv * to_float(nw[n]));
}

// inject_context_kv's index guard (params.h): token t is written only where its slot is
// in [0, S) and its position in [0, P); -1 (skip) and, with validation off, bad values
// write nothing.
__device__ __forceinline__ bool inject_row_valid(const InjectParams& p, int t) {
  const int64_t slot = p.slots[t], pos = p.positions[t];
  return slot >= 0 && slot < p.S && pos >= 0 && pos < p.P;
}

// The inject epilogue of one (layer, k|v, head) row of token t, by one warp, from its D
// fp32 projections x (shared memory): V as it is, K RMS-normed with k_norm_weight and
// rotated (rotate_half RoPE at positions[t]). Shared by every inject kernel.
template <class T>
__device__ void store_kv_row(const InjectParams& p, int layer, bool is_v, int head, int t, const float* x) {
  const int lane = threadIdx.x % 32, D = p.D;
  T* dst = static_cast<T*>(is_v ? p.v_cache : p.k_cache) +
           ((static_cast<int64_t>(layer) * p.S + p.slots[t]) * p.Hkv + head) * D;
  if (is_v) {
    for (int d = lane; d < D; d += 32) dst[d] = from_float<T>(x[d]);
    return;
  }
  float ss = 0.f;
  for (int d = lane; d < D; d += 32) ss += x[d] * x[d];
  const float inv = rsqrtf(warp_sum(ss) / D + p.eps);
  const T* nw = static_cast<const T*>(p.k_norm_weight) + static_cast<int64_t>(layer) * D;
  const int64_t pos = p.positions[t];
  const T* cos_row = static_cast<const T*>(p.cos) + pos * D;
  const T* sin_row = static_cast<const T*>(p.sin) + pos * D;
  for (int d = lane; d < D; d += 32) {
    const int pd = d < D / 2 ? d + D / 2 : d - D / 2;  // rotate_half partner
    const float xd = x[d] * inv * to_float(nw[d]);
    const float xp = x[pd] * inv * to_float(nw[pd]);
    dst[d] = from_float<T>(xd * to_float(cos_row[d]) + (d < D / 2 ? -xp : xp) * to_float(sin_row[d]));
  }
}

// One block per (token, layer, k|v, head): the warps compute the D projections into
// shared memory, then warp 0 writes the cache row.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
inject_context_kv_simt_kernel(const __grid_constant__ InjectParams p) {
  extern __shared__ float y[];  // [D]
  const int t = blockIdx.x;
  if (!inject_row_valid(p, t)) return;
  const int layer = blockIdx.y / (2 * p.Hkv);
  const bool is_v = (blockIdx.y % (2 * p.Hkv)) >= p.Hkv;
  const int head = blockIdx.y % p.Hkv, D = p.D;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* x = static_cast<const T*>(p.ctx) + static_cast<int64_t>(t) * p.H;
  const T* w = static_cast<const T*>(is_v ? p.v_weight : p.k_weight) +
               (static_cast<int64_t>(layer) * p.Hkv + head) * D * p.H;
  for (int d = warp; d < D; d += kSimtThreads / 32) {
    float acc = 0.f;
    for (int h = lane; h < p.H; h += 32) acc += to_float(x[h]) * to_float(w[static_cast<int64_t>(d) * p.H + h]);
    acc = warp_sum(acc);
    if (lane == 0) y[d] = acc;
  }
  __syncthreads();
  if (warp == 0) store_kv_row<T>(p, layer, is_v, head, t, y);
}

// Split-K inject (splits > 1): adds the fp32 partial projections of one (token, layer,
// k|v, head) row over the splits, then the same epilogue. One warp per block.
template <class T>
__global__ void __launch_bounds__(32)
inject_context_kv_finalize_kernel(const __grid_constant__ InjectParams p) {
  extern __shared__ float y[];  // [D]
  const int t = blockIdx.x, row = blockIdx.y;
  if (!inject_row_valid(p, t)) return;
  const int64_t plane = static_cast<int64_t>(gridDim.y) * p.T * p.D;  // one split's partials
  const float* ws = p.workspace + (static_cast<int64_t>(row) * p.T + t) * p.D;
  for (int d = threadIdx.x; d < p.D; d += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.splits; ++s) acc += ws[s * plane + d];
    y[d] = acc;
  }
  __syncwarp();
  store_kv_row<T>(p, row / (2 * p.Hkv), (row % (2 * p.Hkv)) >= p.Hkv, row % p.Hkv, t, y);
}

// One warp per (sequence, query, q head): online softmax over the keys, D <= 256.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
block_attention_simt_kernel(const __grid_constant__ BlockAttentionParams p) {
  constexpr int kPerLane = kSimtMaxHeadDim / 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq) return;
  const int h = warp % p.Hq, b = warp / (static_cast<int64_t>(p.Hq) * p.Bq);
  const int kvh = h / (p.Hq / p.Hkv), D = p.D;
  const KeyRange keys = key_range(p, b);
  const T* q = static_cast<const T*>(p.q) + warp * D;
  float qv[kPerLane], o[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < D ? to_float(q[d]) * p.scale : 0.f;
    o[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int key = 0; key < keys.total; ++key) {
    const bool from_block = key >= keys.n_ctx;
    const int64_t row = from_block ? (static_cast<int64_t>(b) * p.Bq + (key - keys.n_ctx)) * p.Hkv + kvh
                                   : (keys.start + key) * p.Hkv + kvh;
    const T* k = static_cast<const T*>(from_block ? p.k_block : p.k_cache) + row * D;
    const T* v = static_cast<const T*>(from_block ? p.v_block : p.v_cache) + row * D;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < D) s += qv[j] * to_float(k[lane + 32 * j]);
    s = warp_sum(s);
    const float m_new = fmaxf(m, s), alpha = expf(m - m_new), e = expf(s - m_new);
    l = l * alpha + e;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < D) o[j] = o[j] * alpha + e * to_float(v[lane + 32 * j]);
    m = m_new;
  }
  T* out = static_cast<T*>(p.out) + warp * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < D) out[lane + 32 * j] = from_float<T>(o[j] / l);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
