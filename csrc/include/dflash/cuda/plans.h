// Launch-plan rules of the CUDA kernels as pure host functions (no CUDA headers), so that
// the CPU build links them too and python_tests/cuda/test_cuda_plans.py checks them on any
// machine (through dflash_ext._C._cuda_plan). The per-architecture plan functions of the
// op headers (<op>.cuh) call these with their own tile sizes and the occupancy they measured.
#pragma once
#include <algorithm>
#include <cstdint>

#include "dflash/window.h"

namespace dflash::cuda {

struct SplitPlan {
  int splits;          // CTAs along the split dimension (>= 1)
  int units_per_split; // work units (K tiles, key tiles) each split covers (>= 1)
};

// Splits `units` work units of each of `ctas` independent CTAs so that the grid fills one
// wave (`wave` = SMs x resident CTAs per SM), with at least `min_units` units per split
// (a shorter split moves more partial-sum bytes than it saves) and at most `max_splits`
// splits. A grid that already fills the wave is not split. Every unit is covered exactly
// once and no split is empty.
inline SplitPlan split_plan(int64_t ctas, int64_t units, int64_t min_units, int64_t max_splits, int64_t wave) {
  ctas = std::max<int64_t>(ctas, 1);
  units = std::max<int64_t>(units, 1);
  min_units = std::max<int64_t>(min_units, 1);
  const int64_t most = std::max<int64_t>(1, std::min(max_splits, units / min_units));
  const int64_t want = ctas >= wave ? 1 : std::clamp<int64_t>((wave + ctas - 1) / ctas, 1, most);
  const int64_t per = (units + want - 1) / want;
  return {static_cast<int>((units + per - 1) / per), static_cast<int>(per)};
}

// block_attention: split-KV over key tiles of `key_tile` keys, at least kAttnMinKeysPerSplit
// keys per split (64-key splits of a short context moved ~2x the K/V bytes as fp32
// partials) and at most kAttnMaxSplits. The grid stays within one wave (ctas x splits <=
// num_sms x ctas_per_sm: every CTA resident at once, no tail wave) and, within it, the
// split count minimizes the key tiles that the busiest SM reads, ceil(ctas x splits /
// num_sms) resident CTAs x tiles per split: the kernel streams K/V, so its time is the
// busiest SM's bytes. A grid whose CTAs per SM come out uneven (e.g. 136 CTAs on 132 SMs)
// leaves most SMs idle half the time and loses to a smaller or a fuller one; ties go to
// fewer splits (fewer partial bytes). E.g. 8 CTAs (one sequence of Qwen3-8B's 8 KV heads)
// on an H200 (132 SMs x 2): 33 splits, 264 CTAs, 2 per SM.
inline constexpr int kAttnMinKeysPerSplit = 256;
inline constexpr int kAttnMaxSplits = 128;
inline SplitPlan attention_split_plan(int64_t ctas, int64_t max_keys, int key_tile, int64_t num_sms,
                                      int64_t ctas_per_sm) {
  ctas = std::max<int64_t>(ctas, 1);
  num_sms = std::max<int64_t>(num_sms, 1);
  const int64_t tiles = (std::max<int64_t>(max_keys, 1) + key_tile - 1) / key_tile;
  const int64_t min_tiles = (kAttnMinKeysPerSplit + key_tile - 1) / key_tile;
  const int64_t wave = num_sms * std::max<int64_t>(ctas_per_sm, 1);
  const int64_t most = std::min<int64_t>(wave / ctas, kAttnMaxSplits);
  SplitPlan best{1, static_cast<int>(tiles)};
  int64_t best_cost = (ctas + num_sms - 1) / num_sms * tiles;
  for (int64_t want = 2; want <= most; ++want) {
    const int64_t per = (tiles + want - 1) / want, splits = (tiles + per - 1) / per;
    if (per < min_tiles) break;  // and shorter from here on
    const int64_t cost = (ctas * splits + num_sms - 1) / num_sms * per;
    if (cost < best_cost) best = {static_cast<int>(splits), static_cast<int>(per)}, best_cost = cost;
  }
  return best;
}

// inject_context_kv's tensor-core kernel (T > kGemvMaxRows): split-K over K tiles, each
// split streaming at least kGemmMinKTilesPerSplit tiles of the weight. The splits are
// rounded down to whole waves (ctas x splits <= wave where the grid is split): rounding up
// made 288 or 320 CTAs for a 264-CTA wave, a second wave nearly empty.
inline constexpr int kGemmMinKTilesPerSplit = 4;
inline constexpr int kGemmMaxSplits = 64;
inline SplitPlan gemm_split_plan(int64_t ctas, int64_t k_tiles, int64_t wave) {
  ctas = std::max<int64_t>(ctas, 1);
  const int64_t whole = std::max<int64_t>(wave / ctas, 1) * ctas;  // splits = whole / ctas
  return split_plan(ctas, k_tiles, kGemmMinKTilesPerSplit, kGemmMaxSplits, whole);
}

// ---- The weight-streaming GEMV (weight_stream_gemv.cuh): y[T, rows] = X[T, K] W[rows, K]^T
// for T <= kGemvMaxRows, the weight as the MMA's M operand (16 weight rows x 8 tokens), so
// no MMA row is padding for a token that is not there (a 64-row wgmma tile was 48-63 rows
// of zeros at T <= 16). The work is row blocks of kGemvRowBlock weight rows x K steps of
// kGemvStepK, numbered row block major; CTA c of `ctas` streams steps
// [c * steps / ctas, (c + 1) * steps / ctas) (stream-K: every CTA the same weight bytes, one
// wave), writes one fp32 partial per row block it touches, and the last CTA of a row block
// (a counter) adds them, in CTA order (deterministic); the last row block of a group
// (project_features: all of them, the RMSNorm; inject_context_kv: one head) does the op's
// epilogue.
inline constexpr int kGemvMaxRows = 16;     // tokens: two 8-column MMA tiles
inline constexpr int kGemvRowBlock = 32;    // weight rows per block: two 16-row MMA tiles
inline constexpr int kGemvStepK = 32;       // K per step: one 16-byte load per thread and row
inline constexpr int kGemvMinStepsPerCta = 16;  // 32 KiB of bf16 weight: fewer steps cost more than a CTA saves

struct GemvPlan {
  int64_t ctas;          // grid size: min(wave, steps / kGemvMinStepsPerCta), >= 1
  int64_t row_blocks;    // ceil(rows / kGemvRowBlock)
  int64_t k_steps;       // ceil(K / kGemvStepK): steps per row block
  int64_t groups;        // ceil(row_blocks / row blocks per group)
  int64_t partial_floats, y_floats, ss_floats;  // the fp32 workspace: partials, y, per-block sums of squares
  int64_t counters;      // ints, zeroed before the launch: row_blocks + groups
};
// Row blocks of one epilogue group. rows_per_group: a multiple of kGemvRowBlock, or >= rows
// (one group).
inline int64_t gemv_blocks_per_group(int64_t rows, int64_t rows_per_group) {
  if (rows_per_group >= rows) return (std::max<int64_t>(rows, 1) + kGemvRowBlock - 1) / kGemvRowBlock;
  return std::max<int64_t>(1, rows_per_group / kGemvRowBlock);
}
// rows_per_group: a multiple of kGemvRowBlock, or >= rows (one group).
inline GemvPlan gemv_plan(int64_t T, int64_t rows, int64_t K, int64_t rows_per_group, int64_t wave) {
  GemvPlan p{};
  p.row_blocks = (std::max<int64_t>(rows, 1) + kGemvRowBlock - 1) / kGemvRowBlock;
  p.k_steps = (std::max<int64_t>(K, 1) + kGemvStepK - 1) / kGemvStepK;
  const int64_t steps = p.row_blocks * p.k_steps;
  p.ctas = std::clamp<int64_t>(steps / kGemvMinStepsPerCta, 1, std::max<int64_t>(wave, 1));
  const int64_t blocks_per_group = gemv_blocks_per_group(rows, rows_per_group);
  p.groups = (p.row_blocks + blocks_per_group - 1) / blocks_per_group;
  // CTA c's partial of row block b is slot c + b: the (CTA, row block) pairs of a stream-K
  // schedule form a monotone staircase, so c + b is unique, below ctas + row_blocks.
  p.partial_floats = (p.ctas + p.row_blocks) * kGemvRowBlock * T;
  p.y_floats = T * p.row_blocks * kGemvRowBlock;
  p.ss_floats = p.row_blocks * T;
  p.counters = p.row_blocks + p.groups;
  return p;
}

// The CTA of a stream-K schedule (CTA c starts at step c * steps / ctas) that runs `step`
// (host and device: the kernel finds the CTAs of a row block with it).
DFLASH_HOST_DEVICE constexpr int64_t stream_cta_of(int64_t step, int64_t steps, int64_t ctas) { return ((step + 1) * ctas - 1) / steps; }

// ---- Which kernel an op runs. project_features: the GEMV for 16-bit, 16-byte aligned
// inputs with H % 8 == 0 and T <= kGemvMaxRows; every other case (prefill-sized T, fp32,
// odd shapes) runs cuBLAS (at::mm, fp32 output) + at::rms_norm: at T > kGemvMaxRows the
// weight is read once per 16 rows by any kernel of this shape and cuBLAS's tiles are the
// better GEMM (docs/ops.md). inject_context_kv: the GEMV at T <= kGemvMaxRows, the
// tensor-core kernel above, SIMT where the tensor-core rules fail.
enum class GemmPath : int { kLibrary = 0, kGemv = 1, kTensorCores = 2, kSimt = 3 };
inline GemmPath project_features_path(bool tensor_core_inputs, int64_t T) {
  return tensor_core_inputs && T <= kGemvMaxRows ? GemmPath::kGemv : GemmPath::kLibrary;
}
inline GemmPath inject_context_kv_path(bool tensor_core_inputs, int64_t T) {
  return !tensor_core_inputs ? GemmPath::kSimt : T <= kGemvMaxRows ? GemmPath::kGemv : GemmPath::kTensorCores;
}

// Keys a sequence can attend to in a launch planned for `max_context` context rows
// (< 0: the whole cache of S rows) with window `window` (0 = all): the static bound that
// the split plan covers, so that a captured CUDA graph stays correct as contexts grow.
// Counted non-causal: a bound for causal attention too, which sees a row fewer.
inline int64_t planned_context(int64_t max_context, int64_t window, int64_t S) {
  return visible_context(max_context < 0 ? S : std::min(max_context, S), window, false);
}

// Which kernel set runs on compute capability major.minor: sm_90a code needs exactly 9.0
// (wgmma is 9.0-only), the plain sm_100 code runs on every 10.x (B200 10.0, B300 10.3), and
// anything else from 8.0 on takes sm_80 (its SASS on 8.x, else its PTX, JIT-compiled by
// the driver, e.g. on 12.x). `compiled` is the bit set of the sets built in (a build may
// choose, DFLASH_CUDA_ARCHS): a GPU whose own set is missing takes the sm_80 PTX where that
// was built. Below 8.0, or nothing that runs there: kNone.
enum class KernelArch : int { kNone = 0, kSm80 = 80, kSm90a = 90, kSm100 = 100 };
inline constexpr unsigned arch_bit(KernelArch a) {
  return a == KernelArch::kSm80 ? 1u : a == KernelArch::kSm90a ? 2u : a == KernelArch::kSm100 ? 4u : 0u;
}
inline constexpr unsigned kAllKernelArchs = 7u;
inline KernelArch kernel_arch_for(int major, int minor, unsigned compiled = kAllKernelArchs) {
  if (major < 8) return KernelArch::kNone;
  const KernelArch own = major == 9 && minor == 0 ? KernelArch::kSm90a
                         : major == 10            ? KernelArch::kSm100
                                                  : KernelArch::kSm80;
  if (compiled & arch_bit(own)) return own;
  return compiled & arch_bit(KernelArch::kSm80) ? KernelArch::kSm80 : KernelArch::kNone;
}

// The kernel sets this extension was built with (setup.py defines DFLASH_CUDA_ARCH_<ARCH>
// for each architecture it compiles; none in a CPU-only build).
inline constexpr unsigned compiled_kernel_archs() {
  return 0u
#ifdef DFLASH_CUDA_ARCH_SM80
         | arch_bit(KernelArch::kSm80)
#endif
#ifdef DFLASH_CUDA_ARCH_SM90A
         | arch_bit(KernelArch::kSm90a)
#endif
#ifdef DFLASH_CUDA_ARCH_SM100
         | arch_bit(KernelArch::kSm100)
#endif
      ;
}

}  // namespace dflash::cuda
