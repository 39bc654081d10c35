// CPU project_features: out = rms_norm(sum_j features[j] · W[:, jH:(j+1)H]^T) * norm_weight.
// The GEMM runs on the path isa.h picks: oneDNN (bf16 with bf16 units), MKL (fp32, many
// rows; one call per segment) or our tiles, where the k feature tensors are walked as
// K-segments of one GEMM (no concatenation), each thread owning a block of output columns.
// Either way the sum lands in an fp32 accumulator and the row RMSNorm runs over it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_utils.h"
#include "isa.h"
#include "dflash/checks.h"

namespace dflash::cpu {
namespace {

template <typename T>
void project_features_impl(const std::vector<at::Tensor>& features, const at::Tensor& fc_weight,
                           const at::Tensor& norm_weight, float eps, at::Tensor& out,
                           const ProjectFeaturesDims& d) {
  const int64_t k = d.k, T_ = d.T, H = d.H, H_out = d.H_out, ldw = k * H;

  // fp32 accumulator [T, H_out]: the output itself when it is fp32.
  at::Tensor acc = std::is_same_v<T, float> ? out : at::empty({T_, H_out}, out.options().dtype(at::kFloat));
  float* c = acc.data_ptr<float>();

  if (gemm_path(out.scalar_type(), T_, fc_weight.numel() * fc_weight.element_size()) != GemmPath::tiles) {
    library_gemm_nt(features, fc_weight, acc);
  } else {
    const T* w = fc_weight.data_ptr<T>();
    // Features as fp32 rows, one buffer per segment (reduced dtypes are converted once).
    std::vector<std::vector<float>> x_bufs(k);
    std::vector<F32Rows> x(k);
    for (int64_t j = 0; j < k; ++j) {
      const T* src = features[j].data_ptr<T>();
      const int64_t ld = features[j].stride(0);
      if constexpr (std::is_same_v<T, float>) {
        x[j] = {src, ld};
      } else {
        x_bufs[j].resize(T_ * H);
        float* dst = x_bufs[j].data();
        at::parallel_for(0, T_, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) to_float(src + r * ld, dst + r * H, H);
        });
        x[j] = {dst, H};
      }
    }
    const int64_t block = weight_rows_per_tile(H_out);
    const int64_t num_blocks = (H_out + block - 1) / block;
    at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> w_buf;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * block, rows = std::min(block, H_out - n0);
        for (int64_t j = 0; j < k; ++j) {
          gemm_nt_weights(T_, rows, H, x[j].ptr, x[j].ld, w + n0 * ldw + j * H, ldw,
                          j == 0 ? 0.f : 1.f, c + n0, H_out, w_buf);
        }
      }
    });
  }

  std::vector<float> nw(H_out);
  to_float(norm_weight.data_ptr<T>(), nw.data(), H_out);
  T* o = out.data_ptr<T>();
  at::parallel_for(0, T_, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = c + r * H_out;
      const float inv_rms = 1.f / std::sqrt(sum_of_squares(row, H_out) / H_out + eps);
      scale_by_weight(row, nw.data(), inv_rms, H_out);
      if constexpr (!std::is_same_v<T, float>) from_float(row, o + r * H_out, H_out);
    }
  });
}

at::Tensor project_features_cpu(at::TensorList features, const at::Tensor& fc_weight,
                                const at::Tensor& norm_weight, double eps) {
  const ProjectFeaturesDims d = check_project_features(features, fc_weight, norm_weight, eps);
  std::vector<at::Tensor> feats;
  for (const auto& f : features) feats.push_back(with_readable_rows(f));
  const at::Tensor w = fc_weight.contiguous(), nw = norm_weight.contiguous();
  at::Tensor out = at::empty({d.T, d.H_out}, feats[0].options());
  if (d.T == 0 || d.H_out == 0) return out;
  DFLASH_DISPATCH_FLOATING(out.scalar_type(), "project_features", [&] {
    project_features_impl<scalar_t>(feats, w, nw, static_cast<float>(eps), out, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("project_features", &project_features_cpu); }

}  // namespace dflash::cpu
