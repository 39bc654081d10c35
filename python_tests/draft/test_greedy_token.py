"""greedy_token (dflash_ext/sampling.py): the argmax the greedy loop and the drafter take,
widened to float32 on the CPU for bf16/fp16 logits (faster there); the index must be exactly
torch's own argmax of the same logits, ties (first maximum), infinities and NaN included."""
import pytest
import torch

from dflash_ext.sampling import greedy_token, sample_token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7,), (3, 49152), (2, 4, 1000)])
def test_greedy_token_is_torch_argmax(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    logits = (torch.randn(shape, generator=gen) * 4).round().to(dtype)  # coarse values: many ties for the maximum
    flat = logits.view(-1, shape[-1])
    flat[0, shape[-1] // 2] = float("inf")
    if flat.shape[0] > 1:
        flat[1, -1] = float("nan")
        flat[-1, :3] = float("-inf")
    expected = logits.argmax(-1)
    assert torch.equal(greedy_token(logits), expected)
    assert torch.equal(sample_token(logits, temperature=0.0), expected)
    assert greedy_token(logits).dtype == torch.long and greedy_token(logits).shape == shape[:-1]


def test_greedy_token_takes_the_first_of_tied_maxima():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    assert greedy_token(logits).tolist() == [1, 0]
