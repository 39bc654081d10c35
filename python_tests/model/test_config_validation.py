"""A checkpoint with a wrong value is an error at load that names the file and the field (or
tensor), never a drafter that silently drafts something else: the values of config.json
(exact types, ranges, ids inside the vocabulary and the target), the weights (readable,
finite), the optional JSON files, and which weight files are read (model.safetensors, or the
shards a sharded index names; never a stray .safetensors beside them)."""
import copy
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from dflash_ext import DFlashConfig, DFlashDrafter, default_drafter_path
from dflash_ext.model.checkpoint import ACCEPTANCE_NAME, CONFIG_NAME, DRAFT_VOCAB_NAME, WEIGHTS_NAME
from dflash_ext.testing.targets import tiny_target_config
from python_tests.model.plain_reference import config_json, random_drafter

SHIPPED = default_drafter_path()
SHIPPED_CONFIG = json.load(open(os.path.join(SHIPPED, CONFIG_NAME)))


def shipped_copy(folder, edit):
    """The shipped drafter with config.json edited by `edit(config)` (its other files linked)."""
    os.makedirs(folder, exist_ok=True)
    for name in (WEIGHTS_NAME, ACCEPTANCE_NAME, DRAFT_VOCAB_NAME):
        os.symlink(os.path.join(SHIPPED, name), os.path.join(folder, name))
    d = copy.deepcopy(SHIPPED_CONFIG)
    edit(d)
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:
        json.dump(d, f)
    return str(folder)


def top(**fields):
    return lambda d: d.update(fields)


def inner(**fields):
    return lambda d: d["dflash_config"].update(fields)


def load_error(folder, match, error=ValueError):
    """The error loading `folder` raises; it must name `match` (a field or tensor)."""
    with pytest.raises(error) as info:
        DFlashDrafter.from_pretrained(str(folder))
    assert re.search(match, str(info.value)), str(info.value)
    return str(info.value)


# (edit of the shipped config.json, the field its error must name). The shipped drafter:
# vocab_size 49152, 30 target layers, 3 layers, block_size 4.
BAD_VALUES = {
    "mask_token_id = vocab_size": (inner(mask_token_id=49152), "dflash_config.mask_token_id"),
    "mask_token_id < 0": (inner(mask_token_id=-5), "dflash_config.mask_token_id"),
    "mask_token_id float": (inner(mask_token_id=1.9), "dflash_config.mask_token_id"),
    "mask_token_id bool": (inner(mask_token_id=True), "dflash_config.mask_token_id"),
    "block_size string": (top(block_size="4"), "block_size"),
    "block_size float": (top(block_size=4.7), "block_size"),
    "block_size 4.0": (top(block_size=4.0), "block_size"),
    "dflash_config.block_size float": (inner(block_size=4.7), "dflash_config.block_size"),
    "block_size in both places, differently": (inner(block_size=8),
                                               "dflash_config.block_size=8 and the top-level block_size=4 disagree"),
    "target_layer_ids duplicate": (inner(target_layer_ids=[1, 1, 14, 20, 27]), "dflash_config.target_layer_ids"),
    "target_layer_ids float": (inner(target_layer_ids=[1.5, 8, 14, 20, 27]), "dflash_config.target_layer_ids"),
    "target_layer_ids not a list": (inner(target_layer_ids="1,8"), "dflash_config.target_layer_ids"),
    "target_layer_ids past the target": (inner(target_layer_ids=[1, 8, 14, 20, 30]),
                                         "dflash_config.target_layer_ids"),
    "rms_norm_eps < 0": (top(rms_norm_eps=-1), "rms_norm_eps"),
    "rms_norm_eps nan": (top(rms_norm_eps=float("nan")), "rms_norm_eps"),
    "rms_norm_eps string": (top(rms_norm_eps="1e-6"), "rms_norm_eps"),
    "max_position_embeddings < 0": (top(max_position_embeddings=-1), "max_position_embeddings"),
    "head_dim 0": (top(head_dim=0), "head_dim"),
    "head_dim null": (top(head_dim=None), "head_dim"),
    "sliding_window < 0 in use": (top(sliding_window=-5, use_sliding_window=True), "sliding_window"),
    "sliding_window 0 in use": (top(sliding_window=0, use_sliding_window=True), "sliding_window"),
    "sliding_window float": (top(sliding_window=64.0, use_sliding_window=True), "sliding_window"),
    "use_sliding_window string": (top(use_sliding_window="true"), "use_sliding_window"),
    "max_window_layers < 0": (top(max_window_layers=-1), "max_window_layers"),
    "layer_types unknown": (top(layer_types=["full_attention", "linear_attention", "full_attention"]),
                            "layer_types"),
    "layer_types not a list": (top(layer_types="full_attention"), "layer_types"),
    "rope_theta 0": (top(rope_theta=0), "rope_theta"),
    "rope_theta string": (top(rope_theta="1e5"), "rope_theta"),
    "rope_parameters.rope_theta < 0": (top(rope_theta=None, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": -1.0}), "rope_theta"),
    "hidden_size float": (top(hidden_size=576.0), "hidden_size"),
    "num_hidden_layers bool": (top(num_hidden_layers=True), "num_hidden_layers"),
    "num_attention_heads string": (top(num_attention_heads="9"), "num_attention_heads"),
    "num_key_value_heads 0": (top(num_key_value_heads=0), "num_key_value_heads"),
    "intermediate_size < 0": (top(intermediate_size=-1536), "intermediate_size"),
    "vocab_size 0": (top(vocab_size=0), "vocab_size"),
    "num_target_layers float": (top(num_target_layers=30.0), "num_target_layers"),
    "draft_vocab_size string": (inner(draft_vocab_size="16384"), "dflash_config.draft_vocab_size"),
    "draft_vocab_size 0": (inner(draft_vocab_size=0), "dflash_config.draft_vocab_size"),
    "is_causal string": (top(is_causal="true"), "is_causal"),
    "is_causal int": (top(is_causal=1), "is_causal"),
    "dflash_config.is_causal int": (inner(is_causal=0), "dflash_config.is_causal"),
    "dflash_config.causal string": (inner(causal="false"), "dflash_config.causal"),
    "dflash_config not an object": (top(dflash_config=[1, 8]), "dflash_config"),
    "mask_token_id missing": (lambda d: d["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_a_bad_config_value_is_an_error_naming_the_field_and_the_file(tmp_path, name):
    edit, field = BAD_VALUES[name]
    folder = shipped_copy(tmp_path / "drafter", edit)
    message = load_error(folder, re.escape(field))
    assert os.path.join(folder, CONFIG_NAME) in message


# Values that are valid: a float field takes an int or a float written as 1.0, null where
# the field has a default, and the engines' neutral values.
GOOD_VALUES = {
    "rms_norm_eps 1.0": (top(rms_norm_eps=1.0), lambda c: c.rms_norm_eps == 1.0),
    "rms_norm_eps int": (top(rms_norm_eps=1), lambda c: c.rms_norm_eps == 1.0),
    "rope_theta int": (top(rope_theta=10000), lambda c: c.rope_theta == 10000.0),
    "head_dim absent: the width over the heads": (lambda d: d.pop("head_dim"), lambda c: c.head_dim == 64),
    "sliding_window null in use: no window": (top(sliding_window=None, use_sliding_window=True),
                                              lambda c: c.layer_windows == [0, 0, 0]),
    "a window not in use": (top(sliding_window=64, use_sliding_window=False),
                            lambda c: c.layer_windows == [0, 0, 0]),
    "is_causal null": (top(is_causal=None), lambda c: c.causal is None),
    "dflash_config.causal true": (inner(causal=True), lambda c: c.causal is True),
    "block_size in both places": (inner(block_size=4), lambda c: c.block_size == 4),
    "mask_token_id 0": (inner(mask_token_id=0), lambda c: c.mask_token_id == 0),
}


@pytest.mark.parametrize("name", GOOD_VALUES)
def test_valid_config_values_load(tmp_path, name):
    edit, holds = GOOD_VALUES[name]
    with open(os.path.join(SHIPPED, CONFIG_NAME)) as f:
        d = json.load(f)
    edit(d)
    assert holds(DFlashConfig.from_json_dict(d))


def test_configs_built_in_python_are_checked_too():
    target = tiny_target_config()  # vocab 128, 6 layers
    with pytest.raises(ValueError, match=r"dflash_config.mask_token_id=128 must be a token id in \[0, vocab_size"):
        DFlashConfig.for_target(target, num_layers=2, block_size=4, mask_token_id=128)
    with pytest.raises(ValueError, match="block_size must be an int >= 2, got 4.0"):
        DFlashConfig.for_target(target, num_layers=2, block_size=4.0)
    with pytest.raises(ValueError, match="name a layer twice"):
        DFlashConfig.for_target(target, num_layers=2, block_size=4, target_layer_ids=[2, 2])
    with pytest.raises(ValueError, match="head_dim must be an int > 0, got 0"):
        DFlashConfig.for_target(target, num_layers=2, block_size=4, head_dim=0)
    with pytest.raises(ValueError, match="sliding_window must be an int > 0 or null, got -5"):
        DFlashConfig.for_target(target, num_layers=2, block_size=4, sliding_window=-5)


def test_the_default_layer_spread_takes_each_layer_once():
    """The reference rule repeats a layer on a target shallower than the drafter's spread."""
    c = DFlashConfig.for_target(tiny_target_config(num_hidden_layers=6), num_layers=4, block_size=4)
    assert c.target_layer_ids == [1, 2, 3]


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A saved tiny drafter (fp32) and its weights."""
    drafter = random_drafter(config_json())
    drafter.save_pretrained(tmp_path)
    return tmp_path, {k: v.clone() for k, v in drafter.state_dict().items()}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_an_error_naming_the_tensor(tiny_checkpoint, value):
    folder, state = tiny_checkpoint
    state["layers.1.mlp.up_proj.weight"][3, :2] = value
    save_file(state, str(folder / WEIGHTS_NAME))
    message = load_error(folder, "tensor layers.1.mlp.up_proj.weight has 2 non-finite values")
    assert str(folder / WEIGHTS_NAME) in message


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_an_unreadable_safetensors_file_is_an_error_naming_it(tiny_checkpoint, damage):
    folder, _ = tiny_checkpoint
    path = folder / WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x07" * len(data))
    load_error(folder, re.escape(f"{path} is not a readable safetensors file"))


@pytest.mark.parametrize("name", [CONFIG_NAME, ACCEPTANCE_NAME, DRAFT_VOCAB_NAME])
def test_a_file_that_is_not_json_is_an_error_naming_it(tiny_checkpoint, name):
    folder, _ = tiny_checkpoint
    if name == DRAFT_VOCAB_NAME:
        DFlashDrafter.from_pretrained(str(folder)).save_pretrained(folder)  # with a vocabulary below
        d = json.loads((folder / CONFIG_NAME).read_text())
        d["dflash_config"]["draft_vocab_size"] = 3
        (folder / CONFIG_NAME).write_text(json.dumps(d))
    (folder / name).write_text('{"accept": [0.5,')
    load_error(folder, re.escape(f"{folder / name} is not valid JSON"))


@pytest.mark.parametrize("name,content,match", [
    (CONFIG_NAME, [1, 2], "must hold a JSON object"),
    (ACCEPTANCE_NAME, {"tau": 2.0}, "must hold a JSON object with 'accept'"),
    (ACCEPTANCE_NAME, {"accept": ["0.5", "0.3", "0.1"]}, "'accept' must hold block_size - 1 = 3 probabilities"),
    (ACCEPTANCE_NAME, {"accept": 0.5}, "'accept' must hold block_size - 1"),
    (ACCEPTANCE_NAME, {"accept": [0.5, 0.3, 0.1], "walked_tau": [1.4, 1.6]}, "'walked_tau' must hold block_size - 1"),
    (ACCEPTANCE_NAME, {"accept": [0.5, 0.3, 0.1], "walked_tau": [1.4, 1.6, 4.5]}, "each in [1, B]"),
    (ACCEPTANCE_NAME, {"accept": [0.5, 0.3, 0.1], "walked_tau": [0.4, 1.6, 1.7]}, "each in [1, B]"),
    (ACCEPTANCE_NAME, {"accept": [0.5, 0.3, 0.1], "walked_tau": [2.1, 1.6, 1.7]}, "each in [1, B]"),
    (ACCEPTANCE_NAME, {"accept": [0.5, 0.3, 0.1], "walked_tau": ["1.4", 1.6, 1.7]}, "'walked_tau' must hold"),
    (DRAFT_VOCAB_NAME, {"ids": [1, 2, 3]}, "must hold a JSON object with 'token_ids'"),
    (DRAFT_VOCAB_NAME, {"token_ids": ["1", "2", "3"]}, "'token_ids' must be a list of ints"),
    (DRAFT_VOCAB_NAME, {"token_ids": [3, 2, 1]}, "token_ids must be sorted, unique ids"),
])
def test_wrong_keys_and_types_in_the_json_files_name_the_file(tiny_checkpoint, name, content, match):
    folder, _ = tiny_checkpoint
    if name == DRAFT_VOCAB_NAME:
        d = json.loads((folder / CONFIG_NAME).read_text())
        d["dflash_config"]["draft_vocab_size"] = 3
        (folder / CONFIG_NAME).write_text(json.dumps(d))
    (folder / name).write_text(json.dumps(content))
    message = load_error(folder, re.escape(match))
    assert str(folder / name) in message


@pytest.mark.parametrize("kind,match", [
    ("missing", r"missing \['norm.weight'\]"),
    ("unexpected", r"unexpected \['embed_tokens.weight'\]"),
    ("shape", "tensor fc.weight has shape"),
])
def test_weights_that_do_not_fit_the_config_name_the_checkpoint(tiny_checkpoint, kind, match):
    folder, state = tiny_checkpoint
    if kind == "missing":
        del state["norm.weight"]
    elif kind == "unexpected":
        state["embed_tokens.weight"] = torch.zeros(3)
    else:
        state["fc.weight"] = torch.zeros(5, 5)
    save_file(state, str(folder / WEIGHTS_NAME))
    assert load_error(folder, match).startswith(f"{folder}: ")


def test_a_stray_safetensors_file_is_not_read(tiny_checkpoint):
    folder, state = tiny_checkpoint
    # alphabetically after model.safetensors, with a weight of the checkpoint's and an extra one
    save_file({"fc.weight": torch.zeros_like(state["fc.weight"]), "embed_tokens.weight": torch.zeros(3)},
              str(folder / "z-old-copy.safetensors"))
    loaded = DFlashDrafter.from_pretrained(str(folder))
    assert torch.equal(loaded.fc.weight, state["fc.weight"])


def shard(folder, state, weight_map):
    """Write `state` as the shards `weight_map` (tensor -> file) names, and its index."""
    for file in set(weight_map.values()):
        save_file({k: state[k] for k, f in weight_map.items() if f == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.remove(folder / WEIGHTS_NAME)


def test_a_sharded_checkpoint_reads_exactly_the_shards_its_index_names(tiny_checkpoint):
    folder, state = tiny_checkpoint
    names = sorted(state)
    weight_map = {k: "model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors"
                  for i, k in enumerate(names)}
    shard(folder, state, weight_map)
    save_file({"fc.weight": torch.zeros_like(state["fc.weight"])}, str(folder / "stray.safetensors"))
    loaded = DFlashDrafter.from_pretrained(str(folder))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_a_shard_the_index_names_must_exist_and_hold_its_tensors(tiny_checkpoint):
    folder, state = tiny_checkpoint
    weight_map = {k: "a.safetensors" for k in state}
    shard(folder, state, weight_map)
    weight_map["norm.weight"] = "b.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_error(folder, re.escape(f"names the shard {folder / 'b.safetensors'}, which is missing"), FileNotFoundError)
    save_file({"hidden_norm.weight": state["hidden_norm.weight"]}, str(folder / "b.safetensors"))
    load_error(folder, re.escape(f"{folder / 'a.safetensors'} does not hold the tensors"))
