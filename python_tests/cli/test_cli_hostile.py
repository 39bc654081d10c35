"""What a hostile user can type (issue 41) ends in a clear error naming the flag, before
anything loads, or in a defined result: never a traceback, a silently ignored flag, or a
checkpoint that cannot load. (test_cli_args.py holds the range checks of every flag.)"""
import json
import os

import pytest
import torch

import dflash_ext.model.pretrained
from dflash_ext import DFlashDrafter
from dflash_ext.cli.main import main
from dflash_ext.testing.targets import tiny_target, tiny_target_config
from dflash_ext.training.train_config import TrainConfig
from dflash_ext.training.trainer import train
from python_tests.cli.test_cli_args import _usage_error, _write_records, data, nothing_loads, target_dir  # noqa: F401
from python_tests.cli.test_demo import _TextTokenizer, _Tokenizer as ChatTokenizer


def _save(drafter, folder):
    drafter.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def v1_dir(tmp_path):  # the tiny target's layers 1 and 4 (not the run's default rule)
    return _save(DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4, target_layer_ids=[1, 4]),
                 tmp_path / "v1")


@pytest.fixture
def dflash2_dir(tmp_path):
    v1 = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4, target_layer_ids=[1, 4])
    return _save(DFlashDrafter.dflash2_from(v1, conv_kernel_size=3, selector_rank=8, selector_top_k=8),
                 tmp_path / "v2")


def test_train_flags_that_do_not_fit_the_drafter_are_usage_errors_before_loading(
        tmp_path, data, target_dir, v1_dir, dflash2_dir, nothing_loads, capsys):
    run = ["train", "--data", data, "--out", str(tmp_path / "o"), "--target", target_dir]
    cases = [  # (extra flags, the flag the error names, words it says)
        (["--dflash2", "--loss-vocab", "4"], "--loss-vocab", "K = 16"),  # fewer than the selector's K
        (["--dflash2", "--selector-top-k", "200"], "--selector-top-k", "128 tokens"),  # past the vocabulary
        (["--init", dflash2_dir, "--layer-ids", "1", "4", "--loss-vocab", "5"], "--loss-vocab", "K = 8"),
        (["--init", v1_dir, "--layer-ids", "2", "4"], "--init", "[1, 4]"),  # target layers differ
        (["--init", v1_dir], "--init", "--layer-ids"),  # the run's default rule differs
        (["--selector-rank", "8"], "--selector-rank", "--dflash2"),  # ignored before
        (["--selector-top-k", "4"], "--selector-top-k", "--dflash2"),
        (["--init", v1_dir, "--layer-ids", "1", "4", "--selector-alpha", "0.5"], "--selector-alpha", "--dflash2"),
        (["--init", dflash2_dir, "--layer-ids", "1", "4", "--selector-top-k", "16"], "--selector-top-k",
         "keeps"),  # a continuation keeps its selector
        (["--init", dflash2_dir, "--layer-ids", "1", "4", "--dflash2", "--selector-rank", "4"], "--selector-rank",
         "keeps"),
        (["--init", dflash2_dir, "--layer-ids", "1", "4", "--block-size", "2"], "--block-size",
         "conv_kernel_size=3"),  # saved block_size 2 beside conv_kernel_size 3 before
    ]
    for extra, flag, words in cases:
        err = _usage_error(run + extra, capsys)
        assert f"argument {flag}:" in err and words in err, (extra, err)
    assert not (tmp_path / "o").exists()


def test_train_flags_that_fit_pass_the_checks(tmp_path, data, target_dir, dflash2_dir, monkeypatch):
    reached = []
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: reached.append(1) or 1 / 0)
    run = ["train", "--data", data, "--out", str(tmp_path / "o"), "--target", target_dir]
    for extra in (["--dflash2", "--loss-vocab", "16"], ["--init", dflash2_dir, "--layer-ids", "1", "4",
                                                        "--selector-top-k", "8", "--loss-vocab", "8"]):
        with pytest.raises(ZeroDivisionError):  # got as far as loading the target
            main(run + extra)
    assert len(reached) == 2


def test_export_draft_vocab_below_the_selectors_k_is_refused_before_loading(tmp_path, data, dflash2_dir,
                                                                          nothing_loads, capsys):
    err = _usage_error(["export", "--src", dflash2_dir, "--dst", str(tmp_path / "o"), "--draft-vocab", "4",
                        "--data", data, "--holdout", "0"], capsys)
    assert "argument --draft-vocab:" in err and "8 candidates" in err
    assert not (tmp_path / "o").exists()


def test_a_prompt_that_is_not_utf8_is_a_usage_error(nothing_loads, capsys):
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    err = _usage_error(["generate", "--prompt", prompt], capsys)
    assert "argument --prompt:" in err and "not valid UTF-8" in err and "0xe9" in err


@pytest.mark.parametrize("path", ["/proc/dflash-stats.json", "/sys/dflash-stats.json"])
def test_an_unwritable_json_path_fails_before_the_work(path, nothing_loads, capsys):
    err = _usage_error(["generate", "--json", path], capsys)
    assert "argument --json:" in err and "cannot be written" in err


def test_a_writable_json_path_is_left_as_it_was(tmp_path, nothing_loads, monkeypatch):
    monkeypatch.setattr("dflash_ext.cli.main.cmd_generate", lambda args: None)
    main(["generate", "--json", str(tmp_path / "new.json")])
    assert not (tmp_path / "new.json").exists()  # tried, not left behind
    (tmp_path / "old.json").write_text("{}")
    main(["generate", "--json", str(tmp_path / "old.json")])
    assert (tmp_path / "old.json").read_text() == "{}"


def test_max_new_tokens_1_claims_no_tau_and_no_speedup(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (tiny_target(), ChatTokenizer()))
    out = tmp_path / "stats.json"
    main(["generate", "--target", "tiny", "--fresh-drafter", "--block-size", "4", "--dtype", "float32",
          "--max-new-tokens", "1", "--draft-layers", "1", "--baseline", "--json", str(out)])
    err = capsys.readouterr().err
    assert "tau = 0.00" not in err and "over 0 steps" not in err, err
    assert "no speculative step ran" in err and "no DFlash speedup to show" in err, err
    assert json.loads(out.read_text())["speedup"] is None


def _corpus(target, folder):
    prompts = [[3 + i, 7, 9, 11] for i in range(4)]
    return _write_records(folder, [p for p in prompts], response=list(range(20, 44)))


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    target = tiny_target()
    data = _corpus(target, tmp_path / "data")
    out = str(tmp_path / "out")
    cfg = TrainConfig(data=data, out=out, num_layers=1, block_size=4, anchors=4, epochs=50, batch_size=2,
                      max_steps=40, save_every=1, log_every=10 ** 9, autocast="none", features="live",
                      lr=1e30, warmup=0.0)
    with pytest.raises(FloatingPointError, match="not finite") as info:
        train(cfg, target, log=lambda m: None)
    assert "keeps the checkpoint" in str(info.value) and "lr" in str(info.value)
    kept = DFlashDrafter.from_pretrained(out)  # loads: no NaN was written over it
    assert all(torch.isfinite(p).all() for p in kept.parameters())
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert 1 <= state["step"] < 40


def test_the_train_command_ends_a_diverging_run_with_a_message(tmp_path, target_dir, monkeypatch):
    target = tiny_target()
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (target, None))
    data = _corpus(target, tmp_path / "data")
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", data, "--out", str(tmp_path / "o"), "--num-layers", "1", "--block-size", "4",
              "--anchors", "4", "--epochs", "50", "--batch-size", "2", "--max-steps", "40", "--lr", "1e30",
              "--autocast", "none", "--features", "live", "--layer-ids", "1", "4", "--target", target_dir])
    assert "python -m dflash_ext train:" in str(e.value.code) and "not finite" in str(e.value.code)


def test_block_size_through_the_api_is_checked_by_the_config(tmp_path, dflash2_dir):
    target = tiny_target()
    data = _corpus(target, tmp_path / "data")
    cfg = TrainConfig(data=data, out=str(tmp_path / "o"), init=dflash2_dir, layer_ids=[1, 4], block_size=2,
                      anchors=4, batch_size=2, max_steps=1, autocast="none", features="live")
    with pytest.raises(ValueError, match="conv_kernel_size=3 must be <= block_size=2"):
        train(cfg, target, log=lambda m: None)
    assert not os.path.exists(os.path.join(cfg.out, "config.json"))


def test_static_cache_flag_decodes_the_same_text(monkeypatch, capsys):
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (tiny_target(), ChatTokenizer()))
    argv = ["generate", "--target", "tiny", "--fresh-drafter", "--block-size", "4", "--dtype", "float32",
            "--max-new-tokens", "12", "--draft-layers", "1"]
    main(argv)
    dynamic = capsys.readouterr().out
    main(argv + ["--static-cache"])
    assert capsys.readouterr().out == dynamic and dynamic


def test_static_cache_on_a_sliding_window_target_is_a_usage_error(monkeypatch, capsys):
    from dflash_ext.testing.targets import tiny_family_target

    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda *a, **k: (tiny_family_target("gpt_oss"), ChatTokenizer()))
    err = _usage_error(["generate", "--target", "tiny", "--fresh-drafter", "--block-size", "4", "--dtype",
                        "float32", "--max-new-tokens", "400", "--draft-layers", "1", "--static-cache"], capsys)
    assert "argument --static-cache:" in err and "dynamic cache" in err


def test_static_cache_past_the_memory_is_a_usage_error_naming_max_new_tokens(monkeypatch, capsys):
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (tiny_target(), ChatTokenizer()))
    err = _usage_error(["generate", "--target", "tiny", "--fresh-drafter", "--block-size", "4", "--dtype", "float32",
                        "--max-new-tokens", str(10 ** 12), "--draft-layers", "1", "--static-cache"], capsys)
    assert "argument --max-new-tokens: with --static-cache, a static cache of" in err and "bytes" in err, err


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5"])  # a sliding window; linear attention
def test_a_prompts_file_in_batches_on_a_target_a_batch_cannot_hold_is_a_usage_error(family, monkeypatch, tmp_path,
                                                                                    capsys):
    """Issue 67: found before the target alone is timed or anything decodes, naming --batch-size 1
    (before: a NotImplementedError traceback from the batch loop, exit status 1)."""
    from dflash_ext.testing.targets import tiny_family_target

    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target",
                        lambda *a, **k: (tiny_family_target(family), ChatTokenizer()))

    def refused(what):
        return lambda *a, **k: pytest.fail(f"{what} ran before the usage error")
    for name in ("spec_generate", "target_generate"):
        monkeypatch.setattr(f"dflash_ext.decode.loop.{name}", refused(name))
    monkeypatch.setattr("dflash_ext.cli.demo.fastest_target_alone", refused("the timing of the target alone"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\n")
    err = _usage_error(["generate", "--target", "tiny", "--prompts-file", str(prompts), "--fresh-drafter",
                        "--draft-layers", "1", "--block-size", "4", "--max-new-tokens", "4", "--baseline"], capsys)
    assert "argument --batch-size:" in err and family in err and "--batch-size 1" in err, err


@pytest.mark.parametrize("lines, extra", [(["one", "the second prompt", "3"], ["--batch-size", "1"]),
                                          (["a file of one prompt"], [])])  # the default --batch-size 8
def test_a_prompts_file_one_prompt_at_a_time_decodes_on_a_sliding_window_target(lines, extra, monkeypatch, tmp_path,
                                                                               capsys):
    """A batch of one prompt is the one-prompt loop, which every target runs: each output is the
    target alone's greedy output of its prompt."""
    from dflash_ext import target_generate
    from dflash_ext.testing.targets import tiny_family_target

    target, tok = tiny_family_target("gpt_oss"), _TextTokenizer()
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (target, tok))
    prompts, out = tmp_path / "p.txt", tmp_path / "report.json"
    prompts.write_text("\n".join(lines) + "\n")
    main(["generate", "--target", "tiny", "--prompts-file", str(prompts), "--fresh-drafter", "--draft-layers", "1",
          "--block-size", "4", "--dtype", "float32", "--max-new-tokens", "8", "--json", str(out), *extra])
    outputs = json.loads(out.read_text())["outputs"]
    expected = [target_generate(target, tok.apply_chat_template([{"role": "user", "content": p}])["input_ids"],
                                8).tokens for p in lines]
    assert [o["tokens"] for o in outputs] == expected and all(len(t) == 8 for t in expected)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("===")] == \
        [f"=== prompt {i} ===" for i in range(len(lines))]


class _CharTokenizer:
    """A chat template of one token per character (prompt lengths follow the text)."""
    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, messages, add_generation_prompt=True, return_dict=True):
        return {"input_ids": [2] + [3 + ord(c) % 100 for c in messages[0]["content"]] + [2]}


def test_gen_data_names_the_prompts_it_skips_and_fails_when_it_skips_them_all(tmp_path, target_dir, monkeypatch,
                                                                               capsys):
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (tiny_target(), _CharTokenizer()))
    monkeypatch.setattr("dflash_ext.prompts.training_prompts", lambda name: ["ab", "x" * 50, "cd", "y" * 60])
    run = ["gen-data", "--target", target_dir, "--n", "4", "--max-new-tokens", "3", "--no-features",
           "--dtype", "float32", "--max-prompt-tokens"]
    main(run + ["10", "--out", str(tmp_path / "some")])
    err = capsys.readouterr().err
    assert "skipped 2 of 4 prompts" in err and "indices: 1, 3" in err and "2 records" in err
    meta = json.loads((tmp_path / "some" / "meta.json").read_text())
    assert meta["this_run"]["skipped_too_long"] == 2
    err = _usage_error(run + ["1", "--out", str(tmp_path / "none")], capsys)
    assert "argument --max-prompt-tokens:" in err and "every one of the 4 prompts" in err


def test_eval_and_train_measure_tau_at_the_same_stride_by_default(tmp_path, target_dir, monkeypatch, capsys):
    """One default: eval's tau of a checkpoint is the tau its training run logged."""
    target = tiny_target()
    data = str(tmp_path / "data")
    _corpus(target, data)
    cfg = TrainConfig(data=data, out=str(tmp_path / "ckpt"), num_layers=1, block_size=4, anchors=8, epochs=1,
                      batch_size=2, max_steps=2, holdout=2, save_every=10 ** 9, log_every=10 ** 9, autocast="none",
                      layer_ids=[1, 3, 4])
    train(cfg, target, log=lambda m: None)
    logged = json.loads((tmp_path / "ckpt" / "eval.jsonl").read_text().splitlines()[-1])["tau"]
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (target, None))
    main(["eval", "--data", data, "--drafter", cfg.out, "--target", target_dir, "--holdout", "2"])
    report = json.loads(capsys.readouterr().out)
    assert report["eval_stride"] == TrainConfig.eval_stride and report["tau"] == pytest.approx(logged, abs=1e-6)
    main(["eval", "--data", data, "--drafter", cfg.out, "--target", target_dir, "--holdout", "2", "--eval-stride", "1",
          "--save-acceptance"])  # what block_size="auto" reads, written beside the weights
    report = json.loads(capsys.readouterr().out)
    saved = DFlashDrafter.from_pretrained(cfg.out)
    assert saved.walked_tau == report["walked_tau"] and saved.acceptance_profile == report["accept"]


def test_a_two_layer_target_gets_target_layers_inside_it(tmp_path, monkeypatch, capsys):
    """A target of fewer than 4 layers (issue 49 item 2): the default rule's ids stay in [0, L), so a fresh
    drafter, gen-data's features and train on them all run (before: [-1, 1], "layer -1" cached, train died)."""
    small = tiny_target(num_hidden_layers=2)
    target_dir = str(tmp_path / "target")
    small.config.save_pretrained(target_dir)
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (small, ChatTokenizer()))
    main(["generate", "--target", target_dir, "--fresh-drafter", "--draft-layers", "3", "--block-size", "4",
          "--dtype", "float32", "--max-new-tokens", "6"])
    assert len(capsys.readouterr().out.split()) == 6
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (small, _CharTokenizer()))
    monkeypatch.setattr("dflash_ext.prompts.training_prompts", lambda name: ["ab", "cd", "ef", "gh"])
    data = str(tmp_path / "data")
    main(["gen-data", "--target", target_dir, "--n", "4", "--max-new-tokens", "6", "--dtype", "float32",
          "--num-features", "2", "--out", data])
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["target_layer_ids"] == [0, 1]
    out = str(tmp_path / "ckpt")
    main(["train", "--data", data, "--target", target_dir, "--out", out, "--num-layers", "1", "--block-size", "4",
          "--max-steps", "1", "--holdout", "1", "--batch-size", "2", "--anchors", "4", "--autocast", "none"])
    assert DFlashDrafter.from_pretrained(out).config.target_layer_ids == [0, 1]
