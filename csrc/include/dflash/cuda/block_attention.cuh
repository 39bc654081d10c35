// block_attention for one architecture: the Bq draft queries of one sequence attend to that
// sequence's visible context in the cache followed by its own Bq block keys, non-causally or
// causally (p.causal: the rules of dflash/window.h). The tensor-core kernel:
//   - GQA packing: the Bq x group query rows that share a KV head form the M dimension
//     (16 x 4 = 64 rows = one wgmma warpgroup), so each K/V tile is read once per KV head.
//   - Split-KV: grid.z splits the keys; each split writes its fp32 output and log-sum-exp,
//     and the last split CTA of each (sequence, KV head, row tile) to finish, found by an
//     atomic counter, merges them (splits == 1 writes the output directly; no second launch).
//   - Online softmax in registers, log2 domain: each thread owns two rows of the S and O
//     accumulators, shared with the other lanes of its quad (quad shuffles reduce a row);
//     P goes back to shared memory as the A operand of P*V (V is read MN-major).
//   - Causal is a template flag (the non-causal kernel is unchanged): scores are masked per
//     (query row, key). A row tile's queries together see every key, so no tile is skipped.
// Requirements (checked by the plan function, else the SIMT path runs): bf16/fp16,
// D in {64, 128}. The SIMT kernel (every dtype, D <= kSimtMaxHeadDim): one warp per
// (sequence, query, q head). Host side: kernel choice, split-KV plan, launch.
#pragma once
#include <cmath>

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
  const int64_t visible = min(visible_context(n, p.window, p.causal), p.max_context);
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

// Split-KV merge, run by every split CTA when it is done: the one that finishes last for
// its tile (the counter reaches splits - 1) merges the tile's rows over all splits,
// out = sum_s exp(lse_s - max) O_s / sum_s exp(lse_s - max) (partials are normalized by
// their own l). The counters are zeroed before every launch (a memset node in a graph).
// Partials are read through L2 (__ldcg): other CTAs wrote them, and L1 is not coherent.
// `scratch` is the CTA's dynamic shared memory, free by now (no copy in flight, every MMA
// done): a static __shared__ array here would move the dynamic buffer off its 1 KiB
// alignment, which the wgmma swizzle needs. It holds the flag and the per-(split, row)
// weights, so the loop over the D columns reads only the partial outputs.
inline constexpr int kAttnCombineScratchFloats = 1 + kAttnMaxSplits * kAttnBM;
static_assert(kAttnCombineScratchFloats * 4 <= attention_smem_bytes<64>(2), "the combine scratch must fit the tile buffers");
template <class T, int D, class RowIndex>
__device__ void combine_splits_if_last(const BlockAttentionParams& p, int r0, int rows, const RowIndex& row_index,
                                       float* scratch) {
  int* is_last = reinterpret_cast<int*>(scratch);
  float* weight = scratch + 1;  // [splits][kAttnBM]: exp(lse_s - max) / sum_s exp(lse_s - max)
  __threadfence();  // this CTA's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) *is_last = atomicAdd(p.tile_counters + blockIdx.x * gridDim.y + blockIdx.y, 1) == p.splits - 1;
  __syncthreads();
  if (!*is_last) return;
  __threadfence();
  const int64_t plane = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;  // rows of one split
  for (int r = threadIdx.x; r < kAttnBM; r += kTileThreads) {
    if (r0 + r >= rows) continue;
    const int64_t row = row_index(r);
    float m = -INFINITY, denom = 0.f;
    for (int s = 0; s < p.splits; ++s) m = fmaxf(m, __ldcg(p.partial_lse + s * plane + row));
    for (int s = 0; s < p.splits; ++s) {
      const float w = expf(__ldcg(p.partial_lse + s * plane + row) - m);
      weight[s * kAttnBM + r] = w;
      denom += w;
    }
    // denom >= 1: the split holding the block keys is never empty
    for (int s = 0; s < p.splits; ++s) weight[s * kAttnBM + r] /= denom;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kAttnBM * D; c += kTileThreads) {
    const int r = c / D, d = c % D;
    if (r0 + r >= rows) continue;
    const int64_t row = row_index(r);
    float acc = 0.f;
    for (int s = 0; s < p.splits; ++s) {
      const float w = weight[s * kAttnBM + r];
      if (w > 0.f) acc += w * __ldcg(p.partial_out + (s * plane + row) * D + d);  // empty splits: w = 0
    }
    static_cast<T*>(p.out)[row * D + d] = from_float<T>(acc);
  }
}

template <class T, int D, bool kCausal>
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
  if (key_begin >= key_end) {  // an empty split (splits > 1): it adds nothing to the combine
    for (int r = tid; r < BM && r0 + r < rows; r += kTileThreads) {
      const int64_t row = split_base + row_index(r);
      p.partial_lse[row] = -INFINITY;
      for (int d = 0; d < D; ++d) p.partial_out[row * D + d] = 0.f;
    }
    combine_splits_if_last<T, D>(p, r0, rows, row_index, reinterpret_cast<float*>(smem_raw));
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
  int first_key[2] = {0, 0}, last_key[2] = {0, 0};                   // causal: the keys they see
  if constexpr (kCausal) {
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int pos = keys.n_ctx + (r0 + attn_first_row(tid) + 8 * j) / group;
      first_key[j] = static_cast<int>(causal_first_key(pos, p.window));
      last_key[j] = pos;
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
      if constexpr (kCausal) seen = seen && key >= first_key[slot] && key <= last_key[slot];
      const float s = seen ? s_acc(i) * scale_log2 : -INFINITY;
      s_acc(i) = s;
      mx[slot] = fmaxf(mx[slot], s);
    }
    float alpha[2], m_exp[2];
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const float m_new = fmaxf(m_run[j], quad_max(mx[j]));  // non-causal, finite: every tile has a key
      // Causal, a row may have seen no key yet (m_new = -inf): its exponents then use 0, so
      // that its P and alpha are 0, not NaN.
      m_exp[j] = kCausal && m_new == -INFINITY ? 0.f : m_new;
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

  // Causal, a row may see no key of this split (l = 0, lse = -inf): its partial output is
  // NaN, and the combine gives it weight 0 and never reads it.
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
  if (p.splits > 1) combine_splits_if_last<T, D>(p, r0, rows, row_index, reinterpret_cast<float*>(smem_raw));
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
  // causal: the keys [first, n_ctx + i], never empty (the query sees itself)
  const int key_first = p.causal ? static_cast<int>(causal_first_key(keys.n_ctx + i, p.window)) : 0;
  const int key_end = p.causal ? keys.n_ctx + i + 1 : keys.total;
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
template <class T, int D, bool kCausal>
int attention_tc_ctas_per_sm() {
  return prepare_kernel<&block_attention_tc_kernel<T, D, kCausal>>(kTileThreads, attention_smem_bytes<D>(sizeof(T)),
                                                                  "block_attention");
}

// f<D, kCausal>() for the head dim (64 or 128) and p.causal.
template <class F>
decltype(auto) dispatch_tc_kernel(const BlockAttentionParams& p, F&& f) {
  if (p.D == 64) return p.causal ? f.template operator()<64, true>() : f.template operator()<64, false>();
  return p.causal ? f.template operator()<128, true>() : f.template operator()<128, false>();
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
  p.tile_counter_count = 0;
  p.keys_per_split = static_cast<int>(std::min<int64_t>(p.max_keys, INT32_MAX));
  if (!tc) return false;
  int per_sm = 1;
  auto occupancy = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>)
      per_sm = dispatch_tc_kernel(p, []<int D, bool kCausal>() { return attention_tc_ctas_per_sm<T, D, kCausal>(); });
  };
  dispatch_all_types(p.dtype, occupancy);
  const int64_t ctas = static_cast<int64_t>(p.Bsz) * p.Hkv * attention_row_tiles(p);
  p.tile_counter_count = ctas;
  const SplitPlan plan = attention_split_plan(ctas, p.max_keys, kAttnBN, static_cast<int64_t>(dev.num_sms) * per_sm);
  p.splits = plan.splits;
  p.keys_per_split = plan.units_per_split * kAttnBN;
  return true;
}

template <class T, int D, bool kCausal>
void launch_attention_tc(const BlockAttentionParams& p, cudaStream_t stream) {
  constexpr int smem = attention_smem_bytes<D>(sizeof(T));
  attention_tc_ctas_per_sm<T, D, kCausal>();  // the shared-memory opt-in (once per device)
  const dim3 grid(p.Bsz * p.Hkv, attention_row_tiles(p), p.splits);
  block_attention_tc_kernel<T, D, kCausal><<<grid, kTileThreads, smem, stream>>>(p);
  check_launch("block_attention_tc_kernel");
}

void block_attention(const BlockAttentionParams& p, cudaStream_t stream) {
  auto run = [&]<class T>() {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.tensor_cores) {
        dispatch_tc_kernel(p, [&]<int D, bool kCausal>() { launch_attention_tc<T, D, kCausal>(p, stream); });
        return;
      }
    }
    const int64_t warps = static_cast<int64_t>(p.Bsz) * p.Bq * p.Hq;
    block_attention_simt_kernel<T><<<ceil_div(warps * 32, kSimtThreads), kSimtThreads, 0, stream>>>(p);
    check_launch("block_attention_simt_kernel");
  };
  dispatch_all_types(p.dtype, run);
}

}  // namespace dflash::cuda::DFLASH_ARCH_NS
