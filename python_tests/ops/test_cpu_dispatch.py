"""The CPU kernels' run-time dispatch: detection, the override, and the path each level
takes (the ops' results on every path are checked in the op test files, through the
`cpu_isa_level` fixture)."""
import os
import subprocess
import sys

import pytest
import torch

import dflash_ext
from dflash_ext.ops import hardware

LEVELS = hardware.ISA_LEVELS
DETECTED = hardware.cpu_isa()["detected"]


def below_detected(level):
    return LEVELS.index(level) <= LEVELS.index(DETECTED)


def test_detected_level_matches_cpuinfo():
    feats = hardware.cpu_isa()["features"]
    assert "avx2" in feats and "fma3" in feats  # the build's baseline, checked at import
    expected = "avx2"
    if "avx512_f" in feats:
        expected = "avx512"
        if "avx512_bf16" in feats:
            expected = "amx_bf16" if "amx_bf16" in feats else "avx512_bf16"
    assert DETECTED == expected


def test_forced_level_is_restored():
    before = hardware.cpu_isa()["active"]
    with hardware.forced_cpu_isa("avx2"):
        assert hardware.cpu_isa()["active"] == "avx2"
    assert hardware.cpu_isa()["active"] == before
    assert hardware.set_cpu_isa("auto") == before


def test_bad_levels_are_clear_errors():
    with pytest.raises(ValueError, match="unknown CPU ISA level 'sse4'"):
        hardware.set_cpu_isa("sse4")
    for level in LEVELS:
        if not below_detected(level):
            with pytest.raises(ValueError, match="above what this CPU supports"):
                hardware.set_cpu_isa(level)


def test_paths_follow_the_level(cpu_isa_level):
    bf16_units = LEVELS.index(cpu_isa_level) >= LEVELS.index("avx512_bf16")
    avx512 = LEVELS.index(cpu_isa_level) >= LEVELS.index("avx512")
    bf16 = hardware.cpu_paths(torch.bfloat16, rows=4)
    assert bf16["project_features"] == bf16["inject_context_kv"] == ("onednn" if bf16_units else "tiles")
    assert bf16["block_attention"] == ("flash" if bf16_units else "tiles")  # 1024 keys, 48 query rows
    # Flash for many keys or many query rows; our kernel for short contexts and few queries.
    few = hardware.cpu_paths(torch.bfloat16, keys=1023, query_rows=31)["block_attention"]
    assert few == "tiles"
    for keys, rows in [(1024, 1), (100, 32)]:
        path = hardware.cpu_paths(torch.bfloat16, keys=keys, query_rows=rows)["block_attention"]
        assert path == ("flash" if bf16_units else "tiles")
    # bf16, few rows of small weights: our streaming tiles (oneDNN's call costs more there)
    assert hardware.cpu_paths(torch.bfloat16, rows=1, weight_bytes=12 << 20)["project_features"] == "tiles"
    assert hardware.cpu_paths(torch.bfloat16, rows=4, weight_bytes=2 << 20)["inject_context_kv"] == "tiles"
    big = hardware.cpu_paths(torch.bfloat16, rows=1, weight_bytes=(12 << 20) + 1)["project_features"]
    assert big == ("onednn" if bf16_units else "tiles")
    # fp32: our weight tiles while the op is bound by weight bytes, the library's GEMM above
    assert hardware.cpu_paths(torch.float32, rows=8)["project_features"] == "tiles"
    assert hardware.cpu_paths(torch.float32, rows=9)["project_features"] == "mkl"
    assert hardware.cpu_paths(torch.float16, rows=4) == {
        "project_features": "tiles", "inject_context_kv": "tiles", "skinny_linear": "stream",
        "block_attention": "tiles"}
    # skinny_linear: bf16 on bf16 units and fp32 on AVX-512 stream 1..16 rows over any weight
    # (the dot kernel); otherwise 1..8 rows where the GEMM rule says tiles, else the library's linear
    assert hardware.cpu_paths(torch.float32, rows=8, weight_bytes=1 << 30)["skinny_linear"] == "stream"
    assert hardware.cpu_paths(torch.float32, rows=9)["skinny_linear"] == ("stream" if avx512 else "library")
    assert hardware.cpu_paths(torch.float32, rows=16, weight_bytes=1 << 30)["skinny_linear"] == \
        ("stream" if avx512 else "library")
    assert hardware.cpu_paths(torch.float32, rows=17)["skinny_linear"] == "library"
    assert hardware.cpu_paths(torch.bfloat16, rows=4, weight_bytes=2 << 20)["skinny_linear"] == "stream"
    big = hardware.cpu_paths(torch.bfloat16, rows=1, weight_bytes=(12 << 20) + 1)["skinny_linear"]
    assert big == "stream"
    assert hardware.cpu_paths(torch.bfloat16, rows=16)["skinny_linear"] == ("stream" if bf16_units else "library")
    assert hardware.cpu_paths(torch.bfloat16, rows=17)["skinny_linear"] == "library"


def _import_with_env(value):
    env = dict(os.environ, DFLASH_CPU_ISA=value, OMP_NUM_THREADS="1")
    code = ("import dflash_ext, os; "
            "print(dflash_ext.ops.hardware.cpu_isa()['active'], os.environ.get('ONEDNN_MAX_CPU_ISA'))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_override_forces_a_path():
    r = _import_with_env("avx2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["avx2", "AVX2"]  # oneDNN is capped too


@pytest.mark.parametrize("value,message", [("pentium", "unknown CPU ISA level 'pentium'"),
                                           ("amx_bf16", "above what this CPU supports")])
def test_env_override_bad_value_fails_at_import(value, message):
    if value == DETECTED:
        pytest.skip("this CPU has AMX")
    r = _import_with_env(value)
    assert r.returncode != 0 and message in r.stderr


_FAULTS_SCRIPT = """
import resource, sys, torch
from dflash_ext.ops.hardware import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
for _ in range(8):  # the first uses fault pages in either way, until the heap has settled
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # a step's logits: allocated, used, freed
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_stops_refaulting_reused_buffers():
    """Without it glibc unmaps a freed 64 MiB buffer and the next one faults all 16k of its
    pages in again; with it the pages are reused."""
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], int(out[1])

    kept, with_it = faults("keep")
    _, without = faults("plain")
    assert kept == "True"
    assert without > 10 * (64 << 20) // 4096 // 2  # about one fault per 4 KiB page per buffer
    assert with_it < without / 10
