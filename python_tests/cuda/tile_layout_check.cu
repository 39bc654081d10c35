// Host-side check of the layout facts the CUDA kernels rely on, for every TileGemm
// configuration they instantiate (built twice by test_cuda_layouts.py: wgmma and
// mma.sync). CuTe layouts and tiled MMAs are host-usable types, so this runs without
// a GPU:
//   - the tiled MMA has kTileThreads threads and its accumulator coordinates cover the
//     BM x BN tile exactly once (the epilogues index the output by them);
//   - each shared-memory layout is a bijection onto [0, rows*cols), 8 consecutive
//     elements along the contiguous mode stay contiguous (16-byte cp.async and stores),
//     and a tile is a whole number of 1 KiB swizzle periods (stages at offset pointers).
#include <cstdio>
#include <vector>

#include "dflash/cuda/gemm_kernels.cuh"
#include "dflash/cuda/attention_kernels.cuh"

using namespace dflash::cuda::DFLASH_ARCH_NS;

static int failures = 0;
#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) {                          \
      ++failures;                           \
      std::printf("FAIL %s: ", #cond);      \
      std::printf(__VA_ARGS__);             \
      std::printf("\n");                    \
    }                                       \
  } while (0)

// rows x cols smem layout; `contiguous_dim` 1: the second coordinate is contiguous.
template <class Layout>
void check_smem_layout(const char* name, int rows, int cols, int contiguous_dim, int elem_bytes) {
  Layout layout{};
  const int n = rows * cols;
  CHECK(int(cosize(layout)) == n, "%s: cosize %d != %d", name, int(cosize(layout)), n);
  CHECK(n * elem_bytes % 1024 == 0, "%s: %d bytes is not a whole number of 1 KiB periods", name, n * elem_bytes);
  std::vector<int> seen(n, 0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const int off = int(layout(r, c));
      if (off < 0 || off >= n) { CHECK(false, "%s: (%d,%d) -> %d out of range", name, r, c, off); return; }
      ++seen[off];
      const bool chunk_start = (contiguous_dim == 1 ? c : r) % 8 == 0;
      if (chunk_start)
        for (int j = 1; j < 8; ++j) {
          const int o2 = contiguous_dim == 1 ? int(layout(r, c + j)) : int(layout(r + j, c));
          CHECK(o2 == off + j, "%s: chunk at (%d,%d) not contiguous (+%d -> %d, want %d)", name, r, c, j, o2, off + j);
        }
    }
  for (int i = 0; i < n; ++i) CHECK(seen[i] == 1, "%s: offset %d hit %d times", name, i, seen[i]);
}

template <class Gemm, int BM, int BN, int BK, bool kBMNMajor>
void check_gemm(const char* name) {
  using T = cutlass::bfloat16_t;
  CHECK(int(size(Gemm::tiled_mma())) == kTileThreads, "%s: %d threads", name, int(size(Gemm::tiled_mma())));
  std::vector<int> hits(BM * BN, 0);
  for (int tid = 0; tid < kTileThreads; ++tid) {
    auto coords = Gemm::acc_coords(tid);
    CHECK(size(coords) == size(Gemm::make_acc()), "%s: coords/acc size mismatch", name);
    for (int i = 0; i < size(coords); ++i) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i));
      CHECK(r >= 0 && r < BM && c >= 0 && c < BN, "%s: coordinate (%d,%d) outside the tile", name, r, c);
      if (r >= 0 && r < BM && c >= 0 && c < BN) ++hits[r * BN + c];
    }
  }
  int bad = 0;
  for (int h : hits) bad += h != 1;
  CHECK(bad == 0, "%s: %d of %d accumulator positions not covered exactly once", name, bad, BM * BN);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s A", name);
  check_smem_layout<typename Gemm::LayoutA>(buf, BM, BK, 1, sizeof(T));
  std::snprintf(buf, sizeof buf, "%s B", name);
  check_smem_layout<typename Gemm::LayoutB>(buf, BN, BK, kBMNMajor ? 0 : 1, sizeof(T));
  std::printf("checked %s\n", name);
}

int main() {
  using T = cutlass::bfloat16_t;
  check_gemm<TileGemm<T, kGemmBM, 128, kGemmBK, false, kGemmWarpsM>, kGemmBM, 128, kGemmBK, false>("project_features");
  check_gemm<TileGemm<T, kGemmBM, 64, kGemmBK, false, kGemmWarpsM>, kGemmBM, 64, kGemmBK, false>("inject D=64");
  check_gemm<TileGemm<T, kGemmBM, 128, kGemmBK, false, kGemmWarpsM>, kGemmBM, 128, kGemmBK, false>("inject D=128");
  check_gemm<TileGemm<T, kAttnBM, kAttnBN, 64, false>, kAttnBM, kAttnBN, 64, false>("attention QK D=64");
  check_gemm<TileGemm<T, kAttnBM, kAttnBN, 128, false>, kAttnBM, kAttnBN, 128, false>("attention QK D=128");
  check_gemm<TileGemm<T, kAttnBM, 64, kAttnBN, true>, kAttnBM, 64, kAttnBN, true>("attention PV D=64");
  check_gemm<TileGemm<T, kAttnBM, 128, kAttnBN, true>, kAttnBM, 128, kAttnBN, true>("attention PV D=128");
  std::printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
