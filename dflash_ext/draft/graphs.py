"""CUDA graphs of the draft step: :func:`capture_cuda_graph` (any function, as torch advises)
and :class:`CapturedDraftStep` (one block shape of a :class:`~.runtime.DraftRuntime`'s step,
replayed per draft)."""
from typing import Callable

import torch

__all__ = ["capture_cuda_graph", "CapturedDraftStep"]


def capture_cuda_graph(fn: Callable[[], torch.Tensor]):
    """(graph, output) of `fn` captured in a CUDA graph on the current device: two warm-up
    calls on a side stream first (lazy initialisation, the kernels' one-time set-up and the
    allocator's pools stay out of the capture), as torch.cuda.graphs advises. Replaying the
    graph rewrites the output tensor in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class CapturedDraftStep:
    """``runtime.draft_tokens`` for one block of `width` mask tokens and `n` drafts (`sampled`:
    ``runtime.draft_logits``, what a sampled draft is drawn from; the sampling runs after the
    replay, eagerly, with the caller's generator), captured in a CUDA graph: static input
    buffers (the block's token ids and positions), the cache and its device lengths read in
    place, one replay per draft. The attention is planned for the cache capacity, so a replay
    stays correct as the context grows within it. The graph reads by address the runtime's
    :meth:`~.runtime.DraftRuntime.graph_buffers` (the cache, the RoPE tables: once one is
    another tensor, grown, the step no longer :meth:`fits` and is captured anew) and its
    :meth:`~.runtime.DraftRuntime.graph_weights` (held here; the runtime drops its graphs
    when :meth:`~.runtime.DraftRuntime.refresh` finds one at a new address)."""

    @torch.no_grad()
    def __init__(self, runtime, width: int, n: int, sampled: bool = False):
        dev = runtime.device
        step = runtime.draft_logits if sampled else runtime.draft_tokens
        with torch.cuda.device(dev):
            # held: those tensors stay alive while the graph may replay
            self.buffers, self.weights = runtime.graph_buffers(), runtime.graph_weights()
            self.ids = torch.full((1, width + 1), runtime.config.mask_token_id, dtype=torch.long, device=dev)
            self.offsets = torch.arange(width + 1, device=dev)[None]
            self.positions = self.offsets.clone()
            self.graph, self.out = capture_cuda_graph(lambda: step(self.ids, self.positions, n))

    def fits(self, runtime) -> bool:
        """Whether the cache and the tables the runtime's step reads are still the ones this
        graph was captured on (a few identity checks: no walk over the weights)."""
        return all(a is b for a, b in zip(runtime.graph_buffers(), self.buffers))

    def __call__(self, last_token: int, position: int):
        self.ids[:, :1].fill_(last_token)                     # device fills: no host round trip
        torch.add(self.offsets, position, out=self.positions)
        self.graph.replay()
        # the next replay overwrites self.out
        return tuple(t.clone() for t in self.out) if isinstance(self.out, tuple) else self.out.clone()
