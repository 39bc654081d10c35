"""`python -m dflash_ext generate --baseline` (what ./run.sh demo runs) tells what happened:
the baseline is the fastest target alone measured here, a block size of 1 is said to be the
target alone (no speedup claimed) with the drafter's own best run beside it, and the output
comparison says what it means in the dtype."""
import json

import pytest
import torch

pytest.importorskip("transformers")

import dflash_ext.cli.demo  # noqa: E402
import dflash_ext.decode.autotune  # noqa: E402
import dflash_ext.model.pretrained  # noqa: E402
from dflash_ext import BlockSizeChoice  # noqa: E402
from dflash_ext.cli.main import main  # noqa: E402
from dflash_ext.testing.targets import tiny_target  # noqa: E402

_MARGIN = dflash_ext.cli.demo._CONTENDER_MARGIN


class _Tokenizer:
    """Stands in for a tokenizer: a fixed prompt, tokens decoded as numbers."""
    eos_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt=True, return_dict=True):
        return {"input_ids": [3, 14, 15, 92, 65, 35, 89, 79]}

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


@pytest.fixture
def tiny_run(monkeypatch, tmp_path):
    """main() on a tiny random target with a fresh drafter; returns (stderr text, JSON report)."""
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda path=None, dtype=torch.float32, device="cpu", tokenizer=True:
                        (tiny_target().to(dtype), _Tokenizer()))

    def run(capsys, *extra):
        out = tmp_path / "report.json"
        main(["generate", "--baseline", "--fresh-drafter", "--draft-layers", "1", "--max-new-tokens", "6",
              "--threads", "1", "--json", str(out), *extra])
        return capsys.readouterr().err, json.loads(out.read_text())

    return run


def test_block_size_one_is_called_the_target_alone(tiny_run, monkeypatch, capsys):
    chosen = BlockSizeChoice(1, {1: 1.0, 2: 1.4, 4: 1.6}, {1: 0.01, 2: 0.02, 4: 0.03}, {1: 100.0, 2: 70.0, 4: 80.0},
                             "a test's")
    monkeypatch.setattr(dflash_ext.decode.autotune, "choose_block_size", lambda *a, **k: chosen)
    err, report = tiny_run(capsys, "--dtype", "float32")
    assert "drafting does not pay here" in err and "no DFlash speedup here" in err
    assert "DFlash (block size" not in err  # the speedup line of a run that drafted
    assert report["dflash"]["block_size"] == 1
    assert report["dflash_best_drafting"]["block_size"] == 4  # the best B > 1 of the expected speeds
    assert "the drafter at block size 4 (tau" in err and report["speedup_best_drafting"] > 0


def test_baseline_is_the_fastest_target_alone_measured(tiny_run, capsys):
    err, report = tiny_run(capsys, "--dtype", "auto", "--block-size", "4")
    timings = report["target_alone_ms_per_token"]
    assert set(timings) == {"float32 with F.linear", "float32 with skinny_linear", "bfloat16 with F.linear",
                            "bfloat16 with skinny_linear"}
    fastest = min(timings, key=timings.get)
    contenders = report["baseline_contenders"]  # the ways that timed close to the fastest, fastest first
    assert contenders[0] == fastest
    assert contenders == sorted((c for c in timings if timings[c] <= _MARGIN * timings[fastest]), key=timings.get)
    assert report["baseline"]["config"] in contenders
    assert report["dtype"] == fastest.split(" with ")[0]  # auto: the dtype of the fastest target alone
    assert f"the fastest way measured here ({report['baseline']['config']}" in err
    assert "DFlash (block size 4" in err.split("===")[1].splitlines()[1]  # the first line of results
    if report["dtype"] == "bfloat16":
        assert "--dtype float32 gives the exact comparison" in err


def _set_timings(monkeypatch, timings=None, others=3.0):
    """fastest_target_alone with the models it makes and set timings: `timings` (default fp32 with
    F.linear at 1.0), every other way `others`."""
    real = dflash_ext.cli.demo.fastest_target_alone
    timings = timings or {(torch.float32, False): 1.0}

    def set_timings(model, ids, device):
        measured, models = real(model, ids, device)
        return {c: timings.get(c, others) for c in measured}, models
    monkeypatch.setattr(dflash_ext.cli.demo, "fastest_target_alone", set_timings)


@pytest.mark.parametrize("repeats", [1, 3])
def test_speedup_is_the_median_of_pairs_run_alternately(tiny_run, monkeypatch, capsys, repeats):
    """--repeats N: DFlash and the target alone each run N times (after one warm-up each),
    alternately, with the same arguments each time, and the speedup is the median of the N pairs' ratios."""
    import dflash_ext.decode.loop

    _set_timings(monkeypatch)  # one way near the fastest: one target alone a pair

    order, dflash_calls = [], []
    for name in ("spec_generate", "target_generate"):
        real = getattr(dflash_ext.decode.loop, name)

        def spy(*a, _real=real, _name=name, **k):
            order.append(_name)
            if _name == "spec_generate":
                dflash_calls.append((a[3:], {key: v for key, v in k.items() if key not in ("on_tokens", "generator")}))
            return _real(*a, **k)
        monkeypatch.setattr(dflash_ext.decode.loop, name, spy)
    err, report = tiny_run(capsys, "--dtype", "float32", "--block-size", "4", "--repeats", str(repeats))
    # a warm-up and the streamed run of each, the further pairs, then (where the fastest target alone runs in
    # another dtype) the target alone in DFlash's dtype for the output comparison
    pairs = ["spec_generate"] * 2 + ["target_generate"] * 2 + ["spec_generate", "target_generate"] * (repeats - 1)
    assert order[:len(pairs)] == pairs and order[len(pairs):] in ([], ["target_generate"])
    timed = dflash_calls[1:]  # after the warm-up: the streamed run, then the repeats
    assert len(timed) == repeats and all(call == timed[0] for call in timed)
    if repeats == 1:
        assert "speedup_runs" not in report and "pairs run alternately" not in err
    else:
        ratios = report["speedup_runs"]
        assert len(ratios) == repeats and all(r > 0 for r in ratios)
        assert report["speedup"] == sorted(ratios)[repeats // 2]
        assert f"{report['speedup']:.2f}x, the median of {repeats} pairs run alternately" in err


def test_each_pair_takes_the_fastest_run_of_the_ways_timed_close(tiny_run, monkeypatch, capsys):
    """The ways whose pass timed within _MARGIN of the fastest all run in every pair, and the pair's
    baseline is the fastest run among them (here the second in the pass timing), never a slower one."""
    import dflash_ext.decode.loop

    _set_timings(monkeypatch, {(torch.float32, False): 1.0, (torch.float32, True): _MARGIN - 0.05,
                               (torch.bfloat16, False): _MARGIN + 0.05, (torch.bfloat16, True): 2 * _MARGIN})
    real = dflash_ext.decode.loop.target_generate
    seconds = {False: 3.0, True: 2.0}  # the runs: skinny_linear faster than F.linear, whatever the pass said
    runs = []

    def timed(*a, stream_linears=False, **k):
        res = real(*a, stream_linears=stream_linears, **k)
        if "generator" in k:  # a timed run (seeded), not a warm-up
            res.total_time = seconds[stream_linears]
            runs.append(stream_linears)
        return res
    monkeypatch.setattr(dflash_ext.decode.loop, "target_generate", timed)
    err, report = tiny_run(capsys, "--dtype", "float32", "--block-size", "4", "--repeats", "3")
    assert report["baseline_contenders"] == ["float32 with F.linear", "float32 with skinny_linear"]
    assert runs == [False, True] * 3  # both ways in each of the 3 pairs (bf16 with F.linear: just outside)
    assert report["baseline"]["config"] == "float32 with skinny_linear"
    assert report["baseline_runs"] == ["float32 with skinny_linear"] * 3
    assert report["baseline"]["total_s"] == 2.0
    assert report["speedup_runs"][0] == pytest.approx(2.0 / report["dflash"]["total_s"])
    assert "of float32 with F.linear, float32 with skinny_linear, each run once" in err


@pytest.mark.parametrize("dflash_fastest", ["float32", "bfloat16"])
def test_auto_dtype_is_where_dflash_is_expected_fastest(monkeypatch, tmp_path, capsys, dflash_fastest):
    """--dtype auto with --block-size auto and a trained drafter: the block-size rule runs in
    each dtype and DFlash runs in the one of the higher expected tok/s, whichever dtype the
    fastest target alone (the baseline, here bf16) has; the block size chosen there is used."""
    from dflash_ext import DFlashDrafter
    from dflash_ext.testing.targets import tiny_target_config

    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda path=None, dtype=torch.float32, device="cpu", tokenizer=True:
                        (tiny_target().to(dtype), _Tokenizer()))
    _set_timings(monkeypatch, {(torch.bfloat16, True): 1.0}, others=2.0)  # bf16 with skinny_linear fastest
    calls = []

    def choose(target, drafter, context_len, **kwargs):
        dt = next(target.parameters()).dtype
        assert next(drafter.parameters()).dtype == dt  # each dtype's drafter against its target
        calls.append(dt)
        best = 3 if str(dt).endswith(dflash_fastest) else 2
        speeds = {1: 10.0, 2: 12.0, 3: 15.0} if best == 3 else {1: 10.0, 2: 11.0, 3: 9.0}
        return BlockSizeChoice(best, {1: 1.0, 2: 1.5, 3: 1.8}, {b: 0.1 for b in speeds}, speeds, "a test's")

    races = []

    def choose_all(pairs, context_len, **kwargs):  # every dtype in one call: timed in the same rounds
        races.append(len(pairs))
        return {key: choose(target, drafter, context_len) for key, (target, drafter) in pairs.items()}

    monkeypatch.setattr(dflash_ext.decode.autotune, "choose_block_sizes", choose_all)
    drafter = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=3)
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "report.json"
    main(["generate", "--baseline", "--drafter", str(tmp_path / "drafter"), "--max-new-tokens", "6", "--threads",
          "1", "--dtype", "auto", "--json", str(out)])
    err, report = capsys.readouterr().err, json.loads(out.read_text())
    assert sorted(map(str, calls)) == ["torch.bfloat16", "torch.float32"]  # timed once per dtype, not again
    assert races == [2]
    assert report["dtype"] == dflash_fastest and report["dflash"]["block_size"] == 3
    assert report["baseline"]["config"] == "bfloat16 with skinny_linear"  # the fastest target alone still
    assert report["dflash_expected_tokens_per_second"] == {dflash_fastest: 15.0,
                                                           ({"float32", "bfloat16"} - {dflash_fastest}).pop(): 11.0}
    assert f"-> {dflash_fastest}" in err and "where DFlash is expected fastest" in err


def test_bf16_output_line_says_why_and_how_to_get_the_exact_run(tiny_run, capsys):
    err, report = tiny_run(capsys, "--dtype", "bfloat16", "--block-size", "4")
    line = next(l for l in err.splitlines() if l.strip().startswith("output:"))
    assert "rounds differently from one-token decoding" in line and "--dtype float32" in line
    assert isinstance(report["identical_to_baseline"], bool)


@pytest.mark.slow
def test_demo_on_the_embedded_target_in_fp32(tmp_path, capsys):
    """The real demo, shortened: the shipped drafter, fp32, where the output must equal the
    target alone's exactly."""
    out = tmp_path / "demo.json"
    main(["generate", "--baseline", "--dtype", "float32", "--max-new-tokens", "12", "--json", str(out)])
    report = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert report["identical_to_baseline"] is True and "float32: exact" in err
    assert report["dflash"]["new_tokens"] == report["baseline"]["new_tokens"] == 12
    assert report["baseline"]["config"].startswith("float32") or report["baseline"]["config"].startswith("bfloat16")
    assert report["speedup"] > 0


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_generate_verify_picks_the_rule_at_temperature_above_zero(tiny_run, monkeypatch, capsys, rule):
    import dflash_ext.decode.loop

    seen = []
    real = dflash_ext.decode.loop.spec_generate

    def spy(*args, **kwargs):
        seen.append(kwargs["verify"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_ext.decode.loop, "spec_generate", spy)
    _, report = tiny_run(capsys, "--temperature", "1.0", "--verify", rule, "--block-size", "4")
    assert seen and set(seen) == {rule}
    assert report["dflash"]["verify"] == rule


def test_generate_tree_budget_runs_trees_and_keeps_the_greedy_output(tiny_run, monkeypatch, capsys):
    """--tree-budget 6: spec_generate is asked for trees (the match rule), and the output
    comparison with the target alone (the demo's own check) still finds it equal."""
    import dflash_ext.decode.loop

    seen = []
    real = dflash_ext.decode.loop.spec_generate

    def spy(*args, **kwargs):
        seen.append((kwargs["tree_budget"], kwargs["verify"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_ext.decode.loop, "spec_generate", spy)
    err, report = tiny_run(capsys, "--dtype", "float32", "--tree-budget", "6", "--block-size", "4")
    assert seen and set(seen) == {(6, "match")}
    assert report["dflash"]["tree_budget"] == 6 and report["dflash"]["block_size"] == 7  # a pass of 6 nodes + root
    assert report["identical_to_baseline"] is True, err


class _TextTokenizer(_Tokenizer):
    """A tokenizer whose ids follow the text: each character's code (mod 200), one token each."""

    def apply_chat_template(self, messages, add_generation_prompt=True, return_dict=True):
        return {"input_ids": [ord(c) % 200 for c in messages[-1]["content"]]}


def test_generate_a_prompts_file_in_batches(monkeypatch, tmp_path, capsys):
    """--prompts-file (JSONL or plain lines) --batch-size: one output per prompt, in order, each
    the target alone's greedy output (the baseline decodes the same batches), in --json too."""
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda path=None, dtype=torch.float32, device="cpu", tokenizer=True:
                        (tiny_target().to(dtype), _TextTokenizer()))
    prompts = ["a", "a longer prompt, of some thirty chars", "third", "x" * 60, "fifth"]
    jsonl, plain = tmp_path / "p.jsonl", tmp_path / "p.txt"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    plain.write_text("\n".join(prompts) + "\n\n")
    reports = []
    for path in (jsonl, plain):
        out = tmp_path / "report.json"
        main(["generate", "--prompts-file", str(path), "--batch-size", "2", "--baseline", "--fresh-drafter",
              "--draft-layers", "1", "--max-new-tokens", "6", "--threads", "1", "--dtype", "float32", "--block-size",
              "4", "--json", str(out)])
        stdout = capsys.readouterr().out
        reports.append(json.loads(out.read_text()))
        assert [line for line in stdout.splitlines() if line.startswith("===")] == \
            [f"=== prompt {i} ===" for i in range(len(prompts))]
    report = reports[0]
    assert [o["prompt"] for o in report["outputs"]] == prompts and report["dflash"]["batch_size"] == 2
    assert report["identical_to_baseline"] == [True] * len(prompts)
    assert [o["tokens"] for o in report["outputs"]] == [o["tokens"] for o in reports[1]["outputs"]]
    # The fastest target alone in another dtype (timed: bf16 here on some machines) is the speed
    # baseline, but the outputs are compared with the target alone in DFlash's own dtype.
    _set_timings(monkeypatch, {(torch.bfloat16, True): 1.0}, others=2.0)
    out = tmp_path / "report.json"
    main(["generate", "--prompts-file", str(jsonl), "--batch-size", "2", "--baseline", "--fresh-drafter",
          "--draft-layers", "1", "--max-new-tokens", "6", "--threads", "1", "--dtype", "float32", "--block-size", "4",
          "--json", str(out)])
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["baseline"]["config"] == "bfloat16 with skinny_linear"
    assert report["identical_to_baseline"] == [True] * len(prompts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    with pytest.raises(SystemExit):
        main(["generate", "--prompts-file", str(bad)])
    assert 'line 2 of' in capsys.readouterr().err


def test_a_prompts_file_baseline_is_the_fastest_run_of_the_ways_timed_close(monkeypatch, tmp_path, capsys):
    """--prompts-file --baseline times the target alone as one prompt does: every way whose pass
    timed within _MARGIN of the fastest decodes all the batches, and the fastest of those runs is
    the baseline (here the second in the pass timing)."""
    import time

    import dflash_ext.decode.loop

    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda path=None, dtype=torch.float32, device="cpu", tokenizer=True:
                        (tiny_target().to(dtype), _TextTokenizer()))
    _set_timings(monkeypatch, {(torch.float32, False): 1.0, (torch.float32, True): _MARGIN - 0.05})
    real = dflash_ext.decode.loop.target_generate
    runs = []

    def timed(*a, stream_linears=False, **k):
        if "generator" in k:  # a timed run (seeded), not a warm-up: F.linear made the slower way
            runs.append(stream_linears)
            time.sleep(0 if stream_linears else 0.3)
        return real(*a, stream_linears=stream_linears, **k)
    monkeypatch.setattr(dflash_ext.decode.loop, "target_generate", timed)
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\nthe second prompt\nthree\n")
    out = tmp_path / "report.json"
    main(["generate", "--prompts-file", str(prompts), "--batch-size", "2", "--baseline", "--fresh-drafter",
          "--draft-layers", "1", "--max-new-tokens", "6", "--threads", "1", "--dtype", "float32", "--block-size", "4",
          "--json", str(out)])
    err, report = capsys.readouterr().err, json.loads(out.read_text())
    assert report["baseline_contenders"] == ["float32 with F.linear", "float32 with skinny_linear"]
    assert runs == sorted(runs) and runs.count(False) == runs.count(True) >= 2  # each way over both batches, in turn
    assert report["baseline"]["config"] == "float32 with skinny_linear"
    assert report["identical_to_baseline"] == [True] * 3
    assert "the fastest of float32 with F.linear, float32 with skinny_linear" in err


@pytest.mark.parametrize("many", [False, True])
def test_the_output_comparison_reuses_the_baselines_run_in_dflash_dtype(tiny_run, monkeypatch, tmp_path, capsys,
                                                                        many):
    """Where the fastest target alone ran in another dtype (bf16 here) but the target alone in DFlash's
    dtype through F.linear was a contender, its run is what DFlash's output is compared with: the
    target alone is not decoded once more for the comparison (one prompt and --prompts-file alike)."""
    import time

    import dflash_ext.decode.loop

    _set_timings(monkeypatch, {(torch.bfloat16, True): 1.0, (torch.float32, False): _MARGIN - 0.05})
    real = dflash_ext.decode.loop.target_generate
    decoded = []  # (dtype, streamed) of every full-length run of the target alone

    def timed(target, ids, max_new_tokens, *a, stream_linears=False, **k):
        if max_new_tokens == 6:  # not a warm-up: fp32 the slower way (by wall time for the batches)
            decoded.append((next(target.parameters()).dtype, stream_linears))
            time.sleep(0 if stream_linears else 0.3)
        res = real(target, ids, max_new_tokens, *a, stream_linears=stream_linears, **k)
        for r in (res if isinstance(res, list) else [res]):  # and by its own clock for one prompt
            r.total_time = 1.0 if stream_linears else 2.0
        return res
    monkeypatch.setattr(dflash_ext.decode.loop, "target_generate", timed)
    if many:
        prompts = tmp_path / "p.txt"
        prompts.write_text("one\nthe second prompt\n")
        err, report = tiny_run(capsys, "--dtype", "float32", "--block-size", "4", "--prompts-file", str(prompts),
                               "--batch-size", "2")
    else:
        err, report = tiny_run(capsys, "--dtype", "float32", "--block-size", "4", "--repeats", "1")
    assert report["baseline_contenders"] == ["bfloat16 with skinny_linear", "float32 with F.linear"]
    assert report["baseline"]["config"] == "bfloat16 with skinny_linear"
    assert sorted(map(str, decoded)) == ["(torch.bfloat16, True)", "(torch.float32, False)"]  # nothing decoded again
    assert report["identical_to_baseline"] in (True, [True] * 2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fastest_target_alone_times_the_ways_in_rounds(family, monkeypatch):
    """The target alone's four ways on the CPU (fp32 / bf16, F.linear / skinny_linear) are timed
    in rounds, one pass of each a round, each inside its own linear-layer setting (entered and
    left untimed), so that a drift of the machine's speed cannot rank them."""
    import contextlib

    from dflash_ext.cli import demo
    from dflash_ext.decode import autotune  # interleaved_median_seconds: the clock of the rounds

    target = tiny_target(family)
    events, real_streamed = [], demo.streamed_linears

    @contextlib.contextmanager
    def spy(model, enabled):
        events.append(("enter", next(model.parameters()).dtype, enabled))
        with real_streamed(model, enabled=enabled):
            yield
        events.append("exit")

    monkeypatch.setattr(demo, "streamed_linears", spy)
    real_clock = autotune.time.perf_counter
    grad_in_timed_passes = []
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: events.append("t") or real_clock())
    from dflash_ext.ops import linear as linear_module  # linear_rows: what a streamed layer runs

    real_linear_rows = linear_module.linear_rows
    monkeypatch.setattr(linear_module, "linear_rows", lambda layer, x: (
        grad_in_timed_passes.append(torch.is_grad_enabled()), real_linear_rows(layer, x))[1])
    timings, models = demo.fastest_target_alone(target, [5, 17, 33, 2, 9], "cpu", reps=2)
    # a pass with grad on would keep every linear on F.linear (skinny_linear has no backward)
    assert grad_in_timed_passes and not any(grad_in_timed_passes)
    ways = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]
    assert list(timings) == ways and all(t > 0 for t in timings.values())
    assert models[torch.float32] is target and next(models[torch.bfloat16].parameters()).dtype == torch.bfloat16
    untimed = [e for way in ways for e in (("enter", *way), "exit")]  # the prefills, then the warm-up round
    timed = [e for way in ways for e in (("enter", *way), "t", "t", "exit")]
    assert events == untimed * 2 + timed * 2


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_the_cli_times_the_target_alone_on_every_cache_kind(family):
    """generate's --dtype auto / --baseline time one-token passes past a window and on a hybrid."""
    from dflash_ext.cli.demo import time_target_alone
    from dflash_ext.testing.targets import SLIDING_WINDOW, tiny_family_target

    prompt = list(range(5, 5 + 2 * SLIDING_WINDOW))
    assert time_target_alone(tiny_family_target(family), prompt, stream=False, reps=2) > 0
