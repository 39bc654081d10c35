"""The draft side of one ``spec_generate`` generation: :class:`DFlashProposer` joins a drafter
to one target through a :class:`~.runtime.DraftRuntime` that holds the target's block
embedding and LM head: it takes the target's hidden states of the accepted tokens
(:meth:`~DFlashProposer.accept`) and drafts the next block (:meth:`~DFlashProposer.propose`).
Any object with these two methods is a proposer to the loop
(:class:`~dflash_ext.testing.oracle.OracleProposer` is another)."""
import torch

from .head import block_embedding
from .runtime import DraftRuntime

__all__ = ["DFlashProposer"]


class DFlashProposer:
    """The drafter against one target for one generation.

    On CUDA the draft step reads nothing back on the host: the indices come from our own
    cache, so the runtime runs the ops with ``validate=False`` (their kernels guard every
    index), the cache lengths live in a device tensor updated in place, and the RoPE tables
    are covered from host counts. So the whole step (block embedding, N layers, final norm,
    LM head, argmax or DFlash2's selector) is captured in a CUDA graph per block size and
    replayed (`cuda_graph`, default: on for a CUDA drafter with the fused ops). The injection
    after a verify runs eagerly (its token count varies), without a sync. On the CPU nothing
    of this applies: the ops validate and run eagerly.

    `capacity` bounds the context tokens the cache may hold (past it: an error);
    `initial_capacity` (None: all of `capacity`) is what is allocated at first: the cache
    then grows geometrically as tokens are accepted (:class:`~.cache.DraftCache`), and the
    RoPE tables with it, so memory follows what is generated. A growth gives the cache (and
    the tables) new addresses and the attention a new static bound, so the captured graphs
    are captured again then: a few times per generation (doubling)."""

    def __init__(self, drafter, target, capacity: int, fused: bool = True, draft_window=None, cuda_graph=None,
                 initial_capacity=None):
        drafter.check_fits(target.config)
        on_cuda = drafter.fc.weight.device.type == "cuda"
        start = capacity if initial_capacity is None else min(initial_capacity, capacity)
        self.runtime = DraftRuntime(drafter, start, max_capacity=capacity, draft_window=draft_window, fused=fused,
                                    validate=not on_cuda, embed=block_embedding(target),
                                    lm_head=target.get_output_embeddings(),
                                    cuda_graph=on_cuda and fused if cuda_graph is None else cuda_graph)
        self.layer_ids = drafter.config.target_layer_ids
        self.block_size = drafter.config.block_size
        # Every position a block can reach: the cache holds <= capacity tokens, a block adds block_size.
        self.position_limit = capacity + drafter.config.block_size + 1

    @torch.no_grad()
    def accept(self, hidden_states, rows: slice, positions: torch.Tensor) -> None:
        """Inject the target hidden states (HF tuple: layer l is hidden_states[l + 1]) of the
        tokens in `rows` of the last target pass, at `positions` (those tokens' positions, in
        order after the context the proposer holds)."""
        runtime = self.runtime
        feats = [hidden_states[l + 1][0, rows].to(runtime.dtype) for l in self.layer_ids]
        runtime.cover(runtime.cache.lengths[0] + feats[0].shape[0])  # a host count: no device read
        runtime.add_context(0, feats, positions)

    @torch.no_grad()
    def propose(self, last_token: int, position: int, n: int) -> torch.Tensor:
        """n draft tokens following `last_token` at `position`. The drafter always runs
        over at least the block it was trained on (the same cost, and the problem it
        learned: fewer mask tokens change every slot's attention), and the LM head runs
        on the first n slots only."""
        width = max(n, self.block_size - 1)  # mask tokens in the block
        if position + width >= self.position_limit:
            raise RuntimeError(f"a block at position {position} of {width + 1} tokens runs past the "
                               f"{self.position_limit} positions this proposer was made for")
        return self.runtime.draft(last_token, position, width, n)
