"""Prompts and loop arguments that cannot be decoded are a ValueError naming the argument,
in spec_generate and target_generate alike (dflash_ext.decode.loop.prompt_ids, check_sampling):
never a reshape error, an IndexError inside the embedding, floats cut to token ids, or a
block size of 0 read as "the drafter's"."""
import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.testing.targets import tiny_target


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3")
    return target, DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)


BAD_PROMPTS = [
    ([], "input_ids is empty"),
    (torch.zeros(1, 0, dtype=torch.long), "input_ids is empty"),
    ([5, 10 ** 6], "token id 1000000, outside the target's vocabulary"),
    ([5, -3], "token id -3, outside"),
    (torch.tensor([[1.5, 2.0]]), "integer token ids, got float32"),
    (torch.tensor([True, False]), "integer token ids, got bool"),
    (torch.tensor([[[1, 2]]]), "got shape \\[1, 1, 2\\]"),
    (torch.tensor([[1, 2], [3, 4]]), "decodes one sequence.*batch 2"),
]


@pytest.mark.parametrize("ids,match", BAD_PROMPTS, ids=[m for _, m in BAD_PROMPTS])
@pytest.mark.parametrize("loop", ["spec_generate", "target_generate"])
def test_a_prompt_that_cannot_be_decoded_is_an_error_naming_input_ids(models, ids, match, loop):
    target, drafter = models
    run = (lambda: spec_generate(target, drafter, ids, 4)) if loop == "spec_generate" \
        else (lambda: target_generate(target, ids, 4))
    with pytest.raises(ValueError, match=match):
        run()


@pytest.mark.parametrize("block_size", [0, -2, True, 2.0, "x"])
def test_a_block_size_that_is_not_one_is_an_error(models, block_size):
    target, drafter = models
    with pytest.raises(ValueError, match="block_size must be an int >= 1 or 'auto'"):
        spec_generate(target, drafter, [1, 2, 3], 4, block_size=block_size)


@pytest.mark.parametrize("kw,name", [(dict(max_new_tokens=True), "max_new_tokens"),
                                     (dict(max_new_tokens=4, temperature=1.0, top_k=True), "top_k")])
def test_a_bool_is_no_count(models, kw, name):
    target, drafter = models
    with pytest.raises(ValueError, match=name):
        spec_generate(target, drafter, [1, 2, 3], **kw)


def test_the_accepted_forms_decode_alike(models):
    target, drafter = models
    want = target_generate(target, [7, 8, 9], 6).tokens
    for ids in ([7, 8, 9], torch.tensor([7, 8, 9]), torch.tensor([[7, 8, 9]], dtype=torch.int32)):
        assert spec_generate(target, drafter, ids, 6).tokens == want
        assert target_generate(target, ids, 6).tokens == want
