"""A DeepSpec-format drafter (DSpark) does not draft through the fused draft runtime yet
(spec_generate drafts it through DSparkProposer: test_dspark_proposer.py): DFlashProposer,
DraftRuntime and DFlashAssistant say so by name instead of drafting a block of the wrong layout."""
import pytest

from dflash_ext import DFlashAssistant, DFlashConfig, DFlashDrafter
from dflash_ext.draft.runtime import DraftRuntime
from python_tests.model.dspark_reference import deepspec_config


def dspark_drafter():
    return DFlashDrafter(DFlashConfig.from_json_dict(deepspec_config("vanilla")))


def test_the_runtime_and_the_assistant_refuse_it():
    with pytest.raises(NotImplementedError, match="DSpark"):
        DraftRuntime(dspark_drafter(), 16)
    with pytest.raises(NotImplementedError, match="DSpark"):
        DFlashAssistant(dspark_drafter())
