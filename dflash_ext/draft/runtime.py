"""The draft runtime: a :class:`~dflash_ext.model.drafter.DFlashDrafter` at inference, over
the fused ops. :class:`DraftRuntime` holds the drafting state (reset per generation) and runs
the draft step; the proposer (:mod:`.proposer`, ``spec_generate``'s) and the Hugging Face
assistant (:mod:`.assistant`) both wrap one. The drafter's own code holds none of it
(``spec_generate`` keeps its proposer on the drafter as an opaque attribute, dropped when the
drafter is copied: :func:`~.proposer.kept_proposer`).
"""
from typing import Optional, Sequence

import torch

from .. import ops
from ..model.layers import rope_tables
from ..ops import reference
from ..sampling import Draft, Sampling, sample_draft
from .cache import DraftCache
from .graphs import CapturedDraftStep
from .head import greedy_draft, slot_logits, vocab_head, vocab_head_key
from .layers import fused_layer, stacked_kv_weights, stacked_layer_weights

__all__ = ["DraftRuntime"]


def refuse_deepspec(drafter, where: str) -> None:
    """NotImplementedError for a drafter in DeepSpec's format (DSpark): its block layout (every
    slot drafts), own embedding and LM head, Markov walk and confidence cut are not in the
    fused draft step yet."""
    if drafter.config.is_deepspec:
        raise NotImplementedError(
            f"{where} does not draft with DSpark / DeepSpec-format drafters ({drafter.config.deepspec_architecture}) "
            "yet; dflash_ext.draft.dspark.DSparkProposer drafts with them in plain PyTorch (a proposer object for "
            "spec_generate)")


class DraftRuntime:
    """One generation's drafting with `drafter` over `batch_size` sequences:

    - the context cache (:class:`~.cache.DraftCache`): `capacity` rows per sequence at first,
      growing up to `max_capacity` (None: fixed), each layer's window capped by `draft_window`;
    - the RoPE tables, grown with the positions asked for (:meth:`cover`);
    - the weights the fused ops read, by the rule of :mod:`.layers`: the drafts follow every
      in-place write to the parameters at once (the stacked weights are their storage); a
      parameter replaced, cast or moved is picked up by :meth:`refresh`, which :meth:`reset`
      runs at each generation's start: one walk over the parameters per generation, none per
      draft (the drafter keeps its device and dtype while a runtime drafts with it: the cache
      is in them);
    - with the target's block `embed`\\ding and `lm_head` (the proposer's case): the draft tokens
      (:meth:`draft`; sampled at T > 0, :meth:`sample_draft`), the LM head restricted to the
      drafter's draft vocabulary (:func:`~.head.vocab_head`), and with `cuda_graph` (a CUDA
      drafter, `fused`, `validate` False) each block shape's step captured in a CUDA graph and
      replayed (:class:`~.graphs.CapturedDraftStep`).

    `fused`: the layers on the fused ops (False: the reference layers, ``DecoderLayer.forward``
    over ``reference.*``). `validate`: the ops check their index values (and
    :meth:`add_context` / :meth:`draft_hidden` read the largest position to size the RoPE
    tables: on CUDA a sync each); False reads nothing on the host, so the caller covers the
    positions first (:meth:`cover`) and the attention is planned for the cache's capacity (a
    static bound: what a CUDA graph needs).

    A runtime lives as long as its caller keeps it: a generation starts with :meth:`reset`,
    which keeps the cache's memory, the tables, the stacked weights, the vocabulary head and
    the captured graphs (:class:`~dflash_ext.draft.proposer.DFlashProposer` and the loop's
    :func:`~dflash_ext.draft.proposer.kept_proposer` reuse one across generations).
    """

    def __init__(self, drafter, capacity: int, *, batch_size: int = 1, max_capacity: Optional[int] = None,
                 draft_window: Optional[int] = None, fused: bool = True, validate: bool = True, embed=None,
                 lm_head=None, cuda_graph: bool = False):
        refuse_deepspec(drafter, "the draft runtime (spec_generate, DFlashProposer)")
        p = drafter.fc.weight
        if cuda_graph and not (p.device.type == "cuda" and fused):
            raise ValueError("cuda_graph=True needs a drafter on a CUDA device and fused=True")
        if cuda_graph and (validate or embed is None or lm_head is None):
            raise ValueError("cuda_graph=True captures the whole draft step: it needs validate=False (nothing read "
                             "on the host) and the target's embed and lm_head")
        self.drafter, self.config, self.fused, self.validate = drafter, drafter.config, fused, validate
        self.device, self.dtype = p.device, p.dtype
        self.cache = DraftCache(self.config, batch_size, capacity, p.device, p.dtype, draft_window, max_capacity)
        self.rope = None
        first, limit = capacity + self.config.block_size + 1, self.config.rope_position_limit
        self.cover(first if limit is None else min(first, limit))  # a position past a limit: its error, then
        self.embed, self.lm_head, self.cuda_graph = embed, lm_head, bool(cuda_graph)
        self.vocab = self.vocab_weight = self.vocab_bias = None
        self._vocab_key = self._weights_key = self._layer_weights = None
        self._graphs = {}  # (mask tokens in the block, tokens kept, sampled) -> CapturedDraftStep
        self.refresh()  # stacked now, on the caller's stream (never first inside a CUDA graph's warm-up)

    # ------------------------------------------------------------------ state
    def cover(self, positions: int) -> None:
        """RoPE tables for at least the positions ``0 .. positions - 1``, grown geometrically (at
        least 1024 positions, then doubling; a rope type's position limit caps the growth, and
        asking past it is its error: :func:`~dflash_ext.model.layers.rope_tables`)."""
        have = 0 if self.rope is None else self.rope[0].shape[0]
        if have >= positions:
            return
        grown = max(positions, 2 * (have or 512))
        limit = self.config.rope_position_limit
        if limit is not None:
            grown = max(positions, min(grown, limit))
        self.rope = rope_tables(self.config, grown, self.device, self.dtype)

    def reset(self, max_capacity: Optional[int] = None) -> None:
        """Start a new generation: every sequence's context forgotten (the cache's lengths to
        0; its memory, the tables, the weights and the graphs kept), the cache's bound raised
        to `max_capacity` where that is more, and the weights checked (:meth:`refresh`)."""
        if max_capacity is not None and max_capacity > self.cache.max_capacity:
            self.cache.max_capacity = max_capacity
        for b in range(len(self.cache.lengths)):
            self.cache.set_length(b, 0)
        self.refresh()

    def refresh(self) -> None:
        """Pick up drafter or LM-head weights replaced, cast or moved (a new tensor; in-place
        writes need nothing): the layers' weights stacked again where a parameter is no longer
        a view of them, the draft vocabulary's head rows gathered again, and the captured
        graphs, which read every weight by address, dropped where an address changed. One
        walk over the parameters: :meth:`reset` runs it once per generation."""
        if self.fused:
            self._layer_weights = stacked_layer_weights(self.drafter.layers, self._layer_weights)
        if self.lm_head is not None and self.drafter.draft_vocab is not None:
            key = vocab_head_key(self.lm_head, self.dtype)
            if key != self._vocab_key:
                self.vocab, self.vocab_weight, self.vocab_bias = vocab_head(self.lm_head, self.drafter.draft_vocab,
                                                                            self.dtype)
                self._vocab_key = key
        if self.cuda_graph:
            key = tuple(t.data_ptr() for t in self.graph_weights())
            if key != self._weights_key:
                self._graphs.clear()
            self._weights_key = key

    def layer_weights(self):
        """Per layer, its stacked (q/k/v, gate/up) weights (:func:`~.layers.stacked_layer_weights`),
        checked now (:meth:`refresh`): the same tensors while the parameters are still their views."""
        self.refresh()
        return self._layer_weights

    # ------------------------------------------------------------------ the draft step
    @torch.no_grad()
    def add_context(self, b: int, features: Sequence[torch.Tensor], positions: torch.Tensor) -> None:
        """Project the target features [T, H] (one per target layer) of T newly accepted tokens
        of sequence b at `positions` and write their K/V into every layer's cache (the cache
        grows as needed). With ``validate=False`` a token skipped by the op for a position the
        tables do not cover still counts in the cache length."""
        T = features[0].shape[0]
        if T == 0:
            return
        d, eps = self.drafter, self.config.rms_norm_eps
        if self.validate:
            self.cover(int(positions.max()) + 1)
        impl = ops if self.fused else reference
        ctx = impl.project_features(list(features), d.fc.weight, d.hidden_norm.weight, eps)
        slots = self.cache.slots_for(b, T)
        args = (ctx, *stacked_kv_weights(d.layers), *self.rope, positions, slots, self.cache.k, self.cache.v, eps)
        if self.fused:
            ops.inject_context_kv(*args, validate=self.validate)
        else:
            reference.inject_context_kv(*args)
        self.cache.advance(b, T)

    @torch.no_grad()
    def draft_hidden(self, block_embeds: torch.Tensor, positions: torch.Tensor, seqs=None) -> torch.Tensor:
        """Run the N layers over the blocks ``block_embeds [Bsz, B, H]`` (target embeddings of
        [last accepted token, MASK...]) at ``positions [Bsz, B]`` against each sequence's
        context; returns the final-normed hidden states [Bsz, B, H]. Block K/V are scratch: the
        cache is not changed. `seqs` (a long tensor [Bsz]): the cache's sequences the blocks
        belong to (None: all, in order; a batch whose finished rows left drafts the others only)."""
        if self.validate:
            self.cover(int(positions.max()) + 1)
        return self._layers(block_embeds, positions, seqs)

    def _layers(self, block_embeds: torch.Tensor, positions: torch.Tensor, seqs=None) -> torch.Tensor:
        """:meth:`draft_hidden` at positions the RoPE tables cover already (nothing read on the host)."""
        cos, sin = self.rope
        cos, sin = cos[positions], sin[positions]  # [Bsz, B, D]
        fused, cache = self.fused, self.cache
        offsets, lens = (cache.offsets, cache.lens) if seqs is None else (cache.offsets[seqs], cache.lens[seqs])
        attention = ops.block_attention if fused else reference.block_attention
        fused_args = dict(max_context=-1 if self.validate else cache.capacity, validate=self.validate) if fused else {}
        scale = self.config.head_dim ** -0.5
        symmetric = self.config.layer_symmetric_window
        weights = self._layer_weights
        token_rope = cos.flatten(0, 1), sin.flatten(0, 1)  # [Bsz * B, D]: the fused layers' rows
        x, pending = block_embeds, None  # pending: a fused layer's MLP output, added by the next norm
        for i, layer in enumerate(self.drafter.layers):
            def attend(q, k, v, i=i):  # symmetric: |p - k| < W per query (DFlash2's sliding layers)
                return attention(q, k, v, cache.k[i], cache.v[i], offsets, lens, scale,
                                 window=cache.windows[i], causal=cache.causal[i], symmetric=symmetric[i], **fused_args)
            if fused:
                x, pending = fused_layer(layer, *weights[i], x, pending, *token_rope, attend)
                continue
            x = layer(x, cos[:, :, None, :], sin[:, :, None, :], attend, reference.block_conv)
        norm = self.drafter.norm
        if not fused:
            return norm(x)
        return ops.rms_norm(x, norm.weight, norm.eps) if pending is None else \
            ops.rms_norm(pending, norm.weight, norm.eps, residual=x)[1]

    def _final_hidden(self, ids: torch.Tensor, positions: torch.Tensor, seqs=None):
        """(final hidden states [Bsz, W + 1, H] in the head's dtype, (head weight, bias)) of the
        blocks `ids` at covered `positions`: the target's embedding of the blocks and the layers
        (`seqs`: as in :meth:`draft_hidden`)."""
        if self.embed is None or self.lm_head is None:
            raise ValueError("drafting needs the target's embed and lm_head (DraftRuntime(..., embed=, lm_head=))")
        hidden = self._layers(self.embed(ids).to(self.dtype), positions, seqs)
        if self.vocab is None:
            head = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        else:
            head = self.vocab_weight, self.vocab_bias
        return hidden.to(head[0].dtype), head

    def draft_tokens(self, ids: torch.Tensor, positions: torch.Tensor, n: int, seqs=None) -> torch.Tensor:
        """The first n greedy draft tokens [Bsz, n] of the blocks `ids` [Bsz, W + 1] at
        `positions`: the target's embedding of the blocks, :meth:`draft_hidden`, the LM head
        (over the draft vocabulary) and each slot's argmax, or a DFlash2 drafter's selector
        path. The positions must be covered (:meth:`cover`): nothing is read on the host here
        (with ``validate=False`` not by the ops either), so this is what a captured step replays.
        `seqs`: as in :meth:`draft_hidden`."""
        hidden, head = self._final_hidden(ids, positions, seqs)
        selector = getattr(self.drafter, "candidate_selector", None)  # DFlash2
        return greedy_draft(hidden, *head, vocab=self.vocab, n=n, selector=selector, anchor=ids[:, 0])

    def draft_logits(self, ids: torch.Tensor, positions: torch.Tensor, n: int, seqs=None) -> tuple:
        """(hidden [Bsz, n, H], logits [Bsz, n, V']) of the first n prediction slots of the blocks
        `ids` at covered `positions`: what a sampled draft (:meth:`sample_draft`) is drawn from,
        and what a captured step replays at T > 0 (the sampling itself runs after the replay).
        `seqs`: as in :meth:`draft_hidden`."""
        hidden, head = self._final_hidden(ids, positions, seqs)
        return hidden[:, 1:n + 1], slot_logits(hidden, *head, n)

    def sample_draft(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                     sampling: Sampling) -> Draft:
        """The sampled draft (:func:`~dflash_ext.sampling.sample_draft`) of :meth:`draft_logits`' output
        after the `anchor` tokens [Bsz]: q over the target's vocabulary."""
        return sample_draft(hidden, logits, self.lm_head.weight.shape[0], sampling, vocab=self.vocab,
                            selector=getattr(self.drafter, "candidate_selector", None), anchor=anchor)

    @torch.no_grad()
    def draft(self, last_token: int, position: int, width: int, n: int, sampling: Optional[Sampling] = None):
        """The first n draft tokens [n] of sequence 0's block [last_token, MASK x width] at the
        positions ``position .. position + width`` (covered here, from host numbers): greedy,
        or with `sampling` (a :class:`~dflash_ext.sampling.Sampling` at temperature > 0) a
        :class:`~dflash_ext.sampling.Draft` of them and their q [n, V]. With `cuda_graph`, a replay
        of the step captured for (width, n) (at T > 0: up to the logits, the sampling after
        it), captured anew once the cache or the tables grew (:meth:`graph_buffers`) or
        :meth:`refresh` found a weight at a new address; without, one row of :meth:`draft_rows`."""
        if not self.cuda_graph:
            out = self.draft_rows([0], [last_token], [position], width, n, sampling)
            return out[0] if sampling is None else Draft(out.tokens[0], out.probs[0])
        sampled = sampling is not None
        out = self._replay(last_token, position, width, n, sampled)
        if not sampled:
            return out[0]
        anchor = torch.full((1,), last_token, dtype=torch.long, device=self.device)
        tokens, probs = self.sample_draft(*out, anchor, sampling)
        return Draft(tokens[0], probs[0])

    def _replay(self, last_token: int, position: int, width: int, n: int, sampled: bool):
        """The captured step for (width, n, `sampled`: up to the logits) replayed at `position`
        after `last_token` (captured first, or anew where it no longer fits)."""
        self.cover(position + width + 1)
        step = self._graphs.get((width, n, sampled))
        if step is None or not step.fits(self):  # the graphs that no longer fit, and their pools, go first
            self._graphs = {key: g for key, g in self._graphs.items() if g.fits(self)}
            step = self._graphs[(width, n, sampled)] = CapturedDraftStep(self, width, n, sampled)
        return step(last_token, position)

    @torch.no_grad()
    def draft_distribution(self, last_token: int, position: int, width: int, n: int) -> torch.Tensor:
        """The LM head's logits [n, V'] (over the draft vocabulary where the drafter has one) of
        the first n slots of sequence 0's block [last_token, MASK x width] at ``position ..``:
        each slot's distribution, what a draft tree is built from. With `cuda_graph`, a replay
        of :meth:`draft`'s sampled step (it ends at these logits)."""
        if self.cuda_graph:
            return self._replay(last_token, position, width, n, True)[1][0]
        return self.draft_logits(*self._blocks([last_token], [position], width), n)[1][0]

    def _blocks(self, last_tokens: Sequence[int], positions: Sequence[int], width: int):
        """(ids, positions) [rows, width + 1] of the blocks [last_tokens[i], MASK x width] at
        ``positions[i] ..``, those positions covered first (from host numbers)."""
        self.cover(max(positions) + width + 1)
        ids = torch.full((len(last_tokens), width + 1), self.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.tensor(list(last_tokens), dtype=torch.long, device=self.device)
        pos = torch.tensor(list(positions), device=self.device)[:, None] + torch.arange(width + 1, device=self.device)
        return ids, pos

    @torch.no_grad()
    def draft_rows(self, seqs: Sequence[int], last_tokens: Sequence[int], positions: Sequence[int], width: int,
                   n: int, sampling: Optional[Sampling] = None):
        """:meth:`draft` for several sequences at once: the first n draft tokens [len(seqs), n] of
        the blocks [last_tokens[i], MASK x width] of sequences `seqs` at the positions
        ``positions[i] .. positions[i] + width``, in one pass of the layers (eagerly: the captured
        steps are :meth:`draft`'s, one sequence); with `sampling` a :class:`~dflash_ext.sampling.Draft`
        of them and their q [len(seqs), n, V] (row i's q drawn from row i's logits)."""
        ids, pos = self._blocks(last_tokens, positions, width)
        every = list(seqs) == list(range(len(self.cache.lengths)))
        which = None if every else torch.tensor(list(seqs), device=self.device)
        if sampling is None:
            return self.draft_tokens(ids, pos, n, which)
        return self.sample_draft(*self.draft_logits(ids, pos, n, which), ids[:, 0], sampling)

    def graph_buffers(self) -> tuple:
        """What a captured step reads by address and a generation may replace: the cache (new
        tensors at every growth, which also changes the capacity the attention is planned for)
        and the RoPE tables. The weights' addresses are :meth:`refresh`'s to check."""
        return (self.cache.k, self.cache.v, *self.rope)

    def graph_weights(self) -> tuple:
        """Every weight a captured step reads by address: the stacked layer weights, the
        vocabulary head and each parameter of the drafter, the block embedding and the LM head
        (detached: a graph holding these keeps their memory alive even if a parameter is
        given another tensor before the next :meth:`refresh`)."""
        stacked = [w for pair in self._layer_weights or () for w in pair]
        params = (*self.drafter.parameters(), *self.embed.parameters(), *self.lm_head.parameters())
        return (*stacked, *(t for t in (self.vocab_weight, self.vocab_bias) if t is not None),
                *(p.detach() for p in params))
