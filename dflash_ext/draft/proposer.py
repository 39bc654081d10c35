"""The draft side of one ``spec_generate`` generation: :class:`DFlashProposer` joins a drafter
to one target through a :class:`~.runtime.DraftRuntime` that holds the target's block
embedding and LM head: it takes the target's hidden states of the accepted tokens
(:meth:`~DFlashProposer.accept`) and drafts the next block (:meth:`~DFlashProposer.propose`).
Any object with these two methods is a proposer to the loop (:class:`Proposer`;
:class:`~dflash_ext.testing.oracle.OracleProposer` is another). :func:`proposer_for` picks the
proposer of a drafter's format (a DeepSpec one: :class:`~.dspark.DSparkProposer`)."""
import weakref
from typing import Optional, Protocol, runtime_checkable

import torch

from ..sampling import Draft, DraftDistribution, Sampling

from .dspark import DSparkProposer
from .head import block_embedding
from .runtime import DraftRuntime

__all__ = ["Proposer", "DFlashProposer", "proposer_for", "kept_proposer"]


@runtime_checkable
class Proposer(Protocol):
    """What ``spec_generate`` drives when it is given an object instead of a drafter (as
    transformers' ``CandidateGenerator`` is to ``generate``): ``accept`` takes the target's
    hidden states of the accepted tokens, ``propose`` returns n draft tokens ([n] long), or a
    :class:`~dflash_ext.sampling.Draft` (the tokens and the q they were sampled from, [n, V]). One may
    also have ``reset(positions)``, called at the start of each generation that reaches
    `positions` positions (:meth:`DFlashProposer.reset`)."""

    def accept(self, hidden_states, rows: slice, positions: torch.Tensor) -> None: ...

    def propose(self, last_token: int, position: int, n: int): ...


class DFlashProposer:
    """The drafter against one target for one generation.

    On CUDA the draft step reads nothing back on the host: the indices come from our own
    cache, so the runtime runs the ops with ``validate=False`` (their kernels guard every
    index), the cache lengths live in a device tensor updated in place, and the RoPE tables
    are covered from host counts. So the whole step (block embedding, N layers, final norm,
    LM head, argmax or DFlash2's selector) is captured in a CUDA graph per block size and
    replayed (`cuda_graph`, default: on for a CUDA drafter with the fused ops); with
    `sampling` (the generation's :class:`~dflash_ext.sampling.Sampling`: where it samples its
    drafts, T > 0 under the rejection rule) the graph ends at the LM head's logits
    and the few sampling ops run after it, eagerly, with the sampling's generator. The injection
    after a verify runs eagerly (its token count varies), without a sync. On the CPU nothing
    of this applies: the ops validate and run eagerly.

    `capacity` bounds the context tokens the cache may hold (past it: an error);
    `initial_capacity` (None: all of `capacity`) is what is allocated at first: the cache
    then grows geometrically as tokens are accepted (:class:`~.cache.DraftCache`), and the
    RoPE tables with it, so memory follows what is generated. A growth gives the cache (and
    the tables) new addresses and the attention a new static bound, so the captured graphs
    are captured again then: a few times per generation (doubling).

    `batch_size`: sequences drafted together (a batch of prompts, :mod:`dflash_ext.decode.batch`),
    each with its own context (`capacity` rows each): :meth:`accept` names the sequence,
    :meth:`propose_rows` drafts several in one pass (eagerly)."""

    def __init__(self, drafter, target, capacity: int, fused: bool = True, draft_window=None, cuda_graph=None,
                 initial_capacity=None, batch_size: int = 1, sampling: Optional[Sampling] = None):
        drafter.check_fits(target.config)
        on_cuda = drafter.fc.weight.device.type == "cuda"
        start = capacity if initial_capacity is None else min(initial_capacity, capacity)
        self.runtime = DraftRuntime(drafter, start, max_capacity=capacity, draft_window=draft_window, fused=fused,
                                    validate=not on_cuda, embed=block_embedding(target), batch_size=batch_size,
                                    lm_head=target.get_output_embeddings(),
                                    cuda_graph=on_cuda and fused if cuda_graph is None else cuda_graph)
        self.layer_ids = drafter.config.target_layer_ids
        self.block_size = drafter.config.block_size
        # At T > 0 under rejection sampling the drafts are sampled (their q goes to the verifier).
        self.sampling = sampling if sampling is not None and sampling.samples_drafts else None
        self._bound(capacity)

    def reset(self, positions: int) -> None:
        """Start a new generation (the loop calls it: a proposer given to ``spec_generate`` again
        drafts from the new prompt, not the last one's context) whose prompt, budget and one
        block reach `positions`; more than this proposer was made for is a ValueError naming
        the drafter argument, now rather than mid-generation."""
        if positions > self.capacity:
            raise ValueError(f"drafter: this DFlashProposer holds {self.capacity} positions (its capacity), and "
                             f"this generation's prompt, budget and block need {positions}: make one with "
                             f"capacity >= {positions}")
        self.runtime.reset()

    def renew(self, capacity: int, sampling: Optional[Sampling] = None) -> None:
        """Start a new generation of up to `capacity` context tokens per sequence (the cache's
        bound raised where that is more: it still grows only as tokens are accepted) with the
        generation's `sampling`: what :func:`kept_proposer` does with a proposer it kept."""
        self._bound(capacity)
        self.sampling = sampling if sampling is not None and sampling.samples_drafts else None
        self.runtime.reset(max_capacity=capacity)

    def _bound(self, capacity: int) -> None:
        # Every position a block can reach: the cache holds <= capacity tokens, a block adds block_size.
        self.capacity, self.position_limit = capacity, capacity + self.block_size + 1

    @torch.no_grad()
    def accept(self, hidden_states, rows: slice, positions: torch.Tensor, seq: int = 0, index: int = 0) -> None:
        """Inject the target hidden states (HF tuple: layer l is hidden_states[l + 1]) of the
        tokens in `rows` (a slice, or a long tensor of rows: a tree's accepted path) of the last
        target pass, at `positions` (those tokens' positions, in order after the context the
        proposer holds), into sequence `seq`'s context; `index`: the pass's batch row they are in."""
        runtime = self.runtime
        feats = [hidden_states[l + 1][index, rows].to(runtime.dtype) for l in self.layer_ids]
        runtime.cover(runtime.cache.lengths[seq] + feats[0].shape[0])  # a host count: no device read
        runtime.add_context(seq, feats, positions)

    @torch.no_grad()
    def propose(self, last_token: int, position: int, n: int):
        """n draft tokens following `last_token` at `position`: the greedy ones, or with
        `sampling` (where it samples drafts) a :class:`~dflash_ext.sampling.Draft` (the tokens sampled from the
        drafter's processed distribution q, and q). The drafter always runs
        over at least the block it was trained on (the same cost, and the problem it
        learned: fewer mask tokens change every slot's attention), and the LM head runs
        on the first n slots only."""
        width = self._width(position, n)
        return self.runtime.draft(last_token, position, width, n, self.sampling)

    @torch.no_grad()
    def propose_distribution(self, last_token: int, position: int, n: int) -> DraftDistribution:
        """The per-slot distributions of :meth:`propose`'s draft pass (its first n slots'
        logits over the draft vocabulary, and that vocabulary): what a draft tree is built
        from (``spec_generate(..., tree_budget=)``). A DFlash2 drafter's slots follow the token
        drafted before them (its selector's walk), so they are no tree's slots: refused."""
        if getattr(self.runtime.drafter, "candidate_selector", None) is not None:
            raise NotImplementedError("tree drafting with a DFlash2 drafter: its slots' candidates follow the token "
                                      "drafted before them (the selector's walk), so a tree is not its slots' top-k")
        logits = self.runtime.draft_distribution(last_token, position, self._width(position, n), n)
        return DraftDistribution(logits, self.runtime.vocab)

    @torch.no_grad()
    def propose_rows(self, seqs, last_tokens, positions, n: int):
        """:meth:`propose` for the sequences `seqs` at once (one draft pass): the greedy tokens
        [len(seqs), n], or with `sampling` a :class:`~dflash_ext.sampling.Draft` of them and their q
        [len(seqs), n, V] (row i's q is row i's own, as :meth:`propose` returns it). A
        proposer of one sequence runs :meth:`propose`'s step (a captured one where it runs)."""
        if len(self.runtime.cache.lengths) == 1:
            draft = self.propose(last_tokens[0], positions[0], n)
            return draft[None] if self.sampling is None else Draft(draft.tokens[None], draft.probs[None])
        return self.runtime.draft_rows(seqs, last_tokens, positions, self._width(max(positions), n), n,
                                       self.sampling)

    def _width(self, position: int, n: int) -> int:
        """The mask tokens of a block drafting n tokens after `position` (checked against the positions made for)."""
        width = max(n, self.block_size - 1)
        if position + width >= self.position_limit:
            raise RuntimeError(f"a block at position {position} of {width + 1} tokens runs past the "
                               f"{self.position_limit} positions this proposer was made for")
        return width


def proposer_for(drafter, target, capacity: int, fused: bool = True, draft_window=None, cuda_graph=None,
                 initial_capacity=None, batch_size: int = 1, sampling: Optional[Sampling] = None):
    """The proposer of `drafter` against `target` (:class:`DFlashProposer`'s arguments): a
    DeepSpec-format drafter (DSpark, DeepSpec-DFlash) drafts through a
    :class:`~.dspark.DSparkProposer` (plain PyTorch: `fused`, `cuda_graph` and
    `initial_capacity` do not apply; a `draft_window` is a NotImplementedError), any other
    through a :class:`DFlashProposer`."""
    if not drafter.config.is_deepspec:
        return DFlashProposer(drafter, target, capacity, fused=fused, draft_window=draft_window,
                              cuda_graph=cuda_graph, initial_capacity=initial_capacity, batch_size=batch_size,
                              sampling=sampling)
    if draft_window is not None:
        raise NotImplementedError(f"draft_window={draft_window}: a DSpark / DeepSpec-format drafter "
                                  f"({drafter.config.deepspec_architecture}) drafts over its whole context "
                                  "(DSparkProposer has no draft window)")
    return DSparkProposer(drafter, target, capacity, sampling=sampling, batch_size=batch_size)


def kept_proposer(drafter, target, capacity: int, initial_capacity: int, fused: bool, draft_window,
                  batch_size: int, sampling: Sampling) -> DFlashProposer:
    """`drafter`'s proposer against `target` for a new generation (:meth:`DFlashProposer.renew`):
    the one kept on the drafter by the last call where it was made for the same target, device,
    dtype, batch size, fused choice and draft window, else a new one (`initial_capacity` rows
    per sequence at first), kept in its place. So the loop's generations share one runtime:
    its cache's memory, tables, stacked weights, vocabulary head and captured graphs. One is
    kept per drafter (it holds the last target's block embedding and LM head, and the cache
    at its largest); the drafter drops it when copied or pickled. A DeepSpec-format drafter's
    proposer (:func:`proposer_for`: plain PyTorch, nothing made once) is a new one each time."""
    if drafter.config.is_deepspec:
        return proposer_for(drafter, target, capacity, fused=fused, draft_window=draft_window, batch_size=batch_size,
                            sampling=sampling)
    weight = drafter.fc.weight
    key = (weight.device, weight.dtype, batch_size, fused, draft_window)
    kept = drafter.__dict__.get("_kept_proposer")
    if kept is not None and kept[0]() is target and kept[1] == key:
        kept[2].renew(capacity, sampling)
        return kept[2]
    drafter.__dict__["_kept_proposer"] = None  # the old one's memory goes before the new one's is taken
    proposer = DFlashProposer(drafter, target, capacity=capacity, initial_capacity=initial_capacity, fused=fused,
                              draft_window=draft_window, batch_size=batch_size, sampling=sampling)
    drafter.__dict__["_kept_proposer"] = (weakref.ref(target), key, proposer)
    return proposer
