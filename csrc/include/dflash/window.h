// The window and causal rules of block_attention, shared by the op checks, the CPU kernels,
// the CUDA plans and the CUDA kernels (plain C++ that nvcc also compiles for the device).
//
// Positions: in a sequence with n context rows, context row r is at position r, block key
// j at n + j and block query i at n + i. Non-causal, every query sees the last `window`
// context rows (0 = all) and every block key. Causal, the query at position p sees the key
// at position k iff k <= p and (window == 0 or p - k < window): the causal sliding window
// over the context followed by the block.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

// Context rows the queries of a sequence with `len` context rows see, all of them together:
// the last `window` (0 = all). Causal, the first query sees the most of them, window - 1
// (its own block key is the window's last), so no kernel reads the row before those.
DFLASH_HOST_DEVICE constexpr int64_t visible_context(int64_t len, int64_t window, bool causal) {
  const int64_t rows = causal ? window - 1 : window;
  return (window > 0 && len > rows) ? rows : len;
}

// Causal: the first key the query at position p sees (the last is p itself). Positions may
// be counted from any origin shared by the query and the keys, e.g. the first visible row.
DFLASH_HOST_DEVICE constexpr int64_t causal_first_key(int64_t p, int64_t window) {
  return (window > 0 && p >= window) ? p - window + 1 : 0;
}

// Whether the query at position p sees the key at position k, both counted from a sequence's
// first visible context row: non-causal every visible key does (the window made the range).
DFLASH_HOST_DEVICE constexpr bool sees_key(int64_t p, int64_t k, int64_t window, bool causal) {
  return !causal || (k <= p && k >= causal_first_key(p, window));
}

}  // namespace dflash
