// fp32 GEMM for the CPU kernels: the BLAS that libtorch_cpu carries (sgemm_), called
// single-threaded from inside at::parallel_for tiles; at::mm when no BLAS is linked.
#include "cpu_utils.h"

#include <atomic>
#include <algorithm>
#include <climits>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace dflash::cpu {
namespace {

std::atomic<bool> force_aten{false};

int as_int(int64_t v) {
  TORCH_CHECK(v >= 0 && v <= INT_MAX, "GEMM dimension ", v, " does not fit the BLAS int");
  return static_cast<int>(v);
}

// Column-major BLAS call: C^T[N, M] = op(B) · op(A), which is row-major C = A · op(B).
void gemm(bool b_transposed, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // C = beta * C; BLAS would reject the zero leading dimensions
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) C[r * ldc + c] = beta == 0.f ? 0.f : beta * C[r * ldc + c];
    return;
  }
  // A single row (column) has no leading dimension to honour; BLAS still wants one
  // of at least its width.
  if (M == 1) lda = std::max(lda, K);
  if (b_transposed ? N == 1 : K == 1) ldb = std::max(ldb, b_transposed ? K : N);
  if (M == 1) ldc = std::max(ldc, N);
  if (sgemm_ != nullptr && !force_aten.load(std::memory_order_relaxed)) {
    const int m = as_int(N), n = as_int(M), k = as_int(K);
    const int la = as_int(ldb), lb = as_int(lda), lc = as_int(ldc);
    const float alpha = 1.f;
    sgemm_(b_transposed ? "T" : "N", "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor a = at::from_blob(const_cast<float*>(A), {M, K}, {lda, 1}, opts);
  const at::Tensor b = b_transposed
                           ? at::from_blob(const_cast<float*>(B), {N, K}, {ldb, 1}, opts).t()
                           : at::from_blob(const_cast<float*>(B), {K, N}, {ldb, 1}, opts);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
  if (beta == 0.f) {
    at::mm_out(c, a, b);
  } else {
    c.mul_(beta).add_(at::mm(a, b));
  }
}

}  // namespace

bool set_blas_fallback(bool enable) { return force_aten.exchange(enable); }

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm(true, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm(false, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void library_gemm_nt(at::TensorList a, const at::Tensor& b, at::Tensor& c) {
  TORCH_INTERNAL_ASSERT(!a.empty() && c.scalar_type() == at::kFloat);
  if (a[0].scalar_type() == at::kFloat) {  // MKL accumulates every segment into c
    int64_t k0 = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      const at::Tensor bj = b.narrow(1, k0, a[j].size(1)).t();
      k0 += a[j].size(1);
      if (j == 0) at::mm_out(c, a[j], bj);
      else c.addmm_(a[j], bj);
    }
    return;
  }
  // oneDNN gives a bf16 result for bf16 operands: one call over the concatenated K, whose
  // copy of the few rows of `a` costs little next to the weights.
  c.copy_(at::mm(a.size() == 1 ? a[0] : at::cat(a, 1), b.t()));
}

}  // namespace dflash::cpu
