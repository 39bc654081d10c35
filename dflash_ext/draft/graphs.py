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
    """``runtime.draft_tokens`` for one block of `width` mask tokens and `n` drafts, captured in
    a CUDA graph: static input buffers (the block's token ids and positions), the cache and its
    device lengths read in place, one replay per draft. The attention is planned for the cache
    capacity, so a replay stays correct as the context grows within it. The graph reads by
    address what :meth:`~.runtime.DraftRuntime.graph_layout` lists (the cache, the RoPE tables,
    the weights, the vocabulary head): once one of them is another tensor (a cache or tables
    grown, a parameter replaced), the step no longer :meth:`fits` and is captured anew."""

    @torch.no_grad()
    def __init__(self, runtime, width: int, n: int):
        dev = runtime.device
        with torch.cuda.device(dev):
            self.layout = runtime.graph_layout()  # also keeps those tensors alive while the graph may replay
            self.ids = torch.full((1, width + 1), runtime.config.mask_token_id, dtype=torch.long, device=dev)
            self.offsets = torch.arange(width + 1, device=dev)[None]
            self.positions = self.offsets.clone()
            self.graph, self.out = capture_cuda_graph(lambda: runtime.draft_tokens(self.ids, self.positions, n))

    def fits(self, runtime) -> bool:
        """Whether what the runtime's step reads is still what this graph was captured on."""
        now = runtime.graph_layout()  # tensors (the same ones) and parameter addresses (the same values)
        return len(now) == len(self.layout) and all(a is b if isinstance(a, torch.Tensor) else a == b
                                                    for a, b in zip(now, self.layout))

    def __call__(self, last_token: int, position: int) -> torch.Tensor:
        self.ids[:, :1].fill_(last_token)                     # device fills: no host round trip
        torch.add(self.offsets, position, out=self.positions)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out
