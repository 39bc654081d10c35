// Helpers shared by the CPU kernels: fp32 GEMM on BLAS, dtype conversion of rows,
// vectorized row reductions. All math runs in fp32.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "isa.h"

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
// Routes gemm_nt / gemm_nn through at::mm instead of BLAS (a test hook, dflash_ext._C);
// returns the previous setting.
bool set_blas_fallback(bool enable);

// c[M, N] (fp32) = cat(a, 1) · b^T, b [N, sum_j K_j], on the library GEMM ATen picks for the
// dtype: MKL for fp32 (one call per K-segment, accumulated in c, no concatenation), oneDNN
// for bf16 (bf16 dot products or AMX tiles; one call over the concatenated rows of `a`, its
// bf16 result rounded as F.linear's is). Called outside at::parallel_for: it threads itself.
void library_gemm_nt(at::TensorList a, const at::Tensor& b, at::Tensor& c);

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

// `t` ([rows, cols]) itself when its rows can be read as BLAS rows (unit column stride,
// non-overlapping rows), else a contiguous copy.
inline at::Tensor with_readable_rows(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) >= t.size(1));
  return ok ? t : t.contiguous();
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

// Weight rows per parallel GEMM tile for `rows` output columns: about four tiles per
// thread, 16..128 rows (a converted tile of 128 rows stays in L2).
inline int64_t weight_rows_per_tile(int64_t rows) {
  const int64_t tiles = 4 * at::get_num_threads();
  return std::clamp<int64_t>((rows + tiles - 1) / tiles, 16, 128);
}

// Two float vectors of B[0, 2 * Vec::size()), converted from T.
template <typename T>
inline std::pair<Vec, Vec> load_float_pair(const T* b) {
  if constexpr (std::is_same_v<T, float>) {
    return {Vec::loadu(b), Vec::loadu(b + Vec::size())};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(b));
    return {lo, hi};
  }
}

// dst[0, 2 * Vec::size()) = T(lo, hi): the inverse of load_float_pair.
template <typename T>
inline void store_float_pair(const Vec& lo, const Vec& hi, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// C[m, n] = sum_k A[m, k] * float(B[n, k]) + beta * C[m, n] for a few rows of A: one
// pass over B with the conversion fused into the dot products (weight streaming).
template <int64_t M, typename T>
void skinny_gemm_nt(int64_t N, int64_t K, const float* A, int64_t lda, const T* B, int64_t ldb,
                    float beta, float* C, int64_t ldc) {
  constexpr int64_t step = 2 * Vec::size();
  for (int64_t n = 0; n < N; ++n) {
    const T* b = B + n * ldb;
    // Two accumulators per row while registers allow (few rows: latency-bound chains),
    // one per row above 4 rows (M independent chains hide the FMA latency; no spills).
    constexpr int64_t R = M <= 4 ? 2 : 1;
    Vec acc[M][R];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < R; ++r) acc[m][r] = Vec(0.f);
    int64_t k = 0;
    for (; k + step <= K; k += step) {
      auto [lo, hi] = load_float_pair(b + k);
      for (int64_t m = 0; m < M; ++m) {
        acc[m][0] = at::vec::fmadd(Vec::loadu(A + m * lda + k), lo, acc[m][0]);
        acc[m][R - 1] = at::vec::fmadd(Vec::loadu(A + m * lda + k + Vec::size()), hi, acc[m][R - 1]);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      Vec v = acc[m][0];
      if constexpr (R == 2) v = v + acc[m][1];
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, v);
      for (int64_t kk = k; kk < K; ++kk) sum += A[m * lda + kk] * static_cast<float>(b[kk]);
      float& c = C[m * ldc + n];
      c = beta == 0.f ? sum : sum + beta * c;
    }
  }
}

// skinny_gemm_nt for 1 <= M <= kStreamRows (isa.h) rows, dispatched on M.
template <typename T>
void stream_gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const T* B,
                    int64_t ldb, float beta, float* C, int64_t ldc) {
  switch (M) {
    case 1: return skinny_gemm_nt<1>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 2: return skinny_gemm_nt<2>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 3: return skinny_gemm_nt<3>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 4: return skinny_gemm_nt<4>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 5: return skinny_gemm_nt<5>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 6: return skinny_gemm_nt<6>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 7: return skinny_gemm_nt<7>(N, K, A, lda, B, ldb, beta, C, ldc);
    case 8: return skinny_gemm_nt<8>(N, K, A, lda, B, ldb, beta, C, ldc);
    default: TORCH_CHECK(false, "stream_gemm_nt takes 1..", kStreamRows, " rows, got ", M);
  }
}

// C[M, N] = A[M, K] · float(B[N, K])^T + beta · C for weights B of any op dtype.
// fp32 weights go to BLAS in place; reduced-precision weights are streamed once by
// skinny_gemm_nt when A has few rows, else converted into `buf` for BLAS.
template <typename T>
void gemm_nt_weights(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const T* B,
                     int64_t ldb, float beta, float* C, int64_t ldc, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    gemm_nt(M, N, K, A, lda, B, ldb, beta, C, ldc);
  } else if (M == 0) {
    return;
  } else if (M <= kStreamRows) {
    stream_gemm_nt(M, N, K, A, lda, B, ldb, beta, C, ldc);
  } else {
    const F32Rows b = rows_as_f32(B, N, K, ldb, buf);
    gemm_nt(M, N, K, A, lda, b.ptr, b.ld, beta, C, ldc);
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
