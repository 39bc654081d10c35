// CUDA host side of the draft layer's norms (rms_norm, add_rms_norm, qk_norm_rope): the
// shared input checks, contiguous operands, whether the kernels may move rows in 16-byte
// accesses, the launch. No host reads of tensor values: a captured CUDA graph replays them.
// Kernels: dflash/cuda/norms.cuh.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/norms_params.h"

namespace dflash::cuda {
namespace {

constexpr ArchTable<NormsLaunchers> kLaunchers = DFLASH_ARCH_TABLE(norms_launchers);

// Whether the kernels may move `period`-element runs of elements of `element_size` bytes in
// 16-byte accesses: every run starts on a 16-byte boundary when every base pointer does
// (torch's allocations do; a view at a storage offset may not) and the runs are whole vectors.
// Pointers only: no tensor values are read.
bool vector_accesses(std::initializer_list<const void*> pointers, std::initializer_list<int64_t> periods,
                     int64_t element_size) {
  for (const void* ptr : pointers)
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  for (const int64_t period : periods)
    if (period * element_size % 16 != 0) return false;
  return true;
}

// out (and sum, with a residual) in x's shape, contiguous.
std::tuple<at::Tensor, at::Tensor> rms_norm_launch(const at::Tensor& x, const at::Tensor& residual,
                                                   const at::Tensor& weight, double eps) {
  const RmsNormDims d = check_rms_norm(x, residual, weight, eps);
  TORCH_CHECK(d.rows <= INT32_MAX && d.H <= INT32_MAX, "rms_norm on CUDA takes up to 2^31 - 1 rows of up to "
              "2^31 - 1 elements, got ", d.rows, " rows of ", d.H);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), rc = residual.defined() ? residual.contiguous() : residual;
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual.defined() ? at::empty(x.sizes(), x.options()) : at::Tensor();
  if (out.numel() == 0) return {sum, out};
  RmsNormParams p{};
  p.x = xc.data_ptr();
  p.residual = rc.defined() ? rc.data_ptr() : nullptr;
  p.weight = wc.data_ptr();
  p.sum = sum.defined() ? sum.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.rows = d.rows;
  p.H = static_cast<int>(d.H);
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(x);
  p.vec = vector_accesses({p.x, p.residual, p.weight, p.sum, p.out}, {d.H}, x.element_size());
  kLaunchers[device_info(x.device()).arch].rms_norm(p, c10::cuda::getCurrentCUDAStream());
  return {sum, out};
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<1>(rms_norm_launch(x, at::Tensor(), weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.defined(), "residual must be a tensor");
  return rms_norm_launch(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_cuda(const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                                                      const at::Tensor& k_norm_weight, const at::Tensor& cos,
                                                      const at::Tensor& sin, int64_t num_q_heads,
                                                      int64_t num_kv_heads, double eps) {
  const QkNormRopeDims d = check_qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, num_q_heads,
                                              num_kv_heads, eps);
  TORCH_CHECK(d.M * (d.Hq + d.Hkv) <= INT32_MAX, "qk_norm_rope on CUDA takes up to 2^31 - 1 (row, head) pairs, got ",
              d.M * (d.Hq + d.Hkv));
  const c10::cuda::CUDAGuard guard(qkv.device());
  const at::Tensor x = qkv.stride(1) == 1 ? qkv : qkv.contiguous();  // rows read at their stride
  const at::Tensor qw = q_norm_weight.contiguous(), kw = k_norm_weight.contiguous();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor q = at::empty({d.M, d.Hq, d.D}, qkv.options()), k = at::empty({d.M, d.Hkv, d.D}, qkv.options());
  if (d.M == 0) return {q, k};
  QkNormRopeParams p{};
  p.qkv = x.data_ptr();
  p.q_norm_weight = qw.data_ptr();
  p.k_norm_weight = kw.data_ptr();
  p.cos = c.data_ptr();
  p.sin = s.data_ptr();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.M = d.M;
  p.ld = x.stride(0);
  p.Hq = static_cast<int>(d.Hq);
  p.Hkv = static_cast<int>(d.Hkv);
  p.D = static_cast<int>(d.D);
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(qkv);
  // rows ld apart, heads D apart, each half of a head (D / 2) a run
  p.vec = vector_accesses({p.qkv, p.q_norm_weight, p.k_norm_weight, p.cos, p.sin, p.q, p.k}, {p.ld, d.D / 2},
                          qkv.element_size());
  kLaunchers[device_info(qkv.device()).arch].qk_norm_rope(p, c10::cuda::getCurrentCUDAStream());
  return {q, k};
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("rms_norm", &dflash::cuda::rms_norm_cuda);
  m.impl("add_rms_norm", &dflash::cuda::add_rms_norm_cuda);
  m.impl("qk_norm_rope", &dflash::cuda::qk_norm_rope_cuda);
}
