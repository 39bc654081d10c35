"""Extreme but accepted sampling values have a defined meaning (docs/decoding.md,
"Sampling limits"): any finite temperature > 0 samples the tempered distribution, and one so
small that float32 over- or underflows is its greedy limit (the maximum, ties shared), never
torch's "probability tensor contains inf/nan"; any top_p in (0, 1] keeps at least the most
likely token. A non-finite temperature is an error naming the parameter."""
import math

import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode.output import check_sampling
from dflash_ext.sampling import sample_token
from dflash_ext.testing.targets import tiny_target

TINY = [1e-8, 1e-30, 1e-40, 1e-300, 5e-324]  # 5e-324: the smallest float above 0


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_the_greedy_limit(temperature):
    g = torch.Generator().manual_seed(0)
    logits = 30 * torch.randn(16, 1000, generator=g)
    for _ in range(5):
        assert torch.equal(sample_token(logits, temperature, generator=g), logits.argmax(-1))


def test_a_tiny_temperature_shares_exact_ties():
    logits = torch.tensor([[2.0, 5.0, 5.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    assert {int(sample_token(logits, 1e-40, generator=g)) for _ in range(100)} == {1, 2}


@pytest.mark.parametrize("top_p", [1e-8, 1e-50, 5e-324])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 500, generator=g)
    for temperature in (1.0, 1e-40):
        assert torch.equal(sample_token(logits, temperature, top_p=top_p, generator=g), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e30, 1e300])
def test_a_huge_temperature_is_the_uniform_limit(temperature):
    g = torch.Generator().manual_seed(2)
    logits = 10 * torch.randn(1, 4, generator=g)
    seen = {int(sample_token(logits, temperature, generator=g)) for _ in range(200)}
    assert seen == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan])
def test_a_non_finite_temperature_is_an_error_naming_it(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        check_sampling(4, temperature, 0, 1.0)


def test_the_loop_at_a_tiny_temperature_and_top_p_equals_greedy():
    target = tiny_target("qwen3")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    prompt = [5, 17, 33, 2, 9]
    greedy = target_generate(target, prompt, 16).tokens
    g = torch.Generator().manual_seed(0)
    for kw in (dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-50), dict(temperature=5e-324, top_k=3)):
        assert spec_generate(target, drafter, prompt, 16, generator=g, **kw).tokens == greedy, kw
        assert target_generate(target, prompt, 16, generator=g, **kw).tokens == greedy, kw
