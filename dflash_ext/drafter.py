"""The DFlash drafter: N Qwen3-style decoder layers whose attention sees the target's
projected hidden states as a per-layer context KV cache, followed by the block; each layer
bidirectional or causal by :attr:`~dflash_ext.config.DFlashConfig.layer_causal`.

Here: the layers, the context cache (:class:`DraftCache`), the draft step over the
fused ops (inference) and the differentiable forward over many blocks (training). The
config is :mod:`dflash_ext.config`; checkpoint files are :mod:`dflash_ext.checkpoint`.
"""
import os
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops, reference
from .checkpoint import DRAFT_VOCAB_NAME, read_checkpoint, torch_dtype, write_checkpoint
from .config import DFlashConfig, target_text_config

__all__ = ["DFlashDrafter", "DFlashConfig", "DraftCache", "effective_windows", "context_mask", "block_mask"]


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


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)

    def forward(self, x, cos, sin, attend):
        """One decoder layer over block tokens ``x [..., H]`` at RoPE ``cos/sin`` (broadcast
        over heads). ``attend(q [..., Hq, D], k, v [..., Hkv, D])`` returns ``[..., Hq, D]``:
        the attention over the layer's context plus these block keys (inference and
        training supply it differently; everything else is the same code)."""
        Hq, Hkv, D = self.heads
        lead = x.shape[:-1]
        a = self.self_attn
        h = self.input_layernorm(x)
        q = reference.apply_rope(a.q_norm(a.q_proj(h).view(*lead, Hq, D)), cos, sin)
        k = reference.apply_rope(a.k_norm(a.k_proj(h).view(*lead, Hkv, D)), cos, sin)
        v = a.v_proj(h).view(*lead, Hkv, D)
        x = x + a.o_proj(attend(q, k, v).reshape(*lead, Hq * D))
        return x + self.mlp(self.post_attention_layernorm(x))


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
        fused_args = dict(max_context=-1 if validate else cache.capacity, validate=validate) if fused else {}
        offsets, lens = cache.offsets, cache.lens
        scale = self.config.head_dim ** -0.5
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, lambda q, k, v: attention(q, k, v, cache.k[i], cache.v[i], offsets, lens, scale,
                                                             window=cache.windows[i], causal=cache.causal[i],
                                                             **fused_args))
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
            hidden_keys[w, causal] = (~context_mask(anchors, S, w, B if causal else 0),
                                      ~block_mask(B, w, anchors.device) if causal else None)
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


def block_mask(block_size: int, window: int = 0, device=None) -> torch.Tensor:
    """Boolean mask [B, B] (True = attend) of the block rows a causal layer's block queries
    see: query i sees rows j <= i with i - j < window (window = 0: no bound). A
    bidirectional layer sees the whole block."""
    i = torch.arange(block_size, device=device)[:, None]
    j = torch.arange(block_size, device=device)[None, :]
    own = j <= i
    if window > 0:
        own &= i - j < window
    return own


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
