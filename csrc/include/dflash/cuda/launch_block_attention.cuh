// Host side of block_attention for one architecture: kernel choice, split-KV plan, launch.
#pragma once
#include "dflash/cuda/attention_kernels.cuh"
#include "dflash/cuda/simt_kernels.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kAttnMaxSplits = 256;

bool block_attention_plan(BlockAttentionParams& p, const DeviceLimits& dev) {
  const int smem = p.D == 64 ? attention_smem_bytes<64>(2) : attention_smem_bytes<128>(2);
  const bool tc = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && aligned16(p.q) &&
                  aligned16(p.k_block) && aligned16(p.v_block) && aligned16(p.k_cache) &&
                  aligned16(p.v_cache) && smem <= dev.max_smem_per_block;
  p.tensor_cores = tc;
  p.splits = 1;
  p.keys_per_split = static_cast<int>(std::min<int64_t>(p.max_keys, INT32_MAX));
  if (!tc) return false;
  // Few (sequence, KV head, row tile) CTAs and long contexts: split the keys until the
  // grid fills the SMs twice.
  const int64_t ctas = static_cast<int64_t>(p.Bsz) * p.Hkv * ceil_div(static_cast<int64_t>(p.Bq) * (p.Hq / p.Hkv), kAttnBM);
  const int key_tiles = ceil_div(p.max_keys, kAttnBN);
  const int want = static_cast<int>(std::clamp<int64_t>((2 * dev.num_sms + ctas - 1) / ctas, 1,
                                                        std::min(key_tiles, kAttnMaxSplits)));
  p.keys_per_split = ceil_div(key_tiles, want) * kAttnBN;
  p.splits = ceil_div(p.max_keys, p.keys_per_split);
  return true;
}

template <class T, int D>
void launch_attention_tc(const BlockAttentionParams& p, cudaStream_t stream) {
  constexpr int smem = attention_smem_bytes<D>(sizeof(T));
  auto* kernel = &block_attention_tc_kernel<T, D>;
  set_smem_limit(reinterpret_cast<const void*>(kernel), smem, "block_attention");
  const dim3 grid(p.Bsz * p.Hkv, ceil_div(static_cast<int64_t>(p.Bq) * (p.Hq / p.Hkv), kAttnBM), p.splits);
  kernel<<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("block_attention_tc_kernel");
  if (p.splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;
    block_attention_combine_kernel<T><<<static_cast<unsigned>(rows), 128, 0, stream>>>(p);
    check_launch("block_attention_combine_kernel");
  }
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
