"""Training loop: AdamW, cosine schedule with warm-up, gradient clipping, checkpoint +
resume, and data parallelism over processes (DDP; gloo on CPU, NCCL on GPU).

The embedding and LM head are the target's: frozen, used under no_grad / without weight
gradients, and never saved (the drafter checkpoint holds only drafter weights).

Determinism across process counts: the sequence order of every epoch and the anchors of
every (epoch, record) come from seeded generators that do not depend on the rank, and
each optimizer step averages the loss over one global batch, so a run on N processes
follows the one-process run with the same global batch.
"""
import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..drafter import DFlashDrafter
from .data import FeatureStore, load_records
from .recipe import block_labels, block_mask_mod, default_gamma, loss_weights, sample_anchors

__all__ = ["TrainConfig", "train", "sequence_loss"]

STATE_NAME = "trainer_state.pt"


@dataclass
class TrainConfig:
    data: str
    out: str
    num_layers: int = 5
    block_size: int = 16
    anchors: int = 512          # per sequence per epoch (paper: 512)
    gamma: Optional[float] = None  # loss decay; default by block size
    lr: float = 6e-4
    weight_decay: float = 0.0
    epochs: int = 6
    warmup: float = 0.04
    grad_clip: float = 1.0
    batch_size: int = 4         # sequences per optimizer step (global, over all processes)
    max_len: int = 3072
    seed: int = 0
    save_every: int = 200       # steps between checkpoints
    autocast: str = "auto"      # bf16 autocast: auto = on CUDA only
    max_steps: Optional[int] = None
    log_every: int = 10


class FrozenTargetParts(torch.nn.Module):
    """The target's embedding and LM head (no gradients, not part of the drafter)."""

    def __init__(self, target):
        super().__init__()
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        for p in self.parameters():
            p.requires_grad_(False)


def sequence_loss(drafter, frozen: FrozenTargetParts, input_ids: torch.Tensor, features: torch.Tensor,
                  anchors: torch.Tensor, block_size: int, gamma: float, mask=None):
    """Weighted cross-entropy of all blocks of one sequence: slot j predicts
    input_ids[anchor + j] with weight exp(-(j-1)/gamma); slot 0 has no loss.
    Returns (loss, accuracy per slot j=1..B-1)."""
    B = block_size
    config = getattr(drafter, "module", drafter).config  # unwrap DDP
    block_ids = torch.full((anchors.numel(), B), config.mask_token_id, dtype=torch.long,
                           device=input_ids.device)
    block_ids[:, 0] = input_ids[anchors]
    with torch.no_grad():
        embeds = frozen.embed(block_ids).to(features.dtype)
    hidden = drafter(features, embeds, anchors, mask)
    logits = F.linear(hidden[:, 1:], frozen.lm_head.weight).float()
    labels = block_labels(input_ids, anchors, B)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    w = loss_weights(B, gamma, device=ce.device).repeat(anchors.numel())
    loss = (ce * w).sum() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(0)
    return loss, acc.detach()


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(cfg: TrainConfig, target, device="cpu", drafter: Optional[DFlashDrafter] = None,
          log=print) -> DFlashDrafter:
    rank, world = _dist_info()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {world} processes")
    local_batch = cfg.batch_size // world
    records = load_records(cfg.data)
    store = FeatureStore(cfg.data)
    records = [r for r in records
               if r["id"] in store and min(len(r["input_ids"]), cfg.max_len) - r["response_start"] > cfg.block_size]
    if not records:
        raise ValueError(f"no usable training records with features in {cfg.data}")
    with open(os.path.join(cfg.data, "meta.json")) as f:
        layer_ids = json.load(f)["target_layer_ids"]
    gamma = cfg.gamma or default_gamma(cfg.block_size)

    state_path = os.path.join(cfg.out, STATE_NAME)
    resume = os.path.exists(state_path)
    if resume:
        drafter = DFlashDrafter.from_pretrained(cfg.out)
    elif drafter is None:
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter.from_target(target.config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                            target_layer_ids=layer_ids, seed=cfg.seed)
    drafter.to(device).train()
    frozen = FrozenTargetParts(target).to(device)
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(drafter)

    steps_per_epoch = len(records) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    step = 0
    if resume:
        st = torch.load(state_path, weights_only=False)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step = st["step"]
        log(f"[train] resumed at step {step}/{total}")
    use_autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and torch.device(device).type == "cuda")

    def save():
        if rank != 0:
            return
        drafter.save_pretrained(cfg.out)
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
                    "config": asdict(cfg)}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    t0, acc_hist = time.time(), []
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        batch = order[in_epoch * cfg.batch_size:(in_epoch + 1) * cfg.batch_size]
        mine = batch[rank * local_batch:(rank + 1) * local_batch]
        opt.zero_grad(set_to_none=True)
        losses = []
        for i, idx in enumerate(mine.tolist()):
            rec = records[idx]
            ids = torch.tensor(rec["input_ids"][:cfg.max_len], device=device)
            feats = store.get(rec["id"])[:cfg.max_len].to(device, torch.float32)
            g = torch.Generator().manual_seed(hash((cfg.seed, epoch, rec["id"])) % (2 ** 62))
            anchors = sample_anchors(rec["response_start"], ids.numel(), cfg.block_size, cfg.anchors, g).to(device)
            if anchors.numel() == 0:
                continue
            mask = None
            if torch.device(device).type == "cuda":
                from torch.nn.attention.flex_attention import create_block_mask
                n_q = anchors.numel() * cfg.block_size
                mask = create_block_mask(block_mask_mod(anchors, ids.numel(), cfg.block_size), None, None,
                                         n_q, ids.numel() + n_q, device=device)
            last = i == len(mine) - 1
            sync = model.no_sync() if (world > 1 and not last) else contextlib.nullcontext()
            with sync, torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=use_autocast):
                loss, acc = sequence_loss(model, frozen, ids, feats, anchors, cfg.block_size, gamma, mask)
                (loss / local_batch).backward()
            losses.append(loss.item())
            acc_hist.append(acc)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        if rank == 0 and (step % cfg.log_every == 0 or step == total):
            a = torch.stack(acc_hist[-50:]).mean(0) if acc_hist else torch.zeros(1)
            # Expected accepted drafts per block from per-slot accuracies (a lower-bound proxy of tau - 1).
            tau_proxy = 1 + torch.cumprod(a, 0).sum().item()
            log(f"[train] step {step}/{total} epoch {epoch} loss {sum(losses) / max(1, len(losses)):.4f} "
                f"acc@1 {a[0].item():.3f} tau~{tau_proxy:.2f} lr {sched.get_last_lr()[0]:.2e} "
                f"{time.time() - t0:.0f}s")
        if step % cfg.save_every == 0 or step == total:
            save()
    if model is not drafter:
        # The DDP wrapper sits in reference cycles; if it outlives the caller's destroy_process_group(),
        # its gloo reducer aborts the process at exit ("terminate called without an active exception").
        del model
        gc.collect()
    return drafter
