// Every op's schema (the one TORCH_LIBRARY block), and the fallbacks in ATen ops for devices
// without a kernel of ours (skinny_linear, block_conv). The device kernels register in
// cpu/<family>.cpp and cuda/<family>.cpp; the specs are in dflash_ext/ops/reference.py.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>

#include "dflash/checks.h"

TORCH_LIBRARY(dflash_ext, m) {
  // The context path: the target's hidden states to the drafter's K/V cache.
  m.def("project_features(Tensor[] features, Tensor fc_weight, Tensor norm_weight, float eps) -> Tensor");
  m.def(
      "inject_context_kv(Tensor ctx, Tensor k_weight, Tensor v_weight, Tensor k_norm_weight, "
      "Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, float eps, bool validate=True) -> ()");
  // The draft layer: attention, the few-row linear, DFlash2's block convolution, and the norms
  // (rms_norm and add_rms_norm take x [..., H]; qk_norm_rope a layer's stacked q/k/v
  // projection [M, (Hq + 2 Hkv) * D]).
  m.def(
      "block_attention(Tensor q, Tensor k_block, Tensor v_block, Tensor k_cache, Tensor v_cache, "
      "Tensor cache_offsets, Tensor cache_lens, float scale, int window=0, int max_context=-1, "
      "bool validate=True, bool causal=False, bool symmetric=False) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("block_conv(Tensor x, Tensor base, Tensor delta) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "qk_norm_rope(Tensor qkv, Tensor q_norm_weight, Tensor k_norm_weight, Tensor cos, Tensor sin, "
      "int num_q_heads, int num_kv_heads, float eps) -> (Tensor, Tensor)");
}

// skinny_linear on devices without a kernel of ours (CUDA: cuBLAS handles few rows itself):
// the checks, then at::linear. The CPU kernel (cpu/skinny_linear.cpp) takes precedence.
static at::Tensor skinny_linear_library(const at::Tensor& x, const at::Tensor& weight,
                                        const c10::optional<at::Tensor>& bias) {
  dflash::check_skinny_linear(x, weight, bias);
  return at::linear(x, weight, bias);
}

// block_conv on devices without a kernel of ours (the CPU's is cpu/block_conv.cpp, CUDA's
// cuda/block_conv.cpp): the checks, then the math of dflash_ext.ops.reference.block_conv in
// ATen ops (fp32, one cast to x's dtype).
static at::Tensor block_conv_unfused(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta) {
  const dflash::BlockConvDims d = dflash::check_block_conv(x, base, delta);
  const at::Tensor xs = x.to(at::kFloat);
  const at::Tensor coef = base.to(at::kFloat).view({1, 1, d.T, d.H}) +
                          delta.to(at::kFloat).repeat_interleave(d.H / d.G, /*dim=*/-1);  // [M, B, T, H]
  at::Tensor out = at::zeros({d.M, d.B, d.H}, xs.options());
  for (int64_t t = 0; t < std::min(d.T, d.B); ++t)
    out.narrow(1, t, d.B - t).addcmul_(coef.select(2, t).narrow(1, t, d.B - t), xs.narrow(1, 0, d.B - t));
  return out.to(x.scalar_type());
}

TORCH_LIBRARY_IMPL(dflash_ext, CompositeExplicitAutograd, m) {
  m.impl("skinny_linear", &skinny_linear_library);
  m.impl("block_conv", &block_conv_unfused);
}
