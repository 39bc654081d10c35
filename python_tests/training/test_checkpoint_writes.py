"""Checkpoint writes: a save replaces the folder as a whole and atomically (a kill at any
moment leaves the old checkpoint or the new one), leaves no stale file of an earlier save,
and refuses to wipe a folder that is not a drafter checkpoint."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash_ext import DFlashDrafter
from dflash_ext.model import atomic_files
from dflash_ext.model.checkpoint import read_checkpoint, write_checkpoint
from dflash_ext.testing.targets import tiny_target_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def two_versions():
    """Two different checkpoints of a few MB as write_checkpoint's arguments: "a" with an
    acceptance profile and a draft vocabulary, "b" (another block size) with neither."""
    versions = {}
    for name, seed, block_size in (("a", 0, 4), ("b", 1, 5)):
        d = DFlashDrafter.from_target(tiny_target_config(hidden_size=256), num_layers=2, block_size=block_size,
                                      seed=seed)
        vocab = None
        if name == "a":
            vocab = [1, 5, 9, 40]
            d.set_draft_vocab(vocab)
        state = {k: v.detach().contiguous() for k, v in d.state_dict().items()}
        versions[name] = (d.config, state, [0.9, 0.5, 0.25] if name == "a" else None, vocab)
    return versions


def files_of(folder):
    return sorted(os.listdir(folder))


def assert_holds(folder, version):
    config, state, acceptance, vocab = version
    ckpt = read_checkpoint(str(folder))
    assert ckpt.config.to_json_dict() == config.to_json_dict()
    assert ckpt.state.keys() == state.keys() and all(torch.equal(ckpt.state[k], state[k]) for k in state)
    assert ckpt.acceptance_profile == acceptance and ckpt.draft_vocab == vocab
    expected = {"config.json", "model.safetensors"} | ({"acceptance.json"} if acceptance else set()) \
        | ({"draft_vocab.json"} if vocab else set())
    assert set(files_of(folder)) == expected


def test_a_save_removes_the_files_of_an_earlier_save_it_does_not_write(tmp_path):
    """Item 3 of issue 31: a drafter without acceptance profile (or draft vocabulary) saved over
    one with them must not keep the old acceptance.json, which block_size="auto" would read."""
    v = two_versions()
    folder = tmp_path / "ckpt"
    write_checkpoint(str(folder), *v["a"])
    assert_holds(folder, v["a"])
    write_checkpoint(str(folder), *v["b"])
    assert_holds(folder, v["b"])
    d = DFlashDrafter.from_pretrained(str(folder))
    assert d.acceptance_profile is None and d.draft_vocab is None
    assert files_of(tmp_path) == ["ckpt"]  # no temporary sibling left behind


def test_the_fallback_swap_without_renameat2_replaces_the_folder_too(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_files, "_exchange", lambda a, b: False)  # another OS, or a filesystem that refuses
    v = two_versions()
    folder = tmp_path / "ckpt"
    write_checkpoint(str(folder), *v["a"])
    write_checkpoint(str(folder), *v["b"])
    assert_holds(folder, v["b"])
    assert files_of(tmp_path) == ["ckpt"]


def test_a_folder_set_aside_by_a_killed_fallback_swap_is_put_back(tmp_path):
    """The fallback's window: killed between its two renames, the old folder waits beside
    the path; the next save to that path restores it before writing."""
    v = two_versions()
    write_checkpoint(str(tmp_path / "ckpt"), *v["a"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.rename(tmp_path / "ckpt", tmp_path / f".ckpt.old-{dead.pid}-0000")
    os.makedirs(tmp_path / f".ckpt.tmp-{dead.pid}-0000")  # its half-built new folder
    atomic_files._remove_dead_writers_leftovers(str(tmp_path), "ckpt")
    assert files_of(tmp_path) == ["ckpt"]
    assert_holds(tmp_path / "ckpt", v["a"])


def test_sharded_weights_are_a_checkpoint_folder_and_replaced_by_one_file(tmp_path):
    v = two_versions()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        (folder / name).write_text("{}")
    write_checkpoint(str(folder), *v["b"])
    assert_holds(folder, v["b"])


@pytest.mark.parametrize("content", [["notes.txt"], ["config.json", "train.py"], ["data"]])
def test_a_folder_that_is_not_a_checkpoint_is_not_wiped(tmp_path, content):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in content:
        if name == "data":
            (folder / name).mkdir()
        else:
            (folder / name).write_text("{}")
    v = two_versions()
    with pytest.raises(ValueError, match=r"cannot save a drafter checkpoint to .*mine: it is not a drafter "
                                         r"checkpoint folder \(it holds .*" + content[-1]
                                         + r".*pass overwrite=True"):
        write_checkpoint(str(folder), *v["a"])
    assert files_of(folder) == sorted(content)
    d = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="not a drafter checkpoint folder"):
        d.save_pretrained(str(folder))
    d.save_pretrained(str(folder), overwrite=True)
    assert files_of(folder) == ["config.json", "model.safetensors"]


def test_a_checkpoint_folder_with_a_model_card_is_replaced(tmp_path):
    """A copy of the shipped drafter (README.md beside the weights) is a checkpoint folder:
    the API replaces it (as Hugging Face's save_pretrained does), card included."""
    v = two_versions()
    folder = tmp_path / "ckpt"
    write_checkpoint(str(folder), *v["a"])
    (folder / "README.md").write_text("the card of drafter a")
    write_checkpoint(str(folder), *v["b"])
    assert_holds(folder, v["b"])


# Imports once, then per line of stdin forks a writer that saves the checkpoints of the
# folders argv[2] and argv[3] alternately over argv[1] until killed; prints its pid, then
# "reaped" once it is gone (a fresh interpreter per kill would spend seconds importing torch).
WRITER = """
import os, sys
from dflash_ext.model.checkpoint import read_checkpoint, write_checkpoint
sources = [read_checkpoint(p) for p in sys.argv[2:]]
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        i = 0
        while True:
            c = sources[i % 2]
            write_checkpoint(sys.argv[1], c.config, c.state, c.acceptance_profile, c.draft_vocab)
            i += 1
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """Item 2 of issue 31: SIGKILL a writer at random moments; the folder then always loads
    and equals one of the two checkpoints exactly (no file of the other, none missing)."""
    v = two_versions()
    for name in "ab":
        write_checkpoint(str(tmp_path / "sources" / name), *v[name])
    folder = str(tmp_path / "out" / "ckpt")
    start = time.perf_counter()
    for name in "abab":
        write_checkpoint(folder, *v[name])
    one_save = (time.perf_counter() - start) / 4
    writer = subprocess.Popen([sys.executable, "-c", WRITER, folder, str(tmp_path / "sources" / "a"),
                               str(tmp_path / "sources" / "b")], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rng = random.Random(0)
    try:
        for trial in range(16):
            writer.stdin.write("go\n")
            writer.stdin.flush()
            pid = int(writer.stdout.readline())
            time.sleep(rng.uniform(0, 6 * one_save))  # into the first few saves: any phase of one
            os.kill(pid, signal.SIGKILL)
            assert writer.stdout.readline() == "reaped\n"
            matches = []
            for name in "ab":
                try:
                    assert_holds(folder, v[name])
                    matches.append(name)
                except Exception:  # a torn file fails to parse
                    pass
            assert len(matches) == 1, f"trial {trial}: the folder holds {files_of(folder)}, neither checkpoint"
    finally:
        writer.kill()
        writer.wait()
    write_checkpoint(folder, *v["a"])  # the next save removes what the killed writers left
    assert files_of(tmp_path / "out") == ["ckpt"]


def test_a_saved_folder_and_its_files_have_the_modes_the_umask_gives(tmp_path):
    """Built under a temporary name, the folder must not keep a private temporary mode."""
    v = two_versions()
    mask = os.umask(0o022)
    try:
        write_checkpoint(str(tmp_path / "ckpt"), *v["a"])
    finally:
        os.umask(mask)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755
    # every file, the weights too (safetensors creates its own file 0600)
    assert {n: (tmp_path / "ckpt" / n).stat().st_mode & 0o777 for n in files_of(tmp_path / "ckpt")} == \
        {n: 0o644 for n in files_of(tmp_path / "ckpt")}
    assert "model.safetensors" in files_of(tmp_path / "ckpt")


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_feature_shards_and_meta_follow_the_umask(tmp_path, umask):
    from safetensors.torch import save_file

    from dflash_ext.model.atomic_files import write_file_atomically

    mask = os.umask(umask)
    try:
        write_file_atomically(str(tmp_path / "features-00000.safetensors"),
                              lambda path: save_file({"0": torch.ones(2)}, path))
        write_file_atomically(str(tmp_path / "meta.json"), lambda path: open(path, "w").close())
    finally:
        os.umask(mask)
    for n in ("features-00000.safetensors", "meta.json"):
        assert (tmp_path / n).stat().st_mode & 0o777 == 0o666 & ~umask, n
