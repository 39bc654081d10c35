"""Verify numerics: does a B-token verify pass give the logits of one-token decoding, and
what would a verify that does cost?

DFlash's verify runs the target over B tokens at once; one-token decoding (HF `generate`,
the target alone) runs it over one. The two use other GEMM and attention shapes, so in
low precision their logits can differ in the last bits and a near tie can go the other
way (docs/decoding.md, "what lossless means in low precision"). On real prompts (HumanEval and MT-Bench first turns,
greedy continuations of the target), this script measures

  1. how far the verify pass's logits are from one-token decoding's: bitwise equal rows,
     rows with the same argmax, the largest difference;
  2. the same for a *row-wise* verify, which calls the kernels one-token decoding calls:
     every linear layer on one row at a time (M = 1) and attention one query at a time
     over its own prefix (so no reduction order depends on B);
  3. the same for the *streamed* verify the DFlash loop runs on the CPU (every linear
     layer on few rows through ops.skinny_linear: dflash_ext.streamed_linears);
  4. the same for an *exact* verify: the streamed linear layers and attention one query at
     a time, against one-token decoding with its linear layers streamed too. skinny_linear
     takes each row's dot products in the same order for 1 to 4 rows (csrc/cpu/cpu_utils.h,
     skinny_gemm_nt), so where every linear layer of the target streams (its rule:
     dflash_ext.ops.linear.skinny_linear_streams) a verify over B <= 4 tokens should give
     that decoding's logits bit for bit at little cost;
  5. what each costs against one one-token forward, for B in --sizes (median times), and
     what one-token decoding itself costs with its linear layers streamed too (could the
     target alone gain as much?).

A row-wise verify is exact only as far as the kernels' results do not depend on the
memory layout of their inputs; (2) checks it, row by row.

Usage:
    .venv/bin/python -m bench.verify_numerics                     # bf16 and fp32, B = 2 3 4 8 16
    .venv/bin/python -m bench.verify_numerics --dtype bfloat16 --sizes 2 4 --n 1 --quick
"""
import contextlib
import os
import sys
import types

import torch

from bench import _common
from bench._common import DTYPES, OUT_DIR, format_table
from dflash_ext import streamed_linears
from dflash_ext.decode.rollback import crop_cache
from dflash_ext.decode.runner import TargetRunner

ROWWISE_ATTENTION = "rowwise_sdpa"  # no "flash" in the name: transformers would look for a flash-attention kernel


def _rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA one query at a time over its own causal prefix: the call one-token decoding
    makes (one query, no mask). Batch 1 without padding, as in the DFlash loop."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    rows = []
    for i in range(q_len):
        seen = kv_len - q_len + i + 1
        out, _ = sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :seen], value[:, :, :seen],
                                        None, **kwargs)
        rows.append(out)
    return torch.cat(rows, dim=1), None


def _rowwise_linear(self, x):
    rows = x.shape[-2] if x.dim() >= 2 else 1
    if rows == 1:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return torch.cat([torch.nn.functional.linear(x[..., i:i + 1, :], self.weight, self.bias)
                      for i in range(rows)], dim=-2)


@contextlib.contextmanager
def rowwise_attention(model):
    """Within the block, `model` computes attention one query at a time."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(ROWWISE_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def rowwise_linears(model):
    """Within the block, `model` computes every linear layer one row at a time."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = types.MethodType(_rowwise_linear, m)
    try:
        yield model
    finally:
        for m in linears:
            del m.forward  # back to the class's forward


KINDS = ("verify", "streamed", "rowwise", "exact")


@contextlib.contextmanager
def verify_kind(model, kind: str):
    """The context that makes `model`'s pass a verify of `kind` (KINDS)."""
    with contextlib.ExitStack() as stack:
        if kind in ("rowwise", "exact"):
            stack.enter_context(rowwise_attention(model))
        if kind == "rowwise":
            stack.enter_context(rowwise_linears(model))
        stack.enter_context(streamed_linears(model, enabled=kind in ("streamed", "exact")))
        yield model


def _forward(runner, ids, cache):
    """Logits [n, V] of one pass over ids [1, n], extending `cache` (the DFlash loop's call)."""
    return runner(ids, cache, hidden_states=False)[0][0]


@torch.no_grad()
def compare(model, prompt_ids, sizes):
    """Greedy-decode max(sizes) tokens one at a time from `prompt_ids` (and feed the same
    tokens one at a time again with the linear layers streamed), then run the first B of
    them as one verify pass of each kind (KINDS), for each B of `sizes`: per B and kind, how
    many of the B logit rows equal decoding's bitwise / in their argmax, and the largest
    difference; the exact kind against the streamed decoding, the others against the plain
    one. Also returns the cache (at the prompt), the greedy block and its context."""
    from transformers import DynamicCache

    runner = TargetRunner(model)
    cache = DynamicCache(config=model.config)
    logits = _forward(runner, torch.tensor([prompt_ids]), cache)
    context = cache.get_seq_length()
    tokens, decoded = [int(logits[-1].argmax())], []
    for _ in range(max(sizes)):
        row = _forward(runner, torch.tensor([[tokens[-1]]]), cache)[-1]
        decoded.append(row)
        tokens.append(int(row.argmax()))
    decoded = torch.stack(decoded).float()
    block = torch.tensor([tokens[:max(sizes)]])
    crop_cache(cache, context)
    with streamed_linears(model):
        decoded_streamed = torch.cat([_forward(runner, block[:, i:i + 1], cache) for i in range(block.shape[1])])
    decoded_streamed = decoded_streamed.float()
    result = {}
    for b in sizes:
        for kind in KINDS:
            crop_cache(cache, context)
            with verify_kind(model, kind):
                got = _forward(runner, block[:, :b], cache).float()
            want = (decoded_streamed if kind == "exact" else decoded)[:b]
            result[b, kind] = dict(rows=b, bitwise_rows=int((got == want).all(-1).sum()),
                                   argmax_rows=int((got.argmax(-1) == want.argmax(-1)).sum()),
                                   max_abs_diff=float((got - want).abs().max()))
    crop_cache(cache, context)
    return result, cache, block, context


def time_passes(model, cache, block, context, sizes, timing):
    """Median ms of one one-token forward (plain and streamed) and of each kind of verify
    over B tokens (the cache cropped back to the prompt after each call)."""
    runner = TargetRunner(model)  # once: the timed calls are the forward and the crop alone

    def run(ids):
        def fn():
            with torch.no_grad():
                _forward(runner, ids, cache)
            crop_cache(cache, context)
        return fn
    ms, info = _common.measure({"one": run(block[:, :1]), **{f"verify{b}": run(block[:, :b]) for b in sizes}},
                               **timing)
    for kind in KINDS[1:]:
        # one token only streamed: row-wise and exact passes over one token are the plain and
        # the streamed one-token forward again
        counts = [1, *sizes] if kind == "streamed" else sizes
        with verify_kind(model, kind):
            kind_ms, kind_info = _common.measure({f"{kind}{b}": run(block[:, :b]) for b in counts}, **timing)
        ms.update(kind_ms)
        info["noisy"] |= kind_info["noisy"]
    return ms, info


def main(argv=None) -> int:
    ap = _common.arg_parser(__doc__, "verify_numerics", budget=(0.5, 0.1), max_s=(3.0, 0.5),
                            quick_help="smoke test: one prompt, short timing")
    ap.add_argument("--target", default=None, help="Hugging Face causal LM folder (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bfloat16", "float32"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8, 16], help="verify block sizes B")
    ap.add_argument("--n", type=int, default=None, help="prompts per set (HumanEval, MT-Bench; default 4, quick 1)")
    ap.set_defaults(json=os.path.join(OUT_DIR, "verify_numerics.json"))
    args = ap.parse_args(argv)
    if args.device != "cpu":
        sys.exit("verify_numerics.py: --device cpu only (the row-wise verify is a CPU experiment)")
    if min(args.sizes) < 2:
        sys.exit("verify_numerics.py: --sizes must be >= 2 (B = 1 is one-token decoding)")
    device, _ = _common.start(args, op_names=(), prog="verify_numerics.py")
    from dflash_ext import load_target
    from dflash_ext.prompts import load_prompts

    n_prompts = args.n or (1 if args.quick else 4)
    texts = load_prompts("humaneval", n_prompts) + load_prompts("mtbench", n_prompts)
    rows = []
    for dtype_name in args.dtype:
        model, tok = load_target(args.target, dtype=DTYPES[dtype_name])
        model.set_attn_implementation("sdpa")
        agg = {}
        for text in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"]
            result, cache, block, context = compare(model, ids, args.sizes)
            for key, r in result.items():
                a = agg.setdefault(key, dict(rows=0, bitwise_rows=0, argmax_rows=0, max_abs_diff=0.0))
                for k in ("rows", "bitwise_rows", "argmax_rows"):
                    a[k] += r[k]
                a["max_abs_diff"] = max(a["max_abs_diff"], r["max_abs_diff"])
        # Timing on the last prompt's context (its cache and greedy block).
        ms, info = time_passes(model, cache, block, context, args.sizes, _common.timing(args))
        for b in args.sizes:
            rows.append(dict(dtype=dtype_name, block_size=b, context=context, one_ms=ms["one"],
                             one_streamed_x=ms["streamed1"] / ms["one"], noisy=info["noisy"],
                             **{f"{kind}_x": ms[f"{kind}{b}"] / ms["one"] for kind in KINDS},
                             **{f"{kind}_ms": ms[f"{kind}{b}"] for kind in KINDS},
                             **{f"{kind}_{k}": v for kind in KINDS for k, v in agg[b, kind].items()}))
        del model
    meta = _common.metadata(device, prompts=len(texts), sizes=args.sizes)
    print(f"# verify numerics vs one-token decoding | {_common.header(meta)}")
    print(f"# {len(texts)} prompts (HumanEval, MT-Bench), a verify over each one's first B greedy tokens; "
          f"agreement counted over all prompts' rows, times on the last prompt (context {rows[-1]['context']})")
    print(format_table(rows, [
        ("dtype", "dtype", "{}"), ("block_size", "B", "{}"),
        ("verify_bitwise_rows", "verify: bitwise rows", lambda r: f"{r['verify_bitwise_rows']}/{r['verify_rows']}"),
        ("verify_argmax_rows", "same argmax", lambda r: f"{r['verify_argmax_rows']}/{r['verify_rows']}"),
        ("verify_max_abs_diff", "max |diff|", "{:.2e}"),
        ("streamed_bitwise_rows", "streamed: bitwise rows",
         lambda r: f"{r['streamed_bitwise_rows']}/{r['streamed_rows']}"),
        ("streamed_argmax_rows", "same argmax", lambda r: f"{r['streamed_argmax_rows']}/{r['streamed_rows']}"),
        ("streamed_max_abs_diff", "max |diff|", "{:.2e}"),
        ("rowwise_bitwise_rows", "row-wise: bitwise rows",
         lambda r: f"{r['rowwise_bitwise_rows']}/{r['rowwise_rows']}"),
        ("rowwise_max_abs_diff", "max |diff|", "{:.2e}"),
        ("exact_bitwise_rows", "exact: bitwise rows vs streamed decoding",
         lambda r: f"{r['exact_bitwise_rows']}/{r['exact_rows']}"),
        ("exact_argmax_rows", "same argmax", lambda r: f"{r['exact_argmax_rows']}/{r['exact_rows']}"),
        ("one_ms", "1 token ms", "{:.1f}"),
        ("verify_x", "verify B / 1 token", "{:.2f}x"), ("streamed_x", "streamed B / 1 token", "{:.2f}x"),
        ("rowwise_x", "row-wise B / 1 token", "{:.2f}x"), ("exact_x", "exact B / 1 token", "{:.2f}x"),
        ("one_streamed_x", "1 token streamed / 1 token", "{:.2f}x"),
    ]))
    if any(r["noisy"] for r in rows):
        print("# some timings stayed noisy (IQR / median >= 10 %): is the machine busy?")
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
