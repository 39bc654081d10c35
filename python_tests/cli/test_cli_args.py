"""Every CLI flag is checked before anything loads: a bad value ends in a usage error that
names the flag (exit status 2), never in a default, a late crash or a silently wrong output."""
import json
import os

import pytest
import torch

import dflash_ext.model.pretrained
from dflash_ext import DFlashDrafter
from dflash_ext.cli.main import main
from dflash_ext.testing.targets import tiny_target, tiny_target_config
from python_tests.cli.test_demo import _Tokenizer as ChatTokenizer  # the little of a tokenizer generate uses


def _refuse_loading(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")


@pytest.fixture
def nothing_loads(monkeypatch):
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", _refuse_loading)
    monkeypatch.setattr(DFlashDrafter, "from_pretrained", _refuse_loading)


def _write_records(folder, prompts, response=(5, 6, 7, 8)):
    """A gen-data folder: record i answers prompts[i] with `response`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "responses-00000.jsonl"), "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "input_ids": list(p) + list(response), "response_start": len(p)}) + "\n")
    return str(folder)


@pytest.fixture
def data(tmp_path):
    return _write_records(tmp_path / "data", [[1, 2, i + 3] for i in range(6)])  # 6 records, distinct prompts


@pytest.fixture
def target_dir(tmp_path):
    """A target folder with its config only (6 layers): enough for the checks, which load no weights."""
    tiny_target_config().save_pretrained(tmp_path / "target")
    return str(tmp_path / "target")


@pytest.fixture
def drafter_dir(tmp_path):
    DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    return str(tmp_path / "drafter")


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


BAD_FLAGS = [  # (argv, the flag the error names); {data}, {drafter}, {tmp} are filled in
    ("generate --block-size 0", "--block-size"),
    ("generate --draft-layers 0", "--draft-layers"),
    ("generate --temperature -1", "--temperature"),
    ("generate --top-k -1", "--top-k"),
    ("generate --top-p 0", "--top-p"),
    ("generate --top-p 1.5", "--top-p"),
    ("generate --verify accept-all", "--verify"),
    ("generate --tree-budget -1", "--tree-budget"),
    ("generate --tree-budget 8", "--tree-budget"),  # --block-size auto: a tree needs its depth
    ("generate --tree-budget 8 --block-size 4 --static-cache", "--tree-budget"),
    ("generate --tree-budget 8 --block-size 4 --verify rejection", "--tree-budget"),
    ("generate --max-new-tokens 0", "--max-new-tokens"),
    ("generate --threads 0", "--threads"),
    ("generate --device gpu", "--device"),
    ("generate --seed -1", "--seed"),
    ("generate --json {tmp}/no-such-folder/stats.json", "--json"),
    ("generate --target /nonexistent", "--target"),
    ("generate --drafter {data}", "--drafter"),  # a folder, but no drafter checkpoint in it
    ("gen-data --out {tmp}/o --n -3", "--n"),
    ("gen-data --out {tmp}/o --offset -2", "--offset"),
    ("gen-data --out {tmp}/o --batch-size 0", "--batch-size"),
    ("gen-data --out {tmp}/o --max-new-tokens 0", "--max-new-tokens"),
    ("gen-data --out {tmp}/o --max-prompt-tokens 0", "--max-prompt-tokens"),
    ("gen-data --out {tmp}/o --num-features 0", "--num-features"),
    ("gen-data --out {tmp}/o --layer-ids 3 -1", "--layer-ids"),
    ("gen-data --out {data}/responses-00000.jsonl", "--out"),
    ("gen-data --out {tmp}/o --target ./nonexistent", "--target"),
    ("train --data {data} --out {tmp}/o --num-layers 0", "--num-layers"),
    ("train --data {data} --out {tmp}/o --block-size 1", "--block-size"),
    ("train --data {data} --out {tmp}/o --anchors 0", "--anchors"),
    ("train --data {data} --out {tmp}/o --gamma 0", "--gamma"),
    ("train --data {data} --out {tmp}/o --lr 0", "--lr"),
    ("train --data {data} --out {tmp}/o --epochs 0", "--epochs"),
    ("train --data {data} --out {tmp}/o --batch-size 0", "--batch-size"),
    ("train --data {data} --out {tmp}/o --max-len 1", "--max-len"),
    ("train --data {data} --out {tmp}/o --max-steps 0", "--max-steps"),
    ("train --data {data} --out {tmp}/o --save-every 0", "--save-every"),
    ("train --data {data} --out {tmp}/o --holdout -1", "--holdout"),
    ("train --data {data} --out {tmp}/o --eval-every -1", "--eval-every"),
    ("train --data {data} --out {tmp}/o --eval-stride 0", "--eval-stride"),
    ("train --data {data} --out {tmp}/o --log-every 0", "--log-every"),
    ("train --data {data} --out {tmp}/o --loss-vocab -1", "--loss-vocab"),
    ("train --data {data} --out {tmp}/o --layer-ids -1", "--layer-ids"),
    ("train --data {data} --out {tmp}/o --threads 0", "--threads"),
    ("train --data {tmp}/nonexistent --out {tmp}/o", "--data"),
    ("train --data {data} --out {tmp}/o --extra-data {tmp}/nonexistent", "--extra-data"),
    ("train --data {data} --out {tmp}/o --init {tmp}/nonexistent", "--init"),
    ("train --data {data} --out {tmp}/o --init {data}", "--init"),
    ("train --data {data} --out {tmp}/o --target /nonexistent", "--target"),
    ("eval --data {tmp}/nonexistent --drafter {drafter}", "--data"),
    ("eval --data {data} --drafter {tmp}/nonexistent", "--drafter"),
    ("eval --data {data} --drafter {drafter} --holdout 0", "--holdout"),
    ("eval --data {data} --drafter {drafter} --eval-stride 0", "--eval-stride"),
    ("eval --data {data} --drafter {drafter} --extra-data {tmp}/nonexistent", "--extra-data"),
    ("eval --data {data} --drafter {drafter} --target /nonexistent", "--target"),
    ("export --src {tmp}/nonexistent --dst {tmp}/o", "--src"),
    ("export --src {data} --dst {tmp}/o", "--src"),
    ("export --src {drafter} --dst {tmp}/o --draft-vocab -1", "--draft-vocab"),
    ("export --src {drafter} --dst {tmp}/o --draft-vocab 5 --data {data} --holdout -1", "--holdout"),
    ("export --src {drafter} --dst {tmp}/o --draft-vocab 5 --data {tmp}/nonexistent", "--data"),
]


@pytest.mark.parametrize("argv,flag", BAD_FLAGS, ids=[a for a, _ in BAD_FLAGS])
def test_out_of_range_flag_is_a_usage_error_naming_it(argv, flag, tmp_path, data, drafter_dir, nothing_loads, capsys):
    err = _usage_error(argv.format(tmp=tmp_path, data=data, drafter=drafter_dir).split(), capsys)
    assert f"argument {flag}:" in err


def test_a_tree_with_a_prompts_file_is_a_usage_error(tmp_path, nothing_loads, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    err = _usage_error(["generate", "--tree-budget", "8", "--block-size", "4", "--prompts-file", str(prompts)], capsys)
    assert "argument --tree-budget: --prompts-file" in err


def test_data_checks_run_before_anything_loads(tmp_path, data, drafter_dir, nothing_loads, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    holding_out_all = ["--draft-vocab", "5", "--data", data, "--holdout", "6"]  # the tau 1.74 -> 1.00
    cases = [
        (["export", "--src", drafter_dir, "--dst", str(tmp_path / "o")] + holding_out_all, "--holdout"),
        (["export", "--src", drafter_dir, "--dst", str(tmp_path / "o"), "--draft-vocab", "5"], "--draft-vocab"),
        (["export", "--src", drafter_dir, "--dst", str(tmp_path / "o"), "--draft-vocab", "5", "--data", str(empty)],
         "--data"),
        (["eval", "--data", str(empty), "--drafter", drafter_dir], "--data"),
        (["eval", "--data", data, "--drafter", drafter_dir, "--save-acceptance"], "--save-acceptance"),
        (["eval", "--data", data, "--drafter", drafter_dir, "--save-acceptance", "--eval-stride", "2"],
         "--save-acceptance"),
        (["train", "--data", str(empty), "--out", str(tmp_path / "o")], "--data"),
        (["train", "--data", data, "--out", str(tmp_path / "o"), "--holdout", "6"], "--holdout"),
        (["train", "--data", data, "--out", str(tmp_path / "o"), "--eval-every", "5"], "--eval-every"),
        (["export", "--src", drafter_dir, "--dst", str(tmp_path / "o"), "--data", data], "--data"),  # was ignored
    ]
    for argv, flag in cases:
        assert f"argument {flag}:" in _usage_error(argv, capsys), argv
    assert not (tmp_path / "o").exists()


def test_eval_with_every_held_out_record_a_training_twin_names_holdout(tmp_path, drafter_dir, nothing_loads, capsys):
    twins = _write_records(tmp_path / "twins", [[1, 2, 3]] * 4)  # every prompt is also a training record's
    err = _usage_error(["eval", "--data", twins, "--drafter", drafter_dir, "--holdout", "2"], capsys)
    assert "argument --holdout:" in err and "cfg.holdout" not in err


def test_existing_nonempty_dst_needs_overwrite(tmp_path, drafter_dir, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    err = _usage_error(["export", "--src", drafter_dir, "--dst", str(dst)], capsys)
    assert "argument --dst:" in err and "--overwrite" in err
    assert not (dst / "config.json").exists()
    main(["export", "--src", drafter_dir, "--dst", str(dst), "--overwrite"])
    assert DFlashDrafter.from_pretrained(str(dst)).fc.weight.dtype == torch.bfloat16


def test_draft_vocab_larger_than_the_vocabulary_writes_nothing(tmp_path, data, drafter_dir, capsys):
    err = _usage_error(["export", "--src", drafter_dir, "--dst", str(tmp_path / "o"), "--draft-vocab", "1000",
                        "--data", data, "--holdout", "0"], capsys)
    assert "argument --draft-vocab:" in err and "128" in err
    assert not (tmp_path / "o").exists()


def test_train_refuses_a_nonempty_out_without_trainer_state(tmp_path, data, nothing_loads, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a training run")
    err = _usage_error(["train", "--data", data, "--out", str(out)], capsys)
    assert "--out" in err and "notes.txt" in err and "--overwrite" in err


def test_train_batch_not_a_multiple_of_the_processes_is_refused_before_loading(tmp_path, data, monkeypatch,
                                                                              nothing_loads, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--batch-size", "4"], capsys)
    assert "argument --batch-size:" in err and "3 processes" in err


def test_train_with_extra_data_on_cached_features_needs_live_features(tmp_path, data, nothing_loads, capsys):
    from safetensors.torch import save_file

    save_file({str(i): torch.zeros(7, 4) for i in range(6)}, os.path.join(data, "features-00000.safetensors"))
    extra = _write_records(tmp_path / "extra", [[9, 9, 9]])
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--extra-data", extra], capsys)
    assert "argument --extra-data:" in err and "--features live" in err


def test_gen_data_offset_past_the_prompts_is_refused_before_loading(tmp_path, monkeypatch, nothing_loads, capsys):
    import dflash_ext.prompts

    monkeypatch.setattr(dflash_ext.prompts, "training_prompts", lambda source: ["a", "b", "c"])
    err = _usage_error(["gen-data", "--out", str(tmp_path / "o"), "--offset", "3"], capsys)
    assert "argument --offset:" in err and "3 prompts" in err


def test_layer_ids_past_the_target_are_refused_before_loading(tmp_path, data, target_dir, monkeypatch,
                                                              nothing_loads, capsys):
    import dflash_ext.prompts

    monkeypatch.setattr(dflash_ext.prompts, "training_prompts", lambda source: ["a", "b", "c"])
    gen_data = ["gen-data", "--out", str(tmp_path / "o"), "--target", target_dir]
    err = _usage_error(gen_data + ["--layer-ids", "1", "99"], capsys)  # failed after every response was generated
    assert "argument --layer-ids:" in err and "6 layers" in err
    assert "argument --num-features:" in _usage_error(gen_data + ["--num-features", "7"], capsys)
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--target", target_dir,
                        "--layer-ids", "6"], capsys)
    assert "argument --layer-ids:" in err and "6 layers" in err
    # a layer named twice (issue 49): gen-data generated, cached and wrote [1, 1], then train died
    err = _usage_error(gen_data + ["--layer-ids", "1", "3", "1"], capsys)
    assert "argument --layer-ids: names target layer 1 twice" in err
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--target", target_dir,
                        "--layer-ids", "2", "2", "4", "4"], capsys)
    assert "argument --layer-ids: names target layers 2, 4 twice" in err
    assert not (tmp_path / "o").exists()


def test_init_with_fewer_layers_than_its_own_is_refused_before_loading(tmp_path, data, drafter_dir, nothing_loads,
                                                                      capsys):
    DFlashDrafter.from_target(tiny_target_config(), num_layers=2, block_size=4).save_pretrained(tmp_path / "two")
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--init", str(tmp_path / "two"),
                        "--num-layers", "1"], capsys)
    assert "argument --num-layers:" in err and "2 layers" in err


def test_load_target_says_a_missing_folder_is_missing():
    with pytest.raises(FileNotFoundError, match="no such directory"):
        dflash_ext.model.pretrained.load_target("/nonexistent/target", tokenizer=False)


def test_generate_at_block_size_1_with_a_fresh_drafter_runs_the_target_alone(monkeypatch, capsys):
    # a fresh drafter was made with block_size 1, which no drafter config accepts
    monkeypatch.setattr(dflash_ext.model.pretrained, "load_target", lambda *a, **k: (tiny_target(), ChatTokenizer()))
    main(["generate", "--target", "tiny", "--fresh-drafter", "--block-size", "1", "--dtype", "float32",
          "--max-new-tokens", "3", "--draft-layers", "1"])
    assert "block size 1: the target alone" in capsys.readouterr().err


def test_train_max_len_that_leaves_no_response_is_refused_before_loading(tmp_path, data, nothing_loads, capsys):
    # the records have 3 prompt tokens: cut to 4 tokens, none keeps the two response tokens a label needs
    err = _usage_error(["train", "--data", data, "--out", str(tmp_path / "o"), "--max-len", "4"], capsys)
    assert "argument --max-len:" in err and "4 tokens" in err


# --------------------------------------------------------------- --prompts-file (issue 67)
from dflash_ext.cli.args import prompts_file  # noqa: E402


def _prompts(tmp_path, data: bytes):
    path = tmp_path / "prompts"
    path.write_bytes(data)
    return prompts_file(str(path))


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_a_prompts_file_with_a_byte_order_mark_reads_its_prompts(tmp_path, newline):
    bom = "\ufeff".encode()
    records = newline.join(json.dumps({"prompt": p}).encode() for p in ("first", "second")) + newline
    assert _prompts(tmp_path, bom + records) == ["first", "second"]
    assert _prompts(tmp_path, bom + b"plain one" + newline + b"plain two") == ["plain one", "plain two"]
    assert _prompts(tmp_path, bom + newline + b"  \t" + newline + records) == ["first", "second"]  # blanks first


@pytest.mark.parametrize("bad_line,what", [
    ('{"prompt": "trailing comma",}', "not valid JSON"),
    ("{'prompt': 'single quotes'}", "not valid JSON"),
    ('{"prompt": "cut', "not valid JSON"),
    ("plain text among JSON lines", "not valid JSON"),
    ('["a", "list"]', "JSON list, not an object"),
    ('{"prompt": 7}', 'without a "prompt" string'),
    ('{"text": "no prompt field"}', 'without a "prompt" string'),
])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_bad_line_of_a_jsonl_prompts_file_is_named(tmp_path, bad_line, what, where):
    lines = [json.dumps({"prompt": p}) for p in ("one", "two")]
    lines.insert(where, bad_line)
    if where == 0 and not bad_line.startswith("{"):  # then the file is text, and its JSON lines the error
        what, where = "is a JSON record, but line 1 is plain text", 1
    with pytest.raises(Exception, match=f"line {where + 1} of .*{what}"):
        _prompts(tmp_path, "\n".join(lines).encode())


def test_a_json_record_in_a_plain_text_prompts_file_is_an_error_not_a_prompt(tmp_path):
    with pytest.raises(Exception, match='line 3 of .* is a JSON record, but line 1 is plain text'):
        _prompts(tmp_path, b'a text prompt\n\n{"prompt": "a record"}\n')
    # text that merely looks like JSON (a number, a string, braces that do not parse) stays text
    assert _prompts(tmp_path, b'plain\n42\n"quoted"\n{not json at all\n') == ["plain", "42", '"quoted"',
                                                                              "{not json at all"]


def test_a_bad_prompts_file_is_a_usage_error_before_anything_loads(tmp_path, nothing_loads, capsys):
    path = tmp_path / "p.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "fine"}\n{"prompt": "trailing",}\n')
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompts-file", str(path)])
    assert e.value.code == 2 and "argument --prompts-file: line 2 of" in capsys.readouterr().err
