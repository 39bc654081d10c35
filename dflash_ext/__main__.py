"""Command line: ``python -m dflash_ext generate --prompt "..."``.

Runs DFlash speculative decoding on a target (default: the embedded SmolLM2-135M-Instruct)
with a drafter checkpoint (default: a freshly initialised drafter, which accepts almost
nothing until a trained one is given), streaming the text as it is accepted, then prints
the statistics. ``--baseline`` also runs the target alone for comparison.
"""
import argparse
import json
import os
import sys
import time

import torch


class _Streamer:
    """Prints the decoded text of a growing token list as it grows."""

    def __init__(self, tokenizer, enabled=True):
        self.tok, self.tokens, self.printed, self.enabled = tokenizer, [], "", enabled

    def __call__(self, new_tokens):
        self.tokens.extend(new_tokens)
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        if self.enabled and text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
        self.printed = text


def _print_stats(name, res):
    s = res.summary()
    print(f"\n--- {name}: {s['new_tokens']} tokens in {s['total_s']:.2f} s = {s['tokens_per_second']:.1f} tok/s, "
          f"time to first token {1e3 * s['time_to_first_token_s']:.0f} ms", file=sys.stderr)
    if s["block_size"] > 1:
        steps = max(1, s["steps"])
        print(f"    tau = {s['tau']:.2f} over {s['steps']} steps (block size {s['block_size']}); "
              f"acceptance histogram (steps that accepted 0..B-1 drafts): {s['histogram']}", file=sys.stderr)
        print(f"    per step: draft {1e3 * s['draft_s'] / steps:.1f} ms, verify {1e3 * s['verify_s'] / steps:.1f} ms, "
              f"other {1e3 * s['other_s'] / steps:.1f} ms", file=sys.stderr)


# The drafter trained for the embedded default target (see README, "Training").
DEFAULT_DRAFTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters",
                               "smollm2-135m")


def resolve_dtype(name: str, device) -> torch.dtype:
    """--dtype: auto = the fastest the device has (bf16 on CUDA and on CPUs with bf16 units)."""
    from .hardware import fastest_dtype

    return fastest_dtype(device) if name == "auto" else getattr(torch, name)


def parse_block_size(text):
    return text if text == "auto" else int(text)


def cmd_generate(args):
    from .decoding import choose_block_size, spec_generate, target_generate
    from .drafter import DFlashDrafter
    from .hardware import cpu_description
    from .models import load_target

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.device)
    where = cpu_description() if torch.device(args.device).type == "cpu" else args.device
    print(f"[dflash_ext] dtype {str(dtype).replace('torch.', '')} ({'auto: ' if args.dtype == 'auto' else ''}"
          f"{where})", file=sys.stderr)
    model, tok = load_target(args.target, dtype=dtype, device=args.device)
    if args.drafter is None and args.target is None and not args.fresh_drafter \
            and os.path.exists(os.path.join(DEFAULT_DRAFTER, "config.json")):
        args.drafter = DEFAULT_DRAFTER
    if args.drafter:
        drafter = DFlashDrafter.from_pretrained(args.drafter, device=args.device, dtype=dtype)
        drafter.check_fits(model.config)
        note = f"drafter: {args.drafter}"
    else:
        fresh_block = args.block_size if isinstance(args.block_size, int) else 16
        drafter = DFlashDrafter.from_target(model.config, num_layers=args.draft_layers,
                                            block_size=fresh_block).to(args.device, dtype)
        note = ("drafter: freshly initialised (untrained; it accepts almost nothing, tau ~ 1: "
                "pass --drafter DIR for a trained one)")
    print(f"[dflash_ext] target: {args.target or 'SmolLM2-135M-Instruct (embedded default)'}; {note}",
          file=sys.stderr)
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if args.block_size == "auto":
        choice = choose_block_size(model, drafter, len(ids))
        args.block_size = choice.block_size
        speeds = ", ".join(f"B={b}: {v:.0f} tok/s" for b, v in choice.tokens_per_second.items())
        print(f"[dflash_ext] block size auto -> {choice.block_size} (profile: {choice.profile_source}"
              + (f"; expected {speeds}" if speeds else "") + ")", file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops)
    if args.baseline:  # untimed warm-up of both loops, so that neither timed run pays first-call costs
        spec_generate(model, drafter, ids, 8, block_size=args.block_size, **common)
        target_generate(model, ids, 8, **common)
    res = spec_generate(model, drafter, ids, args.max_new_tokens, block_size=args.block_size, generator=gen,
                        on_tokens=_Streamer(tok), **common)
    _print_stats("DFlash", res)
    report = {"dflash": res.summary()}
    if args.baseline:
        gen = torch.Generator().manual_seed(args.seed)
        base = target_generate(model, ids, args.max_new_tokens, generator=gen,
                               on_tokens=_Streamer(tok, enabled=False), **common)
        _print_stats("target alone", base)
        report["baseline"] = base.summary()
        report["speedup"] = base.total_time / res.total_time if res.total_time else None
        if args.temperature == 0:
            report["identical_to_baseline"] = base.tokens == res.tokens
        print(f"    speedup {report['speedup']:.2f}x" + (f", identical output: {report['identical_to_baseline']}"
              if args.temperature == 0 else ""), file=sys.stderr)
        if torch.device(args.device).type == "cpu":  # what the target alone gains from DFlash's GEMM
            gen = torch.Generator().manual_seed(args.seed)
            target_generate(model, ids, 8, stream_linears=True, **common)
            streamed = target_generate(model, ids, args.max_new_tokens, generator=gen, stream_linears=True,
                                       on_tokens=_Streamer(tok, enabled=False), **common)
            _print_stats("target alone, linear layers through skinny_linear as in DFlash's verify", streamed)
            report["streamed_target"] = streamed.summary()
            report["speedup_vs_streamed_target"] = streamed.total_time / res.total_time if res.total_time else None
            print(f"    DFlash over this: {report['speedup_vs_streamed_target']:.2f}x (the drafter's share; "
                  "the rest of the speedup above is the GEMM)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_gen_data(args):
    from .config import default_target_layer_ids, target_text_config
    from .hardware import cpu_description
    from .models import load_target
    from .prompts import TRAINING_SOURCES, training_prompts
    from .training.data import compute_features, generate_responses, load_records

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")  # generation in the fastest dtype this CPU has
    model, tok = load_target(args.target, dtype=dtype)
    layer_ids = args.layer_ids or default_target_layer_ids(target_text_config(model.config).num_hidden_layers,
                                                           args.num_features)
    prompts = training_prompts(args.prompts)[args.offset:args.offset + args.n]
    id_base = TRAINING_SOURCES[args.prompts][1] + args.offset
    before = len(load_records(args.out)) if os.path.isdir(args.out) else 0
    start = time.perf_counter()
    n = generate_responses(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, id_base=id_base)
    seconds = time.perf_counter() - start
    records = load_records(args.out)
    if not args.no_features:
        compute_features(model, args.out, layer_ids)
    meta = {"target": args.target or "SmolLM2-135M-Instruct (embedded default)", "records": n,
            "dtype": str(dtype).replace("torch.", ""), "target_layer_ids": layer_ids,
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "batch_size": args.batch_size, "prompts": f"{args.prompts}: its prompts {args.offset} .. "
                                                     f"{args.offset + len(prompts) - 1} (record ids from {id_base})",
            "response_tokens": sum(len(r["input_ids"]) - r["response_start"] for r in records),
            "this_run": {"responses": n - before, "seconds": round(seconds, 1),
                         "responses_per_hour": round((n - before) * 3600 / seconds) if seconds else None,
                         "cpu": cpu_description()}}
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"[dflash_ext] {n} records in {args.out} ({n - before} new in {seconds:.0f} s)"
          + ("" if args.no_features else ", with features"), file=sys.stderr)


def cmd_train(args):
    import dataclasses

    import torch.distributed as dist

    from .models import load_target
    from .training.trainer import TrainConfig, train

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by torchrun
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    target, _ = load_target(args.target, device=args.device, tokenizer=False)
    train(cfg, target, device=args.device, log=lambda m: print(m, file=sys.stderr, flush=True))
    if world > 1:
        dist.destroy_process_group()


def cmd_eval(args):
    from .drafter import DFlashDrafter
    from .models import load_target
    from .training.trainer import TrainConfig, evaluate_drafter

    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, tokenizer=False)
    drafter = DFlashDrafter.from_pretrained(args.drafter)
    cfg = TrainConfig(data=args.data, out="", block_size=drafter.config.block_size, holdout=args.holdout,
                      eval_stride=args.eval_stride, extra_data=args.extra_data or [],
                      features="live" if args.extra_data else "auto")
    tau, accept = evaluate_drafter(drafter, target, cfg)
    print(json.dumps({"drafter": args.drafter, "data": args.data, "extra_data": args.extra_data,
                      "holdout": args.holdout, "eval_stride": args.eval_stride, "tau": tau, "accept": accept}))


def cmd_export(args):
    from .drafter import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(args.src)
    if args.draft_vocab == 0:
        drafter.set_draft_vocab(None)
    elif args.draft_vocab is not None:
        from .training.data import load_records, split_holdout
        from .training.trainer import most_frequent_tokens

        if args.data is None:
            raise SystemExit("export --draft-vocab K needs --data (the training data folder)")
        records, _ = split_holdout(load_records(args.data), args.holdout)
        ids, coverage = most_frequent_tokens(records, drafter.config.vocab_size, args.draft_vocab)
        drafter.set_draft_vocab(ids)
        print(f"[dflash_ext] draft vocabulary: {ids.numel()} tokens, {100 * coverage:.2f} % of the response "
              f"tokens of {len(records)} records", file=sys.stderr)
    drafter.save_pretrained(args.dst, dtype=getattr(torch, args.dtype))
    print(f"[dflash_ext] wrote {args.dst} ({args.dtype})", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_ext", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation with streaming output and statistics")
    g.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    g.add_argument("--target", default=None, help="Hugging Face causal LM folder (default: embedded SmolLM2)")
    g.add_argument("--drafter", default=None, help="DFlash drafter checkpoint folder (reference format); "
                   "default: drafters/smollm2-135m for the embedded target")
    g.add_argument("--fresh-drafter", action="store_true",
                   help="use a freshly initialised drafter even when the trained default exists")
    g.add_argument("--block-size", type=parse_block_size, default="auto",
                   help="verify block size, or auto (default): the best for this machine's measured verify "
                        "cost and the drafter's acceptance profile")
    g.add_argument("--draft-layers", type=int, default=5, help="layers of a freshly initialised drafter")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--baseline", action="store_true", help="also run the target alone and compare")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target and drafter dtype; auto = bfloat16 where the CPU has bf16 units (or CUDA), else float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, help="write the statistics to this JSON file")
    d = sub.add_parser("gen-data", help="answer training prompts with the target (its own responses) + cache its features")
    d.add_argument("--out", required=True)
    d.add_argument("--target", default=None)
    d.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "sharegpt-later-turns", "stdlib-code"],
                   help="training prompt source (never an evaluation set; dflash_ext/prompts.py says what each is)")
    d.add_argument("--n", type=int, default=512, help="prompts to answer: the source's first N after --offset")
    d.add_argument("--offset", type=int, default=0, help="skip the source's first OFFSET prompts (e.g. a held-out "
                                                          "slice past the ones trained on)")
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--max-prompt-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--num-features", type=int, default=5, help="k target layers (default rule)")
    d.add_argument("--layer-ids", type=int, nargs="*", default=None)
    d.add_argument("--no-features", action="store_true",
                   help="responses only (train with --features live: no 5.6 KiB/token feature cache)")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype for generation; auto = bfloat16 where the CPU has bf16 units")
    d.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train", help="train a DFlash drafter on a gen-data folder (torchrun for data parallel)")
    t.add_argument("--data", required=True, help="gen-data folder; its highest ids are the held-out records")
    t.add_argument("--extra-data", nargs="*", default=None,
                   help="more gen-data folders (other prompt sources), training only: never held out")
    t.add_argument("--out", required=True, help="checkpoint folder (reference format); resumes if it has a trainer state")
    t.add_argument("--target", default=None)
    t.add_argument("--num-layers", type=int, default=None,
                   help="drafter layers (default 5; with --init DIR its own count, or more: new layers are appended)")
    t.add_argument("--block-size", type=int, default=None)
    t.add_argument("--anchors", type=int, default=None, help="anchors per sequence per epoch (paper 512)")
    t.add_argument("--gamma", type=float, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--epochs", type=int, default=None)
    t.add_argument("--batch-size", type=int, default=None, help="global sequences per optimizer step")
    t.add_argument("--max-len", type=int, default=None)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--save-every", type=int, default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--autocast", default=None, choices=["auto", "bf16", "none"])
    t.add_argument("--features", default=None, choices=["auto", "cached", "live"],
                   help="target features from the folder's cache or a target forward per sequence")
    t.add_argument("--layer-ids", type=int, nargs="*", default=None, help="target layers (default: meta.json or the default rule)")
    t.add_argument("--holdout", type=int, default=None, help="records (highest ids) kept out to measure held-out tau")
    t.add_argument("--eval-every", type=int, default=None, help="steps between held-out tau measurements")
    t.add_argument("--init", default=None,
                   help="random (default), target (layers from the target's last layers), or a drafter "
                        "folder to continue from (its weights, a fresh optimizer)")
    t.add_argument("--loss-vocab", type=int, default=None,
                   help="softmax of the loss over the K most frequent response tokens, recorded as the "
                        "checkpoint's draft vocabulary (0 = all)")
    t.add_argument("--eval-stride", type=int, default=None, help="held-out anchors every N response positions")
    t.add_argument("--log-every", type=int, default=None)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=2)
    v = sub.add_parser("eval", help="held-out tau of a drafter on the records a training run holds out")
    v.add_argument("--data", required=True)
    v.add_argument("--drafter", required=True)
    v.add_argument("--target", default=None)
    v.add_argument("--holdout", type=int, default=64,
                   help="the highest-id records of --data, less those whose prompt a training record has")
    v.add_argument("--extra-data", nargs="*", default=None,
                   help="the run's --extra-data folders: held-out records with one of their prompts are left out")
    v.add_argument("--eval-stride", type=int, default=8)
    v.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("export", help="copy a drafter checkpoint (e.g. a training folder) in another dtype")
    e.add_argument("--src", required=True)
    e.add_argument("--dst", required=True)
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="give the drafter a draft vocabulary: the K most frequent response tokens of --data "
                        "(0: remove it); default: keep the source's")
    e.add_argument("--data", default=None, help="training data folder of --draft-vocab (gen-data output)")
    e.add_argument("--holdout", type=int, default=64, help="highest-id records of --data left out of the count")
    args = p.parse_args(argv)
    if args.command in ("gen-data", "train", "eval"):  # jobs that own their process and its allocator
        from . import hardware

        hardware.keep_freed_memory()
    if args.command == "generate":
        if args.drafter is not None:
            if not os.path.isdir(args.drafter):
                p.error(f"--drafter {args.drafter}: no such directory")
        cmd_generate(args)
    elif args.command == "gen-data":
        cmd_gen_data(args)
    elif args.command == "train":
        cmd_train(args)
    elif args.command == "eval":
        cmd_eval(args)
    elif args.command == "export":
        cmd_export(args)


if __name__ == "__main__":
    main()
