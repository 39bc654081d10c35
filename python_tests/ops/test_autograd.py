"""The fused ops have no backward (issue 31, item 9): asked for a gradient they raise,
naming the way out, instead of returning an output whose inputs silently get no .grad;
without gradients they run as before. streamed_linears leaves a layer that trains on
F.linear, so its gradients arrive."""
import copy
import re

import pytest
import torch
from torch import nn

import dflash_ext
from dflash_ext import streamed_linears
from dflash_ext.ops.linear import skinny_linear_streams
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs, make_linear_inputs, make_project_inputs

INPUTS = {
    "project_features": lambda: list(make_project_inputs(5, 32, 3, 24, seed=1)),
    "inject_context_kv": lambda: list(make_inject_inputs(6, 32, 2, 2, 16, S=9, P=12, seed=2, sentinel=0.0).args()),
    "block_attention": lambda: list(make_attention_inputs([5, 0, 9], 3, 4, 2, 16, window=6, seed=3,
                                                          poison=False).args()),
    "skinny_linear": lambda: list(make_linear_inputs(4, 24, 40, bias=True, seed=4)),
}


def _float_tensors(args):
    """(label, tensor) of every floating-point tensor argument, those in a list too."""
    found = []
    for i, a in enumerate(args):
        for j, t in enumerate(a if isinstance(a, list) else [a]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                found.append((f"{i}.{j}" if isinstance(a, list) else str(i), t))
    return found


CASES = [(name, label) for name, make in INPUTS.items() for label, _ in _float_tensors(make())]


@pytest.mark.parametrize("name,label", CASES)
def test_an_op_asked_for_a_gradient_raises(name, label):
    args = INPUTS[name]()
    dict(_float_tensors(args))[label].requires_grad_(True)
    op = getattr(dflash_ext.ops, name)
    message = (f"dflash_ext.ops.{name} has no backward (inference only): call it under torch.no_grad() / "
               f"torch.inference_mode(), or use dflash_ext.ops.reference.{name} for gradients")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        op(*args)
    with torch.no_grad():  # the same inputs, no gradient asked for: the op runs
        op(*args)
    with torch.inference_mode():
        op(*args)


def test_a_streamed_layer_that_trains_gets_its_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32, bias=False))
    streamed = copy.deepcopy(plain)
    x = torch.randn(4, 64)
    assert skinny_linear_streams(x, plain[0].weight), "the test needs rows the op would stream"
    plain(x).square().sum().backward()
    with streamed_linears(streamed):
        streamed(x).square().sum().backward()
    for mine, theirs in zip(streamed.parameters(), plain.parameters()):
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_streamed_layer_streams_unless_gradients_are_wanted(monkeypatch):
    layer, x = nn.Linear(64, 48), torch.randn(4, 64)
    calls = []
    real = dflash_ext.ops.skinny_linear
    monkeypatch.setattr(dflash_ext.ops, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    with streamed_linears(layer):
        with torch.no_grad():
            layer(x)
        assert len(calls) == 1
        layer(x)  # its weights require grad: F.linear
        assert len(calls) == 1
        layer.requires_grad_(False)
        layer(x)  # nothing to differentiate: streamed again
        assert len(calls) == 2
