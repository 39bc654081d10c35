// Helpers shared by the CPU kernels: fp32 GEMM on BLAS, dtype conversion of rows,
// vectorized row reductions. All math runs in fp32.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <vector>

// Dispatch over the dtypes the ops accept (checked before dispatch).
#define DFLASH_DISPATCH_FLOATING(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace dflash::cpu {

using Vec = at::vec::Vectorized<float>;

// C[M, N] = A[M, K] · B[N, K]^T + beta · C   (row-major, leading dimensions in elements)
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc);
// C[M, N] = A[M, K] · B[K, N] + beta · C
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc);

// dst[0, n) = float(src[0, n))
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using VecT = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// dst[0, n) = T(src[0, n) * scale)
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n, float scale = 1.f) {
  int64_t i = 0;
  const Vec s(scale);
  if constexpr (std::is_same_v<T, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(src + i) * s).store(dst + i);
  } else {
    using VecT = at::vec::Vectorized<T>;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      const Vec lo = Vec::loadu(src + i) * s, hi = Vec::loadu(src + i + Vec::size()) * s;
      at::vec::convert_from_float<T>(lo, hi).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// A view of `rows` rows of `cols` floats: the source itself when it is fp32,
// otherwise a converted copy in `buf`.
struct F32Rows {
  const float* ptr;
  int64_t ld;
};

template <typename T>
inline F32Rows rows_as_f32(const T* src, int64_t rows, int64_t cols, int64_t ld,
                           std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, ld};
  } else {
    if (static_cast<int64_t>(buf.size()) < rows * cols) buf.resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) to_float(src + r * ld, buf.data() + r * cols, cols);
    return {buf.data(), cols};
  }
}

inline float sum_of_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// x[i] *= inv_rms * weight[i]
inline void scale_by_weight(float* x, const float* weight, float inv_rms, int64_t n) {
  int64_t i = 0;
  const Vec r(inv_rms);
  for (; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(x + i) * r * Vec::loadu(weight + i)).store(x + i);
  for (; i < n; ++i) x[i] = x[i] * inv_rms * weight[i];
}

// x[i] *= factor
inline void scale_row(float* x, float factor, int64_t n) {
  at::vec::map<float>([factor](Vec v) { return v * Vec(factor); }, x, x, n);
}

}  // namespace dflash::cpu
