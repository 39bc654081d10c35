"""The DFlash drafter: N Qwen3-style decoder layers whose attention sees the target's
projected hidden states as a per-layer context KV cache, followed by the block; each layer
bidirectional or causal by :attr:`~dflash_ext.config.DFlashConfig.layer_causal`.

Here: the layers, the context cache (:class:`DraftCache`), the draft step over the
fused ops (inference) and the differentiable forward over many blocks (training). The
config is :mod:`dflash_ext.config`; checkpoint files are :mod:`dflash_ext.checkpoint`.

DFlash2 (``config.is_dflash2``) adds to each layer a block convolution on both sides of its
attention and its MLP (:class:`BlockConv`) and, after the LM head, a candidate selector that
re-ranks each slot's top-K tokens along a path from the anchor (:class:`CandidateSelector`);
:meth:`DFlashDrafter.dflash2_from` starts one from a v1 drafter, drafting as it does.
"""
import copy
import os
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops, reference
from .checkpoint import DRAFT_VOCAB_NAME, read_checkpoint, torch_dtype, write_checkpoint
from .config import DFlashConfig, target_text_config

__all__ = ["DFlashDrafter", "DFlashConfig", "DraftCache", "BlockConv", "CandidateSelector", "effective_windows",
           "context_mask", "block_mask", "windowed_bidirectional_attention"]

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(H, c.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockConv(nn.Module):
    """DFlash2's grouped dynamic convolution along each block around one sublayer: on its
    input (side 0) and its output (side 1), with the coefficients ``base_kernel[side, t, c]
    + delta[slot, side, t, c // conv_group_size]``, where the deltas of both sides come from
    one ``kernel_projection`` of the normalised sublayer input (rows side-major, then tap,
    then group). Only the block's own tokens pass through it, never the context."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.taps, self.groups = c.conv_kernel_size, c.conv_groups
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, c.hidden_size))
        self.kernel_projection = nn.Linear(c.hidden_size, 2 * self.taps * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        """The identity: tap 0 = 1 on both sides, every other coefficient 0 (out = x exactly)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1
            self.kernel_projection.weight.zero_()

    def deltas(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., B, 2, T, G] per-slot coefficient deltas from the normalised sublayer input [..., B, H]."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.taps, self.groups))

    def forward(self, x: torch.Tensor, deltas: torch.Tensor, side: int, block_conv=reference.block_conv) -> torch.Tensor:
        """x [..., B, H] (blocks of B slots) convolved on `side` (0 input, 1 output) by
        `block_conv` (ops.block_conv in the draft step, the differentiable reference in training)."""
        B, H = x.shape[-2:]
        out = block_conv(x.reshape(-1, B, H), self.base_kernel[side],
                         deltas[..., side, :, :].reshape(-1, B, self.taps, self.groups))
        return out.view(x.shape)


class CandidateSelector(nn.Module):
    """DFlash2's draft: each slot's top-K tokens under the transformed LM-head logits u
    (``u = logits * output_multiplier``, soft-capped ``cap * tanh(u / cap)``), scored
    ``S_j(a -> b) = u_j(b) + <predecessor_codebook[a] * hidden_projection(h_j),
    successor_codebook[b]>``, and one greedy path from the anchor token: slot j takes the
    best-scored candidate after the token chosen at slot j - 1 (the first maximum on a tie),
    as SGLang's and vLLM's walk. Codebooks are indexed by target token id."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
        self.config = c
        self.reset_identity()

    def reset_identity(self, std: float = 0.02) -> None:
        """No transition term (successor codebook 0): the path is each slot's argmax. The
        other two are random, as SpecForge initialises them (they matter once training moves
        the successor codebook)."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=std)
            nn.init.normal_(self.hidden_projection.weight, std=std)
            self.successor_codebook.zero_()

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits, in fp32."""
        c = self.config
        u = logits.float() * c.output_multiplier
        cap = c.final_logit_softcapping
        return u if cap is None else cap * torch.tanh(u / cap)

    def top_candidates(self, unary: torch.Tensor, vocab: Optional[torch.Tensor] = None):
        """(unary [..., K], token ids [..., K]): each slot's top-K of the transformed logits
        `unary` [..., V'] (:meth:`unary`; rows of the draft vocabulary when `vocab` maps them
        to token ids)."""
        top, idx = unary.topk(self.config.selector_top_k, dim=-1)
        return top, (idx if vocab is None else vocab[idx])

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., R] fp32: the per-slot gate on the rank dimension."""
        return self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()

    def scores(self, gate: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               previous: torch.Tensor) -> torch.Tensor:
        """[..., K]: each candidate's score after the token `previous` [...] at the slot before."""
        query = self.predecessor_codebook[previous].float() * gate  # [..., R]
        return unary + torch.einsum("...r,...kr->...k", query, self.successor_codebook[candidates].float())

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                vocab: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Draft tokens [Bsz, n] from the final-normed hidden states of the n prediction slots
        ``hidden [Bsz, n, H]``, their LM-head ``logits [Bsz, n, V']`` (V' the draft vocabulary
        when `vocab` maps its rows to token ids) and the anchor tokens [Bsz]. Plain torch
        ops, no host reads: a CUDA graph captures it."""
        unary, candidates = self.top_candidates(self.unary(logits), vocab)  # [Bsz, n, K]
        gate = self.gate(hidden)  # [Bsz, n, R]
        previous, path = anchor, []
        for j in range(candidates.shape[1]):
            score = self.scores(gate[:, j], unary[:, j], candidates[:, j], previous)
            previous = candidates[:, j].gather(-1, score.argmax(-1, keepdim=True))[:, 0]
            path.append(previous)
        return torch.stack(path, 1)


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        if c.is_dflash2:
            self.attention_conv = BlockConv(c)
            self.mlp_conv = BlockConv(c)

    def forward(self, x, cos, sin, attend, block_conv=reference.block_conv):
        """One decoder layer over blocks of tokens ``x [..., B, H]`` at RoPE ``cos/sin`` (broadcast
        over heads). ``attend(q [..., Hq, D], k, v [..., Hkv, D])`` returns ``[..., Hq, D]``:
        the attention over the layer's context plus these block keys (inference and
        training supply it differently; everything else is the same code). DFlash2 wraps
        the attention and the MLP in their block convolutions (`block_conv`: the op or its
        reference), inside the residual branch."""
        Hq, Hkv, D = self.heads
        lead = x.shape[:-1]
        a = self.self_attn
        conv = getattr(self, "attention_conv", None)
        h = self.input_layernorm(x)
        if conv is not None:
            deltas = conv.deltas(h)
            h = conv(h, deltas, 0, block_conv)
        q = reference.apply_rope(a.q_norm(a.q_proj(h).view(*lead, Hq, D)), cos, sin)
        k = reference.apply_rope(a.k_norm(a.k_proj(h).view(*lead, Hkv, D)), cos, sin)
        v = a.v_proj(h).view(*lead, Hkv, D)
        y = a.o_proj(attend(q, k, v).reshape(*lead, Hq * D))
        x = x + (y if conv is None else conv(y, deltas, 1, block_conv))
        h = self.post_attention_layernorm(x)
        if conv is None:
            return x + self.mlp(h)
        deltas = self.mlp_conv.deltas(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, deltas, 0, block_conv)), deltas, 1, block_conv)


def effective_windows(config: DFlashConfig, draft_window: Optional[int] = None) -> List[int]:
    """Per layer, its attention window W (0 = none): a sliding_attention layer its
    `sliding_window`, a full_attention layer none. A bidirectional layer sees the last W
    context rows and the whole block; a causal one (config.layer_causal) counts W per query:
    the query at position p sees the keys at p - W < k <= p. `draft_window` (like the
    authors' --draft-sliding-window-size) caps every layer's window, full ones included,
    for long contexts."""
    if draft_window is not None and draft_window < 1:
        raise ValueError(f"draft_window must be >= 1 (or None), got {draft_window}")
    if not draft_window:
        return config.layer_windows
    return [min(w, draft_window) if w else draft_window for w in config.layer_windows]


# Capacities a cache grows to are whole multiples of this many rows: the attention's key
# tile on the CPU and its smallest split on CUDA (256 keys), so no tile is left part-used.
CACHE_ROW_ALIGN = 256


class DraftCache:
    """The drafter's context KV cache: ``[N, batch * capacity, Hkv, D]`` for K and V;
    sequence b owns rows ``b * capacity .. (b+1) * capacity - 1`` and ``lengths[b]`` of
    them hold accepted tokens. Only accepted tokens advance it. The lengths live twice:
    on the host (``lengths``, for slot arithmetic without reading the device) and in the
    persistent device tensor ``lens`` that the attention reads, updated in place (so a
    captured CUDA graph sees the current lengths). ``windows`` and ``causal`` say per layer
    how its block queries attend (:func:`effective_windows`).

    ``max_capacity`` (>= capacity) lets it grow as a KV cache does: when a sequence needs
    more rows than ``capacity``, K and V are reallocated at twice the capacity (at least
    what is needed, in whole :data:`CACHE_ROW_ALIGN` rows, at most ``max_capacity``) and
    every sequence's rows copied to its new range; ``offsets`` is updated in place. So
    the memory follows the tokens accepted, not a budget. A growth replaces ``k`` and
    ``v`` (new tensors, new addresses) and changes ``capacity``: whoever holds them (a
    captured CUDA graph) must take them again. None: a fixed cache of ``capacity`` rows."""

    def __init__(self, config: DFlashConfig, batch_size: int, capacity: int, device, dtype,
                 draft_window: Optional[int] = None, max_capacity: Optional[int] = None):
        if max_capacity is not None and max_capacity < capacity:
            raise ValueError(f"max_capacity ({max_capacity}) must be >= capacity ({capacity})")
        self._dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)  # N, Hkv, D
        self.k = self.v = None
        self.capacity = 0
        self.max_capacity = capacity if max_capacity is None else max_capacity
        self.windows = effective_windows(config, draft_window)
        self.causal = config.layer_causal
        self._lengths = [0] * batch_size
        self.lens = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.offsets = torch.zeros(batch_size, device=device, dtype=torch.long)
        self._allocate(capacity, device, dtype)

    def _allocate(self, capacity: int, device, dtype) -> None:
        """K and V of `capacity` rows per sequence, the rows in use copied from the old ones."""
        N, Hkv, D = self._dims
        batch = len(self._lengths)
        k = torch.zeros((N, batch * capacity, Hkv, D), device=device, dtype=dtype)
        v = torch.zeros_like(k)
        used = max(self._lengths)
        if used:  # per sequence: its rows move from b * old capacity to b * new capacity
            for new, old in ((k, self.k), (v, self.v)):
                new.view(N, batch, capacity, Hkv, D)[:, :, :used].copy_(
                    old.view(N, batch, self.capacity, Hkv, D)[:, :, :used])
        self.k, self.v, self.capacity = k, v, capacity
        torch.mul(torch.arange(batch, device=device, dtype=torch.long), capacity, out=self.offsets)

    def reserve(self, b: int, n: int) -> None:
        """Make room for `n` tokens in sequence b: grow (see the class doc) when they do not
        fit the capacity; past ``max_capacity`` an error."""
        if n <= self.capacity:
            return
        if n > self.max_capacity:
            raise RuntimeError(f"drafter context cache is full: sequence {b} needs {n} tokens, "
                               f"more than its capacity of {self.max_capacity}")
        grown = -(-max(n, 2 * self.capacity) // CACHE_ROW_ALIGN) * CACHE_ROW_ALIGN
        self._allocate(min(grown, self.max_capacity), self.k.device, self.k.dtype)

    @property
    def lengths(self) -> tuple:
        """Accepted tokens per sequence (read-only: change them with set_length / advance)."""
        return tuple(self._lengths)

    def set_length(self, b: int, n: int) -> None:
        if not 0 <= n <= self.max_capacity:
            raise ValueError(f"sequence {b} cannot hold {n} tokens: the cache capacity is {self.max_capacity}")
        self.reserve(b, n)
        self._lengths[b] = n
        self.lens[b:b + 1].fill_(n)  # a device fill, no host round trip

    def advance(self, b: int, n: int) -> None:
        self.set_length(b, self._lengths[b] + n)

    def slots_for(self, b: int, n: int) -> torch.Tensor:
        """Cache rows for the next n tokens of sequence b, growing the cache when they do
        not fit (a cache full at ``max_capacity`` is an error)."""
        start = self._lengths[b]
        self.reserve(b, start + n)
        return torch.arange(b * self.capacity + start, b * self.capacity + start + n,
                            device=self.k.device, dtype=torch.long)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.is_dflash2:
            self.candidate_selector = CandidateSelector(c)
        self._stacked = None
        self._rope = None
        self._vocab_head = None
        self.acceptance_profile: Optional[List[float]] = None
        self.draft_vocab: Optional[torch.Tensor] = None  # sorted token ids (int64, CPU): checkpoint.DRAFT_VOCAB_NAME

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                    mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                    seed: Optional[int] = 0, tokenizer=None, **overrides) -> "DFlashDrafter":
        """A fresh, randomly initialised drafter that fits a Hugging Face target config
        (:meth:`DFlashConfig.for_target`; `tokenizer`, when given, picks the mask token)."""
        config = DFlashConfig.for_target(target_config, num_layers, block_size, mask_token_id, target_layer_ids,
                                         tokenizer, **overrides)
        if seed is not None:
            torch.manual_seed(seed)
        drafter = cls(config)
        drafter.apply(_init_weights)
        return drafter

    @classmethod
    def dflash2_from(cls, drafter: "DFlashDrafter", conv_kernel_size: int = 2, conv_group_size: int = 16,
                     selector_rank: int = 256, selector_top_k: int = 16, seed: Optional[int] = 0) -> "DFlashDrafter":
        """A DFlash2 drafter that drafts exactly the blocks the DFlash (v1) `drafter` drafts:
        its weights, identity block convolutions (tap 0 = 1 on both sides, zero projections)
        and a selector without transition term (zero successor codebook; the predecessor
        codebook and hidden projection random, from `seed`), no logit transform: the exact
        starting point for training DFlash2 from a v1 checkpoint. (Only ties between a slot's
        best logits may resolve differently: top-K against a full argmax.)"""
        if drafter.config.is_dflash2:
            raise ValueError("dflash2_from needs a DFlash (v1) drafter; this one is DFlash2 already")
        config = copy.deepcopy(drafter.config)
        for key, value in dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                               selector_rank=selector_rank, selector_top_k=selector_top_k).items():
            setattr(config, key, value)
        config.__post_init__()
        if seed is not None:
            torch.manual_seed(seed)
        p = drafter.fc.weight
        new = cls(config).to(device=p.device, dtype=p.dtype)
        missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
        assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
        new.draft_vocab = drafter.draft_vocab
        new.acceptance_profile = drafter.acceptance_profile
        return new

    @classmethod
    def from_pretrained(cls, path: str, device=None, dtype=None, cache_dir: Optional[str] = None,
                        local_files_only: Optional[bool] = None, revision: Optional[str] = None) -> "DFlashDrafter":
        """Load a reference-format checkpoint from a local folder or a Hugging Face repo id
        (:func:`~dflash_ext.checkpoint.read_checkpoint`). `dtype` is a torch dtype, its
        name, or "auto"/None (the checkpoint's dtype); `device` as in ``.to()``."""
        ckpt = read_checkpoint(path, cache_dir, local_files_only, revision)
        drafter = cls(ckpt.config)
        # the weights' and the vocabulary's checks, each naming where the bad value comes from
        try:
            drafter.load_reference_state_dict(ckpt.state)
        except ValueError as e:
            raise ValueError(f"{ckpt.path}: {e}") from e
        if ckpt.draft_vocab is not None:
            try:
                drafter.set_draft_vocab(ckpt.draft_vocab)
            except ValueError as e:
                raise ValueError(f"{os.path.join(ckpt.path, DRAFT_VOCAB_NAME)}: {e}") from e
        drafter.acceptance_profile = ckpt.acceptance_profile
        return drafter.to(device=device, dtype=torch_dtype(dtype) or ckpt.dtype)

    def load_reference_state_dict(self, state: dict) -> None:
        """Load weights named as in the reference checkpoint; any mismatch is an error."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint does not match its config: missing {missing[:8]}"
                             f"{'…' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                             f"{'…' if len(unexpected) > 8 else ''}")
        for name, t in state.items():
            if t.shape != own[name].shape:
                raise ValueError(f"drafter checkpoint tensor {name} has shape {tuple(t.shape)}, "
                                 f"the config needs {tuple(own[name].shape)}")
        self.load_state_dict(state)

    def save_pretrained(self, path: str, dtype: Optional[torch.dtype] = None, overwrite: bool = False,
                        extra_files=None) -> None:
        """Write the reference format; `dtype` (e.g. torch.bfloat16) converts the weights. The
        folder is replaced as a whole, atomically (:func:`~dflash_ext.checkpoint.write_checkpoint`:
        `extra_files` go into it too); a `path` holding anything but a drafter checkpoint is
        refused unless `overwrite`."""
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        write_checkpoint(path, self.config, state, self.acceptance_profile,
                         None if self.draft_vocab is None else self.draft_vocab.tolist(),
                         extra_files=extra_files, overwrite=overwrite)

    def set_draft_vocab(self, token_ids) -> None:
        """Draft only these target tokens (sorted, unique, in range), or all of them (None)."""
        if token_ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        V = self.config.vocab_size
        if ids.dim() != 1 or ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) \
                or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"draft vocabulary token_ids must be sorted, unique ids in [0, {V}), got "
                             f"{ids.numel()} ids from {ids.min().item() if ids.numel() else None} to "
                             f"{ids.max().item() if ids.numel() else None}")
        if self.config.is_dflash2 and ids.numel() < self.config.selector_top_k:
            raise ValueError(f"a draft vocabulary of {ids.numel()} tokens is smaller than the DFlash2 selector's "
                             f"selector_top_k={self.config.selector_top_k} candidates per slot")
        self.draft_vocab, self.config.draft_vocab_size = ids, ids.numel()

    def add_layers(self, n: int) -> None:
        """Append `n` decoder layers (of the last layer's attention type) whose output
        projections (o_proj, down_proj) start at zero: a new layer adds nothing to the
        residual stream yet, so the drafter drafts exactly as before, and training grows the
        layers from there (more capacity for a drafter that underfits, without starting over)."""
        if n < 1:
            raise ValueError(f"add_layers needs n >= 1, got {n}")
        c = self.config
        c.layer_types = list(c.layer_types) + [c.layer_types[-1]] * n
        c.num_hidden_layers += n
        p = self.fc.weight
        for _ in range(n):
            layer = DecoderLayer(c)
            layer.apply(_init_weights)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
            self.layers.append(layer.to(device=p.device, dtype=p.dtype))

    def as_assistant(self, target=None, fused: bool = True, draft_window: Optional[int] = None):
        """An ``assistant_model`` for ``target.generate(..., assistant_model=...,
        speculation_type="dflash")`` (transformers 5.x), drafting with this drafter and the
        fused ops (:mod:`dflash_ext.hf_assistant`). With `target`, the fit is checked now."""
        from .hf_assistant import DFlashAssistant

        if target is not None:
            self.check_fits(target.config)
        return DFlashAssistant(self, fused=fused, draft_window=draft_window)

    def check_fits(self, target_config) -> None:
        """Raise a clear error when this drafter was not built for `target_config` (a model
        config; composite ones are checked against their text config)."""
        c = self.config
        t = target_text_config(target_config)
        problems = []
        if c.hidden_size != t.hidden_size:
            problems.append(f"hidden size {c.hidden_size} != target's {t.hidden_size}")
        if c.vocab_size != t.vocab_size:
            problems.append(f"vocab size {c.vocab_size} != target's {t.vocab_size}")
        L = t.num_hidden_layers
        if c.num_target_layers != L or max(c.target_layer_ids) >= L:
            problems.append(f"target layers {c.target_layer_ids} of {c.num_target_layers} do not fit "
                            f"a target with {L} layers")
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------------ state for the ops
    def new_cache(self, batch_size: int, capacity: int, draft_window: Optional[int] = None,
                  max_capacity: Optional[int] = None) -> DraftCache:
        """A context cache of `capacity` rows per sequence, growing up to `max_capacity`
        (None: fixed; :class:`DraftCache`)."""
        p = self.fc.weight
        return DraftCache(self.config, batch_size, capacity, p.device, p.dtype, draft_window, max_capacity)

    def _stacked_kv_weights(self):
        """[N, Hkv*D, H] K and V weights and [N, D] k_norm weights of all layers, rebuilt
        only when a weight changed (training, loading, .to())."""
        params = [p for l in self.layers for p in (l.self_attn.k_proj.weight, l.self_attn.v_proj.weight,
                                                    l.self_attn.k_norm.weight)]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if self._stacked is None or self._stacked[0] != key:
            attn = [l.self_attn for l in self.layers]
            self._stacked = (key, torch.stack([a.k_proj.weight.detach() for a in attn]),
                             torch.stack([a.v_proj.weight.detach() for a in attn]),
                             torch.stack([a.k_norm.weight.detach() for a in attn]))
        return self._stacked[1:]

    def rope_tables(self, length: int):
        """cos, sin [P, D] covering positions < length, computed by transformers' own Qwen3
        rotary embedding from the config (every rope type it implements, with the attention
        scaling YaRN / longrope apply to cos and sin)."""
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        p = self.fc.weight
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != p.device \
                or self._rope[0].dtype != p.dtype:
            limit = self.config.rope_position_limit
            if limit is not None and length > limit:
                raise ValueError(
                    f"rope_type {self.config.rope_parameters['rope_type']!r} recomputes every frequency from the "
                    f"whole sequence length past {limit} positions; drafting at {length} positions is not supported")
            P = max(length, 2 * (self._rope[0].shape[0] if self._rope is not None else 512))
            P = min(P, limit) if limit is not None else P
            rotary = Qwen3RotaryEmbedding(self.config.hf_config())
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(P)[None])
            self._rope = (cos[0].to(p.device, p.dtype), sin[0].to(p.device, p.dtype))
        return self._rope

    # ------------------------------------------------------------------ the draft step
    @torch.no_grad()
    def add_context(self, cache: DraftCache, b: int, features: Sequence[torch.Tensor],
                    positions: torch.Tensor, fused: bool = True, rope=None, validate: bool = True) -> None:
        """Project the target features [T, H] (one per target layer) of T newly accepted
        tokens of sequence b at `positions` and write their K/V into every layer's cache.
        `rope`: the (cos, sin) tables to use, covering every position (None: rope_tables
        sized from `positions`, which reads them: a device sync on CUDA). `validate=False`
        lets the fused op skip its host-side index check (ops.py); a token skipped there
        for a bad position still counts in the cache length."""
        T = features[0].shape[0]
        if T == 0:
            return
        impl = ops if fused else reference
        eps = self.config.rms_norm_eps
        ctx = impl.project_features(list(features), self.fc.weight, self.hidden_norm.weight, eps)
        k_w, v_w, kn_w = self._stacked_kv_weights()
        cos, sin = rope if rope is not None else self.rope_tables(int(positions.max()) + 1)
        slots = cache.slots_for(b, T)
        args = (ctx, k_w, v_w, kn_w, cos, sin, positions, slots, cache.k, cache.v, eps)
        if fused:
            ops.inject_context_kv(*args, validate=validate)
        else:
            reference.inject_context_kv(*args)
        cache.advance(b, T)

    @torch.no_grad()
    def draft_hidden(self, cache: DraftCache, block_embeds: torch.Tensor, positions: torch.Tensor,
                     fused: bool = True, rope=None, validate: bool = True) -> torch.Tensor:
        """Run the N layers over the blocks ``block_embeds [Bsz, B, H]`` (target embeddings
        of [last accepted token, MASK...]) at ``positions [Bsz, B]``; returns the final-normed
        hidden states [Bsz, B, H]. Block K/V are scratch: the cache is not changed.
        `rope` and `validate` as in :meth:`add_context`; with ``validate=False`` the
        attention is planned for the cache's capacity (a static bound: CUDA graphs)."""
        cos, sin = rope if rope is not None else self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
        attention = ops.block_attention if fused else reference.block_attention
        block_conv = ops.block_conv if fused else reference.block_conv
        fused_args = dict(max_context=-1 if validate else cache.capacity, validate=validate) if fused else {}
        offsets, lens = cache.offsets, cache.lens
        scale = self.config.head_dim ** -0.5
        symmetric = self.config.layer_symmetric_window
        x = block_embeds
        for i, layer in enumerate(self.layers):
            if symmetric[i]:  # not fused yet (the op has no symmetric window): plain torch, both paths
                def attend(q, k, v, i=i):
                    return windowed_bidirectional_attention(q, k, v, cache.k[i], cache.v[i], cache.capacity, lens,
                                                            scale, cache.windows[i])
            else:
                def attend(q, k, v, i=i):
                    return attention(q, k, v, cache.k[i], cache.v[i], offsets, lens, scale, window=cache.windows[i],
                                     causal=cache.causal[i], **fused_args)
            x = layer(x, cos, sin, attend, block_conv)
        return self.norm(x)

    def draft_vocab_head(self, lm_head: nn.Module):
        """(token ids, weight rows, bias rows or None) of the draft vocabulary in the target's
        LM head, on its device and dtype; gathered once and cached until the head changes."""
        w = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        key = (w.data_ptr(), w._version, w.device, w.dtype, None if bias is None else (bias.data_ptr(), bias._version))
        if self._vocab_head is None or self._vocab_head[0] != key \
                or self._vocab_head[1] is not self.draft_vocab:
            ids = self.draft_vocab.to(w.device)
            self._vocab_head = (key, self.draft_vocab, ids, w.detach()[ids].contiguous(),
                                None if bias is None else bias.detach()[ids])
        return self._vocab_head[2:]

    # ------------------------------------------------------------------ training forward
    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Differentiable forward of all blocks of one sequence at once (training).

        features [S, k*H]: the target features of the sequence's S tokens (k layers
        concatenated); block_embeds [nb, B, H]: target embeddings of [anchor token, MASK...];
        anchors [nb]: block positions. Block a attends to the context rows at positions
        < anchors[a] and to its own B rows, exactly what the block drafted at anchors[a]
        sees at inference, through the same per-layer masks (:func:`context_mask`,
        :func:`block_mask`). The scores against the context, shared by all blocks, and
        against each block's own rows are one softmax ([nb, B, S + B] per head) without
        copying the context keys per block, so the cost grows linearly with the number of
        anchors. Returns final-normed hidden [nb, B, H].
        """
        c = self.config
        S = features.shape[0]
        nb, B, H = block_embeds.shape
        D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        group, scale = Hq // Hkv, D ** -0.5
        cos, sin = self.rope_tables(S + B)
        ctx = self.hidden_norm(self.fc(features))
        cos_c, sin_c = cos[:S, None, :], sin[:S, None, :]
        pos = anchors[:, None] + torch.arange(B, device=anchors.device)  # [nb, B]
        cos_b, sin_b = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
        kinds = list(zip(c.layer_windows, c.layer_causal))
        # the keys each query may not see, per (window, causal): context [nb, 1 or B, S], own block [B, B] (None: all)
        hidden_keys = {}
        for w, causal in set(kinds):
            symmetric = w > 0 and not causal  # |p - k| < w: per query on the context, both ways in the block
            hidden_keys[w, causal] = (~context_mask(anchors, S, w, B if causal or symmetric else 0),
                                      ~block_mask(B, w, anchors.device, causal) if causal or symmetric else None)
        x = block_embeds
        for layer, kind in zip(self.layers, kinds):
            a = layer.self_attn
            k_ctx = reference.apply_rope(a.k_norm(a.k_proj(ctx).view(S, Hkv, D)), cos_c, sin_c)
            v_ctx = a.v_proj(ctx).view(S, Hkv, D)
            hidden, hidden_own = hidden_keys[kind]

            def attend(q, k, v):  # called within this iteration, so the closure sees this layer's tensors
                # q [nb, B, Hq, D]; k, v [nb, B, Hkv, D]; query head h reads kv head h // group
                q = q.reshape(nb, B, Hkv, group, D) * scale
                on_ctx = torch.einsum("nbhgd,shd->hgnbs", q, k_ctx).masked_fill(hidden, float("-inf"))
                on_own = torch.einsum("nbhgd,nchd->hgnbc", q, k)
                if hidden_own is not None:
                    on_own = on_own.masked_fill(hidden_own, float("-inf"))
                # [Hkv, group, nb, B, S + B], normalised in fp32 (CPU autocast would keep a bf16 softmax in bf16)
                p = torch.cat([on_ctx, on_own], -1).softmax(-1, dtype=torch.float32).to(v.dtype)
                o = (torch.einsum("hgnbs,shd->nbhgd", p[..., :S], v_ctx)
                     + torch.einsum("hgnbc,nchd->nbhgd", p[..., S:], v))
                return o.reshape(nb, B, Hq, D)

            x = layer(x, cos_b, sin_b, attend)
        return self.norm(x)


def context_mask(anchors: torch.Tensor, seq_len: int, window: int = 0, causal_block: int = 0) -> torch.Tensor:
    """Boolean mask (True = attend) of the context rows each block's queries see: block a
    sees the rows at positions < anchors[a]. Bidirectional (causal_block = 0): [nb, 1,
    seq_len], the same rows for all its queries, the last `window` of them when window > 0.
    Causal (causal_block = B) with a window: [nb, B, seq_len], query i at position
    anchors[a] + i sees the rows k with anchors[a] + i - k < window; without one every query
    sees every row before the anchor ([nb, 1, seq_len] again)."""
    pos = torch.arange(seq_len, device=anchors.device)[None, None, :]
    anchor = anchors[:, None, None]
    ctx = pos < anchor
    if window > 0:
        if causal_block:
            query = anchor + torch.arange(causal_block, device=anchors.device)[None, :, None]
            ctx = ctx & (query - pos < window)
        else:
            ctx = ctx & (pos >= anchor - window)
    return ctx


def block_mask(block_size: int, window: int = 0, device=None, causal: bool = True) -> torch.Tensor:
    """Boolean mask [B, B] (True = attend) of the block rows a causal layer's block queries
    see: query i sees rows j <= i with i - j < window (window = 0: no bound). A
    bidirectional layer sees the whole block; with a window (causal False) the rows
    |i - j| < window."""
    i = torch.arange(block_size, device=device)[:, None]
    j = torch.arange(block_size, device=device)[None, :]
    own = j <= i if causal else torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window > 0:
        own &= (i - j).abs() < window
    return own


def windowed_bidirectional_attention(q, k_block, v_block, k_cache, v_cache, capacity: int, cache_lens,
                                     scale: float, window: int) -> torch.Tensor:
    """Attention of a bidirectional layer with a window, as the authors' code and TensorRT-LLM
    define it: the query at position p sees the keys at |p - k| < window, over the context rows
    (row r at position r, n = cache_lens[b] of them) and the block (query and key i at n + i).
    q [Bsz, B, Hq, D], block K/V [Bsz, B, Hkv, D], the cache [Bsz * capacity, Hkv, D]
    (sequence b at rows b * capacity). Plain torch over every row of the capacity under a
    mask, without host reads (a CUDA graph captures it); softmax in fp32."""
    Bsz, B, Hq, D = q.shape
    Hkv = k_block.shape[2]
    group = Hq // Hkv
    rows = torch.arange(capacity, device=q.device)
    query_pos = cache_lens[:, None] + torch.arange(B, device=q.device)  # [Bsz, B]
    on_ctx = (rows < cache_lens[:, None, None]) & (query_pos[:, :, None] - rows < window)  # [Bsz, B, capacity]
    on_own = block_mask(B, window, q.device, causal=False)
    k_ctx = k_cache[:Bsz * capacity].view(Bsz, capacity, Hkv, D)
    v_ctx = v_cache[:Bsz * capacity].view(Bsz, capacity, Hkv, D)
    qf = q.float().view(Bsz, B, Hkv, group, D) * scale
    s_ctx = torch.einsum("bihgd,brhd->bhgir", qf, k_ctx.float()).masked_fill(~on_ctx[:, None, None], float("-inf"))
    s_own = torch.einsum("bihgd,bjhd->bhgij", qf, k_block.float()).masked_fill(~on_own, float("-inf"))
    p = torch.cat([s_ctx, s_own], -1).softmax(-1)
    o = (torch.einsum("bhgir,brhd->bihgd", p[..., :capacity], v_ctx.float())
         + torch.einsum("bhgij,bjhd->bihgd", p[..., capacity:], v_block.float()))
    return o.reshape(Bsz, B, Hq, D).to(q.dtype)


def _init_weights(module: nn.Module) -> None:
    """Linear layers random; DFlash2's parts at their identity (Module.apply visits a module
    after its children, so this overrides their projections' random init)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, (BlockConv, CandidateSelector)):
        module.reset_identity()
