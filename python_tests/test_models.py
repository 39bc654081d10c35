"""The embedded target's one-time GGUF conversion is safe when processes run it at once
(the ranks of a torchrun job on a fresh machine): each writes its own folder and renames
it into place, so no process ever loads a half-written checkpoint."""
import os
import threading

import pytest

transformers = pytest.importorskip("transformers")

from dflash_ext import models  # noqa: E402


class _SlowCheckpoint:
    """Stands in for the converted model / tokenizer: save_pretrained waits for every
    converter to be mid-write, so the writes overlap as they did under torchrun."""

    def __init__(self, barrier, name):
        self.barrier, self.name = barrier, name
        self.config = type("Config", (), {"quantization_config": None})()

    def save_pretrained(self, folder):
        if self.name == "model.safetensors":
            self.barrier.wait(timeout=30)
        with open(os.path.join(folder, self.name), "w") as f:
            f.write(str(threading.get_ident()))


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    converters = 4
    barrier = threading.Barrier(converters)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_gguf_dir", lambda: str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: _SlowCheckpoint(barrier, "model.safetensors"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: _SlowCheckpoint(barrier, "tokenizer.json"))
    return tmp_path, converters


def test_concurrent_conversions_leave_one_complete_folder(fake_conversion):
    root, converters = fake_conversion
    results, errors = [], []

    def convert():
        try:
            results.append(models.default_target_path())
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(converters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    folder = os.path.join(str(root), models.DEFAULT_TARGET_NAME)
    assert results == [folder] * converters
    assert sorted(os.listdir(folder)) == [".complete", "model.safetensors", "tokenizer.json"]
    # One converter's files, not a mix of two half-written copies.
    owners = {open(os.path.join(folder, n)).read() for n in ("model.safetensors", "tokenizer.json")}
    assert len(owners) == 1
    assert os.listdir(str(root)) == [models.DEFAULT_TARGET_NAME]  # the losers' copies removed


def test_an_interrupted_conversion_is_redone(fake_conversion, monkeypatch):
    root, _ = fake_conversion
    folder = os.path.join(str(root), models.DEFAULT_TARGET_NAME)
    os.makedirs(folder)
    open(os.path.join(folder, "model.safetensors"), "w").close()  # no .complete marker
    monkeypatch.setattr(threading.Barrier, "wait", lambda self, timeout=None: 0)
    assert models.default_target_path() == folder
    assert os.path.exists(os.path.join(folder, ".complete"))
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) > 0
