"""The baselines a user would write instead of each fused op: batched plain PyTorch in the
inputs' dtype (no fp32 upcast, no Python loop over tokens or layers). bench.bench_ops times the
fused ops against them; python_tests/ops/test_reference_baselines.py checks them against the
specification (dflash_ext.ops.reference)."""
import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from dflash_ext.ops import reference

def eager_project_features(features: Sequence[torch.Tensor], fc_weight: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The project_features a user would write: ``F.rms_norm(F.linear(torch.cat(features, -1),
    fc_weight))`` times norm_weight, in the inputs' dtype."""
    return F.rms_norm(F.linear(torch.cat(list(features), -1), fc_weight), (fc_weight.shape[0],),
                      norm_weight, eps)


def eager_bare_linear(cat_features: torch.Tensor, fc_weight: torch.Tensor) -> torch.Tensor:
    """The bare GEMM of project_features, ``F.linear(cat_features, fc_weight)``, on features
    concatenated beforehand (no concat, no norm): the floor the fused op should reach."""
    return F.linear(cat_features, fc_weight)


def eager_inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots,
                            k_cache, v_cache, eps: float = 1e-6) -> None:
    """The inject_context_kv a user would write (every slot >= 0): one ``F.linear`` over all N
    layers' K weights, ``F.rms_norm`` over D times the per-layer norm weight, rotate_half RoPE
    gathered at ``positions``, one ``F.linear`` for V, and two index writes into the caches."""
    T, H = ctx.shape
    N, HD, _ = k_weight.shape
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k = F.linear(ctx, k_weight.view(N * HD, H)).view(T, N, Hkv, D)
    k = F.rms_norm(k, (D,), eps=eps) * k_norm_weight[None, :, None, :]
    k = reference.apply_rope(k, cos[positions][:, None, None, :], sin[positions][:, None, None, :])
    v = F.linear(ctx, v_weight.view(N * HD, H)).view(T, N, Hkv, D)
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)


def eager_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_len: int, scale: float) -> torch.Tensor:
    """The block_attention a user would write, for Bsz sequences whose contexts lie back to
    back in the cache with one length ``ctx_len`` (sequence b: rows ``b * ctx_len ..``): a view
    of the cache, ``torch.cat`` with the block K/V, ``F.scaled_dot_product_attention(...,
    enable_gqa=True)`` and ``transpose(1, 2).contiguous()`` back to ``[Bsz, Bq, Hq, D]``."""
    Bsz, Bq, Hq, D = q.shape
    Hkv = k_block.shape[2]
    k_ctx = k_cache[: Bsz * ctx_len].view(Bsz, ctx_len, Hkv, D)
    v_ctx = v_cache[: Bsz * ctx_len].view(Bsz, ctx_len, Hkv, D)
    k = torch.cat([k_ctx, k_block], dim=1).transpose(1, 2)  # [Bsz, Hkv, L, D]
    v = torch.cat([v_ctx, v_block], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=None)
def sdpa_supports_gqa() -> bool:
    """Whether this torch's F.scaled_dot_product_attention takes ``enable_gqa=True``."""
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8),
                                       torch.zeros(1, 1, 1, 8), enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def sdpa_problem(q, k_block, v_block, k_cache, v_cache, cache_offsets, cache_lens, scale: float,
                 gqa: Optional[bool] = None):
    """block_attention laid out for SDPA at its best case (build it outside a timed region): q
    as contiguous ``[Bsz, Hq, Bq, D]``; per sequence b its context rows ``k_cache[offsets[b]:
    offsets[b] + lens[b]]`` followed by ``k_block[b]``, as contiguous ``[Bsz, Hkv, L, D]`` K and V.
    All sequences need one context length. gqa: True passes ``enable_gqa=True``, False expands
    K/V to Hq heads, None picks True where supported. Returns ``(q, k, v, kwargs)``."""
    Bsz, Bq, Hq, D = q.shape
    Hkv = k_block.shape[2]
    offs, ns = [int(o) for o in cache_offsets.tolist()], [int(n) for n in cache_lens.tolist()]
    if len(set(ns)) > 1:
        raise ValueError(f"sdpa_problem: all sequences need the same context length, got {ns}")
    k, v = (torch.stack([torch.cat([c[o:o + n], blk[b]]) for b, (o, n) in enumerate(zip(offs, ns))])
            .transpose(1, 2) for c, blk in ((k_cache, k_block), (v_cache, v_block)))
    kwargs = dict(scale=scale)
    if Hq != Hkv:
        if sdpa_supports_gqa() if gqa is None else gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    return q.transpose(1, 2).contiguous(), k.contiguous(), v.contiguous(), kwargs


def sdpa_block_attention(problem) -> torch.Tensor:
    """Non-causal ``F.scaled_dot_product_attention`` on an ``sdpa_problem``; the output is
    ``[Bsz, Hq, Bq, D]`` (the fused op's is ``[Bsz, Bq, Hq, D]``: compare after ``.transpose(1, 2)``)."""
    q, k, v, kwargs = problem
    return F.scaled_dot_product_attention(q, k, v, is_causal=False, **kwargs)


def eager_block_conv(x, base, delta):
    """The block_conv a user would write, in x's dtype: T - 1 zero slots padded in front of
    each block, the T-slot windows unfolded, times base plus the group deltas repeated over
    their channels (window position T - 1 - t holds tap t), summed."""
    T, H, G = base.shape[0], x.shape[-1], delta.shape[-1]
    windows = F.pad(x, (0, 0, T - 1, 0)).unfold(1, T, 1)  # [M, B, H, T]
    coef = base.flip(0).T + delta.flip(2).repeat_interleave(H // G, -1).transpose(-1, -2)  # [M, B, H, T]
    return (windows * coef).sum(-1)
