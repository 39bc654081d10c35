"""Index-extreme cases of the ops, run in a child process by test_index_fuzz.py so that a
crash (a read or write out of bounds) fails the test instead of ending the run.

Every case either matches the reference (valid indices) or raises a RuntimeError that
names the offending argument, and leaves every cache byte outside the written rows as
it was. The child prints one line per case before running it, so a crash names its case.
"""
import itertools
import json
import sys

import torch

import dflash_ext
from dflash_ext.ops import reference

I64_MAX, I64_MIN = 2 ** 63 - 1, -2 ** 63


def extremes(*sizes):
    """0, 1, each size and its neighbours, 2^31 and 2^62 with neighbours, int64 limits,
    and the negatives of all of them."""
    base = {0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 62 + 1, I64_MAX, I64_MAX - 3}
    for s in sizes:
        base |= {s - 1, s, s + 1}
    vals = base | {-v for v in base if v > 0} | {I64_MIN, I64_MIN + 1}
    return sorted(v for v in vals if I64_MIN <= v <= I64_MAX)


# Small shapes: attention Bsz=1, Bq=2, Hq=4, Hkv=2, D=8, S=10 cache rows.
S_ATT, D_, HKV = 10, 8, 2
# Injection T=3, H=16, N=2 layers, S=6 cache rows, P=7 RoPE rows.
T_INJ, H_INJ, N_INJ, S_INJ, P_INJ = 3, 16, 2, 6, 7


def attention_case(offset, length, window, causal=False, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, D_, generator=g).to(device)
    kb, vb = (torch.randn(1, 2, HKV, D_, generator=g).to(device) for _ in range(2))
    kc, vc = (torch.randn(S_ATT, HKV, D_, generator=g).to(device) for _ in range(2))
    before = (kc.clone(), vc.clone())
    offsets = torch.tensor([offset], device=device)
    lens = torch.tensor([length], device=device)
    valid = 0 <= offset <= S_ATT and 0 <= length <= S_ATT - offset and window >= 0
    try:
        out = dflash_ext.block_attention(q, kb, vb, kc, vc, offsets, lens, 0.3, window, causal=causal)
    except RuntimeError as e:
        msg = str(e)
        named = ("window" in msg) if window < 0 else ("cache_offsets" in msg or "cache_lens" in msg)
        ok = not valid and named
        result = "error" if ok else f"unexpected error: {msg.splitlines()[0][:200]}"
    else:
        if not valid:
            result = "invalid input accepted"
        else:
            ref = reference.block_attention(q, kb, vb, kc, vc, offsets, lens, 0.3, window, causal)
            result = "match" if torch.allclose(out, ref, rtol=1e-4, atol=1e-5) else "mismatch"
    if not (torch.equal(kc, before[0]) and torch.equal(vc, before[1])):
        result += " + cache changed"
    return result


def inject_case(positions, slots, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(T_INJ, H_INJ, generator=g)
    kw = torch.randn(N_INJ, HKV * D_, H_INJ, generator=g) * 0.2
    vw = torch.randn(N_INJ, HKV * D_, H_INJ, generator=g) * 0.2
    kn = torch.rand(N_INJ, D_, generator=g) + 0.5
    ang = torch.randn(P_INJ, D_, generator=g)
    cos, sin = ang.cos(), ang.sin()
    kc, vc = (torch.randn(N_INJ, S_INJ, HKV, D_, generator=g) for _ in range(2))
    args = [t.to(device) for t in (ctx, kw, vw, kn, cos, sin)]
    pos_t, slot_t = torch.tensor(positions, device=device), torch.tensor(slots, device=device)
    kc, vc = kc.to(device), vc.to(device)
    before = (kc.clone(), vc.clone())
    written = [s for s in slots if s >= 0]
    bad_slot = any(not -1 <= s < S_INJ for s in slots) or len(written) != len(set(written))
    bad_pos = any(s >= 0 and not 0 <= p < P_INJ for p, s in zip(positions, slots))
    try:
        dflash_ext.inject_context_kv(*args, pos_t, slot_t, kc, vc, 1e-6)
    except RuntimeError as e:
        msg = str(e)
        ok = (bad_slot and "slots" in msg) or (bad_pos and "positions" in msg)  # names an offending argument
        result = "error" if ok else f"unexpected error: {msg.splitlines()[0][:200]}"
        if not (torch.equal(kc, before[0]) and torch.equal(vc, before[1])):
            result += " + cache changed"
        return result
    if bad_slot or bad_pos:
        return "invalid input accepted"
    rk, rv = before[0].clone(), before[1].clone()
    reference.inject_context_kv(*args, pos_t, slot_t, rk, rv, 1e-6)
    untouched = [r for r in range(S_INJ) if r not in written]
    if not (torch.equal(kc[:, untouched], before[0][:, untouched])
            and torch.equal(vc[:, untouched], before[1][:, untouched])):
        return "rows outside the written ones changed"
    return "match" if torch.allclose(kc, rk, rtol=1e-4, atol=1e-5) and torch.allclose(vc, rv, rtol=1e-4, atol=1e-5) \
        else "mismatch"


def attention_cases():
    offs = extremes(S_ATT)
    for o, l in itertools.product(offs, offs):
        yield ("attention", o, l, 0)
    for w in extremes(S_ATT):
        for o, l in ((0, S_ATT), (3, 4), (I64_MAX, 5), (5, I64_MAX)):
            for causal in (False, True):
                yield ("attention", o, l, w, causal)


def inject_cases():
    slot_vals = extremes(S_INJ)
    pos_vals = extremes(P_INJ)
    for s in slot_vals:  # one extreme slot among valid ones
        yield ("inject", [0, 1, 2], [0, s, 3])
    for p in pos_vals:  # an extreme position, once written and once skipped
        yield ("inject", [0, p, 2], [0, 4, 3])
        yield ("inject", [0, p, 2], [0, -1, 3])
    yield ("inject", [0, 1, 2], [2, -1, 2])  # a repeated row


def run(case, device):
    kind, *args = case
    return attention_case(*args, device=device) if kind == "attention" else inject_case(*args, device=device)


def run_hypothesis(n, device):
    """Random int64 draws (a hypothesis strategy over the whole int64 range, mixed with the
    extremes and small values), derandomized so that CI sees the same draws every run."""
    from hypothesis import given, settings, strategies as st

    i64 = st.one_of(st.integers(I64_MIN, I64_MAX), st.sampled_from(extremes(S_ATT, S_INJ, P_INJ)),
                    st.integers(-2, 12))
    att = st.tuples(st.just("attention"), i64, i64, st.one_of(st.just(0), i64), st.booleans())
    inj = st.tuples(st.just("inject"), st.lists(i64, min_size=3, max_size=3),
                    st.lists(st.one_of(i64, st.integers(-1, S_INJ - 1)), min_size=3, max_size=3))

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(st.one_of(att, inj))
    def check(case):
        print("CASE " + json.dumps(case), flush=True)
        result = run(case, device)
        assert result in ("match", "error"), (case, result)

    check()


def main():
    which, device = sys.argv[1], sys.argv[2]
    if which == "hypothesis":
        run_hypothesis(int(sys.argv[3]), device)
        print("BAD []\nDONE hypothesis", flush=True)
        return
    cases = list(attention_cases()) if which == "attention" else list(inject_cases())
    bad = []
    for case in cases:
        print("CASE " + json.dumps(case), flush=True)
        result = run(case, device)
        if result not in ("match", "error"):
            bad.append((case, result))
    print("BAD " + json.dumps(bad), flush=True)
    print(f"DONE {len(cases)}", flush=True)


if __name__ == "__main__":
    main()
