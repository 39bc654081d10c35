"""End-to-end DFlash speculative decoding vs the target alone, on prompt sets.

How to run (from the repository root, with the extension already built)::

    .venv/bin/python -m bench.e2e --quick                       # smoke test: 2 prompts per set, 32 tokens
    .venv/bin/python -m bench.e2e --drafter runs/smollm2-dflash  # a trained drafter checkpoint
    .venv/bin/python -m bench.e2e --sets humaneval --n 20 --max-new-tokens 256 --block-size 8
    .venv/bin/python -m bench.e2e --prompts "Write a haiku." "Explain RoPE." --sets
    .venv/bin/python -m bench.e2e --prompt-file my_prompts.jsonl --sets

For every prompt the target alone (``target_generate``, one token per forward pass) and
DFlash (``spec_generate``) run side by side, same dtype, threads and sampling settings
(greedy by default; the order of the two alternates between prompts); ``--drafter-dtype``
puts the drafter alone in another dtype (bf16 beside an fp32 target: the draft is a
proposal the target's verify checks, so the output stays the target's). Greedy outputs
must be identical in float32 (DFlash is lossless): every mismatch is counted, reported
loudly and makes the exit status 1. In bfloat16/float16 a B-token verify pass rounds
differently from one-token decoding, so outputs may part where two tokens are near-tied:
the share of identical outputs and the first new-token position where they part are
reported (a measurement, not a failure).

Sampling: ``--temperature`` (default 0, greedy), ``--top-k``, ``--top-p``; at T > 0 the
verify rule ``--verify`` (rejection, the default, or match: dflash_ext/decode/verify.py).
Several temperatures and rules (``--temperature 0.7 1.0 --verify rejection match``) run one
configuration each on the same prompts (at T = 0 the rule has no effect: one run), each
written to the --json / --png paths with a ``_T<t>_<rule>`` suffix, and a last table (and the
--json file itself) gives per configuration tau, accepted drafts per step, tokens/s and the
speedup over the fastest target alone run (the streamed one too with --streamed-target).

Prompt sets (``--sets``, default humaneval mtbench sharegpt; loaded with
``dflash_ext.prompts.load_prompts``): HumanEval, MT-Bench (first turns) and held-out
ShareGPT (records from ``--sharegpt-offset``, default the module's held-out evaluation
offset ``SHAREGPT_EVAL_OFFSET``, past the training records).
Custom prompts: ``--prompts TEXT...`` (set "custom") and/or ``--prompt-file FILE`` (set
named after the file): a .json list of strings, a .jsonl file of strings or of objects with
a "prompt" (or "text") field, or plain text with one prompt per line. Pass ``--sets`` with
no names to run only the custom prompts. Each prompt is formatted with the tokenizer's chat
template (the user text is cut to ``--max-prompt-tokens`` tokens first).

Target: ``--target DIR`` (a Hugging Face causal LM folder), default the embedded
SmolLM2-135M-Instruct; any family spec_generate runs (sliding-window and linear-attention
hybrids included: the cache rollback is chosen per cache, dflash_ext.decode.rollback.CacheRollback). Drafter: ``--drafter DIR`` (a DFlash checkpoint in the reference
format), default a freshly initialised drafter (``DFlashDrafter.from_target``) which is
UNTRAINED: it accepts almost nothing (tau ~ 1) and DFlash is then slower than the target
alone; the output says so.

Reported per set and overall: tokens/s of both, speedup (DFlash tokens/s over target
tokens/s, i.e. the ratio of total times for equal outputs), tau (tokens emitted per verify
step), acceptance histogram (steps that emitted 1..B tokens), the per-step time split of
DFlash (draft / verify / other, from GenerationResult.summary()), time to first token and
greedy mismatches. Stdout: a table; JSON (``--json``, default bench/out/e2e.json, with
every prompt's statistics); PNG (``--png``, default bench/out/e2e.png: speedup, tau, time
split per set and the acceptance histograms; needs matplotlib). A progress bar (tqdm) goes
to stderr (``--no-progress`` turns it off).
"""
import argparse
import json
import os
import sys
import time

import torch

from bench import _common
from bench._common import DTYPES, OUT_DIR, format_table

DEFAULT_SETS = ["humaneval", "mtbench", "sharegpt"]


# --------------------------------------------------------------------------- prompts

def read_prompt_file(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
        return [d if isinstance(d, str) else (d.get("prompt") or d.get("text")) for d in data]
    if path.endswith(".jsonl"):
        out = []
        for line in text.splitlines():
            if line.strip():
                d = json.loads(line)
                out.append(d if isinstance(d, str) else (d.get("prompt") or d.get("text")))
        return out
    return [line for line in text.splitlines() if line.strip()]


def gather_prompts(args):
    """[(set name, [prompt text])] in run order."""
    out = []
    if args.sets:
        try:
            from dflash_ext.prompts import load_prompts  # written alongside; imported only when needed
        except ImportError as e:
            sys.exit(f"e2e: cannot load the prompt sets {args.sets} ({e}); pass --prompts/--prompt-file "
                     f"and --sets with no names")
        for name in args.sets:
            if name == "sharegpt" and args.sharegpt_offset is not None:
                prompts = load_prompts(name, args.n, offset=args.sharegpt_offset)
            else:  # sharegpt: the module's held-out evaluation offset
                prompts = load_prompts(name, args.n)
            if not prompts:
                sys.exit(f"e2e: prompt set {name} gave no prompts")
            out.append((name, list(prompts)))
    if args.prompts:
        out.append(("custom", list(args.prompts)))
    if args.prompt_file:
        name = os.path.splitext(os.path.basename(args.prompt_file))[0]
        prompts = [p for p in read_prompt_file(args.prompt_file) if p][:args.n if args.n_file_limit else None]
        if not prompts:
            sys.exit(f"e2e: no prompts in {args.prompt_file}")
        out.append((name, prompts))
    if not out:
        sys.exit("e2e: no prompts: give --sets, --prompts or --prompt-file")
    return out


def _sharegpt_default_offset():
    try:
        from dflash_ext import prompts
        return getattr(prompts, "SHAREGPT_EVAL_OFFSET", None)
    except ImportError:
        return None


def encode(tok, text, max_prompt_tokens):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        text = tok.decode(ids[:max_prompt_tokens])
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
    return list(tok(text)["input_ids"])


# --------------------------------------------------------------------------- statistics

def aggregate(records, block_size):
    """Totals over prompt records (each with 'baseline' and 'dflash' summaries)."""
    if not records:
        return None
    b = [r["baseline"] for r in records]
    d = [r["dflash"] for r in records]
    b_tok, d_tok = sum(x["new_tokens"] for x in b), sum(x["new_tokens"] for x in d)
    b_s, d_s = sum(x["total_s"] for x in b), sum(x["total_s"] for x in d)
    steps = sum(x["steps"] for x in d)
    emitted = sum(x["tau"] * x["steps"] for x in d)
    hist = [0] * block_size
    for x in d:
        for i, n in enumerate(x["histogram"]):
            hist[i] += n
    draft_s, verify_s, other_s = (sum(x[k] for x in d) for k in ("draft_s", "verify_s", "other_s"))
    b_tps, d_tps = (b_tok / b_s if b_s else 0.0), (d_tok / d_s if d_s else 0.0)
    per_prompt = [r["speedup"] for r in records if r["speedup"]]
    return dict(
        prompts=len(records), prompt_tokens_mean=sum(r["prompt_tokens"] for r in records) / len(records),
        baseline_tokens=b_tok, dflash_tokens=d_tok, baseline_s=b_s, dflash_s=d_s,
        baseline_tokens_per_s=b_tps, dflash_tokens_per_s=d_tps,
        speedup=(d_tps / b_tps if b_tps else None),
        speedup_mean_per_prompt=(sum(per_prompt) / len(per_prompt) if per_prompt else None),
        tau=(emitted / steps if steps else 0.0), steps=steps, histogram=hist,
        draft_s=draft_s, verify_s=verify_s, other_s=other_s,
        draft_ms_per_step=1e3 * draft_s / max(1, steps), verify_ms_per_step=1e3 * verify_s / max(1, steps),
        other_ms_per_step=1e3 * other_s / max(1, steps),
        draft_frac=draft_s / d_s if d_s else 0.0, verify_frac=verify_s / d_s if d_s else 0.0,
        other_frac=other_s / d_s if d_s else 0.0,
        baseline_ttft_ms=1e3 * sum(x["time_to_first_token_s"] for x in b) / len(b),
        dflash_ttft_ms=1e3 * sum(x["time_to_first_token_s"] for x in d) / len(d),
        mismatches=sum(1 for r in records if r["identical"] is False),
        compared=sum(1 for r in records if r["identical"] is not None),
        **_streamed_target(records, d_tps),
    )


def _streamed_target(records, dflash_tps):
    """Tokens/s of the target alone with streamed linear layers (--streamed-target), and
    DFlash's speed over it; nothing when that was not run."""
    st = [r["streamed"] for r in records if r.get("streamed")]
    if len(st) != len(records):
        return {}
    tps = sum(x["new_tokens"] for x in st) / sum(x["total_s"] for x in st)
    return dict(streamed_target_tokens_per_s=tps, speedup_vs_streamed_target=dflash_tps / tps)


def table(sets, overall):
    rows = [dict(name=k, **v) for k, v in sets.items()]
    if len(rows) > 1:
        rows.append(dict(name="all", **overall))
    cols = [("name", "set", "{}"), ("prompts", "n", "{}"), ("prompt_tokens_mean", "prompt_tok", "{:.0f}"),
            ("dflash_tokens", "new_tok", "{}"), ("baseline_tokens_per_s", "target tok/s", "{:.1f}"),
            ("dflash_tokens_per_s", "dflash tok/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
            ("tau", "tau", "{:.2f}"), ("steps", "steps", "{}"),
            ("draft_ms_per_step", "draft ms/step", lambda r: f"{r['draft_ms_per_step']:.1f} ({100 * r['draft_frac']:.0f}%)"),
            ("verify_ms_per_step", "verify ms/step", lambda r: f"{r['verify_ms_per_step']:.1f} ({100 * r['verify_frac']:.0f}%)"),
            ("other_ms_per_step", "other ms/step", lambda r: f"{r['other_ms_per_step']:.1f} ({100 * r['other_frac']:.0f}%)"),
            ("mismatches", "mismatch", lambda r: f"{r['mismatches']}/{r['compared']}" if r["compared"] else "-")]
    if "streamed_target_tokens_per_s" in overall:
        cols[6:6] = [("streamed_target_tokens_per_s", "streamed target tok/s", "{:.1f}"),
                     ("speedup_vs_streamed_target", "vs streamed", "{:.2f}x")]
    return format_table(rows, cols)


def peer_table(records, prompt_sets):
    """Per set: tokens/s and tau of our loop and of transformers' loop, and their ratio."""
    rows = []
    for name in [n for n, _ in prompt_sets] + (["all"] if len(prompt_sets) > 1 else []):
        rs = [r for r in records if name == "all" or r["set"] == name]
        ours_tok, ours_s = sum(r["dflash"]["new_tokens"] for r in rs), sum(r["dflash"]["total_s"] for r in rs)
        hf_tok, hf_s = sum(r["hf"]["new_tokens"] for r in rs), sum(r["hf"]["total_s"] for r in rs)
        steps = lambda key: sum(r[key]["steps"] for r in rs)
        tau = lambda key: sum(r[key]["tau"] * r[key]["steps"] for r in rs) / max(1, steps(key))
        same = [r["hf_identical"] for r in rs if r["hf_identical"] is not None]
        rows.append(dict(name=name, ours_tps=ours_tok / ours_s, hf_tps=hf_tok / hf_s, ours_tau=tau("dflash"),
                         hf_tau=tau("hf"), ratio=(ours_tok / ours_s) / (hf_tok / hf_s),
                         hf_identical=f"{sum(same)}/{len(same)}" if same else "-"))
    cols = [("name", "set", "{}"), ("ours_tps", "ours tok/s", "{:.1f}"), ("hf_tps", "hf tok/s", "{:.1f}"),
            ("ratio", "ours / hf", "{:.2f}x"), ("ours_tau", "ours tau", "{:.2f}"), ("hf_tau", "hf tau", "{:.2f}"),
            ("hf_identical", "hf = target", "{}")]
    return dict(rows=rows, table=format_table(rows, cols))


def plot(sets, overall, block_size, title, path):
    plt = _common.pyplot()
    if plt is None or not sets:
        return False
    names = list(sets) + (["all"] if len(sets) > 1 else [])
    aggs = [sets[n] if n in sets else overall for n in names]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0, 0]
    sp = [a["speedup"] or 0.0 for a in aggs]
    bars = ax.bar(names, sp, color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in sp], fontsize=8)
    ax.set_title("speedup (DFlash tok/s / target tok/s)")
    ax = axes[0, 1]
    taus = [a["tau"] for a in aggs]
    bars = ax.bar(names, taus, color="tab:green")
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in taus], fontsize=8)
    ax.set_title(f"tau (tokens per verify step, block size {block_size})")
    ax = axes[1, 0]
    bottom = [0.0] * len(aggs)
    for key, color in (("draft", "tab:orange"), ("verify", "tab:purple"), ("other", "tab:gray")):
        vals = [a[f"{key}_ms_per_step"] for a in aggs]
        ax.bar(names, vals, bottom=bottom, label=key, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("DFlash time per step (ms)")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    width = 0.8 / len(aggs)
    xs = list(range(1, block_size + 1))
    for i, (n, a) in enumerate(zip(names, aggs)):
        total = max(1, sum(a["histogram"]))
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [h / total for h in a["histogram"]], width, label=n)
    ax.set_xticks(xs)
    ax.set_xlabel("tokens emitted per step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("acceptance histogram")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _common.save_figure(fig, path)


# --------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--target", default=None, help="Hugging Face causal LM folder (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter checkpoint folder (default: a fresh, untrained one)")
    ap.add_argument("--draft-layers", type=int, default=5, help="layers of a freshly initialised drafter (default 5)")
    ap.add_argument("--sets", nargs="*", default=None, help=f"prompt sets (default: {' '.join(DEFAULT_SETS)} "
                    "unless --prompts/--prompt-file are given; no names = none)")
    ap.add_argument("--prompts", nargs="+", default=None, help="literal prompts (set 'custom')")
    ap.add_argument("--prompt-file", default=None, help=".json list, .jsonl, or one prompt per line")
    ap.add_argument("--n", type=int, default=None, help="prompts per set (default 10; quick 2)")
    ap.add_argument("--sharegpt-offset", type=int, default=None,
                    help="first ShareGPT record used (default: dflash_ext.prompts.SHAREGPT_EVAL_OFFSET, "
                         "the records held out from training)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="cut longer user texts (default 1024)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--block-size", default="auto",
                    help="verify block size, or auto (default): chosen from this machine's measured verify cost "
                         "and the drafter's acceptance profile (dflash_ext.choose_block_size)")
    ap.add_argument("--loops", default="ours", help="DFlash loops to run beside the target alone: ours "
                    "(spec_generate), hf (transformers' generate(assistant_model=DFlashAssistant(drafter), "
                    "speculation_type='dflash')), or ours,hf: both with the same drafter on the same prompts")
    ap.add_argument("--streamed-target", action="store_true",
                    help="also run the target alone with every linear layer through dflash_ext.skinny_linear "
                         "(one-token rows too): what the target alone gains from the GEMM DFlash's verify uses")
    ap.add_argument("--library-gemm", action="store_true",
                    help="DFlash with F.linear everywhere (spec_generate(stream_linears=False)) instead of "
                         "skinny_linear for the verify pass and the drafter's block")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                    help="0 = greedy (default); several: one run per temperature (and --verify rule)")
    ap.add_argument("--verify", nargs="+", choices=["rejection", "match"], default=["rejection"],
                    help="the verify rule(s) at T > 0 (default rejection; several: one run each)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--path", choices=["fused", "reference"], default="fused",
                    help="drafter ops: fused dflash_ext ops (default) or the plain-PyTorch reference")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--dtype", choices=["auto"] + list(DTYPES), default="auto",
                    help="target and drafter dtype; auto (default) = bfloat16 where the CPU has bf16 units, else float32")
    ap.add_argument("--drafter-dtype", choices=["auto"] + list(DTYPES), default="auto",
                    help="the drafter's own dtype (its draft is only a proposal: the target's verify keeps the output "
                         "the target's); auto (default) = the target's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 prompts per set, 32 new tokens (< 2 min)")
    ap.add_argument("--json", default=os.path.join(OUT_DIR, "e2e.json"))
    ap.add_argument("--png", default=os.path.join(OUT_DIR, "e2e.png"), help="'' for no plot")
    args = ap.parse_args(argv)
    if args.sets is None:
        args.sets = [] if (args.prompts or args.prompt_file) else list(DEFAULT_SETS)
    bad = [s for s in args.sets if s not in DEFAULT_SETS]
    if bad:
        ap.error(f"unknown --sets {bad}; choose from {DEFAULT_SETS}")
    args.n_file_limit = args.n is not None
    args.n = args.n if args.n is not None else (2 if args.quick else 10)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    if args.n < 1 or args.max_new_tokens < 1:
        ap.error("--n and --max-new-tokens must be >= 1")
    if args.block_size != "auto":
        if not args.block_size.isdigit() or int(args.block_size) < 1:
            ap.error("--block-size must be auto or an integer >= 1")
        args.block_size = int(args.block_size)
    args.loops = [x for x in args.loops.split(",") if x]
    if not args.loops or any(x not in ("ours", "hf") for x in args.loops):
        ap.error("--loops takes ours, hf or ours,hf")
    if args.drafter is not None and not os.path.isdir(args.drafter):
        ap.error(f"--drafter {args.drafter}: no such directory")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    missing = _common.check_device(device)
    if missing and args.path == "fused":
        sys.exit(f"e2e: dflash_ext has no {device.type} kernel for {missing}; use --path reference")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from dflash_ext import choose_block_size, DFlashAssistant, DFlashDrafter, load_target, spec_generate, target_generate
    from dflash_ext.model.pretrained import DEFAULT_TARGET_NAME
    from dflash_ext.ops.hardware import fastest_dtype

    dtype = fastest_dtype(device) if args.dtype == "auto" else DTYPES[args.dtype]
    args.dtype = str(dtype).replace("torch.", "")
    drafter_dtype = dtype if args.drafter_dtype == "auto" else DTYPES[args.drafter_dtype]
    args.drafter_dtype = str(drafter_dtype).replace("torch.", "")
    dtypes_label = args.dtype + ("" if drafter_dtype == dtype else f" (drafter {args.drafter_dtype})")  # header, title

    busy = _common.warn_if_busy(device)
    prompt_sets = gather_prompts(args)
    model, tok = load_target(args.target, dtype=dtype, device=device)
    target_name = args.target or f"{DEFAULT_TARGET_NAME} (embedded default)"
    if args.drafter:
        drafter = DFlashDrafter.from_pretrained(args.drafter, device=device, dtype=drafter_dtype)
        drafter.check_fits(model.config)
        drafter_name, fresh = args.drafter, False
    else:
        fresh_block = args.block_size if isinstance(args.block_size, int) else 16
        drafter = DFlashDrafter.from_target(model.config, num_layers=args.draft_layers,
                                            block_size=fresh_block, seed=args.seed).to(device, drafter_dtype)
        drafter_name, fresh = "freshly initialised (UNTRAINED: tau ~ 1, DFlash slower than the target)", True
    drafter.eval()
    encoded = [(name, i, encode(tok, p, args.max_prompt_tokens)) for name, ps in prompt_sets
               for i, p in enumerate(ps)]
    block_choice = None
    if args.block_size == "auto" and "hf" in args.loops:
        B = drafter.config.block_size  # transformers' loop always verifies the drafter's whole block
    elif args.block_size == "auto":  # one choice for the run, at the mean prompt length
        block_choice = choose_block_size(model, drafter, sum(len(e[2]) for e in encoded) // len(encoded),
                                         stream_linears=not args.library_gemm)
        B = block_choice.block_size
    else:
        B = args.block_size
    stops = [] if args.ignore_eos or tok.eos_token_id is None else [tok.eos_token_id]
    fused = args.path == "fused"

    def run_config(temperature, rule, json_path, png_path):
        """One sampling configuration over every prompt: (exit status, its summary row)."""
        loop_args = dict(temperature=temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops)
        greedy = temperature <= 0
        exact = dtype == torch.float32  # where greedy outputs must be identical
        print(f"e2e: target {target_name}; drafter {drafter_name}; block size {B}"
              f"{' (auto)' if block_choice else ''}; {dtypes_label}, {device}, "
              f"{torch.get_num_threads()} threads; "
              f"{'greedy' if greedy else f'temperature {temperature}, verify {rule}'}; "
              f"{args.max_new_tokens} new tokens; sets "
              + ", ".join(f"{n} ({len(p)})" for n, p in prompt_sets), file=sys.stderr, flush=True)

        def run_pair(ids, k, max_new):
            """(baseline, dflash, hf, streamed target) GenerationResults (None where not run);
            the order of the baseline and DFlash alternates with k."""
            def base(stream_linears=False):
                g = torch.Generator().manual_seed(args.seed + k)
                return target_generate(model, ids, max_new, generator=g, stream_linears=stream_linears, **loop_args)

            def spec():
                g = torch.Generator().manual_seed(args.seed + k)
                return spec_generate(model, drafter, ids, max_new, block_size=B, generator=g, fused=fused,
                                     stream_linears=not args.library_gemm, verify=rule, **loop_args)
            if k % 2 == 0:
                b = base()
                s = spec() if "ours" in args.loops else None
            else:
                s = spec() if "ours" in args.loops else None
                b = base()
            h = hf(ids, k, max_new) if "hf" in args.loops else None
            st = base(stream_linears=True) if args.streamed_target else None
            return b, s, h, st

        assistant = DFlashAssistant(drafter, model, fused=fused) if "hf" in args.loops else None

        def hf(ids, k, max_new):
            """transformers' own DFlash loop with our drafter, as a GenerationResult (tau from the
            adapter's view of each round; the draft/verify split is not visible from outside)."""
            from dflash_ext import GenerationResult

            torch.manual_seed(args.seed + k)
            kw = dict(do_sample=not greedy, max_new_tokens=max_new, pad_token_id=tok.pad_token_id or 0)
            if not greedy:
                kw.update(temperature=temperature, top_k=args.top_k or None, top_p=args.top_p)
            if stops:
                kw["eos_token_id"] = stops
            else:
                kw.update(eos_token_id=None, min_new_tokens=max_new)
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([ids], device=device), assistant_model=assistant,
                                 speculation_type="dflash", **kw)
            tokens = out[0, len(ids):].tolist()
            res = GenerationResult(tokens=tokens, block_size=B, total_time=time.perf_counter() - t0)
            # The first token comes from the prefill; the adapter sees every verify step but the last.
            last = len(tokens) - 1 - sum(assistant.acceptance_lengths)
            res.acceptance_lengths = list(assistant.acceptance_lengths) + ([last] if last > 0 else [])
            return res

        if not args.no_warmup:
            run_pair(encoded[0][2], 0, min(8, args.max_new_tokens))

        try:
            from tqdm import tqdm
            bar = tqdm(total=len(encoded), desc="e2e", unit="prompt", file=sys.stderr, disable=args.no_progress,
                       dynamic_ncols=True)
        except ImportError:
            bar = None
        records = []
        for k, (name, i, ids) in enumerate(encoded):
            base, spec, hf_res, streamed = run_pair(ids, k, args.max_new_tokens)
            if spec is None:  # --loops hf: the HF loop stands in the DFlash columns
                spec, hf_res = hf_res, None
            identical = (base.tokens == spec.tokens) if greedy else None
            first_diff = None
            if identical is False:
                first_diff = next((j for j, (a, b) in enumerate(zip(base.tokens, spec.tokens)) if a != b),
                                  min(len(base.tokens), len(spec.tokens)))
            if identical is False and exact:
                msg = (f"GREEDY MISMATCH (a bug): set {name} prompt {i}: DFlash differs from the target alone at "
                       f"new token {first_diff} (target {base.tokens[first_diff:first_diff + 4]}, DFlash "
                       f"{spec.tokens[first_diff:first_diff + 4]})")
                (bar.write if bar else print)("!" * 78 + "\n" + msg + "\n" + "!" * 78, file=sys.stderr)
            bs, ss = base.summary(), spec.summary()
            records.append(dict(set=name, index=i, prompt_tokens=len(ids), baseline=bs, dflash=ss,
                                speedup=(ss["tokens_per_second"] / bs["tokens_per_second"]
                                         if bs["tokens_per_second"] else None),
                                identical=identical, first_mismatch=first_diff,
                                hf=hf_res.summary() if hf_res is not None else None,
                                hf_identical=(hf_res.tokens == base.tokens) if hf_res is not None and greedy else None,
                                streamed=streamed.summary() if streamed is not None else None))
            if bar:
                done = aggregate(records, B)
                bar.set_postfix_str(f"{name} tau {done['tau']:.2f} speedup {done['speedup'] or 0:.2f}x"
                                    + (f" MISMATCH {done['mismatches']}" if done["mismatches"] else ""))
                bar.update(1)
        if bar:
            bar.close()

        sets = {name: aggregate([r for r in records if r["set"] == name], B) for name, _ in prompt_sets}
        overall = aggregate(records, B)
        meta = _common.metadata(device)
        meta.update(target=target_name, drafter=drafter_name, drafter_fresh=fresh, block_size=B,
                    draft_layers=drafter.config.num_hidden_layers, dtype=args.dtype,
                    drafter_dtype=args.drafter_dtype, path=args.path,
                    temperature=temperature, verify=None if greedy else rule, top_k=args.top_k, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, n_per_set=args.n,
                    sharegpt_offset=(args.sharegpt_offset if args.sharegpt_offset is not None
                                     else _sharegpt_default_offset()), max_prompt_tokens=args.max_prompt_tokens,
                    seed=args.seed, quick=args.quick, load_average_at_start=busy, warmup=not args.no_warmup,
                    dflash_linears="F.linear (--library-gemm)" if args.library_gemm else "skinny_linear on few rows (1..16 in bf16 on bf16 units, else 1..8)",
                    elapsed_s=round(time.perf_counter() - t_start, 2))

        title = (f"DFlash vs target alone | target {target_name} | drafter {'UNTRAINED (fresh)' if fresh else drafter_name}"
                 f" | B={B} {dtypes_label} {device} {meta['threads']} threads | DFlash linears: {meta['dflash_linears']}"
                 f" | {args.max_new_tokens} new tokens, "
                 f"{'greedy' if greedy else f'T={temperature}, verify {rule}'}")
        print(f"# {title}")
        if fresh:
            print("# NOTE: the drafter is freshly initialised (untrained): it accepts almost nothing, so tau ~ 1 and "
                  "DFlash is slower than the target alone. Pass --drafter DIR for a trained checkpoint.")
        print(f"# speedup = DFlash tok/s / target tok/s over the whole set; tau = tokens emitted per verify step; "
              f"ms/step = DFlash time per verify step split into draft / verify / other (share of DFlash time); "
              f"{_common.header(meta)}")
        print()
        print(table(sets, overall))
        print()
        for name, a in list(sets.items()) + ([("all", overall)] if len(sets) > 1 else []):
            print(f"# acceptance histogram {name} (steps emitting 1..{B} tokens): {a['histogram']}")
        print(f"# time to first token: target {overall['baseline_ttft_ms']:.0f} ms, DFlash {overall['dflash_ttft_ms']:.0f} ms")
        if args.loops == ["ours", "hf"]:
            peer = peer_table(records, prompt_sets)
            print("\n# our loop (spec_generate) vs transformers' DFlash loop (generate + DFlashAssistant), same drafter:")
            print(peer["table"])
            overall["peer"] = peer["rows"]
        mismatches = overall["mismatches"]
        if greedy and not exact:
            parts = [r["first_mismatch"] for r in records if r["identical"] is False]
            print(f"# {args.dtype}: greedy outputs identical to the target alone: {overall['compared'] - mismatches}/"
                  f"{overall['compared']}" + (f"; where they part, the first differing new token is at "
                                              f"{sorted(parts)} (of {args.max_new_tokens})" if parts else ""))
            mismatches = 0  # low-precision rounding, not a bug (docs/decoding.md: what lossless means in low precision)
        elif greedy:
            if mismatches:
                print("!" * 78)
                print(f"BUG: {mismatches} of {overall['compared']} greedy outputs of DFlash differ from the target alone")
                print("!" * 78)
            else:
                print(f"# greedy outputs identical to the target alone: {overall['compared']}/{overall['compared']}")
        print(f"# total {meta['elapsed_s']:.1f} s")
        if json_path:
            _common.write_json(json_path, dict(metadata=meta, sets=sets, overall=overall, prompts=records))
        if png_path and plot(sets, overall, B, title, png_path):
            print(f"# plot written to {png_path}")
        summary = dict(temperature=temperature, verify="greedy" if greedy else rule, tau=overall["tau"],
                       accepted_drafts_per_step=overall["tau"] - 1, dflash_tokens_per_s=overall["dflash_tokens_per_s"],
                       target_tokens_per_s=overall["baseline_tokens_per_s"], speedup=overall["speedup"])
        if "streamed_target_tokens_per_s" in overall:  # the fastest target alone of the two run
            fastest = max(overall["baseline_tokens_per_s"], overall["streamed_target_tokens_per_s"])
            summary.update(target_tokens_per_s=fastest, speedup=overall["dflash_tokens_per_s"] / fastest)
        return (1 if mismatches else 0), summary

    configs = [(t, "match" if t <= 0 else rule) for t in args.temperature
               for rule in (args.verify[:1] if t <= 0 else args.verify)]  # at T = 0 the rule has no effect
    if len(configs) == 1:
        return run_config(*configs[0], args.json, args.png)[0]
    status, rows = 0, []
    for t, rule in configs:
        tag = f"_T{t:g}" + ("" if t <= 0 else f"_{rule}")
        out = lambda path: (os.path.splitext(path)[0] + tag + os.path.splitext(path)[1]) if path else path
        code, row = run_config(t, rule, out(args.json), out(args.png))
        status, rows = max(status, code), rows + [row]
    cols = [("temperature", "T", "{:g}"), ("verify", "verify", "{}"), ("tau", "tau", "{:.2f}"),
            ("accepted_drafts_per_step", "accepted drafts/step", "{:.2f}"),
            ("dflash_tokens_per_s", "dflash tok/s", "{:.1f}"), ("target_tokens_per_s", "target alone tok/s", "{:.1f}"),
            ("speedup", "speedup", "{:.2f}x")]
    print("\n# every configuration, the same prompts (target alone: the fastest of those run):")
    print(format_table(rows, cols))
    if args.json:
        _common.write_json(args.json, dict(metadata=_common.metadata(device), configs=rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
