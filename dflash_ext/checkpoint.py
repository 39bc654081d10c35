"""Drafter checkpoints on disk, in the reference format (z-lab/dflash ``DFlashDraftModel``):
``config.json`` (:mod:`dflash_ext.config`) and safetensors weights named
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` (the embedding and LM head are the target's),
plus two optional files of ours beside them. Resolving a path or hub id, reading and
writing: the module that builds the drafter from them is :mod:`dflash_ext.drafter`.
"""
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .config import DFlashConfig

__all__ = ["Checkpoint", "read_checkpoint", "write_checkpoint", "torch_dtype", "WEIGHTS_NAME", "CONFIG_NAME",
           "ACCEPTANCE_NAME", "DRAFT_VOCAB_NAME"]

WEIGHTS_NAME = "model.safetensors"
# Hugging Face's sharded form, read when there is no WEIGHTS_NAME: {"weight_map": {tensor: shard file}}
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Optional, beside the reference files (the authors' loader ignores it): the held-out
# accepted-prefix profile {"accept": [P(first j drafts accepted) for j = 1..B-1], "tau": ...}
# that block_size="auto" reads.
ACCEPTANCE_NAME = "acceptance.json"
# Optional draft vocabulary (EAGLE-3's reduced draft vocabulary): with
# dflash_config.draft_vocab_size = K in config.json, this file beside it holds
# {"token_ids": [K sorted target token ids]} and drafts are the argmax over those rows of
# the target's LM head only (K/V of its cost). Verification is unchanged, so output is too.
DRAFT_VOCAB_NAME = "draft_vocab.json"


@dataclass
class Checkpoint:
    """What a checkpoint folder holds, checked against its config."""
    path: str
    config: DFlashConfig
    state: Dict[str, torch.Tensor]
    acceptance_profile: Optional[List[float]] = None
    draft_vocab: Optional[List[int]] = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights were written in."""
        return next(iter(self.state.values())).dtype


def read_checkpoint(path: str, cache_dir: Optional[str] = None, local_files_only: Optional[bool] = None,
                    revision: Optional[str] = None) -> Checkpoint:
    """Read a checkpoint from a local folder or a Hugging Face repo id (resolved through the
    local hub cache; a download is tried only when neither `local_files_only` nor
    HF_HUB_OFFLINE forbids it). Every error names the file (and the field or tensor)."""
    path = _resolve_checkpoint(path, cache_dir, local_files_only, revision)
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"drafter checkpoint {path} has no {CONFIG_NAME}")
    config = DFlashConfig.from_json_dict(_read_json(cfg_path), source=cfg_path)
    ckpt = Checkpoint(path, config, _read_weights(path))
    acc_path = os.path.join(path, ACCEPTANCE_NAME)
    if os.path.exists(acc_path):
        profile = _json_field(acc_path, "accept")
        if type(profile) is not list or len(profile) != config.block_size - 1 \
                or not all(type(p) in (int, float) and 0 <= p <= 1 for p in profile):
            raise ValueError(f"{acc_path}: 'accept' must hold block_size - 1 = {config.block_size - 1} "
                             f"probabilities, got {profile!r}")
        ckpt.acceptance_profile = [float(p) for p in profile]
    vocab_path = os.path.join(path, DRAFT_VOCAB_NAME)
    if config.draft_vocab_size is not None:
        if not os.path.exists(vocab_path):
            raise FileNotFoundError(f"{cfg_path} sets dflash_config.draft_vocab_size but {vocab_path} is missing")
        ids = _json_field(vocab_path, "token_ids")
        if type(ids) is not list or not all(type(i) is int for i in ids):
            raise ValueError(f"{vocab_path}: 'token_ids' must be a list of ints, got {str(ids)[:80]}")
        if len(ids) != config.draft_vocab_size:
            raise ValueError(f"{vocab_path} holds {len(ids)} token ids, dflash_config.draft_vocab_size "
                             f"says {config.draft_vocab_size}")
        ckpt.draft_vocab = ids
    elif os.path.exists(vocab_path):
        raise ValueError(f"{vocab_path} exists but {cfg_path} has no dflash_config.draft_vocab_size")
    return ckpt


def _read_json(path: str):
    """A JSON file's contents; a file that is not JSON is an error naming it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _json_field(path: str, key: str):
    """`key` of the JSON object in `path`; its absence is an error naming both."""
    d = _read_json(path)
    if type(d) is not dict or key not in d:
        raise ValueError(f"{path} must hold a JSON object with '{key}', got {str(d)[:80]}")
    return d[key]


def _weight_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The weight files the format names, and the index's tensor -> shard map (None without
    one): model.safetensors, else the shards that a Hugging Face sharded index
    (model.safetensors.index.json) maps the tensors to. Any other .safetensors file in the
    folder is not the checkpoint's and is not read."""
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.exists(single):
        return [single], None
    index_path = os.path.join(path, WEIGHTS_INDEX_NAME)
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"drafter checkpoint {path} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
    weight_map = _json_field(index_path, "weight_map")
    if type(weight_map) is not dict or not weight_map \
            or not all(type(f) is str and os.path.basename(f) == f for f in weight_map.values()):
        raise ValueError(f"{index_path}: 'weight_map' must map each tensor name to a shard file in the folder")
    shards = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    for shard in shards:
        if not os.path.exists(shard):
            raise FileNotFoundError(f"{index_path} names the shard {shard}, which is missing")
    return shards, weight_map


def _read_weights(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of the checkpoint's weight files: each readable, each tensor in the file
    the index maps it to, each value finite (a NaN or inf weight drafts garbage that
    verification would only hide as a slow run)."""
    from safetensors.torch import load_file

    files, weight_map = _weight_files(path)
    state = {}
    for file in files:
        try:
            tensors = load_file(file)
        except Exception as e:  # safetensors' own error types: truncated, garbled, bad header
            raise ValueError(f"drafter checkpoint {file} is not a readable safetensors file: "
                             f"{type(e).__name__}: {e}") from e
        if weight_map is not None:
            mapped = {n for n, f in weight_map.items() if f == os.path.basename(file)}
            if set(tensors) != mapped:
                raise ValueError(f"drafter checkpoint {file} does not hold the tensors {WEIGHTS_INDEX_NAME} "
                                 f"maps to it: missing {sorted(mapped - set(tensors))[:8]}, "
                                 f"not in the index {sorted(set(tensors) - mapped)[:8]}")
        for name, t in tensors.items():
            if t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    raise ValueError(f"drafter checkpoint {file}: tensor {name} has {bad} non-finite values "
                                     f"(NaN/inf)")
        state.update(tensors)
    return state


def write_checkpoint(path: str, config: DFlashConfig, state: Dict[str, torch.Tensor],
                     acceptance_profile: Optional[List[float]] = None,
                     draft_vocab: Optional[List[int]] = None) -> None:
    """Write the reference format (`state`: CPU tensors, contiguous, in the dtype to store)
    and our optional files; a draft vocabulary file of an earlier save is removed."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    d = config.to_json_dict()
    d["torch_dtype"] = str(state["fc.weight"].dtype).replace("torch.", "")
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(d, f, indent=2)
    save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    if acceptance_profile is not None:
        with open(os.path.join(path, ACCEPTANCE_NAME), "w") as f:
            json.dump({"accept": acceptance_profile}, f)
    vocab_path = os.path.join(path, DRAFT_VOCAB_NAME)
    if draft_vocab is not None:
        with open(vocab_path, "w") as f:
            json.dump({"token_ids": draft_vocab}, f)
    elif os.path.exists(vocab_path):
        os.remove(vocab_path)  # a stale vocabulary of an earlier save


def torch_dtype(dtype) -> Optional[torch.dtype]:
    """A torch dtype from a dtype, its name ("bfloat16", "torch.float32"), or "auto"/None
    (None: keep the checkpoint's)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        named = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype")
        return named
    return dtype


def _resolve_checkpoint(path: str, cache_dir, local_files_only, revision) -> str:
    """A local folder as it is; anything else is a Hugging Face repo id looked up in the
    local hub cache (huggingface_hub), fetched only where that is allowed."""
    if os.path.isdir(path):
        return path
    if path.startswith((".", "/", "~")) or path.count("/") > 1:  # a path, not an "org/name" repo id
        raise FileNotFoundError(f"drafter checkpoint directory not found: {path}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = constants.HF_HUB_OFFLINE if local_files_only is None else local_files_only
    patterns = [CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME, ACCEPTANCE_NAME, DRAFT_VOCAB_NAME]
    try:
        return snapshot_download(path, cache_dir=cache_dir, revision=revision, local_files_only=True,
                                 allow_patterns=patterns)
    except HFValidationError:
        raise FileNotFoundError(f"drafter checkpoint directory not found: {path}") from None
    except Exception as cached_error:  # not in the cache
        if offline:
            raise FileNotFoundError(
                f"drafter checkpoint {path!r} is neither a local folder nor in the local Hugging Face cache "
                f"({cache_dir or constants.HF_HUB_CACHE}); offline (HF_HUB_OFFLINE / local_files_only), so it "
                f"is not downloaded") from cached_error
    try:
        return snapshot_download(path, cache_dir=cache_dir, revision=revision, allow_patterns=patterns)
    except Exception as e:
        raise FileNotFoundError(f"drafter checkpoint {path!r} is neither a local folder nor in the local Hugging "
                                f"Face cache, and fetching it failed: {type(e).__name__}: {e}") from e
