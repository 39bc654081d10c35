// CUDA implementations of the dflash_ext ops: input checks (shared with the CPU path),
// workspaces, and dispatch to the launchers of the device's architecture
// (kernel_arch_for in plans.h): compute capability 9.0 -> sm_90a (wgmma), 10.x -> sm_100
// (mma.sync), any other 8.x or newer -> sm_80 (mma.sync; its PTX is JIT-compiled above 8.x).
// That choice (device_info) and the dtype mapping are declared in dispatch.h and serve
// norms_cuda.cpp's ops too.
// validate=true reads the index values on the host (one small copy, a sync) for clear
// errors; validate=false reads nothing on the host, so a step can be captured in a CUDA
// graph, and the kernels' index guards (params.h) keep every access in bounds.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <utility>
#include <vector>

#include "dflash/checks.h"
#include "dflash/cuda/dispatch.h"
#include "dflash/cuda/params.h"
#include "dflash/cuda/plans.h"

namespace dflash::cuda {

#define DFLASH_ARCH_LAUNCHERS(arch)                                                            \
  ArchLaunchers{&arch::project_features_plan, &arch::project_features,                 \
                &arch::inject_context_kv_plan, &arch::inject_context_kv,                      \
                &arch::block_attention_plan, &arch::block_attention, &arch::block_conv,       \
                &arch::rms_norm, &arch::qk_norm_rope}

static void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "dflash_ext: ", what, " failed: ", cudaGetErrorString(err));
}

// Looked up once per device and returned by value (the cache may grow while another thread
// uses an entry). A kernel set not compiled in (DFLASH_CUDA_ARCHS) has no launchers to point
// to; kernel_arch_for never picks it.
DeviceInfo device_info(const at::Device& device) {
#ifdef DFLASH_CUDA_ARCH_SM80
  static const ArchLaunchers sm80 = DFLASH_ARCH_LAUNCHERS(sm80);
#else
  static const ArchLaunchers sm80{};
#endif
#ifdef DFLASH_CUDA_ARCH_SM90A
  static const ArchLaunchers sm90a = DFLASH_ARCH_LAUNCHERS(sm90a);
#else
  static const ArchLaunchers sm90a{};
#endif
#ifdef DFLASH_CUDA_ARCH_SM100
  static const ArchLaunchers sm100 = DFLASH_ARCH_LAUNCHERS(sm100);
#else
  static const ArchLaunchers sm100{};
#endif
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache;
  const int index = device.index();
  std::lock_guard<std::mutex> lock(mutex);
  if (index >= static_cast<int>(cache.size())) cache.resize(index + 1, DeviceInfo{nullptr, {0, 0}});
  DeviceInfo& info = cache[index];
  if (info.launchers == nullptr) {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index), "reading the compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index), "reading the compute capability");
    check_cuda(cudaDeviceGetAttribute(&info.limits.num_sms, cudaDevAttrMultiProcessorCount, index), "reading the SM count");
    check_cuda(cudaDeviceGetAttribute(&info.limits.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, index),
               "reading the shared memory limit");
    TORCH_CHECK(major >= 8, "dflash_ext CUDA kernels need compute capability 8.0 or newer (Ampere+); ",
                device, " has ", major, ".", minor);
    const KernelArch arch = kernel_arch_for(major, minor, compiled_kernel_archs());
    TORCH_CHECK(arch != KernelArch::kNone, "dflash_ext was built without kernels for ", device, " (compute capability ",
                major, ".", minor, "): rebuild with DFLASH_CUDA_ARCHS including sm80 (runs on every 8.0+ GPU) or "
                "this GPU's own set (python -m dflash_ext info lists what was built)");
    info.launchers = arch == KernelArch::kSm90a ? &sm90a : arch == KernelArch::kSm100 ? &sm100 : &sm80;
  }
  return info;
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

namespace {

// The kernels index with 32-bit sizes.
int32_t narrow(int64_t value, const char* what) {
  TORCH_CHECK(value <= INT32_MAX, "dflash_ext CUDA kernels take ", what, " up to 2^31 - 1, got ", value);
  return static_cast<int32_t>(value);
}

// The cuBLAS path of project_features (project_features_path in plans.h: prefill-sized T,
// fp32, inputs the GEMV does not take): at::mm with an fp32 result (16-bit inputs: the
// same numerics as the kernel, fp32 sums normed in fp32), then at::rms_norm.
at::Tensor project_features_library(at::TensorList features, const at::Tensor& fc_weight,
                                    const at::Tensor& norm_weight, double eps) {
  const auto x = features.size() == 1 ? features[0] : at::cat(features, 1);
  const auto y = x.scalar_type() == at::kFloat ? at::mm(x, fc_weight.t()) : at::mm(x, fc_weight.t(), at::kFloat);
  return at::rms_norm(y, {y.size(1)}, norm_weight.to(at::kFloat), eps).to(x.scalar_type());
}

// The fp32 workspace and zeroed counters of a GEMV schedule, bound into it (returned: they
// must outlive the launch).
std::pair<at::Tensor, at::Tensor> gemv_workspace(GemvSchedule& s, const at::TensorOptions& options) {
  auto workspace = at::empty({s.workspace_floats}, options.dtype(at::kFloat));
  auto counters = at::zeros({s.counter_count}, options.dtype(at::kInt));
  bind_gemv_workspace(s, workspace.data_ptr<float>(), counters.data_ptr<int>());
  return {workspace, counters};
}

at::Tensor project_features_cuda(at::TensorList features, const at::Tensor& fc_weight,
                                 const at::Tensor& norm_weight, double eps) {
  const auto dims = check_project_features(features, fc_weight, norm_weight, eps);
  const c10::cuda::CUDAGuard guard(features[0].device());
  auto out = at::empty({dims.T, dims.H_out}, features[0].options());
  if (out.numel() == 0) return out;
  if (dims.T > kGemvMaxRows) return project_features_library(features, fc_weight, norm_weight, eps);
  std::vector<at::Tensor> feats;
  for (const auto& f : features) feats.push_back(f.contiguous());
  if (static_cast<int>(feats.size()) > kMaxFeatures) feats = {at::cat(feats, 1)};  // rare: many layers
  const auto weight = fc_weight.contiguous(), norm = norm_weight.contiguous();
  const auto info = device_info(out.device());
  ProjectFeaturesParams p{};
  for (size_t j = 0; j < feats.size(); ++j) p.features[j] = feats[j].data_ptr();
  p.k = static_cast<int>(feats.size());
  p.T = static_cast<int>(dims.T);
  p.H = narrow(feats[0].size(1), "H");
  p.H_out = narrow(dims.H_out, "H_out");
  narrow(p.k * static_cast<int64_t>(p.H), "k * H");
  p.fc_weight = weight.data_ptr();
  p.norm_weight = norm.data_ptr();
  p.out = out.data_ptr();
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(out);
  if (!info.launchers->project_features_plan(p, info.limits))
    return project_features_library(features, fc_weight, norm_weight, eps);
  const auto workspace = gemv_workspace(p.gemv, out.options());
  info.launchers->project_features(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

void inject_context_kv_cuda(const at::Tensor& ctx, const at::Tensor& k_weight,
                            const at::Tensor& v_weight, const at::Tensor& k_norm_weight,
                            const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& positions, const at::Tensor& slots,
                            at::Tensor& k_cache, at::Tensor& v_cache, double eps, bool validate) {
  const auto d = check_inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin,
                                         positions, slots, k_cache, v_cache, eps);
  TORCH_CHECK(d.D <= kInjectMaxHeadDim, "inject_context_kv on CUDA takes head dims up to ", kInjectMaxHeadDim,
              ", got D=", d.D);
  // validate: a bad slot is an error, not a skipped row (one small host copy).
  if (validate) check_inject_indices(positions.cpu(), slots.cpu(), d.P, d.S);
  if (d.T == 0 || d.N == 0 || d.Hkv == 0 || d.D == 0) return;
  const c10::cuda::CUDAGuard guard(ctx.device());
  const auto x = ctx.contiguous(), kw = k_weight.contiguous(), vw = v_weight.contiguous();
  const auto kn = k_norm_weight.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const auto pos = positions.contiguous(), sl = slots.contiguous();
  InjectParams p{};
  p.ctx = x.data_ptr();
  p.k_weight = kw.data_ptr();
  p.v_weight = vw.data_ptr();
  p.k_norm_weight = kn.data_ptr();
  p.cos = c.data_ptr();
  p.sin = s.data_ptr();
  p.positions = pos.data_ptr<int64_t>();
  p.slots = sl.data_ptr<int64_t>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.T = narrow(d.T, "T");
  p.H = narrow(d.H, "H");
  p.N = narrow(d.N, "N");
  p.Hkv = narrow(d.Hkv, "Hkv");
  p.D = narrow(d.D, "D");
  p.S = d.S;
  p.P = d.P;
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(ctx);
  const auto info = device_info(ctx.device());
  info.launchers->inject_context_kv_plan(p, info.limits);
  at::Tensor workspace;
  std::pair<at::Tensor, at::Tensor> gemv;
  if (p.path == static_cast<int>(GemmPath::kGemv)) gemv = gemv_workspace(p.gemv, ctx.options());
  if (p.splits > 1) {
    workspace = at::empty({p.splits, d.N * 2 * d.Hkv, d.T, d.D}, ctx.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  info.launchers->inject_context_kv(p, c10::cuda::getCurrentCUDAStream());
}

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
  const bool tensor_cores = info.launchers->block_attention_plan(p, info.limits);
  TORCH_CHECK(tensor_cores || d.D <= kSimtMaxHeadDim, "block_attention on CUDA takes head dims up to ",
              kSimtMaxHeadDim, " (64 and 128 in bf16/fp16 on tensor cores), got D=", d.D);
  at::Tensor partial_out, partial_lse;
  if (p.splits > 1) {  // merged by the combine launch (no zeroing: every split writes its LSEs)
    partial_out = at::empty({p.splits, d.Bsz, d.Bq, d.Hq, d.D}, q.options().dtype(at::kFloat));
    partial_lse = at::empty({p.splits, d.Bsz, d.Bq, d.Hq}, q.options().dtype(at::kFloat));
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  info.launchers->block_attention(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor block_conv_cuda(const at::Tensor& x, const at::Tensor& base, const at::Tensor& delta) {
  const auto d = check_block_conv(x, base, delta);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous(), bc = base.contiguous(), dc = delta.contiguous();
  auto out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  BlockConvParams p{};
  p.x = xc.data_ptr();
  p.base = bc.data_ptr();
  p.delta = dc.data_ptr();
  p.out = out.data_ptr();
  p.M = d.M;
  p.B = narrow(d.B, "B");
  p.H = narrow(d.H, "H");
  p.T = narrow(d.T, "T");
  p.G = narrow(d.G, "G");
  narrow(d.M * d.B, "M * B");  // one CTA per row: the grid's x dimension
  p.dtype = dtype_of(out);
  device_info(x.device()).launchers->block_conv(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace
}  // namespace dflash::cuda

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("project_features", &dflash::cuda::project_features_cuda);
  m.impl("inject_context_kv", &dflash::cuda::inject_context_kv_cuda);
  m.impl("block_attention", &dflash::cuda::block_attention_cuda);
  m.impl("block_conv", &dflash::cuda::block_conv_cuda);
}
