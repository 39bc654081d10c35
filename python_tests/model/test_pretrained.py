"""The embedded target's one-time GGUF conversion when processes run it at once (the
ranks of a torchrun job on a fresh machine): one converts, the others wait for it, and no
process loads a half-written checkpoint. Conversions are faked (no GGUF is read)."""
import os
import threading
import time

import pytest

transformers = pytest.importorskip("transformers")

from dflash_ext.model import pretrained  # noqa: E402


class _SlowCheckpoint:
    """Stands in for the converted model / tokenizer; saving takes a while, so that the
    other converters arrive while one is writing."""

    def __init__(self, name, calls):
        self.name = name
        self.config = type("Config", (), {"quantization_config": None})()
        calls.append(name)

    def save_pretrained(self, folder):
        time.sleep(0.3)
        with open(os.path.join(folder, self.name), "w") as f:
            f.write(str(threading.get_ident()))


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "_gguf_dir", lambda: str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: _SlowCheckpoint("model.safetensors", calls))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: _SlowCheckpoint("tokenizer.json", calls))
    return tmp_path, calls


def _complete_files(folder):
    return sorted(os.listdir(folder)) == [".complete", "model.safetensors", "tokenizer.json"]


def test_concurrent_callers_wait_for_one_conversion(fake_conversion):
    root, calls = fake_conversion
    folder = os.path.join(str(root), pretrained.DEFAULT_TARGET_NAME)
    seen, errors = [], []

    def caller():
        try:
            path = pretrained.default_target_path()
            seen.append((path, _complete_files(path)))  # what the caller would load, right away
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert seen == [(folder, True)] * 4
    assert calls == ["tokenizer.json", "model.safetensors"]  # converted once
    assert sorted(os.listdir(str(root))) == [f".{pretrained.DEFAULT_TARGET_NAME}.lock", pretrained.DEFAULT_TARGET_NAME]


def test_an_interrupted_conversion_is_redone(fake_conversion):
    root, calls = fake_conversion
    folder = os.path.join(str(root), pretrained.DEFAULT_TARGET_NAME)
    os.makedirs(folder)
    open(os.path.join(folder, "model.safetensors"), "w").close()  # cut short: no .complete marker
    assert pretrained.default_target_path() == folder
    assert _complete_files(folder) and os.path.getsize(os.path.join(folder, "model.safetensors")) > 0
    assert pretrained.default_target_path() == folder and len(calls) == 2  # done now: not converted again
