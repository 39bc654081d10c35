// CUDA host side of block_conv (DFlash2): the shared input checks, contiguous operands, the
// launch. Kernel: dflash/cuda/block_conv.cuh.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/block_conv_params.h"

namespace dflash::cuda {
namespace {

constexpr ArchTable<BlockConvLaunchers> kLaunchers = DFLASH_ARCH_TABLE(block_conv_launchers);

at::Tensor block_conv_cuda(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta) {
  const auto d = check_block_conv(x, base, delta);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous(), bc = base.contiguous(), dc = delta.contiguous();
  auto out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  BlockConvParams p{};
  p.x = xc.data_ptr();
  p.base = bc.data_ptr();
  p.delta = dc.data_ptr();
  p.out = out.data_ptr();
  p.M = d.M;
  p.B = narrow(d.B, "B");
  p.H = narrow(d.H, "H");
  p.T = narrow(d.T, "T");
  p.G = narrow(d.G, "G");
  narrow(d.M * d.B, "M * B");  // one CTA per row: the grid's x dimension
  p.dtype = dtype_of(out);
  kLaunchers[device_info(x.device()).arch].launch(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("block_conv", &dflash::cuda::block_conv_cuda);
}
