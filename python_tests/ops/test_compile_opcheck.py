"""torch.library.opcheck of every op (schema, fake kernel, autograd registration, AOT
dispatch) and each op inside torch.compile(fullgraph=True) against eager (CPU, fp32)."""
import pytest
import torch

import dflash_ext
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs, make_project_inputs

ops = torch.ops.dflash_ext


def project_args():
    return make_project_inputs(5, 32, 3, 24, seed=1)


def inject_inputs():
    return make_inject_inputs(6, 32, 2, 2, 16, S=9, P=12, seed=2, sentinel=-3.0)


def attention_args():
    return make_attention_inputs([5, 0, 9], 3, 4, 2, 16, window=6, seed=3, poison=False).args()


@pytest.mark.parametrize("name,make_args,kwargs", [
    ("project_features", lambda: project_args(), {}),
    ("inject_context_kv", lambda: inject_inputs().args(), {}),
    ("block_attention", attention_args, {}),
    ("block_attention", attention_args, {"causal": True}),
    ("block_attention", attention_args, {"max_context": 9, "validate": False, "causal": True}),
    ("block_attention", attention_args, {"symmetric": True}),
    ("block_attention", attention_args, {"max_context": 9, "validate": False, "symmetric": True}),
    ("skinny_linear", lambda: (torch.randn(4, 40), torch.randn(24, 40), torch.randn(24)), {}),
    ("skinny_linear", lambda: (torch.randn(12, 40), torch.randn(24, 40), None), {}),
])
def test_opcheck(name, make_args, kwargs):
    torch.library.opcheck(getattr(ops, name).default, make_args(), kwargs)


def test_compile_project_features():
    feats, w, nw, eps = project_args()
    fn = torch.compile(lambda f0, f1, f2, w, nw: dflash_ext.project_features([f0, f1, f2], w, nw, eps) * 2,
                       fullgraph=True)
    torch.testing.assert_close(fn(*feats, w, nw), dflash_ext.project_features(feats, w, nw, eps) * 2,
                               rtol=0, atol=0)


def test_compile_inject_context_kv():
    """The compiled function mutates the caller's caches in place, like eager."""
    compiled, eager = inject_inputs(), inject_inputs()

    @torch.compile(fullgraph=True)
    def fn(*args):
        dflash_ext.inject_context_kv(*args)
        return args[8].sum()  # read the cache after the write

    total = fn(*compiled.args())
    dflash_ext.inject_context_kv(*eager.args())
    torch.testing.assert_close(compiled.k_cache, eager.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(compiled.v_cache, eager.v_cache, rtol=0, atol=0)
    torch.testing.assert_close(total, eager.k_cache.sum())
    assert not torch.equal(eager.k_cache, inject_inputs().k_cache)  # something was written


@pytest.mark.parametrize("rule", [{}, {"causal": True}, {"symmetric": True}], ids=["bidir", "causal", "symmetric"])
def test_compile_block_attention(rule):
    args = attention_args()
    fn = torch.compile(lambda *a: dflash_ext.block_attention(*a, **rule) * 2, fullgraph=True)
    torch.testing.assert_close(fn(*args), dflash_ext.block_attention(*args, **rule) * 2, rtol=0, atol=0)
