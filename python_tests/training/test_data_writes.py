"""gen-data's writes: a responses line torn by a kill does not break the next run (the
record is generated again), feature shards and meta.json are written whole."""
import json
import os

import pytest

from dflash_ext.testing.targets import tiny_target
from dflash_ext.training.data import compute_features, generate_responses, load_records, write_meta
from python_tests.training.test_training import _ChatTokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_a_responses_line_torn_by_a_kill_is_dropped_and_generated_again(target, tmp_path):
    prompts = ["abc", "defgh", "ij"]
    generate_responses(target, _ChatTokenizer(), prompts, str(tmp_path), max_new_tokens=5, max_prompt_tokens=20,
                       batch_size=3)
    shard = tmp_path / "responses-00000.jsonl"
    whole = shard.read_bytes()
    lines = whole.splitlines(keepends=True)
    torn_id = json.loads(lines[-1])["id"]
    shard.write_bytes(b"".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # killed mid-line
    with pytest.warns(UserWarning, match="responses-00000.jsonl: its last line is cut short"):
        assert sorted(r["id"] for r in load_records(str(tmp_path))) == sorted({0, 1, 2} - {torn_id})
    with pytest.warns(UserWarning, match="its last line is cut short"):
        n = generate_responses(target, _ChatTokenizer(), prompts, str(tmp_path), max_new_tokens=5,
                               max_prompt_tokens=20, batch_size=3)
    assert n.records == 3 and shard.read_bytes() == b"".join(lines[:-1])  # the torn tail is cut off
    again = {r["id"]: r for r in load_records(str(tmp_path))}
    assert again[torn_id] == json.loads(lines[-1])  # generated again, the same greedy response
    shard.write_bytes(lines[0][:5] + b"\n" + b"".join(lines[1:]))  # not a last line: a broken file
    with pytest.raises(ValueError, match="responses-00000.jsonl line 1 is not valid JSON"):
        load_records(str(tmp_path))


def test_feature_shards_and_meta_are_written_whole(target, tmp_path, monkeypatch):
    """A write that fails (as a kill would end it) leaves no shard, so the next run
    computes those features instead of failing on a torn file."""
    generate_responses(target, _ChatTokenizer(), ["abc", "defgh"], str(tmp_path), max_new_tokens=5,
                       max_prompt_tokens=20, batch_size=2)
    import safetensors.torch

    def killed(tensors, path, *args, **kw):
        with open(path, "wb") as f:
            f.write(b"\x00" * 10)  # a torn start
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        compute_features(target, str(tmp_path), [1, 3])
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["responses-00000.jsonl"]
    compute_features(target, str(tmp_path), [1, 3])
    assert sorted(os.listdir(tmp_path)) == ["features-00000.safetensors", "responses-00000.jsonl"]
    write_meta(str(tmp_path), {"target_layer_ids": [1, 3]})
    assert json.load(open(tmp_path / "meta.json")) == {"target_layer_ids": [1, 3]}
