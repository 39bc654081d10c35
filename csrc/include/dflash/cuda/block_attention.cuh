// block_attention for one architecture: the Bq draft queries of one sequence attend to that
// sequence's visible context in the cache followed by its own Bq block keys, non-causally,
// causally or within a symmetric window (p.causal, p.symmetric: the rules of
// dflash/window.h). The tensor-core kernel:
//   - GQA packing: the Bq x group query rows that share a KV head form the M dimension
//     (16 x 4 = 64 rows = one wgmma warpgroup), so each K/V tile is read once per KV head.
//   - Split-KV: grid.z splits the keys so that the grid fills one wave of the SMs
//     (attention_split_plan in plans.h); each split writes its fp32 output and log-sum-exp
//     and a second launch, block_attention_combine_kernel, merges them over every output
//     row in parallel (as FlashAttention-3's combine and FlashInfer's merge_states do).
//     splits == 1 writes the output directly, no second launch.
//   - Online softmax in registers, log2 domain: each thread owns two rows of the S and O
//     accumulators, shared with the other lanes of its quad (quad shuffles reduce a row);
//     P goes back to shared memory as the A operand of P*V (V is read MN-major).
//   - Per-query key spans (causal, or symmetric with a window) are one template flag (the
//     unmasked kernel is unchanged): scores are masked per (query row, key) to the row's
//     span [first, last] (seen_keys in window.h). A row tile's queries together see every
//     key, so no tile is skipped.
// Requirements (checked by the plan function, else the SIMT path runs): bf16/fp16,
// D in {64, 128}. The SIMT kernel (every dtype, D <= kSimtMaxHeadDim): one warp per
// (sequence, query, q head). Host side: kernel choice, split-KV plan, launch.
#pragma once
#include <cmath>

#include "dflash/cuda/block_attention_params.h"
#include "dflash/cuda/plans.h"
#include "dflash/cuda/tile_gemm.cuh"

namespace dflash::cuda::DFLASH_ARCH_NS {

// ---------------------------------------------------------------- kernels
// The keys of sequence b in block_attention: keys [0, n_ctx) are the cache rows
// [start, start + n_ctx), keys [n_ctx, total) the sequence's Bq block rows. Key t is at
// position t and query i at n_ctx + i (window.h's positions, from the first visible row).
struct KeyRange {
  int64_t start;
  int n_ctx, total;
};

// The index guards (params.h): the range is clamped to the cache and to the planned
// context, so that no key outside k_cache is read even when validation is off.
__device__ __forceinline__ KeyRange key_range(const BlockAttentionParams& p, int b) {
  const int64_t off = min(max(p.cache_offsets[b], int64_t(0)), p.S);
  const int64_t n = min(max(p.cache_lens[b], int64_t(0)), p.S - off);
  const int64_t visible = min(visible_context(n, p.window, p.causal || p.symmetric), p.max_context);
  return {off + n - visible, static_cast<int>(visible), static_cast<int>(visible) + p.Bq};
}

inline constexpr int kAttnBM = 64;  // packed query rows per CTA
inline constexpr int kAttnBN = 64;  // keys per tile

template <int D>
constexpr int attention_smem_bytes(int elem_bytes) {
  return (kAttnBM * D + 4 * kAttnBN * D + kAttnBM * kAttnBN) * elem_bytes;  // Q, 2x(K,V), P
}

// Row ownership of the 64-row accumulators (S = QK^T and O, wgmma and mma.sync alike):
// thread tid holds rows attn_first_row(tid) + 8 * slot, slot 0 or 1, and shares each with
// the other three lanes of its quad; fragment element i is in slot attn_elem_slot(i), and
// elements (2i, 2i+1) are columns (c, c+1) of one row, c even. The slot is a function of
// the (unrolled, static) element index so that per-row state stays in registers.
// python_tests/cuda/host_checks.cu checks all of this against the CuTe partitions.
CUTE_HOST_DEVICE constexpr int attn_first_row(int tid) { return 16 * (tid / 32) + (tid % 32) / 4; }
CUTE_HOST_DEVICE constexpr int attn_elem_slot(int i) { return (i / 2) % 2; }

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Split-KV merge (splits > 1), a second launch over every output row, so that all SMs merge
// at once: out = sum_s w_s O_s with w_s = exp(lse_s - max) / sum_s' exp(lse_s' - max)
// (partials are normalized by their own l). Each warp first turns one row's LSEs into its
// weights in shared memory (a lane per split); then each thread owns 4 columns of a row and
// sums the splits with 16-byte loads, issued in batches ahead of their uses. A split a
// row saw no key of has lse = -inf, weight 0, and its partial output (NaN, or never
// written for an empty split) is dropped by a select, never multiplied. Reads 4 bytes per
// split and output element and writes 2: at Qwen3-8B heads with 33 splits (16k context on
// an H200) 8.7 MB per call at B = 16, an eighth of the 67 MB of K/V (partials that an
// H100/H200's 50 MB L2 can still hold when the combine reads them). Every row has a
// finite LSE somewhere: a query sees at least itself, in the split holding the block keys.
inline constexpr int kCombineThreads = 128;
inline constexpr int kCombineBatch = 8;  // splits loaded per batch
template <int D>
constexpr int combine_rows_per_cta() { return kCombineThreads / (D / 4); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class T, int D>
__global__ void __launch_bounds__(kCombineThreads)
block_attention_combine_kernel(const __grid_constant__ BlockAttentionParams p) {
  constexpr int kRows = combine_rows_per_cta<D>();
  static_assert(kRows * (D / 4) == kCombineThreads, "whole rows per CTA");
  __shared__ float weight[kAttnMaxSplits][kRows];
  const int64_t rows = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;  // rows of one split
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kRows && row0 + r < rows; r += kCombineThreads / 32) {
    const float* lse = p.partial_lse + row0 + r;
    float m = -INFINITY;
    for (int s = lane; s < p.splits; s += 32) m = fmaxf(m, lse[s * rows]);
    m = warp_max(m);
    float sum = 0.f;
    for (int s = lane; s < p.splits; s += 32) {
      const float l = lse[s * rows];
      const float w = l == -INFINITY ? 0.f : expf(l - m);
      weight[s][r] = w;
      sum += w;
    }
    const float inv = 1.f / warp_sum(sum);
    for (int s = lane; s < p.splits; s += 32) weight[s][r] *= inv;  // the lane's own writes
  }
  __syncthreads();
  const int r = threadIdx.x / (D / 4), d = (threadIdx.x % (D / 4)) * 4;
  // A thread past the last row (D = 64: half a warp) stays to the end for the __syncwarp
  // below, reading the last row and storing nothing.
  const int64_t row = row0 + r, read_row = min(row, rows - 1);
  const float4* src = reinterpret_cast<const float4*>(p.partial_out + read_row * D + d);
  const int64_t stride = rows * D / 4;  // float4s between splits
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  // Batches of kCombineBatch splits, loaded into registers before the math: the
  // __syncwarp after the loads is a memory-ordering point that ptxas does not move them
  // past, so the whole batch is in flight at once (test_cuda_build checks the SASS);
  // without it ptxas interleaved loads and math, 2 to 4 loads ahead depending on the
  // architecture. A batch
  // past the last split loads the last split again (no predicate) and weighs it 0; weight[]
  // has kAttnMaxSplits rows, a multiple of the batch, so a batch never indexes past it.
  static_assert(kAttnMaxSplits % kCombineBatch == 0, "whole batches");
  for (int s0 = 0; s0 < p.splits; s0 += kCombineBatch) {
    float4 v[kCombineBatch];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) v[j] = __ldcs(src + min(s0 + j, p.splits - 1) * stride);  // read once
    __syncwarp();  // the batch's loads stay above this point
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const float w = weight[s0 + j][r];
      const bool use = s0 + j < p.splits && w > 0.f;
      acc.x += use ? w * v[j].x : 0.f;
      acc.y += use ? w * v[j].y : 0.f;
      acc.z += use ? w * v[j].z : 0.f;
      acc.w += use ? w * v[j].w : 0.f;
    }
  }
  static_assert(sizeof(T) == 2, "the combine runs for the 16-bit tensor-core kernels");
  auto pair = [](float a, float b) {
    uint32_t u;
    T* e = reinterpret_cast<T*>(&u);
    e[0] = from_float<T>(a);
    e[1] = from_float<T>(b);
    return u;
  };
  if (row >= rows) return;
  // one 8-byte store of the four outputs (row * D + d is a multiple of 4 elements)
  *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + row * D + d) = make_uint2(pair(acc.x, acc.y), pair(acc.z, acc.w));
}

template <class T, int D, bool kPerQuery>
__global__ void __launch_bounds__(kTileThreads)
block_attention_tc_kernel(const __grid_constant__ BlockAttentionParams p) {
  constexpr int BM = kAttnBM, BN = kAttnBN;
  using GemmQK = TileGemm<T, BM, BN, D, false>;   // S = Q K^T
  using GemmPV = TileGemm<T, BM, D, BN, true>;    // O += P V
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Every buffer starts on a 1024-byte boundary: the 128-byte swizzle repeats every 1 KiB
  // and wgmma applies it to the address bits.
  T* q_ptr = reinterpret_cast<T*>(smem_raw);
  T* k_ptr = q_ptr + BM * D;
  T* v_ptr = k_ptr + 2 * BN * D;
  T* p_ptr = v_ptr + 2 * BN * D;
  using LayoutK = typename GemmQK::LayoutB;  // (BN keys, D), K-major
  using LayoutV = typename GemmPV::LayoutB;  // (D, BN keys), MN-major
  auto sQ = make_tensor(make_smem_ptr(q_ptr), typename GemmQK::LayoutA{});
  auto sP = make_tensor(make_smem_ptr(p_ptr), typename GemmPV::LayoutA{});

  const int tid = threadIdx.x;
  const int group = p.Hq / p.Hkv, rows = p.Bq * group;
  const int b = blockIdx.x / p.Hkv, kvh = blockIdx.x % p.Hkv;
  const int r0 = blockIdx.y * BM, split = blockIdx.z;
  const KeyRange keys = key_range(p, b);
  const int key_begin = split * p.keys_per_split;
  const int key_end = min(keys.total, key_begin + p.keys_per_split);
  // Packed row r of this tile is query i = (r0 + r) / group of q head kvh * group + (r0 + r) % group.
  auto row_index = [&](int r) -> int64_t {  // the (b, i, h) row of out
    const int pr = r0 + r;
    return (static_cast<int64_t>(b) * p.Bq + pr / group) * p.Hq + kvh * group + pr % group;
  };
  auto q_row_offset = [&](int r) -> int64_t { return row_index(r) * D; };

  const T* q = static_cast<const T*>(p.q);
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const T* k_block = static_cast<const T*>(p.k_block);
  const T* v_block = static_cast<const T*>(p.v_block);
  auto key_offset = [&](int j, bool from_block) -> int64_t {
    return from_block ? ((static_cast<int64_t>(b) * p.Bq + (j - keys.n_ctx)) * p.Hkv + kvh) * D
                      : ((keys.start + j) * p.Hkv + kvh) * D;
  };
  auto load_kv = [&](int tile_begin, int stage) {
    auto sK = smem_stage<LayoutK>(k_ptr, stage);
    auto sV = smem_stage<LayoutV>(v_ptr, stage);
    constexpr int kChunks = D / 8;
    for (int c = tid; c < BN * kChunks; c += kTileThreads) {
      const int jj = c / kChunks, d = (c % kChunks) * 8, j = tile_begin + jj;
      const bool valid = j < key_end, from_block = j >= keys.n_ctx;
      const int64_t o = valid ? key_offset(j, from_block) + d : 0;
      cp_async_16(&sK(jj, d), (from_block ? k_block : k_cache) + o, valid);
      cp_async_16(&sV(d, jj), (from_block ? v_block : v_cache) + o, valid);
    }
  };

  const int64_t split_base = static_cast<int64_t>(split) * p.Bsz * p.Bq * p.Hq;  // partial rows
  if (key_begin >= key_end) {  // an empty split (splits > 1): weight 0 in the combine
    for (int r = tid; r < BM && r0 + r < rows; r += kTileThreads) p.partial_lse[split_base + row_index(r)] = -INFINITY;
    return;
  }

  for (int c = tid; c < BM * (D / 8); c += kTileThreads) {
    const int r = c / (D / 8), d = (c % (D / 8)) * 8;
    const bool valid = r0 + r < rows;
    cp_async_16(&sQ(r, d), q + (valid ? q_row_offset(r) + d : 0), valid);
  }
  load_kv(key_begin, 0);
  cp_async_fence();

  constexpr float kLog2e = 1.4426950408889634f;
  const float scale_log2 = p.scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // this thread's two rows
  int first_key[2] = {0, 0}, last_key[2] = {0, 0};                   // per query: the keys they see
  if constexpr (kPerQuery) {
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int pos = keys.n_ctx + (r0 + attn_first_row(tid) + 8 * j) / group;
      const KeySpan span = seen_keys(pos, keys.total, p.window, p.causal, p.symmetric);
      first_key[j] = static_cast<int>(span.first);
      last_key[j] = static_cast<int>(span.last);
    }
  }
  auto o_acc = GemmPV::make_acc();
  auto o_coords = GemmPV::acc_coords(tid);
  auto s_coords = GemmQK::acc_coords(tid);
  const int n_tiles = (key_end - key_begin + BN - 1) / BN;
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it % 2, tile_begin = key_begin + it * BN;
    cp_async_wait<0>();
    smem_writes_to_mma();
    __syncthreads();  // K/V tile `it` visible; everyone is done with tile it-1 (and its P)
    if (it + 1 < n_tiles) load_kv(tile_begin + BN, stage ^ 1);
    cp_async_fence();

    auto s_acc = GemmQK::make_acc();
    GemmQK::run(sQ, smem_stage<LayoutK>(k_ptr, stage), s_acc, tid);

    // Online softmax: masked scaled scores, row maxima over the quad, rescale factors.
    float mx[2] = {-INFINITY, -INFINITY};
    CUTE_UNROLL
    for (int i = 0; i < size(s_acc); ++i) {
      const int slot = attn_elem_slot(i), key = tile_begin + get<1>(s_coords(i));
      bool seen = key < key_end;
      if constexpr (kPerQuery) seen = seen && key >= first_key[slot] && key <= last_key[slot];
      const float s = seen ? s_acc(i) * scale_log2 : -INFINITY;
      s_acc(i) = s;
      mx[slot] = fmaxf(mx[slot], s);
    }
    float alpha[2], m_exp[2];
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const float m_new = fmaxf(m_run[j], quad_max(mx[j]));  // unmasked, finite: every tile has a key
      // Per query, a row may have seen no key yet (m_new = -inf): its exponents then use 0,
      // so that its P and alpha are 0, not NaN.
      m_exp[j] = kPerQuery && m_new == -INFINITY ? 0.f : m_new;
      alpha[j] = exp2f(m_run[j] - m_exp[j]);  // 0 on the row's first tile with a key
      m_run[j] = m_new;
    }
    float sum[2] = {0.f, 0.f};
    CUTE_UNROLL
    for (int i = 0; i < size(s_acc); i += 2) {  // columns (c, c+1) of one row
      const int r = get<0>(s_coords(i)), slot = attn_elem_slot(i);
      uint32_t pair;
      T* e = reinterpret_cast<T*>(&pair);
      e[0] = from_float<T>(exp2f(s_acc(i) - m_exp[slot]));
      e[1] = from_float<T>(exp2f(s_acc(i + 1) - m_exp[slot]));
      sum[slot] += to_float(e[0]) + to_float(e[1]);  // l sums exactly the P that multiplies V
      st_shared_4(&sP(r, get<1>(s_coords(i))), pair);
    }
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) l_run[j] = l_run[j] * alpha[j] + quad_sum(sum[j]);
    CUTE_UNROLL
    for (int i = 0; i < size(o_acc); ++i) o_acc(i) *= alpha[attn_elem_slot(i)];
    smem_writes_to_mma();
    __syncthreads();  // P visible
    GemmPV::run(sP, smem_stage<LayoutV>(v_ptr, stage), o_acc, tid);
  }

  // Per query, a row may see no key of this split (l = 0, lse = -inf): its partial output
  // is NaN, and the combine gives it weight 0 and drops it.
  CUTE_UNROLL
  for (int i = 0; i < size(o_acc); ++i) {
    const int r = get<0>(o_coords(i)), d = get<1>(o_coords(i));
    if (r0 + r >= rows) continue;
    const float o = o_acc(i) / l_run[attn_elem_slot(i)];
    if (p.splits == 1) {
      static_cast<T*>(p.out)[q_row_offset(r) + d] = from_float<T>(o);
    } else {
      p.partial_out[split_base * D + q_row_offset(r) + d] = o;
    }
  }
  if (p.splits > 1 && tid % 4 == 0) {  // one lane of the quad writes its two rows' LSE
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int r = attn_first_row(tid) + 8 * j;
      if (r0 + r < rows) p.partial_lse[split_base + row_index(r)] = m_run[j] / kLog2e + logf(l_run[j]);
    }
  }
}

// One warp per (sequence, query, q head): online softmax over the keys it sees, D <= 256.
template <class T>
__global__ void __launch_bounds__(kSimtThreads)
block_attention_simt_kernel(const __grid_constant__ BlockAttentionParams p) {
  constexpr int kPerLane = kSimtMaxHeadDim / 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq) return;
  const int h = warp % p.Hq, i = (warp / p.Hq) % p.Bq, b = warp / (static_cast<int64_t>(p.Hq) * p.Bq);
  const int kvh = h / (p.Hq / p.Hkv), D = p.D;
  const KeyRange keys = key_range(p, b);
  const T* q = static_cast<const T*>(p.q) + warp * D;
  float qv[kPerLane], o[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < D ? to_float(q[d]) * p.scale : 0.f;
    o[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  // the keys [first, last] of seen_keys, never empty (the query sees itself)
  const KeySpan span = seen_keys(keys.n_ctx + i, keys.total, p.window, p.causal, p.symmetric);
  const int key_first = static_cast<int>(span.first), key_end = static_cast<int>(span.last) + 1;
  for (int key = key_first; key < key_end; ++key) {
    const bool from_block = key >= keys.n_ctx;
    const int64_t row = from_block ? (static_cast<int64_t>(b) * p.Bq + (key - keys.n_ctx)) * p.Hkv + kvh
                                   : (keys.start + key) * p.Hkv + kvh;
    const T* k = static_cast<const T*>(from_block ? p.k_block : p.k_cache) + row * D;
    const T* v = static_cast<const T*>(from_block ? p.v_block : p.v_cache) + row * D;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < D) s += qv[j] * to_float(k[lane + 32 * j]);
    s = warp_sum(s);
    const float m_new = fmaxf(m, s), alpha = expf(m - m_new), e = expf(s - m_new);
    l = l * alpha + e;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < D) o[j] = o[j] * alpha + e * to_float(v[lane + 32 * j]);
    m = m_new;
  }
  T* out = static_cast<T*>(p.out) + warp * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < D) out[lane + 32 * j] = from_float<T>(o[j] / l);
}

// ---------------------------------------------------------------- plan and launch
template <class T, int D, bool kPerQuery>
int attention_tc_ctas_per_sm() {
  return prepare_kernel<&block_attention_tc_kernel<T, D, kPerQuery>>(kTileThreads, attention_smem_bytes<D>(sizeof(T)),
                                                                    "block_attention");
}

// Whether each query has its own key span (causal, or symmetric with a window); symmetric
// without a window is plain non-causal attention.
inline bool per_query_keys(const BlockAttentionParams& p) { return p.causal || (p.symmetric && p.window > 0); }

// f<D, kPerQuery>() for the head dim (64 or 128) and per_query_keys(p).
template <class F>
decltype(auto) dispatch_tc_kernel(const BlockAttentionParams& p, F&& f) {
  const bool per_query = per_query_keys(p);
  if (p.D == 64) return per_query ? f.template operator()<64, true>() : f.template operator()<64, false>();
  return per_query ? f.template operator()<128, true>() : f.template operator()<128, false>();
}

inline int attention_row_tiles(const BlockAttentionParams& p) {
  return ceil_div(static_cast<int64_t>(p.Bq) * (p.Hq / p.Hkv), kAttnBM);
}

// Sets p.splits / p.keys_per_split from p.max_keys (a static bound: the plan reads no
// index value) and returns whether the tensor-core kernel runs.
bool block_attention_plan(BlockAttentionParams& p, const DeviceLimits& dev) {
  const int smem = p.D == 64 ? attention_smem_bytes<64>(2) : attention_smem_bytes<128>(2);
  const bool tc = p.dtype != DType::kFloat32 && (p.D == 64 || p.D == 128) && aligned16(p.q) &&
                  aligned16(p.k_block) && aligned16(p.v_block) && aligned16(p.k_cache) &&
                  aligned16(p.v_cache) && smem <= dev.max_smem_per_block;
  p.tensor_cores = tc;
  p.splits = 1;
  p.keys_per_split = static_cast<int>(std::min<int64_t>(p.max_keys, INT32_MAX));
  if (!tc) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>)
      per_sm = dispatch_tc_kernel(p, []<int D, bool kPerQuery>() { return attention_tc_ctas_per_sm<T, D, kPerQuery>(); });
  };
  dispatch_all_types(p.dtype, occupancy);
  const int64_t ctas = static_cast<int64_t>(p.Bsz) * p.Hkv * attention_row_tiles(p);
  const SplitPlan plan = attention_split_plan(ctas, p.max_keys, kAttnBN, dev.num_sms, per_sm);
  p.splits = plan.splits;
  p.keys_per_split = plan.units_per_split * kAttnBN;
  return true;
}

template <class T, int D, bool kPerQuery>
void launch_attention_tc(const BlockAttentionParams& p, cudaStream_t stream) {
  constexpr int smem = attention_smem_bytes<D>(sizeof(T));
  attention_tc_ctas_per_sm<T, D, kPerQuery>();  // the shared-memory opt-in (once per device)
  const dim3 grid(p.Bsz * p.Hkv, attention_row_tiles(p), p.splits);
  block_attention_tc_kernel<T, D, kPerQuery><<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("block_attention_tc_kernel");
  if (p.splits == 1) return;
  const int64_t rows = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;
  block_attention_combine_kernel<T, D><<<ceil_div(rows, combine_rows_per_cta<D>()), kCombineThreads, 0, stream>>>(p);
  check_launch("block_attention_combine_kernel");
}

void block_attention(const BlockAttentionParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        dispatch_tc_kernel(p, [&]<int D, bool kPerQuery>() { launch_attention_tc<T, D, kPerQuery>(p, stream); });
        return;
      }
    }
    const int64_t warps = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;
    block_attention_simt_kernel<T><<<ceil_div(warps * 32, kSimtThreads), kSimtThreads, 0, stream>>>(p);
    check_launch("block_attention_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

// This architecture's launcher table (block_attention_params.h), read by csrc/cuda/block_attention.cpp.
extern const BlockAttentionLaunchers block_attention_launchers{&block_attention_plan, &block_attention};

}  // namespace dflash::cuda::DFLASH_ARCH_NS
