// CUDA host side of the draft layer's norms (rms_norm, add_rms_norm, qk_norm_rope): the
// shared input checks, contiguous operands, and dispatch to the launchers of the device's
// architecture (kernel_arch_for in plans.h, as ops_cuda.cpp picks them). Kept apart from
// ops_cuda.cpp so these ops add files rather than edit it. No host reads of tensor values:
// a captured CUDA graph replays them.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>
#include <utility>

#include "dflash/checks.h"
#include "dflash/cuda/norm_params.h"
#include "dflash/cuda/plans.h"

namespace dflash::cuda {
namespace {

struct NormLaunchers {
  void (*rms_norm)(const RmsNormParams&, cudaStream_t);
  void (*qk_norm_rope)(const QkNormRopeParams&, cudaStream_t);
};

// Read per call: two attribute queries on the host (no device work, allowed while a CUDA
// graph is captured); cheap next to a kernel launch.
NormLaunchers norm_launchers(const at::Device& device) {
  int major = 0, minor = 0;
  for (auto [attr, value] : {std::pair{cudaDevAttrComputeCapabilityMajor, &major},
                             std::pair{cudaDevAttrComputeCapabilityMinor, &minor}}) {
    const cudaError_t err = cudaDeviceGetAttribute(value, attr, device.index());
    TORCH_CHECK(err == cudaSuccess, "dflash_ext: reading the compute capability failed: ", cudaGetErrorString(err));
  }
  TORCH_CHECK(major >= 8, "dflash_ext CUDA kernels need compute capability 8.0 or newer (Ampere+); ", device, " has ",
              major, ".", minor);
  switch (kernel_arch_for(major, minor, compiled_kernel_archs())) {
#ifdef DFLASH_CUDA_ARCH_SM80
    case KernelArch::kSm80: return {&sm80::rms_norm, &sm80::qk_norm_rope};
#endif
#ifdef DFLASH_CUDA_ARCH_SM90A
    case KernelArch::kSm90a: return {&sm90a::rms_norm, &sm90a::qk_norm_rope};
#endif
#ifdef DFLASH_CUDA_ARCH_SM100
    case KernelArch::kSm100: return {&sm100::rms_norm, &sm100::qk_norm_rope};
#endif
    default:
      TORCH_CHECK(false, "dflash_ext was built without kernels for ", device, " (compute capability ", major, ".",
                  minor, "): rebuild with DFLASH_CUDA_ARCHS including sm80 or this GPU's own set");
  }
}

DType norm_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? DType::kFloat32 : t.scalar_type() == at::kBFloat16 ? DType::kBFloat16
                                                                                           : DType::kFloat16;
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
  p.dtype = norm_dtype(x);
  norm_launchers(x.device()).rms_norm(p, c10::cuda::getCurrentCUDAStream());
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
  p.dtype = norm_dtype(qkv);
  norm_launchers(qkv.device()).qk_norm_rope(p, c10::cuda::getCurrentCUDAStream());
  return {q, k};
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("rms_norm", &dflash::cuda::rms_norm_cuda);
  m.impl("add_rms_norm", &dflash::cuda::add_rms_norm_cuda);
  m.impl("qk_norm_rope", &dflash::cuda::qk_norm_rope_cuda);
}
