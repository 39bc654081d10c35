"""The draft tree of one DFlash draft pass (issue 66): :func:`build_tree`.

A DFlash drafter drafts a block in one pass: slot s (0-based) predicts the token at depth
s + 1 after the last accepted token (the root), and its distribution does not depend on the
tokens drafted before it. So a path of d tokens (t_1 .. t_d) has the draft log-probability
sum_s logq_s(t_{s+1}), and the best tree of N nodes is the N most probable paths of that
product distribution: a node is (depth d, ranks r_1 .. r_d into the slots' sorted
candidates), its children the candidates of slot d.

The order (what "best" means, ties included, so that the tree is one deterministic function
of the log-probabilities): each slot's candidates sorted by (log-prob desc, token id asc);
nodes by (path log-prob desc, depth asc, rank sequence lexicographically asc). A child never
comes before its parent (its log-prob adds a value <= 0; an equal score has the larger
depth), so the first N nodes are a tree, and that order is a topological one: the build
returns the nodes in it (node 0 the most probable path of one token).

The build is vectorised on the device, with no host read: one stable sort per slot, then one
beam per depth: the best min(N, K^d) paths of depth d are among the extensions of the best
min(N, K^(d-1)) of depth d - 1 (K = min(N, V) candidates a slot), since a path's prefix
extended by the same child keeps its order; the best N of the union of the beams are the
tree. Each beam is kept with its entries' lexicographic positions, so ties resolve by the
rank sequence exactly as the order says (a plain best-first reference with a heap:
python_tests/decode/test_tree.py).
"""
from typing import NamedTuple, Optional

import torch

__all__ = ["DraftTree", "build_tree", "tree_size"]


class DraftTree(NamedTuple):
    """A draft tree of n nodes, in best-first (topological) order: `tokens [n]` (target token
    ids), `parents [n]` (the parent's node index, -1 for the root's children: the root is the
    last accepted token), `depths [n]` (1 for the root's children), `ancestors [n, n]` (bool:
    node i sees node j iff j is i or an ancestor of i), `scores [n]` (float64: the path's draft
    log-probability)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    scores: torch.Tensor


def tree_size(slots: int, vocab: int, budget: int) -> int:
    """The nodes of the tree :func:`build_tree` returns: `budget`, or every path of at most
    `slots` tokens over K = min(budget, vocab) candidates when there are fewer (host arithmetic)."""
    k, total, level = min(budget, vocab), 0, 1
    for _ in range(slots):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


@torch.no_grad()
def build_tree(logprobs: torch.Tensor, budget: int, vocab: Optional[torch.Tensor] = None) -> DraftTree:
    """The best-first tree of :func:`tree_size` nodes (at most `budget`) of one draft pass's
    per-slot log-probabilities `logprobs [S, V]` (slot s: depth s + 1; values <= 0, e.g. a
    log_softmax; NaN not allowed), in the module's order. `vocab [V]`: the target token id of
    each column (a drafter's draft vocabulary), None: the columns are the token ids. Nothing
    is read on the host; the shapes follow from S, V and `budget` alone."""
    if type(budget) is not int or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (the tree's nodes), got {budget!r}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [slots, vocab], got shape {list(logprobs.shape)}")
    S, V = logprobs.shape
    device = logprobs.device
    n = tree_size(S, V, budget) if V > 0 else 0
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(empty, empty, empty, torch.zeros(0, 0, dtype=torch.bool, device=device),
                         torch.zeros(0, dtype=torch.float64, device=device))
    K = min(budget, V)
    # Each slot's candidates, (log-prob desc, column asc): a stable sort keeps equal values in column order.
    sorted_lp, sorted_col = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    lp, col = sorted_lp[:, :K].double(), sorted_col[:, :K]

    # The beams, depth by depth: score, parent (its index in the previous beam), child rank, lexicographic position.
    scores, parents, ranks, lexpos = [lp[0]], [None], [torch.arange(K, device=device)], [torch.arange(K, device=device)]
    width = K
    for d in range(1, S):
        new_width = min(budget, width * K)
        by_lex = torch.argsort(lexpos[-1])  # the beam's entries in lexicographic order
        cand = (scores[-1][by_lex, None] + lp[d][None, :]).reshape(-1)  # index: lexpos(parent) * K + child rank
        order = torch.sort(cand, descending=True, stable=True).indices[:new_width]
        scores.append(cand[order])
        parents.append(by_lex[order // K])
        ranks.append(order % K)
        lexpos.append(torch.argsort(torch.argsort(order)))  # the lexicographic keys `order` are distinct
        width = new_width
    widths = [s.shape[0] for s in scores]
    offsets = [sum(widths[:d]) for d in range(S)]

    # The union, arranged by (depth, lexicographic position), then a stable sort by score: the order's first n.
    by_key = torch.cat([torch.argsort(p) + o for p, o in zip(lexpos, offsets)])
    all_scores = torch.cat(scores)
    chosen = by_key[torch.sort(all_scores[by_key], descending=True, stable=True).indices[:n]]  # entries, in order

    depth_of = torch.cat([torch.full((w,), d + 1, dtype=torch.long, device=device) for d, w in enumerate(widths)])
    # An entry's parent as an entry of the union (-1 at depth 1), then as a node of the tree.
    parent_entry = torch.cat([torch.full((widths[0],), -1, dtype=torch.long, device=device)]
                             + [p + offsets[d - 1] for d, p in enumerate(parents) if d > 0])
    node_of = torch.full((all_scores.shape[0] + 1,), -1, dtype=torch.long, device=device)  # last: "no parent"
    node_of[chosen] = torch.arange(n, device=device)
    parent_entry = parent_entry[chosen]
    tree_parents = node_of[torch.where(parent_entry >= 0, parent_entry, all_scores.shape[0])]
    depths = depth_of[chosen]
    slot_rank = torch.cat(ranks)[chosen]
    tokens = col[depths - 1, slot_rank]
    if vocab is not None:
        tokens = vocab.to(device)[tokens]
    return DraftTree(tokens, tree_parents, depths, ancestor_mask(tree_parents, S), all_scores[chosen])


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at each of its ancestors (`parents [n]`, -1 for the
    root's children; no path longer than `max_depth`): max_depth - 1 gathers, no host read."""
    n = parents.shape[0]
    mask = torch.zeros(n, n + 1, dtype=torch.bool, device=parents.device)  # last column: "no ancestor"
    rows = torch.arange(n, device=parents.device)
    mask[rows, rows] = True
    up = parents
    for _ in range(max_depth - 1):
        mask[rows, torch.where(up >= 0, up, n)] = True
        up = torch.where(up >= 0, parents[up.clamp_min(0)], up)
    return mask[:, :n]
