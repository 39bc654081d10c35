// CPU skinny_linear: F.linear for a few rows, the weight streamed once. A verify pass of
// B <= 16 tokens runs every linear layer of the target on B rows, where the library GEMM
// (MKL sgemm) costs about 2x its one-row GEMV on the CPUs measured (bench/RESULTS.md §1; bench/results/history/notebook-2026.md §6):
// here each thread owns a block of weight rows and takes the dot products of all input
// rows with each weight row as it streams past. bf16 on bf16 units (avx512_bf16) multiplies
// bf16 pairs on them, fp32 on AVX-512 takes FMAs over the same register blocking (`dots`
// below); every other case runs in fp32 at AVX2, reduced dtypes converted on the fly. Other shapes, and the rows skinny_linear_streams (isa.h) sends to
// the library, go to at::linear.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <array>
#include <cstring>

#include "cpu_utils.h"
#include "isa.h"
#include "dflash/checks.h"

// Functions compiled for AVX-512 (and the bf16 dot-product instructions, which only the
// bf16 policy uses: the fp32 instantiations run at avx512); the build's baseline is AVX2,
// so they run only after the run-time check (active_isa()).
#define DFLASH_AVX512_DOTS __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace dflash::cpu {
namespace {

// ---- dot products on AVX-512 registers --------------------------------------------------------
// Two element kinds share one kernel (the `Dots` policies below): bf16 x bf16 on the bf16
// units (VDPBF16PS adds the products of 32 bf16 pairs into 16 fp32 lanes: the products are
// exact in fp32, bf16 denormals read as zero, nothing is converted) and fp32 x fp32 (FMA over
// 16 lanes). One instruction serves one (input row, weight row) pair per 64 bytes of columns.
// A group of NW weight rows meets the input rows MR at a time (MR x NW <= 16 accumulators,
// one per output, their lanes reduced together): each input vector loaded serves NW weight
// rows, each weight vector MR input rows.
//
// How the weights are read decides the speed once they come from DRAM (a target's layers do
// not fit in L3): on the EPYC measured, NW rows read side by side streamed at half the speed
// of one row after another unless the group after the next is prefetched in memory order,
// which the first pass over a group does as it goes (`ahead`). One input row reads its
// weight rows one after another (no reuse to gain by reading them side by side).
namespace dots {

// GCC 12's _mm512_undefined_ps (inside the shuffle and broadcast intrinsics) trips
// -Wuninitialized where they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// bf16 pairs on the bf16 units; outputs rounded to bf16 (to nearest even, as F.linear rounds
// its fp32 result; fp32 denormals flush to zero).
struct Bf16Pairs {
  using In = uint16_t;
  using Out = at::BFloat16;
  using Vec = __m512bh;
  using Mask = __mmask32;
  static constexpr int kStep = 32;  // columns per instruction (64 bytes)
  DFLASH_AVX512_DOTS static Mask tail(int64_t n) { return _cvtu32_mask32((1u << n) - 1); }
  template <bool masked>
  DFLASH_AVX512_DOTS __attribute__((always_inline)) static Vec load(const In* p, Mask mask) {
    if constexpr (masked) return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
    else return (__m512bh)_mm512_loadu_si512(p);
  }
  DFLASH_AVX512_DOTS __attribute__((always_inline)) static __m512 dot(__m512 acc, Vec a, Vec b) {
    return _mm512_dpbf16_ps(acc, a, b);
  }
  DFLASH_AVX512_DOTS static void store16(__m512 sums, Out* dst) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(sums));
  }
};

// fp32 on FMA units: each lane's products added in column order, fused.
struct F32 {
  using In = float;
  using Out = float;
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int kStep = 16;
  DFLASH_AVX512_DOTS static Mask tail(int64_t n) { return _cvtu32_mask16((1u << n) - 1); }
  template <bool masked>
  DFLASH_AVX512_DOTS __attribute__((always_inline)) static Vec load(const In* p, Mask mask) {
    if constexpr (masked) return _mm512_maskz_loadu_ps(mask, p);
    else return _mm512_loadu_ps(p);
  }
  DFLASH_AVX512_DOTS __attribute__((always_inline)) static __m512 dot(__m512 acc, Vec a, Vec b) {
    return _mm512_fmadd_ps(a, b, acc);
  }
  DFLASH_AVX512_DOTS static void store16(__m512 sums, Out* dst) { _mm512_storeu_ps(dst, sums); }
};

// The sums of the 16 lanes of accumulators v[0, n), v[i]'s in lane i. Every output is summed
// in one fixed order (lane l with l + 8, then l + 4, l + 2, l + 1) whatever n and wherever
// its accumulator sits: a row's result does not depend on how many rows share its call.
template <int n>
DFLASH_AVX512_DOTS inline __m512 lane_sums(const __m512 (&v)[n]) {
  static_assert(n >= 1 && n <= 16);
  constexpr int n1 = (n + 1) / 2, n2 = (n1 + 1) / 2, n3 = (n2 + 1) / 2;
  const __m512 zero = _mm512_setzero_ps();
  __m512 r[n1], q[n2], o[n3];
  for (int p = 0; p < n1; ++p) {  // 256-bit halves: [a.lo + a.hi | b.lo + b.hi]
    const __m512 a = v[2 * p], b = 2 * p + 1 < n ? v[2 * p + 1] : zero;
    r[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int p = 0; p < n2; ++p) {  // 128-bit quarters: four accumulators, four partial sums each
    const __m512 a = r[2 * p], b = 2 * p + 1 < n1 ? r[2 * p + 1] : zero;
    q[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int p = 0; p < n3; ++p) {  // pairs within each quarter
    const __m512 a = q[2 * p], b = 2 * p + 1 < n2 ? q[2 * p + 1] : zero;
    o[p] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  const __m512 a = o[0], b = n3 > 1 ? o[1] : zero;
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  // v[i]'s sum is in lane 4 * (i % 4) + i / 4: move it to lane i.
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), sums);
}

// acc[m * NW + j] += x[m, 0:kStep) . w[j, 0:kStep) for m < MR, j < NW; zeros read past `mask`.
template <class P, int MR, int NW, bool masked>
DFLASH_AVX512_DOTS __attribute__((always_inline)) inline void dot_step(__m512 (&acc)[MR * NW], const typename P::In* x,
                                                                      int64_t ldx, const typename P::In* w, int64_t ldw,
                                                                      typename P::Mask mask) {
  for (int m = 0; m < MR; ++m) {
    const auto a = P::template load<masked>(x + m * ldx, mask);
    for (int j = 0; j < NW; ++j) acc[m * NW + j] = P::dot(acc[m * NW + j], a, P::template load<masked>(w + j * ldw, mask));
  }
}

// The weights a group's first pass prefetches (`ahead`: in memory order, past the group) and
// into which cache: L1 while they fit there beside the group, else L2.
template <class P>
struct Prefetch {
  const typename P::In* ahead;
  bool to_l2;
};

// dot_step over columns [k0, k1) (k0 a multiple of kStep; k1 - k0 too unless k1 = K). With
// `pf`, each step also prefetches the NW cache lines of pf->ahead that match the NW lines it
// reads, so that the prefetches cover NW * K weights in memory order as the pass covers the group.
template <class P, int MR, int NW>
DFLASH_AVX512_DOTS void dot_columns(__m512 (&acc)[MR * NW], const typename P::In* x, int64_t ldx,
                                    const typename P::In* w, int64_t ldw, int64_t k0, int64_t k1,
                                    const Prefetch<P>* pf) {
  constexpr int step = P::kStep;
  __m512 a[MR * NW];  // a local copy: the loads may alias acc's memory, they cannot alias a register
  for (int i = 0; i < MR * NW; ++i) a[i] = acc[i];
  int64_t k = k0;
  for (; k + step <= k1; k += step) {
    if (pf != nullptr)
      for (int j = 0; j < NW; ++j) {
        const char* line = reinterpret_cast<const char*>(pf->ahead + k * NW + j * step);
        pf->to_l2 ? _mm_prefetch(line, _MM_HINT_T1) : _mm_prefetch(line, _MM_HINT_T0);
      }
    dot_step<P, MR, NW, false>(a, x + k, ldx, w + k, ldw, 0);
  }
  if (k < k1) dot_step<P, MR, NW, true>(a, x + k, ldx, w + k, ldw, P::tail(k1 - k));
  for (int i = 0; i < MR * NW; ++i) acc[i] = a[i];
}

// out[m * ldo + j] = P::Out(sum of acc[m * NW + j] + bias[j]) for m < MR, j < NW.
template <class P, int MR, int NW>
DFLASH_AVX512_DOTS void store_outputs(const __m512 (&acc)[MR * NW], const float* bias, typename P::Out* out,
                                      int64_t ldo) {
  __m512 sums = lane_sums(acc);
  if (bias != nullptr) {  // lane p (output m * NW + j) gets bias[p % NW]
    alignas(64) static constexpr auto column = [] {
      std::array<int32_t, 16> c{};
      for (int p = 0; p < 16; ++p) c[p] = p % NW;
      return c;
    }();
    sums = _mm512_add_ps(sums, _mm512_permutexvar_ps(_mm512_load_si512(column.data()),
                                                     _mm512_maskz_loadu_ps((1u << NW) - 1, bias)));
  }
  typename P::Out values[16];
  P::store16(sums, values);
  for (int m = 0; m < MR; ++m) std::memcpy(out + m * ldo, values + m * NW, NW * sizeof(typename P::Out));
}

// MR input rows, 16 / MR weight rows read one after another (memory order), one reduction.
template <class P, int MR>
DFLASH_AVX512_DOTS void dot_rows_in_turn(const typename P::In* x, int64_t ldx, const typename P::In* w, int64_t K,
                                         const float* bias, typename P::Out* out, int64_t ldo) {
  constexpr int NW = 16 / MR;
  __m512 acc[MR * NW];
  for (int j = 0; j < NW; ++j) {
    __m512 row[MR];
    for (auto& a : row) a = _mm512_setzero_ps();
    dot_columns<P, MR, 1>(row, x, ldx, w + j * K, K, 0, K, nullptr);
    for (int m = 0; m < MR; ++m) acc[m * NW + j] = row[m];
  }
  store_outputs<P, MR, NW>(acc, bias, out, ldo);
}

// Bytes of columns per pass when several passes of input rows share a group of long weight
// rows: the group's columns and the input rows' stay in L1 (the accumulators wait in memory between).
constexpr int64_t kDepthBytes = 1024;

// The input rows [0, M) in passes of MR (the last pass: the rest) over NW weight rows.
template <class P, int MR, int NW>
struct Group {
  using In = typename P::In;
  using Out = typename P::Out;
  static constexpr int kMaxPasses = (kSkinnyRows + MR - 1) / MR;

  // acc (all passes) for columns [k0, k1); pass p covers rows [p * MR, p * MR + MR) of x.
  template <int mr = MR>
  DFLASH_AVX512_DOTS static void columns(int64_t rows, __m512* acc, const In* x, int64_t ldx, const In* w, int64_t K,
                                         int64_t k0, int64_t k1, const Prefetch<P>* pf) {
    if constexpr (mr > 1)
      if (rows < mr) return columns<mr - 1>(rows, acc, x, ldx, w, K, k0, k1, pf);
    dot_columns<P, mr, NW>(*reinterpret_cast<__m512(*)[mr * NW]>(acc), x, ldx, w, K, k0, k1, pf);
  }
  template <int mr = MR>
  DFLASH_AVX512_DOTS static void store(int64_t rows, const __m512* acc, const float* bias, Out* out, int64_t ldo) {
    if constexpr (mr > 1)
      if (rows < mr) return store<mr - 1>(rows, acc, bias, out, ldo);
    store_outputs<P, mr, NW>(*reinterpret_cast<const __m512(*)[mr * NW]>(acc), bias, out, ldo);
  }

  // out[:, 0:NW) for the NW weight rows at w (row stride K).
  DFLASH_AVX512_DOTS static void run(int64_t M, const In* x, int64_t ldx, const In* w, int64_t K, const float* bias,
                                     Out* out, int64_t ldo) {
    const int64_t passes = (M + MR - 1) / MR;
    // One pass: the next group, into L1 while it is small; several (more time per group):
    // 8 weight rows ahead, into L2.
    const int64_t groups_ahead = passes == 1 ? 1 : std::max(1, 8 / NW);
    const Prefetch<P> pf{w + groups_ahead * NW * K, passes > 1 || NW * K * int64_t(sizeof(In)) > (8 << 10)};
    alignas(64) __m512 acc[kMaxPasses][MR * NW];
    for (int64_t p = 0; p < passes; ++p)
      for (auto& a : acc[p]) a = _mm512_setzero_ps();
    const int64_t depth_cols = kDepthBytes / int64_t(sizeof(In));
    const int64_t depth = passes > 1 && K > depth_cols + depth_cols / 2 ? depth_cols : K;
    for (int64_t k0 = 0; k0 < K; k0 += depth)
      for (int64_t p = 0; p < passes; ++p)
        columns(std::min<int64_t>(MR, M - p * MR), acc[p], x + p * MR * ldx, ldx, w, K, k0, std::min(K, k0 + depth),
                p == 0 ? &pf : nullptr);
    for (int64_t p = 0; p < passes; ++p) store(std::min<int64_t>(MR, M - p * MR), acc[p], bias, out + p * MR * ldo, ldo);
  }
};

// Weight rows [n0, n1) for all M rows: NW at a time, the last (n1 - n0) mod NW one at a time.
template <class P, int MR, int NW>
DFLASH_AVX512_DOTS void dot_tile(int64_t M, int64_t n0, int64_t n1, const typename P::In* x, int64_t ldx,
                                 const typename P::In* w, int64_t K, const float* bias, typename P::Out* out,
                                 int64_t ldo) {
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) Group<P, MR, NW>::run(M, x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
  for (; n < n1; ++n) Group<P, MR * NW, 1>::run(M, x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
}

// The pass shape by rows (measured on the EPYC with bf16, weights in DRAM and in cache): one
// or two rows read 16 or 8 weight rows in turn; up to 8 rows, passes of 4 x 4; above, passes
// of 8 x 2 while 8 input rows fit in L1 beside the weights (K <= 2048 bf16, 4 KiB a row), else of 4 x 4.
template <class P>
DFLASH_AVX512_DOTS void dot_tile_for(int64_t M, int64_t n0, int64_t n1, const typename P::In* x, int64_t ldx,
                                     const typename P::In* w, int64_t K, const float* bias, typename P::Out* out,
                                     int64_t ldo) {
  if (M <= 2) {
    int64_t n = n0;
    for (; n + 16 / M <= n1; n += 16 / M) {
      const float* b = bias ? bias + n : nullptr;
      M == 1 ? dot_rows_in_turn<P, 1>(x, ldx, w + n * K, K, b, out + n, ldo)
             : dot_rows_in_turn<P, 2>(x, ldx, w + n * K, K, b, out + n, ldo);
    }
    for (; n < n1; ++n) Group<P, 2, 1>::run(M, x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
    return;
  }
  if (M > 8 && K * int64_t(sizeof(typename P::In)) <= 4096) return dot_tile<P, 8, 2>(M, n0, n1, x, ldx, w, K, bias, out, ldo);
  dot_tile<P, 4, 4>(M, n0, n1, x, ldx, w, K, bias, out, ldo);
}

#pragma GCC diagnostic pop

}  // namespace dots

// out = x · weight^T + bias on the AVX-512 dot kernel of policy P (bf16 pairs or fp32), the
// weight rows split into tiles over the threads.
template <class P>
void skinny_linear_dots(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::Tensor& out, const SkinnyLinearDims& d) {
  using In = typename P::In;
  using Out = typename P::Out;
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const auto* xp = reinterpret_cast<const In*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const In*>(weight.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<Out*>(out.data_ptr());
  const int64_t block = (weight_rows_per_tile(d.N) + 15) / 16 * 16;  // whole passes of up to 16 weight rows
  at::parallel_for(0, (d.N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t = b0; t < b1; ++t)
      dots::dot_tile_for<P>(d.M, t * block, std::min(d.N, (t + 1) * block), xp, x.stride(0), wp, d.K, bp, op, d.N);
  });
}

// ---- fp32 math: reduced dtypes converted on the fly ------------------------------------------
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
  if (x.scalar_type() == at::kBFloat16 && active_isa() >= Isa::avx512_bf16) {
    skinny_linear_dots<dots::Bf16Pairs>(xr, w, bias, out, d);
    return out;
  }
  // fp32 from 3 rows: one or two rows stream as fast or faster on the AVX2 kernel (its two
  // accumulators per row); from 3 rows this one wins, about 2x the AVX2 kernel at 8 rows and
  // 1.1-3.5x MKL at 12-16 (EPYC-bf16: bench/results/skinny_fp32_avx512*.txt).
  if (x.scalar_type() == at::kFloat && active_isa() >= Isa::avx512 && d.M >= 3) {
    skinny_linear_dots<dots::F32>(xr, w, bias, out, d);
    return out;
  }
  DFLASH_DISPATCH_FLOATING(out.scalar_type(), "skinny_linear", [&] {
    skinny_linear_impl<scalar_t>(xr, w, bias, out, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace dflash::cpu
