"""Which keys a drafter's block queries see: the masks of the training forward
(:func:`context_mask`, :func:`block_mask`) and the plain-torch attention of a bidirectional
layer with a window (:func:`windowed_bidirectional_attention`, no fused op yet)."""
import torch


def context_mask(anchors: torch.Tensor, seq_len: int, window: int = 0, causal_block: int = 0) -> torch.Tensor:
    """Boolean mask (True = attend) of the context rows each block's queries see: block a
    sees the rows at positions < anchors[a]. Bidirectional (causal_block = 0): [nb, 1,
    seq_len], the same rows for all its queries, the last `window` of them when window > 0.
    Causal (causal_block = B) with a window: [nb, B, seq_len], query i at position
    anchors[a] + i sees the rows k with anchors[a] + i - k < window; without one every query
    sees every row before the anchor ([nb, 1, seq_len] again)."""
    pos = torch.arange(seq_len, device=anchors.device)[None, None, :]
    anchor = anchors[:, None, None]
    ctx = pos < anchor
    if window > 0:
        if causal_block:
            query = anchor + torch.arange(causal_block, device=anchors.device)[None, :, None]
            ctx = ctx & (query - pos < window)
        else:
            ctx = ctx & (pos >= anchor - window)
    return ctx


def block_mask(block_size: int, window: int = 0, device=None, causal: bool = True) -> torch.Tensor:
    """Boolean mask [B, B] (True = attend) of the block rows a causal layer's block queries
    see: query i sees rows j <= i with i - j < window (window = 0: no bound). A
    bidirectional layer sees the whole block; with a window (causal False) the rows
    |i - j| < window."""
    i = torch.arange(block_size, device=device)[:, None]
    j = torch.arange(block_size, device=device)[None, :]
    own = j <= i if causal else torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window > 0:
        own &= (i - j).abs() < window
    return own


def windowed_bidirectional_attention(q, k_block, v_block, k_cache, v_cache, capacity: int, cache_lens,
                                     scale: float, window: int) -> torch.Tensor:
    """Attention of a bidirectional layer with a window, as the authors' code and TensorRT-LLM
    define it: the query at position p sees the keys at |p - k| < window, over the context rows
    (row r at position r, n = cache_lens[b] of them) and the block (query and key i at n + i).
    q [Bsz, B, Hq, D], block K/V [Bsz, B, Hkv, D], the cache [Bsz * capacity, Hkv, D]
    (sequence b at rows b * capacity). Plain torch over every row of the capacity under a
    mask, without host reads (a CUDA graph captures it); softmax in fp32."""
    Bsz, B, Hq, D = q.shape
    Hkv = k_block.shape[2]
    group = Hq // Hkv
    rows = torch.arange(capacity, device=q.device)
    query_pos = cache_lens[:, None] + torch.arange(B, device=q.device)  # [Bsz, B]
    on_ctx = (rows < cache_lens[:, None, None]) & (query_pos[:, :, None] - rows < window)  # [Bsz, B, capacity]
    on_own = block_mask(B, window, q.device, causal=False)
    k_ctx = k_cache[:Bsz * capacity].view(Bsz, capacity, Hkv, D)
    v_ctx = v_cache[:Bsz * capacity].view(Bsz, capacity, Hkv, D)
    qf = q.float().view(Bsz, B, Hkv, group, D) * scale
    s_ctx = torch.einsum("bihgd,brhd->bhgir", qf, k_ctx.float()).masked_fill(~on_ctx[:, None, None], float("-inf"))
    s_own = torch.einsum("bihgd,bjhd->bhgij", qf, k_block.float()).masked_fill(~on_own, float("-inf"))
    p = torch.cat([s_ctx, s_own], -1).softmax(-1)
    o = (torch.einsum("bhgir,brhd->bihgd", p[..., :capacity], v_ctx.float())
         + torch.einsum("bhgij,bjhd->bihgd", p[..., capacity:], v_block.float()))
    return o.reshape(Bsz, B, Hq, D).to(q.dtype)
