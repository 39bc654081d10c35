// Tensor-core kernels of project_features and inject_context_kv: a weight-streaming GEMM
// (C[T, N] = A[T, K] * W[N, K]^T, both row-major) with a cp.async multi-stage pipeline
// feeding TileGemm, and two epilogues:
//   - project_features: A is the k feature tensors walked as K-segments (never
//     concatenated); split-K CTAs write fp32 partial sums, and a finalize kernel adds the
//     splits and applies the RMSNorm over H_out (simt_kernels.cuh, shared with the SIMT path);
//   - inject_context_kv: one launch for all layers; each CTA owns one (layer, k|v, head)
//     N-tile of width D, so its epilogue applies the per-head k RMSNorm and RoPE and
//     scatters the rows into k_cache / v_cache by `slots`. Few tokens give few CTAs, so
//     the plan may split K (grid.z): the splits then write fp32 partials and a finalize
//     pass (simt_kernels.cuh) adds them before the same epilogue sees the full sum.
//     Rows of skipped tokens (slot -1, or a bad index with validation off) are not read
//     (zero filled), and a tile with no written row does no work.
// Requirements (checked by the plan functions, else the SIMT path runs): bf16/fp16,
// H % 8 == 0 (16-byte chunks never straddle a feature segment), 16-byte aligned bases.
#pragma once
#include "dflash/cuda/simt_kernels.cuh"
#include "dflash/cuda/tile_gemm.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kGemmBK = 64;     // K tile: one 128-byte swizzle row of 16-bit elements
inline constexpr int kGemmStages = 4;  // cp.async pipeline depth
#if DFLASH_USE_WGMMA
inline constexpr int kGemmBM = 64;     // wgmma M is 64 rows
inline constexpr int kGemmWarpsM = 4;  // unused by the wgmma path
#else
inline constexpr int kGemmBM = 16;     // T <= 16 per decode step: one mma.sync M
inline constexpr int kGemmWarpsM = 1;  // the four warps split N
#endif

// Copies a Rows x BK tile into `s` (a (Rows, BK) smem tensor) 16 bytes at a time.
// src(r, kk) returns the global address of elements [kk, kk+8) of tile row r, or nullptr
// for rows/columns outside the problem (zero filled).
template <int Rows, int BK, class Smem, class Src>
__device__ __forceinline__ void load_tile_async(Smem& s, const Src& src, const void* any_valid) {
  constexpr int kChunksPerRow = BK / 8;
  for (int c = threadIdx.x; c < Rows * kChunksPerRow; c += kTileThreads) {
    const int r = c / kChunksPerRow, kk = (c % kChunksPerRow) * 8;
    const void* g = src(r, kk);
    cp_async_16(&s(r, kk), g ? g : any_valid, g != nullptr);
  }
}

// acc += A[BM, K-range] * B[BN, K-range]^T over K tiles [kt_begin, kt_end).
template <class Gemm, class T, int BM, int BN, class ASrc, class BSrc, class Acc>
__device__ void weight_stream_mainloop(Acc& acc, const ASrc& a_src, const BSrc& b_src,
                                       const void* any_valid, int kt_begin, int kt_end, T* smem) {
  constexpr int BK = kGemmBK, S = kGemmStages;
  using LayoutA = typename Gemm::LayoutA;
  using LayoutB = typename Gemm::LayoutB;
  T* a_base = smem;
  T* b_base = smem + S * cosize(LayoutA{});
  auto load = [&](int kt, int stage) {
    auto a = smem_stage<LayoutA>(a_base, stage);
    auto b = smem_stage<LayoutB>(b_base, stage);
    const int k0 = kt * BK;
    load_tile_async<BM, BK>(a, [&](int r, int kk) { return a_src(r, k0 + kk); }, any_valid);
    load_tile_async<BN, BK>(b, [&](int r, int kk) { return b_src(r, k0 + kk); }, any_valid);
  };
  // Prologue: S-1 tiles in flight (empty groups keep the wait counts uniform).
  for (int s = 0; s < S - 1; ++s) {
    if (kt_begin + s < kt_end) load(kt_begin + s, s);
    cp_async_fence();
  }
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int i = kt - kt_begin;
    cp_async_wait<S - 2>();  // tile kt has landed (this thread's part)
    smem_writes_to_mma();
    __syncthreads();         // ... everyone's part, and tile kt-1's stage is free again
    if (kt + S - 1 < kt_end) load(kt + S - 1, (i + S - 1) % S);
    cp_async_fence();
    Gemm::run(smem_stage<LayoutA>(a_base, i % S), smem_stage<LayoutB>(b_base, i % S), acc, threadIdx.x);
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers may now be reused by the epilogue
}

template <int BM, int BN>
constexpr int weight_stream_smem_bytes(int elem_bytes) {
  return (BM + BN) * kGemmBK * kGemmStages * elem_bytes;
}

// ---------------------------------------------------------------- project_features
template <class T, int BN>
__global__ void __launch_bounds__(kTileThreads)
project_features_tc_kernel(const __grid_constant__ ProjectFeaturesParams p) {
  constexpr int BM = kGemmBM;
  using Gemm = TileGemm<T, BM, BN, kGemmBK, false, kGemmWarpsM>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // the swizzle period
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, split = blockIdx.z;
  const int K = p.k * p.H;
  const int kt_total = (K + kGemmBK - 1) / kGemmBK;
  const int kt_begin = split * p.k_tiles_per_split;
  const int kt_end = min(kt_total, kt_begin + p.k_tiles_per_split);
  const T* w = static_cast<const T*>(p.fc_weight);
  auto a_src = [&](int r, int kk) -> const void* {
    const int t = m0 + r;
    if (t >= p.T || kk >= K) return nullptr;
    const int seg = kk / p.H;
    return static_cast<const T*>(p.features[seg]) + static_cast<int64_t>(t) * p.H + (kk - seg * p.H);
  };
  auto b_src = [&](int r, int kk) -> const void* {
    const int n = n0 + r;
    if (n >= p.H_out || kk >= K) return nullptr;
    return w + static_cast<int64_t>(n) * K + kk;
  };
  auto acc = Gemm::make_acc();
  weight_stream_mainloop<Gemm, T, BM, BN>(acc, a_src, b_src, w, kt_begin, kt_end, smem);
  auto coords = Gemm::acc_coords(threadIdx.x);
  float* ws = p.workspace + static_cast<int64_t>(split) * p.T * p.H_out;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int t = m0 + get<0>(coords(i)), n = n0 + get<1>(coords(i));
    if (t < p.T && n < p.H_out) ws[static_cast<int64_t>(t) * p.H_out + n] = acc(i);
  }
}

// ---------------------------------------------------------------- inject_context_kv
template <class T, int D>
__global__ void __launch_bounds__(kTileThreads)
inject_context_kv_tc_kernel(const __grid_constant__ InjectParams p) {
  constexpr int BM = kGemmBM;
  using Gemm = TileGemm<T, BM, D, kGemmBK, false, kGemmWarpsM>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // the swizzle period
  T* smem = reinterpret_cast<T*>(smem_raw);
  // blockIdx.y = (layer, k|v, head); the N-tile is exactly one head of D columns.
  const int layer = blockIdx.y / (2 * p.Hkv);
  const bool is_v = (blockIdx.y % (2 * p.Hkv)) >= p.Hkv;
  const int head = blockIdx.y % p.Hkv;
  const int m0 = blockIdx.x * BM;
  bool any_row = false;
  for (int r = threadIdx.x; r < BM; r += kTileThreads) any_row |= m0 + r < p.T && inject_row_valid(p, m0 + r);
  if (!__syncthreads_or(any_row)) return;  // nothing to write (with splits > 1 the finalize skips these rows too)
  const T* w = static_cast<const T*>(is_v ? p.v_weight : p.k_weight) +
               (static_cast<int64_t>(layer) * p.Hkv + head) * D * p.H;
  const T* ctx = static_cast<const T*>(p.ctx);
  auto a_src = [&](int r, int kk) -> const void* {
    const int t = m0 + r;
    return (t < p.T && kk < p.H && inject_row_valid(p, t)) ? ctx + static_cast<int64_t>(t) * p.H + kk : nullptr;
  };
  auto b_src = [&](int r, int kk) -> const void* {
    return kk < p.H ? w + static_cast<int64_t>(r) * p.H + kk : nullptr;
  };
  const int kt_total = (p.H + kGemmBK - 1) / kGemmBK;
  const int kt_begin = blockIdx.z * p.k_tiles_per_split;
  const int kt_end = min(kt_total, kt_begin + p.k_tiles_per_split);
  auto acc = Gemm::make_acc();
  weight_stream_mainloop<Gemm, T, BM, D>(acc, a_src, b_src, w, kt_begin, kt_end, smem);
  auto coords = Gemm::acc_coords(threadIdx.x);

  if (p.splits > 1) {  // fp32 partials [split][layer, k|v, head][T][D]; the finalize pass does the rest
    float* ws = p.workspace + ((static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * p.T) * D;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int t = m0 + get<0>(coords(i));
      if (t < p.T) ws[static_cast<int64_t>(t) * D + get<1>(coords(i))] = acc(i);
    }
    return;
  }

  // Epilogue: the fp32 tile goes through shared memory so that a warp owns whole rows
  // (RMSNorm needs the row sum; RoPE pairs column d with d +- D/2).
  constexpr int kStride = D + 4;
  float* tile = reinterpret_cast<float*>(smem_raw);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) tile[get<0>(coords(i)) * kStride + get<1>(coords(i))] = acc(i);
  __syncthreads();
  for (int r = threadIdx.x / 32; r < BM; r += kTileThreads / 32) {
    const int t = m0 + r;
    if (t >= p.T) break;
    if (inject_row_valid(p, t)) store_kv_row<T>(p, layer, is_v, head, t, tile + r * kStride);
  }
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
