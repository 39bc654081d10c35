"""DeepSpec's checkpoint format (deepseek-ai/DeepSpec, ``deepspec/modeling/dspark/``): its
``config.json`` read into :class:`~.config.DFlashConfig`'s fields and written back.

The config is the target's own config (a Qwen3 one for ``Qwen3DSparkModel``) with
``architectures`` replaced, ``num_hidden_layers`` the draft layers, and at the top level
``block_size``, ``num_target_layers``, ``target_layer_ids``, ``mask_token_id``,
``num_anchors`` (training only), ``markov_rank`` (0: no Markov head) with
``markov_head_type`` (vanilla | gated | rnn) when it is > 0, ``enable_confidence_head`` with
``confidence_head_with_markov`` when it is true, and ``tie_word_embeddings: false``. Its
DFlash drafters (``dflash_*_block7``) are the same model with ``markov_rank`` 0 and no
confidence head. A save writes back the very config.json a load read (every key of the
target's config kept), with the fields this drafter owns set from it.
"""
import copy

from .config_fields import (DEEPSPEC_GEMMA4, DEEPSPEC_KEYS, DEEPSPEC_QWEN3, DEEPSPEC_RULES, FIELD_RULES,
                            check_field, check_json_fields, qwen3_fields, reject_unsupported)

__all__ = ["DEEPSPEC_ARCHITECTURES", "deepspec_config_fields", "deepspec_json_dict", "check_deepspec_config"]

DEEPSPEC_ARCHITECTURES = (DEEPSPEC_QWEN3, DEEPSPEC_GEMMA4)
# DeepSpec's Qwen3DSparkModel asserts these at construction (block_size and the DFlash fields
# it reads as int(config.block_size) etc.); the shapes are the Qwen3 config's.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
             "num_target_layers", "block_size", "target_layer_ids", "mask_token_id", "num_anchors", "markov_rank",
             "enable_confidence_head")


def deepspec_config_fields(d: dict) -> dict:
    """The DFlashConfig keyword arguments of a DeepSpec config.json `d` (``architectures``
    one of :data:`DEEPSPEC_ARCHITECTURES`); a bad value is a ValueError naming its field."""
    architecture = d["architectures"][0]
    if architecture == DEEPSPEC_GEMMA4:
        # Its layers are Gemma 4's, not Qwen3's: four norms per layer, V = K where
        # attention_k_eq_v, a scale-free v_norm, attention scale 1, a sqrt(H)-scaled
        # embedding, partial rotary and a soft-capped LM head.
        raise ValueError(f"architectures [{DEEPSPEC_GEMMA4!r}] (DeepSpec's Gemma 4 drafters) is not supported yet: "
                         f"only {DEEPSPEC_QWEN3!r} loads (docs/checkpoints.md, 'DeepSpec')")
    for key in ("dflash_config", "is_causal"):
        if key in d:
            raise ValueError(f"{key} is not a field of DeepSpec's format ({architecture}: its drafter fields are "
                             f"top-level, its attention bidirectional)")
    reject_unsupported(d, {}, format_keys=DEEPSPEC_KEYS)
    for key in _REQUIRED:
        if key not in d:
            raise ValueError(f"lacks '{key}'")
    check_json_fields(d, {}, {**FIELD_RULES, **DEEPSPEC_RULES})
    if d.get("tie_word_embeddings", False) is not False:  # tied, the LM head would be the embedding
        raise ValueError(f"tie_word_embeddings must be false in a {architecture} config, got "
                         f"{d['tie_word_embeddings']!r}")
    if -1 in d["target_layer_ids"]:
        # DeepSpec reads -1 as the target's embedding output (hidden_states[0]); our target
        # features, cached training data and runtime are not tested with it.
        raise ValueError(f"target_layer_ids {d['target_layer_ids']}: -1 (DeepSpec's embedding output) is not "
                         f"supported yet")
    ids, layers = d["target_layer_ids"], d["num_target_layers"]
    if not ids or any(not 0 <= i < layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids must be distinct layers in [0, num_target_layers={layers}), got {ids}")
    if not d["mask_token_id"] < d["vocab_size"]:
        raise ValueError(f"mask_token_id={d['mask_token_id']} must be a token id in [0, vocab_size={d['vocab_size']})")
    rank = d["markov_rank"]
    if rank > 0 and d.get("markov_head_type") is None:
        raise ValueError(f"markov_rank={rank} needs markov_head_type (one of vanilla, gated, rnn)")
    confidence = d["enable_confidence_head"]
    if confidence and "confidence_head_with_markov" not in d:
        raise ValueError("enable_confidence_head=true needs confidence_head_with_markov (true or false)")
    with_markov = confidence and d["confidence_head_with_markov"]
    if with_markov and rank == 0:
        raise ValueError("confidence_head_with_markov=true needs a Markov head (markov_rank > 0)")
    if any(t != "full_attention" for t in d.get("layer_types") or []):  # DeepSpec writes full_attention
        raise ValueError(f"layer_types must all be full_attention in a {architecture} config (its draft "
                         f"attention is bidirectional over the whole context), got {d['layer_types']}")
    qwen3, _ = qwen3_fields(d)
    return dict(
        **qwen3, target_layer_ids=list(d["target_layer_ids"]), mask_token_id=d["mask_token_id"],
        block_size=d["block_size"],
        layer_types=["full_attention"] * d["num_hidden_layers"],
        deepspec_architecture=architecture, num_anchors=d["num_anchors"], markov_rank=rank,
        markov_head_type=d["markov_head_type"] if rank > 0 else None,
        enable_confidence_head=confidence, confidence_head_with_markov=bool(with_markov),
        deepspec_json=copy.deepcopy(d),
    )


def deepspec_json_dict(config, reference: dict) -> dict:
    """The DeepSpec config.json of `config`: the one it was read from (every key of the
    target's config kept) or, for a config built here, `reference` (its reference-format
    dict) with the drafter fields moved to the top level; either way with the fields this
    drafter owns set from `config`."""
    if config.deepspec_json is not None:
        d = copy.deepcopy(config.deepspec_json)
    else:
        d = {k: v for k, v in reference.items() if k not in ("dflash_config", "sliding_window",
                                                               "use_sliding_window")}
    owned = dict(architectures=[config.deepspec_architecture], hidden_size=config.hidden_size,
                 num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                 intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                 num_target_layers=config.num_target_layers, block_size=config.block_size,
                 target_layer_ids=list(config.target_layer_ids), mask_token_id=config.mask_token_id,
                 num_anchors=config.num_anchors, markov_rank=config.markov_rank,
                 enable_confidence_head=config.enable_confidence_head, tie_word_embeddings=False)
    if config.markov_rank > 0:
        owned["markov_head_type"] = config.markov_head_type
    if config.enable_confidence_head:
        owned["confidence_head_with_markov"] = config.confidence_head_with_markov
    if "layer_types" in d or config.deepspec_json is None:
        owned["layer_types"] = ["full_attention"] * config.num_hidden_layers
    d.update(owned)
    return d


def check_deepspec_config(config) -> None:
    """DeepSpec's fields of a DFlashConfig (also one built in Python): in range, each head
    with what it needs, and only in DeepSpec's format."""
    if config.deepspec_architecture is None:
        if config.markov_rank or config.enable_confidence_head:
            raise ValueError("markov_rank and enable_confidence_head are DSpark fields: they need a DeepSpec "
                             f"architecture ({', '.join(DEEPSPEC_ARCHITECTURES)})")
        return
    if config.deepspec_architecture != DEEPSPEC_QWEN3:
        raise ValueError(f"deepspec_architecture must be {DEEPSPEC_QWEN3!r}, got {config.deepspec_architecture!r}")
    for key, rule in DEEPSPEC_RULES.items():
        check_field(key, getattr(config, key), rule)
    if config.markov_rank > 0 and config.markov_head_type is None:
        raise ValueError(f"markov_rank={config.markov_rank} needs markov_head_type (one of vanilla, gated, rnn)")
    if config.confidence_head_with_markov and not (config.enable_confidence_head and config.markov_rank > 0):
        raise ValueError("confidence_head_with_markov=true needs enable_confidence_head and a Markov head "
                         "(markov_rank > 0)")
    if config.is_dflash2 or config.draft_vocab_size is not None or config.causal is not None:
        raise ValueError("a DeepSpec drafter has no DFlash2 fields, draft vocabulary or is_causal")
