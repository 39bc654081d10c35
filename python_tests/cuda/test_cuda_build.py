"""The CUDA kernels as compiled, read without a GPU: every op family's file of every
architecture is in the extension, the sm_90a tensor-core kernels issue wgmma (HGMMA), the sm_80 / sm_100 ones
mma.sync (HMMA), the weight-streaming GEMV kernels mma.sync on every architecture with
16-byte weight loads that bypass L1, the layer norms' 16-byte loads and stores, and ptxas
reports no spills or local memory for any kernel.

These tests run wherever the extension was built with CUDA (a CUDA build of torch and
nvcc, as in CI); they skip on a CPU-only build. They check what was compiled, not what
it computes: the CUDA op tests do that on a GPU. The host checks compile
python_tests/cuda/host_checks.cu as a host program and run it (tile layouts,
accumulator coordinates, split plans)."""
import os
import re
import shutil
import subprocess
import sysconfig

import pytest

import dflash_ext._C
from python_tests.helpers import ROOT, load_setup_module




SETUP = load_setup_module()
DESCRIPTION = SETUP.build_description()
pytestmark = pytest.mark.skipif(not DESCRIPTION["use_cuda"],
                                reason="CPU-only build (no CUDA torch or no nvcc): no CUDA kernels compiled")

TC_OPS = ("inject_context_kv", "block_attention")  # project_features: the GEMV, else cuBLAS (no tile kernel)
GEMV_OPS = ("project_features", "inject_context_kv")
ARCHES = {"sm80": "sm_80", "sm90a": "sm_90a", "sm100": "sm_100"}


def _built(arch):
    """Skip where the extension was built without this kernel set (DFLASH_CUDA_ARCHS)."""
    name = {v: k for k, v in ARCHES.items()}.get(arch, arch)
    if name not in dflash_ext._C._cuda_archs():
        pytest.skip(f"built without {name} (DFLASH_CUDA_ARCHS={os.environ.get('DFLASH_CUDA_ARCHS', '')})")


def _cuobjdump():
    candidates = [shutil.which("cuobjdump"),
                  os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin", "cuobjdump")]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    pytest.fail("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (requirements.txt)")


@pytest.fixture(scope="module")
def sass():
    """{arch: {mangled kernel name: SASS text}} of the built extension."""
    tool = _cuobjdump()
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    text = subprocess.run([tool, "--dump-sass", dflash_ext._C.__file__], check=True, env=env,
                          capture_output=True, text=True).stdout
    result = {}
    for block in text.split("Fatbin elf code:")[1:]:
        arch = re.search(r"arch = (\S+)", block).group(1)
        functions = re.split(r"\n\s*Function : ", block)[1:]
        kernels = result.setdefault(arch, {})
        for f in functions:
            name, _, body = f.partition("\n")
            kernels[name.strip()] = body
    return result


def _kernels(sass, arch, pattern):
    return {name: body for name, body in sass.get(arch, {}).items() if re.search(pattern, name)}


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("op", TC_OPS)
def test_every_op_has_tensor_core_and_simt_kernels_for_every_arch(sass, arch, op):
    _built(arch)
    namespace = f"{len(arch)}{arch}"  # Itanium mangling of the per-arch namespace
    tc = _kernels(sass, ARCHES[arch], rf"{namespace}\d+{op}_tc_kernel")
    simt = _kernels(sass, ARCHES[arch], rf"{namespace}\d+{op}_simt_kernel")
    # (bf16, fp16) x head dims {64, 128}, and block_attention's x per-query key spans (causal or
    # symmetric) {false, true}
    expected_tc = {"inject_context_kv": 4, "block_attention": 8}[op]
    assert len(tc) == expected_tc, f"{op} tensor-core kernels for {arch}: {sorted(tc)}"
    assert len(simt) == 3, f"{op} SIMT kernels for {arch} (fp32, bf16, fp16): {sorted(simt)}"


@pytest.mark.parametrize("op", TC_OPS)
def test_sm90a_tensor_core_kernels_use_wgmma(sass, op):
    _built("sm90a")
    kernels = _kernels(sass, "sm_90a", rf"{op}_tc_kernel")
    assert kernels
    for name, body in kernels.items():
        assert "HGMMA" in body, f"{name} (sm_90a) has no HGMMA (wgmma) instruction"
        assert " HMMA" not in body, f"{name} (sm_90a) falls back to mma.sync"


@pytest.mark.parametrize("arch", ["sm_80", "sm_100"])
@pytest.mark.parametrize("op", TC_OPS)
def test_generic_tensor_core_kernels_use_mma_sync(sass, arch, op):
    _built(arch)
    kernels = _kernels(sass, arch, rf"{op}_tc_kernel")
    assert kernels
    for name, body in kernels.items():
        assert " HMMA" in body, f"{name} ({arch}) has no HMMA (mma.sync) instruction"
        assert "HGMMA" not in body, f"{name} ({arch}) contains wgmma, which traps off Hopper"


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("op", GEMV_OPS)
def test_gemv_kernels_stream_the_weight_through_mma_sync_on_every_arch(sass, arch, op):
    # (bf16, fp16) x (one, two 8-token tiles); mma.sync on sm_90a too (wgmma's 64-row M is what
    # the GEMV avoids); weights as 16-byte loads that do not allocate in L1; no local memory
    _built(arch)
    kernels = _kernels(sass, ARCHES[arch], rf"{len(arch)}{arch}\d+{op}_gemv_kernel")
    assert len(kernels) == 4, f"{op} GEMV kernels for {arch}: {sorted(kernels)}"
    for name, body in kernels.items():
        assert " HMMA.16816.F32" in body, f"{name} ({arch}) has no m16n8k16 mma.sync"
        assert "HGMMA" not in body, f"{name} ({arch}) contains wgmma"
        assert re.search(r"LDG\.E\.NA\.128", body), f"{name} ({arch}) has no 16-byte L1-bypassing weight load"
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name} ({arch}) uses local memory"


@pytest.mark.parametrize("arch", ARCHES)
def test_block_attention_has_a_combine_kernel_per_dtype_and_head_dim(sass, arch):
    """The split-KV merge is its own launch: (bf16, fp16) x D {64, 128}."""
    _built(arch)
    kernels = _kernels(sass, ARCHES[arch], rf"{len(arch)}{arch}\d+block_attention_combine_kernel")
    assert len(kernels) == 4, f"block_attention combine kernels for {arch}: {sorted(kernels)}"


@pytest.mark.parametrize("arch", ARCHES)
def test_block_attention_combine_batches_its_partial_loads(sass, arch):
    """The combine is bound by its loads of the fp32 partials: they are 16 bytes wide and a
    whole batch of them (kCombineBatch = 8) is issued before the math that uses them; without
    the __syncwarp that holds them there, ptxas interleaved loads and math 2 to 4 at a time."""
    _built(arch)
    for name, body in _kernels(sass, ARCHES[arch], "block_attention_combine_kernel").items():
        ops = re.findall(r"\b(LDG\.E\S*|FFMA|FMUL|FADD)\b", body)
        longest = run = 0
        for op in ops:
            run = run + 1 if op.startswith("LDG") and op.endswith(".128") else 0 if not op.startswith("LDG") else run
            longest = max(longest, run)
        assert longest >= 8, f"{name} ({arch}): at most {longest} 16-byte partial loads in flight before their use"


@pytest.mark.parametrize("arch", ARCHES)
def test_no_kernel_uses_local_memory(sass, arch):
    """No local loads or stores (LDL / STL: spills, or arrays the compiler could not keep
    in registers) in any kernel's SASS; the ptxas report test checks the same from -v."""
    _built(arch)
    kernels = sass.get(ARCHES[arch], {})
    assert kernels
    for name, body in kernels.items():
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name} ({arch}) uses local memory"


@pytest.mark.parametrize("arch", ARCHES)
def test_block_conv_has_a_kernel_per_dtype_for_every_arch(sass, arch):
    _built(arch)
    kernels = _kernels(sass, ARCHES[arch], rf"{len(arch)}{arch}\d+block_conv_kernel")
    assert len(kernels) == 3, f"block_conv kernels for {arch} (fp32, bf16, fp16): {sorted(kernels)}"


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kernel", ["rms_norm_kernel", "qk_norm_rope_kernel"])
def test_layer_norms_have_a_kernel_per_dtype_for_every_arch(sass, arch, kernel):
    _built(arch)
    kernels = _kernels(sass, ARCHES[arch], rf"{len(arch)}{arch}\d+{kernel}")
    assert len(kernels) == 3, f"{kernel} for {arch} (fp32, bf16, fp16): {sorted(kernels)}"


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kernel", ["rms_norm_kernel", "qk_norm_rope_kernel"])
def test_layer_norms_move_rows_in_16_byte_accesses(sass, arch, kernel):
    """Rows (rms_norm) and head halves (qk_norm_rope) that are whole 16-byte vectors at 16-byte
    aligned addresses (the host's p.vec) are loaded and stored 16 bytes at a time: 8 bf16 /
    fp16 or 4 fp32 elements per LDG.E.128 / STG.E.128 (the spelling on every arch built), in
    every dtype's kernel; the element-wise path stays for other shapes and offsets."""
    _built(arch)
    kernels = _kernels(sass, ARCHES[arch], rf"{len(arch)}{arch}\d+{kernel}")
    assert kernels
    for name, body in kernels.items():
        assert re.search(r"\bLDG\.E[.\w]*\.128\b", body), f"{name} ({arch}) has no 16-byte global load"
        assert re.search(r"\bSTG\.E[.\w]*\.128\b", body), f"{name} ({arch}) has no 16-byte global store"


def test_sm80_file_embeds_ptx_for_newer_gpus():
    _built("sm80")
    tool = _cuobjdump()
    listing = subprocess.run([tool, "--list-ptx", dflash_ext._C.__file__], check=True,
                             capture_output=True, text=True).stdout
    assert "sm_80.ptx" in listing


def _ptxas_reports():
    reports = {}
    for source in DESCRIPTION["cuda_sources"]:
        name = os.path.splitext(os.path.basename(source))[0]
        path = os.path.join(SETUP.CUDA_OBJECT_DIR, name + ".o.ptxas.txt")
        assert os.path.exists(path), f"no ptxas report for {source}: rebuild the extension"
        assert os.path.getmtime(path) >= os.path.getmtime(os.path.join(ROOT, source)), \
            f"the ptxas report of {source} is older than the source: rebuild the extension"
        reports[source] = open(path).read()
    return reports


def test_ptxas_reports_no_spills_and_no_stack_for_any_kernel():
    reports = _ptxas_reports()
    assert len(reports) == len(SETUP.CUDA_OP_FAMILIES) * len(dflash_ext._C._cuda_archs())  # one file per family and arch
    for source, text in reports.items():
        entries = re.findall(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                             r"(\d+) bytes spill loads", text)
        assert entries, f"{source}: no -Xptxas -v function properties in its report"
        for name, stack, stores, loads in entries:
            assert (int(stack), int(stores), int(loads)) == (0, 0, 0), \
                f"{source}: {name} uses local memory: {stack} B stack, {stores} B spill stores, {loads} B spill loads"
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
        assert registers and max(registers) <= 255, f"{source}: register counts {registers}"


@pytest.mark.slow
@pytest.mark.parametrize("use_wgmma", [1, 0], ids=["wgmma", "mma_sync"])
def test_host_checks_of_layouts_and_plans(use_wgmma, tmp_path):
    """The layout facts the kernels rely on, for every TileGemm configuration they use,
    and the split-K / split-KV plans (python_tests/cuda/host_checks.cu)."""
    exe = tmp_path / "host_checks"
    cuda_home = DESCRIPTION["cuda_home"]
    ptx = "compute_90a" if use_wgmma else "compute_80"  # the kernels are built as PTX only: never run here
    subprocess.run([DESCRIPTION["nvcc"], "-std=c++20", "-O1", "--expt-relaxed-constexpr",
                    "-gencode", f"arch={ptx},code={ptx}",
                    "-DDFLASH_ARCH_NS=hostcheck", f"-DDFLASH_USE_WGMMA={use_wgmma}",
                    "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + SETUP.cutlass_include_dir(),
                    "-I" + os.path.join(cuda_home, "include", "cccl"),
                    os.path.join(ROOT, "python_tests", "cuda", "host_checks.cu"), "-o", str(exe)],
                   check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "0 failures" in run.stdout, run.stdout[-3000:]
    assert run.stdout.count("checked ") == 12
