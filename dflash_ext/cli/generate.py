"""``python -m dflash_ext generate`` (speculative generation, streamed, with statistics and
the comparison with the target alone) and ``info``."""
import json
import os
import statistics
import sys

import torch

from ..decode.autotune import fastest_target_alone
from .args import UsageError, check_drafter_fits


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
    if s["block_size"] > 1 and not s["steps"]:
        print("    no speculative step ran: the prefill's token was the whole answer (--max-new-tokens or a "
              "stop token), so there is no tau and nothing drafted", file=sys.stderr)
    elif s["block_size"] > 1:
        steps = s["steps"]
        print(f"    tau = {s['tau']:.2f} over {s['steps']} steps (block size {s['block_size']}); "
              f"acceptance histogram (steps that accepted 0..B-1 drafts): {s['histogram']}", file=sys.stderr)
        print(f"    per step: draft {1e3 * s['draft_s'] / steps:.1f} ms, verify {1e3 * s['verify_s'] / steps:.1f} ms, "
              f"other {1e3 * s['other_s'] / steps:.1f} ms", file=sys.stderr)


# The target alone's ways whose one-token pass timed within this factor of the fastest way's all run wherever
# --baseline times it (bf16 and fp32 through skinny_linear are ~10 % apart on an EPYC with bf16 units).
_CONTENDER_MARGIN = 1.25


def _contenders(timings: dict) -> list:
    """The target alone's ways (dtype, streamed) whose one-token pass timed within _CONTENDER_MARGIN of the
    fastest, fastest first. All of them run wherever the baseline is timed, and the baseline is the fastest
    run: a slow moment during the short pass timing cannot make a slower way the baseline."""
    best = min(timings.values())
    return [way for way in sorted(timings, key=timings.get) if timings[way] <= _CONTENDER_MARGIN * best]


def _fastest_run(contenders, run, seconds) -> tuple:
    """(way, result, every run by way) of the fastest of one `run(way)` per contender, `seconds(result)` its
    time (every run: the output comparison reuses the run in DFlash's dtype where one was made)."""
    runs = {way: run(way) for way in contenders}
    way = min(runs, key=lambda w: seconds(runs[w]))
    return way, runs[way], runs


def _warm_up(models, contenders, prompt, common) -> None:
    """One short untimed run of every contender (a prompt's ids or a batch of them), so that no timed run
    pays first-call costs."""
    from ..decode.loop import target_generate

    for dtype, stream in contenders:
        target_generate(models[dtype], prompt, 8, stream_linears=stream, **common)


def _reference_run(runs, dtype, run):
    """The target alone in DFlash's `dtype` through F.linear (as HF `generate` runs it), what DFlash's
    output is compared with: the baseline's run of that way where it made one, else `run()`."""
    return runs[(dtype, False)] if (dtype, False) in runs else run()


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _config_name(config) -> str:
    dtype, stream = config
    return f"{_name(dtype)} with {'skinny_linear' if stream else 'F.linear'}"


def _speedup(base, run) -> float:
    """How many times faster `run` was than `base` (two generation results); nan for a run that took no time."""
    return base.total_time / run.total_time if run.total_time else float("nan")


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
    from ..decode.autotune import choose_block_size
    from ..decode.loop import spec_generate, target_generate
    from ..model.drafter import DFlashDrafter
    from ..model.pretrained import MissingPackage, cast_target, default_drafter_path, load_target
    from ..ops.hardware import cpu_description

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = cpu_description() if device.type == "cpu" else args.device
    measure = args.dtype == "auto" or args.baseline
    try:  # measuring compares dtypes: load in fp32 (the converted checkpoint's), copy to bf16 after
        model, tok = load_target(args.target, dtype=torch.float32 if measure else getattr(torch, args.dtype),
                                 device=args.device)
    except MissingPackage as e:
        raise SystemExit(f"python -m dflash_ext: {e}")
    many = [_chat_ids(tok, p) for p in args.prompts_file] if args.prompts_file else None
    ids = many[0] if many else _chat_ids(tok, args.prompt)  # --dtype auto and --baseline time the first prompt
    report = {}
    default_drafter = default_drafter_path()
    if args.drafter is None and args.target is None and not args.fresh_drafter:
        if os.path.exists(os.path.join(default_drafter, "config.json")):
            args.drafter = default_drafter
        else:
            print(f"[dflash_ext] the shipped drafter is missing ({default_drafter}): a broken install?",
                  file=sys.stderr)
    load_drafter = lambda dt: DFlashDrafter.from_pretrained(args.drafter, device=args.device, dtype=dt)
    drafter = choice = None
    if measure:
        timings, models = fastest_target_alone(model, ids, args.device)
        fastest = min(timings, key=timings.get)
        print("[dflash_ext] the target alone, one token per pass after this prompt: "
              + ", ".join(f"{_config_name(c)} {1e3 * t:.1f} ms" for c, t in timings.items())
              + f" -> fastest here: {_config_name(fastest)}", file=sys.stderr)
        report["target_alone_ms_per_token"] = {_config_name(c): 1e3 * t for c, t in timings.items()}
        dtype = fastest[0] if args.dtype == "auto" else getattr(torch, args.dtype)
        how = "auto: the fastest target alone measured above" if args.dtype == "auto" else "as asked"
        if args.dtype == "auto" and args.block_size == "auto" and args.drafter and not (many or args.static_cache):
            raced = _fastest_dflash(models, load_drafter, len(ids))
            if raced is not None:
                dtype, drafter, choice, by_dtype = raced
                how = "auto: where DFlash is expected fastest, above"
                report["dflash_expected_tokens_per_second"] = {
                    _name(dt): c.best_tokens_per_second for dt, (_, c) in by_dtype.items()}
        if dtype not in models:  # e.g. float16 asked for: a copy in it (the fp32 one stays)
            models[dtype] = cast_target(model, dtype)
        model = models[dtype]
    else:
        dtype = getattr(torch, args.dtype)
        how = "as asked"
    print(f"[dflash_ext] dtype {_name(dtype)} ({how}; {where})", file=sys.stderr)
    report["dtype"] = _name(dtype)
    if args.drafter:
        if drafter is None:  # else loaded in DFlash's dtype by the race above
            drafter = load_drafter(dtype)
            check_drafter_fits(drafter, model.config)
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
    # the static cache's rows: the prompt, the budget and one trained block of drafts
    cache_rows = len(ids) + args.max_new_tokens + drafter.config.block_size if args.static_cache else None
    if args.static_cache:  # a target whose static cache cannot be rolled back is refused before decoding
        _check_static_cache(model, cache_rows)
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if many:
        if args.static_cache:
            raise UsageError("argument --static-cache: it decodes one prompt; --prompts-file decodes batches on the "
                             "dynamic cache")
        baseline = (models, _contenders(timings)) if args.baseline else None
        return _generate_many(args, model, tok, drafter, many, stops, baseline, report)
    best_drafting = None  # the best B > 1 where the rule chose B = 1
    if args.block_size == "auto":
        if choice is None:  # else timed already, in the dtype race above
            choice = choose_block_size(model, drafter, len(ids), static_cache=args.static_cache,  # its graphs reused
                                       static_cache_len=cache_rows)
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
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops,
                  static_cache=args.static_cache)
    if args.baseline:  # untimed warm-up of the loop, so that the timed run pays no first-call costs
        spec_generate(model, drafter, ids, 8, block_size=args.block_size, verify=args.verify, **common)
    # One closure for every timed DFlash run (the streamed one, the repeats, the best drafting B), so all run alike.
    run_dflash = lambda block_size, on_tokens=None: spec_generate(
        model, drafter, ids, args.max_new_tokens, block_size=block_size, verify=args.verify,
        generator=torch.Generator().manual_seed(args.seed), on_tokens=on_tokens, **common)
    res = run_dflash(args.block_size, on_tokens=_Streamer(tok))
    _print_stats("DFlash" if args.block_size > 1 else "DFlash at block size 1: the target alone, nothing drafted", res)
    report["dflash"] = dict(res.summary(), verify=args.verify if args.temperature > 0 else "greedy")
    drafted = None
    if best_drafting is not None:
        drafted = run_dflash(best_drafting)
        _print_stats(f"the drafter at block size {best_drafting} (its best B > 1; not chosen)", drafted)
        report["dflash_best_drafting"] = drafted.summary()
    if args.baseline:
        contenders = _contenders(timings)  # each runs in every pair, the pair's baseline the fastest run
        _warm_up(models, contenders, ids, common)
        run_base = lambda: _fastest_run(contenders, lambda way: target_generate(
            models[way[0]], ids, args.max_new_tokens, stream_linears=way[1],
            generator=torch.Generator().manual_seed(args.seed), **common), seconds=lambda r: r.total_time)

        base_way, base, first_runs = run_base()
        name = _config_name(base_way)
        _print_stats(f"target alone, the fastest way measured here ({name}"
                     + (f"; of {', '.join(map(_config_name, contenders))}, each run once" if len(contenders) > 1
                        else "") + ")", base)
        report["baseline"] = dict(base.summary(), config=name)
        report["baseline_contenders"] = [_config_name(way) for way in contenders]
        report["speedup"] = _speedup(base, res)
        if args.repeats > 1 and args.block_size > 1 and res.acceptance_lengths:
            # The machine's speed drifts between runs: more pairs, run alternately, and their median ratio.
            ratios, winners = [report["speedup"]], [name]
            for _ in range(args.repeats - 1):
                again = run_dflash(args.block_size)
                way, again_base, _ = run_base()
                ratios.append(_speedup(again_base, again))
                winners.append(_config_name(way))
            report["speedup_runs"], report["baseline_runs"] = ratios, winners
            report["speedup"] = statistics.median(ratios)
        print(f"\n=== {_name(dtype)} on {where}, against the target alone run the fastest way measured here ({name}, "
              f"{base.tokens_per_second:.1f} tok/s):", file=sys.stderr)
        if args.block_size > 1 and not res.acceptance_lengths:  # both runs were the prefill alone: no ratio
            report["speedup"] = None
            print("    no DFlash speedup to show: the answer was the prefill's token alone, which both runs compute "
                  "the same way (no speculative step ran)", file=sys.stderr)
        elif args.block_size > 1:
            speed = f"{res.tokens_per_second:.1f} tok/s = {report['speedup']:.2f}x"
            if "speedup_runs" in report:  # the first run's tok/s is printed above; the ratio is the pairs' median
                speed = (f"{report['speedup']:.2f}x, the median of {len(report['speedup_runs'])} pairs run alternately ("
                         + ", ".join(f"{r:.2f}x" for r in report["speedup_runs"]) + ")")
            print(f"    DFlash (block size {args.block_size}, tau {res.tau:.2f}): {speed}", file=sys.stderr)
        else:
            # No ratio: this run is a target alone too, and a gap between two is not DFlash's doing.
            print(f"    no DFlash speedup here: block size 1 (drafting does not pay), so DFlash ran the target alone "
                  f"({_config_name((dtype, device.type == 'cpu'))}): {res.tokens_per_second:.1f} tok/s"
                  + (" (faster than the baseline: the short timing at start ranked them otherwise; a busy machine?)"
                     if res.total_time < 0.9 * base.total_time else ""), file=sys.stderr)
        if drafted is not None:
            report["speedup_best_drafting"] = _speedup(base, drafted)
            print(f"    the drafter at block size {best_drafting} (tau {drafted.tau:.2f}): "
                  f"{drafted.tokens_per_second:.1f} tok/s = {report['speedup_best_drafting']:.2f}x", file=sys.stderr)
        if args.temperature == 0:
            reference, ref_name = base, name
            if base_way[0] != dtype:  # compare like with like: the target alone in DFlash's dtype
                reference = _reference_run(first_runs, dtype, lambda: target_generate(
                    model, ids, args.max_new_tokens, **common))
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


def _fastest_dflash(models, load_drafter, context_len: int):
    """--dtype auto with --block-size auto and a trained drafter (one prompt, dynamic cache):
    (dtype, drafter, its BlockSizeChoice, {dtype: (drafter, choice)}) of the dtype where DFlash
    is expected fastest at its best block size (choose_block_sizes over each dtype the target
    alone was timed in, all timed in the same rounds: the verify and the draft step cost
    differently per dtype, so the fastest target alone's dtype need not be DFlash's; the
    baseline stays the fastest target alone). None where the drafter has no acceptance profile (nothing timed)."""
    from ..decode.autotune import choose_block_sizes

    drafters = {dt: load_drafter(dt) for dt in models}
    for dt, target in models.items():
        check_drafter_fits(drafters[dt], target.config)
    choices = choose_block_sizes({dt: (target, drafters[dt]) for dt, target in models.items()}, context_len)
    if not all(choice.tokens_per_second for choice in choices.values()):
        return None
    raced = {dt: (drafters[dt], choices[dt]) for dt in models}
    best = max(raced, key=lambda dt: raced[dt][1].best_tokens_per_second)
    print("[dflash_ext] DFlash expected after this prompt: " + ", ".join(
        f"{_name(dt)} {c.best_tokens_per_second:.1f} tok/s (B={c.block_size})" for dt, (_, c) in raced.items())
        + f" -> {_name(best)}", file=sys.stderr)
    return best, *raced[best], raced


def _chat_ids(tok, prompt: str) -> list:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]


def _run_batches(run, prompts_ids, size: int) -> tuple:
    """(one result per prompt, wall seconds): `run(chunk)` over the prompts in batches of `size`."""
    import time

    start, results = time.perf_counter(), []
    for i in range(0, len(prompts_ids), size):
        results += run(prompts_ids[i:i + size])
    return results, time.perf_counter() - start


def _batch_summary(results, wall: float, size: int) -> dict:
    tokens, steps = sum(len(r.tokens) for r in results), sum(len(r.acceptance_lengths) for r in results)
    return {"prompts": len(results), "batch_size": size, "new_tokens": tokens, "total_s": wall,
            "tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "tau": sum(sum(r.acceptance_lengths) for r in results) / max(1, steps)}


def _generate_many(args, model, tok, drafter, prompts_ids, stops, baseline, report) -> None:
    """--prompts-file: the prompts in batches of --batch-size (decode/batch.py), each output
    printed in order (stdout), the totals (stderr) and, with --json, every output."""
    from ..decode.autotune import choose_block_size
    from ..decode.loop import spec_generate, target_generate

    size = min(args.batch_size, len(prompts_ids))
    if args.block_size == "auto":
        choice = choose_block_size(model, drafter, max(map(len, prompts_ids)), batch_size=size)
        args.block_size = choice.block_size
        print(f"[dflash_ext] block size auto -> {choice.block_size} for batches of {size} (profile: "
              f"{choice.profile_source})", file=sys.stderr)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops)
    seeded = lambda: torch.Generator().manual_seed(args.seed)
    if baseline is not None:  # untimed warm-up, so that the timed run pays no first-call costs
        spec_generate(model, drafter, prompts_ids[:size], 8, block_size=args.block_size, verify=args.verify, **common)
    results, wall = _run_batches(lambda chunk: spec_generate(model, drafter, chunk, args.max_new_tokens,
                                                             block_size=args.block_size, verify=args.verify,
                                                             generator=seeded(), **common),
                                 prompts_ids, size)
    texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in results]
    for i, text in enumerate(texts):
        print(f"=== prompt {i} ===\n{text}")
    summary = report["dflash"] = dict(_batch_summary(results, wall, size), block_size=args.block_size,
                                      verify=args.verify if args.temperature > 0 else "greedy")
    report["outputs"] = [dict(prompt=p, text=t, tokens=r.tokens, **r.summary())
                         for p, t, r in zip(args.prompts_file, texts, results)]
    print(f"\n--- DFlash: {summary['prompts']} prompts in batches of {size}, block size {args.block_size}: "
          f"{summary['new_tokens']} tokens in {wall:.2f} s = {summary['tokens_per_second']:.1f} tok/s, "
          f"tau {summary['tau']:.2f}", file=sys.stderr)
    if baseline is not None:  # as for one prompt: every way timed close to the fastest, the fastest run
        models, contenders = baseline
        _warm_up(models, contenders, prompts_ids[:size], common)
        base_way, (base, base_wall), runs = _fastest_run(contenders, lambda way: _run_batches(
            lambda chunk: target_generate(models[way[0]], chunk, args.max_new_tokens, stream_linears=way[1],
                                          generator=seeded(), **common), prompts_ids, size), seconds=lambda r: r[1])
        name = _config_name(base_way)
        report["baseline"] = dict(_batch_summary(base, base_wall, size), config=name)
        report["baseline_contenders"] = [_config_name(way) for way in contenders]
        report["speedup"] = base_wall / wall if wall > 0 else None
        reference = base  # compared like with like: the target alone in DFlash's dtype (as one prompt is)
        dtype = next(model.parameters()).dtype
        if args.temperature == 0 and base_way[0] != dtype:
            reference, _ = _reference_run(runs, dtype, lambda: _run_batches(lambda chunk: target_generate(
                model, chunk, args.max_new_tokens, generator=seeded(), **common), prompts_ids, size))
        same = [r.tokens == b.tokens for r, b in zip(results, reference)]
        report["identical_to_baseline"] = same if args.temperature == 0 else None
        print(f"--- target alone ({name}" + (f"; the fastest of {', '.join(report['baseline_contenders'])}"
                                               if len(contenders) > 1 else "")
              + f"), the same batches: {report['baseline']['tokens_per_second']:.1f} tok/s; "
              f"DFlash {report['speedup']:.2f}x" + (f"; outputs identical: {sum(same)} of {len(same)}"
                                                     if args.temperature == 0 else ""), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _check_static_cache(model, max_cache_len: int) -> None:
    """Usage error naming --static-cache where the loop could not roll the target's static
    cache back (sliding windows that can fill), naming --max-new-tokens where the cache would
    not fit in memory: transformers allocates a cache's layers on their first update, so
    this probe costs nothing."""
    from ..decode.rollback import CacheRollback
    from ..decode.runner import static_cache

    try:
        CacheRollback(static_cache(model, max_cache_len), 1)
    except NotImplementedError as e:
        raise UsageError(f"argument --static-cache: {e}") from None
    except ValueError as e:
        raise UsageError(f"argument --max-new-tokens: with --static-cache, {e}") from None


def cmd_info(args):
    from ..diagnostics import format_info, info

    report = info()
    print(json.dumps(report, indent=2) if args.json else format_info(report))
