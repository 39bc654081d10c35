"""Tiny DeepSpec checkpoints as DeepSpec's trainer writes them (a Qwen3 config.json with the
drafter fields at the top level; safetensors named as its modules), and DSpark's draft of one
block from the raw tensors of such a file, slot by slot in float64: written for the tests from
DeepSpec's description (issue 64, the DSpark paper's formulas), not from its code nor from
dflash_ext.model.dspark. The backbone is plain_reference's draft step
(transformers' rotary embedding, plain attention under the authors' mask)."""
import copy
import json
import os

import torch
import torch.nn.functional as F

from .plain_reference import D, H, HKV, HQ, plain_draft_step

V, INTERMEDIATE, TARGET_LAYERS, LAYER_IDS, MASK, BLOCK, RANK = 100, 96, 6, [1, 4], 99, 7, 8
# name -> (markov_rank, markov_head_type, confidence head: None / "with_markov" / "hidden_only")
VARIANTS = {
    "deepspec_dflash": (0, None, None),
    "vanilla": (RANK, "vanilla", "with_markov"),
    "gated": (RANK, "gated", "with_markov"),
    "rnn": (RANK, "rnn", "with_markov"),
    "vanilla_confidence_without_markov": (RANK, "vanilla", "hidden_only"),
    "rnn_without_confidence": (RANK, "rnn", None),
    "confidence_only": (0, None, "hidden_only"),
}


def deepspec_config(variant: str, num_layers: int = 2, dtype: str = "float32") -> dict:
    """A config.json as DeepSpec's build_draft_config + save_pretrained write it: the
    target's Qwen3 config (with metadata keys a hub config has), the draft layer count, and
    the drafter fields at the top level."""
    rank, kind, confidence = VARIANTS[variant]
    d = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "attention_bias": False,
         "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": D, "hidden_act": "silu",
         "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
         "max_position_embeddings": 512, "max_window_layers": num_layers, "num_attention_heads": HQ,
         "num_hidden_layers": num_layers, "num_key_value_heads": HKV, "rms_norm_eps": 1e-06, "rope_scaling": None,
         "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
         "torch_dtype": dtype, "transformers_version": "4.57.1", "use_cache": True, "vocab_size": V,
         "layer_types": ["full_attention"] * num_layers, "num_target_layers": TARGET_LAYERS, "block_size": BLOCK,
         "mask_token_id": MASK, "target_layer_ids": list(LAYER_IDS), "num_anchors": 512, "markov_rank": rank,
         "enable_confidence_head": confidence is not None}
    if kind is not None:
        d["markov_head_type"] = kind
    if confidence is not None:
        d["confidence_head_with_markov"] = confidence == "with_markov"
    return d


def tensor_shapes(d: dict) -> dict:
    """Every tensor of a DeepSpec Qwen3 checkpoint of config `d`, by name, with its shape."""
    L, r, conf = d["num_hidden_layers"], d["markov_rank"], d["enable_confidence_head"]
    shapes = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "fc.weight": (H, len(LAYER_IDS) * H),
              "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (HQ * D, H), p + "self_attn.k_proj.weight": (HKV * D, H),
                       p + "self_attn.v_proj.weight": (HKV * D, H), p + "self_attn.o_proj.weight": (H, HQ * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, H), p + "mlp.up_proj.weight": (INTERMEDIATE, H),
                       p + "mlp.down_proj.weight": (H, INTERMEDIATE), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    if r:
        shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        if d["markov_head_type"] == "gated":
            shapes.update({"markov_head.gate_proj.weight": (r, H + r), "markov_head.gate_proj.bias": (r,)})
        if d["markov_head_type"] == "rnn":
            shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + H),
                           "markov_head.joint_proj.bias": (3 * r,)})
    if conf:
        width = H + (r if d["confidence_head_with_markov"] else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes


def random_tensors(d: dict, seed: int = 0, dtype=torch.float32) -> dict:
    """Random (never zero) weights: norms near 1, embeddings and Markov tables of unit scale,
    projections small, so that every head moves the drafts."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(d).items():
        x = torch.randn(shape, generator=g)
        if "norm" in name:
            x = 1 + 0.2 * x
        elif name in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
            pass
        elif name.startswith(("markov_head", "confidence_head")):
            x = 0.4 * x
        else:
            x = 0.15 * x
        out[name] = x.to(dtype)
    return out


def write_deepspec_checkpoint(path: str, d: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def reference_block(drafter, d: dict, t: dict, feats, anchor: int, temperature=0.0, threshold=0.0, generator=None):
    """(kept tokens, every slot's corrected logits [B, V], confidences [B] or None, q [n, V] or
    None) of the block drafted after the context `feats` [S, k*H] from the last token `anchor`:
    slot k drafts the token at anchor + k + 1; its logits are lm_head(h_k) plus the Markov
    term after prev_k (prev_0 the anchor, then the token drafted at k - 1); greedy at T = 0,
    else a draw from softmax(logits / T); then the block is cut before the first slot whose
    confidence is below `threshold` (> 0). Weights are the raw tensors `t` of the file
    (`drafter` only lends them to the backbone's plain step)."""
    t = {k: v.double() for k, v in t.items()}
    S = feats.shape[0]
    ids = [anchor] + [MASK] * (BLOCK - 1)
    qwen3 = {k: v for k, v in d.items() if k not in ("target_layer_ids", "mask_token_id", "num_anchors",
                                                      "markov_rank", "markov_head_type", "enable_confidence_head",
                                                      "confidence_head_with_markov")}
    hidden = plain_draft_step(copy.deepcopy(drafter).double(), qwen3, feats.double(), t["embed_tokens.weight"][ids], S)
    kind, r = d.get("markov_head_type"), d["markov_rank"]
    tokens, logits, prevs, prev, state = [], [], [], anchor, torch.zeros(r, dtype=torch.float64)
    for k in range(BLOCK):
        h = hidden[k]
        z = t["lm_head.weight"] @ h
        if r:
            e = t["markov_head.markov_w1.weight"][prev]
            if kind == "vanilla":
                m = e
            elif kind == "gated":
                m = _sigmoid(t["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + t["markov_head.gate_proj.bias"]) * e
            else:
                j = t["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + t["markov_head.joint_proj.bias"]
                gate, cand, out = _sigmoid(j[:r]), torch.tanh(j[r:2 * r]), torch.tanh(j[2 * r:])
                state = gate * state + (1 - gate) * cand
                m = out
            z = z + t["markov_head.markov_w2.weight"] @ m
        prevs.append(prev)
        if temperature == 0:
            prev = int(z.argmax())
        else:
            prev = int(torch.multinomial(torch.softmax(z / temperature, -1).float(), 1, generator=generator))
        tokens.append(prev)
        logits.append(z)
    logits = torch.stack(logits)
    confidence, kept = None, BLOCK
    if d["enable_confidence_head"]:
        confidence = []
        for k in range(BLOCK):
            x = hidden[k]
            if d["confidence_head_with_markov"]:
                x = torch.cat([x, t["markov_head.markov_w1.weight"][prevs[k]]])
            confidence.append(_sigmoid(t["confidence_head.proj.weight"][0] @ x + t["confidence_head.proj.bias"][0]))
        confidence = torch.stack(confidence)
        if threshold > 0:
            kept = next((k for k in range(BLOCK) if confidence[k] < threshold), BLOCK)
    q = None if temperature == 0 else torch.softmax(logits[:kept] / temperature, -1)
    return tokens[:kept], logits, confidence, q


def context_features(seed: int = 1, S: int = 11):
    return torch.randn(S, len(LAYER_IDS) * H, generator=torch.Generator().manual_seed(seed))
