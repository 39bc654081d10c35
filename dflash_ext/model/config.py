"""The drafter's config: :class:`DFlashConfig`, what each ``config.json`` field of the
reference format (z-lab/dflash ``DFlashDraftModel``: a Qwen3 config plus ``block_size``,
``num_target_layers`` and ``dflash_config``) means here, which layers attend causally
(:attr:`DFlashConfig.layer_causal`: the rule SGLang, vLLM, TensorRT-LLM and the authors'
code share), and which fields are rejected because they change the drafted function in
some implementation and are not implemented (those field rules: :mod:`.config_fields`).
DFlash2 checkpoints (``architectures: ["DFlash2DraftModel"]``) add the block convolution and
candidate selector fields (:data:`DFLASH2_FIELDS`); docs/checkpoints.md, "DFlash2".
"""
import math
from dataclasses import dataclass, field, fields
from typing import List, Optional, Sequence

from .config_fields import (DFLASH2_ARCHITECTURE, DFLASH2_FIELDS, LAYER_TYPES, SUPPORTED_ROPE_TYPES,
                            DFLASH2_LOGIT_FIELDS, DFLASH2_RULES, FIELD_RULES, check_field, check_json_fields,
                            explicit_causal, qwen3_config, qwen3_fields, reject_unsupported)
from .deepspec_config import (DEEPSPEC_ARCHITECTURES, check_deepspec_config, deepspec_config_fields,
                              deepspec_json_dict)

__all__ = ["DFlashConfig", "default_target_layer_ids", "default_mask_token_id", "target_text_config",
           "SUPPORTED_ROPE_TYPES", "DFLASH2_ARCHITECTURE", "DFLASH2_FIELDS"]


def default_target_layer_ids(num_target_layers: int, k: int) -> List[int]:
    """k target layers spread evenly from layer 1 to layer L-3 (the reference's rule), each
    once: on a target with fewer than k such layers the rule repeats one, which adds nothing
    to the drafter's input and is rejected in a config (so fewer than k are returned). On a
    target of fewer than 4 layers the rule reaches below layer 0: its ids are kept inside
    the target's layers [0, L)."""
    for name, value in (("num_target_layers", num_target_layers), ("k", k)):
        if type(value) is not int or value < 1:  # bool too
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if k == 1:
        return [num_target_layers // 2]
    spread = [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]
    return sorted({min(max(i, 0), num_target_layers - 1) for i in spread})


# The config-field rules (what each config.json key does here, each value's type and range,
# what is rejected) are config_fields.py's.
try:  # what transformers 5.x's strict config dataclasses raise on a wrongly typed field
    from huggingface_hub.errors import StrictDataclassError as _TransformersConfigError
except ImportError:
    _TransformersConfigError = ValueError


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
    # Every layer causal (True) or bidirectional (False); None: by layer type (layer_causal).
    causal: Optional[bool] = None
    # DFlash2 (all four set, or none: a v1 drafter): taps T of the block convolution, channels
    # per dynamic coefficient (divides hidden_size), the selector's rank R and candidates per slot K.
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    # DFlash2's transform of the LM head's logits before the selector: u = logits * multiplier,
    # then cap * tanh(u / cap) when a cap is set. A v1 drafter keeps 1 and None.
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # DeepSpec's format (Qwen3DSparkModel; .deepspec_config): its own embedding and LM head, and
    # every block slot drafts (slot k the token at anchor + k + 1). DSpark's heads: a Markov
    # head over the previous token (markov_rank > 0, of markov_head_type) and a confidence
    # head, its input [h_k; W1[previous]] with confidence_head_with_markov, else h_k. None and
    # their defaults: the reference format.
    deepspec_architecture: Optional[str] = None
    num_anchors: Optional[int] = None  # DeepSpec's training setting, kept for the save
    markov_rank: int = 0
    markov_head_type: Optional[str] = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # the DeepSpec config.json this config was read from: a save writes its keys back
    deepspec_json: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for f in fields(self):  # each value's type and range (FIELD_RULES); None where it is the default
            value = getattr(self, f.name)
            if f.name in FIELD_RULES and not (value is None and f.default is None):
                check_field(f.name, value, FIELD_RULES[f.name])
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids must name at least one target layer")
        bad = [l for l in self.target_layer_ids if not 0 <= l < self.num_target_layers]
        if bad:
            raise ValueError(f"dflash_config.target_layer_ids {bad} are outside the target's "
                             f"{self.num_target_layers} layers (num_target_layers)")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"dflash_config.target_layer_ids {list(self.target_layer_ids)} name a layer twice")
        if not self.mask_token_id < self.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id={self.mask_token_id} must be a token id in "
                             f"[0, vocab_size={self.vocab_size})")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"dflash_config.draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        self._check_dflash2()
        check_deepspec_config(self)
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if self.sliding_window else "full_attention"] \
                * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must name full_attention or sliding_attention for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        hf = self.hf_config()  # validates the rope parameters as transformers does
        self.rope_parameters = dict(hf.rope_parameters)
        check_field("rope_theta", self.rope_parameters.get("rope_theta"), FIELD_RULES["rope_theta"])
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if self.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported (the fused ops rotate the whole head)")

    def _check_dflash2(self) -> None:
        """DFlash2's fields: all or none of DFLASH2_FIELDS, each in range and fitting the
        other fields; the logit transform only with them."""
        given = [getattr(self, k) is not None for k in DFLASH2_FIELDS]
        if any(given) and not all(given):
            missing = [k for k, g in zip(DFLASH2_FIELDS, given) if not g]
            raise ValueError(f"a DFlash2 drafter needs dflash_config.{', dflash_config.'.join(missing)}")
        if not self.is_dflash2:
            if self.output_multiplier != 1 or self.final_logit_softcapping is not None:
                raise ValueError("output_multiplier and final_logit_softcapping are DFlash2 fields "
                                 f"({DFLASH2_ARCHITECTURE}); a DFlash drafter keeps 1 and None")
            return
        for key, rule in DFLASH2_RULES.items():
            check_field(f"dflash_config.{key}", getattr(self, key), rule)
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"dflash_config.conv_group_size={self.conv_group_size} must divide "
                             f"hidden_size={self.hidden_size}")
        if self.conv_kernel_size > self.block_size:  # SpecForge's rule: a tap past the block reads nothing
            raise ValueError(f"dflash_config.conv_kernel_size={self.conv_kernel_size} must be <= "
                             f"block_size={self.block_size}")
        candidates = self.draft_vocab_size or self.vocab_size
        if self.selector_top_k > candidates:
            which = "draft_vocab_size" if self.draft_vocab_size else "vocab_size"
            raise ValueError(f"dflash_config.selector_top_k={self.selector_top_k} must be <= {which}={candidates}")

    @property
    def is_deepspec(self) -> bool:
        """A drafter in DeepSpec's format (DSpark, or DeepSpec's DFlash without the heads)."""
        return self.deepspec_architecture is not None

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter (block convolution and candidate selector)."""
        return self.conv_kernel_size is not None

    @property
    def conv_groups(self) -> int:
        """G: channel groups of the block convolution's dynamic coefficients."""
        return self.hidden_size // self.conv_group_size

    def hf_config(self):
        return qwen3_config(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            rms_norm_eps=float(self.rms_norm_eps), max_position_embeddings=self.max_position_embeddings,
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
    def layer_causal(self) -> List[bool]:
        """Per layer: whether its block queries attend causally. The engines' rule: an explicit
        `causal` (is_causal / dflash_config.is_causal / dflash_config.causal) sets every layer;
        else a sliding_attention layer is causal and a full_attention layer bidirectional.
        Causal: the query at position p sees the keys at positions p - W < k <= p (W its
        window, 0 = no bound) over the context followed by the block; bidirectional: the
        whole context and block, or with a window (a sliding layer of a bidirectional
        config, as DFlash2's published ones) the keys at |p - k| < W, as the authors' code
        and TensorRT-LLM give it (drafter.windowed_bidirectional_attention)."""
        if self.causal is not None:
            return [self.causal] * self.num_hidden_layers
        return [t == "sliding_attention" for t in self.layer_types]

    @property
    def layer_symmetric_window(self) -> List[bool]:
        """Per layer: whether it is bidirectional with a window (|p - k| < W per query)."""
        return [bool(w) and not c for w, c in zip(self.layer_windows, self.layer_causal)]

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
        """The reference format: a Qwen3 config plus the DFlash fields (DeepSpec's format for
        a DeepSpec drafter: :func:`.deepspec_config.deepspec_json_dict`)."""
        rope = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        sliding = "sliding_attention" in self.layer_types and self.sliding_window is not None
        # Sliding layers without a window are still causal (layer_causal): their types are saved too.
        typed = "sliding_attention" in self.layer_types
        d = {
            "architectures": [DFLASH2_ARCHITECTURE if self.is_dflash2 else "DFlashDraftModel"],
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
        if typed:
            d["layer_types"] = list(self.layer_types)
        if self.causal is not None:
            d["is_causal"] = self.causal  # the field every engine reads first
        if self.is_dflash2:
            d["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_FIELDS},
                                      output_multiplier=self.output_multiplier)
            if self.final_logit_softcapping is not None:
                d["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        return deepspec_json_dict(self, d) if self.is_deepspec else d

    @classmethod
    def from_json_dict(cls, d: dict, source: str = "config.json") -> "DFlashConfig":
        """The config of a drafter config.json's contents `d`; every error names `source` (the
        file it was read from) and the field."""
        try:
            return cls._from_json_dict(d)
        except (ValueError, TypeError, KeyError, _TransformersConfigError) as e:
            raise ValueError(f"drafter config {source}: {e}") from e

    @classmethod
    def _from_json_dict(cls, d: dict) -> "DFlashConfig":
        def need(src, key, prefix=""):
            if key not in src:
                raise ValueError(f"lacks '{prefix}{key}'")
            return src[key]

        if type(d) is not dict:
            raise ValueError(f"must hold a JSON object, got {type(d).__name__}")
        if type(d.get("architectures")) is list and d["architectures"][:1] \
                and d["architectures"][0] in DEEPSPEC_ARCHITECTURES:
            return cls(**deepspec_config_fields(d))
        dflash = need(d, "dflash_config")
        if type(dflash) is not dict:
            raise ValueError(f"dflash_config must be a JSON object, got {dflash!r}")
        dflash2 = d.get("architectures") == [DFLASH2_ARCHITECTURE]
        reject_unsupported(d, dflash, dflash2)
        for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                    "num_target_layers"):
            need(d, key)
        need(dflash, "mask_token_id", "dflash_config.")
        check_json_fields(d, dflash, {**FIELD_RULES, **DFLASH2_RULES} if dflash2 else FIELD_RULES)
        v2 = {}
        if dflash2:  # in dflash_config or at the top level (the authors' code reads both)
            for key in DFLASH2_FIELDS:
                v2[key] = _in_either_place(d, dflash, key) if key in dflash or key in d \
                    else need(d, key, "dflash_config.")
            for key in DFLASH2_LOGIT_FIELDS:
                if key in dflash or key in d:
                    v2[key] = _in_either_place(d, dflash, key)
            if v2.get("output_multiplier") is None:
                v2["output_multiplier"] = 1.0
        qwen3, hf = qwen3_fields(d)
        return cls(
            **qwen3, target_layer_ids=list(dflash.get("target_layer_ids") or []),
            mask_token_id=dflash["mask_token_id"],
            block_size=_in_either_place(d, dflash, "block_size") if "block_size" in dflash or "block_size" in d
            else 16,
            draft_vocab_size=_in_either_place(d, dflash, "draft_vocab_size")
            if "draft_vocab_size" in dflash or "draft_vocab_size" in d else None,
            sliding_window=hf.sliding_window if "sliding_attention" in hf.layer_types else None,
            layer_types=list(hf.layer_types), causal=explicit_causal(d, dflash), **v2,
        )

    @classmethod
    def for_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                   mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                   tokenizer=None, **overrides) -> "DFlashConfig":
        """The config of a fresh drafter that fits a Hugging Face target config, shaped as the
        authors' drafters are: Qwen3 layers of the target's width over its text config (the
        decoder of a composite model), full rotary at the target's rope theta and scaling
        (:func:`_target_rope`), attention heads by :func:`_drafter_heads`. `tokenizer`, when
        given, picks the mask token (:func:`default_mask_token_id`); `overrides` set any other field."""
        if type(num_layers) is not int or num_layers < 1:  # bool too; before the layer rule reads it as k
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        t = target_text_config(target_config)
        L = t.num_hidden_layers
        heads, kv_heads, head_dim = _drafter_heads(t)
        config = cls(
            hidden_size=t.hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            # MoE configs without a dense MLP size (qwen3_5_moe): Qwen3's 3x
            intermediate_size=getattr(t, "intermediate_size", None) or 3 * t.hidden_size,
            vocab_size=t.vocab_size, num_target_layers=L,
            target_layer_ids=list(target_layer_ids) if target_layer_ids is not None
            else default_target_layer_ids(L, num_layers),
            mask_token_id=default_mask_token_id(t.vocab_size, tokenizer) if mask_token_id is None
            else mask_token_id,
            block_size=block_size, rms_norm_eps=getattr(t, "rms_norm_eps", None) or 1e-6,
            rope_parameters=_target_rope(t),
            max_position_embeddings=getattr(t, "max_position_embeddings", None) or 40960,
        )
        for k, v in overrides.items():
            setattr(config, k, v)
        config.__post_init__()
        return config


def _in_either_place(d: dict, dflash: dict, key: str):
    """A field the readers take from dflash_config or the top level: where both give it they
    must agree (null is a value: a null in one place and a number in the other is no rule
    any reader shares), so no value is silently dropped."""
    if key in dflash and key in d and dflash[key] != d[key]:
        raise ValueError(f"dflash_config.{key}={dflash[key]!r} and the top-level {key}={d[key]!r} disagree: "
                         f"give it once, or the same value in both")
    return dflash[key] if key in dflash else d[key]


def target_text_config(config):
    """The text (decoder) config of a Hugging Face model config: the config itself, or the
    text part of a composite one (Gemma 4, Qwen3.5 with vision), where the layers, widths
    and vocabulary a drafter must fit live."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


# The published drafters' attention head size and KV head count: Qwen3-4B/8B and Llama-3.1-8B
# (heads of 128, 8 KV heads, as their targets), Qwen3.5-9B (32 heads of 128 over a target of
# 16 of 256), gemma-4-31B-it (64 heads of 128, 8 KV heads, over 32 of 256 and 16 KV heads).
DRAFT_MAX_HEAD_DIM = 128
DRAFT_MAX_KV_HEADS = 8


def _drafter_heads(t):
    """(heads, KV heads, head dim) of a drafter for the text config `t`: the target's head
    size capped at :data:`DRAFT_MAX_HEAD_DIM`, as many heads as keep the target's query
    width, and the target's KV width in heads of that size, at most :data:`DRAFT_MAX_KV_HEADS`.
    Per-layer configs (Gemma 4's global layers are wider) give the first layer's attention;
    multi-head latent attention (DeepSeek-V3) its value head size (its `head_dim` is the
    rotary part of the keys only)."""
    layer = t.per_layer_config[0] if getattr(t, "is_heterogeneous", False) else t
    heads = layer.num_attention_heads
    kv = getattr(layer, "num_key_value_heads", None) or heads
    if getattr(layer, "kv_lora_rank", None):
        D = layer.v_head_dim
    else:
        D = getattr(layer, "head_dim", None) or t.hidden_size // heads
    d = min(D, DRAFT_MAX_HEAD_DIM)
    q_heads = heads * D // d
    return q_heads, math.gcd(q_heads, min(kv * D // d, DRAFT_MAX_KV_HEADS)), d




def _target_rope(config) -> Optional[dict]:
    """The rope of a drafter for the text config `config`: the target's theta and scaling as
    a rope_parameters dict, rotating the whole head (the authors' drafters are Qwen3 layers
    with full rotary whatever the target's partial rotary). Rope per layer type (Gemma 4)
    gives the full-attention layers' (gemma-4-31B-it-DFlash has their theta, 1e6);
    "proportional" rope without partial rotation is the default (or linear, with a factor).
    transformers 5.x keeps rope standardised; 4.x configs have rope_scaling + rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
        if getattr(config, "rope_theta", None) is not None:
            params["rope_theta"] = config.rope_theta
    # what a Qwen3 text drafter does not have: partial rotation (Qwen3.5, Qwen3-Next, Gemma 4's
    # global layers) and the multimodal sections (Qwen3.5's mrope)
    for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    if params.get("rope_type") == "proportional":
        scaled = params.get("factor", 1.0) != 1.0
        params["rope_type"] = "linear" if scaled else "default"
        if not scaled:
            params.pop("factor", None)
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

