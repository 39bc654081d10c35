"""A DFlash2 checkpoint (architectures ["DFlash2DraftModel"]) with a wrong value is an error
at load naming the file and the field, as for v1 (test_config_validation.py); its fields are
an error in a v1 config."""
import json
import os
import re

import pytest

from dflash_ext import DFlashConfig, DFlashDrafter
from dflash_ext.model.checkpoint import CONFIG_NAME
from python_tests.model.plain_reference import random_drafter
from python_tests.model.test_dflash2 import dflash2_json


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved random DFlash2 drafter: hidden 64, vocab 100, block 4, T 2, groups of 16, R 8, K 4."""
    folder = tmp_path_factory.mktemp("dflash2")
    random_drafter(dflash2_json(2, 16, multiplier=0.5, softcap=20.0)).save_pretrained(str(folder))
    return folder


def edited(checkpoint, tmp_path, edit):
    """A copy of the checkpoint whose config.json is edited by `edit(config)`."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for name in os.listdir(checkpoint):
        if name != CONFIG_NAME:
            os.symlink(os.path.join(checkpoint, name), folder / name)
    d = json.loads((checkpoint / CONFIG_NAME).read_text())
    edit(d)
    (folder / CONFIG_NAME).write_text(json.dumps(d))
    return str(folder)


def inner(**fields):
    return lambda d: d["dflash_config"].update(fields)


def dropped(key):
    return lambda d: d["dflash_config"].pop(key)


BAD_VALUES = {
    **{f"{key} missing": (dropped(key), f"dflash_config.{key}")
       for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
    **{f"{key} {value!r}": (inner(**{key: value}), f"dflash_config.{key}")
       for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
       for value in (0, -1, 2.0, "2", True, None)},
    "conv_group_size does not divide hidden_size": (inner(conv_group_size=24), "dflash_config.conv_group_size"),
    "conv_kernel_size > block_size": (inner(conv_kernel_size=5), "dflash_config.conv_kernel_size"),
    "selector_top_k > vocab_size": (inner(selector_top_k=101), "dflash_config.selector_top_k"),
    "selector_top_k > draft_vocab_size": (inner(selector_top_k=8, draft_vocab_size=6),
                                          "dflash_config.selector_top_k"),
    **{f"output_multiplier {value!r}": (inner(output_multiplier=value), "output_multiplier")
       for value in (0, -0.5, float("inf"), float("nan"), "1", None, True)},
    **{f"final_logit_softcapping {value!r}": (inner(final_logit_softcapping=value), "final_logit_softcapping")
       for value in (0, -1.0, float("inf"), "20", True)},
    "input_embedding_scale 2 (not supported)": (inner(input_embedding_scale=2.0), "input_embedding_scale"),
    "output_multiplier at the top level": (lambda d: d.update(output_multiplier=0.0), "output_multiplier"),
    # given in both places, differently: no reader's rule is shared, so none is taken silently
    "softcap at the top level beside a null one": (
        lambda d: (d["dflash_config"].update(final_logit_softcapping=None), d.update(final_logit_softcapping=30.0)),
        "dflash_config.final_logit_softcapping=None and the top-level final_logit_softcapping=30.0 disagree"),
    "selector_top_k in both places, differently": (lambda d: d.update(selector_top_k=2),
                                                   "dflash_config.selector_top_k=4 and the top-level selector_top_k=2"),
    "output_multiplier in both places, differently": (lambda d: d.update(output_multiplier=1.0), "output_multiplier"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_a_bad_dflash2_value_is_an_error_naming_the_field_and_the_file(checkpoint, tmp_path, name):
    edit, field = BAD_VALUES[name]
    folder = edited(checkpoint, tmp_path, edit)
    with pytest.raises(ValueError) as info:
        DFlashDrafter.from_pretrained(folder)
    assert re.search(re.escape(field), str(info.value)), str(info.value)
    assert os.path.join(folder, CONFIG_NAME) in str(info.value)


def test_the_fields_are_read_from_the_top_level_too(checkpoint):
    d = json.loads((checkpoint / CONFIG_NAME).read_text())
    for key in ("conv_kernel_size", "selector_top_k", "final_logit_softcapping"):
        d[key] = d["dflash_config"].pop(key)
    c = DFlashConfig.from_json_dict(d)
    assert (c.conv_kernel_size, c.selector_top_k, c.final_logit_softcapping) == (2, 4, 20.0)
    d["dflash_config"].pop("output_multiplier")  # default 1
    assert DFlashConfig.from_json_dict(d).output_multiplier == 1.0
    d["dflash_config"]["input_embedding_scale"] = 1.0  # the neutral value loads
    DFlashConfig.from_json_dict(d)


def test_a_field_given_twice_with_the_same_value_loads(checkpoint):
    d = json.loads((checkpoint / CONFIG_NAME).read_text())
    for key in ("conv_kernel_size", "selector_top_k", "final_logit_softcapping", "output_multiplier"):
        d[key] = d["dflash_config"][key]
    c = DFlashConfig.from_json_dict(d)
    assert (c.conv_kernel_size, c.selector_top_k, c.final_logit_softcapping, c.output_multiplier) == (2, 4, 20.0, 0.5)


@pytest.mark.parametrize("field,value", [("conv_kernel_size", 2), ("selector_top_k", 4), ("selector_rank", 8),
                                         ("conv_group_size", 16)])
def test_dflash2_fields_stay_rejected_in_a_v1_config(checkpoint, field, value):
    d = json.loads((checkpoint / CONFIG_NAME).read_text())
    d["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(ValueError, match=f"unsupported dflash_config fields .*{field}"):
        DFlashConfig.from_json_dict(d)
    v1 = {k: v for k, v in d["dflash_config"].items() if k in ("target_layer_ids", "mask_token_id")}
    d["dflash_config"] = dict(v1, **{field: value})
    with pytest.raises(ValueError, match=f"unsupported dflash_config fields \\['{field}'\\]"):
        DFlashConfig.from_json_dict(d)
    d["dflash_config"] = dict(v1, output_multiplier=0.5)
    with pytest.raises(ValueError, match="output_multiplier=0.5"):
        DFlashConfig.from_json_dict(d)


def test_a_config_built_in_python_needs_all_four_fields():
    c = DFlashConfig.from_json_dict(dflash2_json())
    with pytest.raises(ValueError, match="needs dflash_config.selector_rank"):
        DFlashConfig(**{**c.__dict__, "selector_rank": None})
    with pytest.raises(ValueError, match="DFlash2 fields"):
        DFlashConfig(**{**c.__dict__, **dict(conv_kernel_size=None, conv_group_size=None, selector_rank=None,
                                             selector_top_k=None), "final_logit_softcapping": 30.0})


def test_the_published_layout_loads():
    """The fields of the authors' DFlash2 fixture config (docs/dflash2.md §1) at a tiny width:
    bidirectional, every layer a sliding layer of window 2048 (symmetric per query)."""
    d = dflash2_json(2, 16, multiplier=0.19611613513818404, softcap=20.0, num_layers=5,
                     layer_types=["sliding_attention"] * 5, sliding_window=2048, is_causal=False,
                     initializer_range=0.02, tie_word_embeddings=False, model_type="qwen3",
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    d.pop("rope_theta")
    c = DFlashConfig.from_json_dict(d)
    assert c.is_dflash2 and c.layer_symmetric_window == [True] * 5 and c.layer_windows == [2048] * 5
    assert (c.output_multiplier, c.final_logit_softcapping, c.rope_theta) == (0.19611613513818404, 20.0, 5e5)
    assert DFlashConfig.from_json_dict(c.to_json_dict()) == c
