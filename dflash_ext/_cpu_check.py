"""The x86 CPU kernels are compiled for AVX2 + FMA + F16C (x86-64-v3): refuse to load
them on an older CPU with a clear error instead of dying on an illegal instruction."""
import platform

_REQUIRED = ("avx2", "fma", "f16c")


def require_cpu_features(cpuinfo_path="/proc/cpuinfo"):
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        with open(cpuinfo_path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return  # no /proc (not Linux): nothing to check against
    missing = [x for x in _REQUIRED if flags is not None and x not in flags]
    if missing:
        raise ImportError(
            "dflash_ext's CPU kernels need an x86-64 CPU with " + ", ".join(_REQUIRED)
            + "; this CPU lacks " + ", ".join(missing)
        )
