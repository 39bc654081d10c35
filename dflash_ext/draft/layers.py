"""The drafter's decoder layers on the fused ops (:func:`fused_layer`) and the stacked weights
they read (:func:`stacked_layer_weights`, :func:`stacked_kv_weights`).

The weights rule: drafts follow the parameters' current values whatever wrote them (an
optimizer step, ``p.data.copy_``, ``load_state_dict``, a cast or a move). Each layer's q/k/v
and gate/up parameters are made views of one stacked tensor of their rows (its two GEMMs
read the parameters themselves: a write of any kind is read at once), stacked anew when a
parameter stops being such a view (replaced, cast or moved). The K/V weights of all layers,
which the context injection reads as one ``[N, Hkv*D, H]`` tensor each, cannot also be views
(each layer's k and v rows already sit between its q and v rows), so they are copied at every
injection (:func:`stacked_kv_weights`): no cached copy for a ``.data`` write to bypass.
"""
from typing import List, Tuple

import torch
import torch.nn.functional as F

from .. import ops
from ..ops.linear import streamed_linear

__all__ = ["fused_layer", "stacked_layer_weights", "stacked_kv_weights"]


def stacked_kv_weights(layers) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K [N, Hkv*D, H], V [N, Hkv*D, H], k_norm [N, D]) weights of `layers`, stacked now from
    the parameters' current values (a copy: the caller uses it at once)."""
    attn = [layer.self_attn for layer in layers]
    return tuple(torch.stack([getattr(a, name).weight.detach() for a in attn]) for name in ("k_proj", "v_proj",
                                                                                              "k_norm"))


def stacked_layer_weights(layers, stacked=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (q/k/v weight [(Hq + 2 Hkv) * D, H], gate/up weight [2 I, H]): each layer's
    projections stacked for the fused path's two GEMMs, the parameters views of these rows
    (their names, and so the checkpoint format, stay: no second copy of the weights). Stacked
    once: parameters that already are adjacent rows of one tensor (stacked by an earlier
    runtime) are taken as they are. `stacked` (a previous result): each of its tensors is kept
    while its parameters are still its views."""
    groups = [g for layer in layers for g in (
        (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight),
        (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))]
    before = [w for pair in stacked for w in pair] if stacked is not None and len(stacked) * 2 == len(groups) \
        else [None] * len(groups)
    whole = [w if w is not None and _holds_rows(w, g) else _rows_of(g) for w, g in zip(before, groups)]
    if all(a is b for a, b in zip(whole, before)):
        return stacked
    return list(zip(whole[0::2], whole[1::2]))


def _rows_of(params) -> torch.Tensor:
    """The tensor whose rows `params` are, in order: a view of their storage where they are
    adjacent rows of one already, else a new one (:func:`_stack_rows`)."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    storage = first.untyped_storage()
    fits = (first.storage_offset() + rows * first[0].numel()) * first.element_size() <= storage.nbytes()
    if fits and all(p.untyped_storage().data_ptr() == storage.data_ptr() for p in params):
        with torch.inference_mode(False), torch.no_grad():
            whole = first.detach().new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
        if _holds_rows(whole, params):
            return whole
    return _stack_rows(params)


def _stack_rows(params) -> torch.Tensor:
    """One tensor of these 2-D parameters' rows, in order; each parameter becomes the view of
    its rows. Made outside inference mode: the parameters stay trainable."""
    with torch.inference_mode(False), torch.no_grad():
        whole = torch.cat([p.detach() for p in params])
        row = 0
        for p in params:
            p.data = whole[row:row + p.shape[0]]
            row += p.shape[0]
    return whole


def _holds_rows(whole: torch.Tensor, params) -> bool:
    """Whether `params` are still the views of `whole`'s rows that :func:`_stack_rows` made
    (then `whole` holds their current values)."""
    row, step = 0, whole.stride(0) * whole.element_size()
    for p in params:
        if p.device != whole.device or p.dtype != whole.dtype or p.shape[1:] != whole.shape[1:] \
                or not p.is_contiguous() or p.data_ptr() != whole.data_ptr() + row * step:
            return False
        row += p.shape[0]
    return row == whole.shape[0]


def fused_layer(layer, qkv_weight, gate_up_weight, x, pending, cos, sin, attend):
    """One decoder layer (``DecoderLayer.forward``'s math, its reference) over the blocks
    ``x [Bsz, B, H]`` in 10 compute ops for a v1 layer: the norms on ops.rms_norm (each
    adding the residual branch before it), one GEMM each for q/k/v, o, gate/up and down,
    ops.qk_norm_rope for q and k (v is a view of the q/k/v GEMM's output), `attend`, and
    SiLU(gate) * up; a DFlash2 layer adds its convolutions' delta GEMMs and ops.block_conv
    around the attention and the MLP. ``cos, sin [Bsz * B, D]``; `qkv_weight`,
    `gate_up_weight`: the layer's :func:`stacked_layer_weights`. `pending`: the previous
    layer's MLP output not yet added to x (None: x is complete). Returns (x, this layer's
    MLP output) likewise."""
    Hq, Hkv, D = layer.heads
    a, shape = layer.self_attn, x.shape
    conv, mlp_conv = getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)
    norm = layer.input_layernorm
    if pending is None:
        h = ops.rms_norm(x, norm.weight, norm.eps)
    else:
        x, h = ops.rms_norm(pending, norm.weight, norm.eps, residual=x)
    if conv is not None:
        deltas = conv.deltas(h)
        h = conv(h, deltas, 0, ops.block_conv)
    qkv = streamed_linear(h.view(-1, shape[-1]), qkv_weight)  # [M, (Hq + 2 Hkv) * D]
    q, k = ops.qk_norm_rope(qkv, a.q_norm.weight, a.k_norm.weight, cos, sin, Hq, Hkv, a.q_norm.eps)
    lead = shape[:-1]
    v = qkv[:, (Hq + Hkv) * D:].view(*lead, Hkv, D)
    attended = attend(q.view(*lead, Hq, D), k.view(*lead, Hkv, D), v)
    y = streamed_linear(attended.view(-1, Hq * D), a.o_proj.weight)
    y = y.view(shape) if conv is None else conv(y.view(shape), deltas, 1, ops.block_conv)
    norm = layer.post_attention_layernorm
    x, h = ops.rms_norm(y, norm.weight, norm.eps, residual=x)
    if mlp_conv is not None:
        deltas = mlp_conv.deltas(h)
        h = mlp_conv(h, deltas, 0, ops.block_conv)
    gate_up = streamed_linear(h.view(-1, shape[-1]), gate_up_weight)
    inter = gate_up.shape[-1] // 2
    out = streamed_linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
    out = out.view(shape)
    return x, out if mlp_conv is None else mlp_conv(out, deltas, 1, ops.block_conv)
