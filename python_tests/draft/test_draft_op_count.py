"""Fewer launches per step (issue 38, item 3): one DFlashProposer.propose dispatches at most
12 compute ops per v1 drafter layer on the fused path, and no op that reads a device value
on the host (what would sync on CUDA). Counted on the CPU with a TorchDispatchMode that sees
every aten and dflash_ext op the step dispatches (not the ATen calls inside our compiled
kernels) and ignores views; the fixed per-step ops (block embedding, RoPE rows, LM head,
argmax) cancel in the difference between drafters of 1 and 3 layers."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.testing.targets import tiny_target

MAX_OPS_PER_LAYER = 12
# No data movement or aliasing only: the ops a compiler would not launch a kernel for.
_NOT_COMPUTE = {"detach", "alias", "_unsafe_view", "lift_fresh"}
# Ops that read a device value on the host (a sync on CUDA).
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "_assert_async"}


class ComputeOpCounter(TorchDispatchMode):
    """Counts the ops dispatched under it by name (aten.mm, dflash_ext.qk_norm_rope, ...),
    views and aliases left out."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NOT_COMPUTE:
            self.ops[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def propose_ops(target, num_layers, fused, dflash2=False):
    """The ops of one propose (after a first one: caches and stacked weights built once)."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=num_layers, block_size=8, seed=1)
    if dflash2:
        drafter = DFlashDrafter.dflash2_from(drafter, conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                                             selector_top_k=4)
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    _, hidden, _ = TargetRunner(target, drafter.config.target_layer_ids)(ids, None)
    proposer = DFlashProposer(drafter, target, capacity=64, fused=fused)
    proposer.accept(hidden, slice(0, ids.shape[1]), torch.arange(ids.shape[1]))
    first = proposer.propose(7, ids.shape[1], 7)
    with ComputeOpCounter() as counter:
        again = proposer.propose(7, ids.shape[1], 7)
    assert torch.equal(first, again)
    return counter


def test_fused_step_has_at_most_12_compute_ops_per_layer(target):
    one, three = propose_ops(target, 1, fused=True), propose_ops(target, 3, fused=True)
    per_layer = (three.total - one.total) / 2
    layer_ops = three.ops - one.ops
    assert per_layer <= MAX_OPS_PER_LAYER, f"{per_layer} ops per layer: {dict(layer_ops)}"
    # each layer: its two norms, one GEMM each for q/k/v, o, gate/up and down, q/k norm + RoPE, attention;
    # the GEMMs of a block's few rows (fp32) run skinny_linear's streaming kernel on the CPU
    assert layer_ops["dflash_ext.skinny_linear"] == 2 * 4 and not layer_ops["aten.mm"]
    assert layer_ops["dflash_ext.qk_norm_rope"] == 2
    assert layer_ops["dflash_ext.block_attention"] == 2 and layer_ops["dflash_ext.add_rms_norm"] == 2 * 2


def test_dflash2_layers_add_only_their_convolutions(target):
    """A DFlash2 layer: the v1 layer's ops plus its two convolutions' delta GEMMs and four
    block_conv calls."""
    v1 = [propose_ops(target, n, fused=True) for n in (1, 3)]
    v2 = [propose_ops(target, n, fused=True, dflash2=True) for n in (1, 3)]
    extra = (v2[1].ops - v2[0].ops) - (v1[1].ops - v1[0].ops)
    assert dict(extra) == {"aten.mm": 2 * 2, "dflash_ext.block_conv": 2 * 4}


def test_the_unfused_reference_path_is_the_many_op_baseline(target):
    """The count means something: the reference path (DecoderLayer.forward) dispatches far
    more per layer, the figure the issue started from."""
    one, three = propose_ops(target, 1, fused=False), propose_ops(target, 3, fused=False)
    assert (three.total - one.total) / 2 > 3 * MAX_OPS_PER_LAYER


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_no_host_read_of_a_device_value_in_propose(target, fused):
    counter = propose_ops(target, 3, fused=fused)
    read = {name: n for name, n in counter.ops.items() if name.split(".", 1)[1] in HOST_READS}
    if fused:
        assert not read, f"host reads in the fused propose: {read}"
    else:  # the reference attention reads the cache lengths on the host: the check can see a host read
        assert read
