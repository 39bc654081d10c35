"""Plain PyTorch versions of the fused ops: the specification every kernel is tested
against, differentiable. By default the math runs in float32 and the result is cast back to
the input dtype; ``compute_dtype=x.dtype`` runs it in the input dtype instead, which is the
"what plain PyTorch in that dtype gets" baseline of the tolerance rule in the tests. (The
batched baselines the benchmarks time the ops against are bench/baselines.py.)
"""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rotate_half", "apply_rope", "qk_norm_rope", "project_features", "inject_context_kv",
           "block_attention", "skinny_linear", "block_conv"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
             compute_dtype: Optional[torch.dtype] = None):
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in `compute_dtype` (None: x's dtype,
    what the other references use on tensors they cast already) and cast to x's dtype.

    With a `residual` (the spec of ops.rms_norm's add + norm): ``s = x + residual``, rounded to
    x's dtype as a separate add would, and returns ``(s, rms_norm(s))``."""
    cd = x.dtype if compute_dtype is None else compute_dtype
    if residual is not None:
        s = (x.to(cd) + residual.to(cd)).to(x.dtype)
        return s, rms_norm(s, weight, eps, compute_dtype=cd)
    xs = x.to(cd)
    return (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cd)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face convention: ``[-x[..., D/2:], x[..., :D/2]]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def qk_norm_rope(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float = 1e-6,
                 compute_dtype: Optional[torch.dtype] = torch.float32):
    """The q and k of a decoder layer from its stacked projection ``qkv [M, (Hq + 2 Hkv) * D]``
    (columns q heads, then k heads, then v heads; D = len(q_norm_weight)): each head RMS-normed
    over D times its norm weight, then rotated by RoPE at ``cos, sin [M, D]`` (the rows of
    each token's position; rotate_half convention, as apply_rope). Returns ``(q [M, Hq, D],
    k [M, Hkv, D])`` in qkv's dtype, one cast at the end; v is the view
    ``qkv[:, (Hq + Hkv) * D:]`` and needs no op."""
    M, D = qkv.shape[0], q_norm_weight.shape[0]
    x = qkv.to(compute_dtype)
    c, s = cos.to(compute_dtype)[:, None, :], sin.to(compute_dtype)[:, None, :]
    q = x[:, :num_q_heads * D].unflatten(-1, (num_q_heads, D))
    k = x[:, num_q_heads * D:(num_q_heads + num_kv_heads) * D].unflatten(-1, (num_kv_heads, D))
    q = apply_rope(rms_norm(q, q_norm_weight.to(compute_dtype), eps), c, s)
    k = apply_rope(rms_norm(k, k_norm_weight.to(compute_dtype), eps), c, s)
    return q.to(qkv.dtype), k.to(qkv.dtype)


def project_features(features: Sequence[torch.Tensor], fc_weight: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float = 1e-6,
                     compute_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    out_dtype = features[0].dtype
    x = torch.cat([f.to(compute_dtype) for f in features], dim=-1)
    y = x @ fc_weight.to(compute_dtype).T
    return rms_norm(y, norm_weight.to(compute_dtype), eps).to(out_dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed in `compute_dtype`, in x's dtype."""
    b = None if bias is None else bias.to(compute_dtype)
    return F.linear(x.to(compute_dtype), weight.to(compute_dtype), b).to(x.dtype)


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
                    window: int = 0, causal: bool = False,
                    compute_dtype: Optional[torch.dtype] = torch.float32, symmetric: bool = False) -> torch.Tensor:
    """The rule of ops.block_attention as an explicit boolean mask over positions: context
    row r at r, block key j at n + j, block query i at n + i (n = cache_lens[b]). Keys that
    no query sees are dropped before any math, as the op never reads them."""
    if causal and symmetric:
        raise ValueError("causal and symmetric exclude each other")
    Bsz, Bq, Hq, D = q.shape
    group = Hq // k_block.shape[2]
    out = torch.empty_like(q)
    for b in range(Bsz):
        off, n = int(cache_offsets[b]), int(cache_lens[b])
        key_pos = torch.arange(n + Bq)[None, :]  # [1, n + Bq]: the context rows, then the block
        query_pos = n + torch.arange(Bq)[:, None]  # [Bq, 1]
        if causal:
            visible = key_pos <= query_pos
            if window > 0:
                visible &= query_pos - key_pos < window
        elif symmetric:  # |p - k| < window on both sides (0: every key)
            visible = ((query_pos - key_pos).abs() < window) if window > 0 else torch.ones(Bq, n + Bq, dtype=torch.bool)
        else:  # the last `window` context rows (all when 0) and every block key
            visible = (key_pos >= n - window if window > 0 else key_pos >= 0).expand(Bq, -1)
        seen = visible.any(0).to(q.device)  # [n + Bq]: keys some query sees
        k = torch.cat([k_cache[off:off + n][seen[:n]], k_block[b][seen[n:]]]).to(compute_dtype)  # [L, Hkv, D]
        v = torch.cat([v_cache[off:off + n][seen[:n]], v_block[b][seen[n:]]]).to(compute_dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[b].to(compute_dtype), k) * scale
        s = s.masked_fill(~visible.to(q.device)[:, seen], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hij,jhd->ihd", p, v).to(q.dtype)
    return out


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor,
               compute_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """DFlash2's dynamic depthwise convolution along each block, looking back only and never
    across a block boundary: ``x [M, B, H]`` (M blocks of B slots), ``base [T, H]`` (a static
    coefficient per tap and channel), ``delta [M, B, T, G]`` (a coefficient per slot, tap and
    channel group; G divides H, channel c is in group c // (H / G)). Returns ``[M, B, H]``:
    ``out[m, i, c] = sum_t (base[t, c] + delta[m, i, t, c // (H / G)]) * x[m, i - t, c]``
    over the taps t <= i, accumulated in `compute_dtype` and cast to x's dtype once."""
    M, B, H = x.shape
    T, G = base.shape[0], delta.shape[-1]
    xs = x.to(compute_dtype)
    per_channel = delta.to(compute_dtype).repeat_interleave(H // G, dim=-1)  # [M, B, T, H]
    coef = base.to(compute_dtype)[None, None] + per_channel
    out = torch.zeros_like(xs)
    for t in range(min(T, B)):
        out[:, t:] += coef[:, t:, t] * xs[:, :B - t]
    return out.to(x.dtype)
