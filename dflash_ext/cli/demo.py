"""The demo ``python -m dflash_ext generate`` runs (``./run.sh demo``): DFlash beside the target
alone on this machine. The target alone is timed at start in each dtype and linear path
(:func:`fastest_target_alone`), which picks the dtype (:func:`choose_dtype`; with a trained
drafter, the dtype race: where DFlash is expected fastest); DFlash runs one prompt, streamed
(:func:`demo_one_prompt`), or a prompts file in batches (:func:`demo_prompts_file`); with
--baseline the target alone runs every way that timed close to the fastest, the fastest run is
the baseline, --repeats pairs run alternately (their median ratio), and the outputs are
compared like with like (the target alone in DFlash's dtype)."""
import functools
import statistics
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from ..decode.autotune import BlockSizeChoice, interleaved_median_seconds, median_seconds
from ..decode.rollback import CacheRollback
from ..decode.runner import TargetRunner
from ..model.pretrained import cast_target
from ..ops.linear import streamed_linears
from .args import check_drafter_fits

# ---------------------------------------------------------------- the target alone, timed at start


@torch.no_grad()
def _one_token_pass(model, ids):
    """A function that runs one one-token pass of the target after the prompt `ids` (prefilled
    here, through whatever linear layers are active now) and undoes it, so it can run again."""
    runner = TargetRunner(model)
    x = torch.as_tensor([ids], device=runner.device)
    _, _, cache = runner(x, None, hidden_states=False, last_logits_only=True)
    rollback = CacheRollback(cache, 1)  # undoes each timed pass on every cache kind (windows, hybrids)

    @torch.no_grad()  # it runs later, outside this function: with grad on, the linears would not stream
    def step():
        runner(x[:, -1:], cache, hidden_states=False, last_logits_only=True, rollback=rollback)
        rollback(1)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    return step


def time_target_alone(model, ids, stream: bool, reps: int = 7) -> float:
    """Seconds of one one-token pass of the target alone after the prompt `ids` (median of
    `reps`, after one untimed), its linear layers through skinny_linear (`stream`) or F.linear."""
    with streamed_linears(model, enabled=stream):
        return median_seconds(_one_token_pass(model, ids), reps, warmup=1)


def fastest_target_alone(model, ids, device, reps: int = 7) -> tuple:
    """({(dtype, stream): seconds per token}, {dtype: model}): the target alone timed in fp32
    and bf16, on the CPU with its linear layers through F.linear and through skinny_linear
    (which wins depends on the CPU and the dtype: it is measured, never assumed). The ways are
    timed in rounds (:func:`interleaved_median_seconds`), so a drift of the machine's speed
    cannot rank them. `model` is the fp32 one; the bf16 copy is made here."""
    models = {torch.float32: model, torch.bfloat16: cast_target(model, torch.bfloat16)}
    streams = (False, True) if torch.device(device).type == "cpu" else (False,)
    ways = [(dtype, stream) for dtype in models for stream in streams]
    streaming = {way: functools.partial(streamed_linears, models[way[0]], enabled=way[1]) for way in ways}
    steps = {}
    for way in ways:
        with streaming[way]():
            steps[way] = _one_token_pass(models[way[0]], ids)
    return interleaved_median_seconds(steps, reps, warmup=1, around=streaming), models


# ---------------------------------------------------------------- the dtype DFlash runs in


def measures(args) -> bool:
    """Whether the target alone is timed at start (--dtype auto, --baseline): then the target
    loads in fp32 (the converted checkpoint's weights) and is copied to bf16 for the timing."""
    return args.dtype == "auto" or args.baseline


@dataclass
class DtypeChoice:
    """The dtype DFlash runs in, the target in it, and what was timed to choose it."""
    dtype: torch.dtype
    model: torch.nn.Module                        # the target in `dtype`
    models: Optional[dict] = None                 # where measured: {dtype: the target}, each dtype timed and `dtype`
    timings: Optional[dict] = None                # where measured: {(dtype, streamed): seconds of a one-token pass}
    drafter: Optional[torch.nn.Module] = None     # loaded in `dtype` by the dtype race, where it ran
    block_size: Optional[BlockSizeChoice] = None  # the dtype race's choice in `dtype`, where it ran


def choose_dtype(args, model, ids, load_drafter, report: dict, where: str, one_prompt: bool) -> DtypeChoice:
    """The dtype DFlash runs in (printed, with why, and reported): --dtype as asked, else timed
    after the prompt `ids` (:func:`_measured_dtype`). `model`: the target as loaded."""
    if measures(args):
        chosen, how = _measured_dtype(args, model, ids, load_drafter, report, one_prompt)
    else:
        chosen, how = DtypeChoice(getattr(torch, args.dtype), model), "as asked"
    print(f"[dflash_ext] dtype {_name(chosen.dtype)} ({how}; {where})", file=sys.stderr)
    report["dtype"] = _name(chosen.dtype)
    return chosen


def _measured_dtype(args, model, ids, load_drafter, report: dict, one_prompt: bool) -> tuple:
    """(DtypeChoice, why) after the target alone is timed in each way: --dtype as asked, or auto:
    the fastest target alone's dtype, or, for one prompt on the dynamic cache with a trained
    drafter at --block-size auto, the dtype where DFlash is expected fastest (the dtype race)."""
    timings, models = fastest_target_alone(model, ids, args.device)
    fastest = min(timings, key=timings.get)
    print("[dflash_ext] the target alone, one token per pass after this prompt: "
          + ", ".join(f"{_config_name(c)} {1e3 * t:.1f} ms" for c, t in timings.items())
          + f" -> fastest here: {_config_name(fastest)}", file=sys.stderr)
    report["target_alone_ms_per_token"] = {_config_name(c): 1e3 * t for c, t in timings.items()}
    dtype = fastest[0] if args.dtype == "auto" else getattr(torch, args.dtype)
    how = "auto: the fastest target alone measured above" if args.dtype == "auto" else "as asked"
    drafter = choice = None
    if args.dtype == "auto" and args.block_size == "auto" and args.drafter and one_prompt and not args.static_cache:
        raced = _fastest_dflash(models, load_drafter, len(ids))
        if raced is not None:
            dtype, drafter, choice, by_dtype = raced
            how = "auto: where DFlash is expected fastest, above"
            report["dflash_expected_tokens_per_second"] = {
                _name(dt): c.best_tokens_per_second for dt, (_, c) in by_dtype.items()}
    if dtype not in models:  # e.g. float16 asked for: a copy in it (the fp32 one stays)
        models[dtype] = cast_target(model, dtype)
    return DtypeChoice(dtype, models[dtype], models, timings, drafter, choice), how


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


# ---------------------------------------------------------------- what is printed


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


# ---------------------------------------------------------------- the baseline: the target alone, its fastest way

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


# ---------------------------------------------------------------- one prompt


def demo_one_prompt(args, tok, drafter, ids, stops, chosen: DtypeChoice, report: dict, where: str,
                    static_cache_len: Optional[int]) -> None:
    """One prompt: DFlash's text streamed and its statistics, the drafter's own run where the
    block-size rule chose B = 1, and with --baseline the comparison with the target alone."""
    from ..decode.loop import spec_generate

    model = chosen.model
    block_size, best_drafting = _one_prompt_block_size(args, drafter, ids, chosen, static_cache_len)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops,
                  static_cache=args.static_cache)
    rule = dict(verify=args.verify, tree_budget=args.tree_budget)  # DFlash's alone (the target alone has none)
    if args.baseline:  # untimed warm-up of the loop, so that the timed run pays no first-call costs
        spec_generate(model, drafter, ids, 8, block_size=block_size, **rule, **common)
    # One closure for every timed DFlash run (the streamed one, the repeats, the best drafting B), so all run alike.
    run_dflash = lambda b, on_tokens=None: spec_generate(
        model, drafter, ids, args.max_new_tokens, block_size=b, generator=torch.Generator().manual_seed(args.seed),
        on_tokens=on_tokens, **rule, **common)
    res = run_dflash(block_size, on_tokens=_Streamer(tok))
    _print_stats("DFlash" if block_size > 1 else "DFlash at block size 1: the target alone, nothing drafted", res)
    report["dflash"] = dict(res.summary(), verify=args.verify if args.temperature > 0 else "greedy",
                            tree_budget=args.tree_budget)
    drafted = None
    if best_drafting is not None:
        drafted = run_dflash(best_drafting)
        _print_stats(f"the drafter at block size {best_drafting} (its best B > 1; not chosen)", drafted)
        report["dflash_best_drafting"] = drafted.summary()
    if args.baseline:
        base_way, base, first_runs = _one_prompt_baseline(args, chosen, ids, common, lambda: run_dflash(block_size),
                                                          block_size, res, report)
        print(f"\n=== {_name(chosen.dtype)} on {where}, against the target alone run the fastest way measured here "
              f"({_config_name(base_way)}, {base.tokens_per_second:.1f} tok/s):", file=sys.stderr)
        _print_dflash_speed(args, chosen.dtype, block_size, res, base, report)
        if drafted is not None:
            report["speedup_best_drafting"] = _speedup(base, drafted)
            print(f"    the drafter at block size {best_drafting} (tau {drafted.tau:.2f}): "
                  f"{drafted.tokens_per_second:.1f} tok/s = {report['speedup_best_drafting']:.2f}x", file=sys.stderr)
        _compare_one_output(args, chosen, ids, common, res, base_way, base, first_runs, report)


def _one_prompt_block_size(args, drafter, ids, chosen: DtypeChoice, static_cache_len) -> tuple:
    """(the block size DFlash runs at, the best B > 1 where --block-size auto chose 1 and drafting
    was timed, else None). Auto: timed here, unless the dtype race timed it in DFlash's dtype."""
    from ..decode.autotune import choose_block_size

    if args.block_size != "auto":
        return args.block_size, None
    choice = chosen.block_size
    if choice is None:  # its graphs are shaped by the static cache's rows, so spec_generate reuses them
        choice = choose_block_size(chosen.model, drafter, len(ids), static_cache=args.static_cache,
                                   static_cache_len=static_cache_len)
    speeds = ", ".join(f"B={b}: {v:.0f} tok/s" for b, v in choice.tokens_per_second.items())
    print(f"[dflash_ext] block size auto -> {choice.block_size} (profile: {choice.profile_source}"
          + (f"; expected {speeds}" if speeds else "") + ")", file=sys.stderr)
    drafting = {b: v for b, v in choice.tokens_per_second.items() if b > 1}
    if choice.block_size > 1 or not drafting:
        return choice.block_size, None
    best_drafting = max(drafting, key=drafting.get)
    print(f"[dflash_ext] drafting does not pay here: with this drafter in {_name(chosen.dtype)} on this machine "
          "the target alone is expected to be fastest, so DFlash drafts nothing (block size 1 = the target "
          f"alone). The drafter's own run at its best B > 1 (B = {best_drafting}) follows, with its tau.",
          file=sys.stderr)
    return choice.block_size, best_drafting


def _one_prompt_baseline(args, chosen: DtypeChoice, ids, common, run_dflash, block_size, res, report) -> tuple:
    """The target alone after DFlash's run `res`: every contender run once a pair, the pair's baseline
    the fastest run; with --repeats N (and a run that drafted) N - 1 more pairs of `run_dflash()` and the
    baseline run alternately, the speedup their median ratio. (the first baseline's way, its run, every run)."""
    from ..decode.loop import target_generate

    contenders = _contenders(chosen.timings)  # each runs in every pair, the pair's baseline the fastest run
    _warm_up(chosen.models, contenders, ids, common)
    run_base = lambda: _fastest_run(contenders, lambda way: target_generate(
        chosen.models[way[0]], ids, args.max_new_tokens, stream_linears=way[1],
        generator=torch.Generator().manual_seed(args.seed), **common), seconds=lambda r: r.total_time)
    base_way, base, first_runs = run_base()
    name = _config_name(base_way)
    _print_stats(f"target alone, the fastest way measured here ({name}"
                 + (f"; of {', '.join(map(_config_name, contenders))}, each run once" if len(contenders) > 1
                    else "") + ")", base)
    report["baseline"] = dict(base.summary(), config=name)
    report["baseline_contenders"] = [_config_name(way) for way in contenders]
    report["speedup"] = _speedup(base, res)
    if args.repeats > 1 and block_size > 1 and res.acceptance_lengths:
        # The machine's speed drifts between runs: more pairs, run alternately, and their median ratio.
        ratios, winners = [report["speedup"]], [name]
        for _ in range(args.repeats - 1):
            again = run_dflash()
            way, again_base, _ = run_base()
            ratios.append(_speedup(again_base, again))
            winners.append(_config_name(way))
        report["speedup_runs"], report["baseline_runs"] = ratios, winners
        report["speedup"] = statistics.median(ratios)
    return base_way, base, first_runs


def _print_dflash_speed(args, dtype, block_size, res, base, report) -> None:
    """DFlash's speed against the baseline `base`; no ratio where no step drafted (block size 1, or
    the answer was the prefill's token alone)."""
    if block_size > 1 and not res.acceptance_lengths:  # both runs were the prefill alone: no ratio
        report["speedup"] = None
        print("    no DFlash speedup to show: the answer was the prefill's token alone, which both runs compute "
              "the same way (no speculative step ran)", file=sys.stderr)
    elif block_size > 1:
        speed = f"{res.tokens_per_second:.1f} tok/s = {report['speedup']:.2f}x"
        if "speedup_runs" in report:  # the first run's tok/s is printed above; the ratio is the pairs' median
            speed = (f"{report['speedup']:.2f}x, the median of {len(report['speedup_runs'])} pairs run alternately ("
                     + ", ".join(f"{r:.2f}x" for r in report["speedup_runs"]) + ")")
        print(f"    DFlash (block size {block_size}, tau {res.tau:.2f}): {speed}", file=sys.stderr)
    else:
        # No ratio: this run is a target alone too, and a gap between two is not DFlash's doing.
        streamed = torch.device(args.device).type == "cpu"
        print(f"    no DFlash speedup here: block size 1 (drafting does not pay), so DFlash ran the target alone "
              f"({_config_name((dtype, streamed))}): {res.tokens_per_second:.1f} tok/s"
              + (" (faster than the baseline: the short timing at start ranked them otherwise; a busy machine?)"
                 if res.total_time < 0.9 * base.total_time else ""), file=sys.stderr)


def _compare_one_output(args, chosen: DtypeChoice, ids, common, res, base_way, base, first_runs, report) -> None:
    """At temperature 0, DFlash's text against the target alone's in DFlash's dtype (the baseline's
    run where it ran in that dtype); sampled texts are not compared."""
    from ..decode.loop import target_generate

    if args.temperature > 0:
        print("    sampling (temperature > 0): DFlash follows the target's own distribution; the texts are "
              "compared only at --temperature 0", file=sys.stderr)
        return
    reference, ref_name = base, _config_name(base_way)
    if base_way[0] != chosen.dtype:  # compare like with like: the target alone in DFlash's dtype
        reference = _reference_run(first_runs, chosen.dtype, lambda: target_generate(
            chosen.model, ids, args.max_new_tokens, **common))
        ref_name = _config_name((chosen.dtype, False))
    same, line = _same_output_line(res, reference, chosen.dtype, ref_name)
    report["identical_to_baseline"] = same
    print(f"    {line}", file=sys.stderr)


# ---------------------------------------------------------------- a prompts file, in batches


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


def demo_prompts_file(args, tok, drafter, prompts_ids, stops, chosen: DtypeChoice, report: dict) -> None:
    """--prompts-file: the prompts in batches of --batch-size (decode/batch.py), each output
    printed in order (stdout), the totals (stderr) and, in `report`, every output; with
    --baseline the target alone over the same batches."""
    from ..decode.autotune import choose_block_size
    from ..decode.loop import spec_generate

    model, size, block_size = chosen.model, min(args.batch_size, len(prompts_ids)), args.block_size
    if block_size == "auto":
        choice = choose_block_size(model, drafter, max(map(len, prompts_ids)), batch_size=size)
        block_size = choice.block_size
        print(f"[dflash_ext] block size auto -> {choice.block_size} for batches of {size} (profile: "
              f"{choice.profile_source})", file=sys.stderr)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops)
    if args.baseline:  # untimed warm-up, so that the timed run pays no first-call costs
        spec_generate(model, drafter, prompts_ids[:size], 8, block_size=block_size, verify=args.verify, **common)
    results, wall = _run_batches(lambda chunk: spec_generate(
        model, drafter, chunk, args.max_new_tokens, block_size=block_size, verify=args.verify,
        generator=torch.Generator().manual_seed(args.seed), **common), prompts_ids, size)
    texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in results]
    for i, text in enumerate(texts):
        print(f"=== prompt {i} ===\n{text}")
    summary = report["dflash"] = dict(_batch_summary(results, wall, size), block_size=block_size,
                                      verify=args.verify if args.temperature > 0 else "greedy")
    report["outputs"] = [dict(prompt=p, text=t, tokens=r.tokens, **r.summary())
                         for p, t, r in zip(args.prompts_file, texts, results)]
    print(f"\n--- DFlash: {summary['prompts']} prompts in batches of {size}, block size {block_size}: "
          f"{summary['new_tokens']} tokens in {wall:.2f} s = {summary['tokens_per_second']:.1f} tok/s, "
          f"tau {summary['tau']:.2f}", file=sys.stderr)
    if args.baseline:
        _prompts_file_baseline(args, chosen, prompts_ids, size, common, results, wall, report)


def _prompts_file_baseline(args, chosen: DtypeChoice, prompts_ids, size, common, results, wall, report) -> None:
    """The target alone over the same batches, as for one prompt: every way timed close to the fastest
    decodes them all, the fastest run is the baseline; the outputs compared in DFlash's dtype."""
    from ..decode.loop import target_generate

    contenders = _contenders(chosen.timings)
    _warm_up(chosen.models, contenders, prompts_ids[:size], common)
    run_batches = lambda model, stream: _run_batches(lambda chunk: target_generate(
        model, chunk, args.max_new_tokens, stream_linears=stream, generator=torch.Generator().manual_seed(args.seed),
        **common), prompts_ids, size)
    base_way, (base, base_wall), runs = _fastest_run(contenders, lambda way: run_batches(chosen.models[way[0]], way[1]),
                                                     seconds=lambda r: r[1])
    name = _config_name(base_way)
    report["baseline"] = dict(_batch_summary(base, base_wall, size), config=name)
    report["baseline_contenders"] = [_config_name(way) for way in contenders]
    report["speedup"] = base_wall / wall if wall > 0 else None
    reference = base  # compared like with like: the target alone in DFlash's dtype (as one prompt is)
    if args.temperature == 0 and base_way[0] != chosen.dtype:
        reference, _ = _reference_run(runs, chosen.dtype, lambda: run_batches(chosen.model, False))
    same = [r.tokens == b.tokens for r, b in zip(results, reference)]
    report["identical_to_baseline"] = same if args.temperature == 0 else None
    print(f"--- target alone ({name}" + (f"; the fastest of {', '.join(report['baseline_contenders'])}"
                                           if len(contenders) > 1 else "")
          + f"), the same batches: {report['baseline']['tokens_per_second']:.1f} tok/s; "
          f"DFlash {report['speedup']:.2f}x" + (f"; outputs identical: {sum(same)} of {len(same)}"
                                                 if args.temperature == 0 else ""), file=sys.stderr)
