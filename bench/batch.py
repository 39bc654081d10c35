"""DFlash over a batch of prompts against the target alone batched the same way: total
tokens per second at each batch size, every row checked against its single-prompt output,
and the speedup, in the shape of the paper's concurrency table.

    python -m bench.batch --out OUT                    # SmolLM2 + the shipped drafter, HumanEval prompts
    python -m bench.batch --tiny --out OUT             # a tiny random target (the smoke test)

The same prompts (--prompts of them, default 16) are decoded at each batch size b (default
1 2 4 8 16) in consecutive batches of b: the work is the same at every b, only how it is
batched changes. Per b: DFlash (``spec_generate`` over a list of prompts: decode/batch.py),
the target alone through ``target_generate`` over the same batches (the same left padding
and prefill), plain and (on the CPU) with its linear layers streamed through ``skinny_linear`` (as
DFlash's verify), and transformers' ``generate`` with left padding (greedy, same stop
tokens); the fastest of the three is the baseline of the speedup. Every row of every run is compared
with the target's single-prompt greedy output (``rows_equal``: in float32 all of them must
be; transformers' padded generate is reported, not required, as its padding changes the
rounding). Each run is preceded by an untimed one over the first batch. A plot of the
throughputs and the speedup against b goes next to the JSON (matplotlib). Take the figures
on a quiet machine.
"""
import argparse
import os
import time

import torch

from bench import _common

BATCHES = (1, 2, 4, 8, 16)


def hf_generate(target, prompts, max_new_tokens: int, stop_token_ids=()) -> list:
    """transformers' greedy generate over `prompts` (lists of ints) left-padded into one batch:
    each row's new tokens, cut after its first stop token."""
    width = max(map(len, prompts))
    device = next(target.parameters()).device
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stops = list(stop_token_ids)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=stops or None,
                          min_new_tokens=None if stops else max_new_tokens)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def _run(name, run, chunks, singles) -> dict:
    """One way of decoding every chunk: the totals and the rows equal to their single outputs."""
    run(chunks[0])  # untimed: first-call costs
    start = time.perf_counter()
    outputs = [run(chunk) for chunk in chunks]
    wall = time.perf_counter() - start
    rows = [r for out in outputs for r in out]
    tokens = [r if isinstance(r, list) else r.tokens for r in rows]
    steps = sum(max(len(r.acceptance_lengths) for r in out) for out in outputs) if name != "hf" else None
    total = sum(map(len, tokens))
    res = dict(tokens=total, wall_s=wall, tokens_per_second=total / wall, rows=len(rows),
               rows_equal=sum(t == s for t, s in zip(tokens, singles)))
    if steps is not None:  # the batch's verify passes (the rows' longest), prefills apart
        res.update(steps=steps, ms_per_step=1e3 * wall / max(1, steps))
    if name == "dflash":
        lengths = [a for r in rows for a in r.acceptance_lengths]
        res["tau"] = sum(lengths) / max(1, len(lengths))
    return res


def sweep(target, drafter, prompts, batches=BATCHES, max_new_tokens: int = 64, block_size=None,
          stop_token_ids=(), hf: bool = True, log=print) -> dict:
    """The table: for each batch size, DFlash, target_generate (plain and streamed) and (`hf`)
    transformers' generate over `prompts` (lists of ints) in consecutive batches of that size."""
    from dflash_ext import spec_generate, target_generate

    stops = list(stop_token_ids)
    singles = [target_generate(target, p, max_new_tokens, stop_token_ids=stops).tokens for p in prompts]
    runs = {"dflash": lambda c: spec_generate(target, drafter, c, max_new_tokens, block_size=block_size,
                                              stop_token_ids=stops),
            "alone": lambda c: target_generate(target, c, max_new_tokens, stop_token_ids=stops)}
    if next(target.parameters()).device.type == "cpu":  # skinny_linear streams on the CPU only
        # the target alone with its linear layers streamed, as DFlash's verify: the fastest at few rows
        runs["streamed"] = lambda c: target_generate(target, c, max_new_tokens, stop_token_ids=stops,
                                                     stream_linears=True)
    if hf:
        runs["hf"] = lambda c: hf_generate(target, c, max_new_tokens, stops)
    table = []
    for b in batches:
        chunks = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        row = dict(batch=b)
        for name, run in runs.items():
            row[name] = _run(name, run, chunks, singles)
            log(f"batch {b}: {name} {row[name]}")
        base = max((k for k in ("alone", "streamed", "hf") if k in row), key=lambda k: row[k]["tokens_per_second"])
        row["baseline"] = base
        row["speedup"] = row["dflash"]["tokens_per_second"] / row[base]["tokens_per_second"]
        table.append(row)
    return dict(prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], max_new_tokens=max_new_tokens,
                rows=table)


def check(result, exact: bool) -> list:
    """The rows that differ from their single-prompt output (DFlash and target_generate, plain and streamed;
    `exact`: float32, where none may)."""
    bad = [f"batch {r['batch']}: {k} {r[k]['rows'] - r[k]['rows_equal']} of {r[k]['rows']} rows differ"
           for r in result["rows"] for k in ("dflash", "alone", "streamed")
           if k in r and r[k]["rows_equal"] != r[k]["rows"]]
    return bad if exact else []


def report(result) -> str:
    flat = [dict(batch=r["batch"], dflash=r["dflash"]["tokens_per_second"], alone=r["alone"]["tokens_per_second"],
                 streamed=r.get("streamed", {}).get("tokens_per_second"), hf=r.get("hf", {}).get("tokens_per_second"),
                 baseline=r["baseline"], speedup=r["speedup"],
                 tau=r["dflash"]["tau"], ok=f"{r['dflash']['rows_equal']}/{r['dflash']['rows']}")
            for r in result["rows"]]
    cols = [("batch", "batch", "{}"), ("dflash", "DFlash tok/s", "{:.1f}"),
            ("alone", "target_generate tok/s", "{:.1f}"),
            ("streamed", "streamed target tok/s", "{:.1f}"), ("hf", "HF generate tok/s", "{:.1f}"),
            ("baseline", "baseline", "{}"), ("speedup", "speedup", "{:.2f}x"),
            ("tau", "τ", "{:.2f}"), ("ok", "rows = single", "{}")]
    return _common.format_table(flat, cols, f"# {result['prompts']} prompts, {result['max_new_tokens']} new tokens "
                                            "each, in consecutive batches of each size (total tokens/s)")


def plot(result, path) -> bool:
    plt = _common.pyplot()
    if plt is None:
        return False
    b = [r["batch"] for r in result["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(b, [r["dflash"]["tokens_per_second"] for r in result["rows"]], "o-", label="DFlash")
    left.plot(b, [r[r["baseline"]]["tokens_per_second"] for r in result["rows"]], "s--", label="target alone (fastest)")
    left.set(xscale="log", xlabel="batch", ylabel="total tokens/s", title="throughput")
    right.plot(b, [r["speedup"] for r in result["rows"]], "o-")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="batch", ylabel="speedup", title="DFlash / target alone")
    for ax in (left, right):
        ax.set_xticks(b, [str(x) for x in b])
    left.legend()
    return _common.save_figure(fig, path)


def _models(args):
    """(target, drafter, prompts as token lists, stop tokens)."""
    g = torch.Generator().manual_seed(args.seed)
    if args.tiny:
        from dflash_ext import DFlashDrafter
        from dflash_ext.testing.targets import tiny_family_target

        target = tiny_family_target("qwen3")
        drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
        lengths = torch.randint(1, 60, (args.prompts,), generator=g).tolist()
        return target, drafter, [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths], []
    from dflash_ext import DFlashDrafter
    from dflash_ext.model.pretrained import default_drafter_path, load_target
    from dflash_ext.prompts import load_prompts

    dtype = _common.DTYPES[args.dtype]
    target, tok = load_target(None, dtype=dtype)
    drafter = DFlashDrafter.from_pretrained(args.drafter or default_drafter_path(), dtype=dtype)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for p in load_prompts("humaneval", args.prompts)]
    return target, drafter, prompts, [tok.eos_token_id] if tok.eos_token_id is not None else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random qwen3 target and a fresh drafter (smoke test)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--dtype", default="float32", choices=sorted(_common.DTYPES))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", default=None, help="verify block (default: the drafter's; 'auto' per batch)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(_common.OUT_DIR, "batch"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    block = args.block_size if args.block_size in (None, "auto") else int(args.block_size)
    target, drafter, prompts, stops = _models(args)
    meta = _common.metadata(torch.device("cpu"), dtype=args.dtype if not args.tiny else "float32", tiny=args.tiny,
                            block_size=block or drafter.config.block_size, batches=args.batches)
    result = sweep(target, drafter, prompts, args.batches, args.max_new_tokens, block, stops, hf=not args.no_hf,
                   log=_common.logger())
    result["metadata"] = meta
    os.makedirs(args.out, exist_ok=True)
    _common.write_json(os.path.join(args.out, "batch.json"), result)
    text = _common.header(meta) + "\n\n" + report(result)
    with open(os.path.join(args.out, "batch.txt"), "w") as f:
        f.write(text + "\n")
    plot(result, os.path.join(args.out, "batch.png"))
    print(text)
    bad = check(result, exact=args.tiny or args.dtype == "float32")
    return _common.fail("; ".join(bad)) if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
