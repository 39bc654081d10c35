"""Drafts follow the drafter's parameters whatever wrote them (issue 50 item 3, issue 49 item 1).

An EMA swap-in writes the weights through ``p.data.copy_(...)``, which autograd's version
counter does not see. After such a write to k_proj / v_proj / k_norm (the weights the context
injection reads, stacked across layers) and q_proj / gate_proj (rows of the fused GEMMs'
stacked weights), the drafter drafts exactly what a fresh drafter loaded from the same
state_dict drafts: fused and reference, through a runtime made before the write and one made
after, through a proposer on a target, and after save_pretrained -> from_pretrained.
(Before the runtime, the drafter cached the stacked K/V weights on data_ptr / _version: every
case here drafted from stale K/V weights.)"""
import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.testing.targets import tiny_target

WRITTEN = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm", "self_attn.q_proj", "mlp.gate_proj")
CONTEXT = 11


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _drafter(target, seed):
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=8, seed=seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:  # norm gains away from 1: a stale k_norm shows
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return drafter


def _swap_in(drafter, other):
    """Write `other`'s weights into `drafter` through .data, as an EMA swap-in does."""
    for mine, theirs in zip(drafter.layers, other.layers):
        for name in WRITTEN:
            mine.get_submodule(name).weight.data.copy_(theirs.get_submodule(name).weight.data)


def _fresh(drafter):
    fresh = DFlashDrafter(drafter.config)
    fresh.load_state_dict(drafter.state_dict())
    return fresh


def _inputs(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = drafter.config
    feats = [torch.randn(CONTEXT, c.hidden_size, generator=g) for _ in c.target_layer_ids]
    embeds = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    return feats, embeds, torch.arange(CONTEXT, CONTEXT + c.block_size)[None]


def _draft(runtime):
    """A generation's draft on `runtime`: its context (from the start), then the block."""
    feats, embeds, positions = _inputs(runtime.drafter)
    runtime.cache.set_length(0, 0)
    runtime.add_context(0, feats, torch.arange(CONTEXT))
    return runtime.draft_hidden(embeds, positions)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_a_data_write_after_drafting_is_drafted_with(target, fused):
    drafter, other = _drafter(target, 1), _drafter(target, 2)
    before = DraftRuntime(drafter, 64, fused=fused)
    old = _draft(before)  # the weights are stacked, and the context injected, from the old values
    _swap_in(drafter, other)
    want = _draft(DraftRuntime(_fresh(drafter), 64, fused=fused))
    assert not torch.allclose(old, want)  # the write changes the drafts
    torch.testing.assert_close(_draft(before), want, rtol=0, atol=0)  # the runtime made before the write
    torch.testing.assert_close(_draft(DraftRuntime(drafter, 64, fused=fused)), want, rtol=0, atol=0)  # a new one


def test_a_proposer_after_a_data_write_drafts_the_tokens_of_a_fresh_drafter(target):
    drafter, other = _drafter(target, 1), _drafter(target, 2)
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 77, 12]])
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states

    def proposals(d):
        proposer = DFlashProposer(d, target, capacity=64)
        proposer.accept(hidden, slice(0, ids.shape[1]), torch.arange(ids.shape[1]))
        return [proposer.propose(last, ids.shape[1], 7).tolist() for last in (3, 50, 99)]

    old = proposals(drafter)
    _swap_in(drafter, other)
    want = proposals(_fresh(drafter))
    assert old != want
    assert proposals(drafter) == want


def test_save_and_load_after_a_data_write_drafts_what_the_drafter_in_memory_drafts(target, tmp_path):
    drafter, other = _drafter(target, 1), _drafter(target, 2)
    _draft(DraftRuntime(drafter, 64))
    _swap_in(drafter, other)
    drafter.save_pretrained(str(tmp_path / "ckpt"))
    loaded = DFlashDrafter.from_pretrained(str(tmp_path / "ckpt"))
    torch.testing.assert_close(_draft(DraftRuntime(loaded, 64)), _draft(DraftRuntime(drafter, 64)), rtol=0, atol=0)
