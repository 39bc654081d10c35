"""The draft step of :class:`~dflash_ext.drafter.DFlashDrafter` over the fused ops (inference):
the stacked K/V weights and RoPE tables the ops read, :meth:`DraftStep.add_context` (target
features into the context cache) and :meth:`DraftStep.draft_hidden` (the layers over a block).
A mixin: DFlashDrafter has these methods."""
from typing import Sequence

import torch

from . import ops, reference
from .draft_cache import DraftCache
from .drafter_masks import windowed_bidirectional_attention


class DraftStep:
    """DFlashDrafter's draft step (it holds `config`, `layers`, `fc`, `hidden_norm`, `norm`,
    and the `_stacked` / `_rope` caches)."""

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
        block_conv = ops.block_conv if fused else reference.block_conv
        fused_args = dict(max_context=-1 if validate else cache.capacity, validate=validate) if fused else {}
        offsets, lens = cache.offsets, cache.lens
        scale = self.config.head_dim ** -0.5
        symmetric = self.config.layer_symmetric_window
        x = block_embeds
        for i, layer in enumerate(self.layers):
            if symmetric[i]:  # not fused yet (the op has no symmetric window): plain torch, both paths
                def attend(q, k, v, i=i):
                    return windowed_bidirectional_attention(q, k, v, cache.k[i], cache.v[i], cache.capacity, lens,
                                                            scale, cache.windows[i])
            else:
                def attend(q, k, v, i=i):
                    return attention(q, k, v, cache.k[i], cache.v[i], offsets, lens, scale, window=cache.windows[i],
                                     causal=cache.causal[i], **fused_args)
            x = layer(x, cos, sin, attend, block_conv)
        return self.norm(x)
