"""The fused draft layers (dflash_ext.draft.layers.fused_layer: stacked q/k/v and gate/up GEMMs,
ops.rms_norm with the residual add, ops.qk_norm_rope; DFlash2's convolutions on ops.block_conv)
against their reference,
DecoderLayer.forward (fused=False): hidden states within the dtype's tolerance on random
drafters, layouts mixing full and symmetric-window layers, the parameters as views of the
stacked weights (no second copy; training and saving go on), the checkpoint format unchanged, and the same greedy drafts on tiny targets."""
import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.testing.targets import tiny_target, tiny_target_config

PROMPT = [5, 17, 33, 2, 9, 41, 77, 12]


def _draft_hidden(drafter, fused, bsz=2, ctx_lens=(11, 4), seed=0):
    """draft_hidden over Bsz blocks after random context features of ctx_lens tokens each."""
    g = torch.Generator().manual_seed(seed)
    c, dtype = drafter.config, drafter.fc.weight.dtype
    runtime = DraftRuntime(drafter, 64, batch_size=bsz, fused=fused)
    for b in range(bsz):
        feats = [torch.randn(ctx_lens[b], c.hidden_size, generator=g).to(dtype) for _ in c.target_layer_ids]
        runtime.add_context(b, feats, torch.arange(ctx_lens[b]))
    embeds = torch.randn(bsz, c.block_size, c.hidden_size, generator=g).to(dtype)
    positions = torch.stack([torch.arange(n, n + c.block_size) for n in ctx_lens[:bsz]])
    return runtime.draft_hidden(embeds, positions).float()


def _drafter(kind="qwen3", num_layers=3, dtype=torch.float32, seed=0, **overrides):
    drafter = DFlashDrafter.from_target(tiny_target_config(kind), num_layers=num_layers, block_size=8, seed=seed,
                                        **overrides)
    with torch.no_grad():
        for p in drafter.parameters():  # norm weights away from 1: a swapped or missing gain shows
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return drafter.to(dtype)


def _assert_hidden_close(fused, ref, rel):
    err = (fused - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |fused - reference| = {err:.3g}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)],
                         ids=["fp32", "bf16", "fp16"])
def test_fused_layers_match_the_decoder_layer(kind, dtype, rel):
    for seed in range(3):
        drafter = _drafter(kind, dtype=dtype, seed=seed)
        _assert_hidden_close(_draft_hidden(drafter, True, seed=seed), _draft_hidden(drafter, False, seed=seed), rel)


def test_fused_layers_beside_unfused_ones():
    """A symmetric-window layer (block_attention's symmetric window on the fused path) between
    full-attention ones, and as the last layer."""
    drafter = _drafter(num_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                       sliding_window=3, causal=False)
    assert drafter.config.layer_symmetric_window == [False, True, False]
    _assert_hidden_close(_draft_hidden(drafter, True), _draft_hidden(drafter, False), 2e-5)
    last_unfused = _drafter(num_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                            causal=False)
    _assert_hidden_close(_draft_hidden(last_unfused, True), _draft_hidden(last_unfused, False), 2e-5)


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_fused_dflash2_layers_match_the_decoder_layer(dtype, rel):
    """DFlash2's convolutions (random, away from their identity) around the fused attention and MLP."""
    drafter = DFlashDrafter.dflash2_from(_drafter(), conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                                         selector_top_k=4)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.2 * torch.randn_like(conv.base_kernel))
                conv.kernel_projection.weight.normal_(std=0.05)
    drafter.to(dtype)
    _assert_hidden_close(_draft_hidden(drafter, True), _draft_hidden(drafter, False), rel)


def _stack_groups(layer):
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (m.gate_proj.weight, m.up_proj.weight)


def _assert_views_of_stacked(runtime):
    """Each layer's q/k/v and gate/up parameters are the rows of its stacked weights, in order."""
    for layer, stacked in zip(runtime.drafter.layers, runtime.layer_weights()):
        for whole, params in zip(stacked, _stack_groups(layer)):
            assert torch.equal(whole, torch.cat([p.detach() for p in params]))
            row = 0
            for p in params:
                assert p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                assert p.data_ptr() == whole[row].data_ptr()
                row += p.shape[0]


def test_stacked_weights_are_the_parameters():
    """Stacked once, and the parameters become views of the stacked rows (no second copy); an
    in-place update (a training step) is read with no rebuild; a replaced parameter and a cast
    stack anew; the checkpoint keeps its own names."""
    drafter = _drafter(num_layers=2)
    keys = set(drafter.state_dict())
    runtime = DraftRuntime(drafter, 64)
    first = runtime.layer_weights()
    _assert_views_of_stacked(runtime)
    assert all(a is b for pair, again in zip(first, runtime.layer_weights()) for a, b in zip(pair, again))
    layer = drafter.layers[1]
    before = _draft_hidden(drafter, True)
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(1.5)
    assert runtime.layer_weights()[1][1] is first[1][1]  # the update is already in it
    after = _draft_hidden(drafter, True)
    assert not torch.allclose(before, after)
    _assert_hidden_close(after, _draft_hidden(drafter, False), 2e-5)
    layer.self_attn.k_proj.weight = torch.nn.Parameter(torch.randn_like(layer.self_attn.k_proj.weight))
    assert runtime.layer_weights()[1][0] is not first[1][0]
    _assert_views_of_stacked(runtime)
    _assert_hidden_close(_draft_hidden(drafter, True), _draft_hidden(drafter, False), 2e-5)
    drafter.to(torch.bfloat16)
    assert runtime.layer_weights()[0][0].dtype == torch.bfloat16
    _assert_views_of_stacked(runtime)
    assert set(drafter.state_dict()) == keys


def test_stacked_weights_keep_training_and_saving(tmp_path):
    """After a draft step (here in inference mode) the parameters still train, the optimizer's
    in-place step reaches the stacked rows, and save_pretrained writes a checkpoint that loads
    the same weights (the parameters are disjoint views of one tensor: safetensors writes
    those, and would refuse overlapping ones)."""
    drafter = _drafter(num_layers=2)
    with torch.inference_mode():
        _draft_hidden(drafter, True)
    q = drafter.layers[0].self_attn.q_proj.weight
    assert q.requires_grad and not q.is_inference()
    opt = torch.optim.SGD(drafter.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, drafter.config.hidden_size, generator=g)
    cos, sin = torch.ones(1, 4, 1, drafter.config.head_dim), torch.zeros(1, 4, 1, drafter.config.head_dim)
    def attend(q, k, v):  # [1, 4, heads, D]
        t = [a.transpose(1, 2) for a in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*t, enable_gqa=True).transpose(1, 2)

    out = drafter.layers[0](x, cos, sin, attend)
    out.square().mean().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    old = q.detach().clone()
    opt.step()
    assert not torch.equal(q, old)
    _assert_views_of_stacked(DraftRuntime(drafter, 64))
    _assert_hidden_close(_draft_hidden(drafter, True), _draft_hidden(drafter, False), 2e-5)
    drafter.save_pretrained(str(tmp_path / "ckpt"))
    loaded = DFlashDrafter.from_pretrained(str(tmp_path / "ckpt"))
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fused_and_reference_proposers_draft_the_same_tokens(kind):
    target = tiny_target(kind)
    drafter = DFlashDrafter.from_target(target.config, num_layers=3, block_size=8, seed=2)
    with torch.no_grad():
        drafter.fc.weight.mul_(4)  # sharper drafts than the init: no argmax ties
    ids = torch.tensor([PROMPT])
    _, hidden, _ = TargetRunner(target, drafter.config.target_layer_ids)(ids, None)
    drafts = []
    for fused in (True, False):
        proposer = DFlashProposer(drafter, target, capacity=64, fused=fused)
        proposer.accept(hidden, slice(0, ids.shape[1] - 1), torch.arange(ids.shape[1] - 1))
        drafts.append([proposer.propose(PROMPT[-1], ids.shape[1] - 1, n) for n in (3, 7)])
    for f, r in zip(*drafts):
        assert torch.equal(f, r)
