"""A training run's settings: :class:`TrainConfig`, and the resume rules of ``--out``
(:func:`run_config`): a saved run is resumed with its own settings, a flag that would change
it is refused by name, a folder holding something else is not written over without
``overwrite``. The loop that runs it is :mod:`dflash_ext.training.trainer`."""
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

import torch

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
    distill: float = 0.0        # weight of the cross-entropy to the target's distribution (1 - distill: to its token)


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


def run_layer_ids(cfg: TrainConfig, num_target_layers: int) -> List[int]:
    """The target layers a run reads: --layer-ids, else the data's meta.json (the layers its
    cached features are of), else the default rule for the target's `num_target_layers`."""
    from ..model.config import default_target_layer_ids

    if cfg.layer_ids:
        return list(cfg.layer_ids)
    meta = os.path.join(cfg.data, "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            return json.load(f)["target_layer_ids"]
    return default_target_layer_ids(num_target_layers, cfg.num_layers or FRESH_LAYERS)
