// The parameter blocks and launcher table of the draft layer's norms (rms_norm, add_rms_norm,
// qk_norm_rope): the host side is csrc/cuda/norms.cpp, the kernels dflash/cuda/norms.cuh.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dflash/cuda/params.h"

namespace dflash::cuda {

// rms_norm / add_rms_norm over `rows` rows of H: sum = x + residual (when residual is set),
// out = norm(sum or x) * weight. Every tensor contiguous.
struct RmsNormParams {
  const void* x;         // [rows, H]
  const void* residual;  // [rows, H] or nullptr
  const void* weight;    // [H]
  void* sum;             // [rows, H], written when residual is set
  void* out;             // [rows, H]
  int64_t rows;
  int H;
  float eps;
  DType dtype;
  bool vec;  // 16-byte accesses: H a multiple of 16 / element size, every pointer 16-byte aligned
};

// qk_norm_rope: q [M, Hq, D], k [M, Hkv, D] from qkv rows (stride ld elements, heads contiguous).
struct QkNormRopeParams {
  const void* qkv;  // [M, ld], columns (Hq + 2 Hkv) * D used
  const void* q_norm_weight;  // [D]
  const void* k_norm_weight;  // [D]
  const void* cos;  // [M, D] contiguous
  const void* sin;  // [M, D] contiguous
  void* q;          // [M, Hq, D]
  void* k;          // [M, Hkv, D]
  int64_t M, ld;
  int Hq, Hkv, D;
  float eps;
  DType dtype;
  bool vec;  // 16-byte accesses: D / 2 and ld multiples of 16 / element size, every pointer 16-byte aligned
};

// rms_norm runs add_rms_norm too (RmsNormParams::residual set).
struct NormsLaunchers {
  void (*rms_norm)(const RmsNormParams& p, cudaStream_t stream);
  void (*qk_norm_rope)(const QkNormRopeParams& p, cudaStream_t stream);
};
DFLASH_DECLARE_ARCH_LAUNCHERS(NormsLaunchers, norms_launchers)

}  // namespace dflash::cuda
