"""The embedded target's drafter trained on a GPU inside one device call (issue 40).

Two steps (docs/training.md, "GPU run", has the whole sequence of device calls):

``prepare`` (here, on the CPU): the training prompts of every source of
``dflash_ext.prompts.TRAINING_SOURCES`` (ShareGPT first turns of the training range, their
later human turns, standard-library code stubs), chat template applied and cut to
``--max-prompt-tokens``, less every held-out prompt (the records ``dflash_ext eval`` measures
tau on, by id and by prompt); and those held-out records, so the run measures tau on the
same ones. HumanEval, MT-Bench and the ShareGPT evaluation range are in no training source.

``run`` (on the GPU): within a wall-clock deadline,
  1. loads the target (the embedded one: converted from its GGUF file under DFLASH_CACHE);
  2. generates greedy responses (``dflash_ext.training.data.greedy_batch``) to the prompts
     in large batches, in a random order (similar lengths per batch), one gen-data shard
     per batch;
  3. times a few training steps on them (a throwaway run), then splits the time left between
     more generation and training so that training sees each new record about once
     (``--epochs-of-data``);
  4. continues ``--init`` (the shipped drafter by default) with the existing recipe
     (``dflash_ext.training.trainer.train``, live target features, bf16 autocast) for as many
     steps as the time left allows, the held-out records as ``data`` (all held out) and the
     new records as ``extra_data`` (training only);
  5. exports every new checkpoint (bf16, as ``python -m dflash_ext export``) into ``--out``
     as ``drafter.tar`` in parts of at most 15 MiB with a SHA-256 manifest
     (``tools.gpu.parts``), so a run cut off at any moment still returns the last saved
     weights, and stops training itself at the deadline (exit 0, the last save exported);
  6. writes ``gpu_train.json``: generation tokens/s, training slot-tokens/s, held-out tau.

Not verified on a GPU yet (no device in the session that wrote it): tested end to end on the
CPU with a tiny target (python_tests/training/test_gpu_train.py).
"""
import argparse
import gzip
import json
import os
import random
import re
import statistics
import sys
import tarfile
import time
from typing import Iterator, List, Sequence, Tuple

import torch

from tools.gpu import parts

PROMPTS_NAME = "prompts.jsonl.gz"
PROMPTS_META = "prompts.json"
HELDOUT_DIR = "heldout"
RESULT_NAME = "gpu_train.json"
EXPORT_NAME = "drafter.tar"
EXPORT_PART_MIB = 15  # $OUT brings back files of at most 16 MiB
STEP_LINE = re.compile(r"\[train\] step (\d+)/(\d+) .* (\d+) slot-tokens/s")
EVAL_LINE = re.compile(r"\[eval\] step (\d+) slot-tokens (\d+) held-out tau ([0-9.]+)(?:, [^(]*)? \((\d+)s\)")


# ----------------------------------------------------------------------------- prepare
def training_prompt_texts(exclude_ids=frozenset()) -> List[Tuple[int, str]]:
    """(record id, prompt) of every training source, ids as gen-data gives them (the
    source's base + index), less `exclude_ids`."""
    from dflash_ext.prompts import TRAINING_SOURCES, training_prompts

    out = []
    for source, (_, base) in TRAINING_SOURCES.items():
        out += [(base + i, p) for i, p in enumerate(training_prompts(source)) if base + i not in exclude_ids]
    return out


def tokenize_prompts(tokenizer, prompts: Sequence[Tuple[int, str]], max_prompt_tokens: int,
                     exclude_prompts=frozenset()) -> List[Tuple[int, List[int]]]:
    """(id, prompt token ids) with the chat template applied, as gen-data makes them: those
    over `max_prompt_tokens` and those in `exclude_prompts` (tuples of ids) left out."""
    from dflash_ext.training.data import chat_prompt_ids

    out = []
    for i, text in prompts:
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) <= max_prompt_tokens and tuple(ids) not in exclude_prompts:
            out.append((i, ids))
    return out


def prepare(tokenizer, out_dir: str, heldout_data: str, holdout: int, exclude_data: Sequence[str] = (),
            max_prompt_tokens: int = 256, prompts=None) -> dict:
    """Write PROMPTS_NAME (+ PROMPTS_META) and HELDOUT_DIR into `out_dir`: the training
    prompts less the `holdout` highest-id records of `heldout_data` and every record of
    `exclude_data` (by id and by prompt); the held-out records that tau is measured on
    (``split_holdout``: those whose prompt no training record of `heldout_data` repeats).
    `prompts` ((id, text) pairs) replaces the training sources (tests)."""
    from dflash_ext.model.atomic_files import write_file_atomically
    from dflash_ext.training.data import load_records, split_holdout

    records = load_records(heldout_data)
    excluded = records[len(records) - holdout:] if holdout else []
    _, heldout = split_holdout(records, holdout)
    for folder in exclude_data:
        excluded += load_records(folder)
    ex_ids = {r["id"] for r in excluded}
    ex_prompts = {tuple(r["input_ids"][:r["response_start"]]) for r in excluded}
    texts = training_prompt_texts(ex_ids) if prompts is None else [(i, t) for i, t in prompts if i not in ex_ids]
    tokenized = tokenize_prompts(tokenizer, texts, max_prompt_tokens, ex_prompts)
    os.makedirs(os.path.join(out_dir, HELDOUT_DIR), exist_ok=True)

    def write_prompts(path):
        with gzip.open(path, "wt") as f:
            for i, ids in tokenized:
                f.write(json.dumps({"id": i, "prompt_ids": ids}, separators=(",", ":")) + "\n")

    write_file_atomically(os.path.join(out_dir, PROMPTS_NAME), write_prompts)
    with open(os.path.join(out_dir, HELDOUT_DIR, "responses-00000.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in heldout)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    meta = {"prompts": len(tokenized), "prompt_tokens": sum(len(ids) for _, ids in tokenized),
            "max_prompt_tokens": max_prompt_tokens, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad,
            "heldout": {"data": heldout_data, "holdout": holdout, "measured_records": [r["id"] for r in heldout]},
            "excluded_records": len(excluded), "exclude_data": list(exclude_data)}
    with open(os.path.join(out_dir, PROMPTS_META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_prompts_file(path: str) -> List[Tuple[int, List[int]]]:
    with gzip.open(path, "rt") as f:
        return [(r["id"], r["prompt_ids"]) for r in map(json.loads, f)]


# ----------------------------------------------------------------------------- generate
def batches_by_length(prompts, batch_size: int, seed: int = 0, chunk_batches: int = 8) -> Iterator[list]:
    """The prompts in a random order (a run cut short still covers every source), sorted by
    length within chunks of `chunk_batches` batches (less padding), `batch_size` at a time."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    chunk = batch_size * chunk_batches
    for c0 in range(0, len(order), chunk):
        block = sorted(order[c0:c0 + chunk], key=lambda p: len(p[1]))
        for b0 in range(0, len(block), batch_size):
            yield block[b0:b0 + batch_size]


class Generator:
    """Greedy responses of the target to batches of prompts, one gen-data responses shard
    (``dflash_ext/training/data.py``'s format) per batch, until a deadline."""

    def __init__(self, target, batches: Iterator[list], out_dir: str, eos_token_id: int, pad_token_id: int,
                 max_new_tokens: int, device):
        self.target, self.batches, self.out_dir = target, batches, out_dir
        self.eos, self.pad, self.max_new_tokens, self.device = eos_token_id, pad_token_id, max_new_tokens, device
        self.records = self.new_tokens = self.shards = 0
        self.seconds = 0.0
        self.exhausted = False
        os.makedirs(out_dir, exist_ok=True)

    @torch.no_grad()
    def run(self, until: float) -> None:
        """Generate batch after batch while a batch may start before time.time() reaches
        `until` (a batch started just before it runs to its end)."""
        from dflash_ext.model.atomic_files import write_file_atomically
        from dflash_ext.training.data import greedy_batch, left_padded

        while not self.exhausted and time.time() < until:
            batch = next(self.batches, None)
            if batch is None:
                self.exhausted = True
                break
            t0 = time.time()
            input_ids, mask = left_padded([ids for _, ids in batch], self.pad, self.device)
            responses = greedy_batch(self.target, input_ids, mask, self.max_new_tokens, self.eos)
            lines = [json.dumps({"id": i, "input_ids": ids + resp, "response_start": len(ids)}) + "\n"
                     for (i, ids), resp in zip(batch, responses)]

            def write(path):
                with open(path, "w") as f:
                    f.writelines(lines)

            write_file_atomically(os.path.join(self.out_dir, f"responses-{self.shards:05d}.jsonl"), write)
            self.shards += 1
            self.records += len(batch)
            self.new_tokens += sum(len(r) for r in responses)
            self.seconds += time.time() - t0

    def stats(self) -> dict:
        s = max(self.seconds, 1e-9)
        return {"records": self.records, "response_tokens": self.new_tokens, "seconds": round(self.seconds, 1),
                "tokens_per_s": round(self.new_tokens / s, 1), "responses_per_s": round(self.records / s, 2),
                "all_prompts_done": self.exhausted}


# ----------------------------------------------------------------------------- train
class OutOfTime(Exception):
    """Raised from the trainer's log callback at the hard deadline (the last save stands)."""


class TrainWatch:
    """The log callback of ``train``: prints and keeps every line, times the step lines,
    exports each new checkpoint of the run's folder as it appears, and stops the run at
    `stop_at` (time.time()) by raising OutOfTime, once it has saved a checkpoint (a run
    stopped before its first save would return nothing), or `grace` seconds later
    regardless."""

    def __init__(self, train_dir: str, log=print, export=None, stop_at: float = None, grace: float = 0.0):
        self.train_dir, self.log, self.export, self.stop_at, self.grace = train_dir, log, export, stop_at, grace
        self.start = time.time()
        self.steps: List[Tuple[float, int, int]] = []  # (time, step, the line's slot-tokens/s)
        self.evals: List[Tuple[float, int, float, int]] = []  # (time, step, tau, the line's whole seconds)
        self._saved = None

    def saved_checkpoint(self):
        """An id of the checkpoint in train_dir (None: none yet); a save swaps the folder."""
        try:
            st = os.stat(os.path.join(self.train_dir, "trainer_state.pt"))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def export_if_new(self) -> bool:
        saved = self.saved_checkpoint()
        if self.export is None or saved is None or saved == self._saved:
            return False
        self.export()
        self._saved = saved
        return True

    def __call__(self, msg: str) -> None:
        now = time.time()
        self.log(msg)
        m = STEP_LINE.search(msg)
        if m:
            self.steps.append((now, int(m.group(1)), int(m.group(3))))
        e = EVAL_LINE.search(msg)
        if e:
            self.evals.append((now, int(e.group(1)), float(e.group(3)), int(e.group(4))))
        if m or e:
            self.export_if_new()
        if m and self.stop_at is not None and now > self.stop_at \
                and (self.saved_checkpoint() is not None or now > self.stop_at + self.grace):
            raise OutOfTime(f"deadline reached at step {m.group(1)}")

    def step_seconds(self, skip: int = 2) -> float:
        """Median wall seconds of a step (log_every=1), the first `skip` left out (warm-up)."""
        times = [t for t, _, _ in self.steps]
        gaps = [b - a for a, b in zip(times, times[1:])][skip:] or [b - a for a, b in zip(times, times[1:])]
        if not gaps:
            raise ValueError("timing needs at least two logged steps")
        return statistics.median(gaps)


def export_checkpoint(train_dir: str, out_dir: str, work_dir: str) -> dict:
    """The checkpoint in `train_dir` as bf16 (as ``python -m dflash_ext export``) with the
    run's eval.jsonl, tarred and split into `out_dir` (``tools.gpu.parts``). Returns the
    step and slot-tokens of that checkpoint."""
    from dflash_ext import DFlashDrafter

    state = torch.load(os.path.join(train_dir, "trainer_state.pt"), weights_only=False, mmap=True,
                       map_location="cpu")  # the optimizer state stays off the GPU
    info = {"step": state["step"], "slot_tokens": state.get("slot_tokens", 0)}
    drafter = DFlashDrafter.from_pretrained(train_dir)
    extra = {}
    if os.path.exists(os.path.join(train_dir, "eval.jsonl")):
        with open(os.path.join(train_dir, "eval.jsonl"), "rb") as f:
            extra["eval.jsonl"] = f.read()
    extra["gpu_checkpoint.json"] = json.dumps(info).encode()
    folder = os.path.join(work_dir, "drafter")
    drafter.save_pretrained(folder, dtype=torch.bfloat16, overwrite=True, extra_files=extra)
    tar_path = os.path.join(work_dir, EXPORT_NAME)
    with tarfile.open(tar_path, "w") as tar:
        tar.add(folder, arcname="drafter")
    parts.split(tar_path, out_dir, EXPORT_PART_MIB << 20, EXPORT_NAME)
    return info


def recipe_config(args, data: str, extra_data: str, out: str, layer_ids, **run):
    """The training run's TrainConfig: the existing recipe (the shipped drafter's last
    continuations: B = 4, 256 anchors, 8 sequences a step, gamma 2, 16,384-token loss
    vocabulary) unless the flags say otherwise; `run` sets steps, saving, logging."""
    from dflash_ext.training.train_config import TrainConfig

    return TrainConfig(data=data, extra_data=[extra_data], out=out, init=args.init, num_layers=args.num_layers,
                       block_size=args.block_size, anchors=args.anchors, batch_size=args.batch_size, lr=args.lr,
                       gamma=args.gamma, loss_vocab=args.loss_vocab, holdout=args.holdout_records,
                       eval_stride=args.eval_stride, layer_ids=list(layer_ids), features="live", seed=args.seed,
                       epochs=10 ** 6, overwrite=True, **run)


def _write_json(path: str, obj) -> None:
    from dflash_ext.model.atomic_files import write_file_atomically

    def write(p):
        with open(p, "w") as f:
            json.dump(obj, f, indent=1)

    write_file_atomically(path, write)


def run(args) -> dict:
    """The whole GPU run (module docstring); returns what it writes to gpu_train.json."""
    from dflash_ext import DFlashDrafter, load_target
    from dflash_ext.model.pretrained import cast_target
    from dflash_ext.training.data import load_records
    from dflash_ext.training.trainer import train

    t_start = time.time()
    deadline = args.deadline or t_start + args.budget_seconds
    train_end = deadline - args.final_reserve  # the last save and its export fit after it
    os.makedirs(args.out, exist_ok=True)
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    device = torch.device(args.device)
    result = {"status": "running", "device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "deadline_s": round(deadline - t_start, 1), "args": vars(args)}

    def save_result(**update):
        result.update(update)
        result["wall_s"] = round(time.time() - t_start, 1)
        _write_json(os.path.join(args.out, RESULT_NAME), result)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    with open(os.path.join(args.payload, PROMPTS_META)) as f:
        meta = json.load(f)
    prompts = load_prompts_file(os.path.join(args.payload, PROMPTS_NAME))
    heldout_dir = os.path.join(args.payload, HELDOUT_DIR)
    heldout_n = len(load_records(heldout_dir))
    args.holdout_records = heldout_n  # every record of the held-out folder is held out
    layer_ids = DFlashDrafter.from_pretrained(args.init).config.target_layer_ids if os.path.isdir(args.init) \
        else args.layer_ids

    t = time.time()
    target, _ = load_target(args.target, dtype=torch.float32, device=device, tokenizer=False)
    result["target_load_s"] = round(time.time() - t, 1)
    log(f"[gpu_train] target loaded in {result['target_load_s']} s; {len(prompts)} prompts, {heldout_n} held-out records")
    gen_target = cast_target(target, torch.bfloat16) if args.gen_dtype == "bfloat16" else target
    gen = Generator(gen_target, batches_by_length(prompts, args.gen_batch, args.seed), os.path.join(work, "gen"),
                    meta["eos_token_id"], meta["pad_token_id"], args.max_new_tokens, device)

    # 1. a first share of the data, and the training step timed on it
    gen.run(time.time() + args.probe_seconds)
    save_result(generation=gen.stats())
    log(f"[gpu_train] probe: {gen.stats()}")
    calib_dir = os.path.join(work, "calibrate")
    watch = TrainWatch(calib_dir, log)
    t = time.time()
    train(recipe_config(args, heldout_dir, gen.out_dir, calib_dir, layer_ids, max_steps=args.calibration_steps,
                        log_every=1, save_every=10 ** 9, eval_every=0), target, device=args.device, log=watch)
    step_s = watch.step_seconds()
    eval_s = watch.evals[-1][0] - watch.steps[-1][0] if watch.evals else 0.0
    setup_s = max(0.0, watch.steps[0][0] - t - step_s)
    wall_s = time.time() - t
    t = time.time()  # an export (of this throwaway run, off $OUT): its time, and the path tried once
    export_checkpoint(calib_dir, os.path.join(work, "calibrate_export"), os.path.join(work, "export"))
    export_s = time.time() - t
    calib = {"step_s": round(step_s, 4), "eval_s": round(eval_s, 2), "setup_s": round(setup_s, 2),
             "export_s": round(export_s, 2), "sequences_per_s": round(args.batch_size / step_s, 2),
             "wall_s": round(wall_s, 1)}
    save_result(calibration=calib)
    log(f"[gpu_train] calibration: {calib}")

    # 2. more data: training should see each new record about epochs_of_data times
    evals = args.evals + 1  # and the final one
    # a step's share of the saves and exports, one every save_seconds
    step_s_all = step_s * (1 + export_s / args.save_seconds)
    left = train_end - time.time() - setup_s - evals * eval_s
    rate_t, rate_g = args.batch_size / step_s_all, gen.records / max(gen.seconds, 1e-9)
    e = args.epochs_of_data
    gen_s = max(0.0, min(left - args.min_train_seconds, (rate_t * left - e * gen.records) / (rate_t + e * rate_g)))
    gen.run(time.time() + gen_s)
    save_result(generation={**gen.stats(), "batch_size": args.gen_batch, "max_new_tokens": args.max_new_tokens,
                            "dtype": args.gen_dtype})
    log(f"[gpu_train] generation: {result['generation']}")
    gen.target = gen_target = None  # its memory back before training
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 3. the run: as many steps as the time left allows, saved and exported as it goes
    left = train_end - time.time() - setup_s - evals * eval_s
    steps = max(1, int(0.95 * left / step_s_all))  # 5 % for the noise of the timing
    train_dir = os.path.join(work, "train")
    exports = []

    def export():
        info = export_checkpoint(train_dir, args.out, os.path.join(work, "export"))
        exports.append(info)
        save_result(exported=info)
        log(f"[gpu_train] exported step {info['step']} ({info['slot_tokens']} slot-tokens) to {args.out}")

    watch = TrainWatch(train_dir, log, export, stop_at=train_end + args.final_reserve / 3, grace=args.save_seconds)
    cfg = recipe_config(args, heldout_dir, gen.out_dir, train_dir, layer_ids, max_steps=steps,
                        log_every=args.log_every, eval_every=max(1, steps // max(1, args.evals)),
                        save_every=max(1, int(args.save_seconds / step_s)))
    save_result(train_plan={"max_steps": steps, "save_every": cfg.save_every, "eval_every": cfg.eval_every})
    log(f"[gpu_train] training {steps} steps (~{step_s:.3f} s each)")
    t = time.time()
    status = "complete"
    try:
        train(cfg, target, device=args.device, log=watch)
    except OutOfTime as err:
        status = f"stopped at the deadline: {err}"
    except FloatingPointError as err:  # the trainer stops a diverging run before the bad update
        status = f"stopped, diverging: {err}"
    train_s = time.time() - t
    watch.export_if_new()  # the final save
    rates = [r for _, _, r in watch.steps]
    last = exports[-1] if exports else {"step": 0, "slot_tokens": 0}
    eval_total = sum(s for _, _, _, s in watch.evals)
    save_result(status=status, train={
        "wall_s": round(train_s, 1), "steps": last["step"], "slot_tokens": last["slot_tokens"],
        # over the whole run (start-up, evaluations, saves and exports included), without the
        # evaluations (their whole seconds), and the median of the trainer's own log lines
        "slot_tokens_per_s": round(last["slot_tokens"] / train_s, 1),
        "slot_tokens_per_s_without_evals": round(last["slot_tokens"] / max(train_s - eval_total, 1e-9), 1),
        "slot_tokens_per_s_median_log_line": statistics.median(rates) if rates else None,
        "heldout_tau": [{"step": st, "tau": tau} for _, st, tau, _ in watch.evals],
        "eval_s": eval_total, "config": dict(vars(cfg))})
    log(f"[gpu_train] {status}; {json.dumps(result['train'])}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.training.gpu_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="write the prompts and the held-out records (on the CPU)")
    pp.add_argument("--out", required=True, help="folder of the payload")
    pp.add_argument("--heldout-data", required=True, help="the data folder whose held-out records tau is measured on")
    pp.add_argument("--holdout", type=int, default=64, help="its highest-id records held out (as dflash_ext eval)")
    pp.add_argument("--exclude-data", nargs="*", default=[], help="folders of more held-out records (all of them)")
    pp.add_argument("--max-prompt-tokens", type=int, default=256)
    pp.add_argument("--target", default=None, help="target folder whose tokenizer is used (default: the embedded one)")
    r = sub.add_parser("run", help="generate, train, export (on the GPU)")
    r.add_argument("--payload", required=True, help="the folder `prepare` wrote")
    r.add_argument("--out", required=True, help="where the drafter parts and gpu_train.json go ($OUT)")
    r.add_argument("--work", required=True, help="scratch folder (responses, training folders)")
    r.add_argument("--target", default=None, help="target folder (default: the embedded one)")
    r.add_argument("--device", default="cuda")
    r.add_argument("--deadline", type=float, default=None, help="time.time() at which everything must be done")
    r.add_argument("--budget-seconds", type=float, default=450, help="without --deadline: seconds from now")
    r.add_argument("--final-reserve", type=float, default=30, help="seconds kept for the last save and export")
    r.add_argument("--probe-seconds", type=float, default=20, help="generation before the training step is timed")
    r.add_argument("--min-train-seconds", type=float, default=60)
    r.add_argument("--epochs-of-data", type=float, default=1.0, help="training passes over the generated records")
    r.add_argument("--gen-batch", type=int, default=1024, help="prompts a batch (the KV cache of 1,024 rows of 512 tokens: 12 GB)")
    r.add_argument("--gen-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--calibration-steps", type=int, default=12)
    r.add_argument("--init", default="dflash_ext/drafters/smollm2-135m", help="drafter to continue, or random")
    r.add_argument("--layer-ids", type=int, nargs="*", default=[1, 8, 14, 20, 27], help="without a drafter --init")
    r.add_argument("--num-layers", type=int, default=None, help="more layers than --init's: appended")
    r.add_argument("--block-size", type=int, default=4)
    r.add_argument("--anchors", type=int, default=256)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--lr", type=float, default=1.5e-4)
    r.add_argument("--gamma", type=float, default=2.0)
    r.add_argument("--loss-vocab", type=int, default=16384)
    r.add_argument("--eval-stride", type=int, default=1)
    r.add_argument("--evals", type=int, default=4, help="held-out evaluations during the run (and one at its end)")
    r.add_argument("--save-seconds", type=float, default=45, help="about this many seconds between saves")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--seed", type=int, default=8)
    args = p.parse_args(argv)
    if args.command == "prepare":
        from transformers import AutoTokenizer

        from dflash_ext.model.pretrained import default_target_path

        tokenizer = AutoTokenizer.from_pretrained(args.target or default_target_path())
        meta = prepare(tokenizer, args.out, args.heldout_data, args.holdout, args.exclude_data, args.max_prompt_tokens)
        print(json.dumps({k: v for k, v in meta.items() if k != "heldout"}))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
