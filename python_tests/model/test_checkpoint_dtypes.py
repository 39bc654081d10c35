"""The dtype rules of a checkpoint (docs/checkpoints.md, "Weight dtypes"): every weight is
floating point (an integer or bool tensor is an error naming the file and the tensor), and a
load under dtype=None/"auto" takes the dtype that holds most of the weights, not the first
tensor's. And a save never writes what a load refuses: a non-finite weight or a config that
would not load is refused before anything is written, so the old folder stays."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ext import DFlashDrafter
from dflash_ext.model.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from python_tests.model.plain_reference import config_json, random_drafter

VICTIM = "layers.0.mlp.up_proj.weight"


@pytest.fixture
def saved(tmp_path):
    """A saved tiny drafter (bf16) and its weights as written."""
    random_drafter(config_json()).save_pretrained(tmp_path, dtype=torch.bfloat16)
    return tmp_path, load_file(str(tmp_path / WEIGHTS_NAME))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_a_weight_that_is_not_floating_point_is_an_error_naming_file_and_tensor(saved, dtype):
    folder, state = saved
    state[VICTIM] = (state[VICTIM] > 0).to(dtype)
    save_file(state, str(folder / WEIGHTS_NAME))
    with pytest.raises(ValueError) as info:
        DFlashDrafter.from_pretrained(str(folder))
    message = str(info.value)
    assert str(folder / WEIGHTS_NAME) in message and VICTIM in message, message
    assert str(dtype).replace("torch.", "") in message and "floating point" in message, message


@pytest.mark.parametrize("dtype_arg", [None, "auto"])
def test_a_mixed_checkpoint_loads_in_the_dtype_of_most_of_its_weights(saved, dtype_arg):
    folder, state = saved
    first = next(iter(state))  # before: the first tensor's dtype decided
    state = {name: (t.float() if name in (first, VICTIM) else t) for name, t in state.items()}
    save_file(state, str(folder / WEIGHTS_NAME))
    drafter = DFlashDrafter.from_pretrained(str(folder), dtype=dtype_arg)
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}
    # and mostly fp32 loads as fp32 (the fp32 values exact)
    wide = {name: t.float() for name, t in state.items()}
    wide["norm.weight"] = wide["norm.weight"].bfloat16()
    save_file(wide, str(folder / WEIGHTS_NAME))
    drafter = DFlashDrafter.from_pretrained(str(folder), dtype=dtype_arg)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    assert torch.equal(drafter.state_dict()[VICTIM], wide[VICTIM])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_saving_a_non_finite_weight_is_refused_and_the_old_folder_stays(saved, value):
    folder, state = saved
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    drafter = DFlashDrafter.from_pretrained(str(folder))
    with torch.no_grad():
        drafter.state_dict()[VICTIM][1, 2] = value
    with pytest.raises(ValueError, match=re.escape(f"tensor {VICTIM} has 1 non-finite values")) as info:
        drafter.save_pretrained(folder)
    assert str(folder) in str(info.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    DFlashDrafter.from_pretrained(str(folder))  # still loads


def test_saving_a_config_that_would_not_load_is_refused_and_the_old_folder_stays(saved):
    folder, _ = saved
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    drafter = DFlashDrafter.from_pretrained(str(folder))
    # a field set past the dataclass's own checks (as the trainer once set block_size)
    drafter.config.mask_token_id = drafter.config.vocab_size
    with pytest.raises(ValueError, match="dflash_config.mask_token_id") as info:
        drafter.save_pretrained(folder)
    assert "would not load" in str(info.value) and str(folder) in str(info.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_saved_config_records_the_dtype_the_load_will_use(saved):
    folder, _ = saved
    assert json.loads((folder / CONFIG_NAME).read_text())["torch_dtype"] == "bfloat16"
