// What every op family's parameter block (<family>_params.h) shares: the element types, the
// device limits the plan functions read, the index-guard rule, the GEMV schedule, and the
// declaration of a family's launcher table per architecture. Parameter blocks are plain
// structs passed from a family's host file (csrc/cuda/<family>.cpp, which sees torch) to its
// launchers (<family>.cuh, compiled once per architecture, which do not); every tensor in
// them is contiguous: the host file makes it so.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

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

// The launcher table of a family whose kernel choice depends on the problem and the device:
// `plan` picks the kernel and fills the scheduling fields of the parameter block (splits, the
// GEMV schedule) from the SM count and occupancy, and returns what the family's header says;
// `launch` runs what it planned.
template <class Params>
struct PlannedLaunchers {
  bool (*plan)(Params& p, const DeviceLimits& dev);
  void (*launch)(const Params& p, cudaStream_t stream);
};

// An op family's launcher table of one kernel set, `name` of type `Launchers` (a struct of
// pointers to the family's plan and launch functions), declared here in the namespace
// of every architecture. The family's kernel header (<family>.cuh) defines it in
// DFLASH_ARCH_NS, once per architecture (setup.py generates <family>_<arch>.cu), and the
// family's host file picks the device's one from an ArchTable (dispatch.h).
#define DFLASH_DECLARE_ARCH_LAUNCHERS(Launchers, name) \
  namespace sm80 {                                     \
  extern const Launchers name;                         \
  }                                                    \
  namespace sm90a {                                    \
  extern const Launchers name;                         \
  }                                                    \
  namespace sm100 {                                    \
  extern const Launchers name;                         \
  }

}  // namespace dflash::cuda
