"""Build of the dflash_ext compiled extension.

This file is the one build description: `python setup.py describe-cmake FILE` writes
the same sources, include dirs and flags as CMake `set()` lines, which CMakeLists.txt
reads, so the two builds cannot drift apart.

The extension is a CUDAExtension when torch was built with CUDA and nvcc is found
(CUDA_HOME, else /usr/local/cuda), otherwise a CppExtension with the CPU kernels.
Set DFLASH_FORCE_CPU=1 to build the CPU-only extension on a CUDA machine.
DFLASH_CUDA_ARCHS (e.g. "sm90a" or "sm80,sm100"; default: all of CUDA_ARCH_GENCODE) picks
the architectures whose kernels are compiled; the extension reports them
(`dflash_ext._C._cuda_archs()`) and dispatches only to them (device_info,
csrc/cuda/dispatch.cpp).

Builds are incremental: torch's ninja build keeps its objects in build/temp-<cpu|cuda>
(also under `pip install -e`, which would otherwise compile in a fresh temporary folder
every time) and recompiles what changed, headers and flags included.

The CUDA kernels of each op family (CUDA_OP_FAMILIES) are compiled once per architecture
from a three-line source that this file writes, build/cuda_sources/<family>_<arch>.cu (not
in git, nor in the sdist: every build writes them again), with that architecture's explicit
-gencode flags: the build never asks a GPU. The .cu files are compiled by a small ninja
file of our own (torch's builder gives every .cu file the same flags) into
build/cuda_objects/, next to the `-Xptxas -v` report of each file (`<name>.ptxas.txt`, read
by the SASS/spill test), and linked into the extension. ccache is used when it is on PATH.
"""
import glob
import os
import platform
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc():
    if os.environ.get("DFLASH_FORCE_CPU") == "1":
        return None
    import torch

    if torch.version.cuda is None:
        return None
    # /usr/local/bin/nvcc may be a wrapper that makes torch guess CUDA_HOME=/usr/local.
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None
    os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    return nvcc


# -gencode flags of each architecture a .cu file can name. sm_80 also embeds PTX, which
# the driver JIT-compiles on 8.x-and-newer GPUs without their own kernels (e.g. sm_120).
CUDA_ARCH_GENCODE = {
    "sm80": ["-gencode", "arch=compute_80,code=[sm_80,compute_80]"],
    "sm90a": ["-gencode", "arch=compute_90a,code=sm_90a"],
    # Blackwell (CC 10.x: B200 10.0, B300 10.3): the plain target, whose SASS runs on every
    # 10.x GPU (sm_100a code runs on 10.0 only) -- these kernels use no 10.0-only feature.
    "sm100": ["-gencode", "arch=compute_100,code=sm_100"],
}


# The op families with CUDA kernels. Each has its host side in csrc/cuda/<family>.cpp, its
# parameter blocks and launcher table in csrc/include/dflash/cuda/<family>_params.h, and its
# kernels in csrc/include/dflash/cuda/<family>.cuh, compiled once per architecture
# (cuda_source_text); docs/ops.md, "Adding an op".
CUDA_OP_FAMILIES = ("project_features", "inject_context_kv", "block_attention", "block_conv", "norms")
# The kernel sets whose tensor-core tiles issue wgmma (DFLASH_USE_WGMMA=1, tile_gemm.cuh); the
# others use mma.sync.
WGMMA_ARCHS = ("sm90a",)
CUDA_SOURCE_DIR = os.path.join("build", "cuda_sources")  # relative to ROOT


def selected_cuda_archs():
    """The architectures to compile: DFLASH_CUDA_ARCHS (comma, semicolon or space separated
    names of CUDA_ARCH_GENCODE), all of them when unset."""
    text = os.environ.get("DFLASH_CUDA_ARCHS", "").replace(",", " ").replace(";", " ").split()
    if not text:
        return list(CUDA_ARCH_GENCODE)
    unknown = sorted(set(text) - set(CUDA_ARCH_GENCODE))
    if unknown:
        raise ValueError(f"DFLASH_CUDA_ARCHS: unknown architecture(s) {unknown}; choose from {list(CUDA_ARCH_GENCODE)}")
    return [a for a in CUDA_ARCH_GENCODE if a in text]


def cuda_source(family, arch):
    """The generated source of `family`'s kernels for `arch`, relative to ROOT."""
    return os.path.join(CUDA_SOURCE_DIR, f"{family}_{arch}.cu")


def cuda_family_and_arch(source):
    """(family, arch) of a generated source: `build/cuda_sources/norms_sm90a.cu` -> (norms, sm90a)."""
    family, _, arch = os.path.splitext(os.path.basename(source))[0].rpartition("_")
    if family not in CUDA_OP_FAMILIES or arch not in CUDA_ARCH_GENCODE:
        raise ValueError(f"{source}: not a CUDA source of setup.py's (<family>_<arch>.cu, family in "
                         f"{list(CUDA_OP_FAMILIES)}, arch in {list(CUDA_ARCH_GENCODE)})")
    return family, arch


def cuda_arch_of(source):
    """The architecture a generated .cu file is compiled for: `norms_sm90a.cu` -> sm90a."""
    return cuda_family_and_arch(source)[1]


def cuda_source_text(family, arch):
    """The source that compiles `family`'s kernels for `arch` alone: the header,
    included once in the architecture's namespace (common.cuh)."""
    return (f"// Generated by setup.py (CUDA_OP_FAMILIES): {family}'s kernels compiled for {arch} only.\n"
            f"#define DFLASH_ARCH_NS {arch}\n"
            f"#define DFLASH_USE_WGMMA {int(arch in WGMMA_ARCHS)}\n"
            f'#include "dflash/cuda/{family}.cuh"\n')


def write_cuda_sources(sources, root=ROOT):
    """Writes the generated sources (build_description's cuda_sources) under `root`; a file
    whose text is already right is left alone, so that ninja does not recompile it."""
    for source in sources:
        text = cuda_source_text(*cuda_family_and_arch(source))
        path = os.path.join(root, source)
        if os.path.exists(path) and open(path).read() == text:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def cutlass_include_dir():
    """CUTLASS/CuTe headers of the PyPI package nvidia-cutlass (installed --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the CUDA build needs the CUTLASS headers: pip install --no-deps nvidia-cutlass==4.2.0.0")
    return os.path.join(list(spec.submodule_search_locations)[0], "source", "include")


def build_description():
    """Sources, include dirs and flags of the `dflash_ext._C` extension."""
    nvcc = _nvcc()
    use_cuda = nvcc is not None
    cuda_home = os.path.dirname(os.path.dirname(nvcc)) if use_cuda else None
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp") + (rel("csrc/cuda/*.cpp") if use_cuda else [])
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wno-unknown-pragmas"]  # at::parallel_for is inlined: it needs OpenMP here
    if platform.machine() in ("x86_64", "AMD64"):
        # The CPU kernels use ATen's AVX2 vector types (x86-64-v3; checked at import).
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    cuda_sources, nvcc_flags = [], []
    if use_cuda:
        archs = selected_cuda_archs()
        cuda_sources = [cuda_source(family, arch) for family in CUDA_OP_FAMILIES for arch in archs]
        # The host code dispatches only to the kernel sets compiled in (dflash/cuda/dispatch.h).
        cxx += [f"-DDFLASH_CUDA_ARCH_{a.upper()}" for a in archs]
        include_dirs.append(os.path.join(cuda_home, "include"))
        # CUDA 13 moved the CCCL headers (cuda/std/...) that CUTLASS includes.
        include_dirs.append(os.path.join(cuda_home, "include", "cccl"))
        nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-DNDEBUG", "-Xcompiler", "-fPIC",
                      "-I" + cutlass_include_dir()]
    return {
        "name": "dflash_ext._C",
        "use_cuda": use_cuda,
        "nvcc": nvcc,
        "cuda_home": cuda_home,
        "sources": sources,
        "cuda_sources": cuda_sources,  # generated (write_cuda_sources), relative to ROOT
        "include_dirs": include_dirs,
        "cxx_flags": cxx,
        "nvcc_flags": nvcc_flags,
        "link_flags": ["-fopenmp"],
    }


CUDA_OBJECT_DIR = os.path.join(ROOT, "build", "cuda_objects")


def object_dir(use_cuda):
    """torch's ninja build folder of the C++ objects: one per kind of build, so that a CPU
    wheel build does not throw away the CUDA build's objects (and back)."""
    return os.path.join(ROOT, "build", "temp-cuda" if use_cuda else "temp-cpu")


def compile_cuda_objects(d, jobs):
    """Writes the .cu files, compiles each for its one architecture (ninja, `jobs` at a time)
    and returns the object files; each gets a `<name>.ptxas.txt` report beside it."""
    write_cuda_sources(d["cuda_sources"])
    os.makedirs(CUDA_OBJECT_DIR, exist_ok=True)
    ccache = shutil.which("ccache")
    # The host compiler itself, not a ccache masquerade link (ccache already wraps nvcc).
    plain_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if "ccache" not in p)
    host_cxx = shutil.which("g++", path=plain_path)
    includes = " ".join("-I" + i for i in d["include_dirs"])
    lines = [f"nvcc = {(ccache + ' ') if ccache else ''}{d['nvcc']}{(' -ccbin ' + host_cxx) if host_cxx else ''}",
             f"flags = {' '.join(d['nvcc_flags'])} {includes}"]
    objects = []
    for arch, gencode in CUDA_ARCH_GENCODE.items():
        lines += [f"rule nvcc_{arch}",
                  f"  command = $nvcc $flags {' '.join(gencode)} -MD -MF $out.d -Xptxas -v -c $in -o $out"
                  " > $out.ptxas.txt 2>&1 || (cat $out.ptxas.txt; exit 1)",
                  "  depfile = $out.d",  # rebuild when a kernel header changes
                  "  deps = gcc",
                  f"  description = nvcc ({arch}) $in"]
    for source in d["cuda_sources"]:
        obj = os.path.join(CUDA_OBJECT_DIR, os.path.splitext(os.path.basename(source))[0] + ".o")
        lines.append(f"build {obj}: nvcc_{cuda_arch_of(source)} {os.path.join(ROOT, source)}")
        objects.append(obj)
    with open(os.path.join(CUDA_OBJECT_DIR, "build.ninja"), "w") as f:
        f.write("\n".join(lines) + "\n")
    from ninja import BIN_DIR

    subprocess.run([os.path.join(BIN_DIR, "ninja"), "-C", CUDA_OBJECT_DIR, "-j", str(jobs)], check=True)
    return objects


def write_cmake_description(path):
    d = build_description()
    write_cuda_sources(d["cuda_sources"])
    q = lambda items: " ".join(f'"{i}"' for i in items)
    with open(path, "w") as f:
        f.write("# Generated by setup.py describe-cmake: do not edit.\n")
        f.write(f"set(DFLASH_USE_CUDA {'ON' if d['use_cuda'] else 'OFF'})\n")
        f.write(f"set(DFLASH_SOURCES {q(os.path.join(ROOT, s) for s in d['sources'])})\n")
        f.write(f"set(DFLASH_CUDA_SOURCES {q(os.path.join(ROOT, s) for s in d['cuda_sources'])})\n")
        if d["use_cuda"]:
            cuda_home = d["cuda_home"]
            f.write(f'set(CMAKE_CUDA_COMPILER "{d["nvcc"]}")\n')
            f.write(f'set(CUDA_TOOLKIT_ROOT_DIR "{cuda_home}")\nset(CUDAToolkit_ROOT "{cuda_home}")\n')
            # Torch's CMake config would otherwise probe for a GPU to pick architectures.
            f.write('set(TORCH_CUDA_ARCH_LIST "8.0;9.0a;10.0a")\n')  # unused: each .cu names its own
            # Torch's CUDA targets link NVRTC, which the pip CUDA build of torch carries.
            import sysconfig

            nvrtc = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "lib", "libnvrtc.so*")))
            if nvrtc and not glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")):
                f.write(f'set(CUDA_nvrtc_LIBRARY "{nvrtc[0]}")\n')
        for s in d["cuda_sources"]:  # one architecture per file
            flags = ";".join(CUDA_ARCH_GENCODE[cuda_arch_of(s)])
            f.write(f'set_source_files_properties("{os.path.join(ROOT, s)}" PROPERTIES COMPILE_OPTIONS "{flags}")\n')
        f.write(f"set(DFLASH_INCLUDE_DIRS {q(d['include_dirs'])})\n")
        f.write(f"set(DFLASH_CXX_FLAGS {q(d['cxx_flags'])})\n")
        f.write(f"set(DFLASH_NVCC_FLAGS {q(d['nvcc_flags'])})\n")
        f.write(f"set(DFLASH_LINK_FLAGS {q(d['link_flags'])})\n")


def extensions():
    d = build_description()  # first: it sets CUDA_HOME, which cpp_extension reads at import
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    kind = CUDAExtension if d["use_cuda"] else CppExtension
    return [kind(d["name"], d["sources"], include_dirs=d["include_dirs"],
                 extra_compile_args={"cxx": d["cxx_flags"]}, extra_link_args=d["link_flags"])]


# Loads the built library in a fresh interpreter and makes an op raise an error whose message
# formats a number. A compiler that links its own static libstdc++ into the library (seen:
# /opt/gcc/bin/g++ on a CUDA image) leaves that copy's locale uninitialised, and such a
# message then crashes the process (SIGSEGV) or loses the number ("got " for "got -1").
_ERROR_MESSAGE_PROBE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.dflash_ext.project_features([torch.ones(2, 4)], torch.ones(3, 4), torch.ones(3), -1.0)
except RuntimeError as e:
    if "got -1" not in str(e):
        sys.exit(3)  # the number went missing
else:
    raise SystemExit("project_features accepted eps=-1")
"""


def check_error_messages_survive(library):
    """Fail the build when the library crashes on its own error messages; warn when the probe
    cannot run here (e.g. a cross build)."""
    probe = subprocess.run([sys.executable, "-c", _ERROR_MESSAGE_PROBE, library], capture_output=True, text=True)
    if probe.returncode < 0 or probe.returncode == 3:
        cxx = os.environ.get("CXX", "c++")
        what = f"crashed (signal {-probe.returncode})" if probe.returncode < 0 else "lost the number"
        raise RuntimeError(
            f"{library} {what} raising an error whose message holds a number. "
            f"The C++ compiler (CXX={cxx}) most likely linked a private, static libstdc++ into it; rebuild "
            "with CXX (and CC) naming a compiler that links libstdc++ dynamically, e.g. CXX=/usr/bin/g++ "
            "CC=/usr/bin/gcc (docs/cuda.md).")
    if probe.returncode != 0:
        print(f"warning: could not check {library}'s error messages here:\n{probe.stderr[-2000:]}", file=sys.stderr)


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionWithArchObjects(BuildExtension):
        """torch's builder for the C++ sources, plus our per-architecture .cu objects."""

        def finalize_options(self):
            super().finalize_options()
            # Always hand the build to ninja, which knows what changed (setuptools would
            # skip it when the .so is newer than the .cpp files, missing a header or flag).
            self.force = True

        def build_extensions(self):
            d = build_description()
            # A folder that outlives the build (pip install -e passes a fresh temporary one).
            self.build_temp = object_dir(d["use_cuda"])
            if d["use_cuda"]:
                jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
                objects = compile_cuda_objects(d, jobs)
                for ext in self.extensions:
                    ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extensions()
            for ext in self.extensions:
                check_error_messages_survive(self.get_ext_fullpath(ext.name))

    return BuildExtensionWithArchObjects.with_options(use_ninja=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "describe-cmake":
    write_cmake_description(sys.argv[2])
    sys.exit(0)

# What the package imports besides torch (pyproject.toml lists "dependencies" as dynamic: they are
# here, beside the torch requirement that only the build knows). transformers: the range of
# dflash_ext.draft.assistant.SUPPORTED_TRANSFORMERS (python_tests/test_packaging.py checks).
RUNTIME_DEPENDENCIES = ["transformers>=5.24,<6", "safetensors", "huggingface_hub"]


def torch_requirement() -> str:
    """The wheel's torch requirement: the minor version of the torch it is compiled against
    (the extension loads only with it). pyproject's build requirement gives 2.14 to an
    isolated build; pip install --no-build-isolation builds against the environment's torch
    (vLLM's 2.13 in tools/vllm/setup_and_check.sh) and then requires that one."""
    import torch

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


if __name__ == "__main__":
    # The rest of the project's metadata (name, version, extras, package data) is in pyproject.toml.
    setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext_class()},
          install_requires=[torch_requirement(), *RUNTIME_DEPENDENCIES])
