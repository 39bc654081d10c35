// The weight-streaming tile GEMM of inject_context_kv's tensor-core kernel (T > kGemvMaxRows;
// fewer tokens take the GEMV of weight_stream_gemv.cuh):
// C[T, N] = A[T, K] * W[N, K]^T (both row-major), a cp.async multi-stage pipeline feeding
// TileGemm over a range of K tiles (split-K). The op's header has the kernel: where A's
// rows come from and what the epilogue does with the accumulators.
// Requirements (checked by the plan functions, else the SIMT path runs): bf16/fp16,
// H % 8 == 0 (16-byte chunks never straddle a feature segment), 16-byte aligned bases.
#pragma once
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

}  // namespace dflash::cuda::DFLASH_ARCH_NS
