"""Prompts and loop arguments that cannot be decoded are a ValueError naming the argument,
in spec_generate and target_generate alike (dflash_ext.decode.output.prompt_ids, check_sampling):
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
    ([[1, 2], [5, 10 ** 6]], "prompts\\[1\\]: input_ids holds the token id 1000000"),  # a batch: its bad row named
    ([[1, 2], torch.tensor([[[3]]])], "prompts\\[1\\]: .*got shape \\[1, 1, 1\\]"),
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


# Issue 49, a hostile user's arguments: a TypeError from a comparison ("1" <= 0), int() reading a
# stop id 2.7 as 2 or None as "not iterable", a draft window of 2.5 refused mid-generation by the
# attention op as "window": each a ValueError naming the argument, before the prefill.
ARGUMENTS = [
    (dict(temperature="1"), "temperature must be a finite number"),
    (dict(temperature=None), "temperature must be a finite number"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(temperature=1.0, top_p="0.5"), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=None), r"top_p must be in \(0, 1\]"),
    (dict(stop_token_ids=None), "stop_token_ids must be an iterable of integer token ids"),
    (dict(stop_token_ids=2), "stop_token_ids must be an iterable"),
    (dict(stop_token_ids="2"), "stop_token_ids must be an iterable"),
    (dict(stop_token_ids=[2.7]), "stop_token_ids must be an iterable"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be an iterable"),
    (dict(draft_window=2.5), "draft_window must be an int >= 1"),
    (dict(draft_window=True), "draft_window must be an int >= 1"),
]


@pytest.mark.parametrize("kw,match", ARGUMENTS, ids=[f"{list(k)[-1]}={list(k.values())[-1]!r}" for k, _ in ARGUMENTS])
@pytest.mark.parametrize("loop", ["spec_generate", "target_generate"])
def test_an_argument_of_the_wrong_kind_is_an_error_naming_it(models, kw, match, loop, monkeypatch):
    target, drafter = models
    if loop == "target_generate" and "draft_window" in kw:
        pytest.skip("target_generate has no draft window")
    monkeypatch.setattr(target, "forward", lambda *a, **k: 1 / 0)  # refused before the prefill
    run = (lambda: spec_generate(target, drafter, [1, 2, 3], 4, **kw)) if loop == "spec_generate" \
        else (lambda: target_generate(target, [1, 2, 3], 4, **kw))
    with pytest.raises(ValueError, match=match):
        run()


def test_stop_ids_of_every_integer_kind_stop_alike(models):
    import numpy as np

    target, drafter = models
    free = target_generate(target, [7, 8, 9], 12).tokens
    stop = free[5]
    want = free[:free.index(stop) + 1]
    for ids in ([stop], (np.int64(stop),), [torch.tensor(stop)], {stop}, torch.tensor([stop])):
        assert spec_generate(target, drafter, [7, 8, 9], 12, stop_token_ids=ids).tokens == want
        assert target_generate(target, [7, 8, 9], 12, stop_token_ids=ids).tokens == want


# Issue 67: inputs that are not prompts, and arguments of a batch, each an error naming them
# before the prefill (not `new(): invalid data type 'str'`, "Could not infer dtype of
# generator", an AttributeError or a TypeError after the first step).
class _Encoding(dict):  # what a tokenizer's BatchEncoding is to the loop: a mapping
    pass


NOT_PROMPTS = [
    ("a text prompt", "input_ids is text"),
    (b"bytes", "input_ids is text"),
    (5, "input_ids must be a list, tuple, tensor or numpy array of token ids, got int 5"),
    (None, "got NoneType None"),
    ((t for t in [1, 2, 3]), "got a generator object"),
    (_Encoding(input_ids=[[1, 2, 3]]), r"a mapping\): it takes token ids; pass its \['input_ids'\]"),
    (["a", "b"], r"input_ids\[0\] is text"),
    ([1, "2", 3], r"input_ids\[1\] is text"),
    ([1, 2.0], r"input_ids\[1\] is float 2.0"),
    ([True, 1], r"input_ids\[0\] is bool True"),
    ([[1, 2], "text"], r"prompts\[1\]: a batch of prompts holds token-id sequences"),
    ([[1, 2], 7], r"prompts\[1\]: a batch of prompts holds token-id sequences"),
    ([[1, 2], [3, "x"]], r"prompts\[1\]: input_ids\[1\] is text"),
    ([[1, 2], [[3, 4], [5]]], r"prompts\[1\]: input_ids must be a rectangular sequence"),
    ([[1, 2], None], r"prompts\[1\]: a batch of prompts holds"),
]


@pytest.mark.parametrize("ids,match", NOT_PROMPTS, ids=[m for _, m in NOT_PROMPTS])
@pytest.mark.parametrize("loop", ["spec_generate", "target_generate"])
def test_an_input_that_is_no_prompt_is_an_error_naming_it(models, ids, match, loop, monkeypatch):
    target, drafter = models
    monkeypatch.setattr(target, "forward", lambda *a, **k: 1 / 0)  # refused before the prefill
    run = (lambda: spec_generate(target, drafter, ids, 4)) if loop == "spec_generate" \
        else (lambda: target_generate(target, ids, 4))
    with pytest.raises(ValueError, match=match):
        run()


def test_numpy_prompts_decode_as_lists_do(models):
    import numpy as np

    target, drafter = models
    want = [target_generate(target, p, 6).tokens for p in ([7, 8, 9], [4, 5])]
    assert spec_generate(target, drafter, np.array([7, 8, 9]), 6).tokens == want[0]
    assert spec_generate(target, drafter, [np.int64(7), np.int32(8), 9], 6).tokens == want[0]
    rows = spec_generate(target, drafter, [np.array([7, 8, 9]), np.array([4, 5], dtype=np.int32)], 6)
    assert [r.tokens for r in rows] == want
    assert [r.tokens for r in target_generate(target, np.array([[7, 8, 9], [1, 4, 5]]), 6)][0] == want[0]
    with pytest.raises(ValueError, match="integer token ids, got float64"):
        spec_generate(target, drafter, np.array([7.0, 8.0]), 6)


def test_one_prompt_or_many_follows_one_rule(models):
    """The container decides (spec_generate's docstring, docs/decoding.md): a list of prompts
    is a batch whatever its length; one prompt (flat, [n], [1, n] as a tokenizer returns it)
    is one result; a [b, n] tensor is a batch where b > 1."""
    target, drafter = models
    one, many = "GenerationResult", list
    cases = [([7, 8, 9], one), (torch.tensor([7, 8, 9]), one), (torch.tensor([[7, 8, 9]]), one),
             ([[7, 8, 9]], many), ([torch.tensor([7, 8, 9])], many), (([7, 8, 9],), many),
             (torch.tensor([[7, 8, 9], [1, 2, 3]]), many), ([[7, 8, 9], [1, 2]], many)]
    for ids, kind in cases:
        for res in (spec_generate(target, drafter, ids, 3), target_generate(target, ids, 3)):
            assert (type(res).__name__ == kind) if kind == one else isinstance(res, list), (ids, type(res))


def _two_args(row, tokens):
    pass


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("loop", ["spec_generate", "target_generate"])
def test_an_on_tokens_of_the_wrong_arity_is_an_error_naming_it(models, batch, loop, monkeypatch):
    target, drafter = models
    monkeypatch.setattr(target, "forward", lambda *a, **k: 1 / 0)
    ids = [[1, 2, 3], [4, 5]] if batch else [1, 2, 3]
    wrong = (lambda tokens: None) if batch else _two_args
    call = (lambda cb: spec_generate(target, drafter, ids, 4, on_tokens=cb)) if loop == "spec_generate" \
        else (lambda cb: target_generate(target, ids, 4, on_tokens=cb))
    with pytest.raises(ValueError, match=r"on_tokens is called as on_tokens\(" + ("row, tokens" if batch else "tokens")):
        call(wrong)
    with pytest.raises(ValueError, match="on_tokens must be a callable"):
        call("print")


def test_a_batch_of_one_takes_a_two_argument_on_tokens(models):
    target, drafter = models
    seen = []
    spec_generate(target, drafter, [[1, 2, 3]], 4, on_tokens=lambda row, tokens: seen.append((row, tokens)))
    assert seen and all(row == 0 for row, _ in seen)
    spec_generate(target, drafter, [1, 2, 3], 4, on_tokens=print)  # a builtin: taken as it is
