"""Training loop: AdamW, cosine schedule with warm-up, gradient clipping, checkpoint +
resume, a held-out tau measured during training, and data parallelism over processes
(DDP; gloo on CPU, NCCL on GPU).

The embedding and LM head are the target's: frozen, used under no_grad / without weight
gradients, and never saved (the drafter checkpoint holds only drafter weights).

Target features come from the data folder's feature cache (``features="cached"``) or
from a target forward per sequence (``features="live"``): for a 135M target that costs
about what the drafter's own LM head costs, and needs no 5.6 KiB/token of disk.

Determinism across process counts: the sequence order of every epoch and the anchors of
every (epoch, record) come from seeded generators that do not depend on the rank, and
each optimizer step normalises the loss by the summed label weights of one global batch
(every rank computes that sum from the anchors alone), so a run on N processes follows
the one-process run with the same global batch.

The run's settings and resume rules (TrainConfig, run_config) are
:mod:`dflash_ext.training.train_config`'s and the loss :mod:`dflash_ext.training.loss`'s,
all importable from here too.
"""
import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from dataclasses import asdict
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.config import target_text_config
from ..model.drafter import DFlashDrafter
from ..model.pretrained import cast_target
from ..ops.hardware import fastest_dtype
from .data import FeatureStore, drop_trained_prompts, load_records, split_holdout, target_pass
from .loss import (FrozenTargetParts, LossVocab, block_logits, drafted_tokens, label_weights, most_frequent_tokens,
                   output_rows, sampled_acceptance, sequence_loss, tau_of, walked_acceptance)
from .recipe import IGNORE, block_labels, default_gamma, sample_anchors
from .train_config import EVAL_LOG, FRESH_LAYERS, STATE_NAME, TrainConfig, run_config, run_layer_ids

__all__ = ["TrainConfig", "train", "run_config", "evaluate_drafter", "HeldOut", "sequence_loss", "LossVocab", "tau_of",
           "init_layers_from_target", "most_frequent_tokens"]


def init_layers_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the drafter's N layers from the target's last N decoder layers (same widths;
    the Qwen3 q/k norms start as identity) and its final norm from the target's, so the
    drafter starts as a language model whose output the frozen LM head already reads; its
    feature projection `fc` starts as the identity on the deepest target layer it reads
    (the context the copied layers see is that layer's hidden states, normed)."""
    decoder = target.get_decoder()  # composite models keep the text decoder a level deeper
    src = decoder.layers[-len(drafter.layers):]
    H, deepest = drafter.config.hidden_size, max(range(len(drafter.config.target_layer_ids)),
                                                 key=lambda i: drafter.config.target_layer_ids[i])
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, src):
            own = mine.state_dict()
            for name, t in theirs.state_dict().items():
                if name in own and own[name].shape == t.shape:
                    own[name].copy_(t)
        drafter.norm.weight.copy_(decoder.norm.weight)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, deepest * H:(deepest + 1) * H] = torch.eye(H)


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Features:
    """Target features per record: from the cache, or a target forward (live)."""

    def __init__(self, cfg: TrainConfig, target, layer_ids, device, dtype):
        store = FeatureStore(cfg.data)
        mode = cfg.features if cfg.features != "auto" else ("cached" if len(store) else "live")
        if mode not in ("cached", "live"):
            raise ValueError(f"features must be cached, live or auto, got {cfg.features!r}")
        self.store = store if mode == "cached" else None
        self.target, self.layer_ids, self.device, self.dtype = target, layer_ids, device, dtype
        self.mode = mode

    def usable(self, rec) -> bool:
        return self.store is None or rec["id"] in self.store

    def __call__(self, rec, ids: torch.Tensor) -> torch.Tensor:
        return self.with_final(rec, ids, final=False)[0]

    def with_final(self, rec, ids: torch.Tensor, final: bool = True):
        """(features, the target's final hidden states [S, H] or None): the final hidden states
        need a live target pass (distillation reads the target's logits from them)."""
        if self.store is not None:
            if final:
                raise ValueError("distillation needs live features (features='live'): the feature cache "
                                 "holds no final hidden states")
            return self.store.get(rec["id"])[:ids.numel()].to(self.device, self.dtype), None
        feats, last = target_pass(self.target, ids, self.layer_ids)
        return feats.to(self.dtype), (last if final else None)  # fp32 residual stream


def _anchors(cfg: TrainConfig, rec, seq_len: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((cfg.seed, epoch, rec["id"])) % (2 ** 62))
    return sample_anchors(rec["response_start"], seq_len, cfg.block_size, cfg.anchors, g)


class HeldOut(NamedTuple):
    """A drafter's acceptance on held-out records (:func:`heldout_tau`)."""
    tau: float                 # 1 + mean accepted prefix of greedy drafts against the target's greedy tokens
    accept: List[float]        # per slot: the share of blocks whose first j drafts are all accepted
    tau_t1: Optional[float]    # the same, expected, under rejection sampling at temperature 1 (None: not measured)
    accept_t1: Optional[List[float]]
    # tokens per step as the decoding loop walks the records (walked_acceptance; eval_stride 1 only)
    tau_walked: Optional[float] = None
    walked_tau: Optional[List[float]] = None  # the same at verify B = 2..block_size (the last is tau_walked)


@torch.no_grad()
def heldout_tau(drafter, frozen, records, features, cfg: TrainConfig, device, gamma: float, autocast: bool,
                vocab=None) -> HeldOut:
    """Acceptance on held-out records with fixed anchors (every eval_stride-th response
    position): greedy (tau, per-slot accepted-prefix rate) and, for a DFlash (v1) drafter with
    live features, the expectation of the same under rejection sampling at temperature 1
    (each slot accepted with probability sum_x min(p, q), teacher-forced:
    :func:`~dflash_ext.training.loss.sampled_acceptance`). At eval_stride 1, also greedy tau
    at the anchors the decoding loop would draft from (:func:`~dflash_ext.training.loss.walked_acceptance`),
    at each verify B = 2..block_size (the loop at a smaller B verifies the first B - 1 drafts of
    the same block, and so walks other anchors)."""
    was_training = drafter.training
    drafter.eval()
    sampled = features.store is None and not drafter.config.is_dflash2
    rows, rows_t1 = [], []
    walked = {b: [] for b in range(2, cfg.block_size + 1)}
    for rec in records:
        ids = torch.tensor(rec["input_ids"][:cfg.max_len], device=device)
        anchors = torch.arange(rec["response_start"], ids.numel() - 1, cfg.eval_stride, device=device)
        if anchors.numel() == 0:
            continue
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            feats, final = features.with_final(rec, ids, final=sampled)
            out = block_logits(drafter, frozen, ids, feats, anchors, cfg.block_size, vocab)
            rows.append((drafted_tokens(drafter, out, vocab) == out.labels).cpu())
            if cfg.eval_stride == 1:
                for b, steps in walked.items():
                    steps += walked_acceptance(rows[-1][:, :b - 1])
            if sampled:
                log_p = F.linear(final, frozen.lm_head.weight).float().log_softmax(-1)
                if vocab is not None:
                    log_p = log_p[:, vocab.ids]
                rows_t1.append(sampled_acceptance(out, log_p, anchors).cpu())
    drafter.train(was_training)
    correct = torch.cat(rows)
    greedy = (tau_of(correct), torch.cumprod(correct.float(), -1).mean(0).tolist())
    walked_tau = [1 + sum(steps) / len(steps) for steps in walked.values()] if cfg.eval_stride == 1 else None
    walks = (walked_tau[-1], walked_tau) if walked_tau else (None, None)
    if not sampled:
        return HeldOut(*greedy, None, None, *walks)
    alpha = torch.cat(rows_t1)
    return HeldOut(*greedy, tau_of(alpha), torch.cumprod(alpha, -1).mean(0).tolist(), *walks)


def trainable(record, max_len: int) -> bool:
    """Whether a record cut to `max_len` tokens still has an anchor with a label (two
    response tokens)."""
    return min(len(record["input_ids"]), max_len) - record["response_start"] >= 2


def _split_records(cfg: TrainConfig, features: "_Features"):
    """(training records, held-out records): the `holdout` highest ids of `cfg.data` are
    held out (so the held-out set stays the same whatever `cfg.extra_data` adds), less any
    whose prompt is a training record's, and the records of the `cfg.extra_data` folders
    are training records."""
    def usable(folder):
        return [r for r in load_records(folder) if features.usable(r) and trainable(r, cfg.max_len)]

    records, heldout = split_holdout(usable(cfg.data), cfg.holdout)
    if cfg.extra_data and features.store is not None:
        raise ValueError("extra_data needs live features (features='live'): the feature cache is per folder")
    seen = {r["id"] for r in records + heldout}
    extras = []
    for folder in cfg.extra_data:
        extra = usable(folder)
        clash = seen & {r["id"] for r in extra}
        if clash:
            raise ValueError(f"extra_data folder {folder} repeats record ids of the folders before it "
                             f"(e.g. {min(clash)}): generate each prompt source with its own id base")
        seen |= {r["id"] for r in extra}
        extras += extra
    # split_holdout already dropped the twins of cfg.data's own training records
    return records + extras, drop_trained_prompts(heldout, extras)


def evaluate_drafter(drafter: DFlashDrafter, target, cfg: TrainConfig, device="cpu"):
    """The held-out acceptance of any drafter on the records a training run with `cfg` holds
    out (same anchors, same features): :class:`HeldOut`."""
    use_autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and fastest_dtype(device) == torch.bfloat16)
    if use_autocast:
        target = cast_target(target, torch.bfloat16)
    cfg = TrainConfig(**{**asdict(cfg), "layer_ids": list(drafter.config.target_layer_ids)})
    features = _Features(cfg, target, cfg.layer_ids, device, torch.float32)
    _, heldout = _split_records(cfg, features)
    if not heldout:
        raise ValueError("evaluate_drafter needs cfg.holdout > 0 records")
    frozen = FrozenTargetParts(target).to(device)
    vocab = None if drafter.draft_vocab is None else LossVocab(drafter.draft_vocab, frozen.lm_head.weight)
    return heldout_tau(drafter.float().to(device), frozen, heldout, features, cfg, device,
                       cfg.gamma or default_gamma(cfg.block_size), use_autocast, vocab)


def train(cfg: TrainConfig, target, device="cpu", drafter: Optional[DFlashDrafter] = None,
          log=print) -> DFlashDrafter:
    """Train a drafter into `cfg.out`, or resume the run saved there (see :func:`run_config`:
    fields that are None take the saved run's values, others must match it)."""
    cfg, resume = run_config(asdict(cfg))
    rank, world = _dist_info()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {world} processes")
    local_batch = cfg.batch_size // world
    dev_type = torch.device(device).type
    use_autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and fastest_dtype(device) == torch.bfloat16)
    layer_ids = run_layer_ids(cfg, target_text_config(target.config).num_hidden_layers)
    if use_autocast:  # live features and the frozen parts on bf16 weights (a copy: the caller's stays)
        target = cast_target(target, torch.bfloat16)
    features = _Features(cfg, target, layer_ids, device, torch.float32)
    if not 0 <= cfg.distill <= 1:
        raise ValueError(f"distill must be in [0, 1], got {cfg.distill!r}")
    if cfg.distill and features.store is not None:
        raise ValueError("distill > 0 needs live features (features='live'): the feature cache holds no "
                         "final hidden states to read the target's logits from")
    records, heldout = _split_records(cfg, features)
    if not records:
        raise ValueError(f"no usable training records in {cfg.data}")
    gamma = cfg.gamma or default_gamma(cfg.block_size)

    state_path = os.path.join(cfg.out, STATE_NAME)
    eval_lines: List[str] = []  # EVAL_LOG, rewritten by every save
    if resume:
        if os.path.exists(os.path.join(cfg.out, EVAL_LOG)):
            with open(os.path.join(cfg.out, EVAL_LOG)) as f:
                eval_lines = f.readlines()
        drafter = DFlashDrafter.from_pretrained(cfg.out, dtype=torch.float32)
    elif drafter is None:
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter.from_target(target.config, num_layers=cfg.num_layers or FRESH_LAYERS,
                                            block_size=cfg.block_size,
                                            target_layer_ids=layer_ids, seed=cfg.seed)
        if cfg.init == "target":
            init_layers_from_target(drafter, target)
        elif os.path.isdir(cfg.init):  # continue from committed weights (a fresh optimizer)
            drafter = DFlashDrafter.from_pretrained(cfg.init, dtype=torch.float32)
            if list(drafter.config.target_layer_ids) != list(layer_ids):
                raise ValueError(f"--init {cfg.init} reads target layers {drafter.config.target_layer_ids}, "
                                 f"the run {layer_ids}")
            have = drafter.config.num_hidden_layers
            if cfg.num_layers is not None and cfg.num_layers != have:
                if cfg.num_layers < have:
                    raise ValueError(f"num_layers={cfg.num_layers} is fewer than the {have} layers of --init "
                                     f"{cfg.init}: a continuation can add layers, not drop them")
                drafter.add_layers(cfg.num_layers - have)  # zero-output layers: the drafter starts unchanged
            # The layers do not depend on B, so a run may retarget a drafter to another block size.
            if drafter.config.block_size != cfg.block_size:
                dataclasses.replace(drafter.config, block_size=cfg.block_size)  # the config's own checks
                drafter.config.block_size = cfg.block_size  # in place: the layers share the object
                drafter.acceptance_profile = drafter.walked_tau = None  # measured at the old B; the first eval remeasures it
        elif cfg.init != "random":
            raise ValueError(f"init must be random, target or a drafter folder, got {cfg.init!r}")
        if cfg.dflash2 and not drafter.config.is_dflash2:  # drafts exactly as the v1 drafter at step 0
            drafter = DFlashDrafter.dflash2_from(drafter, selector_rank=cfg.selector_rank,
                                                 selector_top_k=cfg.selector_top_k, seed=cfg.seed)
    drafter.to(device).train()
    if drafter.config.is_dflash2 and not cfg.selector_alpha:  # no selector loss: the selector stays as it is
        drafter.candidate_selector.requires_grad_(False)
    frozen = FrozenTargetParts(target).to(device)
    vocab, coverage = None, 1.0
    if cfg.loss_vocab:
        ids, coverage = most_frequent_tokens(records, drafter.config.vocab_size, cfg.loss_vocab)
        vocab = LossVocab(ids, frozen.lm_head.weight)
        drafter.set_draft_vocab(ids)
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(drafter)

    steps_per_epoch = len(records) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(records)} training records do not fill one batch of {cfg.batch_size}")
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    step, seen_slots = 0, 0
    if resume:
        st = torch.load(state_path, weights_only=False)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, seen_slots = st["step"], st.get("slot_tokens", 0)
        # a folder of an older version appended evaluations between saves: none past the saved step
        eval_lines = [line for line in eval_lines if line.strip() and json.loads(line)["step"] <= step]
        log(f"[train] resumed at step {step}/{total}")
    log(f"[train] {len(records)} training records, {len(heldout)} held out; features {features.mode}; "
        f"bf16 autocast {'on' if use_autocast else 'off'}; {total} steps"
        + (f"; loss and draft vocabulary {vocab.ids.numel()} tokens ({100 * coverage:.2f} % of response tokens)"
           if vocab else ""))

    saved_step = step if resume else None  # the step of the checkpoint in cfg.out

    def save():
        nonlocal saved_step
        if rank != 0:
            return
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
                 "slot_tokens": seen_slots, "config": asdict(cfg)}
        extra = {STATE_NAME: lambda path: torch.save(state, path)}
        if eval_lines:
            extra[EVAL_LOG] = "".join(eval_lines).encode()
        # One swap for the checkpoint and the trainer's files: a kill leaves a resumable run. The
        # folder was checked by run_config (a saved run, or replaced on purpose): it goes as a whole.
        drafter.save_pretrained(cfg.out, extra_files=extra, overwrite=True)
        saved_step = step

    def evaluate():
        if rank != 0 or not heldout:
            return
        t = time.time()
        held = heldout_tau(drafter, frozen, heldout, features, cfg, device, gamma, use_autocast, vocab)
        # saved beside the checkpoint: block_size="auto" reads them (walked_tau: None but at eval_stride 1)
        drafter.acceptance_profile, drafter.walked_tau = held.accept, held.walked_tau
        eval_lines.append(json.dumps({"step": step, "slot_tokens": seen_slots, **held._asdict()}) + "\n")
        log(f"[eval] step {step} slot-tokens {seen_slots} held-out tau {held.tau:.3f}"
            + (f", at T=1 by rejection sampling {held.tau_t1:.3f}" if held.tau_t1 is not None else "")
            + (f", as the loop walks {held.tau_walked:.3f}" if held.tau_walked is not None else "")
            + f" ({time.time() - t:.0f}s)")

    t0, window_slots, window_loss, window_steps = time.time(), 0, 0.0, 0
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        batch = [records[i] for i in order[in_epoch * cfg.batch_size:(in_epoch + 1) * cfg.batch_size].tolist()]
        # Anchors of the whole global batch first: its label-weight sum normalises every rank's loss.
        plan = []
        for rec in batch:
            S = min(len(rec["input_ids"]), cfg.max_len)
            ids = torch.tensor(rec["input_ids"][:S])
            anchors = _anchors(cfg, rec, S, epoch)
            plan.append((rec, ids, anchors))
        total_w = sum(label_weights(block_labels(ids, a, cfg.block_size), gamma).sum().item()
                      for _, ids, a in plan if a.numel())
        mine = [p for p in plan[rank * local_batch:(rank + 1) * local_batch] if p[2].numel()]
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (rec, ids, anchors) in enumerate(mine):
            ids, anchors = ids.to(device), anchors.to(device)
            last = i == len(mine) - 1
            sync = model.no_sync() if (world > 1 and not last) else contextlib.nullcontext()
            with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=use_autocast):
                with torch.no_grad():
                    feats, final = features.with_final(rec, ids, final=cfg.distill > 0)
                    teacher = None if final is None else F.linear(final, output_rows(frozen, vocab))
                with sync:
                    loss, _, _ = sequence_loss(model, frozen, ids, feats, anchors, cfg.block_size, gamma, vocab,
                                               need_correct=False, selector_alpha=cfg.selector_alpha,
                                               teacher_logits=teacher, distill=cfg.distill)
                    (loss / total_w).backward()
            loss_sum += loss.item()
            n_slots = int((block_labels(ids, anchors, cfg.block_size) != IGNORE).sum())
            seen_slots += n_slots * world
            window_slots += n_slots
        grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
        if not math.isfinite(grad_norm):  # the same on every rank (all-reduced); the weights stay finite
            raise FloatingPointError(
                f"step {step + 1}: the loss or its gradient is not finite (loss {loss_sum:.4g}, gradient norm "
                f"{grad_norm}): the run stopped before this update; {cfg.out} keeps the checkpoint of its last "
                f"save{f' (step {saved_step})' if saved_step is not None else ' (none yet)'}; a smaller lr "
                f"(now {cfg.lr:g}) may help")
        opt.step()
        sched.step()
        step += 1
        window_loss, window_steps = window_loss + loss_sum * world / total_w, window_steps + 1
        if rank == 0 and (step % cfg.log_every == 0 or step == total):
            dt = time.time() - t0
            # loss: mean over the steps since the last line (rank 0's share of each batch, scaled)
            log(f"[train] step {step}/{total} epoch {epoch} loss {window_loss / window_steps:.4f} "
                f"lr {sched.get_last_lr()[0]:.2e} "
                f"{window_slots / dt:.0f} slot-tokens/s")
            t0, window_slots, window_loss, window_steps = time.time(), 0, 0.0, 0
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
            evaluate()
        if step % cfg.save_every == 0 or step == total:
            save()
    if model is not drafter:
        # The DDP wrapper sits in reference cycles; if it outlives the caller's destroy_process_group(),
        # its gloo reducer aborts the process at exit ("terminate called without an active exception").
        del model
        gc.collect()
    return drafter
