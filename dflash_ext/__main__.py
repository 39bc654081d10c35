"""Command line: ``python -m dflash_ext generate --prompt "..."``.

Runs DFlash speculative decoding on a target (default: the embedded SmolLM2-135M-Instruct)
with a drafter checkpoint (default for the embedded target: the drafter shipped in the
package; otherwise a freshly initialised one, which accepts almost nothing), streaming the
text as it is accepted, then prints the statistics. ``--baseline`` also runs the target
alone the fastest way measured on this machine and compares. ``python -m dflash_ext info``
says what was built and what runs here.
"""
import argparse
import copy
import json
import math
import os
import sys
import time

import torch


# ---------------------------------------------------------------- argument checks
# argparse `type=` callables: a bad value ends in "argument --FLAG: must be ..., got X" and
# exit status 2 before anything loads (no value outside its range is silently a default).

class UsageError(Exception):
    """A bad argument found by a command (one that needs the data or the model to see it):
    main() reports it as argparse does, with exit status 2."""


def _checked(cast, ok, what):
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse's own messages name the type
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
int_from_2 = _checked(int, lambda v: v >= 2, "an integer >= 2")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")
nonnegative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
probability = _checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]")  # NaN fails too
seed_int = _checked(int, lambda v: 0 <= v < 2 ** 63, "an integer in [0, 2**63)")  # torch.Generator's range


_block_size_int = _checked(int, lambda v: v >= 1, "auto or an integer >= 1")


def parse_block_size(text):
    return text if text == "auto" else _block_size_int(text)


def existing_dir(text):
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    return text


def output_dir(text):
    """A folder to write into: it may exist (what is in it is each command's affair), but as a folder."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def output_file(text):
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: is a directory" if os.path.isdir(text)
                                         else f"{text}: no such directory {folder}")
    return text


def target_name(text):
    """--target: a local model folder or a Hugging Face repo id; what can only be a path must exist."""
    from .models import looks_like_local_path

    if looks_like_local_path(text) and not os.path.isdir(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return text


def drafter_folder(text):
    """A drafter checkpoint folder (reference format: config.json and the weights)."""
    existing_dir(text)
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text} has no config.json: not a drafter checkpoint")
    return text


def drafter_init(text):
    return text if text in ("random", "target") else drafter_folder(text)


def torch_device(text):
    """cpu, cuda or cuda:N, N one of this machine's GPUs. Kept as text: the commands read it so."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def _data_records(flag, folder):
    """The records of a gen-data folder, or a usage error naming `flag` when it has none."""
    from .training.data import load_records

    records = load_records(folder)
    if not records:
        raise UsageError(f"argument {flag}: {folder} has no gen-data records (responses-*.jsonl)")
    return records


def _is_nonempty_dir(path) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def _target_layer_count(target) -> int:
    """The decoder layers of --target (None: the embedded default), from its config alone."""
    from transformers import AutoConfig

    from .config import target_text_config
    from .models import default_target_path

    return target_text_config(AutoConfig.from_pretrained(target or default_target_path())).num_hidden_layers


def _check_drafter_fits(drafter, target_config) -> None:
    try:
        drafter.check_fits(target_config)
    except ValueError as e:
        raise UsageError(f"argument --drafter: {e}") from None


def _check_layer_ids(layer_ids, num_layers):
    if layer_ids and max(layer_ids) >= num_layers:
        raise UsageError(f"argument --layer-ids: the target has {num_layers} layers (ids 0..{num_layers - 1}), "
                         f"got {layer_ids}")


def train_run_config(args):
    """The TrainConfig of `train`'s arguments (a resumed run: the saved one's, with the flags
    given checked against it), and what it means for the data, checked before the target loads."""
    import dataclasses

    from .training.data import FeatureStore
    from .training.trainer import TrainConfig, run_config, trainable

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:  # only the flags given (not None): a resumed run takes the saved run's value of the others
        cfg, _ = run_config({k: v for k, v in vars(args).items() if k in fields and v is not None})
    except ValueError as e:  # the message names the flag (--out, or the flag that differs from the saved run)
        raise UsageError(str(e)) from None
    records = _data_records("--data", cfg.data)
    if not any(trainable(r, cfg.max_len) for r in records):
        raise UsageError(f"argument --max-len: cut to {cfg.max_len} tokens, no record of {cfg.data} keeps two "
                         f"response tokens to train on")
    if cfg.holdout >= len(records) and not cfg.extra_data:  # the --extra-data records are training ones
        raise UsageError(f"argument --holdout: holding out {cfg.holdout} of the {len(records)} records of "
                         f"{cfg.data} leaves none to train on")
    for folder in cfg.extra_data:
        _data_records("--extra-data", folder)
    if cfg.eval_every and not cfg.holdout:  # the trainer would skip every measurement
        raise UsageError("argument --eval-every: measures tau on held-out records, and --holdout holds none out")
    if cfg.layer_ids:
        _check_layer_ids(cfg.layer_ids, _target_layer_count(args.target))
    if cfg.num_layers is not None and cfg.init not in ("random", "target"):
        with open(os.path.join(cfg.init, "config.json")) as f:
            init_layers = json.load(f)["num_hidden_layers"]
        if cfg.num_layers < init_layers:
            raise UsageError(f"argument --num-layers: --init {cfg.init} has {init_layers} layers; a continuation "
                             f"can add layers, not drop them, got {cfg.num_layers}")
    cached = cfg.features == "cached" or (cfg.features == "auto" and len(FeatureStore(cfg.data)))
    if cfg.extra_data and cached:
        raise UsageError("argument --extra-data: needs --features live (the feature cache of --data is per "
                         "folder and would be used)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.batch_size % world:
        raise UsageError(f"argument --batch-size: {cfg.batch_size} is not a multiple of the {world} processes")
    return cfg


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


def resolve_dtype(name: str, device) -> torch.dtype:
    """--dtype of gen-data (batched generation): auto = bf16 on CUDA and on CPUs with bf16 units."""
    from .hardware import fastest_dtype

    return fastest_dtype(device) if name == "auto" else getattr(torch, name)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _config_name(config) -> str:
    dtype, stream = config
    return f"{_name(dtype)} with {'skinny_linear' if stream else 'F.linear'}"


@torch.no_grad()
def time_target_alone(model, ids, stream: bool, reps: int = 7) -> float:
    """Seconds of one one-token pass of the target alone after the prompt `ids` (median of
    `reps`, after one untimed), its linear layers through skinny_linear (`stream`) or F.linear."""
    from .decoding import _median_seconds
    from .target import CacheRollback, TargetRunner, streamed_linears

    with streamed_linears(model, enabled=stream):
        runner = TargetRunner(model)
        x = torch.as_tensor([ids], device=runner.device)
        _, _, cache = runner(x, None, hidden_states=False, last_logits_only=True)
        rollback = CacheRollback(cache, 1)  # undoes each timed pass on every cache kind (windows, hybrids)

        def step():
            runner(x[:, -1:], cache, hidden_states=False, last_logits_only=True, rollback=rollback)
            rollback(1)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)

        step()
        return _median_seconds(step, reps)


def fastest_target_alone(model, ids, device) -> tuple:
    """({(dtype, stream): seconds per token}, {dtype: model}): the target alone timed in fp32
    and bf16, on the CPU with its linear layers through F.linear and through skinny_linear
    (which wins depends on the CPU: on an AMX Xeon one-token decoding ran faster in fp32).
    `model` is the fp32 one; the bf16 copy is made here."""
    models = {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}
    streams = (False, True) if torch.device(device).type == "cpu" else (False,)
    timings = {(dtype, stream): time_target_alone(m, ids, stream) for dtype, m in models.items() for stream in streams}
    return timings, models


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _same_output_line(dflash, reference, dtype, reference_name) -> tuple:
    """(identical, the line that says so and what it means in this dtype)."""
    same = dflash.tokens == reference.tokens
    where = f"after {_first_difference(dflash.tokens, reference.tokens)} identical tokens"
    if dtype == torch.float32:
        return same, ("output: identical to the target alone's greedy output (float32: exact, as it must be)" if same
                      else f"output: DIFFERS from the target alone's greedy output {where} in float32, where it must "
                           "not: please report it with the output of python -m dflash_ext info")
    why = (f"in {_name(dtype)} a B-token verify pass rounds differently from one-token decoding (and skinny_linear "
           "from F.linear), so where two tokens nearly tie the text can part from the target alone's "
           "(docs/decoding.md, \"what lossless means in low precision\"); --dtype float32 gives the exact comparison")
    head = ("output: identical to the target alone's" if same else f"output: parts from the target alone's {where}")
    return same, f"{head} ({reference_name}); {why}"


def cmd_generate(args):
    from .decoding import choose_block_size, spec_generate, target_generate
    from .drafter import DFlashDrafter
    from .hardware import cpu_description
    from .models import MissingPackage, default_drafter_path, load_target

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = cpu_description() if device.type == "cpu" else args.device
    measure = args.dtype == "auto" or args.baseline
    try:  # measuring compares dtypes: load in fp32 (the converted checkpoint's), copy to bf16 after
        model, tok = load_target(args.target, dtype=torch.float32 if measure else getattr(torch, args.dtype),
                                 device=args.device)
    except MissingPackage as e:
        raise SystemExit(f"python -m dflash_ext: {e}")
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    report = {}
    if measure:
        timings, models = fastest_target_alone(model, ids, args.device)
        fastest = min(timings, key=timings.get)
        print("[dflash_ext] the target alone, one token per pass after this prompt: "
              + ", ".join(f"{_config_name(c)} {1e3 * t:.1f} ms" for c, t in timings.items())
              + f" -> fastest here: {_config_name(fastest)}", file=sys.stderr)
        report["target_alone_ms_per_token"] = {_config_name(c): 1e3 * t for c, t in timings.items()}
        dtype = fastest[0] if args.dtype == "auto" else getattr(torch, args.dtype)
        if dtype not in models:  # e.g. float16 asked for: a copy (.to() would convert the fp32 one in place)
            models[dtype] = copy.deepcopy(model).to(dtype)
        model = models[dtype]
    else:
        dtype = getattr(torch, args.dtype)
    print(f"[dflash_ext] dtype {_name(dtype)} ({'auto: the fastest target alone measured above' if args.dtype == 'auto' else 'as asked'}; "
          f"{where})", file=sys.stderr)
    report["dtype"] = _name(dtype)
    default_drafter = default_drafter_path()
    if args.drafter is None and args.target is None and not args.fresh_drafter:
        if os.path.exists(os.path.join(default_drafter, "config.json")):
            args.drafter = default_drafter
        else:
            print(f"[dflash_ext] the shipped drafter is missing ({default_drafter}): a broken install?",
                  file=sys.stderr)
    if args.drafter:
        drafter = DFlashDrafter.from_pretrained(args.drafter, device=args.device, dtype=dtype)
        _check_drafter_fits(drafter, model.config)
        note = f"drafter: {args.drafter}"
    else:
        # a drafter's block is >= 2; at --block-size 1 it drafts nothing anyway
        fresh_block = args.block_size if isinstance(args.block_size, int) and args.block_size >= 2 else 16
        drafter = DFlashDrafter.from_target(model.config, num_layers=args.draft_layers,
                                            block_size=fresh_block).to(args.device, dtype)
        note = ("drafter: freshly initialised (untrained; it accepts almost nothing, tau ~ 1: "
                "pass --drafter DIR for a trained one)")
    print(f"[dflash_ext] target: {args.target or 'SmolLM2-135M-Instruct (embedded default)'}; {note}",
          file=sys.stderr)
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    best_drafting = None  # the best B > 1 where the rule chose B = 1
    if args.block_size == "auto":
        choice = choose_block_size(model, drafter, len(ids))
        args.block_size = choice.block_size
        speeds = ", ".join(f"B={b}: {v:.0f} tok/s" for b, v in choice.tokens_per_second.items())
        print(f"[dflash_ext] block size auto -> {choice.block_size} (profile: {choice.profile_source}"
              + (f"; expected {speeds}" if speeds else "") + ")", file=sys.stderr)
        drafting = {b: v for b, v in choice.tokens_per_second.items() if b > 1}
        if choice.block_size == 1 and drafting:
            best_drafting = max(drafting, key=drafting.get)
            print(f"[dflash_ext] drafting does not pay here: with this drafter in {_name(dtype)} on this machine "
                  "the target alone is expected to be fastest, so DFlash drafts nothing (block size 1 = the target "
                  f"alone). The drafter's own run at its best B > 1 (B = {best_drafting}) follows, with its tau.",
                  file=sys.stderr)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops)
    if args.baseline:  # untimed warm-up of the loop, so that the timed run pays no first-call costs
        spec_generate(model, drafter, ids, 8, block_size=args.block_size, **common)
    res = spec_generate(model, drafter, ids, args.max_new_tokens, block_size=args.block_size,
                        generator=torch.Generator().manual_seed(args.seed), on_tokens=_Streamer(tok), **common)
    _print_stats("DFlash" if args.block_size > 1 else "DFlash at block size 1: the target alone, nothing drafted", res)
    report["dflash"] = res.summary()
    drafted = None
    if best_drafting is not None:
        drafted = spec_generate(model, drafter, ids, args.max_new_tokens, block_size=best_drafting,
                                generator=torch.Generator().manual_seed(args.seed), **common)
        _print_stats(f"the drafter at block size {best_drafting} (its best B > 1; not chosen)", drafted)
        report["dflash_best_drafting"] = drafted.summary()
    if args.baseline:
        base_dtype, base_stream = fastest
        name = _config_name(fastest)
        target_generate(models[base_dtype], ids, 8, stream_linears=base_stream, **common)  # warm-up
        base = target_generate(models[base_dtype], ids, args.max_new_tokens, stream_linears=base_stream,
                               generator=torch.Generator().manual_seed(args.seed), **common)
        _print_stats(f"target alone, the fastest way measured here ({name})", base)
        report["baseline"] = dict(base.summary(), config=name)
        ratio = lambda r: base.total_time / r.total_time if r.total_time else float("nan")
        report["speedup"] = ratio(res)
        print(f"\n=== {_name(dtype)} on {where}, against the target alone run the fastest way measured here ({name}, "
              f"{base.tokens_per_second:.1f} tok/s):", file=sys.stderr)
        if args.block_size > 1:
            print(f"    DFlash (block size {args.block_size}, tau {res.tau:.2f}): {res.tokens_per_second:.1f} tok/s = "
                  f"{report['speedup']:.2f}x", file=sys.stderr)
        else:
            # No ratio: this run is a target alone too, and a gap between two is not DFlash's doing.
            print(f"    no DFlash speedup here: block size 1 (drafting does not pay), so DFlash ran the target alone "
                  f"({_config_name((dtype, device.type == 'cpu'))}): {res.tokens_per_second:.1f} tok/s"
                  + (" (faster than the baseline: the short timing at start ranked them otherwise; a busy machine?)"
                     if res.total_time < 0.9 * base.total_time else ""), file=sys.stderr)
        if drafted is not None:
            report["speedup_best_drafting"] = ratio(drafted)
            print(f"    the drafter at block size {best_drafting} (tau {drafted.tau:.2f}): "
                  f"{drafted.tokens_per_second:.1f} tok/s = {report['speedup_best_drafting']:.2f}x", file=sys.stderr)
        if args.temperature == 0:
            reference, ref_name = base, name
            if base_dtype != dtype:  # compare like with like: the target alone in DFlash's dtype
                reference = target_generate(model, ids, args.max_new_tokens, **common)
                ref_name = _config_name((dtype, False))
            same, line = _same_output_line(res, reference, dtype, ref_name)
            report["identical_to_baseline"] = same
            print(f"    {line}", file=sys.stderr)
        else:
            print("    sampling (temperature > 0): DFlash follows the target's own distribution; the texts are "
                  "compared only at --temperature 0", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_info(args):
    from .diagnostics import format_info, info

    report = info()
    print(json.dumps(report, indent=2) if args.json else format_info(report))


def cmd_gen_data(args):
    from .config import default_target_layer_ids
    from .hardware import cpu_description
    from .models import load_target
    from .prompts import TRAINING_SOURCES, training_prompts
    from .training.data import compute_features, generate_responses, load_records, write_meta

    torch.set_num_threads(args.threads)
    source = training_prompts(args.prompts)
    if args.offset >= len(source):
        raise UsageError(f"argument --offset: {args.prompts} has {len(source)} prompts, got offset {args.offset}")
    prompts = source[args.offset:args.offset + args.n]
    num_layers = _target_layer_count(args.target)  # the features would fail only after every response
    if not args.layer_ids and args.num_features > num_layers:
        raise UsageError(f"argument --num-features: the target has {num_layers} layers, got {args.num_features}")
    _check_layer_ids(args.layer_ids, num_layers)
    layer_ids = args.layer_ids or default_target_layer_ids(num_layers, args.num_features)
    dtype = resolve_dtype(args.dtype, "cpu")  # generation in the fastest dtype this CPU has
    model, tok = load_target(args.target, dtype=dtype)
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
    write_meta(args.out, meta)
    print(f"[dflash_ext] {n} records in {args.out} ({n - before} new in {seconds:.0f} s)"
          + ("" if args.no_features else ", with features"), file=sys.stderr)


def cmd_train(args):
    import torch.distributed as dist

    from .models import load_target
    from .training.trainer import train

    cfg = train_run_config(args)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by torchrun
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    target, _ = load_target(args.target, device=args.device, tokenizer=False)
    train(cfg, target, device=args.device, log=lambda m: print(m, file=sys.stderr, flush=True))
    if world > 1:
        dist.destroy_process_group()


def cmd_eval(args):
    from .drafter import DFlashDrafter
    from .models import load_target
    from .training.data import drop_trained_prompts, split_holdout
    from .training.trainer import TrainConfig, evaluate_drafter

    torch.set_num_threads(args.threads)
    _, heldout = split_holdout(_data_records("--data", args.data), args.holdout)
    for folder in args.extra_data or []:
        heldout = drop_trained_prompts(heldout, _data_records("--extra-data", folder))
    if not heldout:
        raise UsageError(f"argument --holdout: the {args.holdout} highest-id records of {args.data} all have a "
                         "training record's prompt: none is left to measure tau on (a larger --holdout holds out more)")
    target, _ = load_target(args.target, tokenizer=False)
    drafter = DFlashDrafter.from_pretrained(args.drafter)
    _check_drafter_fits(drafter, target.config)
    cfg = TrainConfig(data=args.data, out="", block_size=drafter.config.block_size, holdout=args.holdout,
                      eval_stride=args.eval_stride, extra_data=args.extra_data or [],
                      features="live" if args.extra_data else "auto")
    tau, accept = evaluate_drafter(drafter, target, cfg)
    print(json.dumps({"drafter": args.drafter, "data": args.data, "extra_data": args.extra_data,
                      "holdout": args.holdout, "eval_stride": args.eval_stride, "tau": tau, "accept": accept}))


def cmd_export(args):
    from .drafter import DFlashDrafter
    from .training.data import split_holdout
    from .training.trainer import most_frequent_tokens

    # Everything checked before anything is written.
    if _is_nonempty_dir(args.dst) and not args.overwrite:
        raise UsageError(f"argument --dst: {args.dst} exists and is not empty; --overwrite replaces its checkpoint")
    if args.data is not None and not args.draft_vocab:
        raise UsageError("argument --data: only --draft-vocab K > 0 reads it")
    if args.draft_vocab:
        if args.data is None:
            raise UsageError("argument --draft-vocab: K > 0 needs --data (the training data folder whose "
                             "response tokens are counted)")
        all_records = _data_records("--data", args.data)
        records, _ = split_holdout(all_records, args.holdout)
        if not records:  # counting nothing would pick token ids 0..K-1
            raise UsageError(f"argument --holdout: holding out {args.holdout} of the {len(all_records)} records "
                             f"of {args.data} leaves none to count tokens on")
    drafter = DFlashDrafter.from_pretrained(args.src)
    if args.draft_vocab == 0:
        drafter.set_draft_vocab(None)
    elif args.draft_vocab is not None:
        if args.draft_vocab > drafter.config.vocab_size:
            raise UsageError(f"argument --draft-vocab: {args.src} has a vocabulary of {drafter.config.vocab_size} "
                             f"tokens, got K = {args.draft_vocab}")
        ids, coverage = most_frequent_tokens(records, drafter.config.vocab_size, args.draft_vocab)
        drafter.set_draft_vocab(ids)
        print(f"[dflash_ext] draft vocabulary: {ids.numel()} tokens, {100 * coverage:.2f} % of the response "
              f"tokens of {len(records)} records", file=sys.stderr)
    drafter.save_pretrained(args.dst, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    print(f"[dflash_ext] wrote {args.dst} ({args.dtype})", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_ext", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation with streaming output and statistics")
    g.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    g.add_argument("--target", type=target_name, default=None, help="Hugging Face causal LM folder (default: embedded SmolLM2)")
    g.add_argument("--drafter", type=drafter_folder, default=None, help="DFlash drafter checkpoint folder (reference format); "
                   "default for the embedded target: the one shipped in the package (python -m dflash_ext info)")
    g.add_argument("--fresh-drafter", action="store_true",
                   help="use a freshly initialised drafter even when the trained default exists")
    g.add_argument("--block-size", type=parse_block_size, default="auto",
                   help="verify block size, or auto (default): the best for this machine's measured verify "
                        "cost and the drafter's acceptance profile")
    g.add_argument("--draft-layers", type=positive_int, default=5, help="layers of a freshly initialised drafter")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0)
    g.add_argument("--top-k", type=nonnegative_int, default=0, help="0: off")
    g.add_argument("--top-p", type=probability, default=1.0)
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--baseline", action="store_true",
                   help="also run the target alone the fastest way measured here (dtype and linear path) and compare")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target and drafter dtype; auto = the dtype in which the target alone runs fastest here "
                        "(timed at start, one token per pass)")
    g.add_argument("--device", type=torch_device, default="cpu")
    g.add_argument("--threads", type=positive_int, default=2)
    g.add_argument("--seed", type=seed_int, default=0)
    g.add_argument("--json", type=output_file, default=None, help="write the statistics to this JSON file")
    d = sub.add_parser("gen-data", help="answer training prompts with the target (its own responses) + cache its features")
    d.add_argument("--out", type=output_dir, required=True,
                   help="records folder; an existing one is resumed (its records are kept, their prompts skipped)")
    d.add_argument("--target", type=target_name, default=None)
    d.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "sharegpt-later-turns", "stdlib-code"],
                   help="training prompt source (never an evaluation set; dflash_ext/prompts.py says what each is)")
    d.add_argument("--n", type=positive_int, default=512, help="prompts to answer: the source's first N after --offset")
    d.add_argument("--offset", type=nonnegative_int, default=0, help="skip the source's first OFFSET prompts (e.g. a held-out "
                                                          "slice past the ones trained on)")
    d.add_argument("--max-new-tokens", type=positive_int, default=160)
    d.add_argument("--max-prompt-tokens", type=positive_int, default=256)
    d.add_argument("--batch-size", type=positive_int, default=64)
    d.add_argument("--num-features", type=positive_int, default=5, help="k target layers (default rule)")
    d.add_argument("--layer-ids", type=nonnegative_int, nargs="*", default=None)
    d.add_argument("--no-features", action="store_true",
                   help="responses only (train with --features live: no 5.6 KiB/token feature cache)")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype for generation; auto = bfloat16 where the CPU has bf16 units")
    d.add_argument("--threads", type=positive_int, default=2)
    t = sub.add_parser("train", help="train a DFlash drafter on a gen-data folder (torchrun for data parallel)")
    t.add_argument("--data", type=existing_dir, required=True, help="gen-data folder; its highest ids are the held-out records")
    t.add_argument("--extra-data", type=existing_dir, nargs="*", default=None,
                   help="more gen-data folders (other prompt sources), training only: never held out")
    t.add_argument("--out", type=output_dir, required=True,
                   help="checkpoint folder (reference format); resumes if it has a trainer state")
    t.add_argument("--overwrite", action="store_true",
                   help="train into a non-empty --out that has no trainer state (its files are replaced)")
    t.add_argument("--target", type=target_name, default=None)
    t.add_argument("--num-layers", type=positive_int, default=None,
                   help="drafter layers (default 5; with --init DIR its own count, or more: new layers are appended)")
    t.add_argument("--block-size", type=int_from_2, default=None)
    t.add_argument("--anchors", type=positive_int, default=None, help="anchors per sequence per epoch (paper 512)")
    t.add_argument("--gamma", type=positive_float, default=None)
    t.add_argument("--lr", type=positive_float, default=None)
    t.add_argument("--epochs", type=positive_int, default=None)
    t.add_argument("--batch-size", type=positive_int, default=None, help="global sequences per optimizer step")
    t.add_argument("--max-len", type=int_from_2, default=None)
    t.add_argument("--max-steps", type=positive_int, default=None)
    t.add_argument("--save-every", type=positive_int, default=None)
    t.add_argument("--seed", type=seed_int, default=None)
    t.add_argument("--autocast", default=None, choices=["auto", "bf16", "none"])
    t.add_argument("--features", default=None, choices=["auto", "cached", "live"],
                   help="target features from the folder's cache or a target forward per sequence")
    t.add_argument("--layer-ids", type=nonnegative_int, nargs="*", default=None, help="target layers (default: meta.json or the default rule)")
    t.add_argument("--holdout", type=nonnegative_int, default=None, help="records (highest ids) kept out to measure held-out tau")
    t.add_argument("--eval-every", type=nonnegative_int, default=None, help="steps between held-out tau measurements")
    t.add_argument("--init", type=drafter_init, default=None,
                   help="random (default), target (layers from the target's last layers), or a drafter "
                        "folder to continue from (its weights, a fresh optimizer)")
    t.add_argument("--loss-vocab", type=nonnegative_int, default=None,
                   help="softmax of the loss over the K most frequent response tokens, recorded as the "
                        "checkpoint's draft vocabulary (0 = all)")
    t.add_argument("--dflash2", action="store_const", const=True, default=None,
                   help="train DFlash2 (docs/dflash2.md): a DFlash (v1) --init starts as a DFlash2 drafter "
                        "that drafts exactly as it does (identity convolutions, no transition term)")
    t.add_argument("--selector-rank", type=positive_int, default=None, help="DFlash2 selector rank R (default 256)")
    t.add_argument("--selector-top-k", type=int_from_2, default=None, help="DFlash2 candidates per slot K (default 16)")
    t.add_argument("--selector-alpha", type=nonnegative_float, default=None,
                   help="weight of DFlash2's selector loss (default 1; 0 leaves the selector untrained)")
    t.add_argument("--eval-stride", type=positive_int, default=None, help="held-out anchors every N response positions")
    t.add_argument("--log-every", type=positive_int, default=None)
    t.add_argument("--device", type=torch_device, default="cpu")
    t.add_argument("--threads", type=positive_int, default=2)
    v = sub.add_parser("eval", help="held-out tau of a drafter on the records a training run holds out")
    v.add_argument("--data", type=existing_dir, required=True)
    v.add_argument("--drafter", type=drafter_folder, required=True)
    v.add_argument("--target", type=target_name, default=None)
    v.add_argument("--holdout", type=positive_int, default=64,
                   help="the highest-id records of --data, less those whose prompt a training record has")
    v.add_argument("--extra-data", type=existing_dir, nargs="*", default=None,
                   help="the run's --extra-data folders: held-out records with one of their prompts are left out")
    v.add_argument("--eval-stride", type=positive_int, default=8)
    v.add_argument("--threads", type=positive_int, default=2)
    e = sub.add_parser("export", help="copy a drafter checkpoint (e.g. a training folder) in another dtype")
    e.add_argument("--src", type=drafter_folder, required=True)
    e.add_argument("--dst", type=output_dir, required=True)
    e.add_argument("--overwrite", action="store_true", help="write into a non-empty --dst (its checkpoint is replaced)")
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--draft-vocab", type=nonnegative_int, default=None, metavar="K",
                   help="give the drafter a draft vocabulary: the K most frequent response tokens of --data "
                        "(0: remove it); default: keep the source's")
    e.add_argument("--data", type=existing_dir, default=None, help="training data folder of --draft-vocab (gen-data output)")
    e.add_argument("--holdout", type=nonnegative_int, default=64, help="highest-id records of --data left out of the count")
    i = sub.add_parser("info", help="versions, CUDA architectures built and usable, CPU ISA and op paths, the "
                                    "default target and drafter: what a bug report needs")
    i.add_argument("--json", action="store_true", help="the report as JSON")
    args = p.parse_args(argv)
    commands = {"generate": cmd_generate, "gen-data": cmd_gen_data, "train": cmd_train, "eval": cmd_eval,
                "export": cmd_export, "info": cmd_info}
    try:
        if args.command in ("gen-data", "train", "eval"):  # jobs that own their process and its allocator
            from . import hardware

            hardware.keep_freed_memory()
        commands[args.command](args)
    except UsageError as e:
        sub.choices[args.command].error(str(e))


if __name__ == "__main__":
    main()
