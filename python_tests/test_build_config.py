"""The CMake build reads its sources and flags from setup.py, and the CPU feature
check refuses CPUs the kernels were not compiled for."""
import os
import shutil
import subprocess
import sys

import pytest

from dflash_ext.ops.hardware import require_cpu_features
from python_tests.helpers import ROOT, load_setup_module




def test_build_description_lists_every_kernel_source():
    d = load_setup_module().build_description()
    for pattern_dir in ("csrc", os.path.join("csrc", "cpu")):
        for name in os.listdir(os.path.join(ROOT, pattern_dir)):
            if name.endswith(".cpp"):
                assert os.path.join(pattern_dir, name) in d["sources"]
    cuda_dir = os.path.join("csrc", "cuda")
    archs = load_setup_module().selected_cuda_archs()
    for name in os.listdir(os.path.join(ROOT, cuda_dir)):
        listed = os.path.join(cuda_dir, name) in (d["sources"] + d["cuda_sources"])
        chosen = not name.endswith(".cu") or load_setup_module().cuda_arch_of(name) in archs
        assert listed == (d["use_cuda"] and chosen), f"{name}: built {listed}, CUDA build {d['use_cuda']}"


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


def test_each_cuda_source_names_one_architecture():
    setup = load_setup_module()
    sources = [n for n in os.listdir(os.path.join(ROOT, "csrc", "cuda")) if n.endswith(".cu")]
    assert sources
    arches = {setup.cuda_arch_of(n) for n in sources}
    assert arches == set(setup.CUDA_ARCH_GENCODE)
    with pytest.raises(ValueError, match="_<arch>.cu"):
        setup.cuda_arch_of("csrc/cuda/attention.cu")
    assert setup.CUDA_ARCH_GENCODE["sm90a"] == ["-gencode", "arch=compute_90a,code=sm_90a"]


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
