"""DFlash inside Hugging Face ``generate``: :class:`DFlashAssistant` is an object that
``target.generate(ids, assistant_model=DFlashAssistant(drafter, target),
speculation_type="dflash")`` drives through transformers' own ``DFlashTokenCandidateGenerator``.

How transformers calls it (read from ``transformers/generation/candidate_generator.py``,
5.x): every round it passes the target's hidden states of the tokens accepted since the
last call (``context_hidden_states [1, n, k*H]``, the selected layers concatenated), the
target embeddings of [bonus token, MASK x (B-1)] (``noise_embeds``), and ``position_ids``
covering both (the n context positions, then the B block positions). It keeps its own
``DFlashCache``, into which a transformers assistant writes the context K/V and the block,
and from which it crops the block again before the next round.

This adapter keeps the context in a :class:`~.runtime.DraftRuntime`'s cache instead, with
the same semantics: the n context rows are injected once (``add_context``, the fused ops), the
block is drafted against them (``draft_hidden``) and never stored, so the crop transformers
applies to its own cache has nothing to undo here. A call whose context starts at position 0
is a new generation and starts a new runtime. It needs no weights but
the drafter's: embeddings and LM head are the target's, as transformers passes them.

A static target cache (``generate(..., cache_implementation="static")``): transformers sizes it
to ``max_length - 1`` rows and remembers that size on the target (``_previous_max_cache_length``,
5.x), but its DFlash candidate generator drafts a whole block even near the end, so the last
verify pass wrote past the cache (an IndexError in ``StaticLayer.update``). Given the target,
this adapter returns only the block slots whose verify rows fit in that size: fewer candidates
near the end, the same tokens (without the target, ``DFlashAssistant(drafter)``, it cannot know). A later dynamic-cache generate on the
same target keeps that remembered size: its blocks are shortened in the few steps just before
that position, never past it (the tokens unchanged).

At T > 0 (``do_sample=True``) transformers verifies by speculative sampling, with nothing
to do here: its candidate generator applies the target's LM head to the hidden states returned
here, processes those logits with the target's own logits processors (temperature, top-k,
top-p), samples each candidate from them and returns the processed logits with the
candidates; ``generate`` then accepts candidate k with min(1, p_k / q_k) and samples the
residual at the first rejection (``_speculative_sampling``), exactly the rule of
:mod:`dflash_ext.decode.verify` (python_tests/draft/test_hf_assistant.py checks the law and
that the speculative sampling runs). Two differences from ``spec_generate``: the candidates
are drawn over the target's whole vocabulary (a drafter's draft vocabulary is not applied
there), and from transformers' global random state (``torch.manual_seed``), not a generator.

A DFlash2 drafter cannot be an assistant: transformers applies the LM head to the hidden
states returned here and drafts each slot's argmax, so the candidate selector's path (the
DFlash2 draft) has no way through; :class:`DFlashAssistant` says so (spec_generate drafts it).
"""
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import torch

from .runtime import DraftRuntime, refuse_deepspec

__all__ = ["DFlashAssistant", "SUPPORTED_TRANSFORMERS"]

# The transformers releases whose DFlash candidate generator this adapter was read against.
SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))  # [from, to): read and tested against 5.24


# Context rows of a new generation's cache before it first grows.
_FIRST_CAPACITY = 1024


def _check_transformers() -> None:
    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= version < hi:
        raise RuntimeError(f"DFlashAssistant supports transformers >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]} (its "
                           f"DFlashTokenCandidateGenerator was read there); installed: {transformers.__version__}")
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401


class DFlashAssistant:
    """``assistant_model`` for ``generate(..., speculation_type="dflash")`` (transformers 5.x),
    drafting with a :class:`~dflash_ext.model.drafter.DFlashDrafter` and the fused ops
    (`fused`; `draft_window` caps every layer's window). With `target`, the drafter's fit is
    checked now."""

    def __init__(self, drafter, target=None, fused: bool = True, draft_window: Optional[int] = None):
        if target is not None:
            drafter.check_fits(target.config)
        refuse_deepspec(drafter, "DFlashAssistant")
        if drafter.config.is_dflash2:
            raise NotImplementedError("DFlashAssistant does not support DFlash2 drafters (DFlash2DraftModel): "
                                      "transformers' DFlash generate drafts the LM head's argmax over the returned "
                                      "hidden states, not the DFlash2 candidate selector's path; use "
                                      "dflash_ext.spec_generate")
        _check_transformers()
        self.drafter, self.target, self.fused, self.draft_window = drafter, target, fused, draft_window
        c = drafter.config
        # What transformers reads: a Qwen3 config (its DFlashCache is built from it) plus the DFlash fields.
        # The context lives in our DraftCache, so transformers' cache stays empty; its layers are
        # all full ones, because a sliding-window cache layer cannot crop while empty (5.25).
        self.config = replace(c, layer_types=None, sliding_window=None).hf_config()
        self.config.target_layer_ids = list(c.target_layer_ids)
        self.config.block_size = c.block_size
        self.config.mask_token_id = c.mask_token_id
        self.runtime = None
        self.calls = 0
        # Tokens the target emitted per verify step, as seen from here: each round's context
        # is the tokens accepted in the previous one (accepted drafts + the target's token).
        # The last step of a generation is not followed by a call, so it is not counted.
        self.acceptance_lengths = []

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    def _runtime(self, new_generation: bool) -> DraftRuntime:
        """The assistant's runtime, made on its first call and reset at each new generation
        (its cache's memory, tables and stacked weights kept; made again where the drafter
        moved or was cast since), its cache growing as the context does (transformers bounds
        the generation)."""
        if self.runtime is None or (self.runtime.device, self.runtime.dtype) != (self.device, self.dtype):
            self.runtime = DraftRuntime(self.drafter, _FIRST_CAPACITY, max_capacity=sys.maxsize,
                                        draft_window=self.draft_window, fused=self.fused)
        elif new_generation:
            self.runtime.reset()
        return self.runtime

    @torch.no_grad()
    def __call__(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor,
                 position_ids: torch.Tensor, attention_mask=None, cache=None, **unused):
        if noise_embeds.shape[0] != 1:
            raise ValueError(f"DFlashAssistant drafts one sequence (transformers' assisted decoding is batch 1); "
                             f"got a batch of {noise_embeds.shape[0]}")
        c = self.drafter.config
        n = context_hidden_states.shape[1]
        if noise_embeds.shape[-1] != c.hidden_size:
            raise ValueError(f"the target's embeddings have width {noise_embeds.shape[-1]}; this drafter was built "
                             f"for hidden size {c.hidden_size} (it does not fit this target)")
        if context_hidden_states.shape[-1] != len(c.target_layer_ids) * c.hidden_size:
            raise ValueError(f"context_hidden_states has width {context_hidden_states.shape[-1]}; this drafter reads "
                             f"{len(c.target_layer_ids)} target layers of {c.hidden_size}")
        positions = position_ids[0].to(self.device)
        new_generation = bool(n) and int(positions[0]) == 0  # its prefill starts at position 0
        if new_generation:
            self.acceptance_lengths = []
        else:
            self.acceptance_lengths.append(n)
        runtime = self._runtime(new_generation)
        if n:
            feats = context_hidden_states[0].to(self.device, self.dtype).split(c.hidden_size, -1)
            runtime.add_context(0, list(feats), positions[:n])
        hidden = runtime.draft_hidden(noise_embeds.to(self.device, self.dtype), positions[None, n:])
        self.calls += 1
        # A static cache's size (module docstring). The verify writes the block's positions p, p+1, ...
        # below it; transformers calls here only while a candidate fits (p <= rows - 2): past that
        # the size is an earlier call's and this generation's cache is dynamic.
        rows, p = getattr(self.target, "_previous_max_cache_length", None), int(positions[n])
        if isinstance(rows, int) and rows - p >= 2:
            hidden = hidden[:, :rows - p]
        # transformers puts the target's LM head over these: in the target's dtype (the embeddings'), whatever
        # the drafter's own
        return SimpleNamespace(last_hidden_state=hidden.to(noise_embeds.dtype))
