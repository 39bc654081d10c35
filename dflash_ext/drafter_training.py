"""The differentiable forward of :class:`~dflash_ext.drafter.DFlashDrafter` over many blocks
of one sequence (training). A mixin: DFlashDrafter's ``forward``."""
import torch

from . import reference
from .drafter_masks import block_mask, context_mask


class TrainingForward:
    """DFlashDrafter's training forward (it holds `config`, `layers`, `fc`, `hidden_norm`, `norm`)."""

    # ------------------------------------------------------------------ training forward
    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Differentiable forward of all blocks of one sequence at once (training).

        features [S, k*H]: the target features of the sequence's S tokens (k layers
        concatenated); block_embeds [nb, B, H]: target embeddings of [anchor token, MASK...];
        anchors [nb]: block positions. Block a attends to the context rows at positions
        < anchors[a] and to its own B rows, exactly what the block drafted at anchors[a]
        sees at inference, through the same per-layer masks (:func:`context_mask`,
        :func:`block_mask`). The scores against the context, shared by all blocks, and
        against each block's own rows are one softmax ([nb, B, S + B] per head) without
        copying the context keys per block, so the cost grows linearly with the number of
        anchors. Returns final-normed hidden [nb, B, H].
        """
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
        kinds = list(zip(c.layer_windows, c.layer_causal))
        # the keys each query may not see, per (window, causal): context [nb, 1 or B, S], own block [B, B] (None: all)
        hidden_keys = {}
        for w, causal in set(kinds):
            symmetric = w > 0 and not causal  # |p - k| < w: per query on the context, both ways in the block
            hidden_keys[w, causal] = (~context_mask(anchors, S, w, B if causal or symmetric else 0),
                                      ~block_mask(B, w, anchors.device, causal) if causal or symmetric else None)
        x = block_embeds
        for layer, kind in zip(self.layers, kinds):
            a = layer.self_attn
            k_ctx = reference.apply_rope(a.k_norm(a.k_proj(ctx).view(S, Hkv, D)), cos_c, sin_c)
            v_ctx = a.v_proj(ctx).view(S, Hkv, D)
            hidden, hidden_own = hidden_keys[kind]

            def attend(q, k, v):  # called within this iteration, so the closure sees this layer's tensors
                # q [nb, B, Hq, D]; k, v [nb, B, Hkv, D]; query head h reads kv head h // group
                q = q.reshape(nb, B, Hkv, group, D) * scale
                on_ctx = torch.einsum("nbhgd,shd->hgnbs", q, k_ctx).masked_fill(hidden, float("-inf"))
                on_own = torch.einsum("nbhgd,nchd->hgnbc", q, k)
                if hidden_own is not None:
                    on_own = on_own.masked_fill(hidden_own, float("-inf"))
                # [Hkv, group, nb, B, S + B], normalised in fp32 (CPU autocast would keep a bf16 softmax in bf16)
                p = torch.cat([on_ctx, on_own], -1).softmax(-1, dtype=torch.float32).to(v.dtype)
                o = (torch.einsum("hgnbs,shd->nbhgd", p[..., :S], v_ctx)
                     + torch.einsum("hgnbc,nchd->nbhgd", p[..., S:], v))
                return o.reshape(nb, B, Hq, D)

            x = layer(x, cos_b, sin_b, attend)
        return self.norm(x)
