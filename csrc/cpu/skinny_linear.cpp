// CPU skinny_linear: F.linear for a few rows, the weight streamed once. A verify pass of
// B <= 8 tokens runs every linear layer of the target on B rows, where the library GEMM
// (MKL sgemm) costs about 2x its one-row GEMV on the CPUs measured (bench/RESULTS.md §1; bench/results/history/notebook-2026.md §6):
// here each thread owns a block of weight rows and takes the dot products of all input
// rows with each weight row as it streams past, in fp32 (reduced dtypes converted on the
// fly). Other shapes, and the rows gemm_path (isa.h) sends to oneDNN, go to at::linear.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_utils.h"
#include "isa.h"
#include "dflash/checks.h"

namespace dflash::cpu {
namespace {

template <typename T>
void skinny_linear_impl(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::Tensor& out, const SkinnyLinearDims& d) {
  const int64_t M = d.M, N = d.N, K = d.K;
  at::Tensor acc = std::is_same_v<T, float> ? out : at::empty({M, N}, out.options().dtype(at::kFloat));
  float* c = acc.data_ptr<float>();
  std::vector<float> x_buf;
  const F32Rows a = rows_as_f32(x.data_ptr<T>(), M, K, x.stride(0), x_buf);
  const T* w = weight.data_ptr<T>();
  const int64_t block = weight_rows_per_tile(N);
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block;
      stream_gemm_nt(M, std::min(block, N - n0), K, a.ptr, a.ld, w + n0 * K, K, 0.f, c + n0, N);
    }
  });
  if (bias.has_value() && bias->defined()) acc.add_(bias->to(at::kFloat));
  if constexpr (!std::is_same_v<T, float>) out.copy_(acc);
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const SkinnyLinearDims d = check_skinny_linear(x, weight, bias);
  const int64_t weight_bytes = weight.numel() * weight.element_size();
  if (d.K == 0 || !skinny_linear_streams(x.scalar_type(), d.M, weight_bytes)) return at::linear(x, weight, bias);
  const at::Tensor xr = with_readable_rows(x), w = weight.contiguous();
  at::Tensor out = at::empty({d.M, d.N}, x.options());
  DFLASH_DISPATCH_FLOATING(out.scalar_type(), "skinny_linear", [&] {
    skinny_linear_impl<scalar_t>(xr, w, bias, out, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace dflash::cpu
