"""Fixtures of the dflash_ext test suite (the helpers they share live in helpers.py)."""
import pytest
import torch

import dflash_ext


@pytest.fixture
def blas_fallback():
    """Route the CPU kernels' fp32 GEMMs through at::mm for the test, then restore."""
    prev = dflash_ext._C._set_blas_fallback(True)
    assert dflash_ext._C._set_blas_fallback(True) is True, "the setter returns the previous setting"
    yield
    dflash_ext._C._set_blas_fallback(prev)


@pytest.fixture
def many_threads():
    """More intra-op threads than cores: makes the CPU block_attention split long contexts
    across work items (flash-decoding) even on a 2-core machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(16)
    yield 16
    torch.set_num_threads(prev)
