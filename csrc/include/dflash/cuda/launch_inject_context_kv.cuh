// Host side of inject_context_kv for one architecture: kernel choice and launch.
#pragma once
#include "dflash/cuda/gemm_kernels.cuh"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

bool inject_context_kv_plan(InjectParams& p, const DeviceLimits& dev) {
  p.tensor_cores = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && p.H % 8 == 0 &&
                   aligned16(p.ctx) && aligned16(p.k_weight) && aligned16(p.v_weight) &&
                   weight_stream_smem_bytes<kGemmBM, 128>(2) <= dev.max_smem_per_block;
  return p.tensor_cores;
}

template <class T, int D>
void launch_inject_tc(const InjectParams& p, cudaStream_t stream) {
  constexpr int smem = weight_stream_smem_bytes<kGemmBM, D>(sizeof(T));
  auto* kernel = &inject_context_kv_tc_kernel<T, D>;
  set_smem_limit(reinterpret_cast<const void*>(kernel), smem, "inject_context_kv");
  const dim3 grid(ceil_div(p.T, kGemmBM), p.N * 2 * p.Hkv);
  kernel<<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("inject_context_kv_tc_kernel");
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
    const int smem = p.D * static_cast<int>(sizeof(float));
    set_smem_limit(reinterpret_cast<const void*>(&inject_context_kv_simt_kernel<T>), smem,
                   "inject_context_kv");
    const dim3 grid(p.T, p.N * 2 * p.Hkv);
    inject_context_kv_simt_kernel<T><<<grid, kSimtThreads, smem, stream>>>(p);
    check_launch("inject_context_kv_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
