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


@pytest.fixture(params=dflash_ext.ops.hardware.ISA_LEVELS)
def cpu_isa_level(request):
    """Each ISA level of the CPU kernels' dispatch in turn (forced, as DFLASH_CPU_ISA would);
    levels above this CPU's are skipped."""
    level = request.param
    detected = dflash_ext.ops.hardware.cpu_isa()["detected"]
    levels = dflash_ext.ops.hardware.ISA_LEVELS
    if levels.index(level) > levels.index(detected):
        pytest.skip(f"this CPU's highest ISA level is {detected}")
    with dflash_ext.ops.hardware.forced_cpu_isa(level):
        yield level
