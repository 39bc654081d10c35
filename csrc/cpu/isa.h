// Run-time CPU dispatch: the instruction-set level the CPU kernels pick their paths by.
// Detected once (cpuinfo, through ATen); DFLASH_CPU_ISA (read at load) or set_active_isa
// forces a lower level, so that every path can be tested and benchmarked on one machine.
#pragma once
#include <ATen/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace dflash::cpu {

// Levels, lowest first; each implies the ones below it.
enum class Isa : int { avx2 = 0, avx512 = 1, avx512_bf16 = 2, amx_bf16 = 3 };

Isa detected_isa();               // the highest level this CPU supports
Isa active_isa();                 // the level the kernels use now
Isa set_active_isa(Isa level);    // returns the previous level; refuses a level above detected
const char* isa_name(Isa level);
Isa parse_isa(const std::string& name);  // "auto" = detected; an unknown name is an error

// The GEMM path of project_features and inject_context_kv for `rows` input rows over
// `weight_bytes` of weights:
//   "onednn"  bf16 where the CPU has bf16 units: oneDNN's bf16 dot products / AMX tiles,
//             unless rows x weight_bytes <= kStreamWork (few rows of small weights, where
//             oneDNN's per-call cost, ~50 us, outweighs its dot products: our tiles win);
//   "mkl"     fp32 above kStreamRows rows: the library's blocked GEMM, threaded by itself;
//   "tiles"   our weight tiles on the threads: fp32 BLAS per tile, reduced dtypes converted
//             (streamed through fused dot products up to kStreamRows rows).
// The thresholds come from bench/RESULTS.md §1 (SmolLM2 / Qwen3-8B drafter shapes, both CPU
// kinds seen so far); they are measured, on few machines, not derived.
constexpr int64_t kStreamRows = 8;
constexpr int64_t kStreamWork = int64_t{12} << 20;  // rows x weight bytes
enum class GemmPath { onednn, mkl, tiles };
GemmPath gemm_path(at::ScalarType dtype, int64_t rows, int64_t weight_bytes);
const char* path_name(GemmPath path);

// Whether skinny_linear streams `rows` input rows over `weight_bytes` of weights through our
// kernel or calls the library's linear. bf16 on bf16 units (avx512_bf16 and up): its bf16
// dot-product kernel for 1..kSkinnyRows rows (a verify pass of up to 16 tokens), any weight:
// faster than oneDNN on every target shape measured on the EPYC-bf16, weights in DRAM or in
// cache (not measured on AMX, which takes the same rule); fp32 on AVX-512 the same for
// 1..kSkinnyRows rows (the dot kernel with FMAs from 3 rows, the AVX2 kernel below): faster
// than MKL at every SmolLM2 / Qwen3-8B shape measured up to 16 rows; otherwise the AVX2
// fp32 streaming kernel for 1..kStreamRows rows where gemm_path says tiles.
constexpr int64_t kSkinnyRows = 16;
bool skinny_linear_streams(at::ScalarType dtype, int64_t rows, int64_t weight_bytes);

// The path of block_attention for `keys` keys per sequence (context + block) and `rows`
// query rows per KV head (Bq x group): "flash" runs ATen's CPU flash attention, bf16 dot
// products / AMX tiles, for bf16 where the CPU has bf16 units; "tiles" our split-KV kernel
// (fp32 math: reduced dtypes converted per key). Flash costs two calls (~15 us each) but no
// conversion and less compute: it wins once the keys (conversion) or the query rows
// (compute) are many, at or above kFlashKeys / kFlashRows (bench/RESULTS.md §1).
constexpr int64_t kFlashKeys = 1024, kFlashRows = 32;
enum class AttentionPath { flash, tiles };
AttentionPath attention_path(at::ScalarType dtype, int64_t keys, int64_t rows);
const char* path_name(AttentionPath path);

}  // namespace dflash::cpu
