"""TargetRunner on the CPU: in a masked pass (a verify pass over a cache) grouped K/V heads go
to SDPA as they are, and the pass computes what transformers' own path (repeat_kv) computes."""
import pytest
import torch
from transformers.integrations import sdpa_attention

from dflash_ext.decode.runner import TargetRunner, cache_kwarg
from dflash_ext.testing.targets import FAMILIES, tiny_family_target
from python_tests.decode.test_target_families import PROMPTS


@pytest.mark.parametrize("family", FAMILIES)
def test_a_masked_pass_takes_grouped_kv_and_computes_the_same(family, monkeypatch):
    target = tiny_family_target(family)
    runner = TargetRunner(target)
    prompt, block = torch.tensor([PROMPTS[1]]), torch.tensor([[7, 8, 9, 10]])
    _, _, cache = runner(prompt, None, hidden_states=False)
    ref_cache = target(input_ids=prompt, use_cache=True).past_key_values
    repeats, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: repeats.append(n) or repeat_kv(h, n))

    logits, hidden, _ = runner(block, cache)  # 4 queries over the cache: a masked pass
    assert repeats == []  # no K/V head copied once per query head it serves
    ref = target(input_ids=block, use_cache=True, output_hidden_states=True, **{cache_kwarg(target): ref_cache})
    if family in ("llama", "qwen3"):  # grouped-query SDPA layers: transformers' own path copies
        assert repeats and all(n > 1 for n in repeats)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    for layer, h in enumerate(hidden):
        if h is not None:
            torch.testing.assert_close(h, ref.hidden_states[layer], rtol=1e-5, atol=1e-5)
