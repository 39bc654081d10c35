// One block-level tile GEMM, acc[BM, BN] += A[BM, BK] * B[BN, BK]^T, with both operands
// in shared memory, written once per tensor-core generation:
//   - DFLASH_USE_WGMMA=1 (sm_90a): one warpgroup issues CuTe SM90 GMMA (wgmma) atoms that
//     read A and B straight from shared memory through descriptors;
//   - DFLASH_USE_WGMMA=0 (sm_80, sm_100a): four warps load fragments with ldmatrix and
//     issue CuTe SM80 mma.sync atoms.
// Both use the same 128-byte-swizzled GMMA shared-memory layouts, so the loaders and the
// epilogues of the kernels do not depend on the path. B is K-major ([BN][BK] rows) or
// MN-major (BK rows of BN contiguous elements, e.g. V in P*V).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cutlass/arch/barrier.h>

#include "dflash/cuda/common.cuh"

#ifndef DFLASH_USE_WGMMA
#error "define DFLASH_USE_WGMMA (1 for sm_90a, 0 for the mma.sync path)"
#endif

namespace dflash::cuda::DFLASH_ARCH_NS {

using namespace cute;

inline constexpr int kTileThreads = 128;  // one warpgroup / four warps

template <class T, int Rows, int Cols>  // [Rows][Cols], Cols contiguous (K-major operand)
using SmemKMajor = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<Rows>, Int<Cols>>{}));

template <class T, int MN, int K>  // (MN, K) coordinates, MN contiguous
using SmemMNMajor = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<MN>, Int<K>>{}));

template <class T> struct Sm80Atom;
template <> struct Sm80Atom<cutlass::bfloat16_t> { using type = SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct Sm80Atom<cutlass::half_t> { using type = SM80_16x8x16_F32F16F16F32_TN; };

// WarpsM: warps stacked along M (4 for 64-row tiles, 1 for 16-row skinny GEMM tiles);
// the wgmma path always uses one 64-row warpgroup and ignores it.
template <class T, int BM, int BN, int BK, bool kBMNMajor, int WarpsM = 4>
struct TileGemm {
  static_assert(BK % 16 == 0, "K tile must be a multiple of 16");
  using LayoutA = SmemKMajor<T, BM, BK>;
  using LayoutB = std::conditional_t<kBMNMajor, SmemMNMajor<T, BN, BK>, SmemKMajor<T, BN, BK>>;

#if DFLASH_USE_WGMMA
  static_assert(BM == 64, "the wgmma tile is one 64-row warpgroup");
  static constexpr auto kMajorB = kBMNMajor ? GMMA::Major::MN : GMMA::Major::K;
  CUTE_HOST_DEVICE static auto tiled_mma() {
    return make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<Int<BM>, Int<BN>, Int<BK>>,
                                               GMMA::Major::K, kMajorB>());
  }
#else
  static_assert(BM % (16 * WarpsM) == 0 && BN % (16 * (4 / WarpsM)) == 0, "tile/warp mismatch");
  CUTE_HOST_DEVICE static auto tiled_mma() {
    return make_tiled_mma(MMA_Atom<typename Sm80Atom<T>::type>{},
                          Layout<Shape<Int<WarpsM>, Int<4 / WarpsM>, _1>>{},
                          Tile<Int<16 * WarpsM>, Int<16 * (4 / WarpsM)>, _16>{});
  }
#endif

  // Zeroed fp32 accumulator fragment of this thread.
  CUTE_HOST_DEVICE static auto make_acc() {
    auto acc = partition_fragment_C(tiled_mma(), Shape<Int<BM>, Int<BN>>{});
    clear(acc);
    return acc;
  }

  // (row, col) in the BM x BN tile of each accumulator element of thread `tid`.
  CUTE_HOST_DEVICE static auto acc_coords(int tid) {
    return tiled_mma().get_slice(tid).partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  }

  // acc += A * B^T. sA: (BM, BK) smem tensor in LayoutA; sB: (BN, BK) in LayoutB. The
  // caller has made the tiles visible to the block (barrier) before the call; on return
  // every read of sA/sB by this thread is complete.
  template <class TA, class TB, class TC>
  __device__ static void run(const TA& sA, const TB& sB, TC& acc, int tid) {
    auto mma = tiled_mma();
    auto thr = mma.get_slice(tid);
#if DFLASH_USE_WGMMA
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // smem descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA, tCrB, acc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
#else
    Tensor tCrA = thr.partition_fragment_A(sA);
    Tensor tCrB = thr.partition_fragment_B(sB);
    auto copy_a = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, T>{}, mma);
    using BLoad = std::conditional_t<kBMNMajor, SM75_U16x8_LDSM_T, SM75_U32x4_LDSM_N>;
    auto copy_b = make_tiled_copy_B(Copy_Atom<BLoad, T>{}, mma);
    auto thr_a = copy_a.get_slice(tid);
    auto thr_b = copy_b.get_slice(tid);
    Tensor tAs = thr_a.partition_S(sA);
    Tensor tAr = thr_a.retile_D(tCrA);
    Tensor tBs = thr_b.partition_S(sB);
    Tensor tBr = thr_b.retile_D(tCrB);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      copy(copy_a, tAs(_, _, k), tAr(_, _, k));
      copy(copy_b, tBs(_, _, k), tBr(_, _, k));
      gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    }
#endif
  }
};

// Stage `stage` of a ring of shared-memory tiles laid out back to back. The stage is a
// new tensor at an offset pointer (not a slice of a 3-D swizzled layout, which would keep
// the offset inside the layout where a wgmma descriptor does not see it); every tile
// size used here is a multiple of the 1 KiB swizzle period.
template <class Layout, class T>
__device__ __forceinline__ auto smem_stage(T* base, int stage) {
  return make_tensor(make_smem_ptr(base + stage * cosize(Layout{})), Layout{});
}

// Makes this thread's generic-proxy shared-memory writes (cp.async included, once
// waited for) visible to wgmma's async proxy; call before the block barrier.
__device__ __forceinline__ void smem_writes_to_mma() {
#if DFLASH_USE_WGMMA
  cutlass::arch::fence_view_async_shared();
#endif
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
