// The input checks shared by every device implementation of the ops (dflash/checks.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dflash/checks.h"
#include "dflash/window.h"

namespace dflash {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// `name` must be a floating tensor of the op's dtype, on the op's device, of rank `dim`.
void check_tensor(const at::Tensor& t, const char* name, int64_t dim, const at::Tensor& like,
                  const char* like_name) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but ", like_name,
              " is on ", like.device(), ": all tensors must be on one device");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(),
              " but ", like_name, " has dtype ", like.scalar_type(),
              ": all floating tensors must share one dtype");
}

void check_index(const at::Tensor& t, const char* name, int64_t len, const at::Tensor& like,
                 const char* like_name) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == len, name, " must have shape [", len, "], got ",
              t.sizes());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but ", like_name,
              " is on ", like.device(), ": all tensors must be on one device");
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

}  // namespace

ProjectFeaturesDims check_project_features(at::TensorList features, const at::Tensor& fc_weight,
                                           const at::Tensor& norm_weight, double eps) {
  TORCH_CHECK(!features.empty(), "features must hold at least one tensor (k >= 1), got an empty list");
  const at::Tensor& f0 = features[0];
  TORCH_CHECK(f0.defined() && f0.dim() == 2, "features[0] must be a 2-D tensor [T, H], got shape ",
              f0.defined() ? f0.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(f0.scalar_type()),
              "features[0] must be float32, bfloat16 or float16, got ", f0.scalar_type());
  const int64_t k = features.size(), T = f0.size(0), H = f0.size(1);
  for (int64_t j = 1; j < k; ++j) {
    const std::string name = "features[" + std::to_string(j) + "]";
    check_tensor(features[j], name.c_str(), 2, f0, "features[0]");
    check_shape(features[j], name.c_str(), {T, H});
  }
  check_tensor(fc_weight, "fc_weight", 2, f0, "features[0]");
  TORCH_CHECK(fc_weight.size(1) == k * H, "fc_weight must have shape [H_out, k*H] = [H_out, ", k * H,
              "] for k=", k, " features of width H=", H, ", got ", fc_weight.sizes());
  const int64_t H_out = fc_weight.size(0);
  check_tensor(norm_weight, "norm_weight", 1, f0, "features[0]");
  check_shape(norm_weight, "norm_weight", {H_out});
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  return {k, T, H, H_out};
}

InjectDims check_inject_context_kv(const at::Tensor& ctx, const at::Tensor& k_weight,
                                   const at::Tensor& v_weight, const at::Tensor& k_norm_weight,
                                   const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& positions, const at::Tensor& slots,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache, double eps) {
  TORCH_CHECK(ctx.defined() && ctx.dim() == 2, "ctx must be a 2-D tensor [T, H], got shape ",
              ctx.defined() ? ctx.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(ctx.scalar_type()),
              "ctx must be float32, bfloat16 or float16, got ", ctx.scalar_type());
  const int64_t T = ctx.size(0), H = ctx.size(1);
  check_tensor(k_cache, "k_cache", 4, ctx, "ctx");
  const int64_t N = k_cache.size(0), S = k_cache.size(1), Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D % 2 == 0, "k_cache head dim D must be even for rotate_half RoPE, got D=", D);
  check_tensor(v_cache, "v_cache", 4, ctx, "ctx");
  check_shape(v_cache, "v_cache", k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous(), "k_cache must be contiguous (it is written in place)");
  TORCH_CHECK(v_cache.is_contiguous(), "v_cache must be contiguous (it is written in place)");
  TORCH_CHECK(!k_cache.is_same(v_cache), "k_cache and v_cache must be different tensors");
  check_tensor(k_weight, "k_weight", 3, ctx, "ctx");
  check_shape(k_weight, "k_weight", {N, Hkv * D, H});
  check_tensor(v_weight, "v_weight", 3, ctx, "ctx");
  check_shape(v_weight, "v_weight", {N, Hkv * D, H});
  check_tensor(k_norm_weight, "k_norm_weight", 2, ctx, "ctx");
  check_shape(k_norm_weight, "k_norm_weight", {N, D});
  check_tensor(cos, "cos", 2, ctx, "ctx");
  const int64_t P = cos.size(0);
  TORCH_CHECK(cos.size(1) == D, "cos must have shape [P, D] with D=", D, ", got ", cos.sizes());
  check_tensor(sin, "sin", 2, ctx, "ctx");
  check_shape(sin, "sin", cos.sizes());
  check_index(positions, "positions", T, ctx, "ctx");
  check_index(slots, "slots", T, ctx, "ctx");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  return {T, H, N, Hkv, D, S, P};
}

BlockAttentionDims check_block_attention(const at::Tensor& q, const at::Tensor& k_block,
                                         const at::Tensor& v_block, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& cache_offsets,
                                         const at::Tensor& cache_lens, double scale, int64_t window,
                                         int64_t max_context, bool causal, bool symmetric) {
  TORCH_CHECK(q.defined() && q.dim() == 4, "q must be a 4-D tensor [Bsz, Bq, Hq, D], got shape ",
              q.defined() ? q.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(q.scalar_type()),
              "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  const int64_t Bsz = q.size(0), Bq = q.size(1), Hq = q.size(2), D = q.size(3);
  check_tensor(k_block, "k_block", 4, q, "q");
  const int64_t Hkv = k_block.size(2);
  check_shape(k_block, "k_block", {Bsz, Bq, Hkv, D});
  check_tensor(v_block, "v_block", 4, q, "q");
  check_shape(v_block, "v_block", {Bsz, Bq, Hkv, D});
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads Hq=", Hq,
              " must be a multiple of the KV heads Hkv=", Hkv, " of k_block");
  check_tensor(k_cache, "k_cache", 3, q, "q");
  const int64_t S = k_cache.size(0);
  check_shape(k_cache, "k_cache", {S, Hkv, D});
  check_tensor(v_cache, "v_cache", 3, q, "q");
  check_shape(v_cache, "v_cache", {S, Hkv, D});
  TORCH_CHECK(k_cache.is_contiguous(), "k_cache must be contiguous");
  TORCH_CHECK(v_cache.is_contiguous(), "v_cache must be contiguous");
  check_index(cache_offsets, "cache_offsets", Bsz, q, "q");
  check_index(cache_lens, "cache_lens", Bsz, q, "q");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = no window), got ", window);
  TORCH_CHECK(max_context >= -1, "max_context must be >= 0, or -1 (no bound), got ", max_context);
  TORCH_CHECK(!(causal && symmetric), "causal and symmetric exclude each other (causal: keys up to the query; "
              "symmetric: a window on both sides of it); got both True");
  return {Bsz, Bq, Hq, Hkv, D, S};
}

SkinnyLinearDims check_skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.defined() && x.dim() == 2, "x must be a 2-D tensor [M, K], got shape ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(x.scalar_type()), "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  check_tensor(weight, "weight", 2, x, "x");
  TORCH_CHECK(weight.size(1) == x.size(1), "weight must have shape [N, K] with K=", x.size(1),
              " (the width of x), got ", weight.sizes());
  const int64_t N = weight.size(0);
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", 1, x, "x");
    check_shape(*bias, "bias", {N});
  }
  return {x.size(0), N, x.size(1)};
}

BlockConvDims check_block_conv(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta) {
  TORCH_CHECK(x.defined() && x.dim() == 3, "x must be a 3-D tensor [M, B, H], got shape ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(x.scalar_type()), "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t M = x.size(0), B = x.size(1), H = x.size(2);
  check_tensor(base, "base", 2, x, "x");
  TORCH_CHECK(base.size(1) == H, "base must have shape [T, H] with H=", H, " (the width of x), got ", base.sizes());
  const int64_t T = base.size(0);
  check_tensor(delta, "delta", 4, x, "x");
  TORCH_CHECK(delta.size(0) == M && delta.size(1) == B && delta.size(2) == T, "delta must have shape [M, B, T, G] = [",
              M, ", ", B, ", ", T, ", G] (M, B of x, T of base), got ", delta.sizes());
  const int64_t G = delta.size(3);
  TORCH_CHECK(G > 0 && H % G == 0, "delta's channel groups G=", G, " (its last dim) must be >= 1 and divide H=", H,
              " (the width of x)");
  return {M, B, H, T, G};
}

void check_inject_indices(const at::Tensor& positions_cpu, const at::Tensor& slots_cpu, int64_t P,
                          int64_t S) {
  const auto pos = positions_cpu.contiguous();
  const auto sl = slots_cpu.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = sl.data_ptr<int64_t>();
  std::vector<int64_t> written;
  written.reserve(sl.numel());
  for (int64_t t = 0; t < pos.numel(); ++t) {
    TORCH_CHECK(s[t] >= -1 && s[t] < S, "slots[", t, "] = ", s[t],
                " is out of range [-1, S) with S=", S, " rows in k_cache");
    if (s[t] < 0) continue;  // a skipped token: its position is never read (as in the reference)
    TORCH_CHECK(p[t] >= 0 && p[t] < P, "positions[", t, "] = ", p[t],
                " is out of range [0, P) with P=", P, " rows in cos/sin");
    written.push_back(s[t]);
  }
  std::sort(written.begin(), written.end());
  const auto dup = std::adjacent_find(written.begin(), written.end());
  TORCH_CHECK(dup == written.end(), "slots must not repeat a cache row, but row ", *dup,
              " is written more than once");
}

void check_cache_ranges(const at::Tensor& offsets_cpu, const at::Tensor& lens_cpu, int64_t S, int64_t window,
                        bool causal, bool symmetric, int64_t max_context) {
  const auto off = offsets_cpu.contiguous();
  const auto len = lens_cpu.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* l = len.data_ptr<int64_t>();
  for (int64_t b = 0; b < off.numel(); ++b) {
    TORCH_CHECK(o[b] >= 0, "cache_offsets[", b, "] = ", o[b], " must be >= 0");
    TORCH_CHECK(l[b] >= 0, "cache_lens[", b, "] = ", l[b], " must be >= 0");
    // l <= S - o, never o + l <= S: the sum of two int64 values can overflow (UB, wraps negative).
    TORCH_CHECK(o[b] <= S && l[b] <= S - o[b], "context of sequence ", b, " (cache_offsets[", b, "] = ", o[b],
                ", cache_lens[", b, "] = ", l[b], ") runs past the end of the cache (S=", S, " rows)");
    const int64_t visible = visible_context(l[b], window, causal || symmetric);
    TORCH_CHECK(max_context < 0 || visible <= max_context, "sequence ", b, " sees ", visible,
                " context rows (cache_lens[", b, "] = ", l[b], ", window ", window,
                causal ? ", causal" : symmetric ? ", symmetric" : "",
                ") but max_context is ", max_context);
  }
}

// ---------------------------------------------------------------- the draft layer's norms

RmsNormDims check_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.defined() && x.dim() >= 1, "x must be a tensor [..., H] of at least 1 dimension, got shape ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(x.scalar_type()), "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t H = x.size(-1);
  if (residual.defined()) {
    check_tensor(residual, "residual", x.dim(), x, "x");
    check_shape(residual, "residual", x.sizes());
  }
  check_tensor(weight, "weight", 1, x, "x");
  check_shape(weight, "weight", {H});
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  return {H == 0 ? 0 : x.numel() / H, H};
}

QkNormRopeDims check_qk_norm_rope(const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                                  const at::Tensor& k_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                                  int64_t num_q_heads, int64_t num_kv_heads, double eps) {
  TORCH_CHECK(qkv.defined() && qkv.dim() == 2, "qkv must be a 2-D tensor [M, (Hq + 2*Hkv) * D], got shape ",
              qkv.defined() ? qkv.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_supported_float(qkv.scalar_type()), "qkv must be float32, bfloat16 or float16, got ",
              qkv.scalar_type());
  TORCH_CHECK(num_q_heads > 0, "num_q_heads must be >= 1, got ", num_q_heads);
  TORCH_CHECK(num_kv_heads > 0, "num_kv_heads must be >= 1, got ", num_kv_heads);
  check_tensor(q_norm_weight, "q_norm_weight", 1, qkv, "qkv");
  const int64_t M = qkv.size(0), D = q_norm_weight.size(0);
  TORCH_CHECK(D > 0 && D % 2 == 0, "q_norm_weight must have shape [D] with D even (rotate_half RoPE), got ",
              q_norm_weight.sizes());
  check_tensor(k_norm_weight, "k_norm_weight", 1, qkv, "qkv");
  check_shape(k_norm_weight, "k_norm_weight", {D});
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D, "qkv must have shape [M, (Hq + 2*Hkv) * D] = [M, ",
              (num_q_heads + 2 * num_kv_heads) * D, "] for Hq=", num_q_heads, ", Hkv=", num_kv_heads, ", D=", D,
              " (the size of q_norm_weight), got ", qkv.sizes());
  check_tensor(cos, "cos", 2, qkv, "qkv");
  check_shape(cos, "cos", {M, D});
  check_tensor(sin, "sin", 2, qkv, "qkv");
  check_shape(sin, "sin", {M, D});
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  return {M, num_q_heads, num_kv_heads, D};
}

}  // namespace dflash
