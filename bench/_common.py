"""Helpers shared by the benchmarks (bench.bench_ops, bench.draft_latency, bench.e2e, ...): a median
timer (torch.utils.benchmark), run metadata, one table formatter, one JSON writer, and
matplotlib for the plots."""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

import torch
import torch.utils.benchmark as benchmark

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "bench", "out")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DRAFTERS = {  # the shapes of the two DFlash drafters: DFlashConfig fields, k target features, rope theta
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, k=5, num_hidden_layers=5, num_target_layers=30, rope_theta=1e5, rms_norm_eps=1e-5),
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, k=5, num_hidden_layers=5, num_target_layers=36,
                     rope_theta=1e6, rms_norm_eps=1e-6),
}


class MismatchError(RuntimeError):
    """A fused result disagrees with its baseline or reference: the scripts exit with status 1."""


# --------------------------------------------------------------------------- timing

def measure(fns, warmup=1, budget=0.5, max_s=5.0, min_repeats=4, threshold=0.1):
    """Median ms of each callable of ``fns`` ({name: fn}), one after the other, each by
    ``torch.utils.benchmark.Timer.adaptive_autorange``: blocks of calls (enough per block to
    hide the timer) for at least ``budget`` s, until the blocks' IQR / median < ``threshold``
    or ``max_s`` s have passed; then at least ``min_repeats`` blocks. CUDA is synchronized
    around every block. Returns ({name: ms}, info) with info ``repeats`` (fewest blocks),
    ``noisy`` (some IQR / median stayed >= threshold) and ``<name>_min_ms``."""
    medians, info = {}, dict(repeats=None, noisy=False)
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        timer = benchmark.Timer("fn()", globals=dict(fn=fn), num_threads=torch.get_num_threads())
        runs = [timer.adaptive_autorange(threshold, min_run_time=budget, max_run_time=max_s)]
        while sum(len(m.times) for m in runs) < min_repeats:
            runs.append(timer.timeit(runs[0].number_per_run))
        m = benchmark.Measurement.merge(runs)[0]
        medians[name], info[f"{name}_min_ms"] = m.median * 1e3, min(m.times) * 1e3
        info["repeats"] = min(info["repeats"] or len(m.times), len(m.times))
        info["noisy"] |= not m.meets_confidence(threshold)
    return medians, info


def copy_bandwidth(device, nbytes=None, **timing):
    """Copy bandwidth from the median time of ``dst.copy_(src)`` on ``nbytes`` uint8 (default
    256 MiB on CPU, 1 GiB on CUDA), counting 2 x nbytes (read + write, STREAM "copy")."""
    nbytes = int(nbytes or (1 << (30 if torch.device(device).type == "cuda" else 28)))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, info = measure(dict(copy=lambda: dst.copy_(src)), **timing)
    return dict(copy_gbps=2 * nbytes / t["copy"] / 1e6, copy_ms=t["copy"], copy_bytes=nbytes,
                copy_repeats=info["repeats"])


def warn_if_busy(device):
    """One line on stderr when other processes load the CPU; returns the 1-minute load average."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if torch.device(device).type == "cpu" and load is not None and \
            load > max(0.5, (os.cpu_count() or 1) - torch.get_num_threads()):
        print(f"WARNING: the machine looks busy (load average {load:.1f} on {os.cpu_count()} cores): "
              "CPU timings will be slow and noisy", file=sys.stderr, flush=True)
    return load


def logger():
    """print to stderr with the seconds since this call."""
    t0 = time.perf_counter()
    return lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- metadata

def _run(*cmd):
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU model name from lscpu, else /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    for text, key in ((_run("lscpu"), "Model name"), (cpuinfo, "model name")):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text or "", re.M)
        if m:
            return m.group(1).strip()
    return platform.processor() or platform.machine()


def cpu_isa():
    """dflash_ext.ops.hardware.cpu_isa() (detected / active ISA level, features) where available."""
    from dflash_ext.ops import hardware
    return hardware.cpu_isa() if hasattr(hardware, "cpu_isa") else None


def metadata(device, **extra) -> dict:
    """What a recorded figure needs: date, git commit, machine, CPU ISA, torch, threads."""
    import dflash_ext
    device = torch.device(device)
    status = _run("git", "status", "--porcelain", "--untracked-files=no")
    model = cpu_model()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=_run("git", "rev-parse", "--short", "HEAD"), git_dirty=None if status is None else bool(status),
        device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else model,
        cpu_model=model, cpu_isa=cpu_isa(), cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
        torch_version=torch.__version__, dflash_ext_version=getattr(dflash_ext, "__version__", None),
        python=platform.python_version(), load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
        argv=sys.argv)
    meta.update(extra)
    return meta


def header(meta) -> str:
    """One line naming the machine and the code of a run, from ``metadata()``."""
    isa = meta.get("cpu_isa")
    isa = f"; ISA detected {isa['detected']}, active {isa['active']}" if isa and meta["device"] == "cpu" else ""
    return (f"device {meta['device']} ({meta['device_name']}{isa}) | threads {meta['threads']} | torch "
            f"{meta['torch_version']} | git {meta['git_commit']}{'+dirty' if meta['git_dirty'] else ''}")


def start(args, op_names=("project_features", "inject_context_kv", "block_attention"), prog=None):
    """The torch.device of --device (exits if unusable) with --threads set and a warning if the
    machine looks busy; returns (device, the dflash_ext ops without a kernel on it)."""
    device = torch.device(args.device)
    missing = check_device(device, op_names, prog)
    torch.set_num_threads(args.threads)
    warn_if_busy(device)
    return device, missing


def check_device(device, op_names=("project_features", "inject_context_kv", "block_attention"), prog=None):
    """Exit with a message for an unusable device; returns the dflash_ext ops without a kernel
    on it (CUDA builds without CUDA kernels)."""
    device = torch.device(device)
    prefix = f"{prog}: " if prog else ""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"{prefix}--device cuda requested but torch.cuda.is_available() is False")
        return [op for op in op_names
                if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash_ext::{op}", "CUDA")]
    if device.type != "cpu":
        sys.exit(f"{prefix}unsupported --device {device} (cpu or cuda)")
    return []


# --------------------------------------------------------------------------- output

def format_table(rows, cols, title=None) -> str:
    """rows: dicts; cols: (key, header, format) with format a str.format pattern or a
    callable(row) -> str, or a key alone for (key, key, "{}"). Missing / None values print as '-'."""
    cols = [(c, c, "{}") if isinstance(c, str) else c for c in cols]

    def cell(r, key, fmt):
        if callable(fmt):
            return fmt(r)
        return "-" if r.get(key) is None else fmt.format(r[key])
    cells = [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` (creating the folder) and say so on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"# JSON written to {path}")


def fail(error) -> int:
    """Print a bug (e.g. a MismatchError) loudly on stderr and stdout; returns exit status 1."""
    print("\n" + "!" * 78 + f"\nBUG: {error}\n" + "!" * 78, file=sys.stderr)
    print(f"BUG: {error}")
    return 1


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (with a note) when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib): no PNG written", file=sys.stderr)
        return None


def save_figure(fig, path, dpi=110) -> bool:
    """Lay out `fig`, write it to `path` (creating the folder) and close it; returns True."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- command line

def arg_parser(doc, name, budget, max_s, quick_help):
    """The parser of bench_ops.py and draft_latency.py (description and epilog from `doc`) with
    --device, --threads, --quick, --json, --seed and the timing flags; budget and max_s:
    (default, --quick default) seconds."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", default=os.path.join(OUT_DIR, f"{name}.json"),
                    help=f"where to write the JSON results (default bench/out/{name}.json; '' for none)")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("timing: torch.utils.benchmark adaptive_autorange per variant, median of blocks")
    g.add_argument("--warmup", type=int, default=1, help="untimed calls of each variant first (default 1)")
    g.add_argument("--min-repeats", type=int, default=4, help="at least this many timed blocks (default 4)")
    g.add_argument("--budget", type=float, default=None,
                   help=f"seconds of timed blocks before the spread is checked (default {budget[0]}; "
                        f"--quick {budget[1]})")
    g.add_argument("--max-wait", type=float, default=None,
                   help=f"the most seconds of timed blocks while IQR / median >= 10%%; then the row is marked "
                        f"noisy ('!') (default {max_s[0]}; --quick {max_s[1]})")
    ap.set_defaults(timing_defaults=(budget, max_s))
    return ap


def timing(args) -> dict:
    """The keyword arguments of measure() from the flags of arg_parser()."""
    (budget, max_s), i = args.timing_defaults, int(args.quick)
    return dict(warmup=args.warmup, min_repeats=max(1, args.min_repeats),
                budget=budget[i] if args.budget is None else args.budget,
                max_s=max_s[i] if args.max_wait is None else args.max_wait)
