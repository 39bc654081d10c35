"""The training output folder: a folder that already holds files is refused unless
overwritten, a saved run resumes only with its own settings (issue 31 items 1 and 5), and
one save writes the checkpoint and the trainer's files together."""
import json
import os
import re

import pytest
import torch

from dflash_ext import DFlashDrafter
from dflash_ext.testing.targets import tiny_target
from dflash_ext.training.train_config import TrainConfig, run_config
from dflash_ext.training.trainer import train
from python_tests.training.test_training import _tiny_corpus


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("data"))
    _tiny_corpus(target, folder, n=5, new_tokens=20)
    return folder


def run(data, out, **kw):
    """A tiny run: 1 layer, B = 4, one step, held-out tau at the end."""
    return TrainConfig(**{**dict(data=data, out=str(out), num_layers=1, block_size=4, anchors=8, epochs=1,
                                 batch_size=2, holdout=1, max_steps=1, log_every=1, autocast="none"), **kw})


def test_train_over_a_drafter_folder_is_refused_unless_overwritten(target, data, tmp_path):
    """Item 1 of issue 31: a run over an existing drafter replaced it and kept its
    acceptance.json, which then loaded with the new weights."""
    shipped = tmp_path / "drafter"
    old = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 3, 4])
    old.acceptance_profile = [0.9, 0.8, 0.7]
    old.save_pretrained(str(shipped))
    before = {n: (shipped / n).read_bytes() for n in os.listdir(shipped)}
    with pytest.raises(ValueError, match=r"--out .*drafter already holds files \(acceptance.json, config.json, "
                                         r"model.safetensors\) and no training state to resume: pass --overwrite"):
        train(run(data, shipped, holdout=0), target, log=lambda m: None)
    assert {n: (shipped / n).read_bytes() for n in os.listdir(shipped)} == before
    train(run(data, shipped, holdout=0, overwrite=True), target, log=lambda m: None)
    assert sorted(os.listdir(shipped)) == ["config.json", "model.safetensors", "trainer_state.pt"]
    new = DFlashDrafter.from_pretrained(str(shipped))
    assert new.config.num_hidden_layers == 1 and new.acceptance_profile is None
    assert sorted(os.listdir(tmp_path)) == ["drafter"]  # no temporary sibling left


def test_a_resumed_run_keeps_its_settings_and_refuses_changed_ones(target, data, tmp_path):
    """Item 5 of issue 31: --num-layers was ignored on resume, --block-size 8 trained at 8
    while the config said 4, and changed --layer-ids crashed on a shape mismatch."""
    out = tmp_path / "run"
    train(run(data, out, layer_ids=[1, 3, 4], eval_every=1), target, log=lambda m: None)
    flags = {"data": data, "out": str(out)}  # what the CLI passes: only the flags given
    for flag, name, value in (("--num-layers", "num_layers", 2), ("--block-size", "block_size", 8),
                              ("--layer-ids", "layer_ids", [0, 2, 4]), ("--lr", "lr", 1e-3)):
        with pytest.raises(ValueError, match=rf"--out .*run holds a run trained with {flag} .* \({name}\), this "
                                             rf"one asks for {re.escape(repr(value))}: leave {flag} out to resume"):
            run_config({**flags, name: value})
    with pytest.raises(ValueError, match=r"trained with --block-size 4 \(block_size\), this one asks for 16"):
        train(TrainConfig(data=data, out=str(out)), target)  # the API compares the whole config
    with open(out / "eval.jsonl", "a") as f:  # as an older version left it: an evaluation after the last save
        f.write(json.dumps({"step": 7, "tau": 1.0}) + "\n")
    # No flags but a longer run: the saved settings go on (another --eval-every is allowed).
    cfg, resumed = run_config({**flags, "max_steps": 2, "eval_every": 2})
    assert resumed and (cfg.num_layers, cfg.block_size, cfg.layer_ids, cfg.holdout) == (1, 4, [1, 3, 4], 1)
    logs = []
    drafter = train(cfg, target, log=logs.append)
    assert any("resumed at step 1" in m for m in logs) and drafter.config.block_size == 4
    state = torch.load(out / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["config"]["block_size"] == 4 and state["config"]["max_steps"] == 2
    # eval.jsonl is written with each save: the first run's line is kept, the resumed run's added
    assert [json.loads(line)["step"] for line in open(out / "eval.jsonl")] == [1, 2]
    assert sorted(os.listdir(out)) == ["acceptance.json", "config.json", "eval.jsonl", "model.safetensors",
                                       "trainer_state.pt"]
    # --overwrite starts the saved run over
    logs.clear()
    train(run(data, out, block_size=3, overwrite=True), target, log=logs.append)
    assert not any("resumed" in m for m in logs)
    assert DFlashDrafter.from_pretrained(str(out)).config.block_size == 3
    cfg, resumed = run_config({**flags, "max_steps": 2})  # the started-over run resumes, not starts over again
    assert resumed and not cfg.overwrite and cfg.block_size == 3
    assert [json.loads(line)["step"] for line in open(out / "eval.jsonl")] == [1]


def test_the_cli_resumes_with_the_saved_settings_and_names_a_changed_flag(target, data, tmp_path, monkeypatch,
                                                                         capsys):
    """A flag not given takes the saved run's value, not TrainConfig's default (block_size 16)."""
    from dflash_ext.cli.main import main

    monkeypatch.setattr("dflash_ext.model.pretrained.load_target", lambda *a, **kw: (target, None))
    monkeypatch.setattr("dflash_ext.ops.hardware.keep_freed_memory", lambda: None)  # the test process's allocator
    threads = torch.get_num_threads()
    out = str(tmp_path / "run")
    flags = ["train", "--data", data, "--out", out, "--threads", "1"]
    try:
        main(flags + ["--num-layers", "1", "--block-size", "4", "--anchors", "8", "--batch-size", "2",
                      "--epochs", "1", "--holdout", "1", "--max-steps", "1", "--autocast", "none"])
        with pytest.raises(SystemExit) as exit_:  # a usage error, before the target loads
            main(flags + ["--block-size", "8"])
        assert exit_.value.code == 2
        assert re.search(r"--block-size 4 \(block_size\), this one asks for 8", capsys.readouterr().err)
        main(flags + ["--max-steps", "2"])
    finally:
        torch.set_num_threads(threads)
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 2 and (state["config"]["num_layers"], state["config"]["block_size"]) == (1, 4)
    assert DFlashDrafter.from_pretrained(out).config.block_size == 4
