// Host side of block_attention for one architecture: kernel choice, split-KV plan, launch.
#pragma once
#include "dflash/cuda/block_attention.cuh"
#include "dflash/cuda/plans.h"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

template <class T, int D>
int attention_tc_ctas_per_sm() {
  return prepare_kernel<&block_attention_tc_kernel<T, D>>(kTileThreads, attention_smem_bytes<D>(sizeof(T)),
                                                         "block_attention");
}

inline int attention_row_tiles(const BlockAttentionParams& p) {
  return ceil_div(static_cast<int64_t>(p.Bq) * (p.Hq / p.Hkv), kAttnBM);
}

// Sets p.splits / p.keys_per_split from p.max_keys (a static bound: the plan reads no
// index value) and returns whether the tensor-core kernel runs.
bool block_attention_plan(BlockAttentionParams& p, const DeviceLimits& dev) {
  const int smem = p.D == 64 ? attention_smem_bytes<64>(2) : attention_smem_bytes<128>(2);
  const bool tc = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && aligned16(p.q) &&
                  aligned16(p.k_block) && aligned16(p.v_block) && aligned16(p.k_cache) &&
                  aligned16(p.v_cache) && smem <= dev.max_smem_per_block;
  p.tensor_cores = tc;
  p.splits = 1;
  p.tile_counter_count = 0;
  p.keys_per_split = static_cast<int>(std::min<int64_t>(p.max_keys, INT32_MAX));
  if (!tc) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>)
      per_sm = p.D == 64 ? attention_tc_ctas_per_sm<T, 64>() : attention_tc_ctas_per_sm<T, 128>();
  };
  dispatch_all_types(p.dtype, occupancy);
  const int64_t ctas = static_cast<int64_t>(p.Bsz) * p.Hkv * attention_row_tiles(p);
  p.tile_counter_count = ctas;
  const SplitPlan plan = attention_split_plan(ctas, p.max_keys, kAttnBN, static_cast<int64_t>(dev.num_sms) * per_sm);
  p.splits = plan.splits;
  p.keys_per_split = plan.units_per_split * kAttnBN;
  return true;
}

template <class T, int D>
void launch_attention_tc(const BlockAttentionParams& p, cudaStream_t stream) {
  constexpr int smem = attention_smem_bytes<D>(sizeof(T));
  attention_tc_ctas_per_sm<T, D>();  // the shared-memory opt-in (once per device)
  const dim3 grid(p.Bsz * p.Hkv, attention_row_tiles(p), p.splits);
  block_attention_tc_kernel<T, D><<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("block_attention_tc_kernel");
}

void block_attention(const BlockAttentionParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        if (p.D == 64) launch_attention_tc<T, 64>(p, stream);
        else launch_attention_tc<T, 128>(p, stream);
        return;
      }
    }
    const int64_t warps = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;
    block_attention_simt_kernel<T><<<ceil_div(warps * 32, kSimtThreads), kSimtThreads, 0, stream>>>(p);
    check_launch("block_attention_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
