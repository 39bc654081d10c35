"""Helpers shared by bench/bench_ops.py, bench/draft_latency.py and bench/e2e.py: an
interleaved median timer with a quiet-machine check, a copy-bandwidth probe, run metadata,
aligned text tables, JSON output and a lazy matplotlib (plus saving a figure)."""
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "bench", "out")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- timing

class Timer:
    """Median time (ms) of several variants of one computation, measured interleaved.

    ``warmup`` untimed calls of each variant, then rounds that call every variant once
    (order rotated per round) until ``repeats`` timed calls per variant, or until the kept
    calls add up to ``budget`` seconds once ``min_repeats`` calls are done.

    CUDA: CUDA events around each call (no CUDA graphs: the draft step has host-side work,
    e.g. the cache lengths tensor and ``positions.max()``, that graphs would hide).

    CPU: a tiny two-thread canary op runs before and after every timed
    call. On a shared VM whose other vCPU is intermittently taken by the host every parallel
    region then waits a scheduler tick (the canary takes ms instead of us); calls next to a
    slow canary are dropped, a pass with more than MAX_DROPPED of them is repeated once the
    machine is quiet again, and after ``max_wait`` seconds the quiet calls of all passes
    (else all calls) are used and the measurement is flagged ``noisy``. A long call can
    still be slowed by something the canaries before and after it do not see (e.g. another
    process using the cores throughout): the check catches intermittent stalls only.
    """

    MAX_DROPPED = 0.1
    QUIET_WINDOW_S = 0.05

    def __init__(self, device, warmup=3, repeats=50, min_repeats=5, budget=2.0, quiet_check=True,
                 max_wait=20.0):
        self.device = torch.device(device)
        self.warmup, self.repeats = warmup, repeats
        self.min_repeats, self.budget, self.max_wait = max(1, min(min_repeats, repeats)), budget, max_wait
        self.cuda = self.device.type == "cuda"
        self.quiet_check = quiet_check and not self.cuda
        self.waited_s = 0.0  # total time spent waiting for a quiet machine
        self.dropped_calls = 0
        self.retried_passes = 0
        self.canary_limit_ms = None
        if self.quiet_check:
            self._x = torch.randn(1 << 16)  # 2 * at::internal::GRAIN_SIZE: runs on 2 threads
            self._y = torch.empty_like(self._x)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                single = min(self._canary() for _ in range(200))
            finally:
                torch.set_num_threads(threads)
            # Quiet: the parallel canary costs about the single-thread one, never a tick.
            self.canary_limit_ms = single + 1.0

    def _canary(self):
        t0 = time.perf_counter()
        torch.mul(self._x, 2.0, out=self._y)
        return (time.perf_counter() - t0) * 1e3

    def _quiet(self):
        return not self.quiet_check or self._canary() <= self.canary_limit_ms

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _time(self, fn):
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def _wait_quiet(self, deadline):
        """Wait until the canary has stayed quiet for QUIET_WINDOW_S in a row (a busy spell
        often flickers: quiet canaries between stalls a few ms apart)."""
        if not self.quiet_check:
            return True
        t0 = window_start = time.perf_counter()
        while True:
            now = time.perf_counter()
            if not self._quiet():
                if now > deadline:
                    break
                time.sleep(0.02)
                window_start = time.perf_counter()
            elif now - window_start >= self.QUIET_WINDOW_S:
                break
        self.waited_s += time.perf_counter() - t0
        return self._quiet()

    def _pass(self, fns, deadline):
        """One measurement pass. Rounds call every variant once (rotating the order); with the
        quiet check on, a call counts only if the canary before and after it was quiet. The
        pass gives up early once more than MAX_DROPPED of its calls were disturbed."""
        names = list(fns)
        good = {n: [] for n in names}
        every = {n: [] for n in names}
        spent_ms = 0.0  # time inside the kept timed calls
        quiet = self._wait_quiet(deadline)
        dropped = total = rnd = 0
        while True:
            n_good = min(len(v) for v in good.values())
            if n_good >= self.repeats or (n_good >= self.min_repeats and spent_ms >= self.budget * 1e3):
                break
            if dropped >= 2 and dropped > self.MAX_DROPPED * total:
                break  # a busy spell: this pass is rejected anyway
            if time.perf_counter() > deadline and total >= self.min_repeats * len(names):
                break
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            rnd += 1
            for n in order:
                t = self._time(fns[n])
                quiet_after = self._quiet()
                every[n].append(t)
                total += 1
                if quiet and quiet_after:
                    good[n].append(t)
                    spent_ms += t
                else:
                    dropped += 1
                quiet = quiet_after
        return good, every, dropped, total

    def measure(self, fns):
        """fns: {name: callable}. Returns ({name: median ms}, info) where info holds
        repeats, dropped, passes, noisy and ``<name>_min_ms``."""
        names = list(fns)
        for name in names:
            for _ in range(self.warmup):
                fns[name]()
        self.sync()
        deadline = time.perf_counter() + self.max_wait
        all_good = {n: [] for n in names}
        all_every = {n: [] for n in names}
        passes = dropped_total = 0
        while True:
            good, every, dropped, total = self._pass(fns, deadline)
            passes += 1
            dropped_total += dropped
            self.dropped_calls += dropped
            for n in names:
                all_good[n] += good[n]
                all_every[n] += every[n]
            if min(len(v) for v in good.values()) >= self.min_repeats and dropped <= self.MAX_DROPPED * total:
                noisy, use = False, good
                break
            if time.perf_counter() > deadline:
                noisy = True
                if min(len(v) for v in all_good.values()) >= self.min_repeats:
                    use = all_good
                else:  # no quiet spell at all: keep every call, at least min_repeats of them
                    use = all_every
                    rnd = 0
                    while min(len(v) for v in all_every.values()) < self.min_repeats:
                        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
                            all_every[n].append(self._time(fns[n]))
                        rnd += 1
                break
            self.retried_passes += 1
        medians = {n: statistics.median(use[n]) for n in names}
        info = dict(repeats=min(len(v) for v in use.values()), dropped=dropped_total, passes=passes,
                    noisy=noisy)
        info.update({f"{n}_min_ms": min(use[n]) for n in names})
        return medians, info

    def summary(self) -> dict:
        return dict(quiet_check=self.quiet_check, canary_limit_ms=self.canary_limit_ms,
                    quiet_wait_s=round(self.waited_s, 2), dropped_calls=self.dropped_calls,
                    retried_passes=self.retried_passes)


def busy_fraction(seconds=0.3):
    """CPU: the fraction of tiny two-thread canary ops that stalled (waited for a core taken
    by another process) over `seconds`; 0 on a quiet machine. None with one thread."""
    if torch.get_num_threads() < 2:
        return None
    t = Timer("cpu", quiet_check=True)
    n = slow = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
        slow += not t._quiet()
        time.sleep(0.002)
    return slow / max(1, n)


def warn_if_busy(device, log=None):
    """Print a warning when the CPU is busy; returns the busy fraction (None on CUDA)."""
    if torch.device(device).type != "cpu":
        return None
    frac = busy_fraction()
    if frac is not None and frac > 0.2:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        msg = (f"WARNING: the machine is busy ({frac:.0%} of two-thread canary ops stalled, load average "
               f"{load:.1f} on {os.cpu_count()} cores): with --threads {torch.get_num_threads()} every "
               f"parallel region may wait for a scheduler tick, so timings will be slow and noisy "
               f"(--threads 1 suffers less)")
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)
    return frac


def copy_bandwidth_gbs(device, nbytes=None, repeats=10) -> float:
    """Measured copy bandwidth in GB/s, counting the bytes read plus the bytes written
    (2 x size / time, the STREAM "copy" convention), best of `repeats` copies of a buffer
    far larger than the caches (256 MiB on CPU, 1 GiB on CUDA)."""
    device = torch.device(device)
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (1 << 28))
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
            t = e0.elapsed_time(e1) / 1e3
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            t = time.perf_counter() - t0
        best = min(best, t)
    del a, b
    return 2 * nbytes / best / 1e9


# --------------------------------------------------------------------------- metadata

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    interesting = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return [x for x in interesting if x in flags]


def git_info():
    def run(*cmd):
        try:
            return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    commit = run("git", "rev-parse", "--short", "HEAD")
    status = run("git", "status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def machine_metadata(device) -> dict:
    device = torch.device(device)
    commit, dirty = git_info()
    try:
        import dflash_ext
        version = getattr(dflash_ext, "__version__", None)
    except Exception:  # pragma: no cover
        version = None
    return dict(
        torch_version=torch.__version__, dflash_ext_version=version, device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()),
        cpu_model=cpu_model(), cpu_flags=cpu_flags(), cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(), python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit, git_dirty=dirty, load_average=(os.getloadavg() if hasattr(os, "getloadavg") else None),
        argv=sys.argv,
    )


def check_device(device, op_names=("project_features", "inject_context_kv", "block_attention"),
                 prog=None):
    """Exit with a message (prefixed with ``prog: `` if given) for an unusable device; returns
    the dflash_ext ops without a kernel on it (CUDA builds without CUDA kernels)."""
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
    callable(row) -> str. Missing / None values print as '-'."""
    def cell(r, key, fmt):
        if callable(fmt):
            return fmt(r)
        v = r.get(key)
        return "-" if v is None else fmt.format(v)
    cells = [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path, obj) -> None:
    import json
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (with a note) when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib): no PNG written",
              file=sys.stderr)
        return None


def save_figure(fig, path, dpi=110) -> bool:
    """Lay out `fig`, write it to `path` (creating the folder) and close it; returns True."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True
