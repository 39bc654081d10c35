// The Python module dflash_ext._C. Importing it loads this library and so runs the op
// registrations (ops.cpp, cpu/, cuda/); the module itself holds only test hooks: the CPU
// GEMM backend, the CPU run-time dispatch (cpu/isa.h) and the CUDA launch-plan rules
// (dflash/cuda/plans.h, pure host code). The one file of the extension that sees Python.h.
#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <string>
#include <utility>

#include "cpu/cpu_utils.h"
#include "cpu/isa.h"
#include "dflash/cuda/plans.h"

namespace {

namespace cpu = dflash::cpu;

PyObject* py_set_blas_fallback(PyObject*, PyObject* arg) {
  const int enable = PyObject_IsTrue(arg);
  if (enable < 0) return nullptr;
  return PyBool_FromLong(cpu::set_blas_fallback(enable != 0));
}

// A c10::Error (a bad level, here or in DFLASH_CPU_ISA) becomes a Python ValueError.
template <typename F>
PyObject* raising_value_error(F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

PyObject* py_cpu_isa(PyObject*, PyObject*) {
  return raising_value_error(
      [] { return Py_BuildValue("(ss)", cpu::isa_name(cpu::detected_isa()), cpu::isa_name(cpu::active_isa())); });
}

PyObject* py_set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  return raising_value_error(
      [&] { return PyUnicode_FromString(cpu::isa_name(cpu::set_active_isa(cpu::parse_isa(name)))); });
}

at::ScalarType dtype_named(const char* name) {
  const std::string d(name);
  return d == "float32" ? at::kFloat : d == "bfloat16" ? at::kBFloat16 : at::kHalf;
}

PyObject* py_cpu_gemm_path(PyObject*, PyObject* args) {
  const char* dtype = nullptr;
  long long rows = 0, weight_bytes = 0;
  if (!PyArg_ParseTuple(args, "sLL", &dtype, &rows, &weight_bytes)) return nullptr;
  return PyUnicode_FromString(cpu::path_name(cpu::gemm_path(dtype_named(dtype), rows, weight_bytes)));
}

PyObject* py_cpu_skinny_linear_path(PyObject*, PyObject* args) {
  const char* dtype = nullptr;
  long long rows = 0, weight_bytes = 0;
  if (!PyArg_ParseTuple(args, "sLL", &dtype, &rows, &weight_bytes)) return nullptr;
  return PyUnicode_FromString(cpu::skinny_linear_streams(dtype_named(dtype), rows, weight_bytes) ? "stream"
                                                                                                   : "library");
}

PyObject* py_cpu_attention_path(PyObject*, PyObject* args) {
  const char* dtype = nullptr;
  long long keys = 0, rows = 0;
  if (!PyArg_ParseTuple(args, "sLL", &dtype, &keys, &rows)) return nullptr;
  return PyUnicode_FromString(cpu::path_name(cpu::attention_path(dtype_named(dtype), keys, rows)));
}

PyObject* plan_tuple(dflash::cuda::SplitPlan plan) { return Py_BuildValue("(ii)", plan.splits, plan.units_per_split); }

PyObject* py_cuda_plan(PyObject*, PyObject* args) {
  const char* rule = nullptr;
  long long a = 0, b = 0, c = 0, d = 0, e = 0;
  if (!PyArg_ParseTuple(args, "sL|LLLL", &rule, &a, &b, &c, &d, &e)) return nullptr;
  namespace dc = dflash::cuda;
  const std::string name(rule);
  if (name == "split") return plan_tuple(dc::split_plan(a, b, c, d, e));
  if (name == "attention") return plan_tuple(dc::attention_split_plan(a, b, static_cast<int>(c), d, e));
  if (name == "gemm") return plan_tuple(dc::gemm_split_plan(a, b, c));
  if (name == "planned_context") return PyLong_FromLongLong(dc::planned_context(a, b, c));
  if (name == "gemv") {  // (T, rows, K, rows_per_group, wave)
    const auto g = dc::gemv_plan(a, b, c, d, e);
    return Py_BuildValue("(LLLLLL)", static_cast<long long>(g.ctas), static_cast<long long>(g.row_blocks),
                         static_cast<long long>(g.k_steps), static_cast<long long>(g.groups),
                         static_cast<long long>(g.partial_floats), static_cast<long long>(g.counters));
  }
  if (name == "stream_cta") return PyLong_FromLongLong(dc::stream_cta_of(a, b, c));
  if (name == "project_path") return PyLong_FromLong(static_cast<long>(dc::project_features_path(a != 0, b)));
  if (name == "inject_path") return PyLong_FromLong(static_cast<long>(dc::inject_context_kv_path(a != 0, b)));
  if (name == "kernel_arch") {  // (major, minor[, compiled bit set: default this build's])
    const unsigned compiled = PyTuple_Size(args) > 3 ? static_cast<unsigned>(c) : dc::compiled_kernel_archs();
    return PyLong_FromLong(static_cast<long>(dc::kernel_arch_for(static_cast<int>(a), static_cast<int>(b), compiled)));
  }
  PyErr_Format(PyExc_ValueError, "unknown plan rule %s", rule);
  return nullptr;
}

// The torch this extension was compiled against (it loads only with that minor version).
PyObject* py_torch_version(PyObject*, PyObject*) {
  return Py_BuildValue("(iii)", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

PyObject* py_cuda_archs(PyObject*, PyObject*) {
  namespace dc = dflash::cuda;
  const unsigned compiled = dc::compiled_kernel_archs();
  std::string names;  // the names of the set bits, lowest first
  for (const auto& [arch, name] : {std::pair{dc::KernelArch::kSm80, "sm80"}, std::pair{dc::KernelArch::kSm90a, "sm90a"},
                                   std::pair{dc::KernelArch::kSm100, "sm100"}}) {
    if (compiled & dc::arch_bit(arch)) names += std::string(names.empty() ? "" : " ") + name;
  }
  // Split in Python's own terms: a tuple of str.
  PyObject* text = PyUnicode_FromString(names.c_str());
  if (text == nullptr) return nullptr;
  PyObject* list = PyUnicode_Split(text, nullptr, -1);
  Py_DECREF(text);
  if (list == nullptr) return nullptr;
  PyObject* tuple = PyList_AsTuple(list);
  Py_DECREF(list);
  return tuple;
}

PyMethodDef module_methods[] = {
    {"_cuda_plan", py_cuda_plan, METH_VARARGS,
     "(rule, ints...) -> a CUDA launch-plan rule evaluated on the host: split(ctas, units, min_units, max_splits, "
     "wave), attention(ctas, max_keys, key_tile, num_sms, ctas_per_sm), gemm(ctas, k_tiles, wave) -> (splits, units per split); "
     "planned_context(max_context, window, S); gemv(T, rows, K, rows_per_group, wave) -> (ctas, row_blocks, k_steps, "
     "groups, partial floats, counters); stream_cta(step, steps, ctas); project_path / inject_path(tensor-core "
     "inputs, T) -> 0 library, 1 GEMV, 2 tensor cores, 3 SIMT; kernel_arch(major, minor[, compiled bits: 1 sm80, 2 sm90a, 4 sm100; "
     "default this build's]) -> 0, 80, 90 or 100."},
    {"_torch_version", py_torch_version, METH_NOARGS, "(major, minor, patch) of the torch the extension was built with."},
    {"_cuda_archs", py_cuda_archs, METH_NOARGS,
     "The CUDA kernel sets compiled into this extension, e.g. ('sm80', 'sm90a', 'sm100'); () in a CPU-only build."},
    {"_set_blas_fallback", py_set_blas_fallback, METH_O,
     "Route the CPU kernels' fp32 GEMMs through at::mm instead of BLAS (tests); returns the old setting."},
    {"_cpu_isa", py_cpu_isa, METH_NOARGS,
     "(detected, active): the CPU ISA levels of the run-time dispatch."},
    {"_set_cpu_isa", py_set_cpu_isa, METH_O,
     "Force the CPU ISA level ('auto' = detected); returns the previous level."},
    {"_cpu_gemm_path", py_cpu_gemm_path, METH_VARARGS,
     "(dtype name, rows, weight bytes) -> the GEMM path project_features / inject_context_kv take now."},
    {"_cpu_skinny_linear_path", py_cpu_skinny_linear_path, METH_VARARGS,
     "(dtype name, rows, weight bytes) -> 'stream' or 'library': what skinny_linear runs now."},
    {"_cpu_attention_path", py_cpu_attention_path, METH_VARARGS,
     "(dtype name, keys, query rows per KV head) -> the path block_attention takes now."},
    {nullptr, nullptr, 0, nullptr}};

struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
