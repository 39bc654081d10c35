#include "isa.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace dflash::cpu {
namespace {

bool has(const std::unordered_map<std::string, c10::IValue>& caps, const char* name) {
  const auto it = caps.find(name);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

Isa detect() {
  const auto caps = at::cpu::get_cpu_capabilities();
  Isa level = Isa::avx2;  // the build's baseline (checked at import)
  if (has(caps, "avx512_f") && has(caps, "avx512_bw") && has(caps, "avx512_vl") && has(caps, "avx512_dq"))
    level = Isa::avx512;
  if (level == Isa::avx512 && has(caps, "avx512_bf16")) level = Isa::avx512_bf16;
  // AMX tiles also need the OS to grant the tile state (what init_amx asks for).
  if (level == Isa::avx512_bf16 && has(caps, "amx_bf16") && at::cpu::init_amx()) level = Isa::amx_bf16;
  return level;
}

std::atomic<int>& active() {
  static std::atomic<int> level{[] {
    const Isa found = detected_isa();
    const char* env = std::getenv("DFLASH_CPU_ISA");
    if (env == nullptr || *env == '\0') return static_cast<int>(found);
    const Isa forced = parse_isa(env);
    TORCH_CHECK(forced <= found, "DFLASH_CPU_ISA=", env, " is above what this CPU supports (", isa_name(found), ")");
    return static_cast<int>(forced);
  }()};
  return level;
}

}  // namespace

Isa detected_isa() {
  static const Isa level = detect();
  return level;
}

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

Isa set_active_isa(Isa level) {
  TORCH_CHECK(level <= detected_isa(), "CPU ISA level ", isa_name(level), " is above what this CPU supports (",
              isa_name(detected_isa()), ")");
  return static_cast<Isa>(active().exchange(static_cast<int>(level)));
}

const char* isa_name(Isa level) {
  switch (level) {
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx_bf16: return "amx_bf16";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  if (name == "auto") return detected_isa();
  for (Isa level : {Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16})
    if (name == isa_name(level)) return level;
  TORCH_CHECK_VALUE(false, "unknown CPU ISA level '", name, "': expected auto, avx2, avx512, avx512_bf16 or amx_bf16");
}

GemmPath gemm_path(at::ScalarType dtype, int64_t rows, int64_t weight_bytes) {
  const bool small = rows <= kStreamRows && weight_bytes <= kStreamWork / std::max<int64_t>(rows, 1);
  if (dtype == at::kBFloat16 && active_isa() >= Isa::avx512_bf16 && !small) return GemmPath::onednn;
  if (dtype == at::kFloat && rows > kStreamRows) return GemmPath::mkl;
  return GemmPath::tiles;
}

bool skinny_linear_streams(at::ScalarType dtype, int64_t rows, int64_t weight_bytes) {
  if (rows < 1 || rows > kSkinnyRows) return false;
  if (dtype == at::kBFloat16 && active_isa() >= Isa::avx512_bf16) return true;
  if (dtype == at::kFloat && active_isa() >= Isa::avx512) return true;
  return rows <= kStreamRows && gemm_path(dtype, rows, weight_bytes) == GemmPath::tiles;
}

const char* path_name(GemmPath path) {
  switch (path) {
    case GemmPath::onednn: return "onednn";
    case GemmPath::mkl: return "mkl";
    case GemmPath::tiles: return "tiles";
  }
  return "?";
}

AttentionPath attention_path(at::ScalarType dtype, int64_t keys, int64_t rows) {
  const bool bf16_units = dtype == at::kBFloat16 && active_isa() >= Isa::avx512_bf16;
  return bf16_units && (keys >= kFlashKeys || rows >= kFlashRows) ? AttentionPath::flash : AttentionPath::tiles;
}

const char* path_name(AttentionPath path) { return path == AttentionPath::flash ? "flash" : "tiles"; }

}  // namespace dflash::cpu
