"""Drafter checkpoints on disk, in the reference format (z-lab/dflash ``DFlashDraftModel``):
``config.json`` (:mod:`.config`) and safetensors weights named
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` (the embedding and LM head are the target's),
plus two optional files of ours beside them. A DFlash2 checkpoint (``DFlash2DraftModel``)
also has ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, T, H] and
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight`` [2*T*G, H],
``candidate_selector.hidden_projection.weight`` [R, H] and the raw (no ``.weight``)
``candidate_selector.{predecessor,successor}_codebook`` [V, R]. Resolving a path or hub id, reading and
writing: the module that builds the drafter from them is :mod:`.drafter`.
"""
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from .atomic_files import write_file_atomically, write_folder_atomically
from .config import DFlashConfig

__all__ = ["Checkpoint", "read_checkpoint", "write_checkpoint", "check_weights", "torch_dtype", "WEIGHTS_NAME",
           "CONFIG_NAME", "ACCEPTANCE_NAME", "DRAFT_VOCAB_NAME", "WEIGHTS_INDEX_NAME", "acceptance_json",
           "write_acceptance", "VLLM_D2T_NAME", "VLLM_LM_HEAD_NAME"]

WEIGHTS_NAME = "model.safetensors"
# Hugging Face's sharded form, read when there is no WEIGHTS_NAME: {"weight_map": {tensor: shard file}}
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Optional, beside the reference files (the authors' loader ignores it): the held-out
# accepted-prefix profile {"accept": [P(first j drafts accepted) for j = 1..B-1]} and, where
# measured, "walked_tau": [tokens per step as the decoding loop walks, at verify B = 2..B]:
# what block_size="auto" reads.
ACCEPTANCE_NAME = "acceptance.json"
# Optional draft vocabulary (EAGLE-3's reduced draft vocabulary): with
# dflash_config.draft_vocab_size = K in config.json, this file beside it holds
# {"token_ids": [K sorted target token ids]} and drafts are the argmax over those rows of
# the target's LM head only (K/V of its cost). Verification is unchanged, so output is too.
DRAFT_VOCAB_NAME = "draft_vocab.json"
# The same vocabulary as vLLM's DFlash loader reads it (EAGLE-3's fields; written by
# export --for vllm, model/vllm_format.py): the top-level draft_vocab_size K, a tensor
# "d2t" [K] int64 (draft row i is target token i + d2t[i]) and "lm_head.weight" [K, H]
# (the target's LM head rows of those tokens). Checked against draft_vocab.json at load and
# kept out of the drafter's weights: our loop drafts with the target's own head.
VLLM_D2T_NAME = "d2t"
VLLM_LM_HEAD_NAME = "lm_head.weight"


@dataclass
class Checkpoint:
    """What a checkpoint folder holds, checked against its config."""
    path: str
    config: DFlashConfig
    state: Dict[str, torch.Tensor]
    acceptance_profile: Optional[List[float]] = None
    draft_vocab: Optional[List[int]] = None
    walked_tau: Optional[List[float]] = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights were written in: the one that holds most of their elements
        (a bf16 checkpoint with a norm kept in fp32 is a bf16 checkpoint; a tie goes to the
        wider dtype). A load under dtype=None/"auto" casts every weight to it."""
        elements: Dict[torch.dtype, int] = {}
        for t in self.state.values():
            elements[t.dtype] = elements.get(t.dtype, 0) + t.numel()
        return max(elements, key=lambda d: (elements[d], torch.finfo(d).bits))


def read_checkpoint(path: str, cache_dir: Optional[str] = None, local_files_only: Optional[bool] = None,
                    revision: Optional[str] = None) -> Checkpoint:
    """Read a checkpoint from a local folder or a Hugging Face repo id (resolved through the
    local hub cache; a download is tried only when neither `local_files_only` nor
    HF_HUB_OFFLINE forbids it). Every error names the file (and the field or tensor)."""
    path = _resolve_checkpoint(path, cache_dir, local_files_only, revision)
    config, cfg_path = _read_config(path), os.path.join(path, CONFIG_NAME)
    ckpt = Checkpoint(path, config, _read_weights(path))
    acc_path = os.path.join(path, ACCEPTANCE_NAME)
    if os.path.exists(acc_path):
        ckpt.acceptance_profile, ckpt.walked_tau = _read_acceptance(acc_path, config.block_size)
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
    if not config.is_deepspec:  # DeepSpec's format has its own full LM head, not vLLM's K-row one
        _take_vllm_vocabulary(ckpt, "draft_vocab_size" in _read_json(cfg_path))
    return ckpt


def _take_vllm_vocabulary(ckpt: Checkpoint, top_level_size: bool) -> None:
    """Check vLLM's form of the draft vocabulary (:data:`VLLM_D2T_NAME`) against
    draft_vocab.json and take its tensors out of ``ckpt.state``. `top_level_size`: config.json
    has the top-level draft_vocab_size, which vLLM reads as the rows of the drafter's own LM
    head, so it needs both tensors (without them vLLM would draft over the target's full head
    with a K-row offset table)."""
    d2t, head = ckpt.state.pop(VLLM_D2T_NAME, None), ckpt.state.pop(VLLM_LM_HEAD_NAME, None)
    where = f"drafter checkpoint {ckpt.path}"
    if d2t is None and head is None and not top_level_size:
        return
    if d2t is None or head is None or not top_level_size or ckpt.draft_vocab is None:
        raise ValueError(f"{where}: vLLM's draft vocabulary needs all of the top-level draft_vocab_size "
                         f"(present: {top_level_size}), the tensors {VLLM_D2T_NAME} (present: {d2t is not None}) "
                         f"and {VLLM_LM_HEAD_NAME} (present: {head is not None}), and {DRAFT_VOCAB_NAME} "
                         f"(present: {ckpt.draft_vocab is not None})")
    K, H = len(ckpt.draft_vocab), ckpt.config.hidden_size
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (K,):
        raise ValueError(f"{where}: tensor {VLLM_D2T_NAME} must be int64 of shape ({K},), got "
                         f"{str(d2t.dtype).replace('torch.', '')} {tuple(d2t.shape)}")
    if (torch.arange(K) + d2t).tolist() != ckpt.draft_vocab:
        raise ValueError(f"{where}: tensor {VLLM_D2T_NAME} maps the draft rows to other tokens than "
                         f"{DRAFT_VOCAB_NAME} lists (row i must be token i + {VLLM_D2T_NAME}[i])")
    if tuple(head.shape) != (K, H):
        raise ValueError(f"{where}: tensor {VLLM_LM_HEAD_NAME} has shape {tuple(head.shape)}, the draft "
                         f"vocabulary needs ({K}, {H})")


def _read_config(path: str) -> DFlashConfig:
    """The config.json of the checkpoint folder `path`, checked; its absence is an error naming the folder."""
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"drafter checkpoint {path} has no {CONFIG_NAME}")
    return DFlashConfig.from_json_dict(_read_json(cfg_path), source=cfg_path)


def _read_acceptance(path: str, block_size: int) -> Tuple[List[float], Optional[List[float]]]:
    """(accepted-prefix profile, walked tau per verify B or None) of an acceptance.json, each
    checked against the drafter's block size."""
    d = _json_object(path, "accept")
    profile, walked = d["accept"], d.get("walked_tau")
    if type(profile) is not list or len(profile) != block_size - 1 \
            or not all(type(p) in (int, float) and 0 <= p <= 1 for p in profile):
        raise ValueError(f"{path}: 'accept' must hold block_size - 1 = {block_size - 1} probabilities, got {profile!r}")
    if walked is not None and (type(walked) is not list or len(walked) != block_size - 1 or not all(
            type(t) in (int, float) and 1 <= t <= b for b, t in enumerate(walked, 2))):
        raise ValueError(f"{path}: 'walked_tau' must hold block_size - 1 = {block_size - 1} tokens per step, at "
                         f"verify B = 2..{block_size}, each in [1, B], got {walked!r}")
    return [float(p) for p in profile], None if walked is None else [float(t) for t in walked]


def acceptance_json(profile: List[float], walked_tau: Optional[List[float]] = None) -> bytes:
    """The contents of acceptance.json (:data:`ACCEPTANCE_NAME`)."""
    return json.dumps({"accept": profile, **({} if walked_tau is None else {"walked_tau": walked_tau})}).encode()


def write_acceptance(path: str, profile: List[float], walked_tau: Optional[List[float]] = None) -> None:
    """Replace the acceptance.json of the local checkpoint folder `path` alone (its weights and
    other files stay): checked against its config as a load checks it, then swapped in whole."""
    block_size = _read_config(path).block_size

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(acceptance_json(profile, walked_tau))
        _read_acceptance(tmp, block_size)  # a value a load would refuse: the old file stays

    write_file_atomically(os.path.join(path, ACCEPTANCE_NAME), write)


def _read_json(path: str):
    """A JSON file's contents; a file that is not JSON is an error naming it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _json_object(path: str, key: str) -> dict:
    """The JSON object in `path`, which must hold `key`: its absence is an error naming both."""
    d = _read_json(path)
    if type(d) is not dict or key not in d:
        raise ValueError(f"{path} must hold a JSON object with '{key}', got {str(d)[:80]}")
    return d


def _json_field(path: str, key: str):
    """`key` of the JSON object in `path` (:func:`_json_object`)."""
    return _json_object(path, key)[key]


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
        # d2t is vLLM's int64 offset table (_take_vllm_vocabulary checks it), not a weight
        check_weights({n: t for n, t in tensors.items() if n != VLLM_D2T_NAME}, f"drafter checkpoint {file}")
        state.update(tensors)
    return state


def check_weights(state: Dict[str, torch.Tensor], where: str) -> None:
    """ValueError (starting with `where`) unless every tensor is floating point and finite:
    a drafter has no integer or bool weights (read as numbers they would load as 0/1 or fail
    in a cast without a name), and a NaN or inf weight drafts garbage that verification would
    only hide as a slow run. Loads and saves apply the same rule, so a save never writes
    what a load refuses."""
    for name, t in state.items():
        if not t.is_floating_point():
            raise ValueError(f"{where}: tensor {name} is {str(t.dtype).replace('torch.', '')}; "
                             f"a drafter's weights are floating point")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{where}: tensor {name} has {bad} non-finite values (NaN/inf)")


def write_checkpoint(path: str, config: DFlashConfig, state: Dict[str, torch.Tensor],
                     acceptance_profile: Optional[List[float]] = None,
                     draft_vocab: Optional[List[int]] = None, *, walked_tau: Optional[List[float]] = None,
                     extra_files: Optional[Dict[str, Union[bytes, Callable[[str], None]]]] = None,
                     overwrite: bool = False) -> None:
    """Write the reference format (`state`: CPU tensors, contiguous, in the dtype to store),
    our optional files (`walked_tau` goes into acceptance.json beside the profile, so it needs
    one) and `extra_files` (name -> bytes, or a callable that writes the file
    at the path it is given) as one folder that replaces `path` atomically: a crash at any
    moment leaves the old folder or the new one, never a mix, and files of the old folder
    this save does not write (a stale acceptance.json or draft_vocab.json) are gone.

    A `path` that exists but does not look like a checkpoint folder (no config.json, or
    files a checkpoint folder never holds) is refused unless `overwrite`: the save would
    delete them."""
    from safetensors.torch import save_file

    path = os.path.abspath(os.fspath(path))
    extra_files = dict(extra_files or {})
    if not overwrite:
        _refuse_foreign_folder(path, set(extra_files))
    # What a load would refuse is refused before anything is written: the old folder stays.
    if walked_tau is not None and acceptance_profile is None:
        raise ValueError("walked_tau is written into acceptance.json beside the acceptance profile: it needs one")
    check_weights(state, f"refusing to save the drafter checkpoint {path}")
    d = config.to_json_dict()
    try:
        DFlashConfig.from_json_dict(json.loads(json.dumps(d)), source=os.path.join(path, CONFIG_NAME))
    except ValueError as e:
        raise ValueError(f"refusing to save the drafter checkpoint {path}: its config would not load: {e}") from e
    # metadata, in the key(s) the config has: a DeepSpec config written by transformers 5.x names it
    # "dtype" or, saved from a config alone, has none (written back as it was read)
    for key in [k for k in ("torch_dtype", "dtype") if k in d] or ([] if config.deepspec_json else ["torch_dtype"]):
        d[key] = str(state["fc.weight"].dtype).replace("torch.", "")
    files: Dict[str, Union[bytes, Callable[[str], None]]] = {
        CONFIG_NAME: json.dumps(d, indent=2).encode(),
        WEIGHTS_NAME: lambda p: save_file(state, p, metadata={"format": "pt"}),
    }
    if acceptance_profile is not None:
        files[ACCEPTANCE_NAME] = acceptance_json(acceptance_profile, walked_tau)
    if draft_vocab is not None:
        files[DRAFT_VOCAB_NAME] = json.dumps({"token_ids": draft_vocab}).encode()
    files.update(extra_files)
    write_folder_atomically(path, files)


# Files a checkpoint folder may hold besides the ones write_checkpoint writes (and weights in
# Hugging Face's sharded form): a model card (the shipped drafter has one, as Hugging Face
# repos do). A save replaces them too.
_CHECKPOINT_COMPANIONS = {"README.md", ".gitattributes"}


def _refuse_foreign_folder(path: str, extra_names: Set[str]) -> None:
    """ValueError where replacing `path` would delete something that is not a checkpoint of ours."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"cannot save a drafter checkpoint to {path}: it exists and is not a folder "
                         f"(pass overwrite=True to replace it)")
    names = sorted(os.listdir(path))
    if not names:
        return
    ours = {CONFIG_NAME, ACCEPTANCE_NAME, DRAFT_VOCAB_NAME} | _CHECKPOINT_COMPANIONS | extra_names
    foreign = [n for n in names if not (os.path.isfile(os.path.join(path, n))
                                        and (n in ours or n.endswith((".safetensors", ".safetensors.index.json"))))]
    if CONFIG_NAME not in names or foreign:
        shown = foreign or names
        raise ValueError(f"cannot save a drafter checkpoint to {path}: it is not a drafter checkpoint folder "
                         f"(it holds {', '.join(shown[:5])}{', ...' if len(shown) > 5 else ''}"
                         f"{'' if CONFIG_NAME in names else f' and no {CONFIG_NAME}'}) and a save replaces "
                         f"the whole folder; pass overwrite=True to replace it")


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
