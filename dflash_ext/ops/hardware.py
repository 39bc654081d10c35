"""What this machine computes fast: run-time CPU feature detection (never tuned to one
machine), the dtype choice that follows from it, and the CPU kernels' dispatch.

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

import torch

__all__ = ["cpu_has_bf16_units", "cpu_description", "fastest_dtype", "ISA_LEVELS", "cpu_isa",
           "set_cpu_isa", "forced_cpu_isa", "cpu_paths", "keep_freed_memory"]

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
    a fresh mmap, so every reuse faults its pages in and zeroes them again: on a 2-core KVM
    guest (AMD EPYC) a short training run spent 10.7 s in the kernel without this, 6.3 s
    with it, for 26-28 s of user time (python -m bench.malloc_reuse). Process-wide, for jobs
    that own their process (the CLI's train, eval and gen-data); False where the C library
    is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def _c():
    from . import _C  # the compiled extension (imported lazily: this module is imported first)
    return _C


def cap_onednn_isa_from_env() -> None:
    """Called at import, before any oneDNN call: DFLASH_CPU_ISA also caps oneDNN's ISA
    (unless ONEDNN_MAX_CPU_ISA is set already)."""
    level = os.environ.get("DFLASH_CPU_ISA", "")
    if level in _ONEDNN_MAX_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_MAX_ISA[level])


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


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def skinny_linear_streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``ops.skinny_linear(x, weight)`` runs its streaming kernel (the rule of
    csrc/cpu/isa.h: 1..8 rows where the GEMM rule says tiles) rather than the library's
    linear; False off the CPU and for dtypes the op does not take (float64)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPE_NAMES or x.dim() == 0 or x.shape[-1] == 0:
        return False
    rows = x.numel() // x.shape[-1]
    return _c()._cpu_skinny_linear_path(_DTYPE_NAMES[x.dtype], rows, weight.numel() * weight.element_size()) == "stream"


def cpu_paths(dtype: torch.dtype, rows: int = 16, weight_bytes: int = 1 << 30, keys: int = 1024,
              query_rows: int = 48) -> dict:
    """The path each CPU op takes now for ``dtype``: the GEMM ops for ``rows`` input rows over
    ``weight_bytes`` of weights (project_features: fc_weight; inject_context_kv: k_weight and
    v_weight together; skinny_linear: its weight), block_attention for ``keys`` keys per
    sequence (context + block) and ``query_rows`` query rows per KV head (Bq x Hq / Hkv)."""
    name = _DTYPE_NAMES[dtype]
    gemm = _c()._cpu_gemm_path(name, int(rows), int(weight_bytes))
    return {"project_features": gemm, "inject_context_kv": gemm,
            "skinny_linear": _c()._cpu_skinny_linear_path(name, int(rows), int(weight_bytes)),
            "block_attention": _c()._cpu_attention_path(name, int(keys), int(query_rows))}
