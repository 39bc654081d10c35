"""The DFlash drafter: N Qwen3-style decoder layers whose non-causal attention sees the
target's projected hidden states as a per-layer context KV cache.

Checkpoints use the reference format (z-lab/dflash ``DFlashDraftModel``): a Qwen3
``config.json`` plus ``block_size``, ``num_target_layers`` and ``dflash_config``
(``target_layer_ids``, ``mask_token_id``), and safetensors weights named
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``. The embedding and LM head are the target's.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops, reference

__all__ = ["DFlashConfig", "DFlashDrafter", "DraftCache", "default_target_layer_ids", "default_mask_token_id",
           "effective_windows"]

WEIGHTS_NAME = "model.safetensors"
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


def default_target_layer_ids(num_target_layers: int, k: int) -> List[int]:
    """k target layers spread evenly from layer 1 to layer L-3 (the reference's rule)."""
    if k == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]


# What each config.json key of the reference format does here. A key outside these lists
# changes the drafted function in some implementation and is rejected at load.
_QWEN3_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
               "rope_scaling", "rope_theta", "sliding_window", "use_sliding_window", "max_window_layers",
               "layer_types")
_DFLASH_KEYS = ("block_size", "num_target_layers", "dflash_config")
# Metadata, training-only settings, and parts the drafter does not have (embedding, LM head).
_INERT_KEYS = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "initializer_range",
               "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
               "tie_word_embeddings", "auto_map", "_name_or_path"}
# Honoured at these values only (the authors' code reads the DFlash ones from dflash_config or the top level).
_FIXED_VALUES = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                 "is_causal": (None, False), "input_embedding_scale": (None, 1, 1.0),
                 "output_multiplier": (None, 1, 1.0), "final_logit_softcapping": (None, 0, 0.0)}
_DFLASH_INNER_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "draft_vocab_size"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _qwen3_config(**fields):
    """transformers' Qwen3Config: it standardises rope (rope_parameters in 5.x, rope_scaling
    / rope_theta in 4.x), layer_types and the sliding window exactly as the authors'
    Qwen3-based DFlashDraftModel sees them, defaults included."""
    from transformers import Qwen3Config

    return Qwen3Config(**fields)


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    # transformers' standardised rope dict (rope_type, rope_theta, scaling fields); None =
    # Qwen3Config's default, so the default theta lives in one place: transformers.
    rope_parameters: Optional[dict] = None
    max_position_embeddings: int = 40960
    sliding_window: Optional[int] = None  # window of the "sliding_attention" layers (None = none)
    layer_types: Optional[List[str]] = None  # per layer: full_attention | sliding_attention
    draft_vocab_size: Optional[int] = None  # tokens of the draft vocabulary (None: the whole vocabulary)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids must name at least one target layer")
        bad = [l for l in self.target_layer_ids if not 0 <= l < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's "
                             f"{self.num_target_layers} layers")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"dflash_config.draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if self.sliding_window else "full_attention"] \
                * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or \
                not set(self.layer_types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types must name full_attention or sliding_attention for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        hf = self.hf_config()  # validates the rope parameters as transformers does
        self.rope_parameters = dict(hf.rope_parameters)
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if self.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported (the fused ops rotate the whole head)")

    def hf_config(self):
        return _qwen3_config(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters) if self.rope_parameters else None,
            use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window,
            layer_types=list(self.layer_types))

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def layer_windows(self) -> List[int]:
        """Per layer: how many of the last context rows it sees (0 = all of them)."""
        return [self.sliding_window if t == "sliding_attention" and self.sliding_window else 0
                for t in self.layer_types]

    @property
    def rope_position_limit(self) -> Optional[int]:
        """dynamic and longrope recompute every frequency from the whole sequence length once
        it passes this many positions; an incremental context cache cannot follow that."""
        t = self.rope_parameters.get("rope_type", "default")
        if t == "dynamic":
            return self.max_position_embeddings
        if t == "longrope":
            return self.rope_parameters.get("original_max_position_embeddings", self.max_position_embeddings)
        return None

    def to_json_dict(self) -> dict:
        """The reference format: a Qwen3 config plus the DFlash fields."""
        rope = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        sliding = "sliding_attention" in self.layer_types and self.sliding_window is not None
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id,
                              **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {})},
            "sliding_window": self.sliding_window if sliding else None,
            "use_sliding_window": sliding,
        }
        if rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = rope  # read by transformers 4.x and 5.x alike
        if sliding:
            d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> "DFlashConfig":
        def need(key):
            if key not in d:
                raise ValueError(f"drafter config.json lacks '{key}'")
            return d[key]

        dflash = need("dflash_config")
        _reject_unsupported(d, dflash)
        need("num_attention_heads"), need("hidden_size")
        hf = _qwen3_config(**{k: d[k] for k in _QWEN3_KEYS if k in d})
        return cls(
            hidden_size=hf.hidden_size, num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
            head_dim=d.get("head_dim") or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            num_target_layers=need("num_target_layers"),
            target_layer_ids=list(dflash.get("target_layer_ids") or []),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(dflash.get("block_size", d.get("block_size", 16))),
            draft_vocab_size=int(dflash["draft_vocab_size"]) if dflash.get("draft_vocab_size") is not None else None,
            rms_norm_eps=hf.rms_norm_eps, rope_parameters=dict(hf.rope_parameters),
            max_position_embeddings=hf.max_position_embeddings,
            sliding_window=hf.sliding_window if "sliding_attention" in hf.layer_types else None,
            layer_types=list(hf.layer_types),
        )


def _reject_unsupported(d: dict, dflash: dict) -> None:
    """A config field that changes the drafted function and is not implemented here is an
    error at load, never silently ignored."""
    problems = []
    known = set(_QWEN3_KEYS) | set(_DFLASH_KEYS) | _INERT_KEYS | set(_FIXED_VALUES)
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        problems.append(f"unsupported fields {unknown}")
    unknown_inner = sorted(k for k in dflash if k not in _DFLASH_INNER_KEYS | set(_FIXED_VALUES))
    if unknown_inner:
        problems.append(f"unsupported dflash_config fields {unknown_inner}")
    for key, allowed in _FIXED_VALUES.items():
        for where, src in (("", d), ("dflash_config.", dflash)):
            if key in src and src[key] not in allowed:
                problems.append(f"{where}{key}={src[key]!r} (supported: {[a for a in allowed if a is not None]})")
    if problems:
        raise ValueError("drafter config.json: " + "; ".join(problems)
                         + " (README, 'Checkpoints': what is supported)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(H, c.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)

    def forward(self, x, cos, sin, attend):
        """One decoder layer over block tokens ``x [..., H]`` at RoPE ``cos/sin`` (broadcast
        over heads). ``attend(q [..., Hq, D], k, v [..., Hkv, D])`` returns ``[..., Hq, D]``:
        the attention over the layer's context plus these block keys (inference and
        training supply it differently; everything else is the same code)."""
        Hq, Hkv, D = self.heads
        lead = x.shape[:-1]
        a = self.self_attn
        h = self.input_layernorm(x)
        q = reference.apply_rope(a.q_norm(a.q_proj(h).view(*lead, Hq, D)), cos, sin)
        k = reference.apply_rope(a.k_norm(a.k_proj(h).view(*lead, Hkv, D)), cos, sin)
        v = a.v_proj(h).view(*lead, Hkv, D)
        x = x + a.o_proj(attend(q, k, v).reshape(*lead, Hq * D))
        return x + self.mlp(self.post_attention_layernorm(x))


def effective_windows(config: DFlashConfig, draft_window: Optional[int] = None) -> List[int]:
    """Per layer, the number of last context rows it sees (0 = all): a sliding_attention
    layer its `sliding_window`, a full_attention layer everything. `draft_window` (like
    the authors' --draft-sliding-window-size) caps every layer's view, full ones included,
    for long contexts."""
    if draft_window is not None and draft_window < 1:
        raise ValueError(f"draft_window must be >= 1 (or None), got {draft_window}")
    if not draft_window:
        return config.layer_windows
    return [min(w, draft_window) if w else draft_window for w in config.layer_windows]


class DraftCache:
    """The drafter's context KV cache: ``[N, batch * capacity, Hkv, D]`` for K and V;
    sequence b owns rows ``b * capacity .. (b+1) * capacity - 1`` and ``lengths[b]`` of
    them hold accepted tokens. Only accepted tokens advance it. The lengths live twice:
    on the host (``lengths``, for slot arithmetic without reading the device) and in the
    persistent device tensor ``lens`` that the attention reads, updated in place (so a
    captured CUDA graph sees the current lengths)."""

    def __init__(self, config: DFlashConfig, batch_size: int, capacity: int, device, dtype,
                 draft_window: Optional[int] = None):
        shape = (config.num_hidden_layers, batch_size * capacity, config.num_key_value_heads,
                 config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.windows = effective_windows(config, draft_window)
        self._lengths = [0] * batch_size
        self.lens = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.offsets = torch.arange(batch_size, device=device, dtype=torch.long) * capacity

    @property
    def lengths(self) -> tuple:
        """Accepted tokens per sequence (read-only: change them with set_length / advance)."""
        return tuple(self._lengths)

    def set_length(self, b: int, n: int) -> None:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"sequence {b} cannot hold {n} tokens: the cache capacity is {self.capacity}")
        self._lengths[b] = n
        self.lens[b:b + 1].fill_(n)  # a device fill, no host round trip

    def advance(self, b: int, n: int) -> None:
        self.set_length(b, self._lengths[b] + n)

    def slots_for(self, b: int, n: int) -> torch.Tensor:
        """Cache rows for the next n tokens of sequence b (a full cache is an error)."""
        start = self._lengths[b]
        if start + n > self.capacity:
            raise RuntimeError(f"drafter context cache is full: sequence {b} holds {start} tokens, "
                               f"{n} more do not fit in its capacity of {self.capacity}")
        return torch.arange(b * self.capacity + start, b * self.capacity + start + n,
                            device=self.k.device, dtype=torch.long)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._stacked = None
        self._rope = None
        self._vocab_head = None
        self.acceptance_profile: Optional[List[float]] = None
        self.draft_vocab: Optional[torch.Tensor] = None  # sorted token ids (int64, CPU); see DRAFT_VOCAB_NAME

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                    mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                    seed: Optional[int] = 0, tokenizer=None, **overrides) -> "DFlashDrafter":
        """A fresh, randomly initialised drafter that fits a Hugging Face target config
        (`tokenizer`, when given, picks the mask token: :func:`default_mask_token_id`)."""
        L = target_config.num_hidden_layers
        heads = target_config.num_attention_heads
        config = DFlashConfig(
            hidden_size=target_config.hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size, vocab_size=target_config.vocab_size,
            num_target_layers=L,
            target_layer_ids=list(target_layer_ids) if target_layer_ids is not None
            else default_target_layer_ids(L, num_layers),
            mask_token_id=default_mask_token_id(target_config.vocab_size, tokenizer) if mask_token_id is None
            else mask_token_id,
            block_size=block_size, rms_norm_eps=target_config.rms_norm_eps,
            rope_parameters=_target_rope(target_config),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 40960),
        )
        for k, v in overrides.items():
            setattr(config, k, v)
        config.__post_init__()
        if seed is not None:
            torch.manual_seed(seed)
        drafter = cls(config)
        drafter.apply(_init_weights)
        return drafter

    @classmethod
    def from_pretrained(cls, path: str, device=None, dtype=None, cache_dir: Optional[str] = None,
                        local_files_only: Optional[bool] = None, revision: Optional[str] = None) -> "DFlashDrafter":
        """Load a reference-format checkpoint from a local folder or a Hugging Face repo id
        (resolved through the local hub cache; a download is tried only when neither
        `local_files_only` nor HF_HUB_OFFLINE forbids it). `dtype` is a torch dtype, its
        name, or "auto"/None (the checkpoint's dtype); `device` as in ``.to()``."""
        from safetensors.torch import load_file

        path = _resolve_checkpoint(path, cache_dir, local_files_only, revision)
        cfg_path = os.path.join(path, CONFIG_NAME)
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"drafter checkpoint {path} has no {CONFIG_NAME}")
        with open(cfg_path) as f:
            config = DFlashConfig.from_json_dict(json.load(f))
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"drafter checkpoint {path} has no .safetensors weights")
        state = {}
        for name in files:
            state.update(load_file(os.path.join(path, name)))
        drafter = cls(config)
        drafter.load_reference_state_dict(state)
        acc_path = os.path.join(path, ACCEPTANCE_NAME)
        if os.path.exists(acc_path):
            with open(acc_path) as f:
                profile = json.load(f)["accept"]
            if len(profile) != config.block_size - 1 or not all(0 <= p <= 1 for p in profile):
                raise ValueError(f"{acc_path}: 'accept' must hold block_size - 1 = {config.block_size - 1} "
                                 f"probabilities, got {profile}")
            drafter.acceptance_profile = [float(p) for p in profile]
        vocab_path = os.path.join(path, DRAFT_VOCAB_NAME)
        if config.draft_vocab_size is not None:
            if not os.path.exists(vocab_path):
                raise FileNotFoundError(f"{cfg_path} sets dflash_config.draft_vocab_size but {vocab_path} is missing")
            with open(vocab_path) as f:
                ids = json.load(f)["token_ids"]
            if len(ids) != config.draft_vocab_size:
                raise ValueError(f"{vocab_path} holds {len(ids)} token ids, dflash_config.draft_vocab_size "
                                 f"says {config.draft_vocab_size}")
            drafter.set_draft_vocab(ids)
        elif os.path.exists(vocab_path):
            raise ValueError(f"{vocab_path} exists but {cfg_path} has no dflash_config.draft_vocab_size")
        if isinstance(dtype, str) and dtype != "auto":
            named = getattr(torch, dtype.replace("torch.", ""), None)
            if not isinstance(named, torch.dtype):
                raise ValueError(f"dtype {dtype!r} is not a torch dtype")
            dtype = named
        dtype = None if dtype == "auto" else dtype
        # Default: the dtype the checkpoint was written in.
        return drafter.to(device=device, dtype=dtype or next(iter(state.values())).dtype)

    def load_reference_state_dict(self, state: dict) -> None:
        """Load weights named as in the reference checkpoint; any mismatch is an error."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint does not match its config: missing {missing[:8]}"
                             f"{'…' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                             f"{'…' if len(unexpected) > 8 else ''}")
        for name, t in state.items():
            if t.shape != own[name].shape:
                raise ValueError(f"drafter checkpoint tensor {name} has shape {tuple(t.shape)}, "
                                 f"the config needs {tuple(own[name].shape)}")
        self.load_state_dict(state)

    def save_pretrained(self, path: str, dtype: Optional[torch.dtype] = None) -> None:
        """Write the reference format; `dtype` (e.g. torch.bfloat16) converts the weights."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        config = self.config.to_json_dict()
        config["torch_dtype"] = str(dtype or self.fc.weight.dtype).replace("torch.", "")
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
        if self.acceptance_profile is not None:
            with open(os.path.join(path, ACCEPTANCE_NAME), "w") as f:
                json.dump({"accept": self.acceptance_profile}, f)
        vocab_path = os.path.join(path, DRAFT_VOCAB_NAME)
        if self.draft_vocab is not None:
            with open(vocab_path, "w") as f:
                json.dump({"token_ids": self.draft_vocab.tolist()}, f)
        elif os.path.exists(vocab_path):
            os.remove(vocab_path)  # a stale vocabulary of an earlier save

    def set_draft_vocab(self, token_ids) -> None:
        """Draft only these target tokens (sorted, unique, in range), or all of them (None)."""
        if token_ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        V = self.config.vocab_size
        if ids.dim() != 1 or ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) \
                or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"draft vocabulary token_ids must be sorted, unique ids in [0, {V}), got "
                             f"{ids.numel()} ids from {ids.min().item() if ids.numel() else None} to "
                             f"{ids.max().item() if ids.numel() else None}")
        self.draft_vocab, self.config.draft_vocab_size = ids, ids.numel()

    def add_layers(self, n: int) -> None:
        """Append `n` decoder layers (of the last layer's attention type) whose output
        projections (o_proj, down_proj) start at zero: a new layer adds nothing to the
        residual stream yet, so the drafter drafts exactly as before, and training grows the
        layers from there (more capacity for a drafter that underfits, without starting over)."""
        if n < 1:
            raise ValueError(f"add_layers needs n >= 1, got {n}")
        c = self.config
        c.layer_types = list(c.layer_types) + [c.layer_types[-1]] * n
        c.num_hidden_layers += n
        p = self.fc.weight
        for _ in range(n):
            layer = DecoderLayer(c)
            layer.apply(_init_weights)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
            self.layers.append(layer.to(device=p.device, dtype=p.dtype))

    def as_assistant(self, target=None, fused: bool = True, draft_window: Optional[int] = None):
        """An ``assistant_model`` for ``target.generate(..., assistant_model=...,
        speculation_type="dflash")`` (transformers 5.x), drafting with this drafter and the
        fused ops (:mod:`dflash_ext.hf_assistant`). With `target`, the fit is checked now."""
        from .hf_assistant import DFlashAssistant

        if target is not None:
            self.check_fits(target.config)
        return DFlashAssistant(self, fused=fused, draft_window=draft_window)

    def check_fits(self, target_config) -> None:
        """Raise a clear error when this drafter was not built for `target_config`."""
        c = self.config
        problems = []
        if c.hidden_size != target_config.hidden_size:
            problems.append(f"hidden size {c.hidden_size} != target's {target_config.hidden_size}")
        if c.vocab_size != target_config.vocab_size:
            problems.append(f"vocab size {c.vocab_size} != target's {target_config.vocab_size}")
        L = target_config.num_hidden_layers
        if c.num_target_layers != L or max(c.target_layer_ids) >= L:
            problems.append(f"target layers {c.target_layer_ids} of {c.num_target_layers} do not fit "
                            f"a target with {L} layers")
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------------ state for the ops
    def new_cache(self, batch_size: int, capacity: int, draft_window: Optional[int] = None) -> DraftCache:
        p = self.fc.weight
        return DraftCache(self.config, batch_size, capacity, p.device, p.dtype, draft_window)

    def _stacked_kv_weights(self):
        """[N, Hkv*D, H] K and V weights and [N, D] k_norm weights of all layers, rebuilt
        only when a weight changed (training, loading, .to())."""
        params = [p for l in self.layers for p in (l.self_attn.k_proj.weight, l.self_attn.v_proj.weight,
                                                    l.self_attn.k_norm.weight)]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if self._stacked is None or self._stacked[0] != key:
            attn = [l.self_attn for l in self.layers]
            self._stacked = (key, torch.stack([a.k_proj.weight.detach() for a in attn]),
                             torch.stack([a.v_proj.weight.detach() for a in attn]),
                             torch.stack([a.k_norm.weight.detach() for a in attn]))
        return self._stacked[1:]

    def rope_tables(self, length: int):
        """cos, sin [P, D] covering positions < length, computed by transformers' own Qwen3
        rotary embedding from the config (every rope type it implements, with the attention
        scaling YaRN / longrope apply to cos and sin)."""
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        p = self.fc.weight
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != p.device \
                or self._rope[0].dtype != p.dtype:
            limit = self.config.rope_position_limit
            if limit is not None and length > limit:
                raise ValueError(
                    f"rope_type {self.config.rope_parameters['rope_type']!r} recomputes every frequency from the "
                    f"whole sequence length past {limit} positions; drafting at {length} positions is not supported")
            P = max(length, 2 * (self._rope[0].shape[0] if self._rope is not None else 512))
            P = min(P, limit) if limit is not None else P
            rotary = Qwen3RotaryEmbedding(self.config.hf_config())
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(P)[None])
            self._rope = (cos[0].to(p.device, p.dtype), sin[0].to(p.device, p.dtype))
        return self._rope

    # ------------------------------------------------------------------ the draft step
    @torch.no_grad()
    def add_context(self, cache: DraftCache, b: int, features: Sequence[torch.Tensor],
                    positions: torch.Tensor, fused: bool = True, rope=None, validate: bool = True) -> None:
        """Project the target features [T, H] (one per target layer) of T newly accepted
        tokens of sequence b at `positions` and write their K/V into every layer's cache.
        `rope`: the (cos, sin) tables to use, covering every position (None: rope_tables
        sized from `positions`, which reads them: a device sync on CUDA). `validate=False`
        lets the fused op skip its host-side index check (ops.py); a token skipped there
        for a bad position still counts in the cache length."""
        T = features[0].shape[0]
        if T == 0:
            return
        impl = ops if fused else reference
        eps = self.config.rms_norm_eps
        ctx = impl.project_features(list(features), self.fc.weight, self.hidden_norm.weight, eps)
        k_w, v_w, kn_w = self._stacked_kv_weights()
        cos, sin = rope if rope is not None else self.rope_tables(int(positions.max()) + 1)
        slots = cache.slots_for(b, T)
        args = (ctx, k_w, v_w, kn_w, cos, sin, positions, slots, cache.k, cache.v, eps)
        if fused:
            ops.inject_context_kv(*args, validate=validate)
        else:
            reference.inject_context_kv(*args)
        cache.advance(b, T)

    @torch.no_grad()
    def draft_hidden(self, cache: DraftCache, block_embeds: torch.Tensor, positions: torch.Tensor,
                     fused: bool = True, rope=None, validate: bool = True) -> torch.Tensor:
        """Run the N layers over the blocks ``block_embeds [Bsz, B, H]`` (target embeddings
        of [last accepted token, MASK...]) at ``positions [Bsz, B]``; returns the final-normed
        hidden states [Bsz, B, H]. Block K/V are scratch: the cache is not changed.
        `rope` and `validate` as in :meth:`add_context`; with ``validate=False`` the
        attention is planned for the cache's capacity (a static bound: CUDA graphs)."""
        cos, sin = rope if rope is not None else self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
        attention = ops.block_attention if fused else reference.block_attention
        fused_args = (-1 if validate else cache.capacity, validate) if fused else ()  # max_context, validate
        offsets, lens = cache.offsets, cache.lens
        scale = self.config.head_dim ** -0.5
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, lambda q, k, v: attention(q, k, v, cache.k[i], cache.v[i], offsets, lens,
                                                             scale, cache.windows[i], *fused_args))
        return self.norm(x)

    def draft_vocab_head(self, lm_head: nn.Module):
        """(token ids, weight rows, bias rows or None) of the draft vocabulary in the target's
        LM head, on its device and dtype; gathered once and cached until the head changes."""
        w = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        key = (w.data_ptr(), w._version, w.device, w.dtype, None if bias is None else (bias.data_ptr(), bias._version))
        if self._vocab_head is None or self._vocab_head[0] != key \
                or self._vocab_head[1] is not self.draft_vocab:
            ids = self.draft_vocab.to(w.device)
            self._vocab_head = (key, self.draft_vocab, ids, w.detach()[ids].contiguous(),
                                None if bias is None else bias.detach()[ids])
        return self._vocab_head[2:]

    # ------------------------------------------------------------------ training forward
    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Differentiable forward of all blocks of one sequence at once (training).

        features [S, k*H]: the target features of the sequence's S tokens (k layers
        concatenated); block_embeds [nb, B, H]: target embeddings of [anchor token, MASK...];
        anchors [nb]: block positions. Block a attends to the context rows at positions
        < anchors[a] and to its own B rows, exactly what the block drafted at anchors[a]
        sees at inference. The scores against the context, shared by all blocks, and
        against each block's own rows are one softmax ([nb, B, S + B] per head) without
        copying the context keys per block, so the cost grows linearly with the number of
        anchors. Returns final-normed hidden [nb, B, H].
        """
        from .training.recipe import context_mask

        c = self.config
        S = features.shape[0]
        nb, B, H = block_embeds.shape
        D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        group, scale = Hq // Hkv, D ** -0.5
        cos, sin = self.rope_tables(S + B)
        ctx = self.hidden_norm(self.fc(features))
        cos_c, sin_c = cos[:S, None, :], sin[:S, None, :]
        pos = anchors[:, None] + torch.arange(B, device=anchors.device)  # [nb, B]
        cos_b, sin_b = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
        hidden_ctx = {w: ~context_mask(anchors, S, w)[:, None, :] for w in set(c.layer_windows)}  # [nb, 1, S]
        x = block_embeds
        for layer, window in zip(self.layers, c.layer_windows):
            a = layer.self_attn
            k_ctx = reference.apply_rope(a.k_norm(a.k_proj(ctx).view(S, Hkv, D)), cos_c, sin_c)
            v_ctx = a.v_proj(ctx).view(S, Hkv, D)
            hidden = hidden_ctx[window]

            def attend(q, k, v):  # called within this iteration, so the closure sees this layer's tensors
                # q [nb, B, Hq, D]; k, v [nb, B, Hkv, D]; query head h reads kv head h // group
                q = q.reshape(nb, B, Hkv, group, D) * scale
                on_ctx = torch.einsum("nbhgd,shd->hgnbs", q, k_ctx).masked_fill(hidden, float("-inf"))
                on_own = torch.einsum("nbhgd,nchd->hgnbc", q, k)
                # [Hkv, group, nb, B, S + B], normalised in fp32 (CPU autocast would keep a bf16 softmax in bf16)
                p = torch.cat([on_ctx, on_own], -1).softmax(-1, dtype=torch.float32).to(v.dtype)
                o = (torch.einsum("hgnbs,shd->nbhgd", p[..., :S], v_ctx)
                     + torch.einsum("hgnbc,nchd->nbhgd", p[..., S:], v))
                return o.reshape(nb, B, Hq, D)

            x = layer(x, cos_b, sin_b, attend)
        return self.norm(x)


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
    patterns = [CONFIG_NAME, "*.safetensors", ACCEPTANCE_NAME]
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


def _target_rope(config) -> Optional[dict]:
    """The target's rope as a rope_parameters dict (transformers 5.x keeps it standardised;
    4.x configs have rope_scaling + rope_theta)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
    if getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    return params


def default_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """The mask token of a fresh drafter: the tokenizer's own mask token where it has one;
    else the first embedding row no token of the tokenizer uses (vocabularies padded past
    the tokenizer); else the last vocab id (then a real token: nothing better exists)."""
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
            return int(tokenizer.mask_token_id)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    return vocab_size - 1


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
