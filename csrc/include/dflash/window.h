// The window, causal and symmetric rules of block_attention, shared by the op checks, the
// CPU kernels, the CUDA plans and the CUDA kernels (plain C++ that nvcc also compiles for
// the device).
//
// Positions: in a sequence with n context rows, context row r is at position r, block key
// j at n + j and block query i at n + i. Non-causal, every query sees the last `window`
// context rows (0 = all) and every block key. Causal, the query at position p sees the key
// at position k iff k <= p and (window == 0 or p - k < window): the causal sliding window
// over the context followed by the block. Symmetric (a bidirectional window, DFlash2's
// sliding layers), it sees k iff window == 0 or |p - k| < window: the context rows within
// the window behind it and the block keys within the window on both sides. Causal and
// symmetric are per-query rules: each query sees one contiguous span of keys.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

// Context rows the queries of a sequence with `len` context rows see, all of them together:
// the last `window` (0 = all). Per query (causal or symmetric), the first query sees the
// most of them, window - 1 (its own block key is the window's last context-side key), so
// no kernel reads the row before those.
DFLASH_HOST_DEVICE constexpr int64_t visible_context(int64_t len, int64_t window, bool per_query) {
  const int64_t rows = per_query ? window - 1 : window;
  return (window > 0 && len > rows) ? rows : len;
}

// Causal and symmetric: the first key the query at position p sees. Positions may be counted
// from any origin shared by the query and the keys, e.g. the first visible row.
DFLASH_HOST_DEVICE constexpr int64_t causal_first_key(int64_t p, int64_t window) {
  return (window > 0 && p >= window) ? p - window + 1 : 0;
}

// The keys [first, last] the query at position p sees among a sequence's `total` keys (its
// visible context rows, then its block), positions counted from the first visible row:
// non-causal all of them (the window made the range), causal [first, p], symmetric
// [first, p + window - 1]. Never empty for a block query (it sees itself).
struct KeySpan {
  int64_t first, last;
};
DFLASH_HOST_DEVICE constexpr KeySpan seen_keys(int64_t p, int64_t total, int64_t window, bool causal, bool symmetric) {
  if (causal) return {causal_first_key(p, window), p};
  if (symmetric && window > 0) return {causal_first_key(p, window), p + window - 1 < total ? p + window - 1 : total - 1};
  return {0, total - 1};
}

// Whether the query at position p sees the key at position k (both as in seen_keys).
DFLASH_HOST_DEVICE constexpr bool sees_key(int64_t p, int64_t k, int64_t total, int64_t window, bool causal,
                                           bool symmetric) {
  const KeySpan span = seen_keys(p, total, window, causal, symmetric);
  return k >= span.first && k <= span.last;
}

}  // namespace dflash
