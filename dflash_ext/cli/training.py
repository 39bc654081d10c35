"""The training commands: ``gen-data`` (the target's responses and features), ``train``
(its run config checked before the target loads: :func:`train_run_config`), ``eval``
(held-out tau) and ``export`` (a checkpoint in another dtype, a draft vocabulary)."""
import json
import os
import sys
import time

import torch

from .args import UsageError, _check_drafter_fits, _check_layer_ids, _data_records, _is_nonempty_dir, \
    _target_layer_count


def train_run_config(args):
    """The TrainConfig of `train`'s arguments (a resumed run: the saved one's, with the flags
    given checked against it), and what it means for the data, checked before the target loads."""
    import dataclasses

    from ..training.data import FeatureStore
    from ..training.trainer import TrainConfig, run_config, trainable

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


def resolve_dtype(name: str, device) -> torch.dtype:
    """--dtype of gen-data (batched generation): auto = bf16 on CUDA and on CPUs with bf16 units."""
    from ..hardware import fastest_dtype

    return fastest_dtype(device) if name == "auto" else getattr(torch, name)


def cmd_gen_data(args):
    from ..config import default_target_layer_ids
    from ..hardware import cpu_description
    from ..models import load_target
    from ..prompts import TRAINING_SOURCES, training_prompts
    from ..training.data import compute_features, generate_responses, load_records, write_meta

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

    from ..models import load_target
    from ..training.trainer import train

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
    from ..drafter import DFlashDrafter
    from ..models import load_target
    from ..training.data import drop_trained_prompts, split_holdout
    from ..training.trainer import TrainConfig, evaluate_drafter

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
    from ..drafter import DFlashDrafter
    from ..training.data import split_holdout
    from ..training.trainer import most_frequent_tokens

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
