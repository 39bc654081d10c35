// CPU kernels of the draft layer's norms (specs: dflash_ext.ops.reference.rms_norm, qk_norm_rope):
//   rms_norm      out = x * rsqrt(mean(x^2) + eps) * weight, per row of H
//   add_rms_norm  s = x + residual (rounded to the dtype, as a separate add), then rms_norm(s)
//   qk_norm_rope  each q and k head of a stacked q/k/v row RMS-normed over D, then RoPE-rotated
// One pass per row in fp32 (rows converted on the load, one cast at the store); rows in
// parallel. Bound by memory and small (a draft step's rows): no ISA-specific paths.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "cpu_utils.h"
#include "dflash/checks.h"

namespace dflash::cpu {
namespace {

constexpr int64_t kGrainElements = int64_t{1} << 14;  // elements per parallel chunk, at least

// 1 / sqrt(mean(v^2) + eps) of the n fp32 values at v.
float inv_rms(const float* v, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_of_squares(v, n) / static_cast<float>(n) + eps);
}

template <typename T>
void rms_norm_impl(const T* x, const T* residual, const float* w, T* sum_out, T* out, const RmsNormDims& d,
                   double eps) {
  const int64_t H = d.H;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, H));
  at::parallel_for(0, d.rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H), res(residual != nullptr ? H : 0);
    for (int64_t r = r0; r < r1; ++r) {
      to_float(x + r * H, row.data(), H);
      if (residual != nullptr) {  // s = x + residual, rounded to T, then normed from the rounded value
        to_float(residual + r * H, res.data(), H);
        for (int64_t i = 0; i < H; ++i) row[i] += res[i];
        from_float(row.data(), sum_out + r * H, H);
        to_float(sum_out + r * H, row.data(), H);
      }
      scale_by_weight(row.data(), w, inv_rms(row.data(), H, static_cast<float>(eps)), H);
      from_float(row.data(), out + r * H, H);
    }
  });
}

std::vector<at::Tensor> rms_norm_launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps) {
  const RmsNormDims d = check_rms_norm(x, residual, weight, eps);
  const at::Tensor xc = x.contiguous(), rc = residual.defined() ? residual.contiguous() : residual;
  const at::Tensor w32 = weight.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual.defined() ? at::empty(x.sizes(), x.options()) : at::Tensor();
  if (out.numel() > 0) {
    DFLASH_DISPATCH_FLOATING(x.scalar_type(), "rms_norm", [&] {
      rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), rc.defined() ? rc.data_ptr<scalar_t>() : nullptr,
                              w32.data_ptr<float>(), sum.defined() ? sum.data_ptr<scalar_t>() : nullptr,
                              out.data_ptr<scalar_t>(), d, eps);
    });
  }
  if (sum.defined()) return {sum, out};
  return {out};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_launch(x, at::Tensor(), weight, eps)[0];
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.defined(), "residual must be a tensor");
  auto outs = rms_norm_launch(x, residual, weight, eps);
  return {outs[0], outs[1]};
}

// One head of D values at `src` (fp32 in `h`): normed by `w`, rotated by cos/sin, stored to `dst`.
template <typename T>
void norm_rope_head(const T* src, const float* w, const float* cos, const float* sin, float eps, float* h, T* dst,
                    int64_t D) {
  to_float(src, h, D);
  scale_by_weight(h, w, inv_rms(h, D, eps), D);
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {  // rotate_half: [-x2, x1]
    const float x1 = h[i], x2 = h[i + half];
    dst[i] = static_cast<T>(x1 * cos[i] + -x2 * sin[i]);
    dst[i + half] = static_cast<T>(x2 * cos[i + half] + x1 * sin[i + half]);
  }
}

template <typename T>
void qk_norm_rope_impl(const at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& q, at::Tensor& k, const QkNormRopeDims& d, double eps) {
  const int64_t D = d.D, heads = d.Hq + d.Hkv, ld = qkv.stride(0);
  const T* x = qkv.data_ptr<T>();
  const float *qwp = qw.data_ptr<float>(), *kwp = kw.data_ptr<float>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  at::parallel_for(0, d.M, std::max<int64_t>(1, kGrainElements / (heads * D)), [&](int64_t m0, int64_t m1) {
    std::vector<float> c(D), s(D), h(D);
    for (int64_t m = m0; m < m1; ++m) {
      to_float(cp + m * cs, c.data(), D);
      to_float(sp + m * ss, s.data(), D);
      for (int64_t j = 0; j < heads; ++j) {
        const bool is_q = j < d.Hq;
        T* dst = is_q ? qp + (m * d.Hq + j) * D : kp + (m * d.Hkv + j - d.Hq) * D;
        norm_rope_head(x + m * ld + j * D, is_q ? qwp : kwp, c.data(), s.data(), static_cast<float>(eps), h.data(),
                       dst, D);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_cpu(const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                                                     const at::Tensor& k_norm_weight, const at::Tensor& cos,
                                                     const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                                                     double eps) {
  const QkNormRopeDims d = check_qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, num_q_heads,
                                              num_kv_heads, eps);
  // Rows are read at their stride (qkv may be a row-strided view); the head values need unit stride.
  const at::Tensor x = qkv.stride(1) == 1 ? qkv : qkv.contiguous();
  const at::Tensor c = cos.stride(1) == 1 ? cos : cos.contiguous(), s = sin.stride(1) == 1 ? sin : sin.contiguous();
  const at::Tensor qw = q_norm_weight.to(at::kFloat).contiguous(), kw = k_norm_weight.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({d.M, d.Hq, d.D}, qkv.options()), k = at::empty({d.M, d.Hkv, d.D}, qkv.options());
  if (d.M > 0) {
    DFLASH_DISPATCH_FLOATING(qkv.scalar_type(), "qk_norm_rope",
                             [&] { qk_norm_rope_impl<scalar_t>(x, qw, kw, c, s, q, k, d, eps); });
  }
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("qk_norm_rope", &qk_norm_rope_cpu);
}

}  // namespace dflash::cpu
