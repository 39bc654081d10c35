"""The four ops of an installed dflash_ext against its plain-PyTorch reference (fp32 and
bf16, at every CPU ISA level this machine has): run by tools/ci/wheel_check.sh with the
wheel's own Python, outside the repository. Prints one line per check; exits 1 on a mismatch."""
import sys

import torch

import dflash_ext
from dflash_ext import ops
from dflash_ext.ops import hardware, reference
from dflash_ext.testing import inputs


def close(got, want, dtype):
    want32 = want.float()
    scale = want32.abs().nan_to_num().max().item() or 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: about two roundings of the output
    return torch.allclose(got.float(), want32, rtol=tol, atol=tol * scale, equal_nan=True)


def checks(dtype):
    feats, fc, norm, eps = inputs.make_project_inputs(5, 64, 3, dtype=dtype, seed=1)
    yield "project_features", ops.project_features(feats, fc, norm, eps=eps), \
        reference.project_features(feats, fc, norm, eps)
    x, w, b = inputs.make_linear_inputs(4, 96, 64, bias=True, dtype=dtype, seed=2)
    yield "skinny_linear", ops.skinny_linear(x, w, b), reference.skinny_linear(x, w, b)
    inp = inputs.make_inject_inputs(6, 64, 2, 2, 16, dtype=dtype, seed=3)
    rk, rv = torch.zeros_like(inp.k_cache), torch.zeros_like(inp.v_cache)
    reference.inject_context_kv(*inp.args(rk, rv))
    ops.inject_context_kv(*inp.args())
    written = inp.slots[inp.slots >= 0]
    yield "inject_context_kv", torch.cat([inp.k_cache[:, written], inp.v_cache[:, written]]), \
        torch.cat([rk[:, written], rv[:, written]])
    att = inputs.make_attention_inputs([7, 40], 4, 4, 2, 16, dtype=dtype, seed=4)
    yield "block_attention", ops.block_attention(*att.args()), reference.block_attention(*att.args())


def main():
    detected = hardware.cpu_isa()["detected"]
    levels = hardware.ISA_LEVELS[:hardware.ISA_LEVELS.index(detected) + 1]
    failed = 0
    for level in levels:
        with hardware.forced_cpu_isa(level):
            for dtype in (torch.float32, torch.bfloat16):
                for name, got, want in checks(dtype):
                    ok = close(got, want, dtype)
                    failed += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {name} {str(dtype)[6:]} at ISA level {level}")
    print(f"dflash_ext {dflash_ext.__version__} from {dflash_ext.__file__}: {failed} mismatches")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
