// CPU inject_context_kv: for all N drafter layers at once, K = ctx · W_k^T and
// V = ctx · W_v^T (on the GEMM path isa.h picks: one library call per projection, or one
// pass of our GEMM tiles over the stacked [W_k; W_v] rows), then
// an epilogue per (token, layer) that applies the per-head k RMSNorm and RoPE and
// scatters K/V into the caches at `slots`. Tokens with slot -1 are never computed.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_utils.h"
#include "isa.h"
#include "dflash/checks.h"

namespace dflash::cpu {
namespace {

// y[0, D) = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]]
inline void rope(const float* x, const float* cos, const float* sin, float* y, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i);
    (x1 * Vec::loadu(cos + i) - x2 * Vec::loadu(sin + i)).store(y + i);
    (x2 * Vec::loadu(cos + half + i) + x1 * Vec::loadu(sin + half + i)).store(y + half + i);
  }
  for (; i < half; ++i) {
    y[i] = x[i] * cos[i] - x[half + i] * sin[i];
    y[half + i] = x[half + i] * cos[half + i] + x[i] * sin[half + i];
  }
}

template <typename T>
void inject_impl(const at::Tensor& ctx, const at::Tensor& k_weight, const at::Tensor& v_weight,
                 const at::Tensor& k_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<int64_t>& tokens, const int64_t* positions, const int64_t* slots,
                 at::Tensor& k_cache, at::Tensor& v_cache, float eps, const InjectDims& d) {
  const int64_t Tv = tokens.size(), H = d.H, D = d.D, HD = d.Hkv * d.D, NK = d.N * HD;

  // Projections of every layer, fp32: K [Tv, NK] then V [Tv, NK] (layer-major columns).
  at::Tensor proj = at::empty({2, Tv, NK}, ctx.options().dtype(at::kFloat));
  const at::Tensor weights[2] = {k_weight, v_weight};
  const T* ctx_ptr = ctx.data_ptr<T>();
  const int64_t weight_bytes = 2 * NK * H * static_cast<int64_t>(ctx.element_size());
  if (gemm_path(ctx.scalar_type(), Tv, weight_bytes) != GemmPath::tiles) {
    const at::Tensor x = Tv == d.T ? ctx : ctx.index_select(0, at::tensor(tokens));
    for (int64_t half = 0; half < 2; ++half) {
      at::Tensor p = proj[half];
      library_gemm_nt({x}, weights[half].view({NK, H}), p);
    }
  } else {
    // The written tokens' ctx rows in fp32 (the ctx tensor itself when fp32 and all are written).
    std::vector<float> x_buf;
    F32Rows x{nullptr, H};
    if (std::is_same_v<T, float> && Tv == d.T) {
      x = {reinterpret_cast<const float*>(ctx_ptr), ctx.stride(0)};
    } else {
      x_buf.resize(Tv * H);
      for (int64_t r = 0; r < Tv; ++r) to_float(ctx_ptr + tokens[r] * ctx.stride(0), x_buf.data() + r * H, H);
      x = {x_buf.data(), H};
    }
    // One pass of weight tiles over the stacked [W_k; W_v] rows.
    const int64_t block = weight_rows_per_tile(2 * NK);
    const int64_t blocks_per_half = (NK + block - 1) / block;
    at::parallel_for(0, 2 * blocks_per_half, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> w_buf;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t half = b / blocks_per_half, n0 = (b % blocks_per_half) * block;
        const int64_t rows = std::min(block, NK - n0);
        gemm_nt_weights(Tv, rows, H, x.ptr, x.ld, weights[half].data_ptr<T>() + n0 * H, H, 0.f,
                        proj[half].data_ptr<float>() + n0, NK, w_buf);
      }
    });
  }
  const float* proj_k = proj[0].data_ptr<float>();
  const float* proj_v = proj[1].data_ptr<float>();

  std::vector<float> knw(d.N * D);
  to_float(k_norm_weight.data_ptr<T>(), knw.data(), d.N * D);
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  at::parallel_for(0, Tv * d.N, 4, [&](int64_t w0, int64_t w1) {
    std::vector<float> cs(2 * D), head(D), roped(D);
    int64_t cached_pos = -1;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t r = w / d.N, layer = w % d.N, t = tokens[r];
      if (positions[t] != cached_pos) {
        cached_pos = positions[t];
        to_float(cos_ptr + cached_pos * D, cs.data(), D);
        to_float(sin_ptr + cached_pos * D, cs.data() + D, D);
      }
      const float* k_row = proj_k + r * NK + layer * HD;
      const int64_t dst = (layer * d.S + slots[t]) * HD;
      for (int64_t h = 0; h < d.Hkv; ++h) {
        std::memcpy(head.data(), k_row + h * D, D * sizeof(float));
        const float inv_rms = 1.f / std::sqrt(sum_of_squares(head.data(), D) / D + eps);
        scale_by_weight(head.data(), knw.data() + layer * D, inv_rms, D);
        rope(head.data(), cs.data(), cs.data() + D, roped.data(), D);
        from_float(roped.data(), kc + dst + h * D, D);
      }
      from_float(proj_v + r * NK + layer * HD, vc + dst, HD);
    }
  });
}

void inject_context_kv_cpu(const at::Tensor& ctx, const at::Tensor& k_weight,
                           const at::Tensor& v_weight, const at::Tensor& k_norm_weight,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                           const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache,
                           double eps, bool /*validate*/) {
  const InjectDims d = check_inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin,
                                               positions, slots, k_cache, v_cache, eps);
  // Always validated on the CPU: the values are in host memory, reading them costs nothing.
  check_inject_indices(positions, slots, d.P, d.S);
  const at::Tensor pos = positions.contiguous(), sl = slots.contiguous();
  const int64_t* slot_ptr = sl.data_ptr<int64_t>();
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < d.T; ++t)
    if (slot_ptr[t] >= 0) tokens.push_back(t);
  if (tokens.empty() || d.N == 0 || d.Hkv == 0 || d.D == 0) return;
  DFLASH_DISPATCH_FLOATING(ctx.scalar_type(), "inject_context_kv", [&] {
    inject_impl<scalar_t>(with_readable_rows(ctx), k_weight.contiguous(), v_weight.contiguous(),
                          k_norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), tokens,
                          pos.data_ptr<int64_t>(), slot_ptr, k_cache, v_cache,
                          static_cast<float>(eps), d);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("inject_context_kv", &inject_context_kv_cpu); }

}  // namespace dflash::cpu
