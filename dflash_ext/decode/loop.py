"""The decoding loops: :func:`spec_generate` (DFlash speculative decoding: a prefill, then
:func:`~.step.speculative_step` until the budget or a stop token) and :func:`target_generate`
(the target alone, one token per pass: the baseline, same sampling rules). A list of prompts
goes to :mod:`.batch` (:func:`~.batch.batch_generate`: one batch, ragged acceptance); what the
loops share (checks, output, result) is :mod:`.output`'s.
"""
from typing import Callable, Iterable, List, Optional, Union

import torch
from torch import nn

from ..draft.proposer import DFlashProposer, Proposer, kept_proposer
from ..model.drafter import DFlashDrafter
from ..ops.linear import streamed_linears
from ..sampling import Sampling
from . import runner as runner_module
from .autotune import choose_block_size
from .batch import RowProposers, batch_generate, check_batchable, per_row, prompt_rows, row_callback
from .output import GenerationResult, PhaseClock, RowOutput, check_on_tokens, check_sampling, prompt_ids
from .rollback import CacheRollback
from .runner import TargetRunner, vocab_size
from .step import DecodeState, OneRow, speculative_step
from .tree import TreeProposer, tree_step
from .tree_verify import check_tree_cache, check_tree_target

__all__ = ["spec_generate", "target_generate"]


# Blocks of answer the drafter's context cache holds before it first grows (spec_generate).
_FIRST_BLOCKS = 4


@torch.no_grad()
def spec_generate(target, drafter, input_ids, max_new_tokens: int, temperature: float = 0.0,
                  block_size=None, stop_token_ids: Iterable[int] = (), top_k: int = 0,
                  top_p: float = 1.0, generator: Optional[torch.Generator] = None, fused: bool = True,
                  on_tokens: Optional[Callable] = None,
                  draft_window: Optional[int] = None, streamer=None,
                  stream_linears: bool = True, static_cache: bool = False,
                  verify: Optional[str] = None,
                  tree_budget: Optional[int] = None) -> Union[GenerationResult, List[GenerationResult]]:
    """Speculative generation of up to `max_new_tokens` tokens after `input_ids` ([1, n] or a
    list): the loop around :func:`~.step.speculative_step`, which times and streams.

    `drafter` is a :class:`~dflash_ext.model.drafter.DFlashDrafter` (its proposer kept on it
    between generations: :func:`~dflash_ext.draft.proposer.kept_proposer`) or a proposer object
    (:class:`~dflash_ext.draft.proposer.Proposer`; one with ``reset`` is reset per generation).
    `block_size`: the verify block (int), "auto" (:func:`~.autotune.choose_block_size`) or None
    (the drafter's). `on_tokens` receives each step's new tokens; `streamer` is a Hugging Face
    streamer (``put``/``end``, e.g. TextStreamer). `draft_window` caps every drafter layer's
    window (long contexts; the authors' --draft-sliding-window-size): per query on causal
    layers, the last N context tokens on bidirectional ones
    (:func:`~dflash_ext.draft.cache.effective_windows`). `stream_linears`: the linear layers run
    through skinny_linear where it streams (:func:`~dflash_ext.ops.linear.streamed_linears`;
    False: F.linear). `static_cache`: a transformers StaticCache of the prompt, the budget and
    one block (:mod:`.rollback`), the B-token verify passes compiled on CUDA (CUDA graphs,
    :func:`~.runner.compiled_call`), eager on the CPU.

    `verify`: the verify rule at T > 0 (:mod:`.verify`): "rejection" (None: the default; the
    drafter's drafts sampled from its processed distribution, accepted with min(1, p/q)) or
    "match" (greedy drafts, accepted while they equal the target's sample). Both emit exactly
    the target's distribution; at T = 0 both are the greedy match. One `generator` drives the
    drafting and the verification: a seeded generator gives the same tokens again.

    `tree_budget` N (None or 0: the chain): each step verifies the N most probable paths of the
    draft pass's `block_size` - 1 slots in one target pass (:func:`~.tree.tree_step`; one prompt,
    the match rule, exact at every temperature; what it takes: docs/decoding.md, "Tree verification").

    One prompt or many, one rule (:func:`~.batch.prompt_rows`; docs/decoding.md, "One prompt
    or many"): a list or tuple of prompts (lists of ints, [n] or [1, n] tensors or arrays, of any
    lengths), or a [b, n] tensor with b > 1, returns a list of GenerationResult, one per prompt,
    even for a list of one; one prompt (a flat list of ints, an [n] or [1, n] tensor) one. A batch is decoded together (:func:`~.batch.batch_generate`: each row
    accepts its own drafts under the same `verify` rule, a finished row leaves the batch;
    full-attention targets only, else a NotImplementedError naming the family; a list of one
    runs the single-prompt loop). With a batch, `drafter` is a DFlashDrafter or a list of
    proposer objects, one per prompt; `on_tokens(row, tokens)`; `streamer` None or a list of
    one per prompt; "auto" times the batched passes (``choose_block_size(batch_size=...)``); no
    `static_cache`. Every argument is checked before the prefill, with an error naming it."""
    tree_budget = _check_tree(tree_budget, verify, block_size, static_cache, target)
    sampling = check_sampling(max_new_tokens, temperature, top_k, top_p, "match" if tree_budget else verify,
                              generator)
    rows = prompt_rows(input_ids, target, "spec_generate")
    check_on_tokens(on_tokens, batch=rows is not None)
    _check_drafter(drafter, None if rows is None else len(rows), tree=bool(tree_budget))
    _check_block_size(block_size, drafter)
    options = dict(block_size=block_size, stop_token_ids=stop_token_ids, fused=fused, draft_window=draft_window,
                   stream_linears=stream_linears, static_cache=static_cache, tree_budget=tree_budget)
    if rows is None:
        return _spec_generate_one(target, drafter, prompt_ids(input_ids, target, "spec_generate"), max_new_tokens,
                                  sampling, on_tokens=on_tokens, streamer=streamer, **options)
    return _spec_generate_batch(target, drafter, rows, max_new_tokens, sampling, on_tokens=on_tokens,
                                streamer=streamer, **options)


def _spec_generate_one(target, drafter, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, block_size,
                       stop_token_ids, fused, on_tokens, draft_window, streamer, stream_linears,
                       static_cache, tree_budget) -> GenerationResult:
    """spec_generate of one prompt, `ids` [1, n] on the target's device, its arguments checked."""
    models = [target] + ([drafter] if isinstance(drafter, nn.Module) else [])
    with streamed_linears(*models, enabled=stream_linears):
        device = ids.device
        n_prompt = ids.shape[1]
        B, proposer, layer_ids, trained = _drafting(target, drafter, block_size, n_prompt, max_new_tokens, fused,
                                                    draft_window, stream_linears, static_cache, sampling)
        if proposer is None:  # nothing to draft: the target alone, without the drafter's hidden states
            return _target_generate_one(target, ids, max_new_tokens, sampling, stop_token_ids, on_tokens, streamer,
                                        static_cache)
        if tree_budget and not isinstance(drafter, DFlashDrafter):
            proposer = drafter  # a tree proposer object drives the tree step itself
        runner = TargetRunner(target, layer_ids, compiled_sizes=(B,) if static_cache else ())
        # Prompt, budget, one block of rejected rows (the trained block: the length choose_block_size compiled for).
        cache = runner_module.make_static_cache(target, n_prompt + max_new_tokens + max(B, trained)) \
            if static_cache else None
        width = tree_budget + 1 if tree_budget else B  # a verify pass's tokens: the block, or the tree and its root
        out = RowOutput(ids, width, max_new_tokens, stop_token_ids, on_tokens, streamer)
        res = out.res
        clock = PhaseClock(device)
        logits, hidden, cache = runner(ids, cache, last_logits_only=True)
        if tree_budget:
            check_tree_cache(cache)
        clock("verify")
        last = int(sampling.token(logits[0, -1:])[0])
        state = DecodeState(OneRow(cache, CacheRollback(cache, width)), [0], [last], [n_prompt])
        done = out.emit([last])
        if not done and B > 1:
            proposer.accept(hidden, slice(0, n_prompt), torch.arange(n_prompt, device=device))
        clock("draft")
        while not done:
            verify_size = min(B, max_new_tokens - len(res.tokens) + 1)  # near the budget: verify fewer
            new = tree_step(runner, proposer, state, verify_size - 1, tree_budget, sampling, clock) if tree_budget \
                else speculative_step(runner, proposer, state, verify_size, sampling, clock)[0]
            before = len(res.tokens)
            done = out.emit(new)
            res.acceptance_lengths.append(len(res.tokens) - before)  # the budget may cut the last step
            clock("other")
        out.finish()
        res.draft_time, res.verify_time = clock.totals["draft"], clock.totals["verify"]
        return res


def _drafting(target, drafter, block_size, context_len: int, max_new_tokens: int, fused: bool, draft_window,
              stream_linears: bool, static_cache: bool, sampling: Sampling, batch_size: int = 1):
    """(verify block B, proposer, the target layers it reads, the drafter's trained block or
    0) of a generation of `batch_size` rows of at most `context_len` prompt tokens: a
    DFlashDrafter's kept proposer (:func:`_proposer`; None at B = 1: the target alone), or the
    caller's proposer objects (one, or a list of one per row), reset, as rows
    (:class:`~.batch.RowProposers`)."""
    if isinstance(drafter, DFlashDrafter):
        trained = drafter.config.block_size
        B = _block_size(target, drafter, block_size, context_len, max_new_tokens, stream_linears, static_cache,
                        batch_size)
        if B == 1:
            return 1, None, None, trained
        return (B, _proposer(drafter, target, B, context_len, max_new_tokens, fused, draft_window, sampling, batch_size),
                drafter.config.target_layer_ids, trained)
    proposers = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]
    _reset(proposers, context_len + max_new_tokens + block_size)
    rows = RowProposers(proposers, next(target.parameters()).device, vocab_size(target))
    return block_size, rows, getattr(proposers[0], "layer_ids", None), 0


def _block_size(target, drafter, block_size, context_len: int, max_new_tokens: int, stream_linears: bool,
                static_cache: bool, batch_size: int = 1) -> int:
    """The verify block: `block_size` (an int), the drafter's (None: its trained block; a
    DeepSpec-format drafter's every slot drafts, so one more: its block_size drafts and the
    target's token) or "auto" (timed for this batch)."""
    trained = drafter.config.block_size
    if block_size is None:
        return trained + 1 if drafter.config.is_deepspec else trained
    if block_size == "auto":
        block_size = choose_block_size(target, drafter, context_len, stream_linears=stream_linears,
                                       static_cache=static_cache,
                                       static_cache_len=context_len + max_new_tokens + trained if static_cache else None,
                                       batch_size=batch_size).block_size
    return block_size


def _check_block_size(block_size, drafter) -> None:
    """`block_size` as the loop takes it, checked once at the way in: an int >= 1, or with a
    DFlashDrafter also None (its trained block) or "auto" (timed); proposer objects have no
    trained block to default to or time. Else a ValueError naming it."""
    if type(block_size) is int and block_size >= 1:  # bool too: True is no block size
        return
    if not isinstance(drafter, DFlashDrafter):
        raise ValueError(f"block_size must be an int >= 1 with proposer objects, got {block_size!r}")
    if block_size is not None and not (isinstance(block_size, str) and block_size == "auto"):
        raise ValueError(f"block_size must be an int >= 1 or 'auto', got {block_size!r}")


def _check_tree(tree_budget, verify, block_size, static_cache: bool, target) -> int:
    """`tree_budget` as the loop takes it (0: the chain), with what a tree step excludes, else
    an error naming the argument (the target: :func:`~.tree_verify.check_tree_target`)."""
    if tree_budget is None or (type(tree_budget) is int and tree_budget == 0):
        return 0
    if type(tree_budget) is not int or tree_budget < 0:  # bool too
        raise ValueError(f"tree_budget must be an int >= 1 (the tree's nodes), or 0 / None (the chain), "
                         f"got {tree_budget!r}")
    if verify not in (None, "match"):
        raise ValueError(f"verify={verify!r} with tree_budget: a tree is verified by the match rule over its siblings "
                         "(exact at every temperature); give verify=None or 'match'")
    if static_cache:
        raise ValueError("static_cache=True with tree_budget: a tree is verified over the dynamic cache")
    if isinstance(block_size, str):
        raise ValueError(f"block_size={block_size!r} with tree_budget: the tree's depth is block_size - 1, an int "
                         "(or None: the drafter's)")
    check_tree_target(target)
    return tree_budget


def _check_drafter(drafter, batch: Optional[int], tree: bool = False) -> None:
    """`drafter` as the loop takes it, else a ValueError naming it: a DFlashDrafter, or for one
    prompt (`batch` None) a proposer object, for a batch of `batch` prompts a list of them,
    one per prompt (a proposer drafts one sequence). With `tree`: one prompt, and a drafter
    whose slots are a tree's (not DFlash2's walk, not DeepSpec's Markov chain) or a tree
    proposer object (``propose_distribution``, ``accept``)."""
    if tree:
        _check_tree_drafter(drafter, batch)
        return
    if isinstance(drafter, DFlashDrafter):
        return
    if batch is None:
        if isinstance(drafter, (list, tuple)):
            raise ValueError("drafter: a list of proposers goes with a list of prompts (one each); one prompt takes a "
                             "DFlashDrafter or one proposer object")
        if not isinstance(drafter, Proposer):
            raise ValueError("drafter must be a DFlashDrafter or a proposer object (with accept and propose methods), "
                             f"got {type(drafter).__name__}")
        return
    if not isinstance(drafter, (list, tuple)):
        raise ValueError("drafter: a batch of prompts takes a DFlashDrafter or a list of proposer objects, "
                         f"one per prompt (a proposer drafts one sequence), got {type(drafter).__name__}")
    if len(drafter) != batch:
        raise ValueError(f"drafter: a list of proposers needs one per prompt ({batch}), got {len(drafter)}")
    for i, one in enumerate(drafter):
        if isinstance(one, DFlashDrafter):
            raise ValueError(f"drafter[{i}] is a DFlashDrafter: a batch of prompts takes one DFlashDrafter for all "
                             "its rows (drafted together), not a list of them")
        if not isinstance(one, Proposer):
            raise ValueError(f"drafter[{i}] must be a proposer object (with accept and propose methods), "
                             f"got {type(one).__name__}")


def _check_tree_drafter(drafter, batch: Optional[int]) -> None:
    if batch is not None and batch > 1:
        raise ValueError("tree_budget: one prompt (a batch of prompts verifies chains; per-row trees are not written)")
    one = drafter[0] if isinstance(drafter, (list, tuple)) and len(drafter) == 1 else drafter
    if isinstance(one, DFlashDrafter):
        c = one.config
        if c.is_dflash2 or c.is_deepspec:
            raise NotImplementedError(f"tree_budget with a {'DFlash2' if c.is_dflash2 else 'DeepSpec-format'} drafter: "
                                      "its slots follow the token drafted before them, so a tree is not its slots' "
                                      "top-k; tree drafting takes a DFlash (v1) drafter")
        return
    if not isinstance(one, TreeProposer):
        raise ValueError("drafter: tree_budget takes a DFlashDrafter or a tree proposer object (with "
                         f"propose_distribution and accept methods), got {type(one).__name__}")


def _reset(proposers, positions: int) -> None:
    """A new generation reaching `positions` for each proposer object that can be reset (a
    DFlashProposer given again drafts from this prompt, or says it is too small)."""
    for proposer in proposers:
        if hasattr(proposer, "reset"):
            proposer.reset(positions)


def _proposer(drafter, target, B: int, context_len: int, max_new_tokens: int, fused: bool, draft_window,
              sampling: Sampling, batch_size: int = 1) -> DFlashProposer:
    """The drafter against `target` for one generation of `batch_size` sequences of at most
    `context_len` prompt tokens. It runs the drafter over at least its trained block
    (DFlashProposer.propose); its cache is bounded by the budget but starts at the prompt
    and a few blocks, then grows with the answer: an answer that stops early never pays for
    the budget. `sampling`: the generation's (:attr:`~dflash_ext.sampling.Sampling.samples_drafts`:
    the drafts sampled, with their q)."""
    block = max(B, drafter.config.block_size)
    return kept_proposer(drafter, target, capacity=context_len + max_new_tokens + block,
                         initial_capacity=context_len + _FIRST_BLOCKS * block, fused=fused,
                         draft_window=draft_window, batch_size=batch_size, sampling=sampling)


def _spec_generate_batch(target, drafter, rows: List[torch.Tensor], max_new_tokens: int, sampling: Sampling,
                         block_size, stop_token_ids, fused, on_tokens, draft_window, streamer, stream_linears,
                         static_cache, tree_budget) -> List[GenerationResult]:
    """spec_generate over a list of prompts (:func:`~.batch.batch_generate`); a list of one runs
    the single-prompt loop."""
    streamers = per_row(streamer, len(rows), "streamer")
    if len(rows) == 1:  # a batch of one: the single-prompt loop itself
        one = drafter[0] if isinstance(drafter, (list, tuple)) else drafter
        return [_spec_generate_one(target, one, rows[0], max_new_tokens, sampling, block_size, stop_token_ids, fused,
                                   row_callback(on_tokens, 0), draft_window, streamers[0], stream_linears,
                                   static_cache, tree_budget)]
    if static_cache:
        raise ValueError("static_cache=True decodes one prompt: a batch of prompts runs on the dynamic cache")
    check_batchable(target)
    common = dict(stop_token_ids=stop_token_ids, on_tokens=on_tokens, streamers=streamers)
    longest = max(ids.shape[1] for ids in rows)
    models = [target] + ([drafter] if isinstance(drafter, nn.Module) else [])
    with streamed_linears(*models, enabled=stream_linears):
        B, proposer, layer_ids, _ = _drafting(target, drafter, block_size, longest, max_new_tokens, fused, draft_window,
                                              stream_linears, False, sampling, len(rows))
        return batch_generate(target, proposer if B > 1 else None, rows, max_new_tokens, B, sampling,
                              layer_ids=layer_ids, **common)


@torch.no_grad()
def target_generate(target, input_ids, max_new_tokens: int, temperature: float = 0.0,
                    stop_token_ids: Iterable[int] = (), top_k: int = 0, top_p: float = 1.0,
                    generator: Optional[torch.Generator] = None,
                    on_tokens: Optional[Callable] = None, streamer=None, stream_linears: bool = False,
                    static_cache: bool = False) -> Union[GenerationResult, List[GenerationResult]]:
    """The target alone, one token per forward pass (the baseline, same sampling rules).
    `stream_linears`: its linear layers run through skinny_linear where it streams
    (:func:`~dflash_ext.ops.linear.streamed_linears`; default off: F.linear, as HF `generate`
    runs them). `static_cache`: a StaticCache of the prompt and the budget, the one-token
    passes compiled on CUDA (CUDA graphs, as transformers' generate runs a static cache there),
    eager on the CPU. A list of prompts: as :func:`spec_generate`'s, one batch, a list of
    results."""
    sampling = check_sampling(max_new_tokens, temperature, top_k, top_p, generator=generator)
    rows = prompt_rows(input_ids, target, "target_generate")
    check_on_tokens(on_tokens, batch=rows is not None)
    with streamed_linears(target, enabled=stream_linears):
        if rows is None:
            return _target_generate_one(target, prompt_ids(input_ids, target, "target_generate"), max_new_tokens,
                                        sampling, stop_token_ids, on_tokens, streamer, static_cache)
        streamers = per_row(streamer, len(rows), "streamer")
        if len(rows) == 1:  # a list of one: the single-prompt loop
            return [_target_generate_one(target, rows[0], max_new_tokens, sampling, stop_token_ids,
                                         row_callback(on_tokens, 0), streamers[0], static_cache)]
        if static_cache:
            raise ValueError("static_cache=True decodes one prompt: a batch of prompts runs on the dynamic cache")
        return batch_generate(target, None, rows, max_new_tokens, 1, sampling, stop_token_ids=stop_token_ids,
                              on_tokens=on_tokens, streamers=streamers)


def _target_generate_one(target, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, stop_token_ids,
                         on_tokens, streamer, static_cache: bool) -> GenerationResult:
    """target_generate of one prompt, `ids` [1, n] on the target's device (its linear layers
    already as the caller streams them)."""
    runner = TargetRunner(target, compiled_sizes=(1,) if static_cache else ())
    out = RowOutput(ids, 1, max_new_tokens, stop_token_ids, on_tokens, streamer)
    cache = runner_module.make_static_cache(target, ids.shape[1] + max_new_tokens) if static_cache else None
    done = False
    while not done:
        logits, _, cache = runner(ids, cache, hidden_states=False, last_logits_only=True)
        t = int(sampling.token(logits[0, -1:])[0])
        out.res.acceptance_lengths.append(1)
        done = out.emit([t])
        ids = torch.tensor([[t]], device=ids.device)
    res = out.finish()
    res.verify_time = res.total_time
    return res
