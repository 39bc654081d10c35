// CUDA host side of block_attention: the shared input checks (and, validating, the cache
// ranges), the planned context bound, the split-KV plan and its partials, the launch.
// Kernels: dflash/cuda/block_attention.cuh.
// validate=true reads the index values on the host (one small copy, a sync) for clear
// errors; validate=false reads nothing on the host, so a step can be captured in a CUDA
// graph, and the kernels' index guards (params.h) keep every access in bounds.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/block_attention_params.h"

namespace dflash::cuda {
namespace {

constexpr ArchTable<BlockAttentionLaunchers> kLaunchers = DFLASH_ARCH_TABLE(block_attention_launchers);

at::Tensor block_attention_cuda(const at::Tensor& q, const at::Tensor& k_block,
                                const at::Tensor& v_block, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& cache_offsets,
                                const at::Tensor& cache_lens, double scale, int64_t window,
                                int64_t max_context, bool validate, bool causal, bool symmetric) {
  const auto d = check_block_attention(q, k_block, v_block, k_cache, v_cache, cache_offsets,
                                       cache_lens, scale, window, max_context, causal, symmetric);
  // The split plan covers max_context visible rows: given, it is a static bound (a graph
  // replayed over a growing context stays correct); else, validating, the longest visible
  // context read on the host; else the whole cache. (planned_context counts non-causal
  // rows, a bound for causal and symmetric too: they see one row fewer.)
  int64_t planned = planned_context(max_context, window, d.S);
  if (validate) {
    const auto offsets_cpu = cache_offsets.cpu().contiguous(), lens_cpu = cache_lens.cpu().contiguous();
    check_cache_ranges(offsets_cpu, lens_cpu, d.S, window, causal, symmetric, max_context);
    if (max_context < 0) {
      planned = 0;
      const int64_t* lens = lens_cpu.data_ptr<int64_t>();
      for (int64_t b = 0; b < d.Bsz; ++b)
        planned = std::max(planned, visible_context(lens[b], window, causal || symmetric));
    }
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.contiguous(), kb = k_block.contiguous(), vb = v_block.contiguous();
  auto out = at::empty_like(qc);
  if (out.numel() == 0) return out;
  const auto offs = cache_offsets.contiguous(), lns = cache_lens.contiguous();
  BlockAttentionParams p{};
  p.q = qc.data_ptr();
  p.k_block = kb.data_ptr();
  p.v_block = vb.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_offsets = offs.data_ptr<int64_t>();
  p.cache_lens = lns.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.Bsz = narrow(d.Bsz, "Bsz");
  p.Bq = narrow(d.Bq, "Bq");
  p.Hq = narrow(d.Hq, "Hq");
  p.Hkv = narrow(d.Hkv, "Hkv");
  p.D = narrow(d.D, "D");
  p.S = d.S;
  p.window = window;
  p.causal = causal;
  p.symmetric = symmetric;
  p.max_context = planned;
  // + one key tile of headroom: the plan rounds splits up to whole tiles in int
  p.max_keys = narrow(planned + d.Bq + 64, "context + Bq keys per sequence") - 64;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of(q);
  const auto info = device_info(q.device());
  const BlockAttentionLaunchers& kernels = kLaunchers[info.arch];
  const bool tensor_cores = kernels.plan(p, info.limits);
  TORCH_CHECK(tensor_cores || d.D <= kSimtMaxHeadDim, "block_attention on CUDA takes head dims up to ",
              kSimtMaxHeadDim, " (64 and 128 in bf16/fp16 on tensor cores), got D=", d.D);
  at::Tensor partial_out, partial_lse;
  if (p.splits > 1) {  // merged by the combine launch (no zeroing: every split writes its LSEs)
    partial_out = at::empty({p.splits, d.Bsz, d.Bq, d.Hq, d.D}, q.options().dtype(at::kFloat));
    partial_lse = at::empty({p.splits, d.Bsz, d.Bq, d.Hq}, q.options().dtype(at::kFloat));
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  kernels.launch(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("block_attention", &dflash::cuda::block_attention_cuda);
}
