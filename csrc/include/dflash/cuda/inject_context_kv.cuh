// Host side of inject_context_kv for one architecture: kernel choice, split-K plan, launch.
#pragma once
#include "dflash/cuda/weight_stream_gemm.cuh"
#include "dflash/cuda/plans.h"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

template <class T, int D>
int inject_tc_ctas_per_sm() {
  return prepare_kernel<&inject_context_kv_tc_kernel<T, D>>(kTileThreads, weight_stream_smem_bytes<kGemmBM, D>(sizeof(T)),
                                                           "inject_context_kv");
}

// Sets p.splits / p.k_tiles_per_split (the caller allocates p.workspace when splits > 1)
// and returns whether the tensor-core kernel runs.
bool inject_context_kv_plan(InjectParams& p, const DeviceLimits& dev) {
  p.tensor_cores = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && p.H % 8 == 0 &&
                   aligned16(p.ctx) && aligned16(p.k_weight) && aligned16(p.v_weight) &&
                   weight_stream_smem_bytes<kGemmBM, 128>(2) <= dev.max_smem_per_block;
  const int k_tiles = ceil_div(p.H, kGemmBK);
  p.splits = 1;
  p.k_tiles_per_split = k_tiles;
  if (!p.tensor_cores) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>)
      per_sm = p.D == 64 ? inject_tc_ctas_per_sm<T, 64>() : inject_tc_ctas_per_sm<T, 128>();
  };
  dispatch_all_types(p.dtype, occupancy);
  // One CTA per (row tile, layer, k|v, head) streams a whole D x H weight slice: with few
  // tokens that is too few CTAs for the SMs (18 for a SmolLM2 drafter), so split K.
  const int64_t ctas = static_cast<int64_t>(ceil_div(p.T, kGemmBM)) * p.N * 2 * p.Hkv;
  const SplitPlan plan = gemm_split_plan(ctas, k_tiles, static_cast<int64_t>(dev.num_sms) * per_sm);
  p.splits = plan.splits;
  p.k_tiles_per_split = plan.units_per_split;
  return true;
}

template <class T, int D>
void launch_inject_tc(const InjectParams& p, cudaStream_t stream) {
  constexpr int smem = weight_stream_smem_bytes<kGemmBM, D>(sizeof(T));
  inject_tc_ctas_per_sm<T, D>();  // the shared-memory opt-in (once per device)
  const dim3 grid(ceil_div(p.T, kGemmBM), p.N * 2 * p.Hkv, p.splits);
  inject_context_kv_tc_kernel<T, D><<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("inject_context_kv_tc_kernel");
  if (p.splits > 1) {
    const dim3 rows(p.T, p.N * 2 * p.Hkv);
    inject_context_kv_finalize_kernel<T><<<rows, 32, p.D * sizeof(float), stream>>>(p);
    check_launch("inject_context_kv_finalize_kernel");
  }
}

void inject_context_kv(const InjectParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        if (p.D == 64) launch_inject_tc<T, 64>(p, stream);
        else launch_inject_tc<T, 128>(p, stream);
        return;
      }
    }
    // D <= kInjectMaxHeadDim floats (checked by the dispatcher): no shared-memory opt-in.
    const dim3 grid(p.T, p.N * 2 * p.Hkv);
    inject_context_kv_simt_kernel<T><<<grid, kSimtThreads, p.D * sizeof(float), stream>>>(p);
    check_launch("inject_context_kv_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
