"""Training data: ShareGPT first turns answered by the target itself, plus the target's
hidden states of the selected layers for every token.

Shard format (a folder):
- ``responses-NNNNN.jsonl``: one record per line,
  ``{"id": int, "input_ids": [prompt + response token ids], "response_start": int}``;
  tokens at positions >= response_start are the target's own (greedy) response.
- ``features-NNNNN.safetensors``: tensor ``"<id>"`` of shape ``[S, k*H]`` (bfloat16): the
  concatenated hidden states of the k target layers (layer l = HF ``hidden_states[l+1]``)
  for each of the S tokens of that record, in ``target_layer_ids`` order. That costs
  ``2*k*H`` bytes per token (5.6 KiB for SmolLM2-135M with k = 5).
- ``meta.json``: the target, layer ids, generation settings.
Generation is resumable: records already in the folder are skipped. A kill leaves no torn
file but the last line of a responses shard, which readers drop (with a warning) and the
next generation run cuts off and generates again; feature shards and meta.json are
written whole (temporary file + rename).
"""
import glob
import json
import os
import sys
import time
import warnings
from typing import Dict, List, NamedTuple, Sequence

import torch

from ..decode.runner import cache_kwarg, returned_cache
from ..model.atomic_files import write_file_atomically

__all__ = ["Generated", "generate_responses", "chat_prompt_ids", "left_padded", "greedy_batch", "target_pass", "target_features",
           "compute_features", "load_records", "split_holdout", "drop_trained_prompts", "FeatureStore", "write_meta"]

META_NAME = "meta.json"


def _shard_records(path: str):
    """(records of one responses shard, byte length of its whole lines): a last line that is
    not valid JSON was cut short by a kill of the writer and is dropped, with a warning."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records, end = [], 0
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                if any(rest.strip() for rest in lines[n:]):
                    raise ValueError(f"{path} line {n} is not valid JSON") from None
                warnings.warn(f"{path}: its last line is cut short (a generation run was interrupted): "
                              f"dropped; the next gen-data run generates that record again")
                break
        end += len(line) + 1
    return records, min(end, os.path.getsize(path))


def _records_in(folder: str) -> List[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "responses-*.jsonl"))):
        out.extend(_shard_records(path)[0])
    return out


def _cut_torn_lines(folder: str) -> None:
    """Truncate each responses shard to its whole lines (see :func:`_shard_records`)."""
    for path in glob.glob(os.path.join(folder, "responses-*.jsonl")):
        _, whole = _shard_records(path)
        if whole < os.path.getsize(path):
            os.truncate(path, whole)


def write_meta(out_dir: str, meta: dict) -> None:
    """meta.json of a data folder, written whole (a kill leaves the old one or the new one)."""
    def write(path):
        with open(path, "w") as f:
            json.dump(meta, f, indent=2)

    write_file_atomically(os.path.join(out_dir, META_NAME), write)


def load_records(folder: str) -> List[dict]:
    return sorted(_records_in(folder), key=lambda r: r["id"])


def _prompt(record: dict) -> tuple:
    return tuple(record["input_ids"][:record["response_start"]])


def split_holdout(records: List[dict], holdout: int):
    """(training records, held-out records): the `holdout` last (highest-id) records are
    held out, less those whose prompt is also a training record's (ShareGPT repeats
    conversations: 9 of the 64 highest-id records of the shipped data have a twin
    among the training records, answered the same), which measure memory, not drafting."""
    heldout = records[len(records) - holdout:] if holdout else []
    training = records[:len(records) - len(heldout)]
    return training, drop_trained_prompts(heldout, training)


def drop_trained_prompts(heldout: List[dict], training: List[dict]) -> List[dict]:
    """The held-out records whose prompt is no training record's prompt."""
    seen = {_prompt(r) for r in training}
    return [r for r in heldout if _prompt(r) not in seen]


def chat_prompt_ids(tokenizer, prompt: str) -> List[int]:
    """The token ids of `prompt` as the target's user turn, chat template applied, ready
    for the response (as every generated record's prompt is made)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int, device=None):
    """(input_ids, attention_mask) [len(prompts), longest]: the prompts left-padded, as
    :func:`greedy_batch` takes them."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, ids in enumerate(prompts):
        input_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[r, width - len(ids):] = 1
    return input_ids.to(device), mask.to(device)


@torch.no_grad()
def greedy_batch(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int) -> List[List[int]]:
    """Greedy continuations of a left-padded batch (up to and including EOS), the tokens
    ``generate(do_sample=False)`` makes, except that a row leaves the batch once it has
    emitted EOS: ``generate`` computes finished rows until the longest one is done, and
    responses end at very different lengths (the mean of the shipped data is 204 of 256)."""
    cache_arg = cache_kwarg(target)
    rows = list(range(input_ids.shape[0]))
    out: List[List[int]] = [[] for _ in rows]
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    step = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                  logits_to_keep=1)
    cache = returned_cache(step)
    mask, pos = attention_mask, positions[:, -1:] + 1
    nxt = step.logits[:, -1].argmax(-1)
    for n in range(max_new_tokens):
        tokens = nxt.tolist()
        for r, t in zip(rows, tokens):
            out[r].append(t)
        alive = [k for k, t in enumerate(tokens) if t != eos_token_id]
        if not alive or n == max_new_tokens - 1:
            break
        if len(alive) < len(rows):
            keep = torch.tensor(alive, device=mask.device)
            # beam search's batch index_select: every cache layer kind has it, the linear-attention
            # states of hybrid targets included (batch_select_indices is missing there)
            cache.reorder_cache(keep)
            rows, mask, pos, nxt = [rows[k] for k in alive], mask[keep], pos[keep], nxt[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        step = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True,
                      **{cache_arg: cache})
        nxt, pos = step.logits[:, -1].argmax(-1), pos + 1
    return out


class Generated(NamedTuple):
    """What :func:`generate_responses` did: the records in the folder now, and the ids of the
    prompts it left out because their tokens are over `max_prompt_tokens`."""
    records: int
    too_long: List[int]


@torch.no_grad()
def generate_responses(target, tokenizer, prompts: Sequence[str], out_dir: str, max_new_tokens: int = 192,
                       max_prompt_tokens: int = 256, batch_size: int = 16, shard_size: int = 256,
                       id_base: int = 0) -> Generated:
    """Greedy responses of the target to `prompts` (chat template applied), written to
    `out_dir` in shards; prompt i becomes record ``id_base + i``; a prompt of more than
    `max_prompt_tokens` tokens is left out and named in the result."""
    from tqdm import tqdm

    os.makedirs(out_dir, exist_ok=True)
    _cut_torn_lines(out_dir)  # a record cut short by a kill is generated again
    done = {r["id"] for r in _records_in(out_dir)}
    todo, too_long = [], []
    for i, p in enumerate(prompts, start=id_base):
        if i in done:
            continue
        ids = chat_prompt_ids(tokenizer, p)
        if len(ids) <= max_prompt_tokens:
            todo.append((i, ids))
        else:
            too_long.append(i)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    shard = len(glob.glob(os.path.join(out_dir, "responses-*.jsonl")))
    todo.sort(key=lambda x: len(x[1]))  # similar lengths per batch: less padding
    bar = tqdm(total=len(todo), desc="generating responses", unit="resp", file=sys.stderr)
    t0, new_tokens = time.perf_counter(), 0
    written_in_shard = shard_size
    f = None
    for b0 in range(0, len(todo), batch_size):
        batch = todo[b0:b0 + batch_size]
        input_ids, mask = left_padded([ids for _, ids in batch], pad)
        responses = greedy_batch(target, input_ids, mask, max_new_tokens, tokenizer.eos_token_id)
        for (i, ids), resp in zip(batch, responses):
            if written_in_shard >= shard_size:
                if f:
                    f.close()
                f = open(os.path.join(out_dir, f"responses-{shard:05d}.jsonl"), "a")
                shard, written_in_shard = shard + 1, 0
            f.write(json.dumps({"id": i, "input_ids": ids + resp, "response_start": len(ids)}) + "\n")
            f.flush()
            written_in_shard += 1
            new_tokens += len(resp)
        bar.update(len(batch))
        bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s")
    if f:
        f.close()
    bar.close()
    return Generated(len(_records_in(out_dir)), too_long)


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, layer_ids: Sequence[int]):
    """(features [S, k*H], final [S, H]) of one sequence ``input_ids [S]``: the hidden states
    of `layer_ids` (layer l = HF ``hidden_states[l+1]``) concatenated in `layer_ids` order,
    and the decoder's output (after its final norm), which the LM head reads. Runs the
    target's decoder only: its LM head (49,152 logits a token on SmolLM2) is the caller's
    to apply, to the rows it needs."""
    out = target.get_decoder()(input_ids=input_ids[None], output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[l + 1][0] for l in layer_ids], -1), out.last_hidden_state[0]


def target_features(target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[S, k*H]: the features of :func:`target_pass`."""
    return target_pass(target, input_ids, layer_ids)[0]


@torch.no_grad()
def compute_features(target, out_dir: str, layer_ids: Sequence[int], records_per_shard: int = 128) -> None:
    """Hidden states of `layer_ids` for every record without features yet (resumable)."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    have = set()
    for path in glob.glob(os.path.join(out_dir, "features-*.safetensors")):
        have.update(load_file(path).keys())
    todo = [r for r in load_records(out_dir) if str(r["id"]) not in have]
    shard = len(glob.glob(os.path.join(out_dir, "features-*.safetensors")))
    pending: Dict[str, torch.Tensor] = {}
    for rec in tqdm(todo, desc="target features", file=sys.stderr):
        feats = target_features(target, torch.tensor(rec["input_ids"]), layer_ids)
        pending[str(rec["id"])] = feats.to(torch.bfloat16).contiguous()
        if len(pending) == records_per_shard or rec is todo[-1]:
            # whole or absent: a torn shard would stop every later read of the folder
            write_file_atomically(os.path.join(out_dir, f"features-{shard:05d}.safetensors"),
                                  lambda path: save_file(pending, path))
            shard, pending = shard + 1, {}


class FeatureStore:
    """Lazy access to the cached features of a data folder by record id."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self._index = {}
        self._handles = []
        for path in sorted(glob.glob(os.path.join(folder, "features-*.safetensors"))):
            h = safe_open(path, framework="pt")
            self._handles.append(h)
            for key in h.keys():
                self._index[int(key)] = h

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, rec_id: int) -> bool:
        return rec_id in self._index

    def get(self, rec_id: int) -> torch.Tensor:
        return self._index[rec_id].get_tensor(str(rec_id))
