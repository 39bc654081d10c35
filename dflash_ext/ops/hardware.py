"""What this machine is and computes fast: the CPU features the kernels need (checked before
the compiled extension loads: :func:`load_extension`), run-time CPU feature detection (never
tuned to one machine), the dtype choice that follows from it, and the CPU kernels' dispatch.

The CPU kernels choose their paths by an ISA level, lowest first: ``avx2`` (the build's
baseline: AVX2 + FMA), ``avx512``, ``avx512_bf16`` and ``amx_bf16``. The level is detected
at load; ``DFLASH_CPU_ISA=<level>`` in the environment (read at import) or
:func:`forced_cpu_isa` forces a lower one, so that every path can be tested and benchmarked
on one machine. A level above what the CPU has is an error.
"""
import contextlib
import ctypes
import os
import platform
from typing import Optional

import torch

__all__ = ["cpu_has_bf16_units", "cpu_description", "fastest_dtype", "ISA_LEVELS", "cpu_isa",
           "set_cpu_isa", "forced_cpu_isa", "cpu_paths", "skinny_linear_path", "keep_freed_memory",
           "available_memory", "require_cpu_features", "load_extension"]

# The x86 CPU kernels are compiled for AVX2 + FMA + F16C (x86-64-v3).
REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx_bf16")
# oneDNN's own cap for a forced level (it reads ONEDNN_MAX_CPU_ISA once, at its first use):
# forcing avx512_bf16 on an AMX CPU then also keeps oneDNN off the AMX tiles.
_ONEDNN_MAX_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16"}


def cpu_has_bf16_units() -> bool:
    """True where bf16 matmuls run on bf16 dot-product units (avx512_bf16 or AMX-BF16),
    i.e. where oneDNN's bf16 GEMM beats fp32 instead of converting in software: the
    kernels' detected ISA level (one detection for the dtype choice and the dispatch)."""
    return ISA_LEVELS.index(cpu_isa()["detected"]) >= ISA_LEVELS.index("avx512_bf16")


def cpu_description() -> str:
    """The CPU model name and the bf16 features torch sees, for every recorded figure."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    level = ISA_LEVELS.index(cpu_isa()["detected"])
    feats = [name for name, need in (("avx512_bf16", "avx512_bf16"), ("amx", "amx_bf16"))
             if level >= ISA_LEVELS.index(need)]
    return f"{model} ({', '.join(feats) or 'no bf16 units'}, {torch.get_num_threads()} threads)"


def fastest_dtype(device="cpu") -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with bf16 units, float32 elsewhere (where bf16 is
    converted in software and runs slower than fp32)."""
    if torch.device(device).type == "cuda" or cpu_has_bf16_units():
        return torch.bfloat16
    return torch.float32


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the kernel
    (no mmap'd blocks, no trimming below 2 GiB of free heap top). Training allocates and
    frees tensors of tens of MB every step (logits, attention keys); glibc serves each from
    a fresh mmap, so every reuse faults its pages in and zeroes them again (what that costs:
    python -m bench.malloc_reuse, bench/RESULTS.md). Process-wide, for jobs
    that own their process (the CLI's train, eval and gen-data); False where the C library
    is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def available_memory(device) -> Optional[int]:
    """Bytes a new allocation on `device` can take now: CUDA's free memory and what torch's
    caching allocator holds unused, the host's MemAvailable (Linux, /proc/meminfo; free pages
    elsewhere); None where it cannot be known."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            kib = next((int(l.split()[1]) for l in f if l.startswith("MemAvailable:")), None)
        if kib is not None:
            return kib * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def require_cpu_features(cpuinfo_path="/proc/cpuinfo") -> None:
    """Refuse an x86 CPU older than the kernels (:data:`REQUIRED_CPU_FEATURES`) with a clear
    ImportError instead of dying on an illegal instruction; nothing to check elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        with open(cpuinfo_path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return  # no /proc (not Linux): nothing to check against
    missing = [x for x in REQUIRED_CPU_FEATURES if flags is not None and x not in flags]
    if missing:
        raise ImportError("dflash_ext's CPU kernels need an x86-64 CPU with " + ", ".join(REQUIRED_CPU_FEATURES)
                          + "; this CPU lacks " + ", ".join(missing))


def cap_onednn_isa_from_env() -> None:
    """Before any oneDNN call: DFLASH_CPU_ISA also caps oneDNN's ISA (unless
    ONEDNN_MAX_CPU_ISA is set already)."""
    level = os.environ.get("DFLASH_CPU_ISA", "")
    if level in _ONEDNN_MAX_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_MAX_ISA[level])


def load_extension():
    """Load the compiled extension (it registers ``torch.ops.dflash_ext.*``) once the CPU is
    known to run it and oneDNN's cap is set, and read DFLASH_CPU_ISA now (a bad value is an
    error at import, not at a call). A missing or mismatched build is an ImportError that
    says what to do."""
    require_cpu_features()
    cap_onednn_isa_from_env()
    try:
        from .. import _C
    except ModuleNotFoundError as e:
        if e.name != "dflash_ext._C":
            raise
        raise ImportError("dflash_ext's compiled extension is not built here: ./run.sh builds it, or "
                          "pip install --no-build-isolation -e . (docs/build.md)") from e
    except ImportError as e:  # most often a torch other than the one the extension was built with
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        raise ImportError(f"dflash_ext at {package}: its compiled extension failed to load with torch "
                          f"{torch.__version__} ({e}). It loads only with the torch minor version it was built "
                          "against (the package's torch requirement, e.g. pip show dflash_ext): install that "
                          "torch, or rebuild against this one (pip install --no-build-isolation .)") from e
    _C._cpu_isa()
    return _C


def _c():
    from .. import _C  # loaded by load_extension (imported lazily: this module is imported before it)
    return _C


def cpu_isa() -> dict:
    """``{"detected": level, "active": level, "features": [...]}``: the ISA levels of the CPU
    kernels' dispatch and the instruction sets torch's cpuinfo reports that matter to them."""
    detected, active = _c()._cpu_isa()
    caps = torch._C._cpu._get_cpu_capability() if hasattr(torch._C._cpu, "_get_cpu_capability") else {}
    names = ("avx2", "fma3", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    return {"detected": detected, "active": active, "features": [n for n in names if caps.get(n) is True]}


def set_cpu_isa(level: str) -> str:
    """Force the ISA level of the CPU kernels (``"auto"``: the detected one); returns the
    previous level. oneDNN's own ISA is not changed (see ``DFLASH_CPU_ISA``)."""
    return _c()._set_cpu_isa(level)


@contextlib.contextmanager
def forced_cpu_isa(level: str):
    """The CPU kernels run at ``level`` inside the block, at the previous level after it."""
    prev = set_cpu_isa(level)
    try:
        yield
    finally:
        set_cpu_isa(prev)


# The dtypes the CPU kernels take, by the names their path rules use.
CPU_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def skinny_linear_path(dtype: torch.dtype, rows: int, weight_bytes: int) -> str:
    """The path ``ops.skinny_linear`` takes on the CPU now for `rows` input rows of `dtype`
    (one of :data:`CPU_KERNEL_DTYPES`) over `weight_bytes` of weight: ``"stream"`` (its own
    kernel) or the library's linear (the rule of csrc/cpu/isa.h)."""
    return _c()._cpu_skinny_linear_path(CPU_KERNEL_DTYPES[dtype], int(rows), int(weight_bytes))


def cpu_paths(dtype: torch.dtype, rows: int = 16, weight_bytes: int = 1 << 30, keys: int = 1024,
              query_rows: int = 48) -> dict:
    """The path each CPU op takes now for ``dtype``: the GEMM ops for ``rows`` input rows over
    ``weight_bytes`` of weights (project_features: fc_weight; inject_context_kv: k_weight and
    v_weight together; skinny_linear: its weight), block_attention for ``keys`` keys per
    sequence (context + block) and ``query_rows`` query rows per KV head (Bq x Hq / Hkv)."""
    name = CPU_KERNEL_DTYPES[dtype]
    gemm = _c()._cpu_gemm_path(name, int(rows), int(weight_bytes))
    return {"project_features": gemm, "inject_context_kv": gemm,
            "skinny_linear": skinny_linear_path(dtype, rows, weight_bytes),
            "block_attention": _c()._cpu_attention_path(name, int(keys), int(query_rows))}
