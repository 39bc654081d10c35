// Host-side checks of what the CUDA kernels rely on, built twice by test_cuda_build.py
// (wgmma and mma.sync) and run without a GPU. CuTe layouts and tiled MMAs are
// host-usable types, and the plan functions are host code. For every TileGemm
// configuration the kernels instantiate:
//   - the tiled MMA has kTileThreads threads and its accumulator coordinates cover the
//     BM x BN tile exactly once (the epilogues index the output by them);
//   - attention tiles: element i of thread tid is in row attn_first_row(tid) + 8 *
//     attn_elem_slot(i), a row shared by the thread's quad only, and elements (2i, 2i+1)
//     are columns (c, c+1), c even (the register softmax relies on it);
//   - each shared-memory layout is a bijection onto [0, rows*cols), 8 consecutive
//     elements along the contiguous mode stay contiguous (16-byte cp.async and stores),
//     and a tile is a whole number of 1 KiB swizzle periods (stages at offset pointers).
// For the plan functions: the split schedules cover every K tile / key exactly once with
// no split past the end, the GEMV's stream-K schedule covers every step once in one wave
// with unique partial slots, and the path choice (GEMV, tensor cores, SIMT or cuBLAS)
// follows T, the dtype, shape, alignment and shared-memory rules.
#include <cstdio>
#include <vector>

#include "dflash/cuda/block_attention.cuh"
#include "dflash/cuda/inject_context_kv.cuh"
#include "dflash/cuda/project_features.cuh"

using namespace dflash::cuda;
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

template <class Gemm, int BM, int BN>
void check_attention_rows(const char* name) {
  for (int tid = 0; tid < kTileThreads; ++tid) {
    auto coords = Gemm::acc_coords(tid);
    const int first = attn_first_row(tid);
    for (int i = 0; i < size(coords); ++i) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i));
      CHECK(r == first + 8 * attn_elem_slot(i), "%s: thread %d element %d is in row %d, not %d", name, tid, i, r,
            first + 8 * attn_elem_slot(i));
      if (i % 2 == 0) {
        CHECK(c % 2 == 0 && get<0>(coords(i + 1)) == r && get<1>(coords(i + 1)) == c + 1,
              "%s: thread %d elements %d, %d are not columns (c, c+1) of one row", name, tid, i, i + 1);
      }
    }
  }
  // the four lanes of a quad hold the same rows, so quad shuffles reduce a whole row
  for (int tid = 0; tid < kTileThreads; ++tid)
    CHECK(attn_first_row(tid) == attn_first_row(tid - tid % 4), "%s: quad of thread %d splits rows", name, tid);
  std::vector<int> owners(BM, 0);
  for (int tid = 0; tid < kTileThreads; tid += 4) { ++owners[attn_first_row(tid)]; ++owners[attn_first_row(tid) + 8]; }
  for (int r = 0; r < BM; ++r) CHECK(owners[r] == 1, "%s: row %d owned by %d quads", name, r, owners[r]);
  std::printf("checked %s rows\n", name);
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

void* fake_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

void check_plans() {
  const DeviceLimits h200{132, 227 * 1024}, ada{128, 99 * 1024}, small_smem{16, 64 * 1024}, tiny{4, 227 * 1024};
  // block_attention: schedules
  for (const DeviceLimits& dev : {h200, tiny})
    for (int bsz : {1, 3, 16})
      for (int bq : {1, 4, 16})
        for (int64_t keys : {int64_t(1), int64_t(63), int64_t(64), int64_t(65), int64_t(1000), int64_t(32768 + 16), int64_t(1) << 20}) {
          BlockAttentionParams p{};
          p.q = p.k_block = p.v_block = p.k_cache = p.v_cache = fake_ptr(0x10000);
          p.Bsz = bsz; p.Bq = bq; p.Hq = 32; p.Hkv = 8; p.D = 128; p.max_keys = keys + bq;
          p.dtype = DType::kBFloat16;
          const bool tc = block_attention_plan(p, dev);
          CHECK(tc && p.tensor_cores, "attention bf16 D=128 should take tensor cores");
          CHECK(p.splits >= 1 && p.splits <= kAttnMaxSplits, "splits %d", p.splits);
          CHECK(p.keys_per_split % kAttnBN == 0, "keys_per_split %d not a multiple of %d", p.keys_per_split, kAttnBN);
          CHECK(int64_t(p.splits) * p.keys_per_split >= p.max_keys, "splits do not cover %lld keys", (long long)p.max_keys);
          CHECK(int64_t(p.splits - 1) * p.keys_per_split < p.max_keys, "a split starts past %lld keys", (long long)p.max_keys);
          CHECK(p.splits == 1 || p.keys_per_split >= kAttnMinKeysPerSplit, "a split of %d keys", p.keys_per_split);
          const int64_t ctas = int64_t(bsz) * p.Hkv * ((bq * 4 + kAttnBM - 1) / kAttnBM);
          CHECK(p.splits == 1 || ctas * p.splits <= int64_t(dev.num_sms) * 2,
                "%lld CTAs x %d splits exceed one wave", (long long)ctas, p.splits);  // <= 2 resident per SM
          for (int rule = 0; rule < 2; ++rule) {  // causal and symmetric mask scores only: the same schedule
            BlockAttentionParams c = p;
            (rule == 0 ? c.causal : c.symmetric) = true;
            c.window = 100;
            CHECK(block_attention_plan(c, dev) && c.splits == p.splits && c.keys_per_split == p.keys_per_split,
                  "%s attention plans %d splits of %d keys, non-causal %d of %d", rule == 0 ? "causal" : "symmetric",
                  c.splits, c.keys_per_split, p.splits, p.keys_per_split);
          }
        }
  // block_attention: path choice
  auto attention_tc = [](DType dtype, int D, uintptr_t q, const DeviceLimits& dev) {
    BlockAttentionParams p{};
    p.k_block = p.v_block = p.k_cache = p.v_cache = fake_ptr(0x10000);
    p.q = fake_ptr(q);
    p.Bsz = 1; p.Bq = 16; p.Hq = 8; p.Hkv = 2; p.D = D; p.max_keys = 100; p.dtype = dtype;
    return block_attention_plan(p, dev);
  };
  CHECK(!attention_tc(DType::kFloat32, 128, 0x10000, h200), "fp32 attention must take the SIMT path");
  CHECK(!attention_tc(DType::kBFloat16, 96, 0x10000, h200), "D=96 attention must take the SIMT path");
  CHECK(!attention_tc(DType::kFloat16, 64, 0x10002, h200), "unaligned q must take the SIMT path");
  CHECK(attention_tc(DType::kFloat16, 128, 0x10000, ada), "D=128 fits 99 KiB of shared memory (sm_86/89/120)");
  CHECK(attention_tc(DType::kFloat16, 64, 0x10000, small_smem), "D=64 fits 64 KiB of shared memory");
  CHECK(!attention_tc(DType::kFloat16, 128, 0x10000, small_smem), "D=128 does not fit 64 KiB of shared memory");
  // project_features: the GEMV at T <= kGemvMaxRows, cuBLAS (false) otherwise
  for (const DeviceLimits& dev : {h200, tiny})
    for (int T : {1, 8, 9, 16, 17, 2000})
      for (int H : {64, 576, 4096})
        for (int k : {1, 5, 16}) {
          ProjectFeaturesParams p{};
          for (int j = 0; j < k; ++j) p.features[j] = fake_ptr(0x20000 + 0x1000 * j);
          p.fc_weight = fake_ptr(0x10000);
          p.k = k; p.T = T; p.H = H; p.H_out = H; p.dtype = DType::kBFloat16;
          const bool gemv = project_features_plan(p, dev);
          CHECK(gemv == (T <= kGemvMaxRows), "project bf16 T=%d H=%d: GEMV %d", T, H, int(gemv));
          if (!gemv) continue;
          const GemvSchedule& g = p.gemv;
          CHECK(g.ctas >= 1 && g.ctas <= dev.num_sms, "project GEMV grid %d on %d SMs (one wave)", g.ctas, dev.num_sms);
          CHECK(g.row_blocks * kGemvRowBlock >= H && (g.row_blocks - 1) * kGemvRowBlock < H, "row blocks %d", g.row_blocks);
          CHECK(g.k_steps * kGemvStepK >= k * H && (g.k_steps - 1) * kGemvStepK < k * H, "k steps %d", g.k_steps);
          CHECK(g.blocks_per_group == g.row_blocks, "project: one epilogue group, got %d of %d blocks",
                g.blocks_per_group, g.row_blocks);
          CHECK(g.counter_count == g.row_blocks + 1, "project counters %lld", (long long)g.counter_count);
          CHECK(g.y_offset == int64_t(g.ctas + g.row_blocks) * kGemvRowBlock * T && g.y_offset % 4 == 0 &&
                g.ss_offset == g.y_offset + int64_t(T) * g.row_blocks * kGemvRowBlock &&
                g.workspace_floats == g.ss_offset + int64_t(g.row_blocks) * T, "project workspace layout");
        }
  ProjectFeaturesParams p{};
  p.features[0] = fake_ptr(0x20000); p.features[1] = fake_ptr(0x30008);
  p.fc_weight = fake_ptr(0x10000); p.k = 2; p.T = 4; p.H = 64; p.H_out = 64; p.dtype = DType::kBFloat16;
  CHECK(!project_features_plan(p, h200), "an unaligned feature must take the cuBLAS path");
  p.features[1] = fake_ptr(0x30000); p.H = 100;
  CHECK(!project_features_plan(p, h200), "H %% 8 != 0 must take the cuBLAS path");
  p.H = 64; p.dtype = DType::kFloat32;
  CHECK(!project_features_plan(p, h200), "fp32 must take the cuBLAS path");
  // inject_context_kv: path choice and schedules
  InjectParams q{};
  q.ctx = q.k_weight = q.v_weight = fake_ptr(0x10000);
  q.T = 16; q.H = 4096; q.N = 5; q.Hkv = 8; q.D = 128; q.dtype = DType::kBFloat16;
  CHECK(inject_context_kv_plan(q, h200) && q.path == int(GemmPath::kGemv), "inject bf16 D=128 T=16 takes the GEMV");
  for (const DeviceLimits& dev : {h200, tiny})
    for (int T : {1, 16, 17, 4096})
      for (int H : {576, 4096})
        for (int D : {64, 128}) {
          q.T = T; q.H = H; q.D = D;
          CHECK(inject_context_kv_plan(q, dev), "inject bf16 H=%d should take tensor cores", H);
          if (T <= kGemvMaxRows) {
            CHECK(q.path == int(GemmPath::kGemv) && q.splits == 1, "inject T=%d: path %d", T, q.path);
            CHECK(q.gemv.ctas >= 1 && q.gemv.ctas <= dev.num_sms, "inject GEMV grid %d", q.gemv.ctas);
            CHECK(q.gemv.blocks_per_group * kGemvRowBlock == D, "inject: a group is one head (%d blocks)",
                  q.gemv.blocks_per_group);
            CHECK(q.gemv.counter_count == q.gemv.row_blocks + q.N * 2 * q.Hkv, "inject counters");
            continue;
          }
          CHECK(q.path == int(GemmPath::kTensorCores), "inject T=%d: path %d", T, q.path);
          const int k_tiles = (H + kGemmBK - 1) / kGemmBK;
          CHECK(q.splits >= 1 && q.splits * q.k_tiles_per_split >= k_tiles &&
                (q.splits - 1) * q.k_tiles_per_split < k_tiles, "inject split-K %d x %d over %d tiles", q.splits,
                q.k_tiles_per_split, k_tiles);
          const int64_t ctas = int64_t((T + kGemmBM - 1) / kGemmBM) * q.N * 2 * q.Hkv;
          CHECK(q.splits == 1 || ctas * q.splits <= dev.num_sms, "inject split grid %lld x %d past one wave",
                (long long)ctas, q.splits);
        }
  q.T = 16; q.H = 4096;
  q.D = 96;
  CHECK(!inject_context_kv_plan(q, h200) && q.path == int(GemmPath::kSimt), "inject D=96 must take the SIMT path");
  q.D = 64; q.H = 100;
  CHECK(!inject_context_kv_plan(q, h200), "inject H %% 8 != 0 must take the SIMT path");
  std::printf("checked plans\n");
}

// The GEMV's stream-K schedule as the kernel walks it (weight_stream_gemv.cuh): every
// (row block, K step) is streamed by exactly one CTA, no CTA is empty, the partial slot
// c + rb of each (CTA, row block) pair is unique and inside the workspace, and the
// contributor range of each row block (stream_cta_of) is exactly the CTAs that touch it.
void check_gemv_schedules() {
  const DeviceLimits h200{132, 227 * 1024}, tiny{4, 227 * 1024};
  for (const DeviceLimits& dev : {h200, tiny})
    for (int T : {1, 16})
      for (int64_t rows : {int64_t(40), int64_t(576), int64_t(4096), int64_t(10240)})
        for (int64_t K : {int64_t(8), int64_t(576), int64_t(5 * 4096)})
          for (int64_t group : {int64_t(64), int64_t(128), rows}) {
            const GemvSchedule s = gemv_schedule(T, rows, K, group, dev, 2);
            const int64_t steps = int64_t(s.row_blocks) * s.k_steps;
            CHECK(s.ctas >= 1 && s.ctas <= 2 * dev.num_sms && s.ctas <= steps, "%d CTAs for %lld steps", s.ctas,
                  (long long)steps);
            std::vector<int> slot_used(s.ctas + s.row_blocks, 0);
            std::vector<int64_t> first(s.row_blocks, -1), last(s.row_blocks, -1);
            int64_t covered = 0;
            for (int64_t c = 0; c < s.ctas; ++c) {
              const int64_t begin = c * steps / s.ctas, end = (c + 1) * steps / s.ctas;
              CHECK(begin == covered && end > begin, "CTA %lld covers [%lld, %lld)", (long long)c, (long long)begin,
                    (long long)end);
              covered = end;
              for (int64_t seg = begin; seg < end;) {
                const int64_t rb = seg / s.k_steps;
                seg = std::min<int64_t>(end, (rb + 1) * s.k_steps);
                CHECK(c + rb < int64_t(slot_used.size()) && ++slot_used[c + rb] == 1, "slot %lld reused",
                      (long long)(c + rb));
                if (first[rb] < 0) first[rb] = c;
                last[rb] = c;
              }
            }
            CHECK(covered == steps, "%lld of %lld steps covered", (long long)covered, (long long)steps);
            for (int64_t rb = 0; rb < s.row_blocks; ++rb)
              CHECK(first[rb] == stream_cta_of(rb * s.k_steps, steps, s.ctas) &&
                    last[rb] == stream_cta_of((rb + 1) * s.k_steps - 1, steps, s.ctas),
                    "row block %lld: CTAs %lld..%lld", (long long)rb, (long long)first[rb], (long long)last[rb]);
            CHECK(int64_t(s.ctas + s.row_blocks) * kGemvRowBlock * T == s.y_offset, "partials size");
          }
  std::printf("checked gemv schedules\n");
}

int main() {
  check_plans();
  check_gemv_schedules();
  using T = cutlass::bfloat16_t;
  check_gemm<TileGemm<T, kGemmBM, 64, kGemmBK, false, kGemmWarpsM>, kGemmBM, 64, kGemmBK, false>("inject D=64");
  check_gemm<TileGemm<T, kGemmBM, 128, kGemmBK, false, kGemmWarpsM>, kGemmBM, 128, kGemmBK, false>("inject D=128");
  check_gemm<TileGemm<T, kAttnBM, kAttnBN, 64, false>, kAttnBM, kAttnBN, 64, false>("attention QK D=64");
  check_gemm<TileGemm<T, kAttnBM, kAttnBN, 128, false>, kAttnBM, kAttnBN, 128, false>("attention QK D=128");
  check_gemm<TileGemm<T, kAttnBM, 64, kAttnBN, true>, kAttnBM, 64, kAttnBN, true>("attention PV D=64");
  check_gemm<TileGemm<T, kAttnBM, 128, kAttnBN, true>, kAttnBM, 128, kAttnBN, true>("attention PV D=128");
  check_attention_rows<TileGemm<T, kAttnBM, kAttnBN, 64, false>, kAttnBM, kAttnBN>("attention QK D=64");
  check_attention_rows<TileGemm<T, kAttnBM, kAttnBN, 128, false>, kAttnBM, kAttnBN>("attention QK D=128");
  check_attention_rows<TileGemm<T, kAttnBM, 64, kAttnBN, true>, kAttnBM, 64>("attention PV D=64");
  check_attention_rows<TileGemm<T, kAttnBM, 128, kAttnBN, true>, kAttnBM, 128>("attention PV D=128");
  std::printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
