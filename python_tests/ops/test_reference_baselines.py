"""The eager baselines of bench/baselines.py (what the benchmarks time the fused ops against)
compute the specified function: in fp32 they match the specification itself."""
import torch

from bench import baselines
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs, make_project_inputs

from python_tests.helpers import assert_close


def test_eager_project_features_and_bare_linear():
    feats, w, nw, eps = make_project_inputs(16, 64, 3, dtype=torch.float32, seed=11)
    assert_close(baselines.eager_project_features(feats, w, nw, eps), reference.project_features(feats, w, nw, eps))
    y = baselines.eager_bare_linear(torch.cat(feats, -1), w)
    assert_close(reference.rms_norm(y, nw, eps), reference.project_features(feats, w, nw, eps))


def test_eager_inject_context_kv():
    inp = make_inject_inputs(16, 64, 3, 4, 64, dtype=torch.float32, seed=12, skip_frac=0.0)
    ours_k, ours_v = inp.k_cache.clone(), inp.v_cache.clone()
    baselines.eager_inject_context_kv(*inp.args(ours_k, ours_v))
    reference.inject_context_kv(*inp.args())
    written = inp.slots
    assert_close(ours_k[:, written], inp.k_cache[:, written])
    assert_close(ours_v[:, written], inp.v_cache[:, written])


def test_eager_block_attention():
    n = 40
    inp = make_attention_inputs([n, n], 4, 9, 3, 64, dtype=torch.float32, seed=13, gap=0)
    assert inp.cache_offsets.tolist() == [0, n]  # back to back, one length: what the baseline reads
    out = baselines.eager_block_attention(inp.q, inp.k_block, inp.v_block, inp.k_cache, inp.v_cache, n, inp.scale)
    assert_close(out, reference.block_attention(*inp.args()))
