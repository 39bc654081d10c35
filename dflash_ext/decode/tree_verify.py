"""The target's side of a tree step (issue 66): the verify pass over a draft tree
(:mod:`.tree_build`), its rule, and the cache after it.

- The pass (:func:`tree_inputs`): the target runs [root, node tokens...] (the root: the last
  accepted token, not yet in its cache) in one pass, node i at position pos + depth_i, under a
  4-D attention mask: every cache column visible, the root visible to all, a node sees only
  itself and its ancestors. transformers takes a 4-D mask as given (``masking_utils``: an
  already prepared mask is returned as-is), so the families whose every layer is full
  attention over a DynamicCache and whose attention reads an explicit mask (SDPA, eager)
  verify trees; a sliding window (its mask is built by the model, and its cache drops
  columns by count) or a linear-attention state (it folds in every token of the pass, in
  order, whatever the mask) cannot: :func:`check_tree_target` refuses them by name.
- The rule (:func:`verify_tree`): the target's token at every row of the pass (its argmax at
  T = 0, else one sample of its processed distribution p, :class:`~dflash_ext.sampling.Sampling`);
  from the root, descend into the child whose token is the target's token there, while there
  is one; then emit the target's token at the last node reached. At T = 0 that is the target's
  greedy output. At T > 0 each visited row's token is a fresh sample of p given the path so
  far, so the emitted tokens follow the target's own law exactly (sample-and-match, the
  "match" rule of :mod:`.verify`, over siblings). For a candidate set chosen
  deterministically (the top-k of the drafter's distribution, as here) it is also the best
  exact rule: no rule that emits p can accept a child c with probability above p(c), and this
  one accepts each child exactly that often. (A *sampled* tree, its children drawn from q,
  verified by recursive rejection sampling over siblings (SpecInfer, Sequoia), is another
  scheme: exact in expectation over the draws, it can accept more at T > 0 where q is close to
  p and spread out (one sampled child is accepted with probability sum min(p, q), one top-1
  child with p(top-1)); not built.)
- The cache (:func:`keep_path`): the pass wrote K/V for the whole tree; the accepted path's
  columns are moved right after the root's, in order, and the rest is cropped
  (:class:`~.rollback.CacheRollback`, as a chain's rejected tail).
"""
from typing import List, Tuple

import torch

from ..sampling import Sampling
from .tree_build import DraftTree

__all__ = ["check_tree_target", "check_tree_cache", "tree_inputs", "verify_tree", "keep_path"]

# Attention implementations that read an explicit 4-D mask as given.
MASKED_ATTENTION = ("sdpa", "eager")

# Why a cache layer kind (a substring of its class name) cannot hold a tree pass.
_WHY_NOT = {
    "Sliding": "a sliding window builds its own mask and drops its oldest columns by count, siblings counted",
    "LinearAttention": "a linear-attention state folds in every token of the pass in order, siblings too",
    "Indexed": "DSA's indexer picks each query's keys by its own scores and mask",
    "Static": "a static cache's buffer (decode trees on the dynamic cache)",
}


def check_tree_target(target) -> None:
    """A NotImplementedError naming the family (and what it holds) where a tree cannot be
    verified: every layer of the target's cache (as transformers builds it from the config)
    must be full attention (``DynamicLayer``: no sliding window, no linear-attention state),
    and its attention one that reads an explicit 4-D mask (:data:`MASKED_ATTENTION`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = target.config.get_text_config()
    family = getattr(config, "model_type", type(target).__name__)
    layers = DynamicCache(config=config).layers
    others = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if others:
        why = [reason for key, reason in _WHY_NOT.items() if any(key in kind for kind in others)]
        raise NotImplementedError(
            f"tree verification on a {family} target: its cache holds {', '.join(others)} layers, not full attention "
            f"only ({'; '.join(why) or 'a layer kind whose mask or cache a tree pass cannot steer'}); it verifies "
            "chains only (spec_generate)")
    impl = getattr(target.config, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if impl not in MASKED_ATTENTION:
        raise NotImplementedError(
            f"tree verification on a {family} target with attn_implementation={impl!r}: the tree's mask is a custom "
            f"4-D one, which {', '.join(MASKED_ATTENTION)} read as given; load the target with one of them")


def check_tree_cache(cache) -> None:
    """The target's cache after the prefill, as :func:`keep_path` moves its columns: a cache of
    full-attention DynamicLayers (not a static cache), else a NotImplementedError naming it."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}) \
        if layers is not None else [type(cache).__name__]
    if kinds:
        raise NotImplementedError(f"tree verification moves the accepted path's K/V in a DynamicCache of "
                                  f"DynamicLayers; this cache holds {', '.join(kinds)}")


def tree_inputs(tree: DraftTree, last: int, pos: int, cached: int, dtype: torch.dtype) -> Tuple[torch.Tensor, ...]:
    """The verify pass's (ids [1, n + 1], position_ids [1, n + 1], attention_mask [1, 1, n + 1,
    cached + n + 1]) over `tree` (n nodes) after the root `last` at position `pos`, with
    `cached` columns in the target's cache. The mask is additive in `dtype` (0: seen, the
    dtype's minimum: hidden), which SDPA and eager attention both read."""
    device, n = tree.tokens.device, tree.tokens.shape[0]
    ids = torch.cat([torch.tensor([last], device=device), tree.tokens])[None]
    positions = pos + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths])[None]
    seen = torch.ones(n + 1, cached + n + 1, dtype=torch.bool, device=device)
    seen[:, cached + 1:] = False
    seen[1:, cached + 1:] = tree.ancestors  # the root's row sees no node
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)
    return ids, positions, mask[None, None]


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampling: Sampling) -> Tuple[List[int], List[int]]:
    """The rule (module notes) on the pass's `logits [n + 1, V]` (row 0: the root, row 1 + i:
    node i): (the accepted path's node indices, root to leaf; the new tokens: the path's tokens,
    then the target's token after it). One host read (the target's tokens and the tree)."""
    n = tree.tokens.shape[0]
    target_tokens = sampling.token(logits)  # argmax at T = 0, else one sample of p per row
    host = torch.cat([target_tokens.view(-1), tree.tokens, tree.parents]).tolist()
    targets, tokens, parents = host[:n + 1], host[n + 1:2 * n + 1], host[2 * n + 1:]
    child = {(parents[i], tokens[i]): i for i in range(n)}  # siblings hold distinct tokens
    path, at = [], -1
    while (at, targets[at + 1]) in child:
        at = child[(at, targets[at + 1])]
        path.append(at)
    return path, [tokens[i] for i in path] + [targets[at + 1]]


def keep_path(cache, first: int, path: List[int]) -> None:
    """Move the K/V of the accepted `path` (node indices) to the columns right after the root:
    node i of the pass sits at column `first` + i (`first`: the column after the root's), and
    the path's nodes go to `first`, `first` + 1, ... in order (each layer's keys and values
    [b, heads, columns, dim]). The columns after them are the caller's to crop."""
    if not path or path == list(range(len(path))):
        return
    cols = torch.tensor(path, device=cache.layers[0].keys.device) + first
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            t[:, :, first:first + len(path)] = t[:, :, cols]  # the right side is a copy: overlaps are safe
