"""Issue 41: `block_size="auto"` with a prompt shorter than the drafter's block (the CLI
default with a short chat prompt) on every family, and CacheRollback refusing what cannot
be right (a second rollback of one pass, a negative one, more than the pass, a pass after
one not rolled back) with clear errors instead of a silently shorter or broken cache."""
import pytest
import torch

from dflash_ext import DFlashDrafter, choose_block_size, spec_generate, target_generate
from dflash_ext.decode.rollback import CacheRollback
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.testing.targets import CROPPABLE, FAMILIES, tiny_family_target

SHORT_PROMPT = [5, 17]  # a few tokens: shorter than the drafter's block of 16


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_block_size_with_a_prompt_shorter_than_the_block(family, monkeypatch):
    """Every timed verify pass runs over B new tokens after the whole context (on main it ran
    over the prompt's first B tokens, fewer than B, then rolled back B: the prefill cropped
    away, an IndexError on the hybrids, a size mismatch on sliding windows); then the
    generation is the target alone."""
    target = tiny_family_target(family)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=16)
    drafter.acceptance_profile = [0.9 ** j for j in range(1, 16)]
    passes = []
    real_call = TargetRunner.__call__

    def recording_call(self, ids, cache, *args, **kw):
        passes.append((ids.shape[1], None if cache is None else int(cache.get_seq_length())))
        return real_call(self, ids, cache, *args, **kw)

    monkeypatch.setattr(TargetRunner, "__call__", recording_call)
    choice = choose_block_size(target, drafter, len(SHORT_PROMPT))
    monkeypatch.undo()
    assert passes[0] == (len(SHORT_PROMPT), None)  # the context's prefill
    timed = passes[1:]
    assert {n for n, _ in timed} == set(choice.step_seconds)
    assert all(length == len(SHORT_PROMPT) for _, length in timed), timed
    out = spec_generate(target, drafter, SHORT_PROMPT, 12, block_size="auto")
    assert out.tokens == target_generate(target, SHORT_PROMPT, 12).tokens


FAMILY_KINDS = [CROPPABLE[0], "gpt_oss", "qwen3_5"]  # crop only, a sliding window, a Gated DeltaNet hybrid


def pass_then(family):
    """A prefilled cache of `family`, its rollback (4 tokens), and a pass of 3 tokens announced."""
    target = tiny_family_target(family)
    runner = TargetRunner(target)
    _, _, cache = runner(torch.arange(5, 15)[None], None, hidden_states=False)
    rollback = CacheRollback(cache, 4)
    runner(torch.arange(20, 23)[None], cache, hidden_states=False, rollback=rollback)
    return runner, cache, rollback


@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_one_rollback_per_pass(family):
    runner, cache, rollback = pass_then(family)
    rollback(2)
    assert int(cache.layers[-1].get_seq_length()) == 11
    with pytest.raises(RuntimeError, match="without a pass to roll back"):
        rollback(1)  # again for the same pass: it would crop accepted tokens
    with pytest.raises(RuntimeError, match="without a pass to roll back"):
        rollback(0)
    assert int(cache.layers[-1].get_seq_length()) == 11  # nothing was done


@pytest.mark.parametrize("family", FAMILY_KINDS)
@pytest.mark.parametrize("drop", [-1, 4, 1.0, True])
def test_a_rollback_outside_the_pass_is_refused(family, drop):
    runner, cache, rollback = pass_then(family)
    with pytest.raises(ValueError, match="int >= 0|a pass of 3"):
        rollback(drop)
    rollback(3)  # the pass can still be undone exactly
    assert int(cache.layers[-1].get_seq_length()) == 10


@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_pass_after_one_not_rolled_back_is_refused(family):
    runner, cache, rollback = pass_then(family)
    with pytest.raises(RuntimeError, match="not rolled back"):
        runner(torch.arange(30, 32)[None], cache, hidden_states=False, rollback=rollback)
    rollback(0)
    runner(torch.arange(30, 32)[None], cache, hidden_states=False, rollback=rollback)
    rollback(2)
    assert int(cache.layers[-1].get_seq_length()) == 13
