// CPU block_attention: attention of a block of Bq queries per sequence over that
// sequence's cached context rows followed by its own Bq block rows, non-causal, causal or
// with a symmetric window (the rules in dflash/window.h).
//
// GQA packing: the Bq x group query rows that share one KV head form one M-tile, so
// every K/V row is read once per KV head. Work items are (sequence, KV head, split):
// long contexts are split across threads, each split keeping an fp32 partial output
// with its running max and sum (flash-decoding), merged in a second pass.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>

#include "cpu_utils.h"
#include "isa.h"
#include "dflash/checks.h"
#include "dflash/window.h"

namespace dflash::cpu {
namespace {

constexpr int64_t kKeyTile = 256;   // keys per S = Q·K^T tile
constexpr int64_t kMinSplitKeys = 128;  // do not split below this many keys per split

// A contiguous run of key/value rows in memory (row stride `ld` elements).
template <typename T>
struct KeyRun {
  const T* k;
  const T* v;
  int64_t rows, ld;
};

// Online softmax of one row of scores s[0, n) whose query sees the keys [lo, hi): turns
// s into exp(s - m_new) there and 0 elsewhere, updates the running max m and sum l, and
// returns the factor by which the old output must be scaled (1 when it sees none of them).
inline float online_softmax_row(float* s, int64_t lo, int64_t hi, int64_t n, float& m, float& l) {
  std::fill(s, s + lo, 0.f);
  std::fill(s + std::max(lo, hi), s + n, 0.f);
  if (lo >= hi) return 1.f;  // causal: a tile wholly outside this query's keys
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
  const float m_new = std::max(m, mx);
  const float alpha = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  const Vec shift(m_new);
  Vec acc(0.f);
  int64_t j = lo;
  for (; j + Vec::size() <= hi; j += Vec::size()) {
    const Vec p = (Vec::loadu(s + j) - shift).exp_u20();
    p.store(s + j);
    acc = acc + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < hi; ++j) {
    s[j] = std::exp(s[j] - m_new);
    sum += s[j];
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

template <typename T>
void block_attention_impl(const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const int64_t* offsets, const int64_t* lens, float scale, int64_t window,
                          bool causal, bool symmetric, at::Tensor& out, const BlockAttentionDims& d) {
  const int64_t Bq = d.Bq, D = d.D, Hkv = d.Hkv, group = d.Hq / d.Hkv, M = Bq * group;
  const int64_t ld = Hkv * D;  // row stride of every K/V source
  const bool per_query = causal || (symmetric && window > 0);  // each query row has its own key span

  // Context rows [ctx_begin[b], ctx_begin[b] + ctx_len[b]) of the cache, after the window.
  std::vector<int64_t> ctx_begin(d.Bsz), ctx_len(d.Bsz);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.Bsz; ++b) {
    ctx_len[b] = visible_context(lens[b], window, per_query);
    ctx_begin[b] = offsets[b] + lens[b] - ctx_len[b];
    max_keys = std::max(max_keys, ctx_len[b] + Bq);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t items = d.Bsz * Hkv;
  // At least two work items per thread, and a multiple of the thread count where possible
  // (3 KV heads on 2 threads would otherwise leave a thread idle a third of the time).
  int64_t splits = (2 * threads + items - 1) / items;
  while ((items * splits) % threads != 0 && splits < 4 * threads) ++splits;
  splits = std::max<int64_t>(1, std::min(splits, max_keys / kMinSplitKeys));

  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Partial results when split: o [items*splits, M, D], running max / sum [items*splits, M].
  std::vector<float> part_o, part_m, part_l;
  if (splits > 1) {
    part_o.resize(items * splits * M * D);
    part_m.resize(items * splits * M);
    part_l.resize(items * splits * M);
  }

  at::parallel_for(0, items * splits, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> qf(M * D), o(M * D), s(M * kKeyTile), m(M), l(M), k_buf, v_buf;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t split = w % splits, item = w / splits, b = item / Hkv, h = item % Hkv;
      const int64_t keys = ctx_len[b] + Bq;
      const int64_t per_split = (keys + splits - 1) / splits;
      const int64_t key0 = std::min(keys, split * per_split), key1 = std::min(keys, key0 + per_split);

      // Query rows (i, r) -> m = i * group + r, pre-scaled.
      for (int64_t i = 0; i < Bq; ++i)
        for (int64_t r = 0; r < group; ++r) {
          float* dst = qf.data() + (i * group + r) * D;
          to_float(qp + ((b * Bq + i) * d.Hq + h * group + r) * D, dst, D);
          scale_row(dst, scale, D);
        }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);

      // The virtual key sequence is [context rows ; block rows]; walk its slice [key0, key1).
      // Key t of it is at position t and query i at ctx_len[b] + i (window.h, shifted to
      // the first visible row). The M-tile's queries together see every key, so causal and
      // symmetric mask scores per row (online_softmax_row's range) and skip no tile.
      const KeyRun<T> runs[2] = {
          {k_cache.data_ptr<T>() + ctx_begin[b] * ld + h * D,
           v_cache.data_ptr<T>() + ctx_begin[b] * ld + h * D, ctx_len[b], ld},
          {k_block.data_ptr<T>() + b * Bq * ld + h * D, v_block.data_ptr<T>() + b * Bq * ld + h * D,
           Bq, ld}};
      int64_t run_start = 0;
      for (const KeyRun<T>& run : runs) {
        const int64_t base = run_start;  // the run's first key
        const int64_t lo = std::max(key0, base) - base, hi = std::min(key1, base + run.rows) - base;
        run_start += run.rows;
        for (int64_t j0 = lo; j0 < hi; j0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, hi - j0), t0 = base + j0;  // the tile's first key
          const F32Rows kt = rows_as_f32(run.k + j0 * run.ld, n, D, run.ld, k_buf);
          gemm_nt(M, n, D, qf.data(), D, kt.ptr, kt.ld, 0.f, s.data(), kKeyTile);
          for (int64_t r = 0; r < M; ++r) {
            int64_t seen_lo = 0, seen_hi = n;
            if (per_query) {
              const KeySpan span = seen_keys(ctx_len[b] + r / group, keys, window, causal, symmetric);
              seen_lo = std::clamp<int64_t>(span.first - t0, 0, n);
              seen_hi = std::clamp<int64_t>(span.last + 1 - t0, 0, n);
            }
            const float alpha = online_softmax_row(s.data() + r * kKeyTile, seen_lo, seen_hi, n, m[r], l[r]);
            if (alpha != 1.f) scale_row(o.data() + r * D, alpha, D);
          }
          const F32Rows vt = rows_as_f32(run.v + j0 * run.ld, n, D, run.ld, v_buf);
          gemm_nn(M, D, n, s.data(), kKeyTile, vt.ptr, vt.ld, 1.f, o.data(), D);
        }
      }

      if (splits == 1) {
        for (int64_t i = 0; i < Bq; ++i)
          for (int64_t r = 0; r < group; ++r) {
            const int64_t row = i * group + r;
            from_float(o.data() + row * D, op + ((b * Bq + i) * d.Hq + h * group + r) * D, D,
                       1.f / l[row]);
          }
      } else {
        std::copy(o.begin(), o.end(), part_o.begin() + w * M * D);
        std::copy(m.begin(), m.end(), part_m.begin() + w * M);
        std::copy(l.begin(), l.end(), part_l.begin() + w * M);
      }
    }
  });
  if (splits == 1) return;

  // Merge the splits of each (sequence, KV head): weights exp(m_s - max_s m_s).
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(D);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      for (int64_t row = 0; row < M; ++row) {
        float m_max = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < splits; ++sp) m_max = std::max(m_max, part_m[(item * splits + sp) * M + row]);
        float l_sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t w = item * splits + sp;
          if (part_l[w * M + row] == 0.f) continue;  // an empty split
          const float f = std::exp(part_m[w * M + row] - m_max);
          l_sum += f * part_l[w * M + row];
          const float* po = part_o.data() + (w * M + row) * D;
          at::vec::map2<float>([f](Vec a, Vec p) { return at::vec::fmadd(Vec(f), p, a); },
                               acc.data(), acc.data(), po, D);
        }
        const int64_t i = row / group, r = row % group;
        from_float(acc.data(), op + ((b * Bq + i) * d.Hq + h * group + r) * D, D, 1.f / l_sum);
      }
    }
  });
}

// Causal or symmetric: the additive mask [Bq x group query rows, keys] of the queries at
// positions q0 + i over the keys at positions k0 + j of a sequence of `total` keys (0 where
// seen, -inf where not).
at::Tensor per_query_mask(int64_t Bq, int64_t group, int64_t q0, int64_t k0, int64_t keys, int64_t total,
                          int64_t window, bool causal, bool symmetric) {
  at::Tensor mask = at::empty({Bq * group, keys}, at::kFloat);
  float* m = mask.data_ptr<float>();
  for (int64_t i = 0; i < Bq; ++i)
    for (int64_t j = 0; j < keys; ++j)
      m[i * group * keys + j] = sees_key(q0 + i, k0 + j, total, window, causal, symmetric)
                                    ? 0.f
                                    : -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < Bq; ++i)  // the group's rows of query i repeat its row
    for (int64_t r = 1; r < group; ++r) std::copy_n(m + i * group * keys, keys, m + (i * group + r) * keys);
  return mask;
}

// The flash path: per sequence, ATen's CPU flash attention (bf16 dot products / AMX tiles
// where the CPU has them) once over the context rows and once over the block rows, both
// strided views of the caches (no concatenation), merged by their log-sum-exp. The Bq x
// group queries of one KV head are its query rows, so the kernel sees Hkv heads (GQA).
// Causal or symmetric, both calls take an additive mask (window.h's rule); a query that
// sees no context row (window <= its block index) takes the block call alone.
void flash_block_attention(const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const int64_t* offsets, const int64_t* lens, double scale, int64_t window,
                           bool causal, bool symmetric, at::Tensor& out, const BlockAttentionDims& d) {
  const int64_t Bq = d.Bq, D = d.D, Hkv = d.Hkv, group = d.Hq / d.Hkv, M = Bq * group;
  const bool per_query = causal || (symmetric && window > 0);
  const auto heads_first = [&](const at::Tensor& rows) { return rows.permute({1, 0, 2}).unsqueeze(0); };
  // Positions counted from the first visible context row: query i at n + i, block key j at n + j.
  using Mask = std::optional<at::Tensor>;
  for (int64_t b = 0; b < d.Bsz; ++b) {
    const int64_t n = visible_context(lens[b], window, per_query);
    const at::Tensor qh = q[b].view({Bq, Hkv, group, D}).permute({1, 0, 2, 3}).reshape({1, Hkv, M, D});
    auto block = at::_scaled_dot_product_flash_attention_for_cpu(
        qh, heads_first(k_block[b]), heads_first(v_block[b]), 0.0, false,
        per_query ? Mask(per_query_mask(Bq, group, n, n, Bq, n + Bq, window, causal, symmetric)) : Mask(), scale);
    at::Tensor o = std::get<0>(block);  // [1, Hkv, M, D]
    if (n > 0) {
      const int64_t start = offsets[b] + lens[b] - n;
      // window 0: every query sees the whole context, no mask
      auto ctx = at::_scaled_dot_product_flash_attention_for_cpu(
          qh, heads_first(k_cache.narrow(0, start, n)), heads_first(v_cache.narrow(0, start, n)), 0.0, false,
          per_query && window > 0 ? Mask(per_query_mask(Bq, group, n, 0, n, n + Bq, window, causal, symmetric))
                                  : Mask(),
          scale);
      // softmax over both key sets = each part's softmax weighted by exp(lse_part - lse_all)
      const at::Tensor o_c = std::get<0>(ctx).contiguous(), o_b = o.contiguous();
      const at::Tensor lse_b = std::get<1>(block).to(at::kFloat).contiguous();
      const at::Tensor lse_c = std::get<1>(ctx).to(at::kFloat).contiguous();
      at::Tensor merged = at::empty({Hkv * M, D}, o.options().dtype(at::kFloat));
      DFLASH_DISPATCH_FLOATING(o.scalar_type(), "flash_merge", [&] {
        const scalar_t *pb = o_b.data_ptr<scalar_t>(), *pc = o_c.data_ptr<scalar_t>();
        const float *lb = lse_b.data_ptr<float>(), *lc = lse_c.data_ptr<float>();
        float* dst = merged.data_ptr<float>();
        std::vector<float> row(D);
        for (int64_t r = 0; r < Hkv * M; ++r) {
          to_float(pb + r * D, dst + r * D, D);
          // Per query, a query may see no context row: ATen's output for a row with every key
          // masked (0, lse 0 rather than -inf) must not be merged, so tell such rows by position.
          if (per_query && causal_first_key(n + (r % M) / group, window) >= n) continue;
          const float mx = std::max(lb[r], lc[r]);
          const float wb = std::exp(lb[r] - mx), wc = std::exp(lc[r] - mx), inv = 1.f / (wb + wc);
          to_float(pc + r * D, row.data(), D);
          at::vec::map2<float>([=](Vec x, Vec y) { return (x * Vec(wb) + y * Vec(wc)) * Vec(inv); },
                               dst + r * D, dst + r * D, row.data(), D);
        }
      });
      o = merged;
    }
    out[b].copy_(o.view({Hkv, Bq, group, D}).permute({1, 0, 2, 3}).reshape({Bq, d.Hq, D}));
  }
}

at::Tensor block_attention_cpu(const at::Tensor& q, const at::Tensor& k_block,
                               const at::Tensor& v_block, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& cache_offsets,
                               const at::Tensor& cache_lens, double scale, int64_t window,
                               int64_t max_context, bool /*validate*/, bool causal, bool symmetric) {
  const BlockAttentionDims d = check_block_attention(q, k_block, v_block, k_cache, v_cache, cache_offsets,
                                                     cache_lens, scale, window, max_context, causal, symmetric);
  // Always validated on the CPU: the values are in host memory, reading them costs nothing.
  check_cache_ranges(cache_offsets, cache_lens, d.S, window, causal, symmetric, max_context);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (out.numel() == 0) return out;
  const at::Tensor off = cache_offsets.contiguous(), len = cache_lens.contiguous();
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.Bsz; ++b) {
    max_keys = std::max(max_keys, visible_context(len.data_ptr<int64_t>()[b], window, causal || symmetric) + d.Bq);
  }
  if (attention_path(q.scalar_type(), max_keys, d.Bq * (d.Hq / d.Hkv)) == AttentionPath::flash) {
    flash_block_attention(qc, k_block, v_block, k_cache, v_cache, off.data_ptr<int64_t>(), len.data_ptr<int64_t>(),
                          scale, window, causal, symmetric, out, d);
    return out;
  }
  DFLASH_DISPATCH_FLOATING(q.scalar_type(), "block_attention", [&] {
    block_attention_impl<scalar_t>(qc, k_block.contiguous(), v_block.contiguous(), k_cache, v_cache,
                                   off.data_ptr<int64_t>(), len.data_ptr<int64_t>(),
                                   static_cast<float>(scale), window, causal, symmetric, out, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) { m.impl("block_attention", &block_attention_cpu); }

}  // namespace dflash::cpu
