// Plain parameter blocks passed from the host dispatcher (csrc/cuda/ops_cuda.cpp, which
// sees torch) to the per-architecture launchers (csrc/cuda/*_sm*.cu, which do not).
// Every tensor here is contiguous: the dispatcher makes it so.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/window.h"  // visible_context, causal_first_key

namespace dflash::cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// What the plan functions need to know about the device.
struct DeviceLimits {
  int num_sms;
  int max_smem_per_block;  // opt-in maximum of dynamic shared memory, bytes
};

// Index guards with validation off (validate=False: no host copy checked the values):
// the kernels never read or write outside a tensor. A token whose slot is outside [0, S)
// or whose position is outside [0, P) is skipped (nothing written); a context range is
// clamped to the cache (offset to [0, S], length to [0, S - offset]) and to the planned
// context (block_attention's max_context); repeated slots write a mix of those tokens'
// rows (K/V and heads come from different CTAs), never outside them.

// The schedule and workspace of a weight-streaming GEMV launch (weight_stream_gemv.cuh;
// the sizes come from gemv_plan in plans.h, set by the op's plan function).
struct GemvSchedule {
  int ctas;            // grid size (one wave at most)
  int row_blocks;      // of kGemvRowBlock weight rows
  int k_steps;         // of kGemvStepK, per row block
  int blocks_per_group;  // row blocks of one epilogue group
  float* partials;     // [ctas + row_blocks][T][kGemvRowBlock]: CTA c's sum over its part of block b at slot c + b
  float* y;            // [T][row_blocks * kGemvRowBlock]: the full sums
  float* ss;           // [row_blocks][T]: sum of squares of y over a block's rows (project_features)
  int* counters;       // [row_blocks + groups], zero at launch: partials in, then blocks done per group
  int64_t y_offset, ss_offset, workspace_floats;  // floats of the one fp32 workspace (partials at 0)
  int64_t counter_count;
};
// Points the schedule at its workspace (workspace_floats fp32) and counters (counter_count
// ints, zeroed).
inline void bind_gemv_workspace(GemvSchedule& s, float* workspace, int* counters) {
  s.partials = workspace;
  s.y = workspace + s.y_offset;
  s.ss = workspace + s.ss_offset;
  s.counters = counters;
}

// project_features: out = rms_norm(concat(features) @ fc_weight^T) * norm_weight. The
// kernel (the GEMV) runs for T <= kGemvMaxRows; the dispatcher runs every other case
// through cuBLAS (project_features_path in plans.h).
inline constexpr int kMaxFeatures = 16;  // more are concatenated on the host first
struct ProjectFeaturesParams {
  const void* features[kMaxFeatures];  // k tensors [T, H]
  int k, T, H, H_out;
  const void* fc_weight;    // [H_out, k*H]
  const void* norm_weight;  // [H_out]
  void* out;                // [T, H_out]
  GemvSchedule gemv;        // set by project_features_plan, workspace by the dispatcher
  float eps;
  DType dtype;
};

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
  GemvSchedule gemv;          // the GEMV path's schedule (T <= kGemvMaxRows), workspace by the dispatcher
  int T, H, N, Hkv, D;
  int64_t S, P;
  float eps;
  DType dtype;
  int path;               // GemmPath (plans.h), set by the plan
  int splits;             // split-K factor (set by the plan; > 1: a finalize pass does the epilogue)
  int k_tiles_per_split;  // K tiles each split reduces
};

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

// block_conv (DFlash2): out[m, i, c] = sum_{t <= i, t < T} (base[t, c] + delta[m, i, t, c / (H / G)])
// * x[m, i - t, c].
struct BlockConvParams {
  const void* x;      // [M, B, H]
  const void* base;   // [T, H]
  const void* delta;  // [M, B, T, G]
  void* out;          // [M, B, H]
  int64_t M;
  int B, H, T, G;
  DType dtype;
};

// One set of launchers per compiled architecture (csrc/cuda/*_sm*.cu). A plan function
// picks the kernel for the problem and fills the scheduling fields (splits, the GEMV
// schedule) from the SM count and occupancy. project_features_plan returns whether its
// kernel runs (false: the dispatcher's cuBLAS path); inject_context_kv_plan and
// block_attention_plan whether a tensor-core or GEMV kernel runs (false: the SIMT path,
// also taken where the device has too little shared memory for the tensor-core tile).
#define DFLASH_DECLARE_ARCH_LAUNCHERS(arch)                                        \
  namespace arch {                                                                 \
  bool project_features_plan(ProjectFeaturesParams& p, const DeviceLimits& dev);   \
  void project_features(const ProjectFeaturesParams& p, cudaStream_t stream);      \
  bool inject_context_kv_plan(InjectParams& p, const DeviceLimits& dev);           \
  void inject_context_kv(const InjectParams& p, cudaStream_t stream);              \
  bool block_attention_plan(BlockAttentionParams& p, const DeviceLimits& dev);     \
  void block_attention(const BlockAttentionParams& p, cudaStream_t stream);        \
  void block_conv(const BlockConvParams& p, cudaStream_t stream);                  \
  }

DFLASH_DECLARE_ARCH_LAUNCHERS(sm80)
DFLASH_DECLARE_ARCH_LAUNCHERS(sm90a)
DFLASH_DECLARE_ARCH_LAUNCHERS(sm100)

}  // namespace dflash::cuda
