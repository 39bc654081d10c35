"""The training commands: ``gen-data`` (the target's responses and features), ``train``
(its run config checked before the target loads: :func:`train_run_config`), ``eval``
(held-out tau) and ``export`` (a checkpoint in another dtype, a draft vocabulary)."""
import json
import os
import sys
import time

import torch

from .args import UsageError, check_drafter_fits, check_layer_ids, data_records, drafter_config, is_nonempty_dir, \
    read_target_config, target_layer_count


def train_run_config(args):
    """The TrainConfig of `train`'s arguments (a resumed run: the saved one's, with the flags
    given checked against it), and what it means for the data, checked before the target loads."""
    import dataclasses

    from ..training.data import FeatureStore
    from ..training.train_config import TrainConfig, run_config
    from ..training.trainer import trainable

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:  # only the flags given (not None): a resumed run takes the saved run's value of the others
        cfg, resume = run_config({k: v for k, v in vars(args).items() if k in fields and v is not None})
    except ValueError as e:  # the message names the flag (--out, or the flag that differs from the saved run)
        raise UsageError(str(e)) from None
    records = data_records("--data", cfg.data)
    if not any(trainable(r, cfg.max_len) for r in records):
        raise UsageError(f"argument --max-len: cut to {cfg.max_len} tokens, no record of {cfg.data} keeps two "
                         f"response tokens to train on")
    if cfg.holdout >= len(records) and not cfg.extra_data:  # the --extra-data records are training ones
        raise UsageError(f"argument --holdout: holding out {cfg.holdout} of the {len(records)} records of "
                         f"{cfg.data} leaves none to train on")
    for folder in cfg.extra_data:
        data_records("--extra-data", folder)
    if cfg.eval_every and not cfg.holdout:  # the trainer would skip every measurement
        raise UsageError("argument --eval-every: measures tau on held-out records, and --holdout holds none out")
    if cfg.layer_ids:
        check_layer_ids(cfg.layer_ids, target_layer_count(args.target))
    _check_drafter_settings(args, cfg, resume)
    cached = cfg.features == "cached" or (cfg.features == "auto" and len(FeatureStore(cfg.data)))
    if cfg.extra_data and cached:
        raise UsageError("argument --extra-data: needs --features live (the feature cache of --data is per "
                         "folder and would be used)")
    if cfg.distill and cached:
        raise UsageError("argument --distill: needs --features live (the target's logits come from its live pass; "
                         "the feature cache of --data would be used)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.batch_size % world:
        raise UsageError(f"argument --batch-size: {cfg.batch_size} is not a multiple of the {world} processes")
    return cfg


def _check_drafter_settings(args, cfg, resume: bool) -> None:
    """What the drafter a run trains must fit, checked from the configs before anything loads:
    a continued drafter (--init DIR) reads the run's target layers and takes its block size;
    the selector flags apply to a DFlash2 run only, one continuing a DFlash2 drafter keeps its
    selector, and the selector's K candidates fit the vocabulary and the loss vocabulary."""
    import dataclasses

    from ..training.train_config import run_layer_ids

    init = None if resume or cfg.init in ("random", "target") else drafter_config("--init", cfg.init)
    if init is not None:
        if cfg.num_layers is not None and cfg.num_layers < init.num_hidden_layers:
            raise UsageError(f"argument --num-layers: --init {cfg.init} has {init.num_hidden_layers} layers; a "
                             f"continuation can add layers, not drop them, got {cfg.num_layers}")
        layers = run_layer_ids(cfg, target_layer_count(args.target))
        if list(init.target_layer_ids) != list(layers):
            source = "--layer-ids" if cfg.layer_ids else "the data's meta.json or the default rule"
            raise UsageError(f"argument --init: {cfg.init} reads target layers {list(init.target_layer_ids)}, the "
                             f"run reads {list(layers)} ({source})")
        try:
            dataclasses.replace(init, block_size=cfg.block_size)
        except ValueError as e:
            raise UsageError(f"argument --block-size: {cfg.block_size} does not fit --init {cfg.init}: {e}") from None
    dflash2 = cfg.dflash2 or (init is not None and init.is_dflash2)
    given = [f for f in ("selector_rank", "selector_top_k", "selector_alpha") if getattr(args, f, None) is not None]
    if given and not dflash2 and not resume:
        raise UsageError(f"argument --{given[0].replace('_', '-')}: a DFlash2 setting; this run trains DFlash "
                         f"(v1): pass --dflash2, or --init a DFlash2 drafter")
    if not dflash2:
        return
    if init is not None and init.is_dflash2:
        for field in ("selector_rank", "selector_top_k"):
            if getattr(args, field, None) not in (None, getattr(init, field)):
                raise UsageError(f"argument --{field.replace('_', '-')}: --init {cfg.init} is a DFlash2 drafter "
                                 f"with {field} {getattr(init, field)}, which a continuation keeps; got "
                                 f"{getattr(args, field)}")
    k = init.selector_top_k if init is not None and init.is_dflash2 else cfg.selector_top_k
    vocab = read_target_config(args.target).vocab_size
    if k > vocab:
        raise UsageError(f"argument --selector-top-k: the target's vocabulary has {vocab} tokens, got {k}")
    if cfg.loss_vocab and cfg.loss_vocab < k:
        raise UsageError(f"argument --loss-vocab: DFlash2's selector picks K = {k} candidates among the draft "
                         f"vocabulary, so it needs at least {k} tokens (or 0: all), got {cfg.loss_vocab}")


def resolve_dtype(name: str, device) -> torch.dtype:
    """--dtype of gen-data (batched generation): auto = bf16 on CUDA and on CPUs with bf16 units."""
    from ..ops.hardware import fastest_dtype

    return fastest_dtype(device) if name == "auto" else getattr(torch, name)


def cmd_gen_data(args):
    from ..model.config import default_target_layer_ids
    from ..model.pretrained import load_target
    from ..ops.hardware import cpu_description
    from ..prompts import TRAINING_SOURCES, training_prompts
    from ..training.data import compute_features, generate_responses, load_records, write_meta

    torch.set_num_threads(args.threads)
    source = training_prompts(args.prompts)
    if args.offset >= len(source):
        raise UsageError(f"argument --offset: {args.prompts} has {len(source)} prompts, got offset {args.offset}")
    prompts = source[args.offset:args.offset + args.n]
    num_layers = target_layer_count(args.target)  # the features would fail only after every response
    if not args.layer_ids and args.num_features > num_layers:
        raise UsageError(f"argument --num-features: the target has {num_layers} layers, got {args.num_features}")
    check_layer_ids(args.layer_ids, num_layers)
    layer_ids = args.layer_ids or default_target_layer_ids(num_layers, args.num_features)
    dtype = resolve_dtype(args.dtype, "cpu")  # generation in the fastest dtype this CPU has
    model, tok = load_target(args.target, dtype=dtype)
    id_base = TRAINING_SOURCES[args.prompts][1] + args.offset
    before = len(load_records(args.out)) if os.path.isdir(args.out) else 0
    start = time.perf_counter()
    n, too_long = generate_responses(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                     max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                                     id_base=id_base)
    seconds = time.perf_counter() - start
    if too_long:
        shown = ", ".join(str(i - id_base + args.offset) for i in too_long[:10]) + (", ..." if len(too_long) > 10 else "")
        print(f"[dflash_ext] skipped {len(too_long)} of {len(prompts)} prompts of {args.prompts} longer than "
              f"--max-prompt-tokens {args.max_prompt_tokens} tokens (their indices: {shown})", file=sys.stderr)
    if n == 0:
        raise UsageError(f"argument --max-prompt-tokens: every one of the {len(prompts)} prompts is longer than "
                         f"{args.max_prompt_tokens} tokens: no record was written to {args.out}")
    records = load_records(args.out)
    if not args.no_features:
        compute_features(model, args.out, layer_ids)
    meta = {"target": args.target or "SmolLM2-135M-Instruct (embedded default)", "records": n,
            "dtype": str(dtype).replace("torch.", ""), "target_layer_ids": layer_ids,
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "batch_size": args.batch_size, "prompts": f"{args.prompts}: its prompts {args.offset} .. "
                                                     f"{args.offset + len(prompts) - 1} (record ids from {id_base})",
            "response_tokens": sum(len(r["input_ids"]) - r["response_start"] for r in records),
            "this_run": {"responses": n - before, "skipped_too_long": len(too_long), "seconds": round(seconds, 1),
                         "responses_per_hour": round((n - before) * 3600 / seconds) if seconds else None,
                         "cpu": cpu_description()}}
    write_meta(args.out, meta)
    print(f"[dflash_ext] {n} records in {args.out} ({n - before} new in {seconds:.0f} s)"
          + ("" if args.no_features else ", with features"), file=sys.stderr)


def cmd_train(args):
    import torch.distributed as dist

    from ..model.pretrained import load_target
    from ..training.trainer import train

    cfg = train_run_config(args)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by torchrun
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    target, _ = load_target(args.target, device=args.device, tokenizer=False)
    try:
        train(cfg, target, device=args.device, log=lambda m: print(m, file=sys.stderr, flush=True))
    except FloatingPointError as e:  # a diverged run: stopped, its last good checkpoint kept
        raise SystemExit(f"python -m dflash_ext train: {e}") from None
    if world > 1:
        dist.destroy_process_group()


def cmd_eval(args):
    from ..model.checkpoint import ACCEPTANCE_NAME, write_acceptance
    from ..model.drafter import DFlashDrafter
    from ..model.pretrained import load_target
    from ..training.data import drop_trained_prompts, split_holdout
    from ..training.train_config import TrainConfig
    from ..training.trainer import evaluate_drafter

    if args.save_acceptance and args.eval_stride != 1:  # a profile without the walk would drop a saved walk
        raise UsageError(f"argument --save-acceptance: the loop's walk is measured at --eval-stride 1 only, got "
                         f"--eval-stride {args.eval_stride}")
    torch.set_num_threads(args.threads)
    _, heldout = split_holdout(data_records("--data", args.data), args.holdout)
    for folder in args.extra_data or []:
        heldout = drop_trained_prompts(heldout, data_records("--extra-data", folder))
    if not heldout:
        raise UsageError(f"argument --holdout: the {args.holdout} highest-id records of {args.data} all have a "
                         "training record's prompt: none is left to measure tau on (a larger --holdout holds out more)")
    target, _ = load_target(args.target, tokenizer=False)
    drafter = DFlashDrafter.from_pretrained(args.drafter)
    check_drafter_fits(drafter, target.config)
    stride = {} if args.eval_stride is None else {"eval_stride": args.eval_stride}  # None: TrainConfig's
    cfg = TrainConfig(data=args.data, out="", block_size=drafter.config.block_size, holdout=args.holdout,
                      extra_data=args.extra_data or [], features="live" if args.extra_data else "auto", **stride)
    held = evaluate_drafter(drafter, target, cfg)
    print(json.dumps({"drafter": args.drafter, "data": args.data, "extra_data": args.extra_data,
                      "holdout": args.holdout, "eval_stride": cfg.eval_stride, **held._asdict()}))
    if args.save_acceptance:
        write_acceptance(args.drafter, held.accept, held.walked_tau)
        print(f"[dflash_ext] wrote {os.path.join(args.drafter, ACCEPTANCE_NAME)}", file=sys.stderr)


def cmd_export(args):
    from ..model.drafter import DFlashDrafter
    from ..training.data import split_holdout
    from ..training.loss import most_frequent_tokens

    # Everything checked before anything is written.
    if is_nonempty_dir(args.dst) and not args.overwrite:
        raise UsageError(f"argument --dst: {args.dst} exists and is not empty; --overwrite replaces its checkpoint")
    if args.data is not None and not args.draft_vocab:
        raise UsageError("argument --data: only --draft-vocab K > 0 reads it")
    if args.target is not None and args.engine != "vllm":
        raise UsageError("argument --target: only --for vllm reads it (the LM head rows of the draft vocabulary)")
    if args.draft_vocab:
        if args.data is None:
            raise UsageError("argument --draft-vocab: K > 0 needs --data (the training data folder whose "
                             "response tokens are counted)")
        src = drafter_config("--src", args.src)
        if args.draft_vocab > src.vocab_size:
            raise UsageError(f"argument --draft-vocab: {args.src} has a vocabulary of {src.vocab_size} "
                             f"tokens, got K = {args.draft_vocab}")
        if src.is_dflash2 and args.draft_vocab < src.selector_top_k:
            raise UsageError(f"argument --draft-vocab: {args.src} is a DFlash2 drafter whose selector picks "
                             f"{src.selector_top_k} candidates among the draft vocabulary, got K = {args.draft_vocab}")
        all_records = data_records("--data", args.data)
        records, _ = split_holdout(all_records, args.holdout)
        if not records:  # counting nothing would pick token ids 0..K-1
            raise UsageError(f"argument --holdout: holding out {args.holdout} of the {len(all_records)} records "
                             f"of {args.data} leaves none to count tokens on")
    drafter = DFlashDrafter.from_pretrained(args.src)
    if args.draft_vocab == 0:
        drafter.set_draft_vocab(None)
    elif args.draft_vocab is not None:
        ids, coverage = most_frequent_tokens(records, drafter.config.vocab_size, args.draft_vocab)
        drafter.set_draft_vocab(ids)
        print(f"[dflash_ext] draft vocabulary: {ids.numel()} tokens, {100 * coverage:.2f} % of the response "
              f"tokens of {len(records)} records", file=sys.stderr)
    if args.engine == "vllm":
        _save_for_vllm(drafter, args)
    else:
        drafter.save_pretrained(args.dst, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    print(f"[dflash_ext] wrote {args.dst} ({args.dtype}{', for vLLM' if args.engine == 'vllm' else ''})",
          file=sys.stderr)


def _save_for_vllm(drafter, args) -> None:
    """export --for vllm: the drafter plus vLLM's form of its draft vocabulary, whose LM head
    rows come from --target (loaded in its own dtype: the rows are written as it stores them)."""
    from ..model.pretrained import load_target
    from ..model.vllm_format import save_for_vllm

    head = None
    if drafter.draft_vocab is not None:
        target, _ = load_target(args.target, dtype="auto", tokenizer=False)
        try:
            drafter.check_fits(target.config)
        except ValueError as e:
            raise UsageError(f"argument --target: {e}") from None
        head = target.get_output_embeddings().weight
    save_for_vllm(drafter, args.dst, head, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
