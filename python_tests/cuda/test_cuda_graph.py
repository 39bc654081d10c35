"""The CUDA draft step without host syncs, and its CUDA graph (DFlashProposer): a
validate=False draft step makes no synchronising call, and a captured graph replayed over
20 steps with a growing context drafts what the eager step drafts. CUDA only: every test
skips without a GPU; the CPU cases check what the proposer does there (nothing new)."""
import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.draft.runtime import DraftRuntime

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


def test_the_draft_vocab_head_is_gathered_once_per_drafter():
    target, drafter = _pair("cpu", draft_vocab=list(range(0, 128, 3)))
    a = DFlashProposer(drafter, target, capacity=64)
    b = DFlashProposer(drafter, target, capacity=64)
    assert a.runtime.vocab_weight is b.runtime.vocab_weight
    torch.testing.assert_close(a.runtime.vocab_weight, target.get_output_embeddings().weight[::3])


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
    assert graph.runtime.cuda_graph and [n for _, n in graph.runtime._graphs] == [7]  # one step, keeping 7 tokens


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
