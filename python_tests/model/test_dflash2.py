"""DFlash2 drafters: the block convolution around each sublayer and the candidate selector's
path, on random weights, equal the plain loops of plain_reference.py (inference fused and
unfused, the training forward); a DFlash2 drafter made from a v1 one drafts its blocks; a
checkpoint round-trips."""
import json

import pytest
import torch

from dflash_ext import DFlashDrafter
from dflash_ext.draft.head import greedy_draft
from dflash_ext.model.config_fields import DFLASH2_ARCHITECTURE
from python_tests.model.plain_reference import (H, K_FEATS, config_json, our_draft_step, plain_draft_step,
                                                  plain_select, random_drafter)

CONTEXT = 7
VOCAB = 100


def dflash2_json(taps=2, group=16, rank=8, top_k=4, multiplier=None, softcap=None, **extra):
    d = config_json(architectures=[DFLASH2_ARCHITECTURE], **extra)
    d["dflash_config"].update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
    if multiplier is not None:
        d["dflash_config"]["output_multiplier"] = multiplier
    if softcap is not None:
        d["dflash_config"]["final_logit_softcapping"] = softcap
    return d


def inputs(block, seed=1, n=CONTEXT):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, K_FEATS * H, generator=g), torch.randn(block, H, generator=g),
            torch.randn(VOCAB, H, generator=g))


# (taps, channels per group, block size at run time, draft vocabulary, output_multiplier, soft cap)
CASES = {
    "T1 one group per channel B2": (1, 1, 2, None, None, None),
    "T2 groups of 16 B4": (2, 16, 4, None, 0.5, 3.0),
    "T3 groups of 4 B6 (longer than the trained block)": (3, 4, 6, None, None, 2.0),
    "T2 one group B5 draft vocabulary": (2, 64, 5, list(range(0, VOCAB, 3)), 2.0, None),
}


@pytest.mark.parametrize("name", CASES)
def test_draft_equals_the_plain_reference(name):
    taps, group, block, vocab, multiplier, softcap = CASES[name]
    d = dflash2_json(taps, group, multiplier=multiplier, softcap=softcap)
    drafter = random_drafter(d)  # every weight random: base kernels, projections, both codebooks
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    feats, embeds, head = inputs(block)
    anchor = 17
    ids = None if vocab is None else torch.tensor(vocab)
    rows = head if ids is None else head[ids]
    with torch.no_grad():
        ref = plain_draft_step(drafter, d, feats, embeds, CONTEXT)
        want = plain_select(drafter, ref[1:], ref[1:] @ rows.T, anchor, ids)
        for fused in (False, True):
            ours = our_draft_step(drafter, feats, embeds, CONTEXT, fused)
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
            got = greedy_draft(ours[None], rows, vocab=ids, selector=drafter.candidate_selector,
                               anchor=torch.tensor([anchor]))
            assert got[0].tolist() == want


def test_the_selector_and_the_convolution_change_the_draft():
    """The test above could pass vacuously: on these weights the path differs from the per-slot
    argmax, and the hidden states from the same weights without the convolutions."""
    d = dflash2_json(2, 16, multiplier=0.5, softcap=3.0)
    drafter = random_drafter(d)
    feats, embeds, head = inputs(5)
    with torch.no_grad():
        ours = our_draft_step(drafter, feats, embeds, CONTEXT, fused=False)
        path = greedy_draft(ours[None], head, selector=drafter.candidate_selector, anchor=torch.tensor([17]))
        assert path[0].tolist() != (ours[1:] @ head.T).argmax(-1).tolist()
        for layer in drafter.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        assert (our_draft_step(drafter, feats, embeds, CONTEXT, fused=False) - ours).abs().max() > 1e-2


@pytest.mark.parametrize("taps", [1, 3])
def test_training_forward_convolves_within_each_block(taps):
    """DFlashDrafter.forward (training) over many blocks at once: each block equals its
    inference step, the convolution never reading a neighbouring block."""
    d = dflash2_json(taps, 8)
    drafter = random_drafter(d)
    feats, _, _ = inputs(4, n=12)
    anchors = torch.tensor([1, 3, 6, 8])
    embeds = torch.randn(len(anchors), 4, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = drafter(feats, embeds, anchors)
        for a, p in enumerate(anchors.tolist()):
            torch.testing.assert_close(hidden[a], plain_draft_step(drafter, d, feats[:p], embeds[a], p),
                                       rtol=1e-4, atol=1e-4)


def test_training_forward_is_differentiable_in_every_dflash2_weight():
    drafter = random_drafter(dflash2_json(2, 16))
    feats, _, head = inputs(4, n=10)
    hidden = drafter(feats, torch.randn(2, 4, H), torch.tensor([3, 6]))
    logits = hidden[:, 1:] @ head.T
    sel = drafter.candidate_selector
    # the selector's scores of each slot's candidates after a teacher-forced predecessor (token 5)
    candidates = logits.topk(4, -1).indices
    score = (sel.predecessor_codebook[5] * sel.hidden_projection(hidden[:, 1:]))[:, :, None] \
        * sel.successor_codebook[candidates]
    (logits.sum() + score.sum()).backward()
    for name, p in drafter.named_parameters():
        if "_conv." in name or name.startswith("candidate_selector."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def v1_drafter(seed=0):
    return random_drafter(config_json(), seed=seed)


@pytest.mark.parametrize("fused", [False, True])
def test_dflash2_from_v1_drafts_the_v1_blocks(fused):
    """Identity convolutions and a zero successor codebook: the same hidden states, bit for bit,
    and the selector's path is the per-slot argmax, on random inputs and several anchors."""
    v1 = v1_drafter()
    v2 = DFlashDrafter.dflash2_from(v1, conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert v2.config.is_dflash2 and not v1.config.is_dflash2
    for layer in v2.layers:
        assert layer.attention_conv.base_kernel[:, 0].eq(1).all() and layer.mlp_conv.base_kernel[:, 1:].eq(0).all()
    assert v2.candidate_selector.predecessor_codebook.abs().sum() > 0
    for seed in range(3):
        feats, embeds, head = inputs(6, seed=seed)
        with torch.no_grad():
            h1 = our_draft_step(v1, feats, embeds, CONTEXT, fused)
            h2 = our_draft_step(v2, feats, embeds, CONTEXT, fused)
            assert torch.equal(h1, h2)
            path = greedy_draft(h2[None], head, selector=v2.candidate_selector, anchor=torch.tensor([seed]))
            assert torch.equal(path, greedy_draft(h1[None], head))


def test_dflash2_from_keeps_the_draft_vocabulary_and_refuses_dflash2():
    v1 = v1_drafter()
    v1.set_draft_vocab(list(range(0, VOCAB, 2)))
    v2 = DFlashDrafter.dflash2_from(v1, 2, 16, 8, 4)
    assert torch.equal(v2.draft_vocab, v1.draft_vocab) and v2.config.draft_vocab_size == 50
    with pytest.raises(ValueError, match="DFlash2 already"):
        DFlashDrafter.dflash2_from(v2)
    with pytest.raises(ValueError, match="selector_top_k=4"):
        v2.set_draft_vocab([1, 2, 3])


def test_from_target_starts_at_the_identity():
    from dflash_ext.testing.targets import tiny_target_config

    drafter = DFlashDrafter.from_target(tiny_target_config(), num_layers=2, block_size=4, conv_kernel_size=2,
                                        conv_group_size=16, selector_rank=8, selector_top_k=4)
    conv = drafter.layers[1].mlp_conv
    assert conv.kernel_projection.weight.eq(0).all() and conv.base_kernel[:, 0].eq(1).all()
    assert drafter.candidate_selector.successor_codebook.eq(0).all()


def test_a_checkpoint_round_trips(tmp_path):
    d = dflash2_json(3, 4, multiplier=0.25, softcap=20.0)
    drafter = random_drafter(d)
    drafter.set_draft_vocab(list(range(10, 60)))
    drafter.save_pretrained(str(tmp_path / "d2"))
    saved = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert saved["architectures"] == [DFLASH2_ARCHITECTURE]
    assert {k: saved["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                   "selector_top_k", "output_multiplier",
                                                   "final_logit_softcapping")} == \
        dict(conv_kernel_size=3, conv_group_size=4, selector_rank=8, selector_top_k=4, output_multiplier=0.25,
             final_logit_softcapping=20.0)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d2" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 3, H)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 3 * (H // 4), H)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, H)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] \
        == (VOCAB, 8)
    again = DFlashDrafter.from_pretrained(str(tmp_path / "d2"))
    assert again.config == drafter.config and torch.equal(again.draft_vocab, drafter.draft_vocab)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
