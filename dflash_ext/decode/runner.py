"""The target side of the loop: a Hugging Face causal LM as DFlash calls it.

- :class:`TargetRunner`: one forward as the loop calls it (the cache argument's name,
  last-position logits for a prefill, only the hidden states the drafter reads; on the CPU,
  grouped K/V heads passed to SDPA as they are, not repeated per query head);
- :func:`make_static_cache` / :func:`compiled_call`: the static cache and the compiled passes
  over it (CUDA graphs through ``torch.compile``; the target itself off CUDA).

The rollback of every cache kind is :mod:`.rollback`; which kernel runs the target's linear
layers is :mod:`dflash_ext.ops.linear`'s (``streamed_linears``).
"""
import contextvars
import inspect
from typing import Optional, Sequence

import torch

from .rollback import CacheRollback, drop_tail

__all__ = ["TargetRunner", "vocab_size", "cache_kwarg", "returned_cache", "make_static_cache", "compiled_call"]


def cache_kwarg(model) -> str:
    """The name of the KV-cache argument of a Hugging Face model's forward: recent
    transformers name it `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out):
    """The KV cache a Hugging Face forward returned (`cache` in recent transformers,
    `past_key_values` in older ones)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def vocab_size(target) -> int:
    """The width of the target's logits: what a draft's q spans, the ids a draft may hold."""
    head = target.get_output_embeddings()
    return head.weight.shape[0] if head is not None else target.get_input_embeddings().num_embeddings


class TargetRunner:
    """One target's forward as the loop calls it. The signature is inspected once
    (:func:`cache_kwarg`, `logits_to_keep`), and only the hidden states the drafter reads
    are asked for where transformers can select them (5.x takes a list of indices in
    `output_hidden_states`; the tuple keeps its layout, with None elsewhere); otherwise, or
    if the model returns None for one of them, all.

    `compiled_sizes`: passes of these many tokens over a cache that is `is_compileable` (a
    static one, transformers' criterion) run through :func:`compiled_call` (CUDA graphs on
    CUDA; off CUDA the target itself); every other pass (the prefill, a shorter verify near
    the budget) runs eagerly, as transformers' generate runs its prefill."""

    def __init__(self, target, layer_ids: Optional[Sequence[int]] = None, compiled_sizes: Sequence[int] = ()):
        self.target = target
        self.device = next(target.parameters()).device
        self.vocab_size = vocab_size(target)
        self.cache_arg = cache_kwarg(target)
        self.can_keep_last = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.needed = [l + 1 for l in layer_ids] if layer_ids else []
        self.select = self.needed if self.needed and _CAN_SELECT_HIDDEN_STATES else True
        self.compiled_sizes = set(compiled_sizes)
        self.compiled = compiled_call(target) if self.compiled_sizes else target
        self.grouped_kv = self.device.type == "cpu" and _let_sdpa_take_grouped_kv()

    @property
    def compiles(self) -> bool:
        """Whether some passes run compiled (on CUDA, with `compiled_sizes`)."""
        return self.compiled is not self.target

    def _forward(self, n: int, cache):
        """The compiled call for a pass of `n` tokens where it applies, else the target."""
        if not (self.compiles and n in self.compiled_sizes and getattr(cache, "is_compileable", False)):
            return self.target
        # A CUDA graph's outputs live in its pool until its next replay: the loop reads each
        # pass's logits and hidden states before the next pass, so a new step may begin here.
        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled

    def __call__(self, ids: torch.Tensor, cache, hidden_states: bool = True, last_logits_only: bool = False,
                 rollback: Optional[CacheRollback] = None, **rows):
        """(logits [b, n, V], hidden states or None, cache) of one pass over `ids` [b, n];
        `last_logits_only`: logits [b, 1, V] of the last position only (a prefill needs no
        more; as in `generate`, which also rounds them the same way then). `rollback`: the
        cache's :class:`CacheRollback` (a pass redone must be undone first; without one the
        cache must crop). `rows`: a batch's `position_ids` and `attention_mask` (the model's
        own arguments; :mod:`.batch`), passed as given."""
        want = self.select if hidden_states else False
        if rollback is not None:
            rollback.check_pass(ids.shape[1])
        keep = {"logits_to_keep": 1} if last_logits_only and self.can_keep_last else {}
        grouped = _GROUPED_KV_WITH_MASK.set(self.grouped_kv)
        try:
            out = self._forward(ids.shape[1], cache)(input_ids=ids, use_cache=True, output_hidden_states=want,
                                                     **{self.cache_arg: cache}, **keep, **rows)
        finally:
            _GROUPED_KV_WITH_MASK.reset(grouped)
        hs = out.hidden_states
        if hidden_states and want is not True and any(hs is None or len(hs) <= i or hs[i] is None
                                                      for i in self.needed):
            self.select = True  # this model cannot select: ask for all from now on, and redo this pass
            if cache is not None:
                rollback(ids.shape[1]) if rollback is not None else drop_tail(cache, ids.shape[1])
            return self(ids, cache, hidden_states, last_logits_only, rollback, **rows)
        return out.logits, hs, returned_cache(out)


def make_static_cache(target, max_cache_len: int):
    """An empty transformers StaticCache for `target` (its text config: the layer kinds,
    windows and head widths) holding up to `max_cache_len` tokens: prompt, answer and the
    rejected rows of the last verify pass. Its shapes never change, so a pass over it can be
    compiled and captured (:func:`compiled_call`). transformers allocates it on its first
    update, all of it at once: a cache larger than the device's available memory is refused
    here, with the bytes it would take, before anything is allocated."""
    from transformers import StaticCache

    from ..model.config import target_text_config
    from ..ops.hardware import available_memory

    if type(max_cache_len) is not int or max_cache_len < 1:  # bool too
        raise ValueError(f"max_cache_len must be an int >= 1, got {max_cache_len!r}")
    cache = StaticCache(config=target.config, max_cache_len=max_cache_len)
    t, weight = target_text_config(target.config), next(target.parameters())
    need, free = _static_cache_bytes(cache, t, weight.element_size()), available_memory(weight.device)
    if free is not None and need > free:
        limit = getattr(t, "max_position_embeddings", None)
        raise ValueError(f"a static cache of {max_cache_len} tokens (the prompt, max_new_tokens and one verify "
                         f"block) would take {need} bytes ({need / 2 ** 30:.1f} GiB) of {weight.device} memory, "
                         f"{free} bytes ({free / 2 ** 30:.1f} GiB) available"
                         + (f" (the target positions {limit} tokens: max_position_embeddings)" if limit else "")
                         + ": ask for fewer max_new_tokens, or leave the static cache off (the dynamic cache grows "
                         "with the answer)")
    return cache


def _static_cache_bytes(cache, text_config, element_size: int) -> int:
    """The bytes `cache` (an empty StaticCache) allocates on its first update, from the
    config of each layer (heterogeneous ones: per_layer_config): its rows (a sliding layer's
    window) times K and V of its KV heads, or MLA's latent and rope key (kv_lora_rank +
    qk_rope_head_dim, DeepSeek's cache); layers that hold no rows (linear attention's fixed
    state, shared K/V) count nothing."""
    configs = getattr(text_config, "per_layer_config", None) or [text_config] * len(cache.layers)
    total = 0
    for layer, c in zip(cache.layers, configs):
        if getattr(c, "kv_lora_rank", None):
            width = c.kv_lora_rank + c.qk_rope_head_dim
        else:
            heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            width = 2 * heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        total += getattr(layer, "max_cache_len", 0) * width * element_size
    return total


def compiled_call(target):
    """The target's forward compiled to capture CUDA graphs at fixed shapes (transformers'
    own `get_compiled_call` with a CompileConfig of mode "reduce-overhead", as its generate
    compiles decoding passes over a static cache); off CUDA the target itself: compiling
    is a no-op there (the CPU path runs the same passes eagerly)."""
    if next(target.parameters()).device.type != "cuda":
        return target
    from transformers import CompileConfig

    return target.get_compiled_call(CompileConfig(mode="reduce-overhead", fullgraph=False, dynamic=False))


def _can_select_hidden_states() -> bool:
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


_CAN_SELECT_HIDDEN_STATES = _can_select_hidden_states()


# Inside TargetRunner's passes on the CPU: SDPA gets a grouped-query layer's K/V heads as they are.
_GROUPED_KV_WITH_MASK = contextvars.ContextVar("dflash_grouped_kv_with_mask", default=False)


def _let_sdpa_take_grouped_kv() -> bool:
    """transformers' SDPA attention passes grouped K/V heads to torch's SDPA (enable_gqa) only
    when the pass has no mask, for CUDA's kernels; any pass with one, as a verify pass over a
    cache has (its queries are causal among themselves), first copies every K/V head once per
    query head it serves (repeat_kv: the layer's whole cache, each pass). torch's CPU SDPA takes
    grouped heads with a mask too, and the same attention comes out (python_tests/decode/test_runner.py)
    without the copies: 7 % of a bf16 verify pass of SmolLM2 (3 of 9 heads) at B = 3, more as the
    context grows. So transformers' choice is wrapped, once, to say yes to CPU tensors during
    TargetRunner's passes (a context flag: a user's own calls keep transformers' choice).
    False where this transformers has no such choice to wrap."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return False
    choice = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if choice is None:
        return False
    if getattr(choice, "dflash_wrapped", False):
        return True

    def use_gqa_in_sdpa(attention_mask, key, value=None, *args, **kwargs):
        if (_GROUPED_KV_WITH_MASK.get() and key.device.type == "cpu"
                and (value is None or value.shape[-1] == key.shape[-1])):
            return True
        return choice(attention_mask, key, *(() if value is None else (value,)), *args, **kwargs)

    use_gqa_in_sdpa.dflash_wrapped = True
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True
