"""DFlash2 training: the loss as SpecForge defines it (unary cross-entropy on the transformed
logits plus the teacher-forced selector cross-entropy over the top-K candidates), the exact
start from a v1 drafter, and a run from a v1 checkpoint that decodes losslessly."""
import os

import torch
import torch.nn.functional as F

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.testing.targets import tiny_target
from dflash_ext.training.loss import FrozenTargetParts, label_weights, sequence_loss
from dflash_ext.training.recipe import IGNORE, block_labels
from dflash_ext.training.train_config import TrainConfig
from dflash_ext.training.trainer import train
from python_tests.training.test_training import _tiny_corpus


def _pair(layer_ids=None):
    torch.manual_seed(0)
    target = tiny_target()
    v1 = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, target_layer_ids=layer_ids)
    return target, v1, DFlashDrafter.dflash2_from(v1, selector_rank=8, selector_top_k=4, seed=1)


def _batch(drafter, S=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = drafter.config
    feats = torch.randn(S, len(c.target_layer_ids) * c.hidden_size, generator=g)
    return torch.randint(3, 128, (S,), generator=g), feats, torch.tensor([2, 9, 17, 27])  # the last block runs past the end


def test_a_dflash2_drafter_from_v1_has_the_v1_unary_loss_and_drafts():
    target, v1, v2 = _pair()
    frozen = FrozenTargetParts(target)
    ids, feats, anchors = _batch(v1)
    loss1, w1, correct1 = sequence_loss(v1, frozen, ids, feats, anchors, 4, 4.0)
    loss2, w2, correct2 = sequence_loss(v2, frozen, ids, feats, anchors, 4, 4.0, selector_alpha=0.0)
    torch.testing.assert_close(loss2, loss1, rtol=1e-6, atol=1e-6)
    assert torch.equal(w1, w2) and torch.equal(correct1, correct2)
    loss, _, _ = sequence_loss(v2, frozen, ids, feats, anchors, 4, 4.0)
    loss.backward()
    conv = v2.layers[0].attention_conv
    assert conv.base_kernel.grad.abs().sum() > 0 and conv.kernel_projection.weight.grad.abs().sum() > 0
    # the transition term is zero at the start: only the successor codebook gets a gradient
    selector = v2.candidate_selector
    assert selector.successor_codebook.grad.abs().sum() > 0
    assert selector.predecessor_codebook.grad.abs().sum() == 0


def test_the_selector_loss_is_the_teacher_forced_candidate_cross_entropy():
    target, _, v2 = _pair()
    c = v2.config
    c.output_multiplier, c.final_logit_softcapping = 0.7, 5.0
    c.selector_top_k = 48  # of 128 tokens: random labels are covered at some slots, not at others
    selector = v2.candidate_selector
    with torch.no_grad():
        selector.successor_codebook.normal_(std=0.5)
        selector.predecessor_codebook.normal_(std=0.5)
        selector.hidden_projection.weight.normal_(std=0.5)
    frozen = FrozenTargetParts(target)
    ids, feats, anchors = _batch(v2, seed=3)
    alpha = 0.7
    with torch.no_grad():
        unary_only, weight_sum, _ = sequence_loss(v2, frozen, ids, feats, anchors, 4, 4.0, selector_alpha=0.0)
        both, _, _ = sequence_loss(v2, frozen, ids, feats, anchors, 4, 4.0, selector_alpha=alpha)
        # slot by slot, from the definition
        block = torch.full((anchors.numel(), 4), c.mask_token_id)
        block[:, 0] = ids[anchors]
        hidden = v2(feats, frozen.embed(block), anchors)[:, 1:]
        labels = block_labels(ids, anchors, 4)
        w = label_weights(labels, 4.0)
        logits = F.linear(hidden, frozen.lm_head.weight).double() * 0.7
        unary = 5.0 * torch.tanh(logits / 5.0)
        gate = selector.hidden_projection(hidden).double()
        A, Bc = selector.predecessor_codebook.double(), selector.successor_codebook.double()
        expected_unary = expected_selector = 0.0
        covered = uncovered = 0
        for a in range(anchors.numel()):
            for j in range(3):
                gold = int(labels[a, j])
                if gold == IGNORE:
                    continue
                expected_unary += w[a, j] * (torch.logsumexp(unary[a, j], 0) - unary[a, j, gold])
                top = unary[a, j].topk(48)
                if gold not in top.indices.tolist():
                    uncovered += 1
                    continue
                covered += 1
                prev = int(block[a, 0]) if j == 0 else int(labels[a, j - 1])
                scores = top.values + (A[prev] * gate[a, j] * Bc[top.indices]).sum(-1)
                k = top.indices.tolist().index(gold)
                expected_selector += w[a, j] * (torch.logsumexp(scores, 0) - scores[k])
    assert covered and uncovered  # both kinds of slot are in the test
    torch.testing.assert_close(unary_only.double(), torch.as_tensor(expected_unary), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((both - unary_only).double(), alpha * torch.as_tensor(expected_selector),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(weight_sum, w.sum())


def test_training_dflash2_from_a_v1_checkpoint_decodes_losslessly(tmp_path):
    layer_ids = (1, 3, 4)
    target, v1, _ = _pair(list(layer_ids))
    prompts = _tiny_corpus(target, str(tmp_path / "data"), layer_ids=layer_ids)
    v1.save_pretrained(str(tmp_path / "v1"))
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "v2"), block_size=4, anchors=16, lr=3e-3,
                      epochs=2, batch_size=2, save_every=10 ** 9, log_every=10 ** 9, autocast="none",
                      init=str(tmp_path / "v1"), dflash2=True, selector_rank=8, selector_top_k=4)
    train(cfg, target, log=lambda m: None)
    loaded = DFlashDrafter.from_pretrained(cfg.out, dtype=torch.float32)
    assert loaded.config.is_dflash2 and loaded.config.selector_rank == 8
    assert loaded.candidate_selector.successor_codebook.abs().sum() > 0  # the transition term was trained
    base = loaded.layers[0].mlp_conv.base_kernel
    assert not torch.equal(base[:, 0], torch.ones_like(base[:, 0]))  # the convolutions moved off the identity
    for p in prompts[:3]:
        assert spec_generate(target, loaded, p, 30).tokens == target_generate(target, p, 30).tokens
    assert os.path.exists(os.path.join(cfg.out, "config.json"))
