"""A draft step written independently of dflash_ext (its drafter and draft runtime), for the drafter tests to compare
against: transformers' Qwen3RotaryEmbedding and apply_rotary_pos_emb, and plain softmax
attention over [context K/V ; block K/V] under an explicit boolean mask per layer. Which
keys a layer's queries see is the caller's: the authors' rule (:func:`authors_visible`) or a
test's own. DFlash2's block convolution (:func:`plain_block_conv`, wrapped around each
sublayer) and candidate selector (:func:`plain_select`) are written out here as loops over
slots, taps and channels from the research notes' formulas (docs/dflash2.md)."""
import torch
import torch.nn.functional as F

from dflash_ext import DFlashConfig, DFlashDrafter
from dflash_ext.draft.runtime import DraftRuntime

H, HQ, HKV, D, K_FEATS = 64, 4, 2, 16, 2


def config_json(rope=None, layer_types=None, sliding_window=None, num_layers=2, **extra):
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
         "num_hidden_layers": num_layers, "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D,
         "intermediate_size": 96, "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False, "block_size": 4,
         "num_target_layers": 6, "dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99}}
    if rope:
        d["rope_scaling"] = dict(rope)
    if layer_types:
        d.update(layer_types=layer_types, use_sliding_window=True, sliding_window=sliding_window)
    d.update(extra)
    return d


def random_drafter(d, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig.from_json_dict(d))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return drafter.to(dtype).eval()


def hf_config(d):
    """transformers' Qwen3Config of a drafter config.json (it standardises layer_types and
    drops sliding_window without use_sliding_window, as the authors' model sees them)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{k: v for k, v in d.items() if k not in ("dflash_config", "block_size",
                                                                 "num_target_layers", "architectures")})


def authors_visible(d):
    """The authors' attention mask (z-lab/dflash model.py, `Qwen3DFlashAttention` and
    `_attention_mask`): a layer is causal by the top-level is_causal, else when it is a
    sliding_attention layer; its window is sliding_window on sliding layers. Causal: key
    k <= query q and q - k < window; bidirectional with a window: |q - k| < window."""
    hf = hf_config(d)

    def visible(layer, query_pos, key_pos):
        sliding = hf.layer_types[layer] == "sliding_attention"
        causal = sliding if d.get("is_causal") is None else d["is_causal"]
        window = hf.sliding_window if sliding else None
        mask = torch.ones(query_pos.shape[0], key_pos.shape[1], dtype=torch.bool)
        if causal:
            mask &= key_pos <= query_pos
        if window is not None:
            mask &= query_pos - key_pos < window
            if not causal:
                mask &= key_pos - query_pos < window
        return mask

    return visible


def plain_draft_step(drafter, d, feats, block_embeds, start, visible=None):
    """One draft step: context rows 0..T-1 at positions 0..T-1 and the block at positions
    start..start+B-1 in one rotary call; layer i's block queries see the keys where
    ``visible(i, query_pos [B, 1], key_pos [1, T + B])`` is True (default: the authors')."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    hf = hf_config(d)
    visible = visible or authors_visible(d)
    T, B = feats.shape[0], block_embeds.shape[0]
    c = drafter.config
    HQ, HKV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = torch.cat([torch.arange(T), torch.arange(start, start + B)])[None]
    cos, sin = Qwen3RotaryEmbedding(hf)(block_embeds[None], positions)

    def norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, hf.rms_norm_eps)

    ctx = norm(F.linear(feats, drafter.fc.weight), drafter.hidden_norm.weight)
    x = block_embeds
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h, conv_out = dflash2_sides(getattr(layer, "attention_conv", None), norm(x, layer.input_layernorm.weight))
        q = norm(F.linear(h, a.q_proj.weight).view(B, HQ, D), a.q_norm.weight).transpose(0, 1)[None]
        k = norm(torch.cat([F.linear(ctx, a.k_proj.weight), F.linear(h, a.k_proj.weight)]).view(T + B, HKV, D),
                 a.k_norm.weight).transpose(0, 1)[None]
        v = torch.cat([F.linear(ctx, a.v_proj.weight), F.linear(h, a.v_proj.weight)]).view(T + B, HKV, D)
        v = v.transpose(0, 1)[None]
        q, _ = apply_rotary_pos_emb(q, q, cos[:, T:], sin[:, T:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        s = (q.float() @ k.float().transpose(-1, -2)) * D ** -0.5
        s = s.masked_fill(~visible(i, positions[0, T:, None], positions), float("-inf"))
        o = (torch.softmax(s, -1) @ v.float()).to(x.dtype)[0].transpose(0, 1).reshape(B, HQ * D)
        x = x + conv_out(F.linear(o, a.o_proj.weight))
        h = norm(x, layer.post_attention_layernorm.weight)
        h, conv_out = dflash2_sides(getattr(layer, "mlp_conv", None), h)
        m = layer.mlp
        x = x + conv_out(F.linear(F.silu(F.linear(h, m.gate_proj.weight)) * F.linear(h, m.up_proj.weight),
                                  m.down_proj.weight))
    return norm(x, drafter.norm.weight)


def plain_block_conv(x, base, delta, group_size):
    """out[i, c] = sum over taps t <= i of (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c]:
    x [B, H] one block, base [T, H], delta [B, T, G]; summed in fp64."""
    B, H = x.shape
    out = torch.zeros(B, H, dtype=torch.float64)
    for i in range(B):
        for t in range(min(base.shape[0], i + 1)):
            for c in range(H):
                out[i, c] += (base[t, c].double() + delta[i, t, c // group_size].double()) * x[i - t, c].double()
    return out.to(x.dtype)


def dflash2_sides(conv, normed):
    """(the sublayer's input, what its output goes through) for a DFlash2 BlockConv `conv` (None: v1,
    no convolution): the coefficient deltas of both sides are one projection of `normed` [B, H],
    its rows read as (side, tap, group)."""
    if conv is None:
        return normed, lambda y: y
    T, H = conv.base_kernel.shape[1:]
    G = conv.kernel_projection.weight.shape[0] // (2 * T)
    delta = F.linear(normed, conv.kernel_projection.weight).view(-1, 2, T, G)
    side = [lambda y, s=s: plain_block_conv(y, conv.base_kernel[s], delta[:, s], H // G) for s in (0, 1)]
    return side[0](normed), side[1]


def plain_select(drafter, hidden, logits, anchor, vocab=None):
    """The DFlash2 selector's greedy path, slot by slot, for one block: `hidden` [n, H] the
    prediction slots' final-normed states, `logits` [n, V'] their LM-head logits (V' the draft
    vocabulary's rows when `vocab` maps them to token ids), `anchor` the block's first token."""
    c, sel = drafter.config, drafter.candidate_selector
    path, previous = [], int(anchor)
    for j in range(logits.shape[0]):
        u = logits[j].double() * c.output_multiplier
        if c.final_logit_softcapping is not None:
            u = c.final_logit_softcapping * torch.tanh(u / c.final_logit_softcapping)
        best, best_score = None, None
        order = sorted(range(u.numel()), key=lambda t: -float(u[t]))[:c.selector_top_k]
        gate = [float(sum(sel.hidden_projection.weight[r, h] * hidden[j, h] for h in range(hidden.shape[1])))
                for r in range(c.selector_rank)]
        for row in order:
            token = row if vocab is None else int(vocab[row])
            score = float(u[row]) + sum(float(sel.predecessor_codebook[previous, r]) * gate[r]
                                        * float(sel.successor_codebook[token, r]) for r in range(c.selector_rank))
            if best_score is None or score > best_score:
                best, best_score = token, score
        path.append(best)
        previous = best
    return path


def our_draft_step(drafter, feats, block_embeds, start, fused=True, draft_window=None):
    runtime = DraftRuntime(drafter, feats.shape[0] + 8, draft_window=draft_window, fused=fused)
    runtime.add_context(0, list(feats.split(drafter.config.hidden_size, -1)), torch.arange(feats.shape[0]))
    B = block_embeds.shape[0]
    return runtime.draft_hidden(block_embeds[None], torch.arange(start, start + B)[None])[0]
