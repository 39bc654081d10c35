"""The config-field rules of the reference format's ``config.json``: what each key does here
(honoured, inert, fixed at a value, DFlash2's), each value's own type and range
(:data:`FIELD_RULES`, checked as written by :func:`check_json_fields`), and which fields are
rejected because they change the drafted function and are not implemented
(:func:`reject_unsupported`). :class:`.config.DFlashConfig` applies them."""
import math
from typing import Any, Callable, NamedTuple, Optional


# What each config.json key of the reference format does here. A key outside these lists
# changes the drafted function in some implementation and is rejected at load.
QWEN3_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
               "rope_scaling", "rope_theta", "sliding_window", "use_sliding_window", "max_window_layers",
               "layer_types")
# draft_vocab_size at the top level: vLLM's (EAGLE-3's) field, written by export --for vllm beside
# dflash_config's (model/vllm_format.py); both given, they must agree.
_DFLASH_KEYS = ("block_size", "num_target_layers", "dflash_config", "is_causal", "draft_vocab_size")
# Metadata, training-only settings, and parts the drafter does not have (embedding, LM head).
_INERT_KEYS = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "initializer_range",
               "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
               "tie_word_embeddings", "auto_map", "_name_or_path"}
# Honoured at these values only, at the top level or in dflash_config (the authors' code and
# the engines read the DFlash ones from either). The engines' DFlash v1 extras, by reader:
# vLLM's attention sinks (dflash_config.attention_sink_bias, top-level
# add_swa_attention_sink_bias), its SWA switch for every layer (dflash_config.use_swa, window
# swa_window_size), interleaved RoPE (is_neox_style; SGLang also rope_is_neox_style), a
# drafter without target features (use_aux_hidden_state) and a logit scale (logit_scale).
_FIXED_VALUES = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                 "input_embedding_scale": (None, 1, 1.0), "output_multiplier": (None, 1, 1.0),
                 "final_logit_softcapping": (None, 0, 0.0), "attention_sink_bias": (None, False),
                 "add_swa_attention_sink_bias": (None, False), "use_swa": (None, False),
                 "swa_window_size": (None,), "is_neox_style": (None, True), "rope_is_neox_style": (None, True),
                 "use_aux_hidden_state": (None, True), "logit_scale": (None, 1, 1.0)}
_DFLASH_INNER_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "draft_vocab_size", "is_causal", "causal"}
# DFlash2 (second generation): this architecture name switches on the block convolution and
# the candidate selector, as in SGLang and vLLM. Their four required fields, read from
# dflash_config first, then the top level (the authors' code reads both); the logit transform
# fields are DFlash2's only (a v1 drafter keeps them at their neutral values, _FIXED_VALUES).
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_LOGIT_FIELDS = ("output_multiplier", "final_logit_softcapping")
# Where a checkpoint says that every layer is causal (true) or bidirectional (false), first
# found wins: top-level is_causal (the authors' model.py, SGLang, vLLM), dflash_config.is_causal
# (some checkpoints; vLLM ports), dflash_config.causal (vLLM `_dflash_layer_causal`).
_CAUSAL_FIELDS = (("is_causal", False), ("is_causal", True), ("causal", True))  # (key, inside dflash_config)
# DeepSpec's format (deepseek-ai/DeepSpec, deepspec/modeling/dspark/): the target's config with
# these keys at the top level (no dflash_config), one architecture name per target family. Its
# DFlash drafters are the same model without the two heads (markov_rank 0, no confidence head).
DEEPSPEC_QWEN3 = "Qwen3DSparkModel"
DEEPSPEC_GEMMA4 = "Gemma4DSparkModel"
DEEPSPEC_KEYS = ("block_size", "num_target_layers", "target_layer_ids", "mask_token_id", "num_anchors",
                 "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen3_config(**fields):
    """transformers' Qwen3Config: it standardises rope (rope_parameters in 5.x, rope_scaling
    / rope_theta in 4.x), layer_types and the sliding window exactly as the authors'
    Qwen3-based DFlashDraftModel (and DeepSpec's Qwen3DSparkModel) see them, defaults included."""
    from transformers import Qwen3Config

    return Qwen3Config(**fields)


def qwen3_fields(d: dict):
    """(the DFlashConfig fields a config.json `d` gives as a Qwen3 config: shapes, norm, rope,
    positions; transformers' Qwen3Config of it, for its standardised layer types and window)."""
    qwen3 = {k: d[k] for k in QWEN3_KEYS if k in d}
    if "rms_norm_eps" in qwen3:
        qwen3["rms_norm_eps"] = float(qwen3["rms_norm_eps"])  # transformers' field takes a float only
    hf = qwen3_config(**qwen3)
    return dict(hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"], num_key_value_heads=hf.num_key_value_heads,
                head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
                intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                num_target_layers=d["num_target_layers"], rms_norm_eps=hf.rms_norm_eps,
                rope_parameters=dict(hf.rope_parameters), max_position_embeddings=hf.max_position_embeddings), hf


class _Rule(NamedTuple):
    """What a field's value must be: one of `types` exactly (so a bool is not an int, nor a
    float or a string an int), and `ok` of it; `need` says both in the error."""
    types: tuple
    ok: Callable[[Any], bool]
    need: str


def _finite_positive(v) -> bool:
    return math.isfinite(v) and v > 0


_INT = (int,)
_NUMBER = (int, float)  # a float field takes an int too (rope_theta 10000)
_POSITIVE_INT = _Rule(_INT, lambda v: v > 0, "an int > 0")
# Each value's own type and range, by its config.json name (the DFlash ones also inside
# dflash_config); the ranges that involve other fields are DFlashConfig.__post_init__'s.
FIELD_RULES = {
    **{k: _POSITIVE_INT for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "intermediate_size", "vocab_size", "num_target_layers",
                                  "max_position_embeddings")},
    "mask_token_id": _Rule(_INT, lambda v: v >= 0, "an int >= 0"),
    "block_size": _Rule(_INT, lambda v: v >= 2, "an int >= 2"),
    "draft_vocab_size": _Rule(_INT + (type(None),), lambda v: v is None or v > 0, "an int > 0 or null"),
    "target_layer_ids": _Rule((list, tuple), lambda v: all(type(i) is int for i in v), "a list of ints"),
    "rms_norm_eps": _Rule(_NUMBER, _finite_positive, "a finite number > 0"),
    "rope_theta": _Rule(_NUMBER, _finite_positive, "a finite number > 0"),
    "sliding_window": _Rule(_INT + (type(None),), lambda v: v is None or v > 0, "an int > 0 or null"),
    "use_sliding_window": _Rule((bool,), lambda v: True, "true or false"),
    "max_window_layers": _Rule(_INT, lambda v: v >= 0, "an int >= 0"),
    "layer_types": _Rule((list, tuple), lambda v: all(t in LAYER_TYPES for t in v),
                         f"a list of {' or '.join(LAYER_TYPES)}"),
    **{k: _Rule((bool, type(None)), lambda v: True, "true, false or None (null)") for k in ("is_causal", "causal")},
}
# DFlash2's fields: checked in a DFlash2 config only (a v1 config rejects them before, reject_unsupported).
DFLASH2_RULES = {
    **{k: _POSITIVE_INT for k in DFLASH2_FIELDS},
    "output_multiplier": _Rule(_NUMBER, _finite_positive, "a finite number > 0"),
    "final_logit_softcapping": _Rule(_NUMBER + (type(None),), lambda v: v is None or _finite_positive(v),
                                     "a finite number > 0 or null"),
}


# DeepSpec's own fields (the DFlash ones share FIELD_RULES); checked in a DeepSpec config only.
# num_anchors is a training setting (anchors per sequence), kept for the save.
DEEPSPEC_RULES = {
    "num_anchors": _POSITIVE_INT,
    "markov_rank": _Rule(_INT, lambda v: v >= 0, "an int >= 0 (0: no Markov head)"),
    "markov_head_type": _Rule((str, type(None)), lambda v: v is None or v in MARKOV_HEAD_TYPES,
                              f"one of {', '.join(MARKOV_HEAD_TYPES)}"),
    **{k: _Rule((bool,), lambda v: True, "true or false") for k in ("enable_confidence_head",
                                                                    "confidence_head_with_markov")},
}


def check_field(label: str, value, rule: "_Rule") -> None:
    """Raise naming `label` when `value` breaks `rule`."""
    if type(value) not in rule.types or not rule.ok(value):
        raise ValueError(f"{label} must be {rule.need}, got {value!r}")


def check_json_fields(d: dict, dflash: dict, rules: dict = FIELD_RULES) -> None:
    """Every value of config.json (and its dflash_config) that has a rule, checked as written,
    before anything converts it."""
    for prefix, src in (("", d), ("dflash_config.", dflash)):
        for key, value in src.items():
            if key in rules:
                check_field(prefix + key, value, rules[key])


def reject_unsupported(d: dict, dflash: dict, dflash2: bool = False, format_keys=_DFLASH_KEYS) -> None:
    """A config field that changes the drafted function and is not implemented here is an
    error at load, never silently ignored. `dflash2`: a DFlash2 config, which also has
    DFLASH2_FIELDS and free logit transform fields (DFLASH2_RULES checks them). `format_keys`:
    the top-level keys of the format beside the Qwen3 ones (DeepSpec's: DEEPSPEC_KEYS)."""
    problems = []
    fixed = {k: v for k, v in _FIXED_VALUES.items() if not (dflash2 and k in DFLASH2_LOGIT_FIELDS)}
    v2_keys = set(DFLASH2_FIELDS) if dflash2 else set()
    known = set(QWEN3_KEYS) | set(format_keys) | _INERT_KEYS | set(_FIXED_VALUES) | v2_keys
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        problems.append(f"unsupported fields {unknown}")
    unknown_inner = sorted(k for k in dflash if k not in _DFLASH_INNER_KEYS | set(_FIXED_VALUES) | v2_keys)
    if unknown_inner:
        problems.append(f"unsupported dflash_config fields {unknown_inner}")
    for key, allowed in fixed.items():
        for where, src in (("", d), ("dflash_config.", dflash)):
            if key in src and src[key] not in allowed:
                problems.append(f"{where}{key}={src[key]!r} (supported: {[a for a in allowed if a is not None]})")
    if problems:
        raise ValueError("; ".join(problems)
                         + " (README, 'Checkpoints': what is supported)")


def explicit_causal(d: dict, dflash: dict) -> Optional[bool]:
    """The checkpoint's causality override for every layer (None: by layer type)."""
    for key, inner in _CAUSAL_FIELDS:
        value = (dflash if inner else d).get(key)  # a bool or None (check_json_fields)
        if value is not None:
            return value
    return None
