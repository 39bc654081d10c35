"""The CUDA draft step without host syncs, and its CUDA graph (DFlashProposer): a
validate=False draft step makes no synchronising call, and a captured graph replayed over
20 steps with a growing context drafts what the eager step drafts. CUDA only: every test
skips without a GPU; the CPU cases check what the proposer does there (nothing new)."""
import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.sampling import Sampling

from dflash_ext.testing.targets import tiny_target, tiny_target_config
from python_tests.helpers import HAS_CUDA

CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")


def _pair(device, dtype=torch.float32, draft_vocab=None):
    # head_dim 64: the tensor-core kernels on CUDA in bf16
    target = tiny_target("qwen3", num_hidden_layers=4, hidden_size=256).to(device, dtype)
    drafter = DFlashDrafter.from_target(tiny_target_config("qwen3", num_hidden_layers=4, hidden_size=256), num_layers=2,
                                        block_size=8, seed=1).to(device, dtype)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    return target, drafter


def _hidden_states(target, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, n), generator=g).to(target.device)
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True).hidden_states


def test_cpu_proposer_neither_captures_nor_skips_validation():
    target, drafter = _pair("cpu")
    prop = DFlashProposer(drafter, target, capacity=64)
    assert not prop.runtime.cuda_graph and prop.runtime.validate
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        DFlashProposer(drafter, target, capacity=64, cuda_graph=True)


def test_the_draft_vocab_head_is_gathered_once_per_runtime():
    """Gathered when the runtime is made, kept by a new generation (reset), gathered again at
    the next generation once the target's head was written (in place: its version)."""
    target, drafter = _pair("cpu", draft_vocab=list(range(0, 128, 3)))
    prop = DFlashProposer(drafter, target, capacity=64)
    rows = prop.runtime.vocab_weight
    torch.testing.assert_close(rows, target.get_output_embeddings().weight[::3])
    prop.reset(64)
    assert prop.runtime.vocab_weight is rows
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2)
    prop.reset(64)
    assert prop.runtime.vocab_weight is not rows
    torch.testing.assert_close(prop.runtime.vocab_weight, target.get_output_embeddings().weight[::3])


def test_proposer_past_its_positions_is_a_clear_error():
    target, drafter = _pair("cpu")
    prop = DFlashProposer(drafter, target, capacity=16)
    with pytest.raises(RuntimeError, match="runs past"):
        prop.propose(1, 16 + 8, 7)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_draft_step_without_validation_never_syncs(dtype):
    target, drafter = _pair("cuda", dtype)
    prop = DFlashProposer(drafter, target, capacity=256, cuda_graph=False)
    hs = _hidden_states(target, 40)
    positions = torch.arange(40, device="cuda")
    prop.accept(hs, slice(0, 30), positions[:30])
    prop.propose(3, 30, 7)  # warm-up: lazy initialisation outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prop.propose(5, 30, 7)
        prop.accept(hs, slice(30, 33), positions[30:33])
        prop.propose(7, 33, 7)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_vocab", [None, list(range(1, 128, 2))])
def test_cuda_graph_replays_equal_the_eager_step_as_the_context_grows(dtype, draft_vocab):
    # capacity 4096: the attention is planned for it (~16 splits of 256-320 keys), and the
    # context passes 320 keys, so the merge sees more than one non-empty split.
    target, drafter = _pair("cuda", dtype, draft_vocab)
    graph = DFlashProposer(drafter, target, capacity=4096, cuda_graph=True)
    eager = DFlashProposer(drafter, target, capacity=4096, cuda_graph=False)
    hs = _hidden_states(target, 500, seed=3)
    positions = torch.arange(500, device="cuda")
    pos = 300
    for p in (graph, eager):
        p.accept(hs, slice(0, pos), positions[:pos])
    for step in range(20):
        last = (7 * step + 1) % 128
        got, want = graph.propose(last, pos, 7), eager.propose(last, pos, 7)
        assert torch.equal(got, want), f"step {step} at context {pos}: graph {got.tolist()} != eager {want.tolist()}"
        n = 1 + step % 5  # accepted tokens of this step
        for p in (graph, eager):
            p.accept(hs, slice(pos, pos + n), positions[pos:pos + n])
        pos += n
    assert graph.runtime.cuda_graph and [key[1] for key in graph.runtime._graphs] == [7]  # one step, keeping 7 tokens


def _sampling(seed=0):
    return Sampling(temperature=0.8, top_k=20, top_p=0.95, generator=torch.Generator("cuda").manual_seed(seed))


@CUDA_ONLY
@pytest.mark.parametrize("dflash2", [False, True])
@pytest.mark.parametrize("draft_vocab", [None, list(range(1, 128, 2))])
def test_cuda_graph_sampled_step_equals_the_eager_sampled_step(dflash2, draft_vocab):
    """At T > 0 the captured step ends at the logits and the sampling (a DFlash2 walk too)
    runs after the replay with the proposer's generator: the same seed drafts the same tokens
    and the same q as the eager step, and the step reads nothing on the host."""
    target, drafter = _pair("cuda", torch.float32, draft_vocab)
    if dflash2:
        drafter = DFlashDrafter.dflash2_from(drafter, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                             selector_top_k=4).to("cuda")
    graph = DFlashProposer(drafter, target, capacity=1024, cuda_graph=True, sampling=_sampling())
    eager = DFlashProposer(drafter, target, capacity=1024, cuda_graph=False, sampling=_sampling())
    hs = _hidden_states(target, 200, seed=3)
    positions = torch.arange(200, device="cuda")
    pos = 100
    for p in (graph, eager):
        p.accept(hs, slice(0, pos), positions[:pos])
    graph.propose(3, pos, 7), eager.propose(3, pos, 7)  # capture and warm-up outside the checked region
    torch.cuda.synchronize()
    for step in range(10):
        last = (7 * step + 1) % 128
        torch.cuda.set_sync_debug_mode("error")
        try:
            (got, got_q), (want, want_q) = graph.propose(last, pos, 7), eager.propose(last, pos, 7)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), f"step {step}: graph {got.tolist()} != eager {want.tolist()}"
        torch.testing.assert_close(got_q, want_q)
        assert got_q.shape == (7, 128) and (got_q[torch.arange(7), got] > 0).all()
        n = 1 + step % 5
        for p in (graph, eager):
            p.accept(hs, slice(pos, pos + n), positions[pos:pos + n])
        pos += n
    assert [key for key in graph.runtime._graphs] == [(7, 7, True)]


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_unvalidated_step_planned_for_the_capacity_matches_the_validated_step(dtype):
    """validate=False plans the attention for the whole capacity (many splits, most of them
    empty); validate=True plans it from the lens read on the host: same hidden states."""
    target, drafter = _pair("cuda", dtype)
    runtime = DraftRuntime(drafter, 4096)
    hs = _hidden_states(target, 450, seed=5)
    feats = [hs[l + 1][0].to(dtype) for l in drafter.config.target_layer_ids]
    runtime.add_context(0, feats, torch.arange(450, device="cuda"))
    embeds = torch.randn(1, 8, drafter.config.hidden_size, device="cuda").to(dtype)
    positions = torch.arange(450, 458, device="cuda")[None]
    with torch.no_grad():
        checked = runtime.draft_hidden(embeds, positions).float()
        runtime.validate = False
        unchecked = runtime.draft_hidden(embeds, positions).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(unchecked, checked, rtol=tol, atol=tol)
