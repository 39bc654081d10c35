// CPU block_conv: DFlash2's dynamic depthwise convolution along each block of B slots,
//   out[m, i, c] = sum_{t <= i, t < T} (base[t, c] + delta[m, i, t, c / (H / G)]) * x[m, i - t, c].
// Elementwise over channels and bound by memory: each thread owns a range of output rows
// (m, i) and walks the channels kStep at a time (two fp32 vectors, reduced dtypes converted
// on the load), the taps accumulated in fp32 registers and the row cast to x's dtype once.
// One path at every ISA level of isa.h: the levels choose between library kernels, and
// this op calls none (bound by memory, it would gain little from AVX-512's wider vectors;
// not measured).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_utils.h"
#include "dflash/checks.h"

namespace dflash::cpu {
namespace {

constexpr int64_t kStep = 2 * Vec::size();  // channels per step: one load_float_pair
constexpr int64_t kGrainWork = int64_t{1} << 14;  // channel-taps per parallel chunk, at least

template <typename T>
void block_conv_impl(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta, at::Tensor& out,
                     const BlockConvDims& d) {
  const int64_t B = d.B, H = d.H, G = d.G, group = d.H / d.G;
  const int64_t taps = std::min(d.T, d.B);  // a tap past the block's last slot reads nothing
  const at::Tensor base32 = base.to(at::kFloat).contiguous();  // [T, H], small: converted once
  const float* bp = base32.data_ptr<float>();
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);  // channels adjacent (the launcher's rule)
  const int64_t ds0 = delta.stride(0), ds1 = delta.stride(1), ds2 = delta.stride(2), ds3 = delta.stride(3);
  // With a group size that is a multiple of kStep every step lies in one group: its delta is one
  // broadcast. Otherwise (e.g. G = H) each row's coefficients are expanded per channel first.
  const bool step_in_group = group % kStep == 0;
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, H * taps));

  at::parallel_for(0, d.M * B, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> dl(taps * G), coef(step_in_group ? 0 : taps * H);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t m = r / B, i = r % B, n = std::min(taps, i + 1);  // the taps slot i sees
      const T* drow = dp + m * ds0 + i * ds1;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t g = 0; g < G; ++g) dl[t * G + g] = static_cast<float>(drow[t * ds2 + g * ds3]);
      if (!step_in_group) {
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t c = g * group; c < (g + 1) * group; ++c) coef[t * H + c] = bp[t * H + c] + dl[t * G + g];
      }
      const T* xi = xp + m * xs0 + i * xs1;  // x[m, i]; x[m, i - t] is xi - t * xs1
      T* o = op + r * H;
      int64_t c = 0;
      for (; c + kStep <= H; c += kStep) {
        Vec acc0(0.f), acc1(0.f);
        for (int64_t t = 0; t < n; ++t) {
          const auto [x0, x1] = load_float_pair(xi - t * xs1 + c);
          Vec c0, c1;
          if (step_in_group) {
            const Vec dv(dl[t * G + c / group]);
            c0 = Vec::loadu(bp + t * H + c) + dv;
            c1 = Vec::loadu(bp + t * H + c + Vec::size()) + dv;
          } else {
            c0 = Vec::loadu(coef.data() + t * H + c);
            c1 = Vec::loadu(coef.data() + t * H + c + Vec::size());
          }
          acc0 = at::vec::fmadd(c0, x0, acc0);
          acc1 = at::vec::fmadd(c1, x1, acc1);
        }
        store_float_pair(acc0, acc1, o + c);
      }
      for (; c < H; ++c) {  // the last H % kStep channels
        float acc = 0.f;
        for (int64_t t = 0; t < n; ++t)
          acc += (bp[t * H + c] + dl[t * G + c / group]) * static_cast<float>(xi[c - t * xs1]);
        o[c] = static_cast<T>(acc);
      }
    }
  });
}

at::Tensor block_conv_cpu(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta) {
  const BlockConvDims d = check_block_conv(x, base, delta);
  // Rows and blocks are read at their strides; the vector loads need adjacent channels.
  const at::Tensor xr = x.stride(2) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({d.M, d.B, d.H}, x.options());
  if (out.numel() == 0) return out;
  DFLASH_DISPATCH_FLOATING(out.scalar_type(), "block_conv", [&] { block_conv_impl<scalar_t>(xr, base, delta, out, d); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("block_conv", &block_conv_cpu); }

}  // namespace dflash::cpu
