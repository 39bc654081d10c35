"""The build description (setup.py): every source compiled, the CUDA op families and their
generated per-architecture sources, the sdist that builds from what it holds, the CMake build
that reads its sources and flags from setup.py; and the CPU feature check that refuses CPUs
the kernels were not compiled for."""
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from dflash_ext.ops.hardware import require_cpu_features
from python_tests.helpers import ROOT, load_setup_module




def test_build_description_lists_every_kernel_source():
    setup = load_setup_module()
    d = setup.build_description()
    for pattern_dir in ("csrc", os.path.join("csrc", "cpu")):
        for name in os.listdir(os.path.join(ROOT, pattern_dir)):
            if name.endswith(".cpp"):
                assert os.path.join(pattern_dir, name) in d["sources"]
    cuda_dir = os.path.join("csrc", "cuda")
    for name in os.listdir(os.path.join(ROOT, cuda_dir)):
        assert name.endswith(".cpp"), f"{cuda_dir}/{name}: the .cu sources are generated (setup.py), not kept here"
        assert (os.path.join(cuda_dir, name) in d["sources"]) == d["use_cuda"], name
    # one generated source per op family and chosen architecture, and no other
    expected = [setup.cuda_source(f, a) for f in setup.CUDA_OP_FAMILIES for a in setup.selected_cuda_archs()]
    assert d["cuda_sources"] == (expected if d["use_cuda"] else [])


def test_every_cuda_op_family_has_its_host_file_params_header_and_kernels():
    """An op family is a row of setup.py's CUDA_OP_FAMILIES and three files, which name each
    other: csrc/cuda/<family>.cpp (host side: its ArchTable), dflash/cuda/<family>_params.h
    (parameter blocks, its launcher table declared per architecture) and <family>.cuh (the
    kernels, the launcher table defined); no file of one kind without the others."""
    setup = load_setup_module()
    include = os.path.join(ROOT, "csrc", "include", "dflash", "cuda")
    hosts = {n[:-4] for n in os.listdir(os.path.join(ROOT, "csrc", "cuda"))} - {"dispatch"}
    params = {n[: -len("_params.h")] for n in os.listdir(include) if n.endswith("_params.h")}
    assert hosts == params == set(setup.CUDA_OP_FAMILIES)
    for family in setup.CUDA_OP_FAMILIES:
        host = open(os.path.join(ROOT, "csrc", "cuda", f"{family}.cpp")).read()
        header = open(os.path.join(include, f"{family}_params.h")).read()
        kernels = open(os.path.join(include, f"{family}.cuh")).read()
        table = f"{family}_launchers"
        assert re.search(rf"DFLASH_DECLARE_ARCH_LAUNCHERS\(\w+, {table}\)", header), family
        assert re.search(rf"extern const \w+ {table}\{{", kernels), family
        assert f"DFLASH_ARCH_TABLE({table})" in host and f'#include "dflash/cuda/{family}_params.h"' in host, family
        assert f'#include "dflash/cuda/{family}_params.h"' in kernels, family


def test_cuda_archs_pick_the_sources_and_the_dispatch(monkeypatch):
    setup = load_setup_module()
    monkeypatch.delenv("DFLASH_CUDA_ARCHS", raising=False)
    assert setup.selected_cuda_archs() == list(setup.CUDA_ARCH_GENCODE)
    monkeypatch.setenv("DFLASH_CUDA_ARCHS", "sm100, sm80")
    assert setup.selected_cuda_archs() == ["sm80", "sm100"]  # in CUDA_ARCH_GENCODE's order
    monkeypatch.setenv("DFLASH_CUDA_ARCHS", "sm90")
    with pytest.raises(ValueError, match="unknown architecture"):
        setup.selected_cuda_archs()
    if setup._nvcc() is None:
        pytest.skip("no CUDA build here: the source list and the defines are checked where there is one")
    monkeypatch.setenv("DFLASH_CUDA_ARCHS", "sm90a")
    d = setup.build_description()
    assert d["cuda_sources"] and all(s.endswith("_sm90a.cu") for s in d["cuda_sources"])
    assert "-DDFLASH_CUDA_ARCH_SM90A" in d["cxx_flags"] and "-DDFLASH_CUDA_ARCH_SM80" not in d["cxx_flags"]


def test_builds_keep_their_objects_per_kind():
    setup = load_setup_module()
    # pip install -e would compile in a fresh temporary folder: ours outlives it, one per kind
    assert setup.object_dir(True) != setup.object_dir(False)
    assert all(p.startswith(os.path.join(ROOT, "build")) for p in (setup.object_dir(True), setup.object_dir(False)))


def test_generated_cuda_sources_compile_one_family_for_one_architecture(tmp_path):
    setup = load_setup_module()
    sources = [setup.cuda_source(f, a) for f in setup.CUDA_OP_FAMILIES for a in setup.CUDA_ARCH_GENCODE]
    setup.write_cuda_sources(sources, root=str(tmp_path))
    for source in sources:
        family, arch = setup.cuda_family_and_arch(source)
        assert setup.cuda_arch_of(source) == arch and source.endswith(f"{family}_{arch}.cu")
        lines = (tmp_path / source).read_text().splitlines()
        assert f"#define DFLASH_ARCH_NS {arch}" in lines
        assert f"#define DFLASH_USE_WGMMA {int(arch == 'sm90a')}" in lines  # wgmma: sm_90a only
        assert lines[-1] == f'#include "dflash/cuda/{family}.cuh"'
    # a file already right is not rewritten (ninja would recompile it), a wrong one is
    first, second = (tmp_path / sources[0]), (tmp_path / sources[1])
    os.utime(first, (1, 1))
    second.write_text("stale")
    setup.write_cuda_sources(sources, root=str(tmp_path))
    assert first.stat().st_mtime == 1 and second.read_text() == setup.cuda_source_text(
        *setup.cuda_family_and_arch(sources[1]))
    for bad in ("csrc/cuda/attention.cu", "build/cuda_sources/attention_sm80.cu", "build/cuda_sources/norms_sm90.cu"):
        with pytest.raises(ValueError, match="<family>_<arch>.cu"):
            setup.cuda_family_and_arch(bad)
    assert setup.CUDA_ARCH_GENCODE["sm90a"] == ["-gencode", "arch=compute_90a,code=sm_90a"]


def test_sdist_holds_what_a_build_reads_and_regenerates_the_cuda_sources(tmp_path):
    """The sdist (tools/ci/wheel_check.sh builds the CPU wheel from it) carries every file
    under csrc/ and the build files, and no .cu file: a CUDA build from it writes them from
    setup.py's table, as describe-cmake does here in the unpacked tree."""
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    (sdist,) = glob.glob(str(tmp_path / "dflash_ext-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    held = {os.path.relpath(os.path.join(d, n), unpacked) for d, _, names in os.walk(unpacked) for n in names}
    csrc = {os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(os.path.join(ROOT, "csrc")) for n in names}
    missing = (csrc | {"setup.py", "pyproject.toml", "CMakeLists.txt", "MANIFEST.in"}) - held
    assert not missing, f"the sdist lacks {sorted(missing)}"
    assert not [n for n in held if n.endswith(".cu")]
    setup = load_setup_module()
    if setup._nvcc() is None:
        return  # a CPU build compiles no .cu file
    subprocess.run([sys.executable, "setup.py", "describe-cmake", str(tmp_path / "dflash_build.cmake")], cwd=unpacked,
                   check=True, capture_output=True)
    for source in setup.build_description()["cuda_sources"]:
        family, _ = setup.cuda_family_and_arch(source)
        assert (unpacked / source).read_text() == setup.cuda_source_text(*setup.cuda_family_and_arch(source))
        assert (unpacked / "csrc" / "include" / "dflash" / "cuda" / f"{family}.cuh").exists()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_configure_uses_setup_py_description(tmp_path):
    subprocess.run(["cmake", "-S", ROOT, "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
                   check=True, capture_output=True)
    generated = (tmp_path / "dflash_build.cmake").read_text()
    d = load_setup_module().build_description()
    sources = " ".join(f'"{os.path.join(ROOT, s)}"' for s in d["sources"])
    assert f"set(DFLASH_SOURCES {sources})" in generated
    flags = " ".join(f'"{f}"' for f in d["cxx_flags"])
    assert f"set(DFLASH_CXX_FLAGS {flags})" in generated
    for source in d["cuda_sources"]:  # one -gencode per .cu file, as setup.py compiles it
        arch = load_setup_module().cuda_arch_of(source)
        assert f'set_source_files_properties("{os.path.join(ROOT, source)}" PROPERTIES COMPILE_OPTIONS ' \
               f'"-gencode;{load_setup_module().CUDA_ARCH_GENCODE[arch][1]}")' in generated


def test_cpu_without_avx2_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx\n")
    with pytest.raises(ImportError, match="avx2"):
        require_cpu_features(str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c\n")
    require_cpu_features(str(cpuinfo))
