// Input checks shared by every device implementation of the dflash_ext ops.
// Shape, dtype and device checks read only metadata; the index-range checks read
// values and therefore take tensors that live on the host.
#pragma once
#include <ATen/core/Tensor.h>

namespace dflash {

struct ProjectFeaturesDims { int64_t k, T, H, H_out; };
struct InjectDims { int64_t T, H, N, Hkv, D, S, P; };
struct BlockAttentionDims { int64_t Bsz, Bq, Hq, Hkv, D, S; };
struct SkinnyLinearDims { int64_t M, N, K; };
struct BlockConvDims { int64_t M, B, H, T, G; };

ProjectFeaturesDims check_project_features(at::TensorList features, const at::Tensor& fc_weight,
                                           const at::Tensor& norm_weight, double eps);
InjectDims check_inject_context_kv(const at::Tensor& ctx, const at::Tensor& k_weight,
                                   const at::Tensor& v_weight, const at::Tensor& k_norm_weight,
                                   const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& positions, const at::Tensor& slots,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache, double eps);
BlockAttentionDims check_block_attention(const at::Tensor& q, const at::Tensor& k_block,
                                         const at::Tensor& v_block, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& cache_offsets,
                                         const at::Tensor& cache_lens, double scale, int64_t window,
                                         int64_t max_context, bool causal, bool symmetric);
SkinnyLinearDims check_skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias);
BlockConvDims check_block_conv(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta);

// Value checks (host tensors): positions in [0, P), slots in [-1, S) and unique.
void check_inject_indices(const at::Tensor& positions_cpu, const at::Tensor& slots_cpu,
                          int64_t P, int64_t S);
// Value checks (host tensors): offsets >= 0, lens >= 0, offset + len <= S, and the
// visible context (visible_context in window.h: the rows all queries of a sequence see
// together) at most max_context (>= 0 only).
void check_cache_ranges(const at::Tensor& offsets_cpu, const at::Tensor& lens_cpu, int64_t S, int64_t window,
                        bool causal, bool symmetric, int64_t max_context);

// The draft layer's norms. RmsNormDims: rows = numel / H of x [..., H];
// `residual` may be undefined (rms_norm) or must match x (add_rms_norm).
struct RmsNormDims { int64_t rows, H; };
struct QkNormRopeDims { int64_t M, Hq, Hkv, D; };
RmsNormDims check_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
QkNormRopeDims check_qk_norm_rope(const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                                  const at::Tensor& k_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                                  int64_t num_q_heads, int64_t num_kv_heads, double eps);

}  // namespace dflash
