"""``python -m dflash_ext generate``: reads its arguments, refuses what cannot run, loads the
target and the drafter, and runs the demo (cli/demo.py: DFlash streamed or in batches, the
comparison with the target alone); and ``info``."""
import json
import os
import sys

import torch

from . import demo
from ..sampling import DEFAULT_VERIFY
from .args import UsageError, check_drafter_fits


def cmd_generate(args):
    """generate: the target and the drafter as the arguments ask, what cannot run refused before
    any work, then the demo (one prompt or a prompts file) and its report (--json)."""
    from ..model.drafter import DFlashDrafter
    from ..model.pretrained import MissingPackage, load_target
    from ..ops.hardware import cpu_description

    _check_tree_budget(args)
    torch.set_num_threads(args.threads)
    where = cpu_description() if torch.device(args.device).type == "cpu" else args.device
    try:
        dtype = torch.float32 if demo.measures(args) else getattr(torch, args.dtype)  # timed: fp32, copied after
        model, tok = load_target(args.target, dtype=dtype, device=args.device)
    except MissingPackage as e:
        raise SystemExit(f"python -m dflash_ext: {e}")
    prompts = [_chat_ids(tok, p) for p in args.prompts_file or [args.prompt]]
    if args.prompts_file:  # refused before any timing or decoding
        _check_prompts_file(args, model, len(prompts))
    args.drafter = _drafter_path(args)
    load_drafter = lambda dt: DFlashDrafter.from_pretrained(args.drafter, device=args.device, dtype=dt)
    report = {}
    # --dtype auto and --baseline time the first prompt
    chosen = demo.choose_dtype(args, model, prompts[0], load_drafter, report, where, one_prompt=not args.prompts_file)
    drafter = _drafter(args, chosen, load_drafter)
    cache_rows = _static_cache_rows(args, chosen.model, prompts[0], drafter)
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if args.prompts_file:
        demo.demo_prompts_file(args, tok, drafter, prompts, stops, chosen, report)
    else:
        demo.demo_one_prompt(args, tok, drafter, prompts[0], stops, chosen, report, where, cache_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _check_tree_budget(args) -> None:
    """--tree-budget's usage errors, before any work, and the verify rule: --verify's, else
    match with a tree (its rule), rejection without."""
    if not args.tree_budget:
        args.verify = args.verify or DEFAULT_VERIFY
        return
    for wrong, why in ((args.prompts_file, "--prompts-file: a tree decodes one prompt (batches verify chains)"),
                       (args.static_cache, "--static-cache: a tree is verified over the dynamic cache"),
                       (args.block_size == "auto", "--block-size auto times chains: give the tree's depth + 1 "
                                                   "(--block-size N)"),
                       (args.verify == "rejection", "--verify rejection: a tree is verified by the match rule")):
        if wrong:
            raise UsageError(f"argument --tree-budget: {why}")
    args.verify = "match"


def _chat_ids(tok, prompt: str) -> list:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]


def _check_prompts_file(args, model, count: int) -> None:
    """Usage errors of --prompts-file, found before any timing or decoding: --static-cache (it decodes
    one prompt), and batches on a target whose cache a batch cannot hold (sliding windows, linear
    attention), whose prompts --batch-size 1 decodes one at a time as single prompts."""
    from ..decode.batch import check_batchable

    if args.static_cache:
        raise UsageError("argument --static-cache: it decodes one prompt; --prompts-file decodes batches on the "
                         "dynamic cache")
    if min(args.batch_size, count) > 1:  # a batch of one is the one-prompt loop, which every target runs
        try:
            check_batchable(model)
        except NotImplementedError as e:
            raise UsageError(f"argument --batch-size: {e}, which --batch-size 1 does") from None


def _drafter_path(args):
    """--drafter, else for the embedded target (unless --fresh-drafter) the drafter shipped in the package."""
    from ..model.pretrained import default_drafter_path

    if args.drafter is not None or args.target is not None or args.fresh_drafter:
        return args.drafter
    shipped = default_drafter_path()
    if os.path.exists(os.path.join(shipped, "config.json")):
        return shipped
    print(f"[dflash_ext] the shipped drafter is missing ({shipped}): a broken install?", file=sys.stderr)
    return None


def _drafter(args, chosen, load_drafter):
    """The drafter in DFlash's dtype (--drafter's, loaded here unless the dtype race did; else a fresh one),
    after the line that names the target and it."""
    from ..model.drafter import DFlashDrafter

    if args.drafter:
        drafter = chosen.drafter
        if drafter is None:  # else loaded in DFlash's dtype by the race
            drafter = load_drafter(chosen.dtype)
            check_drafter_fits(drafter, chosen.model.config)
        note = f"drafter: {args.drafter}"
    else:
        # a drafter's block is >= 2; at --block-size 1 it drafts nothing anyway
        fresh_block = args.block_size if isinstance(args.block_size, int) and args.block_size >= 2 else 16
        drafter = DFlashDrafter.from_target(chosen.model.config, num_layers=args.draft_layers,
                                            block_size=fresh_block).to(args.device, chosen.dtype)
        note = ("drafter: freshly initialised (untrained; it accepts almost nothing, tau ~ 1: "
                "pass --drafter DIR for a trained one)")
    print(f"[dflash_ext] target: {args.target or 'SmolLM2-135M-Instruct (embedded default)'}; {note}",
          file=sys.stderr)
    return drafter


def _static_cache_rows(args, model, ids, drafter):
    """--static-cache: its rows (the prompt, the budget and one trained block of drafts), after a
    target whose static cache cannot be rolled back is refused (before decoding); else None."""
    if not args.static_cache:
        return None
    rows = len(ids) + args.max_new_tokens + drafter.config.block_size
    _check_static_cache(model, rows)
    return rows


def _check_static_cache(model, max_cache_len: int) -> None:
    """Usage error naming --static-cache where the loop could not roll the target's static
    cache back (sliding windows that can fill), naming --max-new-tokens where the cache would
    not fit in memory: transformers allocates a cache's layers on their first update, so
    this probe costs nothing."""
    from ..decode.rollback import CacheRollback
    from ..decode.runner import make_static_cache

    try:
        CacheRollback(make_static_cache(model, max_cache_len), 1)
    except NotImplementedError as e:
        raise UsageError(f"argument --static-cache: {e}") from None
    except ValueError as e:
        raise UsageError(f"argument --max-new-tokens: with --static-cache, {e}") from None


def cmd_info(args):
    from ..diagnostics import format_info, info

    report = info()
    print(json.dumps(report, indent=2) if args.json else format_info(report))
