"""The optional draft vocabulary: drafts are the argmax over a subset of the target's LM
head rows; the checkpoint records it (dflash_config.draft_vocab_size + draft_vocab.json),
the loader validates it, and output stays the target's own."""
import json
import os

import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer, spec_generate, target_generate
from dflash_ext.model.checkpoint import DRAFT_VOCAB_NAME
from dflash_ext.testing.targets import tiny_target

PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 61))]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def drafter_for(target, block_size=4, vocab=None):
    d = DFlashDrafter.from_target(target.config, num_layers=2, block_size=block_size)
    d.set_draft_vocab(vocab)
    return d


def test_round_trip_and_a_checkpoint_without_it(target, tmp_path):
    V = target.config.vocab_size
    d = drafter_for(target, vocab=list(range(3, V, 2)))
    d.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["dflash_config"]["draft_vocab_size"] == len(range(3, V, 2))
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    assert torch.equal(loaded.draft_vocab, torch.arange(3, V, 2))
    # Saving without it removes the file and the config field: it loads as before the extension.
    loaded.set_draft_vocab(None)
    loaded.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / DRAFT_VOCAB_NAME)
    assert "draft_vocab_size" not in json.load(open(tmp_path / "config.json"))["dflash_config"]
    assert DFlashDrafter.from_pretrained(str(tmp_path)).draft_vocab is None


@pytest.mark.parametrize("ids,match", [([3, 2, 5], "sorted, unique"), ([1, 1, 2], "sorted, unique"),
                                       ([-1, 4], r"in \[0, "), ([0, 10**6], r"in \[0, "), ([], "sorted")])
def test_bad_vocabularies_are_clear_errors(target, ids, match):
    with pytest.raises(ValueError, match=match):
        drafter_for(target, vocab=ids)


def test_inconsistent_checkpoints_are_clear_errors(target, tmp_path):
    drafter_for(target, vocab=[1, 2, 3]).save_pretrained(tmp_path)
    with open(tmp_path / DRAFT_VOCAB_NAME, "w") as f:
        json.dump({"token_ids": [1, 2]}, f)
    with pytest.raises(ValueError, match="holds 2 token ids, dflash_config.draft_vocab_size says 3"):
        DFlashDrafter.from_pretrained(str(tmp_path))
    os.remove(tmp_path / DRAFT_VOCAB_NAME)
    with pytest.raises(FileNotFoundError, match="draft_vocab_size but .* is missing"):
        DFlashDrafter.from_pretrained(str(tmp_path))
    drafter_for(target).save_pretrained(tmp_path)
    with open(tmp_path / DRAFT_VOCAB_NAME, "w") as f:
        json.dump({"token_ids": [1, 2]}, f)
    with pytest.raises(ValueError, match="no dflash_config.draft_vocab_size"):
        DFlashDrafter.from_pretrained(str(tmp_path))


def _drafts(target, drafter, prompt, n):
    """The proposer's block after the prompt's context is injected."""
    prop = DFlashProposer(drafter, target, capacity=64)
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    prop.accept(out.hidden_states, slice(0, len(prompt) - 1), torch.arange(len(prompt) - 1))
    return prop.propose(prompt[-1], len(prompt) - 1, n)


def test_drafts_are_the_argmax_over_the_vocabulary(target):
    V = target.config.vocab_size
    full = drafter_for(target, block_size=8)
    prompt = PROMPTS[1]
    free = _drafts(target, full, prompt, 7)
    # A vocabulary holding the free drafts (and more) drafts exactly them.
    holding = sorted(set(free.tolist()) | set(range(0, V, 3)))
    full.set_draft_vocab(holding)
    assert torch.equal(_drafts(target, full, prompt, 7), free)
    # One without them drafts only its own tokens, the best of them by the same logits.
    excluding = [t for t in range(V) if t not in set(free.tolist())]
    full.set_draft_vocab(excluding)
    restricted = _drafts(target, full, prompt, 7)
    assert not set(restricted.tolist()) & set(free.tolist())


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_output_is_the_target_s(target, block_size):
    V = target.config.vocab_size
    drafter = drafter_for(target, block_size, vocab=list(range(0, V, 2)))
    for prompt in PROMPTS:
        assert spec_generate(target, drafter, prompt, 24).tokens == target_generate(target, prompt, 24).tokens


def test_a_drafter_in_another_dtype_drafts_with_the_rows_in_its_own(target):
    """A bf16 drafter beside an fp32 target (what the CPU runs where it has bf16 units): the
    vocabulary's head rows are the target's, cast once to the drafter's dtype, and the output
    is still the target's own."""
    V = target.config.vocab_size
    vocab = list(range(1, V, 2))
    drafter = drafter_for(target, 4, vocab=vocab).to(torch.bfloat16)
    runtime = DFlashProposer(drafter, target, capacity=64).runtime
    head = target.get_output_embeddings().weight
    assert head.dtype == torch.float32
    assert runtime.vocab_weight.dtype == torch.bfloat16
    assert torch.equal(runtime.vocab_weight, head.detach()[vocab].to(torch.bfloat16))
    for prompt in PROMPTS:
        assert spec_generate(target, drafter, prompt, 24).tokens == target_generate(target, prompt, 24).tokens
