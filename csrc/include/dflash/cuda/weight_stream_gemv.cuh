// The weight-streaming GEMV shared by project_features and inject_context_kv at
// T <= kGemvMaxRows tokens: y[T, rows] = X[T, K] * W[rows, K]^T, then the op's epilogue.
// The schedule (stream-K over row blocks x K steps, one wave, deterministic partial sums,
// last-CTA epilogues) is described at gemv_plan in plans.h.
//
// The weight is the MMA's A operand (m16n8k16: 16 weight rows x 8 tokens), loaded straight
// from global memory into registers, 16 bytes per thread and row: the order of k inside a
// dot product is free, so thread (g, q) of a warp (g = lane / 4, q = lane % 4) reads
// W[row g, k0 + 8q .. k0 + 8q + 8) and X[token g, the same 8 k] and feeds them as the
// fragments' k pairs {2q, 2q+1} and {2q+8, 2q+9} of two MMAs: the same permutation of k
// on both operands, so the sums are those of the product. No shared-memory staging, no
// padded rows; T <= 8 issues one 8-token MMA per 16 weight rows, T <= 16 two.
// Requirements (the plan functions check them, else another path runs): bf16/fp16,
// 16-byte aligned bases, K and each feature segment a multiple of 8 elements.
//
// A Problem supplies: tokens, rows, K; weight_row(r) (row r < rows of W); token_valid(t)
// (false: the token is not there or skipped, its X row reads as zeros); act(t, k) (the
// address of X[t, k..k+8) of a valid token); kSumSquares (the per-block sums of squares of
// y the RMSNorm needs); finish_group(g, scratch, schedule) (by all threads of the CTA, once
// every row block of group g is summed into schedule.y; scratch: kGemvScratchFloats).
#pragma once
#include <type_traits>

#include "dflash/cuda/common.cuh"
#include "dflash/cuda/plans.h"

namespace dflash::cuda::DFLASH_ARCH_NS {

inline constexpr int kGemvThreads = 256;
inline constexpr int kGemvWarps = kGemvThreads / 32;
// K steps per warp chunk: 4 x 4 16-byte weight loads in flight per thread for one 8-token
// tile, 2 x 4 for two (whose activations take the registers; 2 CTAs of 256 threads per SM
// keep 64 KiB of weight loads in flight either way).
template <int NT>
inline constexpr int kGemvUnroll = NT == 1 ? 4 : 2;
inline constexpr int kGemvMTiles = kGemvRowBlock / 16;
inline constexpr int kGemvScratchFloats = kGemvWarps * kGemvRowBlock * kGemvMaxRows;  // 16 KiB

// Weights are read once: keep them out of L1 (the activations, re-read by every warp, stay).
__device__ __forceinline__ uint4 load_weight_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_act_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// c += A(16x16, row) * B(16x8, col), fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// One warp: acc += the products of K steps [k_begin, k_end) of row block `rb`, the warp
// taking chunks of kGemvUnroll<NT> steps in turn with the CTA's other warps.
template <class T, int NT, class Problem>
__device__ __forceinline__ void gemv_block_steps(const Problem& pb, int rb, int k_begin, int k_end,
                                                 float (&acc)[kGemvMTiles][NT][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const T* w_rows[kGemvMTiles][2];
  bool token_ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) token_ok[nt] = pb.token_valid(nt * 8 + g);
#pragma unroll
  for (int mt = 0; mt < kGemvMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rb * kGemvRowBlock + mt * 16 + h * 8 + g;
      w_rows[mt][h] = r < pb.rows ? pb.weight_row(r) : nullptr;
    }
  constexpr int U = kGemvUnroll<NT>;
  for (int kc = k_begin + warp * U; kc < k_end; kc += kGemvWarps * U) {
    uint4 w[U][kGemvMTiles][2], x[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (kc + u) * kGemvStepK + q * 8;
      const bool in = kc + u < k_end && k < pb.K;
#pragma unroll
      for (int mt = 0; mt < kGemvMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          w[u][mt][h] = in && w_rows[mt][h] ? load_weight_16(w_rows[mt][h] + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        x[u][nt] = in && token_ok[nt] ? load_act_16(pb.act(nt * 8 + g, k)) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mt = 0; mt < kGemvMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          // k pairs (8q, 8q+1), (8q+2, 8q+3) -> MMA 0, (8q+4 ..), (8q+6 ..) -> MMA 1
          mma_16816<T>(acc[mt][nt], w[u][mt][0].x, w[u][mt][1].x, w[u][mt][0].y, w[u][mt][1].y, x[u][nt].x,
                       x[u][nt].y);
          mma_16816<T>(acc[mt][nt], w[u][mt][0].z, w[u][mt][1].z, w[u][mt][0].w, w[u][mt][1].w, x[u][nt].z,
                       x[u][nt].w);
        }
  }
}

// True in every thread of the CTA when this CTA's atomicAdd took `counter` to `last`
// (the earlier writes of every thread made visible first; the caller's later reads of
// other CTAs' data go through L2: __ldcg).
__device__ __forceinline__ bool gemv_arrive_last(int* counter, int last, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1) == last;
  __syncthreads();
  const bool is_last = *flag;
  if (is_last) __threadfence();
  return is_last;
}

// The schedule of a launch of `ctas_per_sm` resident CTAs per SM (gemv_plan); the
// dispatcher allocates workspace_floats and counter_count (zeroed) and binds them.
inline GemvSchedule gemv_schedule(int64_t tokens, int64_t rows, int64_t K, int64_t rows_per_group,
                                  const DeviceLimits& dev, int ctas_per_sm) {
  const GemvPlan plan = gemv_plan(tokens, rows, K, rows_per_group, static_cast<int64_t>(dev.num_sms) * ctas_per_sm);
  GemvSchedule s{};
  s.ctas = static_cast<int>(plan.ctas);
  s.row_blocks = static_cast<int>(plan.row_blocks);
  s.k_steps = static_cast<int>(plan.k_steps);
  s.blocks_per_group = static_cast<int>(gemv_blocks_per_group(rows, rows_per_group));
  s.y_offset = plan.partial_floats;
  s.ss_offset = s.y_offset + plan.y_floats;
  s.workspace_floats = s.ss_offset + plan.ss_floats;
  s.counter_count = plan.counters;
  return s;
}

template <class T, int NT, class Problem>
__device__ void gemv_stream(const Problem& pb, const GemvSchedule& s) {
  __shared__ float scratch[kGemvScratchFloats];  // [warp][row][token] partials, then the epilogue's
  __shared__ int flag;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const int tokens = pb.tokens;
  const int64_t steps = static_cast<int64_t>(s.row_blocks) * s.k_steps, c = blockIdx.x;
  const int64_t begin = c * steps / s.ctas, end = (c + 1) * steps / s.ctas;
  for (int64_t seg = begin; seg < end;) {
    const int rb = static_cast<int>(seg / s.k_steps);
    const int64_t seg_end = std::min<int64_t>(end, static_cast<int64_t>(rb + 1) * s.k_steps);
    float acc[kGemvMTiles][NT][4] = {};
    gemv_block_steps<T, NT>(pb, rb, static_cast<int>(seg - int64_t(rb) * s.k_steps),
                            static_cast<int>(seg_end - int64_t(rb) * s.k_steps), acc);
    seg = seg_end;
    // This CTA's partial of block rb: the warps' sums through shared memory, in warp order.
    __syncthreads();  // scratch is free (the previous block's epilogue is done)
#pragma unroll
    for (int mt = 0; mt < kGemvMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // C fragment: rows g, g + 8; tokens 2q, 2q + 1
          const int r = mt * 16 + g + (i / 2) * 8, t = nt * 8 + 2 * q + i % 2;
          scratch[(warp * kGemvRowBlock + r) * kGemvMaxRows + t] = acc[mt][nt][i];
        }
    __syncthreads();
    float* part = s.partials + (c + rb) * int64_t(tokens) * kGemvRowBlock;
    for (int i = threadIdx.x; i < tokens * kGemvRowBlock; i += kGemvThreads) {
      const int t = i / kGemvRowBlock, r = i % kGemvRowBlock;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) sum += scratch[(w * kGemvRowBlock + r) * kGemvMaxRows + t];
      part[i] = sum;
    }
    // The last CTA of block rb adds the partials of its CTAs in CTA order (slot c + rb).
    const int64_t c_first = stream_cta_of(int64_t(rb) * s.k_steps, steps, s.ctas);
    const int64_t c_last = stream_cta_of(int64_t(rb + 1) * s.k_steps - 1, steps, s.ctas);
    if (!gemv_arrive_last(s.counters + rb, static_cast<int>(c_last - c_first), &flag)) continue;
    const int64_t y_cols = int64_t(s.row_blocks) * kGemvRowBlock;
    for (int i = threadIdx.x; i < tokens * kGemvRowBlock; i += kGemvThreads) {  // a warp: one token's 32 rows
      const int t = i / kGemvRowBlock, r = i % kGemvRowBlock;
      float sum = 0.f;
      for (int64_t cc = c_first; cc <= c_last; ++cc) sum += __ldcg(s.partials + (cc + rb) * int64_t(tokens) * kGemvRowBlock + i);
      s.y[t * y_cols + rb * kGemvRowBlock + r] = sum;
      if constexpr (Problem::kSumSquares) {
        const float ss = warp_sum(rb * kGemvRowBlock + r < pb.rows ? sum * sum : 0.f);
        if (lane == 0) s.ss[int64_t(rb) * tokens + t] = ss;
      }
    }
    // The last block of its group runs the op's epilogue on the group's rows of y.
    const int group = rb / s.blocks_per_group;
    const int group_blocks = std::min(s.blocks_per_group, s.row_blocks - group * s.blocks_per_group);
    if (!gemv_arrive_last(s.counters + s.row_blocks + group, group_blocks - 1, &flag)) continue;
    __syncthreads();  // scratch: the epilogue may use it
    pb.finish_group(group, scratch, s);
  }
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
