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
"""
import contextlib
import copy
import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import default_target_layer_ids, target_text_config
from ..drafter import DFlashDrafter
from ..hardware import fastest_dtype
from ..proposer import block_embedding
from .data import FeatureStore, drop_trained_prompts, load_records, split_holdout, target_features
from .recipe import IGNORE, block_labels, default_gamma, loss_weights, sample_anchors

__all__ = ["TrainConfig", "train", "run_config", "evaluate_drafter", "sequence_loss", "LossVocab", "tau_of",
           "init_layers_from_target", "most_frequent_tokens"]

STATE_NAME = "trainer_state.pt"
FRESH_LAYERS = 5  # drafter layers of a fresh (not continued) run, as the paper's drafters
# One line per held-out evaluation; written with the checkpoint (one atomic save), so it
# shows an evaluation at the next save and never one past the saved step.
EVAL_LOG = "eval.jsonl"


@dataclass
class TrainConfig:
    data: str
    out: str
    num_layers: Optional[int] = None  # 5 for a fresh drafter; with init a folder: its own, or more (appended)
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
    autocast: str = "auto"      # bf16 autocast: auto = where bf16 is fast (CUDA, CPUs with bf16 units)
    max_steps: Optional[int] = None
    log_every: int = 10
    features: str = "auto"      # cached | live | auto (cached when the folder has features)
    layer_ids: Optional[List[int]] = None  # target layers; default: meta.json, else the default rule
    holdout: int = 0            # records (highest ids) kept out of training to measure tau on
    eval_every: int = 0         # steps between held-out tau measurements (0: only at the end)
    eval_stride: int = 4        # held-out anchors: every eval_stride-th response position
    init: str = "random"        # random | target (layers from the target's last layers) | a drafter folder
    loss_vocab: int = 0         # softmax of the loss over the K most frequent response tokens (0: all)
    extra_data: List[str] = field(default_factory=list)  # more gen-data folders: training only, never held out
    overwrite: bool = False     # replace whatever `out` holds (a saved run starts over)
    dflash2: bool = False       # train DFlash2: a v1 drafter (init) starts as DFlashDrafter.dflash2_from of it
    selector_rank: int = 256    # DFlash2's selector (a new one; a DFlash2 init keeps its own)
    selector_top_k: int = 16
    selector_alpha: float = 1.0  # weight of the selector's loss (SpecForge's dflash2_selector_loss_alpha)


# What a resumed run may change: how long it goes on and how often it logs, evaluates and
# saves. Every other field defines the run (and its saved optimizer and step).
MAY_CHANGE_ON_RESUME = {"out", "max_steps", "save_every", "log_every", "eval_every", "overwrite"}
PATH_FIELDS = {"data", "extra_data", "init"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _comparable(name: str, value):
    if isinstance(value, (list, tuple)):
        return [_comparable(name, v) for v in value]
    if name in PATH_FIELDS and isinstance(value, str) and os.path.exists(value):
        return os.path.realpath(value)  # the same folder by another spelling
    return value


def _saved_run(out: str) -> Optional[Dict[str, Any]]:
    """The TrainConfig fields of the run saved in `out` (None: no trainer state there)."""
    path = os.path.join(out, STATE_NAME)
    if not os.path.exists(path):
        return None
    saved = torch.load(path, weights_only=False, mmap=True)["config"]  # mmap: the optimizer state stays on disk
    known = {f.name for f in fields(TrainConfig)} - {"overwrite"}  # a run started over once is resumed later
    return {k: v for k, v in saved.items() if k in known}


def _refuse_foreign_out(out: str) -> None:
    if os.path.isdir(out):
        held = sorted(os.listdir(out))
    else:
        held = [os.path.basename(out)] if os.path.lexists(out) else []
    if held:
        raise ValueError(f"--out {out} already holds files ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}) "
                         f"and no training state to resume: pass --overwrite to replace it")


def run_config(values: Dict[str, Any]) -> Tuple[TrainConfig, bool]:
    """(the config of a training run, whether it resumes the run saved in ``values["out"]``)
    from TrainConfig fields, None meaning not given (the CLI passes its flags so). A resumed
    run takes the saved run's value of every field not given; a given field that defines the
    run (all but MAY_CHANGE_ON_RESUME) must equal the saved one: ValueError naming the flag.
    Without a saved run, an `out` that already holds files is refused unless `overwrite`."""
    given = {k: v for k, v in values.items() if v is not None}
    out = given["out"]
    saved = None if given.get("overwrite") else _saved_run(out)
    if saved is None:
        if not given.get("overwrite"):
            _refuse_foreign_out(out)
        return TrainConfig(**given), False
    for name, value in given.items():
        if name in MAY_CHANGE_ON_RESUME or name not in saved:
            continue
        if _comparable(name, value) != _comparable(name, saved[name]):
            raise ValueError(f"--out {out} holds a run trained with {_flag(name)} {saved[name]!r} ({name}), "
                             f"this one asks for {value!r}: leave {_flag(name)} out to resume the saved run, or "
                             f"pass --overwrite to start over (or use another --out)")
    return TrainConfig(**{**saved, **given}), True


class FrozenTargetParts(torch.nn.Module):
    """The target's embedding and LM head (no gradients, not part of the drafter)."""

    def __init__(self, target):
        super().__init__()
        self.embed = block_embedding(target)  # as inference embeds a block
        self.lm_head = target.get_output_embeddings()
        for p in self.parameters():
            p.requires_grad_(False)


def sequence_loss(drafter, frozen: FrozenTargetParts, input_ids: torch.Tensor, features: torch.Tensor,
                  anchors: torch.Tensor, block_size: int, gamma: float, vocab: Optional["LossVocab"] = None,
                  need_correct: bool = True, selector_alpha: float = 1.0):
    """Weighted cross-entropy of all blocks of one sequence: slot j predicts
    input_ids[anchor + j] with weight exp(-(j-1)/gamma); slot 0 and slots past the end
    have no loss. With `vocab`, the softmax runs over that token subset only (labels
    outside it get no loss). Returns (weighted loss sum, weight sum, correct [nb, B-1]
    bool: the block inference would draft matches the labels there; None without
    `need_correct`): the caller normalises by the weight sum of its whole batch.

    DFlash2 (as SpecForge defines its loss): the cross-entropy runs on the selector's
    transformed logits, plus `selector_alpha` times the selector's: at each slot whose label
    is among the top-K candidates, a K-way cross-entropy of the candidates' scores after the
    label of the slot before (teacher-forced; the anchor token at slot 1), with the same
    weights, over the same denominator. Its drafts are the selector's greedy path."""
    B = block_size
    core = getattr(drafter, "module", drafter)  # unwrap DDP
    config = core.config
    block_ids = torch.full((anchors.numel(), B), config.mask_token_id, dtype=torch.long,
                           device=input_ids.device)
    block_ids[:, 0] = input_ids[anchors]
    with torch.no_grad():
        embeds = frozen.embed(block_ids).to(features.dtype)
    hidden = drafter(features, embeds, anchors)[:, 1:]
    labels = block_labels(input_ids, anchors, B)
    # flattened first: on a strided 3-D input that needs grad, F.linear runs a bmm against the
    # weight expanded per block (measured: over a quarter of a CPU training step, bench/RESULTS.md §5)
    logits = F.linear(hidden.flatten(0, 1), frozen.lm_head.weight if vocab is None else vocab.lm_head_rows)
    logits = logits.view(*labels.shape, -1)
    selector = core.candidate_selector if config.is_dflash2 else None
    vocab_ids = None if vocab is None else vocab.ids
    correct = None
    if need_correct:  # the drafts inference would make: the argmax over the draft vocabulary, or the selector's path
        with torch.no_grad():
            if selector is not None:
                drafts = selector(hidden, logits, block_ids[:, 0], vocab_ids)
            else:
                best = logits.argmax(-1)
                drafts = best if vocab is None else vocab.ids[best]
            correct = drafts == labels
    token_labels = labels
    if vocab is not None:
        labels = vocab.remap(labels)
    w = label_weights(labels, gamma)
    unary = logits.float() if selector is None else selector.unary(logits)
    ce = F.cross_entropy(unary.reshape(-1, unary.shape[-1]), labels.reshape(-1), reduction="none",
                         ignore_index=IGNORE)
    loss = (ce * w.reshape(-1)).sum()
    if selector is not None and selector_alpha:
        top, candidates = selector.top_candidates(unary, vocab_ids)  # [nb, B-1, K]
        previous = torch.cat([block_ids[:, :1], token_labels[:, :-1].clamp(min=0)], 1)  # a past-end label has weight 0
        scores = selector.scores(selector.gate(hidden), top, candidates, previous)
        is_label = candidates == token_labels[..., None]
        covered = is_label.any(-1)
        ce_sel = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), is_label.float().argmax(-1).reshape(-1),
                                 reduction="none")
        loss = loss + selector_alpha * (ce_sel * (w * covered).reshape(-1)).sum()
    return loss, w.sum(), correct


def most_frequent_tokens(records, vocab_size: int, k: int):
    """(sorted ids of the k most frequent response tokens of `records`, their share of all
    response tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts += torch.bincount(torch.tensor(r["input_ids"][r["response_start"]:]), minlength=vocab_size)
    ids = counts.topk(min(k, vocab_size)).indices.sort().values
    return ids, counts[ids].sum().item() / max(1, counts.sum().item())


class LossVocab:
    """A token subset of the vocabulary: the softmax of the loss runs over it instead of the
    whole vocabulary (the frozen LM head's rows are most of the FLOPs per slot), and the
    drafter trained so drafts from it (its draft vocabulary, saved with the checkpoint).
    The held-out tau drafts from it too, as inference does."""

    def __init__(self, ids: torch.Tensor, lm_head_weight: torch.Tensor):
        self.ids = ids.to(lm_head_weight.device)
        self.lm_head_rows = lm_head_weight.detach()[self.ids].contiguous()
        self._map = torch.full((lm_head_weight.shape[0],), IGNORE, dtype=torch.long, device=self.ids.device)
        self._map[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)

    def remap(self, labels: torch.Tensor) -> torch.Tensor:
        return torch.where(labels == IGNORE, IGNORE, self._map[labels.clamp(min=0)])


def label_weights(labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """[nb, B-1] loss weights of the labelled slots (0 past the end)."""
    w = loss_weights(labels.shape[1] + 1, gamma, device=labels.device)
    return w[None, :] * (labels != IGNORE)


def tau_of(correct: torch.Tensor) -> float:
    """Expected tokens per draft step from a per-block correctness matrix [nb, B-1]: the
    accepted prefix of each block (drafts right up to the first miss) plus the target's
    own token."""
    return 1 + torch.cumprod(correct.float(), -1).sum(-1).mean().item()


def init_layers_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the drafter's N layers from the target's last N decoder layers (same widths;
    the Qwen3 q/k norms start as identity) and its final norm from the target's, so the
    drafter starts as a language model whose output the frozen LM head already reads."""
    decoder = target.get_decoder()  # composite models keep the text decoder a level deeper
    src = decoder.layers[-len(drafter.layers):]
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, src):
            own = mine.state_dict()
            for name, t in theirs.state_dict().items():
                if name in own and own[name].shape == t.shape:
                    own[name].copy_(t)
        drafter.norm.weight.copy_(decoder.norm.weight)


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _layer_ids(cfg: TrainConfig, target) -> List[int]:
    if cfg.layer_ids:
        return list(cfg.layer_ids)
    meta = os.path.join(cfg.data, "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            return json.load(f)["target_layer_ids"]
    return default_target_layer_ids(target_text_config(target.config).num_hidden_layers,
                                    cfg.num_layers or FRESH_LAYERS)


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
        if self.store is not None:
            return self.store.get(rec["id"])[:ids.numel()].to(self.device, self.dtype)
        return target_features(self.target, ids, self.layer_ids).to(self.dtype)  # fp32 residual stream


def _anchors(cfg: TrainConfig, rec, seq_len: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((cfg.seed, epoch, rec["id"])) % (2 ** 62))
    return sample_anchors(rec["response_start"], seq_len, cfg.block_size, cfg.anchors, g)


@torch.no_grad()
def heldout_tau(drafter, frozen, records, features, cfg: TrainConfig, device, gamma: float, autocast: bool,
                vocab=None):
    """tau on held-out records with fixed anchors (every eval_stride-th response position):
    (tau, per-slot acceptance rate of the accepted prefix)."""
    was_training = drafter.training
    drafter.eval()
    rows = []
    for rec in records:
        ids = torch.tensor(rec["input_ids"][:cfg.max_len], device=device)
        anchors = torch.arange(rec["response_start"], ids.numel() - 1, cfg.eval_stride, device=device)
        if anchors.numel() == 0:
            continue
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            _, _, correct = sequence_loss(drafter, frozen, ids, features(rec, ids), anchors, cfg.block_size, gamma,
                                          vocab, selector_alpha=0.0)
        rows.append(correct.cpu())
    drafter.train(was_training)
    correct = torch.cat(rows)
    return tau_of(correct), torch.cumprod(correct.float(), -1).mean(0).tolist()


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
    """The held-out tau of any drafter on the records a training run with `cfg` holds out
    (same anchors, same features): (tau, accepted-prefix profile)."""
    use_autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and fastest_dtype(device) == torch.bfloat16)
    if use_autocast:
        target = copy.deepcopy(target).to(torch.bfloat16)
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
    layer_ids = _layer_ids(cfg, target)
    if use_autocast:  # live features and the frozen parts on bf16 weights (a copy: the caller's stays)
        target = copy.deepcopy(target).to(torch.bfloat16)
    features = _Features(cfg, target, layer_ids, device, torch.float32)
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
                drafter.config.block_size = cfg.block_size
                drafter.acceptance_profile = None  # measured at the old B; the first eval remeasures it
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

    def save():
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

    def evaluate():
        if rank != 0 or not heldout:
            return
        t = time.time()
        tau, accept = heldout_tau(drafter, frozen, heldout, features, cfg, device, gamma, use_autocast, vocab)
        drafter.acceptance_profile = accept  # saved beside the checkpoint: block_size="auto" reads it
        eval_lines.append(json.dumps({"step": step, "slot_tokens": seen_slots, "tau": tau, "accept": accept}) + "\n")
        log(f"[eval] step {step} slot-tokens {seen_slots} held-out tau {tau:.3f} ({time.time() - t:.0f}s)")

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
                    feats = features(rec, ids)
                with sync:
                    loss, _, _ = sequence_loss(model, frozen, ids, feats, anchors, cfg.block_size, gamma, vocab,
                                               need_correct=False, selector_alpha=cfg.selector_alpha)
                    (loss / total_w).backward()
            loss_sum += loss.item()
            n_slots = int((block_labels(ids, anchors, cfg.block_size) != IGNORE).sum())
            seen_slots += n_slots * world
            window_slots += n_slots
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
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
