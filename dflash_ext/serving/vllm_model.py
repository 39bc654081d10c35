"""vLLM's DFlash drafter (``vllm.model_executor.models.qwen3_dflash``) with each decoder
layer's norms, per-head q/k norm + RoPE and residual adds run by our fused ops
(:func:`dflash_ext.ops.rms_norm`, :func:`dflash_ext.ops.qk_norm_rope`); its projections,
attention over vLLM's paged KV cache, MLP, context K/V precompute and LM head stay vLLM's.
Registered by :mod:`.vllm_plugin`; imported by vLLM only (it imports vLLM)."""
import torch
from vllm.model_executor.models.qwen3_dflash import (DFlashQwen3DecoderLayer, DFlashQwen3ForCausalLM,
                                                      DFlashQwen3Model)

from .. import ops

__all__ = ["FusedDFlashQwen3ForCausalLM", "FusedDFlashDecoderLayer", "fusable"]


def fusable(attn) -> bool:
    """Whether qk_norm_rope computes this attention's q/k as vLLM does: rotate_half (neox) RoPE
    over the whole head, and no value scale; another layer keeps vLLM's own forward."""
    rope = attn.rotary_emb
    return bool(rope.is_neox_style) and getattr(rope, "rotary_dim", attn.head_dim) == attn.head_dim \
        and getattr(attn, "v_scale", None) is None


class FusedDFlashDecoderLayer(DFlashQwen3DecoderLayer):
    """vLLM's DFlash decoder layer, computing the same function on our fused ops."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual):
        if not fusable(self.self_attn):
            return super().forward(positions, hidden_states, residual)
        norm, eps = self.input_layernorm, self.input_layernorm.variance_epsilon
        if residual is None:
            residual, hidden_states = hidden_states, ops.rms_norm(hidden_states, norm.weight, eps)
        else:  # ours returns (x + residual, its norm); vLLM's RMSNorm returns them the other way round
            residual, hidden_states = ops.rms_norm(hidden_states, norm.weight, eps, residual=residual)
        hidden_states = self._attention(positions, hidden_states)
        post = self.post_attention_layernorm
        residual, hidden_states = ops.rms_norm(hidden_states, post.weight, post.variance_epsilon, residual=residual)
        return self.mlp(hidden_states), residual

    def _attention(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        qkv, _ = a.qkv_proj(hidden_states)
        # vLLM's table row: [cos | sin] of half the head each; ours takes rotate_half's full-width tables
        cos, sin = a.rotary_emb.cos_sin_cache.index_select(0, positions).to(qkv.dtype).chunk(2, dim=-1)
        q, k = ops.qk_norm_rope(qkv, a.q_norm.weight, a.k_norm.weight, torch.cat([cos, cos], -1),
                                torch.cat([sin, sin], -1), a.num_heads, a.num_kv_heads, a.q_norm.variance_epsilon)
        v = qkv[:, a.q_size + a.kv_size:]
        out, _ = a.o_proj(a.attn(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v))
        return out


class FusedDFlashQwen3Model(DFlashQwen3Model):
    decoder_layer_cls = FusedDFlashDecoderLayer


class FusedDFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash drafter on :class:`FusedDFlashDecoderLayer` layers (same weights, same loader)."""
    model_cls = FusedDFlashQwen3Model
