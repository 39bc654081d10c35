// CUDA host side of inject_context_kv: the shared input checks (and, validating, the index
// values), contiguous operands, the plan (GEMV, tensor cores with split-K, or SIMT) and its
// workspaces, the launch. Kernels: dflash/cuda/inject_context_kv.cuh.
// validate=true reads the index values on the host (one small copy, a sync) for clear
// errors; validate=false reads nothing on the host, so a step can be captured in a CUDA
// graph, and the kernels' index guards (params.h) keep every access in bounds.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <utility>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/inject_context_kv_params.h"

namespace dflash::cuda {
namespace {

constexpr ArchTable<InjectLaunchers> kLaunchers = DFLASH_ARCH_TABLE(inject_context_kv_launchers);

void inject_context_kv_cuda(const at::Tensor& ctx, const at::Tensor& k_weight,
                            const at::Tensor& v_weight, const at::Tensor& k_norm_weight,
                            const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& positions, const at::Tensor& slots,
                            at::Tensor& k_cache, at::Tensor& v_cache, double eps, bool validate) {
  const auto d = check_inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin,
                                         positions, slots, k_cache, v_cache, eps);
  TORCH_CHECK(d.D <= kInjectMaxHeadDim, "inject_context_kv on CUDA takes head dims up to ", kInjectMaxHeadDim,
              ", got D=", d.D);
  // validate: a bad slot is an error, not a skipped row (one small host copy).
  if (validate) check_inject_indices(positions.cpu(), slots.cpu(), d.P, d.S);
  if (d.T == 0 || d.N == 0 || d.Hkv == 0 || d.D == 0) return;
  const c10::cuda::CUDAGuard guard(ctx.device());
  const auto x = ctx.contiguous(), kw = k_weight.contiguous(), vw = v_weight.contiguous();
  const auto kn = k_norm_weight.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const auto pos = positions.contiguous(), sl = slots.contiguous();
  InjectParams p{};
  p.ctx = x.data_ptr();
  p.k_weight = kw.data_ptr();
  p.v_weight = vw.data_ptr();
  p.k_norm_weight = kn.data_ptr();
  p.cos = c.data_ptr();
  p.sin = s.data_ptr();
  p.positions = pos.data_ptr<int64_t>();
  p.slots = sl.data_ptr<int64_t>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.T = narrow(d.T, "T");
  p.H = narrow(d.H, "H");
  p.N = narrow(d.N, "N");
  p.Hkv = narrow(d.Hkv, "Hkv");
  p.D = narrow(d.D, "D");
  p.S = d.S;
  p.P = d.P;
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(ctx);
  const auto info = device_info(ctx.device());
  const InjectLaunchers& kernels = kLaunchers[info.arch];
  kernels.plan(p, info.limits);
  at::Tensor workspace;
  std::pair<at::Tensor, at::Tensor> gemv;
  if (p.path == static_cast<int>(GemmPath::kGemv)) gemv = gemv_workspace(p.gemv, ctx.options());
  if (p.splits > 1) {
    workspace = at::empty({p.splits, d.N * 2 * d.Hkv, d.T, d.D}, ctx.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  kernels.launch(p, c10::cuda::getCurrentCUDAStream());
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("inject_context_kv", &dflash::cuda::inject_context_kv_cuda);
}
