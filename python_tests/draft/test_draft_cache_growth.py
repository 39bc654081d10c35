"""The drafter's context cache grows with the answer, not with the budget (issue 31, item 7):
an answer that stops early allocates for what it generated, whatever max_new_tokens says;
a cache that grows many times (rows moved per sequence, batch > 1 too) drafts exactly what
a cache allocated up front drafts, and spec_generate stays lossless across the growths."""
import copy

import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer, spec_generate, target_generate
from dflash_ext.decode import loop
from dflash_ext.draft import cache as draft_cache
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.testing.targets import tiny_target, tiny_target_config
from python_tests.helpers import DEVICES

PROMPT = [5, 17, 33, 2, 9]
STOP_PROMPT = [100, 3]  # the tiny Qwen3 target's answer brings a new token at index 17


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _record_runtimes(monkeypatch):
    """Every DraftRuntime made from now on, in order."""
    made, real = [], DraftRuntime.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(DraftRuntime, "__init__", spy)
    return made


def _stop_after(tokens, at):
    """A stop token that first occurs at index >= `at` of the greedy answer, and where it stops."""
    for i in range(at, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i
    raise AssertionError(f"no token first occurs at index >= {at} of {tokens}")


def test_an_answer_that_stops_early_allocates_for_what_it_generated(target, monkeypatch):
    runtimes = _record_runtimes(monkeypatch)
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=8)
    stop, index = _stop_after(target_generate(target, STOP_PROMPT, 40).tokens, 16)
    base = target_generate(target, STOP_PROMPT, 10 ** 9, stop_token_ids=[stop])
    assert len(base.tokens) == index + 1

    out = spec_generate(target, drafter, STOP_PROMPT, 10 ** 9, stop_token_ids=[stop])
    assert out.tokens == base.tokens
    (runtime,) = runtimes
    cache = runtime.cache
    # the budget only bounds it: the rows allocated follow the prompt and the answer
    assert cache.max_capacity >= 10 ** 9
    assert cache.capacity <= 4 * (len(STOP_PROMPT) + len(out.tokens) + 8)
    assert cache.k.shape[1] == cache.capacity
    assert runtime.rope[0].shape[0] <= 1024  # nor do the RoPE tables follow the budget


def test_spec_generate_stays_lossless_as_the_cache_grows_many_times(target, monkeypatch):
    runtimes = _record_runtimes(monkeypatch)
    # start at the prompt alone and grow in small steps: many growths within a short answer
    monkeypatch.setattr(loop, "_FIRST_BLOCKS", 0)
    monkeypatch.setattr(draft_cache, "CACHE_ROW_ALIGN", 4)
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    base = target_generate(target, PROMPT, 90)
    out = spec_generate(target, drafter, PROMPT, 90)
    assert out.tokens == base.tokens
    (runtime,) = runtimes
    assert runtime.cache.capacity >= 8 * len(PROMPT)  # grown at least 3 times from the prompt's rows


def _features(drafter, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, drafter.config.hidden_size, generator=g) for _ in drafter.config.target_layer_ids]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_a_growing_batch_cache_drafts_what_a_preallocated_one_drafts(monkeypatch, causal):
    """Two sequences fed unevenly: every growth moves each one's rows to its new range."""
    monkeypatch.setattr(draft_cache, "CACHE_ROW_ALIGN", 4)
    drafter = DFlashDrafter.from_target(tiny_target_config(), num_layers=2, block_size=4, causal=causal)
    growing_runtime = DraftRuntime(drafter, 3, batch_size=2, max_capacity=500)
    fixed_runtime = DraftRuntime(drafter, 200, batch_size=2)
    growing, fixed = growing_runtime.cache, fixed_runtime.cache
    H, B = drafter.config.hidden_size, 4
    embeds = torch.randn(2, B, H, generator=torch.Generator().manual_seed(9))
    capacities = set()
    for step, (n0, n1) in enumerate([(5, 1), (1, 7), (3, 3), (9, 2), (2, 11), (17, 4), (6, 30)]):
        for b, n in ((0, n0), (1, n1)):
            start = growing.lengths[b]
            feats = _features(drafter, n, seed=10 * step + b)
            for runtime in (growing_runtime, fixed_runtime):
                runtime.add_context(b, feats, torch.arange(start, start + n))
        assert growing.lengths == fixed.lengths
        capacities.add(growing.capacity)
        positions = torch.tensor(growing.lengths)[:, None] + torch.arange(B)
        torch.testing.assert_close(growing_runtime.draft_hidden(embeds, positions),
                                   fixed_runtime.draft_hidden(embeds, positions), rtol=0, atol=0)
    assert len(capacities) >= 4, f"the cache grew fewer than 3 times: capacities {sorted(capacities)}"
    for b, n in enumerate(growing.lengths):  # the rows themselves moved, not only the lengths
        for mine, theirs in ((growing.k, fixed.k), (growing.v, fixed.v)):
            rows = slice(b * growing.capacity, b * growing.capacity + n)
            assert torch.equal(mine[:, rows], theirs[:, b * fixed.capacity:b * fixed.capacity + n])
    assert growing.offsets.tolist() == [0, growing.capacity]


def test_a_growing_cache_is_full_at_its_max_capacity():
    drafter = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4)
    runtime = DraftRuntime(drafter, 4, max_capacity=10)
    cache = runtime.cache
    runtime.add_context(0, _features(drafter, 6, 0), torch.arange(6))
    assert cache.capacity == 10  # doubled and rounded up, then held to the bound
    with pytest.raises(RuntimeError, match="drafter context cache is full: sequence 0 needs 11 tokens, "
                                           "more than its capacity of 10"):
        runtime.add_context(0, _features(drafter, 5, 1), torch.arange(6, 11))
    assert cache.lengths == (6,)
    with pytest.raises(ValueError, match="max_capacity"):
        DraftRuntime(drafter, 8, max_capacity=4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_growing_proposer_drafts_what_a_preallocated_one_drafts(device, monkeypatch):
    """Every draft, not only the output (spec_generate is lossless whatever is drafted): the
    cache and the RoPE tables grown many times (on CUDA: each growth captures the graph
    again) draft the tokens of a proposer that had all its rows from the start."""
    monkeypatch.setattr(draft_cache, "CACHE_ROW_ALIGN", 4)
    target = tiny_target("qwen3", num_hidden_layers=4, hidden_size=256).to(device)  # head_dim 64: every CUDA kernel
    # two drafters, one weight set
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4).to(device)
    grown = DFlashProposer(drafter, target, capacity=1100, initial_capacity=4)
    fixed = DFlashProposer(copy.deepcopy(drafter), target, capacity=1100)
    rope_start = grown.runtime.rope[0].shape[0]
    # past the 1024 positions the first RoPE tables cover
    ids = torch.randint(0, target.config.vocab_size, (1, 1100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(input_ids=ids.to(device), output_hidden_states=True).hidden_states
    positions = torch.arange(1100, device=device)
    capacities, pos = set(), 0
    for step, n in enumerate([3, 1, 4, 2, 9, 4, 30, 1, 4, 60, 4, 100, 300, 500, 20]):
        for p in (grown, fixed):
            p.accept(hidden, slice(pos, pos + n), positions[pos:pos + n])
        pos += n
        capacities.add(grown.runtime.cache.capacity)
        last = int(ids[0, pos])
        got, want = grown.propose(last, pos, 3), fixed.propose(last, pos, 3)
        assert torch.equal(got, want), f"step {step} at context {pos}: {got.tolist()} != {want.tolist()}"
    assert len(capacities) >= 5 and grown.runtime.cache.capacity < fixed.runtime.cache.capacity
    assert grown.runtime.rope[0].shape[0] > rope_start  # the tables grew with the positions
    if grown.runtime.cuda_graph:  # the stale graphs were dropped: one per block shape remains
        assert len(grown.runtime._graphs) == 1 and next(iter(grown.runtime._graphs.values())).fits(grown.runtime)
