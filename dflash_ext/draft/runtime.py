"""The draft step of :class:`~dflash_ext.drafter.DFlashDrafter` over the fused ops (inference):
the stacked K/V weights and RoPE tables the ops read, :meth:`DraftStep.add_context` (target
features into the context cache) and :meth:`DraftStep.draft_hidden` (the layers over a block).
Every layer runs on the fused path of :meth:`DraftStep._fused_layer` (10 ops a v1 layer;
symmetric-window layers through block_attention's symmetric window); DecoderLayer.forward,
which training runs, is its reference (``fused=False``).
A mixin: DFlashDrafter has these methods."""
from typing import Sequence

import torch
import torch.nn.functional as F

from . import ops, reference
from .draft_cache import DraftCache


class DraftStep:
    """DFlashDrafter's draft step (it holds `config`, `layers`, `fc`, `hidden_norm`, `norm`,
    and the `_stacked` / `_layer_weights` / `_rope` caches)."""

    def stack_weights(self) -> None:
        """Stack the weights the fused ops read now, as the first draft step would (the
        proposer calls it at its start: on the caller's stream, never first inside a CUDA
        graph's warm-up)."""
        self._stacked_kv_weights()
        self._stacked_layer_weights()

    def _stacked_kv_weights(self):
        """[N, Hkv*D, H] K and V weights and [N, D] k_norm weights of all layers, rebuilt
        only when a weight changed (training, loading, .to())."""
        key = _weights_key(p for l in self.layers for p in (l.self_attn.k_proj.weight, l.self_attn.v_proj.weight,
                                                             l.self_attn.k_norm.weight))
        if self._stacked is None or self._stacked[0] != key:
            attn = [l.self_attn for l in self.layers]
            self._stacked = (key, torch.stack([a.k_proj.weight.detach() for a in attn]),
                             torch.stack([a.v_proj.weight.detach() for a in attn]),
                             torch.stack([a.k_norm.weight.detach() for a in attn]))
        return self._stacked[1:]

    def _stacked_layer_weights(self):
        """Per layer, (q/k/v weight [(Hq + 2 Hkv) * D, H], gate/up weight [2 I, H]): each
        layer's projections stacked for the fused path's two GEMMs. The parameters become views
        of these rows (their names, and so the checkpoint format, stay): no second copy of the
        weights, and an in-place update (a training step) is read at once. A cast, a move or a
        replaced parameter gives them storage of their own again: then they are stacked anew."""
        groups = [g for l in self.layers for g in (
            (l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight),
            (l.mlp.gate_proj.weight, l.mlp.up_proj.weight))]
        stacked = self._layer_weights
        if stacked is None or len(stacked) != len(groups) or \
                not all(_holds_rows(w, g) for w, g in zip(stacked, groups)):
            self._layer_weights = stacked = [_stack_rows(g) for g in groups]
        return list(zip(stacked[0::2], stacked[1::2]))

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
        cos, sin = cos[positions], sin[positions]  # [Bsz, B, D]
        attention = ops.block_attention if fused else reference.block_attention
        block_conv = ops.block_conv if fused else reference.block_conv
        fused_args = dict(max_context=-1 if validate else cache.capacity, validate=validate) if fused else {}
        offsets, lens = cache.offsets, cache.lens
        scale = self.config.head_dim ** -0.5
        symmetric = self.config.layer_symmetric_window
        weights = self._stacked_layer_weights() if fused else None
        token_rope = cos.flatten(0, 1), sin.flatten(0, 1)  # [Bsz * B, D]: the fused layers' rows
        x, pending = block_embeds, None  # pending: a fused layer's MLP output, added by the next norm
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):  # symmetric: |p - k| < W per query (DFlash2's sliding layers)
                return attention(q, k, v, cache.k[i], cache.v[i], offsets, lens, scale, window=cache.windows[i],
                                 causal=cache.causal[i], symmetric=symmetric[i], **fused_args)
            if fused:
                x, pending = self._fused_layer(layer, *weights[i], x, pending, *token_rope, attend)
                continue
            if pending is not None:
                x, pending = x + pending, None
            x = layer(x, cos[:, :, None, :], sin[:, :, None, :], attend, block_conv)
        if not fused:
            return self.norm(x)
        return ops.rms_norm(x, self.norm.weight, self.norm.eps) if pending is None else \
            ops.rms_norm(pending, self.norm.weight, self.norm.eps, residual=x)[1]

    @staticmethod
    def _fused_layer(layer, qkv_weight, gate_up_weight, x, pending, cos, sin, attend):
        """One decoder layer (DecoderLayer.forward's math, its reference) over the blocks
        ``x [Bsz, B, H]`` in 10 compute ops for a v1 layer: the norms on ops.rms_norm (each
        adding the residual branch before it), one GEMM each for q/k/v, o, gate/up and down,
        ops.qk_norm_rope for q and k (v is a view of the q/k/v GEMM's output), `attend`, and
        SiLU(gate) * up; a DFlash2 layer adds its convolutions' delta GEMMs and ops.block_conv
        around the attention and the MLP. ``cos, sin [Bsz * B, D]``. `pending`: the previous
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
        qkv = ops.streamed_linear(h.view(-1, shape[-1]), qkv_weight)  # [M, (Hq + 2 Hkv) * D]
        q, k = ops.qk_norm_rope(qkv, a.q_norm.weight, a.k_norm.weight, cos, sin, Hq, Hkv, a.q_norm.eps)
        lead = shape[:-1]
        v = qkv[:, (Hq + Hkv) * D:].view(*lead, Hkv, D)
        attended = attend(q.view(*lead, Hq, D), k.view(*lead, Hkv, D), v)
        y = ops.streamed_linear(attended.view(-1, Hq * D), a.o_proj.weight)
        y = y.view(shape) if conv is None else conv(y.view(shape), deltas, 1, ops.block_conv)
        norm = layer.post_attention_layernorm
        x, h = ops.rms_norm(y, norm.weight, norm.eps, residual=x)
        if mlp_conv is not None:
            deltas = mlp_conv.deltas(h)
            h = mlp_conv(h, deltas, 0, ops.block_conv)
        gate_up = ops.streamed_linear(h.view(-1, shape[-1]), gate_up_weight)
        inter = gate_up.shape[-1] // 2
        out = ops.streamed_linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
        out = out.view(shape)
        return x, out if mlp_conv is None else mlp_conv(out, deltas, 1, ops.block_conv)


def _weights_key(params):
    """What identifies the current values of these parameters: a cache built from them is
    stale once one is replaced, written in place (its version), cast or moved."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


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
