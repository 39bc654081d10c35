// inject_context_kv's parameter block and launcher table: the host side is
// csrc/cuda/inject_context_kv.cpp, the kernels dflash/cuda/inject_context_kv.cuh.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/cuda/params.h"

namespace dflash::cuda {

// inject_context_kv: for every layer n, token t with slots[t] >= 0:
// k_cache[n, slots[t]] = rope(rms_norm(ctx[t] @ k_weight[n]^T per head)), v_cache likewise.
inline constexpr int kInjectMaxHeadDim = 8192;  // D fp32 values in shared memory, under 48 KiB
struct InjectParams {
  const void* ctx;            // [T, H]
  const void* k_weight;       // [N, Hkv*D, H]
  const void* v_weight;       // [N, Hkv*D, H]
  const void* k_norm_weight;  // [N, D]
  const void* cos;            // [P, D]
  const void* sin;            // [P, D]
  const int64_t* positions;   // [T] in [0, P)
  const int64_t* slots;       // [T] in [-1, S), -1 = skip
  void* k_cache;              // [N, S, Hkv, D]
  void* v_cache;              // [N, S, Hkv, D]
  float* workspace;           // [splits, N * 2 * Hkv, T, D] fp32 partial sums (tensor cores, splits > 1)
  GemvSchedule gemv;          // the GEMV path's schedule (T <= kGemvMaxRows), workspace by the host file
  int T, H, N, Hkv, D;
  int64_t S, P;
  float eps;
  DType dtype;
  int path;               // GemmPath (plans.h), set by the plan
  int splits;             // split-K factor (set by the plan; > 1: a finalize pass does the epilogue)
  int k_tiles_per_split;  // K tiles each split reduces
};

// The plan (the path, the split-K factor, the GEMV schedule) returns whether a tensor-core or
// GEMV kernel runs; false: the SIMT path, also taken where the device has too little shared
// memory for the tensor-core tile.
using InjectLaunchers = PlannedLaunchers<InjectParams>;
DFLASH_DECLARE_ARCH_LAUNCHERS(InjectLaunchers, inject_context_kv_launchers)

}  // namespace dflash::cuda
