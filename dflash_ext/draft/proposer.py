"""The draft side of one step: :class:`DFlashProposer` joins a drafter to one target
(its embedding and LM head, the drafter's context cache, the selected target layers),
captures the draft step in a CUDA graph on CUDA, and turns the drafter's hidden states
into draft tokens (:func:`draft_tokens`, with the CPU LM-head padding rule). The block's
embeddings come from :func:`block_embedding`, here and in training."""
import copy
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .drafter import CandidateSelector, DFlashDrafter, DraftCache
from .hardware import skinny_linear_streams

__all__ = ["DFlashProposer", "draft_tokens", "capture_cuda_graph", "block_embedding"]


def block_embedding(target) -> nn.Module:
    """The target's input embedding as DFlash embeds a block [token, MASK...]: as
    transformers' DFlash path does (``DFlashTokenCandidateGenerator._get_noise_embeds``),
    without the normaliser some embeddings apply after the lookup (``embed_norm``), keeping
    any scale (Gemma's sqrt(H)). A view that shares the target's weights and leaves its
    embedding as it is (transformers swaps the norm out per call, which a captured CUDA
    graph or a concurrent target forward would not survive)."""
    embed = target.get_input_embeddings()
    if getattr(embed, "embed_norm", None) is None:
        return embed
    view = copy.copy(embed)
    view._modules = {**embed._modules, "embed_norm": nn.Identity()}
    return view


def draft_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 vocab: Optional[torch.Tensor] = None, n: Optional[int] = None,
                 selector: Optional[CandidateSelector] = None, anchor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Greedy draft tokens [Bsz, n] from the drafter's final hidden states [Bsz, B, H]: the
    argmax of the LM head (`weight`, `bias`) at slots 1..n (default n = B - 1; slot 0 is the
    last accepted token). Only those n rows go through the LM head, the step's largest
    GEMM. With a draft vocabulary, `weight` holds the rows of those token ids only and
    `vocab` maps back. A DFlash2 drafter's `selector` drafts its path from the `anchor`
    tokens [Bsz] (the block's slot 0) over these logits instead of the argmax."""
    Bsz, B, H = hidden.shape
    n = B - 1 if n is None else n
    rows = hidden[:, 1:n + 1].reshape(Bsz * n, H)
    if skinny_linear_streams(rows, weight):
        logits = ops.skinny_linear(rows, weight, bias).view(Bsz, n, -1)
    else:
        pad = _lm_head_padding(rows.shape[0], weight, bias)
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        logits = F.linear(rows, weight, bias)[:Bsz * n].view(Bsz, n, -1)
    if selector is not None:
        return selector(hidden[:, 1:n + 1], logits, anchor, vocab)
    best = logits.argmax(-1)
    return best if vocab is None else vocab[best]


_PADDING = {}  # (rows, weight shape, dtype, bias?) -> rows to add


def _lm_head_padding(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """Rows to pad an LM-head GEMM with on CPU: 0 or up to a multiple of 16, whichever this
    machine runs faster (measured once per shape). CPU GEMM kernels run some row counts
    far slower than the next multiple of 16 (MKL in fp32: 10 rows about 2x slower than 16,
    bench/results/history/notebook-2026.md §2), others faster (bf16 with avx512_bf16: 3 rows in
    half the time of 16)."""
    pad = -rows % 16
    if weight.device.type != "cpu" or pad == 0:
        return 0
    key = (rows, tuple(weight.shape), weight.dtype, bias is not None)
    if key not in _PADDING:
        plain, padded = (torch.randn(m, weight.shape[1], dtype=weight.dtype) for m in (rows, rows + pad))
        best = {0: float("inf"), pad: float("inf")}
        with torch.no_grad():
            for _ in range(8):  # interleaved, the minimum of each: robust to other work on the cores
                for p, x in ((0, plain), (pad, padded)):
                    t = time.perf_counter()
                    F.linear(x, weight, bias)
                    best[p] = min(best[p], time.perf_counter() - t)
        _PADDING[key] = min(best, key=best.get)
    return _PADDING[key]


class DFlashProposer:
    """Glue between the drafter and one target: the target's embedding and LM head, the
    drafter's context cache, and the selected target layers.

    On CUDA the draft step reads nothing back on the host: the indices come from our own
    cache, so the fused ops run with ``validate=False`` (their kernels guard every index),
    the cache lengths live in a device tensor updated in place, and the RoPE tables cover
    every reachable position from the start. So the whole step (block embedding, N
    layers, final norm, LM head, argmax or DFlash2's selector) is captured in a CUDA graph per block size and
    replayed (``cuda_graph``, default: on for a CUDA drafter with the fused ops). The
    injection after a verify runs eagerly (its token count varies), without a sync.
    On CPU nothing of this applies: the ops validate and run eagerly.

    `capacity` bounds the context tokens the cache may hold (past it: an error);
    `initial_capacity` (None: all of `capacity`) is what is allocated at first: the cache
    then grows geometrically as tokens are accepted (:class:`DraftCache`), and the RoPE
    tables with it, so memory follows what is generated. A growth gives the cache (and
    the tables) new addresses and the attention a new static bound, so the captured
    graphs are captured again then: a few times per generation (doubling)."""

    def __init__(self, drafter: DFlashDrafter, target, capacity: int, fused: bool = True,
                 draft_window: Optional[int] = None, cuda_graph: Optional[bool] = None,
                 initial_capacity: Optional[int] = None):
        drafter.check_fits(target.config)
        self.drafter, self.fused = drafter, fused
        if fused:
            drafter.stack_weights()
        self.embed = block_embedding(target)
        self.lm_head = target.get_output_embeddings()
        self.layer_ids = drafter.config.target_layer_ids
        self.mask_token_id = drafter.config.mask_token_id
        start = capacity if initial_capacity is None else min(initial_capacity, capacity)
        self.cache: DraftCache = drafter.new_cache(1, start, draft_window, max_capacity=capacity)
        self.device = drafter.fc.weight.device
        on_cuda = self.device.type == "cuda"
        # Every position a block can reach (the cache holds <= capacity tokens, a block
        # adds block_size). The tables are held here (a captured graph's tables stay alive
        # whatever the drafter does later) and grown with the cache (_cover).
        self.position_limit = capacity + drafter.config.block_size + 1
        self.rope = None
        self._cover(start + drafter.config.block_size + 1)
        self.validate = not on_cuda
        if cuda_graph and not (on_cuda and fused):
            raise ValueError("cuda_graph=True needs a drafter on a CUDA device and fused=True")
        self.cuda_graph = on_cuda and fused if cuda_graph is None else cuda_graph
        self._graphs = {}  # (mask tokens in the block, tokens kept) -> _CapturedDraftStep
        self.vocab = self.vocab_head = self.vocab_bias = None
        if drafter.draft_vocab is not None:  # cached on the drafter: gathered once, not per generation
            self.vocab, self.vocab_head, self.vocab_bias = drafter.draft_vocab_head(self.lm_head)

    @torch.no_grad()
    def accept(self, hidden_states, rows: slice, positions: torch.Tensor) -> None:
        """Inject the target hidden states (HF tuple: layer l is hidden_states[l + 1]) of the
        tokens in `rows` of the last target pass, at `positions`."""
        feats = [hidden_states[l + 1][0, rows].to(self.drafter.fc.weight.dtype) for l in self.layer_ids]
        # the positions of the tokens accepted in order (a host count: no device read)
        self._cover(self.cache.lengths[0] + feats[0].shape[0])
        self.drafter.add_context(self.cache, 0, feats, positions, fused=self.fused, rope=self.rope,
                                 validate=self.validate)

    def _cover(self, positions: int) -> None:
        """RoPE tables for at least `positions` positions, grown geometrically by the drafter
        (rope_tables; past a rope type's position limit, its error)."""
        if self.rope is None or self.rope[0].shape[0] < positions:
            self.rope = self.drafter.rope_tables(positions)

    @torch.no_grad()
    def propose(self, last_token: int, position: int, n: int) -> torch.Tensor:
        """n draft tokens following `last_token` at `position`. The drafter always runs
        over at least the block it was trained on (the same cost, and the problem it
        learned: fewer mask tokens change every slot's attention), and the LM head runs
        on the first n slots only."""
        width = max(n, self.drafter.config.block_size - 1)  # mask tokens in the block
        if position + width >= self.position_limit:
            raise RuntimeError(f"a block at position {position} of {width + 1} tokens runs past the "
                               f"{self.position_limit} positions this proposer was made for")
        self._cover(position + width + 1)
        if self.cuda_graph:
            return self._captured_step(width, n)(last_token, position)
        ids = torch.full((1, width + 1), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, :1].fill_(last_token)
        return self.draft_step(ids, torch.arange(position, position + width + 1, device=self.device)[None], n)

    def _captured_step(self, width: int, n: int) -> "_CapturedDraftStep":
        """The draft step for this block in a CUDA graph, captured anew when the cache or the
        tables grew since (the graphs that no longer fit, and their memory pools, go first)."""
        step = self._graphs.get((width, n))
        if step is None or not step.fits(self):
            step = None
            self._graphs = {key: g for key, g in self._graphs.items() if g.fits(self)}
            step = self._graphs[(width, n)] = _CapturedDraftStep(self, width, n)
        return step

    def draft_step(self, ids: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """The first n draft tokens for the block `ids` [1, width + 1] at `positions`:
        everything a captured step replays (no host reads on CUDA)."""
        embeds = self.embed(ids).to(self.drafter.fc.weight.dtype)
        hidden = self.drafter.draft_hidden(self.cache, embeds, positions, fused=self.fused, rope=self.rope,
                                           validate=self.validate)
        if self.vocab is None:
            head = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        else:
            head = self.vocab_head, self.vocab_bias
        selector = getattr(self.drafter, "candidate_selector", None)  # DFlash2
        return draft_tokens(hidden.to(head[0].dtype), *head, vocab=self.vocab, n=n, selector=selector,
                            anchor=ids[:, 0])[0]


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


class _CapturedDraftStep:
    """DFlashProposer.draft_step for one block width and draft count, captured in a CUDA
    graph: static input buffers (the block's token ids and positions), the cache and its device lengths read
    in place, one replay per draft. The attention is planned for the cache capacity, so a
    replay stays correct as the context grows within it. The graph holds the drafter's
    weights and the proposer's tensors by address: a proposer lives for one generation, and
    the drafter must not be moved or changed meanwhile (a new proposer captures anew); a
    cache or RoPE tables grown since the capture no longer fit it (:meth:`fits`)."""

    @torch.no_grad()
    def __init__(self, proposer: DFlashProposer, width: int, n: int):
        dev = proposer.device
        with torch.cuda.device(dev):
            self._capture(proposer, width, n, dev)

    @staticmethod
    def _layout(proposer: DFlashProposer) -> tuple:
        """What a capture reads by address: the cache (new tensors at every growth, which
        also changes the capacity the attention is planned for) and the RoPE tables."""
        return proposer.cache.k, proposer.cache.v, proposer.rope

    def fits(self, proposer: DFlashProposer) -> bool:
        """Whether the proposer's cache and tables are still those this graph was captured on."""
        return all(now is then for now, then in zip(self._layout(proposer), self.layout))

    def _capture(self, proposer: DFlashProposer, width: int, n: int, dev) -> None:
        self.layout = self._layout(proposer)  # also keeps those tensors alive while the graph may replay
        self.ids = torch.full((1, width + 1), proposer.mask_token_id, dtype=torch.long, device=dev)
        self.offsets = torch.arange(width + 1, device=dev)[None]
        self.positions = self.offsets.clone()
        self.graph, self.out = capture_cuda_graph(lambda: proposer.draft_step(self.ids, self.positions, n))

    def __call__(self, last_token: int, position: int) -> torch.Tensor:
        self.ids[:, :1].fill_(last_token)                     # device fills: no host round trip
        torch.add(self.offsets, position, out=self.positions)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out

