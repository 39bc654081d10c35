"""DeepSpec's format (issue 64): DSpark and DeepSpec-DFlash checkpoints load, save back
exactly and name their bad config values."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dflash_ext import DFlashConfig, DFlashDrafter
from python_tests.model.dspark_reference import VARIANTS, deepspec_config, random_tensors, write_deepspec_checkpoint

def checkpoint(tmp_path, variant, dtype=torch.float32, seed=0, edit=None):
    """A DeepSpec checkpoint of `variant` with random weights, its config.json edited by `edit`
    (after the tensors are made: an edited value does not reshape them)."""
    d = deepspec_config(variant, dtype=str(dtype).replace("torch.", ""))
    tensors = random_tensors(d, seed, dtype)
    if edit is not None:
        edit(d)
    return write_deepspec_checkpoint(str(tmp_path / variant), d, tensors), d, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_writes_back_the_checkpoint_it_loaded(tmp_path, variant, dtype):
    path, d, tensors = checkpoint(tmp_path, variant, dtype)
    drafter = DFlashDrafter.from_pretrained(path)
    assert drafter.config.is_deepspec and drafter.fc.weight.dtype == dtype
    assert hasattr(drafter, "markov_head") == (d["markov_rank"] > 0)
    assert hasattr(drafter, "confidence_head") == d["enable_confidence_head"]
    out = str(tmp_path / "saved")
    drafter.save_pretrained(out)
    assert json.load(open(os.path.join(out, "config.json"))) == d
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert set(saved) == set(tensors)
    for name, t in tensors.items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_transformers_5_config_keeps_its_dtype_key(tmp_path):
    def five(d):
        d["dtype"] = d.pop("torch_dtype")
        d["transformers_version"] = "5.25.0"

    path, d, _ = checkpoint(tmp_path, "gated", edit=five)
    DFlashDrafter.from_pretrained(path).save_pretrained(str(tmp_path / "saved"))
    assert json.load(open(tmp_path / "saved" / "config.json")) == d


def test_a_missing_head_tensor_is_named(tmp_path):
    path, d, tensors = checkpoint(tmp_path, "rnn")
    del tensors["markov_head.joint_proj.bias"]
    write_deepspec_checkpoint(path, d, tensors)
    with pytest.raises(ValueError, match=r"markov_head\.joint_proj\.bias"):
        DFlashDrafter.from_pretrained(path)


def test_a_wrongly_shaped_confidence_head_is_named(tmp_path):
    # confidence_head_with_markov false: the head reads h_k alone, a [1, H + r] weight is not it
    path, d, tensors = checkpoint(tmp_path, "vanilla")
    d["confidence_head_with_markov"] = False
    write_deepspec_checkpoint(path, d, tensors)
    with pytest.raises(ValueError, match=r"confidence_head\.proj\.weight"):
        DFlashDrafter.from_pretrained(path)


def _set(**fields):
    return lambda d: d.update(fields)


def _drop(key):
    return lambda d: d.pop(key)


BAD = [
    ("markov_rank", _set(markov_rank=-1)),
    ("markov_rank", _set(markov_rank="8")),
    ("markov_rank", _set(markov_rank=8.0)),
    ("markov_head_type", _set(markov_head_type="lstm")),
    ("markov_head_type", _drop("markov_head_type")),
    ("enable_confidence_head", _set(enable_confidence_head="yes")),
    ("confidence_head_with_markov", _drop("confidence_head_with_markov")),
    ("confidence_head_with_markov", _set(confidence_head_with_markov=1)),
    ("num_anchors", _set(num_anchors=0)),
    ("num_anchors", _drop("num_anchors")),
    ("tie_word_embeddings", _set(tie_word_embeddings=True)),
    ("target_layer_ids", _set(target_layer_ids=[-1, 4])),
    ("target_layer_ids", _set(target_layer_ids=[1, 6])),
    ("target_layer_ids", _set(target_layer_ids=[4, 4])),
    ("mask_token_id", _set(mask_token_id=100)),
    ("block_size", _set(block_size=1)),
    ("block_size", _drop("block_size")),
    ("layer_types", _set(layer_types=["sliding_attention", "full_attention"])),
    ("hidden_act", _set(hidden_act="gelu")),
    ("attention_bias", _set(attention_bias=True)),
    ("rope_theta", _set(rope_theta=-1.0)),
    ("unsupported fields", _set(logit_bias_table=[1])),
    ("dflash_config", _set(dflash_config={"target_layer_ids": [1, 4], "mask_token_id": 99})),
    ("is_causal", _set(is_causal=True)),
    ("Gemma4DSparkModel", _set(architectures=["Gemma4DSparkModel"])),
]


@pytest.mark.parametrize("field,edit", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_config_value_is_an_error_naming_the_field(tmp_path, field, edit):
    path, _, _ = checkpoint(tmp_path, "vanilla", edit=edit)
    with pytest.raises(ValueError, match=field):
        DFlashDrafter.from_pretrained(path)


def test_a_confidence_head_over_the_markov_input_needs_a_markov_head(tmp_path):
    path, _, _ = checkpoint(tmp_path, "confidence_only", edit=_set(confidence_head_with_markov=True))
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        DFlashDrafter.from_pretrained(path)


def test_dspark_fields_need_deepspecs_format():
    d = DFlashConfig.from_json_dict(deepspec_config("vanilla"))
    with pytest.raises(ValueError, match="markov_rank"):
        DFlashConfig(**{**{f: getattr(d, f) for f in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "intermediate_size",
                                                      "vocab_size", "num_target_layers", "target_layer_ids",
                                                      "mask_token_id")}, "markov_rank": 8,
                        "markov_head_type": "vanilla"})
