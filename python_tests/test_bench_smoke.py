"""Smoke tests of bench/draft_latency.py and bench/e2e.py: each runs in a subprocess with
options even smaller than --quick, and the JSON it writes is checked (fields and sanity,
not the timings)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(script, args, timeout=240):
    cmd = [sys.executable, os.path.join(REPO, "bench", script)] + args
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def test_draft_latency_quick(tmp_path):
    out, png = tmp_path / "dl.json", tmp_path / "dl.png"
    proc = _run("draft_latency.py", [
        "--quick", "--presets", "smollm2", "--blocks", "4", "--contexts", "64", "--batch", "1", "2",
        "--tau", "3", "--repeats", "3", "--min-repeats", "2", "--warmup", "1", "--budget", "0.05",
        "--max-wait", "0.5", "--threads", "1", "--json", str(out), "--png", str(png)])
    assert "ref/fused" in proc.stdout and "per-op breakdown" in proc.stdout
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["copy_bandwidth_gbs"] > 0 and meta["tau"] == 3 and meta["cuda_graphs"] is False
    assert meta["paths"] == ["fused", "reference"] and "smollm2" in meta["presets"]
    rows = data["rows"]
    assert [(r["batch"], r["context"], r["block_size"]) for r in rows] == [(1, 64, 4), (2, 64, 4)]
    for r in rows:
        assert r["preset"] == "smollm2" and r["dtype"] == "float32" and r["tau"] == 3
        for key in ("fused_ms", "reference_ms", "fused_min_ms", "reference_min_ms", "speedup", "floor_ms",
                    "x_floor_fused", "x_floor_reference"):
            assert isinstance(r[key], float) and r[key] > 0, key
        assert r["bytes_weights"] > 49152 * 576 * 4  # at least the fp32 LM head
        assert r["bytes_kv"] == 5 * r["batch"] * (64 + 3) * 3 * 64 * 2 * 4
        assert r["check"]["hidden_rel_err"] < 1e-3
        assert r["repeats"] >= 2 and isinstance(r["noisy"], bool)
        for path in ("fused", "reference"):
            b = r["breakdown"][path]
            pieces = [b[f"{p}_ms"] for p in ("project", "inject", "attention", "layers_rest", "lm_head")]
            assert all(isinstance(x, float) and x > 0 for x in pieces)
            assert b["sum_ms"] == pytest.approx(sum(pieces))
    assert data["skipped"] == []
    if HAVE_MPL:
        assert png.stat().st_size > 1000


def test_e2e_quick(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    have_sets = importlib.util.find_spec("dflash_ext.prompts") is not None
    sets = ["--sets", "mtbench", "--n", "1"] if have_sets else ["--sets"]
    proc = _run("e2e.py", [
        "--quick", *sets, "--prompts", "What is the capital of France?", "--max-new-tokens", "12",
        "--block-size", "4", "--threads", "1", "--no-progress", "--json", str(out), "--png", str(png)])
    assert "UNTRAINED" in proc.stdout or "untrained" in proc.stdout
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["drafter_fresh"] is True and meta["block_size"] == 4 and meta["temperature"] == 0
    assert meta["max_new_tokens"] == 12 and meta["dtype"] == "float32"
    names = (["mtbench"] if have_sets else []) + ["custom"]
    assert list(data["sets"]) == names
    assert [p["set"] for p in data["prompts"]] == names
    for p in data["prompts"]:
        assert p["identical"] is True and p["prompt_tokens"] > 5
        for run in ("baseline", "dflash"):
            s = p[run]
            assert 1 <= s["new_tokens"] <= 12 and s["total_s"] > 0
        assert len(p["dflash"]["histogram"]) == 4
        assert sum(p["dflash"]["histogram"]) == p["dflash"]["steps"]
    for agg in list(data["sets"].values()) + [data["overall"]]:
        for key in ("baseline_tokens_per_s", "dflash_tokens_per_s", "speedup", "tau", "draft_ms_per_step",
                    "verify_ms_per_step", "other_ms_per_step"):
            assert isinstance(agg[key], float), key
        assert agg["speedup"] > 0 and 1.0 <= agg["tau"] <= 4
        assert len(agg["histogram"]) == 4 and sum(agg["histogram"]) == agg["steps"]
        assert agg["draft_frac"] + agg["verify_frac"] + agg["other_frac"] == pytest.approx(1.0)
        assert agg["mismatches"] == 0 and agg["compared"] == agg["prompts"]
    assert data["overall"]["prompts"] == len(names)
    if HAVE_MPL:
        assert png.stat().st_size > 1000
