// block_attention's parameter block and launcher table: the host side is
// csrc/cuda/block_attention.cpp, the kernels dflash/cuda/block_attention.cuh.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/window.h"  // visible_context, causal_first_key
#include "dflash/cuda/params.h"

namespace dflash::cuda {

// block_attention: per sequence b the keys are k_cache[start : off+len] ++ k_block[b]
// (start: visible_context in window.h), every one of them seen unless `causal` or
// `symmetric` (with a window) give each query its own span (seen_keys in window.h).
inline constexpr int kSimtMaxHeadDim = 256;  // the SIMT path keeps D/32 <= 8 values per lane

struct BlockAttentionParams {
  const void* q;        // [Bsz, Bq, Hq, D]
  const void* k_block;  // [Bsz, Bq, Hkv, D]
  const void* v_block;
  const void* k_cache;  // [S, Hkv, D]
  const void* v_cache;
  const int64_t* cache_offsets;  // [Bsz]
  const int64_t* cache_lens;     // [Bsz]
  void* out;            // [Bsz, Bq, Hq, D]
  float* partial_out;   // [splits, Bsz, Bq, Hq, D] fp32 (splits > 1), merged by a second launch
  float* partial_lse;   // [splits, Bsz, Bq, Hq]
  int Bsz, Bq, Hq, Hkv, D;
  int64_t S;
  int64_t window;       // 0 = whole context
  bool causal;          // the causal sliding-window rule of window.h
  bool symmetric;       // the symmetric window rule of window.h (never with causal)
  int64_t max_context;  // the planned bound of visible context rows (a sequence sees at most these)
  int64_t max_keys;     // max_context + Bq
  int splits;           // split-KV factor, 1 = write `out` directly (set by the plan)
  int keys_per_split;   // a multiple of the kernel's key tile (set by the plan)
  bool tensor_cores;    // set by the plan: tensor-core kernel, else the SIMT path
  float scale;
  DType dtype;
};

// The plan (the split-KV factor) returns whether the tensor-core kernel runs; false: the SIMT
// path, also taken where the device has too little shared memory for the tensor-core tile.
using BlockAttentionLaunchers = PlannedLaunchers<BlockAttentionParams>;
DFLASH_DECLARE_ARCH_LAUNCHERS(BlockAttentionLaunchers, block_attention_launchers)

}  // namespace dflash::cuda
