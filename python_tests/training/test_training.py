"""The training recipe: mask, labels, weights, anchors, frozen parts, agreement of the
training forward with the inference draft step, overfitting end to end, and DDP."""
import json
import os
from dataclasses import replace

import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.model.masks import block_mask, context_mask
from dflash_ext.testing.targets import tiny_family_target, tiny_target, tiny_target_config
from dflash_ext.training.data import compute_features, generate_responses, greedy_batch, load_records, split_holdout, target_features
from dflash_ext.training.loss import (FrozenTargetParts, block_logits, drafted_tokens, sequence_loss, tau_of,
                                      walked_acceptance)
from dflash_ext.training.recipe import IGNORE, block_labels, loss_weights, sample_anchors
from dflash_ext.training.train_config import TrainConfig
from dflash_ext.training.trainer import _Features, _split_records, train


def test_context_mask_matches_hand_built_mask():
    anchors = torch.tensor([2, 4, 5])
    # rows: blocks at anchors 2, 4, 5; cols: context rows 0..5 (one row for all of a block's queries)
    assert torch.equal(context_mask(anchors, 6)[:, 0], torch.tensor([
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
    ], dtype=torch.bool))
    assert torch.equal(context_mask(anchors, 6, window=2)[:, 0], torch.tensor([  # the last 2 rows before the anchor
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ], dtype=torch.bool))


def test_causal_masks_match_hand_built_masks():
    """A causal layer with window 3: query i at anchor + i sees the keys k with anchor + i - k < 3."""
    anchors = torch.tensor([2, 4])
    assert torch.equal(context_mask(anchors, 6, window=3, causal_block=3), torch.tensor([
        [[1, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],  # anchor 2, queries at 2, 3, 4
        [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]],  # anchor 4, queries at 4, 5, 6
    ], dtype=torch.bool))
    assert torch.equal(context_mask(anchors, 6, causal_block=3), context_mask(anchors, 6))  # no window: all before
    assert torch.equal(block_mask(3, window=2), torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool))
    assert torch.equal(block_mask(3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_labels_line_up_with_slots():
    ids = torch.arange(100, 120)
    labels = block_labels(ids, torch.tensor([3, 10]), 4)
    assert labels.tolist() == [[104, 105, 106], [111, 112, 113]]  # slot j <-> token anchor + j


def test_slots_past_the_end_have_no_label():
    ids = torch.arange(100, 120)
    labels = block_labels(ids, torch.tensor([17, 18]), 4)
    assert labels.tolist() == [[118, 119, IGNORE], [119, IGNORE, IGNORE]]


def test_tau_counts_the_accepted_prefix_plus_the_target_token():
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert tau_of(correct) == 1 + (2 + 0 + 4) / 3


def test_the_walk_drafts_where_the_loop_would():
    """Accepted prefixes 2, 3, 3, 0, 3, 0, 1 at anchors 0..6: the loop drafts at 0 (accepts 2),
    then at 3 (0), then at 4 (3), then past the end: 5 tokens in 3 steps, where every anchor
    says 12 / 7."""
    correct = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]],
                           dtype=torch.bool)
    assert walked_acceptance(correct) == [2, 0, 3]
    assert tau_of(correct) == pytest.approx(1 + 12 / 7)
    assert walked_acceptance(correct[:0]) == []


def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[6], torch.tensor(torch.e ** (-6 / 7)))


def test_anchors_stay_inside_the_response():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        S, start, B = int(torch.randint(20, 60, ())), int(torch.randint(1, 15, ())), 4
        a = sample_anchors(start, S, B, 8, g)
        assert a.numel() == min(8, S - 2 - start + 1)
        assert (a >= start).all() and (a <= S - 2).all() and a.unique().numel() == a.numel()
    assert sample_anchors(10, 12, 4, 8).tolist() == [10]  # one label left: still an anchor
    assert sample_anchors(11, 12, 4, 8).numel() == 0


def test_target_features_are_the_models_hidden_states():
    """The decoder-only pass (no LM head) gives the causal LM's own hidden states."""
    target = tiny_target()
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    got = target_features(target, ids, [0, 3, 5])
    assert torch.equal(got, torch.cat([hs[1][0], hs[4][0], hs[6][0]], -1))


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_training_forward_equals_the_inference_draft_step(sliding_window):
    torch.manual_seed(0)
    d = DFlashDrafter.from_target(tiny_target_config(), num_layers=2, block_size=4)
    c, S = d.config, 20
    if sliding_window:  # layer 0 causal over a window of 5, layer 1 bidirectional over everything
        c.sliding_window, c.layer_types = sliding_window, ["sliding_attention", "full_attention"]
    feats = torch.randn(S, len(c.target_layer_ids) * c.hidden_size)
    anchors, emb = torch.tensor([3, 7, 12, 16]), torch.randn(4, 4, c.hidden_size)
    hidden = d(feats, emb, anchors)
    for a, p in enumerate(anchors.tolist()):
        runtime = DraftRuntime(d, 64)
        runtime.add_context(0, list(feats[:p].split(c.hidden_size, -1)), torch.arange(p))
        torch.testing.assert_close(runtime.draft_hidden(emb[a:a + 1], torch.arange(p, p + 4)[None])[0],
                                   hidden[a], rtol=1e-4, atol=1e-5)


def test_target_init_copies_the_last_layers_and_reads_the_deepest_features():
    from dflash_ext.training.trainer import init_layers_from_target

    target = tiny_target()
    d = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 4, 2])
    init_layers_from_target(d, target)
    layers = target.get_decoder().layers
    for mine, theirs in zip(d.layers, layers[-2:]):
        for name, t in theirs.state_dict().items():
            torch.testing.assert_close(mine.state_dict()[name], t, rtol=0, atol=0)
    torch.testing.assert_close(d.norm.weight, target.get_decoder().norm.weight, rtol=0, atol=0)
    H = d.config.hidden_size
    x = torch.randn(5, 3 * H)
    torch.testing.assert_close(d.fc(x), x[:, H:2 * H])  # layer 4, the deepest of [1, 4, 2]


def test_frozen_parts_get_no_gradient_and_are_not_saved(tmp_path):
    target = tiny_target()
    frozen = FrozenTargetParts(target)
    d = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    ids = torch.randint(0, 128, (30,))
    feats = torch.randn(30, len(d.config.target_layer_ids) * d.config.hidden_size)
    loss, _, _ = sequence_loss(d, frozen, ids, feats, torch.tensor([5, 12, 28]), 4, 4.0)
    loss.backward()
    assert all(p.grad is None for p in frozen.parameters())
    assert all(p.grad is not None for p in d.parameters())
    d.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_distillation_loss_is_the_cross_entropy_to_the_target_distribution():
    """distill = 1: each slot's loss is -sum p_target log q at the position before its label
    (the logits there predict it), weighted as the hard loss; distill = 0 is the hard loss;
    between, the mix; a teacher that is the label's one-hot gives the hard loss back."""
    import torch.nn.functional as F

    from dflash_ext.training.loss import target_distribution

    torch.manual_seed(0)
    target = tiny_target()
    frozen = FrozenTargetParts(target)
    d = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    S, V = 30, target.config.vocab_size
    ids = torch.randint(0, V, (S,))
    feats = torch.randn(S, len(d.config.target_layer_ids) * d.config.hidden_size)
    anchors = torch.tensor([5, 12, 27])  # the last block runs past the end
    teacher = torch.randn(S, V) * 3
    hard, w_sum, _ = sequence_loss(d, frozen, ids, feats, anchors, 4, 2.0)
    soft, w_sum1, _ = sequence_loss(d, frozen, ids, feats, anchors, 4, 2.0, teacher_logits=teacher, distill=1.0)
    mix, _, _ = sequence_loss(d, frozen, ids, feats, anchors, 4, 2.0, teacher_logits=teacher, distill=0.25)
    assert w_sum == w_sum1
    # by hand: slot j of anchor a reads teacher row a + j - 1
    with torch.no_grad():
        embeds = frozen.embed(torch.stack([torch.cat([ids[a:a + 1], torch.full((3,), d.config.mask_token_id)])
                                           for a in anchors]))
        logq = F.log_softmax(F.linear(d(feats, embeds, anchors)[:, 1:], frozen.lm_head.weight).float(), -1)
    labels = block_labels(ids, anchors, 4)
    w = loss_weights(4, 2.0)[None] * (labels != IGNORE)
    expected = 0.0
    for a, p in enumerate(anchors.tolist()):
        for j in range(1, 4):
            if p + j < S:
                expected -= w[a, j - 1] * (teacher[p + j - 1].softmax(-1) * logq[a, j - 1]).sum()
    torch.testing.assert_close(soft.detach(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mix, 0.75 * hard + 0.25 * soft, rtol=1e-5, atol=1e-5)
    one_hot = torch.full((S, V), -1e4)
    one_hot[torch.arange(S - 1), ids[1:]] = 1e4  # row p predicts token p + 1
    sharp, _, _ = sequence_loss(d, frozen, ids, feats, anchors, 4, 2.0, teacher_logits=one_hot, distill=1.0)
    torch.testing.assert_close(sharp, hard, rtol=1e-5, atol=1e-5)
    assert target_distribution(teacher, anchors, 4).shape == (3, 3, V)
    with pytest.raises(ValueError, match="teacher_logits"):
        sequence_loss(d, frozen, ids, feats, anchors, 4, 2.0, distill=0.5)


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions_per_slot():
    """Rejection sampling accepts a draft x ~ q with probability sum_x min(p, q): computed
    per slot from the target's log-probabilities at the position before the label."""
    from dflash_ext.training.loss import LossVocab, block_logits, sampled_acceptance

    torch.manual_seed(1)
    target = tiny_target()
    frozen = FrozenTargetParts(target)
    d = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    S, V = 25, target.config.vocab_size
    ids = torch.randint(0, V, (S,))
    feats = torch.randn(S, len(d.config.target_layer_ids) * d.config.hidden_size)
    anchors = torch.tensor([3, 10, 23])
    vocab = LossVocab(torch.arange(0, V, 2), frozen.lm_head.weight)  # a draft vocabulary of half the tokens
    out = block_logits(d, frozen, ids, feats, anchors, 4, vocab)
    log_p = (torch.randn(S, V) * 2).log_softmax(-1)  # over the whole vocabulary
    alpha = sampled_acceptance(out, log_p[:, vocab.ids], anchors)
    q = out.logits.float().softmax(-1)
    for a, pos in enumerate(anchors.tolist()):
        for j in range(3):
            want = torch.minimum(log_p[pos + j, vocab.ids].exp(), q[a, j]).sum() if pos + j + 1 < S else 0.0
            torch.testing.assert_close(alpha[a, j], torch.as_tensor(want, dtype=torch.float32))
    assert (alpha <= 1).all() and (alpha >= 0).all()


def test_distilled_training_reads_the_targets_logits_over_the_loss_vocabulary(tmp_path):
    """A distilled run (live features, a loss vocabulary) trains and moves the weights
    differently from the hard-label run; cached features are refused by name."""
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=4, new_tokens=20)
    common = dict(data=data, num_layers=1, block_size=4, anchors=8, epochs=1, batch_size=2, max_steps=2,
                  save_every=10 ** 9, log_every=10 ** 9, autocast="none", loss_vocab=60)
    hard = train(TrainConfig(out=str(tmp_path / "h"), features="live", **common), target, log=lambda m: None)
    soft = train(TrainConfig(out=str(tmp_path / "s"), features="live", distill=1.0, **common), target,
                 log=lambda m: None)
    assert not torch.equal(hard.fc.weight, soft.fc.weight)
    assert torch.isfinite(soft.fc.weight).all()
    with pytest.raises(ValueError, match="live features"):
        train(TrainConfig(out=str(tmp_path / "c"), features="cached", distill=0.5, **common), target,
              log=lambda m: None)
    with pytest.raises(ValueError, match="distill must be in"):
        train(TrainConfig(out=str(tmp_path / "x"), features="live", distill=1.5, **common), target,
              log=lambda m: None)


def _tiny_corpus(target, folder, n=6, prompt_len=6, new_tokens=40, layer_ids=(1, 3, 4)):
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (prompt_len,), generator=g).tolist() for _ in range(n)]  # in every tiny vocab
    with open(os.path.join(folder, "responses-00000.jsonl"), "w") as f:
        for i, p in enumerate(prompts):
            resp = target_generate(target, p, new_tokens).tokens
            f.write(json.dumps({"id": i, "input_ids": p + resp, "response_start": len(p)}) + "\n")
    compute_features(target, folder, list(layer_ids))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"target_layer_ids": list(layer_ids)}, f)
    return prompts


def _tiny_run(tmp_path, epochs: int):
    """(target, prompts, the saved drafter) of a tiny B = 4 run over a tiny corpus: repeated
    data, so `epochs` sets how far it overfits."""
    torch.manual_seed(0)
    target = tiny_target()
    prompts = _tiny_corpus(target, str(tmp_path / "data"))
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "ckpt"), num_layers=2, block_size=4,
                      anchors=64, lr=3e-3, epochs=epochs, batch_size=2, warmup=0.02, save_every=10 ** 9,
                      log_every=10 ** 9, autocast="none")
    train(cfg, target, log=lambda m: None)
    return target, prompts, DFlashDrafter.from_pretrained(cfg.out)  # the saved checkpoint is what decoding uses


@pytest.mark.slow
def test_tiny_drafter_overfits_until_whole_blocks_are_accepted(tmp_path):
    target, prompts, loaded = _tiny_run(tmp_path, epochs=150)
    taus = []
    for p in prompts:
        res = spec_generate(target, loaded, p, 40)
        assert res.tokens == target_generate(target, p, 40).tokens
        taus.append(res.tau)
    assert sum(taus) / len(taus) > 3.0, taus  # B = 4: close to whole blocks


def test_the_walk_accepts_what_the_decoding_loop_accepts(tmp_path):
    """A partly trained drafter: every step of spec_generate (fp32, greedy) accepts exactly the
    drafts walked_acceptance walks from the teacher-forced blocks of the sequence it made,
    the training forward at every anchor of its response (where the budget allows); at a
    verify B below the trained block, from the blocks' first B - 1 slots (heldout_tau's walk
    at each B, which block_size="auto" reads)."""
    target, prompts, drafter = _tiny_run(tmp_path, epochs=12)
    drafter = drafter.float().eval()
    frozen = FrozenTargetParts(target)
    seen = {2: set(), 4: set()}
    for B in seen:
        for p in prompts:
            res = spec_generate(target, drafter, p, 40, block_size=B)
            seq = torch.tensor(p + res.tokens)
            with torch.no_grad():
                feats = target_features(target, seq, drafter.config.target_layer_ids)
                out = block_logits(drafter, frozen, seq, feats, torch.arange(len(p), seq.numel() - 1), 4)
            correct = drafted_tokens(drafter, out) == out.labels
            walked = [k + 1 for k in walked_acceptance(correct[:, :B - 1])]
            last = len(res.acceptance_lengths) - 1  # the budget may cut the last step short
            assert walked[:last] == res.acceptance_lengths[:last], (B, walked, res.acceptance_lengths)
            seen[B] |= set(res.acceptance_lengths)
    assert len(seen[4]) >= 3 and seen[2] == {1, 2}, seen  # partly trained: short and long steps both walked


def _ddp_worker(rank, world, store, data, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    # A file store: no free port to race other processes for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    target = tiny_target()
    cfg = TrainConfig(data=data, out=out, num_layers=1, block_size=4, anchors=8, epochs=1, batch_size=4,
                      max_steps=3, save_every=10 ** 9, log_every=10 ** 9, autocast="none")
    train(cfg, target, log=lambda m: None)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path):
    import torch.multiprocessing as mp
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=8, new_tokens=20)
    cfg = TrainConfig(data=data, out=str(tmp_path / "one"), num_layers=1, block_size=4, anchors=8, epochs=1,
                      batch_size=4, max_steps=3, save_every=10 ** 9, log_every=10 ** 9, autocast="none")
    one = train(cfg, target, log=lambda m: None)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), data, str(tmp_path / "two")), nprocs=2, join=True)
    two = DFlashDrafter.from_pretrained(str(tmp_path / "two"))
    for (n, p1), p2 in zip(one.state_dict().items(), two.state_dict().values()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    # and training moved the weights at all
    fresh = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3, 4])
    assert not torch.equal(fresh.fc.weight, two.fc.weight)


def test_live_features_train_exactly_as_cached_ones(tmp_path):
    """features="live" (a target forward per sequence) computes the cache's features."""
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=4, new_tokens=20)
    common = dict(data=data, num_layers=1, block_size=4, anchors=8, epochs=1, batch_size=2, max_steps=2,
                  save_every=10 ** 9, log_every=10 ** 9, autocast="none")
    cached = train(TrainConfig(out=str(tmp_path / "c"), features="cached", **common), target, log=lambda m: None)
    live = train(TrainConfig(out=str(tmp_path / "l"), features="live", **common), target, log=lambda m: None)
    for (n, p1), p2 in zip(cached.state_dict().items(), live.state_dict().values()):
        # the cache stores bf16 features; live ones are fp32
        torch.testing.assert_close(p1, p2, rtol=2e-2, atol=2e-3, msg=lambda m: f"{n}: {m}")


def test_bf16_training_with_target_init_and_heldout_tau(tmp_path):
    """bf16 autocast with live features and layers started from the target: the held-out
    tau is logged, resume continues, and the caller's target keeps its dtype."""
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=6, new_tokens=30)
    os.remove(os.path.join(data, "meta.json"))
    for f in os.listdir(data):
        if f.startswith("features-"):
            os.remove(os.path.join(data, f))
    cfg = TrainConfig(data=data, out=str(tmp_path / "ckpt"), num_layers=2, block_size=4, anchors=16, epochs=2,
                      batch_size=2, holdout=2, eval_every=2, save_every=2, log_every=1, autocast="bf16",
                      init="target", layer_ids=[1, 3, 4], max_steps=3, loss_vocab=40, eval_stride=1)
    logs = []
    train(cfg, target, log=logs.append)
    assert next(target.parameters()).dtype == torch.float32
    assert any("features live" in m and "bf16 autocast on" in m for m in logs)
    evals = [json.loads(l) for l in open(tmp_path / "ckpt" / "eval.jsonl")]
    assert [e["step"] for e in evals] == [2, 3] and all(1 <= e["tau"] <= 4 for e in evals)
    assert all(1 <= e["tau_walked"] <= 4 for e in evals) and any("as the loop walks" in m for m in logs)
    assert all(1 <= e["tau_t1"] <= 4 and len(e["accept_t1"]) == 3 for e in evals)  # live features: measured
    assert evals[1]["slot_tokens"] > evals[0]["slot_tokens"] > 0
    from dflash_ext.training.trainer import evaluate_drafter

    saved = DFlashDrafter.from_pretrained(cfg.out)
    assert saved.acceptance_profile == pytest.approx(evals[-1]["accept"])  # acceptance.json beside the weights
    # The loss vocabulary is the checkpoint's draft vocabulary: the most frequent response tokens.
    from dflash_ext.training.data import load_records
    from dflash_ext.training.loss import most_frequent_tokens

    expected, _ = most_frequent_tokens(load_records(data)[:-2], target.config.vocab_size, 40)
    assert torch.equal(saved.draft_vocab, expected)
    tau = evaluate_drafter(saved, target, cfg).tau  # the same held-out records and anchors as training's eval
    assert tau == pytest.approx(evals[-1]["tau"], abs=0.02)
    cfg.max_steps = 4
    logs.clear()
    train(cfg, target, log=logs.append)
    assert any("resumed at step 3" in m for m in logs)
    # Another machine: only the committed weights travel; training continues from them.
    # Another machine: only the committed weights travel; training continues from them, here
    # retargeted to another block size (the layers do not depend on it).
    cont = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "cont"), "init": cfg.out, "max_steps": 1,
                          "block_size": 3})
    again = train(cont, target, log=lambda m: None)
    assert not torch.equal(again.fc.weight, DFlashDrafter.from_pretrained(cfg.out).fc.weight.float())
    reloaded = DFlashDrafter.from_pretrained(cont.out)
    assert reloaded.config.block_size == 3 and len(reloaded.acceptance_profile) == 2


def test_training_step_and_heldout_eval_on_a_hybrid_target(tmp_path):
    """A Gated DeltaNet hybrid target (qwen3_5: linear-attention + full-attention layers):
    responses, cached features, a few training steps on repeated data (the loss falls) and
    the held-out tau, during training and from evaluate_drafter on the saved drafter."""
    from dflash_ext.training.trainer import evaluate_drafter

    target = tiny_family_target("qwen3_5")
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=5, new_tokens=20, layer_ids=(0, 2))
    cfg = TrainConfig(data=data, out=str(tmp_path / "ckpt"), num_layers=1, block_size=4, anchors=16, lr=3e-3,
                      epochs=4, batch_size=2, warmup=0.1, holdout=1, save_every=10 ** 9, log_every=1,
                      autocast="none")  # 4 training records: 2 steps an epoch, the same data again and again
    logs = []
    drafter = train(cfg, target, log=logs.append)
    assert drafter.config.target_layer_ids == [0, 2] and drafter.config.num_target_layers == 4
    losses = [float(m.split(" loss ")[1].split()[0]) for m in logs if m.startswith("[train] step")]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    evals = [json.loads(l) for l in open(tmp_path / "ckpt" / "eval.jsonl")]
    assert [e["step"] for e in evals] == [8] and 1 <= evals[0]["tau"] <= 4
    held = evaluate_drafter(DFlashDrafter.from_pretrained(cfg.out), target, cfg)
    assert held.tau == pytest.approx(evals[0]["tau"], abs=0.02) and len(held.accept) == 3
    assert held.tau_walked is None and held.walked_tau is None  # measured at eval_stride 1 only
    walked = evaluate_drafter(DFlashDrafter.from_pretrained(cfg.out), target, replace(cfg, eval_stride=1))
    assert walked.tau_walked is not None and 1 <= walked.tau_walked <= 4
    assert len(walked.walked_tau) == 3 and walked.walked_tau[-1] == walked.tau_walked  # at verify B = 2, 3, 4
    assert all(1 <= t <= b for b, t in enumerate(walked.walked_tau, 2))


def test_added_layers_leave_the_drafts_unchanged_until_trained(tmp_path):
    """add_layers appends layers whose output projections are zero: the training forward and
    the inference draft step give what they gave before, the checkpoint round-trips with the
    new count, and a gradient step moves the new layers off zero."""
    torch.manual_seed(0)
    target = tiny_target()
    d = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    c, S = d.config, 20
    feats = torch.randn(S, len(c.target_layer_ids) * c.hidden_size)
    anchors, emb = torch.tensor([3, 9, 15]), torch.randn(3, 4, c.hidden_size)

    def draft(m, p=9):
        runtime = DraftRuntime(m, 64)
        runtime.add_context(0, list(feats[:p].split(c.hidden_size, -1)), torch.arange(p))
        return runtime.draft_hidden(emb[1:2], torch.arange(p, p + 4)[None])

    before_train, before_draft = d(feats, emb, anchors), draft(d)
    d.add_layers(2)
    assert len(d.layers) == c.num_hidden_layers == 4 and len(c.layer_types) == 4
    assert torch.equal(d(feats, emb, anchors), before_train)
    assert torch.equal(draft(d), before_draft)
    d.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert loaded.config.num_hidden_layers == 4 and torch.equal(draft(loaded), before_draft)
    loss, _, _ = sequence_loss(d, FrozenTargetParts(target), torch.randint(0, 128, (S,)), feats, anchors, 4, 4.0)
    loss.backward()
    assert d.layers[3].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert d.layers[3].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="n >= 1"):
        d.add_layers(0)


def test_a_continuation_may_add_layers_but_not_drop_them(tmp_path):
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=4, new_tokens=20)
    base = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 3, 4])
    base.save_pretrained(str(tmp_path / "base"))
    cfg = TrainConfig(data=data, out=str(tmp_path / "grown"), init=str(tmp_path / "base"), num_layers=3,
                      block_size=4, anchors=8, epochs=1, batch_size=2, max_steps=1, log_every=1,
                      autocast="none")
    grown = train(cfg, target, log=lambda m: None)
    assert grown.config.num_hidden_layers == 3
    assert DFlashDrafter.from_pretrained(cfg.out).config.num_hidden_layers == 3
    kept = train(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "kept"), "num_layers": None}), target,
                 log=lambda m: None)
    assert kept.config.num_hidden_layers == 2  # no num_layers: the init drafter's own count
    with pytest.raises(ValueError, match="num_layers=1 is fewer than the 2 layers of --init"):
        train(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "fewer"), "num_layers": 1}), target,
              log=lambda m: None)


def _records(ids, prompt_of=lambda i: [i % 100 + 3, 7]):
    return [{"id": i, "input_ids": prompt_of(i) + [5, 6, 7, 8], "response_start": 2} for i in ids]


def test_heldout_records_whose_prompt_was_trained_on_are_dropped():
    records = _records(range(10), prompt_of=lambda i: [3, 7] if i in (2, 8) else [i + 10, 7])
    training, heldout = split_holdout(records, 3)
    assert [r["id"] for r in training] == list(range(7))
    assert [r["id"] for r in heldout] == [7, 9]  # 8 repeats 2's prompt


def _write(folder, records):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "responses-00000.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_extra_data_is_trained_on_and_never_held_out(tmp_path):
    _write(tmp_path / "main", _records(range(8)))
    _write(tmp_path / "code", _records(range(2_000_000, 2_000_005)))
    cfg = TrainConfig(data=str(tmp_path / "main"), out="", holdout=2, features="live",
                      extra_data=[str(tmp_path / "code")])
    features = _Features(cfg, tiny_target(), [1, 3, 4], "cpu", torch.float32)
    training, heldout = _split_records(cfg, features)
    assert [r["id"] for r in heldout] == [6, 7]
    assert sorted(r["id"] for r in training) == list(range(6)) + list(range(2_000_000, 2_000_005))
    _write(tmp_path / "clash", _records([3, 2_000_009]))
    with pytest.raises(ValueError, match="extra_data folder .*clash repeats record ids .*e.g. 3"):
        _split_records(TrainConfig(**{**cfg.__dict__, "extra_data": [str(tmp_path / "clash")]}), features)


def test_extra_data_needs_live_features(tmp_path):
    target = tiny_target()
    data = str(tmp_path / "data")
    _tiny_corpus(target, data, n=3, new_tokens=10)
    _write(tmp_path / "more", _records([100]))
    cfg = TrainConfig(data=data, out="", features="cached", extra_data=[str(tmp_path / "more")])
    with pytest.raises(ValueError, match="extra_data needs live features"):
        _split_records(cfg, _Features(cfg, target, [1, 3, 4], "cpu", torch.float32))


class _ChatTokenizer:
    """The three things generate_responses asks of a tokenizer."""
    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        return {"input_ids": [2] + [3 + ord(c) % 100 for c in messages[0]["content"]] + [2]}


def test_generated_records_take_ids_from_the_base_and_resume(tmp_path):
    target = tiny_target()
    prompts = ["abc", "defgh", "x" * 40, "ij"]
    n = generate_responses(target, _ChatTokenizer(), prompts[:2], str(tmp_path), max_new_tokens=5,
                           max_prompt_tokens=20, batch_size=2, id_base=500)
    assert n == (2, [])
    n = generate_responses(target, _ChatTokenizer(), prompts, str(tmp_path), max_new_tokens=5,
                           max_prompt_tokens=20, batch_size=2, id_base=500)  # resumes: only "ij" is new
    records = load_records(str(tmp_path))
    assert n == (3, [502]) and [r["id"] for r in records] == [500, 501, 503]  # 502's prompt is over 20 tokens
    for r, p in zip(records, [prompts[0], prompts[1], prompts[3]]):
        prompt = _ChatTokenizer().apply_chat_template([{"content": p}], True, True)["input_ids"]
        assert r["input_ids"][:r["response_start"]] == prompt
        # greedy: the target's own continuation of the prompt (batched with left padding)
        assert r["input_ids"][r["response_start"]:] == target_generate(target, prompt, 5).tokens[:len(r["input_ids"]) - r["response_start"]]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_greedy_batch_makes_the_tokens_of_hf_generate_while_dropping_finished_rows(family):
    """Also on a hybrid target, whose linear-attention states leave the batch with the rows."""
    target = tiny_target() if family == "llama" else tiny_family_target(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    eos = target_generate(target, prompts[0], 4).tokens[3]  # a token this target emits: rows end early
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    got = greedy_batch(target, ids, mask, 24, eos)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)[:, width:].tolist()
    lengths = set()
    for g_row, r_row in zip(got, ref):
        want = r_row[:r_row.index(eos) + 1] if eos in r_row else r_row
        assert g_row == want
        lengths.add(len(g_row))
    assert len(lengths) > 1 and got[0][-1] == eos  # rows did leave the batch at different steps


def test_heldout_records_with_an_extra_data_prompt_are_dropped(tmp_path):
    _write(tmp_path / "main", _records(range(6)))
    _write(tmp_path / "more", _records([2_000_000], prompt_of=lambda i: [8, 7]))  # record 5's prompt
    cfg = TrainConfig(data=str(tmp_path / "main"), out="", holdout=2, features="live",
                      extra_data=[str(tmp_path / "more")])
    _, heldout = _split_records(cfg, _Features(cfg, tiny_target(), [1, 3, 4], "cpu", torch.float32))
    assert [r["id"] for r in heldout] == [4]
