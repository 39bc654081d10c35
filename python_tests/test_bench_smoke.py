"""Smoke tests of bench.draft_latency, bench.e2e, bench.bench_ops, bench.verify_numerics,
bench.rollback, bench.tree and bench.training.learning_curve: each runs (``python -m bench.<name>`` from the repository
root) with options even smaller than --quick, and the JSON it writes is checked (fields and
sanity, not the timings). bench_ops's CUDA-only columns (bytes moved, copy bandwidth, SDPA)
are checked on CPU through its pure helpers and a run with them forced on; its --isa levels
through a faked dflash_ext.ops.hardware ISA API."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(module, args, timeout=240):
    """python -m bench.<module> ARGS from the repository root (as a user runs it)."""
    cmd = [sys.executable, "-m", f"bench.{module}"] + args
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_draft_latency_quick(tmp_path):
    out, png = tmp_path / "dl.json", tmp_path / "dl.png"
    proc = _run("draft_latency", [
        "--quick", "--presets", "smollm2", "--blocks", "4", "--contexts", "64", "--batch", "1", "2",
        "--tau", "3", "--min-repeats", "2", "--warmup", "1", "--budget", "0.05",
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


@pytest.mark.slow
def test_e2e_quick(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    have_sets = importlib.util.find_spec("dflash_ext.prompts") is not None
    sets = ["--sets", "mtbench", "--n", "1"] if have_sets else ["--sets"]
    proc = _run("e2e", [
        "--quick", *sets, "--prompts", "What is the capital of France?", "--max-new-tokens", "12",
        "--block-size", "4", "--threads", "1", "--dtype", "float32", "--loops", "ours,hf", "--no-progress",
        "--json", str(out), "--png", str(png)])
    assert "UNTRAINED" in proc.stdout or "untrained" in proc.stdout
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["drafter_fresh"] is True and meta["block_size"] == 4 and meta["temperature"] == 0
    assert meta["max_new_tokens"] == 12 and meta["dtype"] == "float32"
    names = (["mtbench"] if have_sets else []) + ["custom"]
    assert list(data["sets"]) == names
    assert [p["set"] for p in data["prompts"]] == names
    assert "transformers' DFlash loop" in proc.stdout
    assert {r["name"] for r in data["overall"]["peer"]} >= set(names)
    for p in data["prompts"]:
        assert p["identical"] is True and p["hf_identical"] is True and p["prompt_tokens"] > 5
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


@pytest.mark.slow
def test_e2e_temperatures_and_verify_rules(tmp_path):
    """--temperature 0.7 1.0 --verify rejection match: one configuration each on the same
    prompts, each in its own JSON, and the summary of all (tau, accepted drafts per step,
    tokens/s, the speedup over the target alone); --drafter-dtype: the drafter in bf16 beside the
    fp32 target."""
    out = tmp_path / "e2e.json"
    proc = _run("e2e", [
        "--quick", "--sets", "--prompts", "What is the capital of France?", "--max-new-tokens", "8",
        "--block-size", "4", "--threads", "1", "--dtype", "float32", "--drafter-dtype", "bfloat16",
        "--no-progress", "--no-warmup",
        "--temperature", "0.7", "1.0", "--verify", "rejection", "match", "--json", str(out), "--png", ""])
    rows = json.loads(out.read_text())["configs"]
    assert [(r["temperature"], r["verify"]) for r in rows] == [
        (0.7, "rejection"), (0.7, "match"), (1.0, "rejection"), (1.0, "match")]
    for r in rows:
        assert 1.0 <= r["tau"] <= 4 and r["accepted_drafts_per_step"] == pytest.approx(r["tau"] - 1)
        assert r["dflash_tokens_per_s"] > 0 and r["target_tokens_per_s"] > 0 and r["speedup"] > 0
        data = json.loads((tmp_path / f"e2e_T{r['temperature']:g}_{r['verify']}.json").read_text())
        assert data["metadata"]["temperature"] == r["temperature"] and data["metadata"]["verify"] == r["verify"]
        assert (data["metadata"]["dtype"], data["metadata"]["drafter_dtype"]) == ("float32", "bfloat16")
    assert "accepted drafts/step" in proc.stdout and "float32 (drafter bfloat16)" in proc.stdout


# --------------------------------------------------------------------------- bench_ops

def _bench_module(name):
    """bench.<name> imported (to test its pure helpers)."""
    return importlib.import_module(f"bench.{name}")


def _bench_ops():
    """bench.bench_ops (its CUDA-only helpers are pure functions)."""
    return _bench_module("bench_ops")


TINY_OPS = ["--presets", "smollm2", "--tokens", "1", "4", "--contexts", "64", "--batch", "1", "2",
            "--dtype", "float32", "--min-repeats", "1", "--warmup", "1", "--budget", "0.01",
            "--max-wait", "0.5", "--threads", "1"]
CUDA_KEYS = ("min_bytes", "fused_gbps", "pct_of_copy", "sdpa_ms", "ratio_vs_sdpa", "sdpa_min_ms")


def test_min_bytes_by_hand():
    bo = _bench_ops()
    p = dict(H=8, Hq=4, Hkv=2, D=4, N=3, k=2)
    # fc_weight [8, 16] + norm_weight [8] + features 2 x [5, 8] + out [5, 8], bf16
    assert bo.min_bytes("project_features", p, 2, 5) == (128 + 8 + 80 + 40) * 2
    # k/v weights 2 x [3, 8, 8] + k_norm_weight [3, 4] + ctx [3, 8] + cos/sin rows 2 x [3, 4]
    # + written K/V rows 2 x [3 layers, 3, 2, 4], fp32; + positions and slots (int64)
    assert bo.min_bytes("inject_context_kv", p, 4, 3) == (384 + 12 + 24 + 24 + 144) * 4 + 2 * 3 * 8
    # q and out 2 x [2, 3, 4, 4] + K/V of context and block 2 x [2, 5 + 3, 2, 4], fp16;
    # + cache offsets and lengths (int64)
    assert bo.min_bytes("block_attention", p, 2, 3, context=5, batch=2) == (192 + 256) * 2 + 2 * 2 * 8
    # weight [6, 8] + x [3, 8] + out [3, 6], fp32
    assert bo.min_bytes("skinny_linear", p, 4, 3, weight_shape=(6, 8)) == (48 + 24 + 18) * 4
    with pytest.raises(ValueError):
        bo.min_bytes("nope", p, 2, 1)
    # add_bandwidth: GB/s from the row's preset / dtype and its fused time
    row = dict(op="block_attention", preset="smollm2", dtype="bfloat16", tokens=16, context=512, batch=2,
               fused_ms=0.5)
    bo.add_bandwidth(row, copy_gbps=100.0)
    assert row["min_bytes"] == 2 * (2 * 2 * 16 * 9 * 64 + 2 * 2 * 528 * 3 * 64) + 2 * 2 * 8
    assert row["fused_gbps"] == pytest.approx(row["min_bytes"] / 0.5e-3 / 1e9)
    assert row["pct_of_copy"] == pytest.approx(row["fused_gbps"])


@pytest.mark.parametrize("gqa", [True, False])
def test_sdpa_problem_matches_reference(gqa):
    import torch

    from bench import baselines
    from dflash_ext.ops import reference
    gen = torch.Generator().manual_seed(0)
    Bsz, Bq, Hq, Hkv, D, n = 3, 4, 6, 2, 8, 5
    q = torch.randn(Bsz, Bq, Hq, D, generator=gen)
    k_block, v_block = (torch.randn(Bsz, Bq, Hkv, D, generator=gen) for _ in range(2))
    k_cache, v_cache = (torch.randn(20, Hkv, D, generator=gen) for _ in range(2))
    offsets = torch.tensor([9, 0, 15])  # not back to back, not in order
    scale = 0.3
    for lens in (torch.full((Bsz,), n), torch.zeros(Bsz, dtype=torch.int64)):
        prob = baselines.sdpa_problem(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale, gqa=gqa)
        qs, k, v, kwargs = prob
        L = int(lens[0]) + Bq
        assert qs.shape == (Bsz, Hq, Bq, D) and k.shape == v.shape == (Bsz, Hkv if gqa else Hq, L, D)
        assert qs.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert kwargs == (dict(scale=scale, enable_gqa=True) if gqa else dict(scale=scale))
        out = baselines.sdpa_block_attention(prob).transpose(1, 2)
        ref = reference.block_attention(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="same context length"):
        baselines.sdpa_problem(q, k_block, v_block, k_cache, v_cache, offsets, torch.tensor([1, 2, 1]), scale)


def test_copy_bandwidth_cpu():
    bo = _bench_ops()
    c = bo._common.copy_bandwidth("cpu", 1 << 20, warmup=1, min_repeats=1, budget=0.01, max_s=0.5)
    assert c["copy_bytes"] == 1 << 20 and c["copy_repeats"] >= 1 and c["copy_ms"] > 0
    assert c["copy_gbps"] == pytest.approx(2 * (1 << 20) / c["copy_ms"] / 1e6)


def test_bench_ops_cpu_has_no_cuda_columns(tmp_path):
    out = tmp_path / "ops.json"
    proc = _run("bench_ops", TINY_OPS + ["--json", str(out)])
    for col in ("fused_gbps", "pct_of_copy", "sdpa_ms", "ratio_vs_sdpa", "Copy bandwidth"):
        assert col not in proc.stdout
    data = json.loads(out.read_text())
    assert "copy_gbps" not in data["metadata"]
    assert [r["op"] for r in data["rows"]] == ["project_features"] * 2 + ["inject_context_kv"] * 2 + [
        "block_attention"] * 4 + ["skinny_linear"] * 8  # q_proj, up_proj, down_proj, lm_head at T 1, 4
    assert [r["weight"] for r in data["rows"][-8::2]] == ["q_proj", "up_proj", "down_proj", "lm_head"]
    for r in data["rows"]:
        assert r["fused_ms"] > 0 and not any(k in r for k in CUDA_KEYS)
        assert r["eager_ms"] > 0 and r["ratio"] == pytest.approx(r["eager_ms"] / r["fused_ms"])
        assert (r["goal"] == "-") == (r["op"] == "block_attention")  # context 64: outside the attention goal
    assert data["metadata"]["cpu_model"] and data["metadata"]["git_commit"]


def test_bench_ops_isa_levels(tmp_path, capsys, monkeypatch):
    """--isa all: one run per level up to the detected one, inside forced_cpu_isa, with the
    level and the path of each op in every row (the hardware API is faked here)."""
    import contextlib
    from dflash_ext.ops import hardware
    bo = _bench_ops()
    state = dict(level="avx512", forced=[])

    @contextlib.contextmanager
    def forced_cpu_isa(level):
        prev, state["level"] = state["level"], level
        state["forced"].append(level)
        try:
            yield
        finally:
            state["level"] = prev
    monkeypatch.setattr(hardware, "cpu_isa", lambda: dict(detected="avx512", active=state["level"],
                                                          features=["avx2", "avx512"]), raising=False)
    monkeypatch.setattr(hardware, "forced_cpu_isa", forced_cpu_isa, raising=False)
    monkeypatch.setattr(hardware, "cpu_paths", lambda dtype, rows=16: {
        op: f"{op[:4]}-{state['level']}-{rows}" for op in bo.OPS}, raising=False)
    out = tmp_path / "ops.json"
    args = TINY_OPS + ["--ops", "project_features", "block_attention", "--batch", "1", "--json", str(out)]
    assert bo.main(args + ["--isa", "all"]) == 0
    assert state["forced"] == ["avx2", "avx512"] and state["level"] == "avx512"
    stdout = capsys.readouterr().out
    assert "ISA detected avx512, active avx512" in stdout and "isa" in stdout and "path" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["isa"], r["op"], r["tokens"]) for r in rows] == [
        (isa, op, t) for isa in ("avx2", "avx512") for op in ("project_features", "block_attention") for t in (1, 4)]
    for r in rows:
        assert r["path"] == f"{r['op'][:4]}-{r['isa']}-{r['tokens']}"
    with pytest.raises(SystemExit):
        bo.parse_args(TINY_OPS + ["--isa", "amx_bf16"])  # above the detected level


def test_bench_ops_cuda_columns_forced_on_cpu(tmp_path, capsys):
    """The CUDA-only code path (copy bandwidth, fused_gbps, SDPA timing and check), run on CPU."""
    import torch
    bo = _bench_ops()
    out = tmp_path / "ops.json"
    threads = torch.get_num_threads()
    try:
        assert bo.main(TINY_OPS + ["--copy-mib", "1", "--json", str(out)], extras=True) == 0
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert "# Copy bandwidth" in stdout and "ratio_vs_sdpa" in stdout and "pct_of_copy" in stdout
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["copy_gbps"] > 0 and meta["copy_bytes"] == 1 << 20 and isinstance(meta["sdpa_enable_gqa"], bool)
    for r in data["rows"]:
        p = bo.PRESETS[r["preset"]]
        assert r["min_bytes"] == bo.min_bytes(r["op"], p, 4, r["tokens"], r["context"], r["batch"],
                                              r.get("weight_shape"))
        assert r["fused_gbps"] == pytest.approx(r["min_bytes"] / r["fused_ms"] / 1e6)
        assert r["pct_of_copy"] == pytest.approx(100 * r["fused_gbps"] / meta["copy_gbps"])
        sdpa = r["op"] == "block_attention"
        assert ("sdpa_ms" in r) == ("ratio_vs_sdpa" in r) == ("sdpa_min_ms" in r) == sdpa
        if sdpa:
            assert r["sdpa_ms"] > 0 and r["ratio_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["fused_ms"])


# --------------------------------------------------------------------------- verify_numerics

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_verify_reproduces_one_token_decoding(dtype):
    """The row-wise verify calls the kernels one-token decoding calls: its logits equal
    decoding's bitwise, row by row. The exact verify (streamed linear layers, attention
    one query at a time) equals decoding with streamed linear layers bitwise at B <= 4,
    where skinny_linear sums each row in the same order as for one row. Leaving either
    restores the model's own forward."""
    from dflash_ext.ops.linear import skinny_linear_streams
    from dflash_ext.testing.targets import tiny_target

    vn = _bench_module("verify_numerics")
    model = tiny_target().to(dtype)
    model.set_attn_implementation("sdpa")
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(skinny_linear_streams(torch.zeros(b, linear.in_features, dtype=dtype), linear.weight)
               for b in (1, 4))  # the tiny target's layers stream: the exact verify's premise
    prompt = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    result, cache, block, context = vn.compare(model, prompt, [2, 4, 5, 9])
    for b in (2, 4, 5, 9):
        row = result[b, "rowwise"]
        assert row["rows"] == b and row["bitwise_rows"] == b and row["max_abs_diff"] == 0.0
        assert result[b, "verify"]["argmax_rows"] >= b - 1  # plain verify: last bits only
    for b in (2, 4):
        row = result[b, "exact"]
        assert row["rows"] == b and row["bitwise_rows"] == b and row["max_abs_diff"] == 0.0
    assert cache.get_seq_length() == context and block.shape == (1, 9)
    # Leaving the verify kinds restores the model: a plain pass equals a fresh model's.
    assert "forward" not in vars(linear) and model.config._attn_implementation == "sdpa"
    fresh = tiny_target().to(dtype)
    fresh.set_attn_implementation("sdpa")
    with torch.no_grad():
        ids = torch.tensor([prompt + block[0].tolist()])
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)


@pytest.mark.slow
def test_verify_numerics_quick(tmp_path):
    out = tmp_path / "vn.json"
    proc = _run("verify_numerics", ["--quick", "--n", "1", "--sizes", "2", "3", "--threads", "1",
                                       "--min-repeats", "1", "--budget", "0.01", "--json", str(out)])
    assert "row-wise B / 1 token" in proc.stdout
    data = json.loads(out.read_text())
    assert [(r["dtype"], r["block_size"]) for r in data["rows"]] == [
        ("bfloat16", 2), ("bfloat16", 3), ("float32", 2), ("float32", 3)]
    for r in data["rows"]:
        assert r["verify_rows"] == r["rowwise_rows"] == 2 * r["block_size"]  # one HumanEval + one MT-Bench prompt
        assert r["rowwise_bitwise_rows"] == r["rowwise_rows"]
        assert r["exact_rows"] == r["verify_rows"]
        assert r["one_ms"] > 0 and r["verify_x"] > 0 and r["rowwise_x"] > 0 and r["exact_x"] > 0


# --------------------------------------------------------------------------- rollback

@pytest.mark.slow
def test_rollback_quick(tmp_path):
    out = tmp_path / "rb.json"
    proc = _run("rollback", ["--quick", "--reps", "2", "--warmup", "1", "--threads", "1", "--hidden", "64",
                             "--layers", "2", "--vocab", "256", "--context", "16", "--block", "4", "--window", "6",
                             "--full-every", "2", "--json", str(out)])
    assert "rollback ms/step" in proc.stdout
    data = json.loads(out.read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert set(rows) == {"qwen3", "gpt_oss", "qwen3_5"} and data["metadata"]["block"] == 4
    assert not rows["qwen3"]["records"] and rows["gpt_oss"]["records"] and rows["qwen3_5"]["records"]
    assert "DynamicSlidingWindowLayer" in rows["gpt_oss"]["cache_layers"]
    assert "LinearAttentionLayer" in rows["qwen3_5"]["cache_layers"]
    for r in rows.values():
        assert r["pass_ms"] > 0 and r["recorded_pass_ms"] > 0 and r["crop_ms"] > 0 and r["reps"] == 2
    assert rows["qwen3"]["rollback_ms"] == rows["qwen3"]["crop_ms"]  # nothing recorded: the crop alone
    for r in (rows["gpt_oss"], rows["qwen3_5"]):
        assert r["rollback_ms"] == pytest.approx(r["pass_and_rollback_ms"] - r["pass_ms"])


# --------------------------------------------------------------------------- training.learning_curve

def test_learning_curve_reads_profiles_and_transcribed_logs(tmp_path):
    first, second = tmp_path / "run-a", tmp_path / "run-b"
    first.mkdir(), second.mkdir()
    (first / "eval.jsonl").write_text(json.dumps(
        dict(step=50, slot_tokens=1000, tau=1.25, accept=[0.2, 0.04, 0.01, 0.003, 0.0])) + "\n")
    (second / "eval.jsonl").write_text(json.dumps(dict(step=10, slot_tokens=200, tau=1.3, p1=0.25, p2=0.05,
                                                       p4=0.002)) + "\n")
    third = tmp_path / "run-b4"  # B = 4: three slots in the profile, no P(first 4 ok)
    third.mkdir()
    (third / "eval.jsonl").write_text(json.dumps(dict(step=20, slot_tokens=300, tau=1.4, accept=[0.3, 0.08, 0.02]))
                                      + "\n")
    proc = _run("training.learning_curve", [str(first / "eval.jsonl"), f"{second / 'eval.jsonl'}+1000",
                                      f"{third / 'eval.jsonl'}+1200"])
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1] == " " or line[:1].isdigit()]
    assert ["50", "1,000", "1.250", "0.200", "0.040", "0.003"] in rows
    assert ["10", "1,200", "1.300", "0.250", "0.050", "0.002"] in rows  # the offset is added
    assert ["20", "1,500", "1.400", "0.300", "0.080", "-"] in rows
    assert "# run-a:" in proc.stdout and "# run-b:" in proc.stdout


def test_gpu_e2e_small(tmp_path):
    """bench.gpu_e2e --small on the CPU: every row (the target alone eager and static, our step
    eager and static, transformers' DFlash loop), the speedup table at the paper's τ, the
    forced-acceptance check; nothing compiles off CUDA."""
    proc = _run("gpu_e2e", ["--small", "--threads", "1", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert "speedup(τ)" in proc.stdout and "forced acceptance" in proc.stdout
    data = json.loads((tmp_path / "gpu_e2e.json").read_text())
    assert data["metadata"]["small"] and data["metadata"]["block"] == 4
    assert data["metadata"]["drafter"] == dict(num_layers=5, block_size=4, target_layer_ids=[1, 9, 17, 25, 33])
    (row,) = data["contexts"]
    assert row["context"] == 24
    for key in ("alone", "alone_static"):
        assert row[key]["ms"] > 0 and row[key]["compiled"] is False
    for key in ("ours", "ours_static"):
        step = row[key]
        assert step["compiled"] is False and 1 <= step["measured_tau"] <= 4
        parts = [step[f"{p}_ms"] for p in ("draft", "verify", "rollback")]
        assert all(p > 0 for p in parts) and step["step_ms"] >= step["verify_ms"]
    assert row["hf"]["step_ms"] > 0
    assert [r["tau"] for r in row["speedup"]] == [6.49, 7.87, 5.48]
    for r in row["speedup"]:
        assert r["ours_vs_eager"] == pytest.approx(r["tau"] * row["alone"]["ms"] / row["ours"]["step_ms"])
        assert r["hf_vs_static"] == pytest.approx(r["tau"] * row["alone_static"]["ms"] / row["hf"]["step_ms"])
    oracle = data["oracle"]
    assert oracle["ok"] and oracle["static"]["equal_prefix"] == oracle["static"]["tokens"] == 9
    assert oracle["dynamic"]["tau"] > 3
    assert "speedup(τ)" in (tmp_path / "gpu_e2e.txt").read_text()
    batch = data["batch"]  # the batch sweep: batches 1 and 2, every row its single output (fp32)
    assert [r["batch"] for r in batch["rows"]] == [1, 2] and batch["prompts"] == 3
    for r in batch["rows"]:
        assert r["dflash"]["rows_equal"] == r["alone"]["rows_equal"] == 3
        assert set(r["speedup_at_tau"]) == {"avg greedy", "MATH-500", "avg T=1"}
    assert "batched: speedup(τ)" in proc.stdout
    tree = row["tree"]  # the tree row: a chain step and a step per node budget
    assert tree["chain_ms"] > 0 and tree["chain_pass_tokens"] == 4
    assert [r["budget"] for r in tree["trees"]] == [4, 8, 16, 32, 64]
    for r in tree["trees"]:
        assert r["pass_tokens"] == r["budget"] + 1 and r["over_chain"] == pytest.approx(r["step_ms"] / tree["chain_ms"])
    assert "tree steps: median ms per step" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_e2e_script_refuses_without_cuda(tmp_path):
    """tools/gpu/gpu_e2e.sh stops at once, before building anything, and says how to run its
    Python part on the CPU."""
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu", "gpu_e2e.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "bench.gpu_e2e --small" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_batch_quick(tmp_path):
    """bench.batch --tiny: DFlash, target_generate (plain and streamed) and transformers' generate
    at each batch size over the same prompts, every DFlash and target_generate row equal to its
    single output (float32), the speedup against the fastest baseline, the table and the plot."""
    proc = _run("batch", ["--tiny", "--prompts", "5", "--batches", "1", "2", "4", "--max-new-tokens", "8",
                          "--threads", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "batch.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2, 4] and data["prompts"] == 5
    for row in data["rows"]:
        for key in ("dflash", "alone", "hf"):
            assert row[key]["rows"] == 5 and row[key]["tokens"] == 40 and row[key]["tokens_per_second"] > 0
        assert row["dflash"]["rows_equal"] == row["alone"]["rows_equal"] == 5
        assert row["baseline"] in ("alone", "streamed", "hf")  # the fastest of the three target-alone runs
        assert row[row["baseline"]]["tokens_per_second"] == max(row[k]["tokens_per_second"]
                                                                for k in ("alone", "streamed", "hf") if k in row)
        assert row["speedup"] == pytest.approx(row["dflash"]["tokens_per_second"]
                                               / row[row["baseline"]]["tokens_per_second"])
        assert 1 <= row["dflash"]["tau"] <= 4 and row["alone"]["steps"] == 8 * -(-5 // row["batch"])
    assert "speedup" in proc.stdout and (tmp_path / "batch.png").exists()


def test_tree_quick(tmp_path):
    """bench.tree --tiny: the chain's tau and each tree budget's, every tree output equal to the
    chain's (greedy, float32), the table."""
    proc = _run("tree", ["--tiny", "--prompts", "2", "--max-new-tokens", "8", "--budgets", "2", "8",
                         "--threads", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "tree.json").read_text())
    assert data["depth"] == 3 and data["chain"]["tokens"] == 16 and data["chain"]["pass_tokens"] == 4
    assert [r["budget"] for r in data["trees"]] == [2, 8]
    for row in data["trees"]:
        assert row["equal"] == 2 and row["tokens"] == 16 and row["pass_tokens"] == row["budget"] + 1
        assert 1 <= row["tau"] <= 4 and row["tok_s"] > 0
    assert data["alone"]["tokens"] == 16 and data["alone"]["tok_s"] > 0  # timed in the same run
    assert "pass tokens" in proc.stdout and "x alone" in proc.stdout


def _fake_binary(folder, name, lines, code=0):
    path = folder / name
    path.write_text("#!/bin/sh\ncat <<'OUT'\n" + "\n".join(lines) + "\nOUT\nexit %d\n" % code)
    path.chmod(0o755)


def test_llama_cpp_peer_parses_llama_cpps_own_timings(tmp_path):
    """bench.llama_cpp over stand-ins for llama.cpp's two programs (llama.cpp is not installed
    here): the figures are their printed decode timings, summed per set; a run whose line is
    missing is an error that shows its output."""
    _fake_binary(tmp_path, "llama-completion", [
        "0.02.087 I common_perf_print: prompt eval time =      50.00 ms /    20 tokens (    2.50 ms per token)",
        "0.02.087 I common_perf_print:        eval time =    1000.00 ms /    99 runs   (   10.10 ms per token,    99.00 tokens per second)"])
    _fake_binary(tmp_path, "llama-speculative-simple", [
        "decoded  100 tokens in    0.500 seconds, speed:  200.000 t/s", "n_draft   = 3", "n_predict = 100",
        "n_drafted = 120", "n_accept  = 60", "accept    = 50.000%"])
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    out = tmp_path / "peer.json"
    args = ["--bin", str(tmp_path), "--target-gguf", str(model), "--drafter-gguf", str(model), "--sets", "mtbench",
            "--n", "2", "--max-new-tokens", "8", "--json", str(out)]
    proc = _run("llama_cpp", args)
    assert "DFlash / target" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["sets"]] == ["mtbench", "all"] and len(data["records"]) == 2
    row = data["sets"][0]
    assert row["target"] == pytest.approx(99.0) and row["dflash"] == pytest.approx(200.0)
    assert row["speedup"] == pytest.approx(200 / 99) and row["acceptance"] == pytest.approx(0.5)
    _fake_binary(tmp_path, "llama-speculative-simple", ["error: unknown argument: --spec-type"], code=1)
    proc = subprocess.run([sys.executable, "-m", "bench.llama_cpp"] + args, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown argument: --spec-type" in proc.stderr and "exited 1" in proc.stderr
