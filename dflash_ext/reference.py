"""Plain PyTorch versions of the fused ops: the specification every kernel is tested
against. By default the math runs in float32 and the result is cast back to the input
dtype; ``compute_dtype=x.dtype`` runs it in the input dtype instead, which is the
"what plain PyTorch in that dtype gets" baseline of the tolerance rule in the tests.
"""
from typing import Optional, Sequence

import torch

__all__ = ["rms_norm", "rotate_half", "apply_rope", "project_features", "inject_context_kv",
           "block_attention"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in the dtype of x."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face convention: ``[-x[..., D/2:], x[..., :D/2]]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def project_features(features: Sequence[torch.Tensor], fc_weight: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float = 1e-6,
                     compute_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    out_dtype = features[0].dtype
    x = torch.cat([f.to(compute_dtype) for f in features], dim=-1)
    y = x @ fc_weight.to(compute_dtype).T
    return rms_norm(y, norm_weight.to(compute_dtype), eps).to(out_dtype)


def inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots, k_cache,
                      v_cache, eps: float = 1e-6,
                      compute_dtype: Optional[torch.dtype] = torch.float32) -> None:
    N, HD, H = k_weight.shape
    D = k_cache.shape[-1]
    keep = slots >= 0
    x = ctx[keep].to(compute_dtype)
    pos, rows = positions[keep], slots[keep]
    k = torch.einsum("th,nfh->ntf", x, k_weight.to(compute_dtype)).unflatten(-1, (HD // D, D))
    v = torch.einsum("th,nfh->ntf", x, v_weight.to(compute_dtype)).unflatten(-1, (HD // D, D))
    k = rms_norm(k, k_norm_weight.to(compute_dtype)[:, None, None, :], eps)
    k = apply_rope(k, cos[pos].to(compute_dtype)[None, :, None, :], sin[pos].to(compute_dtype)[None, :, None, :])
    k_cache[:, rows] = k.to(k_cache.dtype)
    v_cache[:, rows] = v.to(v_cache.dtype)


def block_attention(q, k_block, v_block, k_cache, v_cache, cache_offsets, cache_lens, scale: float,
                    window: int = 0, compute_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    Bsz, Bq, Hq, D = q.shape
    group = Hq // k_block.shape[2]
    out = torch.empty_like(q)
    for b in range(Bsz):
        off, n = int(cache_offsets[b]), int(cache_lens[b])
        start = off + max(0, n - window) if window > 0 else off
        k = torch.cat([k_cache[start:off + n], k_block[b]]).to(compute_dtype)  # [L, Hkv, D]
        v = torch.cat([v_cache[start:off + n], v_block[b]]).to(compute_dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[b].to(compute_dtype), k) * scale
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hij,jhd->ihd", p, v).to(q.dtype)
    return out
