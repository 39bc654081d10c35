"""Small CUDA cases of every op, one kernel path each, for `compute-sanitizer`:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m tools.gpu.cuda_sanitizer_cases
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 -m tools.gpu.cuda_sanitizer_cases --quick

(from the repository root, as tools/gpu/gpu_check.sh runs them).

Each case runs the op once and compares it with the fp32 reference (a loose check: the
tests hold the tolerances; this script is about memory errors). Exits non-zero on a
mismatch. Paths covered: the weight-streaming GEMV of project_features / inject_context_kv
at T <= 16 (bf16/fp16; one and two 8-token tiles; CTAs spanning several row blocks, a
partial last row block, skipped tokens), project_features' cuBLAS path (T > 16, fp32,
odd H), tensor-core kernels (bf16/fp16; D 64/128; split-K and split-KV with the combine
launch, empty splits; block_attention causal and with a symmetric window too) and the SIMT
kernels (fp32, odd shapes); and the index guards: bad slots, positions and cache ranges with
validate=False (skipped or clamped, so memcheck must see no access outside the tensors);
block_conv (taps past the block's start, T > B).
"""
import sys

import torch

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs, make_project_inputs

QUICK = "--quick" in sys.argv[1:]  # bf16 and the first two shapes of each op (racecheck is slow)
DTYPES = [torch.bfloat16] if QUICK else [torch.bfloat16, torch.float16, torch.float32]
failures = []


def shapes(cases):
    return cases[:2] if QUICK else cases


def compare(name, out, ref):
    err = (out.float() - ref.float()).abs().max().item()
    bound = 0.05 * ref.float().abs().max().item() + 1e-3
    status = "ok" if err <= bound else "MISMATCH"
    if status != "ok":
        failures.append(name)
    print(f"{name:60s} max|err| {err:.3g} (bound {bound:.3g}) {status}", flush=True)


def project_cases():
    for dtype in DTYPES:
        # GEMV (1 tile, 2 tiles), cuBLAS (T > 16, odd H), GEMV with 8 row blocks per CTA, GEMV with a
        # partial last row block (H_out % 32 != 0, H_out % 4 != 0)
        for T, H, k, H_out in shapes([(1, 576, 3, 576), (16, 1024, 5, 1024), (70, 128, 2, 200), (3, 100, 2, 40),
                                      (2, 64, 1, 4096), (9, 64, 2, 90)]):
            feats, w, nw, eps = make_project_inputs(T, H, k, H_out, dtype=dtype, device="cuda", seed=T)
            out = dflash_ext.project_features(feats, w, nw, eps)
            compare(f"project_features {dtype} T={T} H={H} k={k} H_out={H_out}", out,
                    reference.project_features(feats, w, nw, eps))


def inject_cases():
    for dtype in DTYPES:
        # GEMV (1 tile, 2 tiles), tensor cores, SIMT, tensor cores split 4 ways (T > 16)
        for T, H, N, Hkv, D in shapes([(1, 576, 3, 3, 64), (16, 1024, 2, 2, 128), (70, 256, 1, 2, 64), (5, 100, 2, 1, 96),
                                       (17, 1024, 2, 2, 128)]):
            inp = make_inject_inputs(T, H, N, Hkv, D, dtype=dtype, device="cuda", seed=T, sentinel=0.0)
            k_ref, v_ref = inp.k_cache.clone(), inp.v_cache.clone()
            dflash_ext.inject_context_kv(*inp.args())
            reference.inject_context_kv(*inp.args(k_ref, v_ref))
            compare(f"inject_context_kv {dtype} T={T} H={H} N={N} Hkv={Hkv} D={D}",
                    torch.cat([inp.k_cache, inp.v_cache]), torch.cat([k_ref, v_ref]))


def attention_cases():
    for dtype in DTYPES:
        for lens, Bq, Hq, Hkv, D, window, causal in shapes([
                ([100], 16, 4, 1, 64, 0, False), ([3000, 0, 40], 16, 8, 2, 128, 0, False),
                ([2000, 5], 16, 8, 2, 64, 6, True),  # causal split-KV: rows that see none of a split
                ([5000], 3, 6, 2, 64, 700, False), ([50, 9], 4, 4, 4, 96, 0, False), ([50, 9], 4, 4, 4, 96, 3, True)]):
            inp = make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=causal, dtype=dtype,
                                        device="cuda", seed=Bq, poison=False)
            out = dflash_ext.block_attention(*inp.args(), causal=causal)
            compare(f"block_attention {dtype} lens={lens} Bq={Bq} Hq={Hq} Hkv={Hkv} D={D} window={window} causal={causal}",
                    out, reference.block_attention(*inp.args(), causal=causal))
        # symmetric window (|p - k| < W): split-KV with splits most rows see none of, a window
        # under Bq, two row tiles (group 8), window 0 (the unmasked kernel), the SIMT path
        for lens, Bq, Hq, Hkv, D, window in shapes([
                ([3000, 40], 16, 8, 2, 128, 6), ([2000, 5, 0], 16, 32, 4, 64, 700),
                ([5000], 3, 6, 2, 64, 0), ([50, 9], 4, 4, 4, 96, 3)]):
            inp = make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, symmetric=True, dtype=dtype,
                                        device="cuda", seed=Bq + 1, poison=False)
            out = dflash_ext.block_attention(*inp.args(), symmetric=True)
            compare(f"block_attention {dtype} lens={lens} Bq={Bq} Hq={Hq} Hkv={Hkv} D={D} window={window} symmetric",
                    out, reference.block_attention(*inp.args(), symmetric=True))


def conv_cases():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in DTYPES:
        for M, B, H, T, G in shapes([(3, 16, 576, 2, 36), (5, 4, 2048, 2, 128), (2, 7, 17, 3, 17), (1, 3, 7, 5, 7)]):
            x, base, delta = (torch.randn(shape, generator=gen, device="cuda").to(dtype)
                              for shape in ((M, B, H), (T, H), (M, B, T, G)))
            compare(f"block_conv {dtype} M={M} B={B} H={H} T={T} G={G}", dflash_ext.block_conv(x, base, delta),
                    reference.block_conv(x, base, delta))


def unvalidated_bad_index_cases():
    for dtype in DTYPES:
        T, S, P = 16, 20, 24
        inp = make_inject_inputs(T, 1024, 2, 2, 128, S=S, P=P, dtype=dtype, device="cuda", seed=3, sentinel=0.0)
        slots = torch.arange(T)
        slots[0], slots[1], slots[2] = S, 1 << 40, -9
        positions = torch.arange(T)
        positions[3], positions[4] = P + 5, -(1 << 40)
        inp.slots, inp.positions = slots.cuda(), positions.cuda()
        good = torch.ones(T, dtype=torch.bool, device="cuda")
        good[:5] = False
        k_ref, v_ref = inp.k_cache.clone(), inp.v_cache.clone()
        dflash_ext.inject_context_kv(*inp.args(), validate=False)
        reference.inject_context_kv(inp.ctx[good], inp.k_weight, inp.v_weight, inp.k_norm_weight, inp.cos, inp.sin,
                                    inp.positions[good], inp.slots[good], k_ref, v_ref, inp.eps)
        compare(f"inject_context_kv {dtype} bad slots/positions, validate=False",
                torch.cat([inp.k_cache, inp.v_cache]), torch.cat([k_ref, v_ref]))
        att = make_attention_inputs([3000, 40], 16, 8, 2, 128, dtype=dtype, device="cuda", seed=5, poison=False)
        S = att.k_cache.shape[0]
        att.cache_offsets = torch.tensor([-(1 << 40), S - 10], device="cuda")
        att.cache_lens = torch.tensor([1 << 40, 500], device="cuda")
        out = dflash_ext.block_attention(*att.args(), max_context=1000, validate=False)
        att.cache_offsets, att.cache_lens = torch.tensor([0, S - 10], device="cuda"), torch.tensor([S, 10], device="cuda")
        att.window = 1000  # what the clamps amount to: offsets into the cache, at most max_context rows
        compare(f"block_attention {dtype} bad ranges, validate=False", out, reference.block_attention(*att.args()))
        att.cache_offsets = torch.tensor([-(1 << 40), S - 10], device="cuda")
        att.cache_lens = torch.tensor([1 << 40, 500], device="cuda")
        att.window = 300
        out = dflash_ext.block_attention(*att.args(), max_context=1000, validate=False, symmetric=True)
        att.cache_offsets, att.cache_lens = torch.tensor([0, S - 10], device="cuda"), torch.tensor([S, 10], device="cuda")
        compare(f"block_attention {dtype} bad ranges, validate=False, symmetric", out,
                reference.block_attention(*att.args(), symmetric=True))


if __name__ == "__main__":
    assert torch.cuda.is_available(), "this script needs a CUDA device"
    project_cases()
    inject_cases()
    attention_cases()
    conv_cases()
    unvalidated_bad_index_cases()
    torch.cuda.synchronize()
    print(f"{len(failures)} mismatches" + (f": {failures}" if failures else ""))
    sys.exit(1 if failures else 0)
