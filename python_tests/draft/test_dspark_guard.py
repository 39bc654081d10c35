"""A DeepSpec-format drafter (DSpark) does not draft through the draft runtime yet: every way in
(spec_generate, DFlashProposer, DraftRuntime, DFlashAssistant) says so by name instead of
drafting a block of the wrong layout."""
import pytest
import torch

from dflash_ext import DFlashAssistant, DFlashConfig, DFlashDrafter, spec_generate
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.testing.targets import tiny_target
from python_tests.model.dspark_reference import H, LAYER_IDS, TARGET_LAYERS, V, deepspec_config


def dspark_drafter():
    return DFlashDrafter(DFlashConfig.from_json_dict(deepspec_config("vanilla")))


def test_spec_generate_refuses_a_dspark_drafter_by_name():
    target = tiny_target(hidden_size=H, vocab_size=V, num_hidden_layers=TARGET_LAYERS)
    assert max(LAYER_IDS) < TARGET_LAYERS
    with pytest.raises(NotImplementedError, match="DSpark"):
        spec_generate(target, dspark_drafter(), torch.tensor([[1, 2, 3]]), max_new_tokens=4)


def test_the_runtime_and_the_assistant_refuse_it():
    with pytest.raises(NotImplementedError, match="DSpark"):
        DraftRuntime(dspark_drafter(), 16)
    with pytest.raises(NotImplementedError, match="DSpark"):
        DFlashAssistant(dspark_drafter())
