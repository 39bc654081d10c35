// Op schemas (TORCH_LIBRARY), and skinny_linear's library fallback for devices without
// a kernel of ours. The device kernels register in cpu/ and cuda/.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "dflash/checks.h"

TORCH_LIBRARY(dflash_ext, m) {
  m.def("project_features(Tensor[] features, Tensor fc_weight, Tensor norm_weight, float eps) -> Tensor");
  m.def(
      "inject_context_kv(Tensor ctx, Tensor k_weight, Tensor v_weight, Tensor k_norm_weight, "
      "Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, float eps, bool validate=True) -> ()");
  m.def(
      "block_attention(Tensor q, Tensor k_block, Tensor v_block, Tensor k_cache, Tensor v_cache, "
      "Tensor cache_offsets, Tensor cache_lens, float scale, int window=0, int max_context=-1, "
      "bool validate=True, bool causal=False) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

// skinny_linear on devices without a kernel of ours (CUDA: cuBLAS handles few rows itself):
// the checks, then at::linear. The CPU kernel (cpu/skinny_linear.cpp) takes precedence.
static at::Tensor skinny_linear_library(const at::Tensor& x, const at::Tensor& weight,
                                        const c10::optional<at::Tensor>& bias) {
  dflash::check_skinny_linear(x, weight, bias);
  return at::linear(x, weight, bias);
}

TORCH_LIBRARY_IMPL(dflash_ext, CompositeExplicitAutograd, m) { m.impl("skinny_linear", &skinny_linear_library); }
