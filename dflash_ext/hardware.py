"""What this machine computes fast: run-time CPU feature detection (never tuned to one
machine) and the dtype choice that follows from it."""
import torch

__all__ = ["cpu_has_bf16_units", "cpu_description", "fastest_dtype"]


def cpu_has_bf16_units() -> bool:
    """True where bf16 matmuls run on bf16 dot-product units (avx512_bf16 or AMX-BF16),
    i.e. where oneDNN's bf16 GEMM beats fp32 instead of converting in software."""
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


def cpu_description() -> str:
    """The CPU model name and the bf16 features torch sees, for every recorded figure."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    feats = [name for name, ok in (("avx512_bf16", torch.cpu._is_avx512_bf16_supported()),
                                   ("amx", torch.cpu._is_amx_tile_supported())) if ok]
    return f"{model} ({', '.join(feats) or 'no bf16 units'}, {torch.get_num_threads()} threads)"


def fastest_dtype(device="cpu") -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with bf16 units, float32 elsewhere (where bf16 is
    converted in software and runs slower than fp32)."""
    if torch.device(device).type == "cuda" or cpu_has_bf16_units():
        return torch.bfloat16
    return torch.float32
