"""The DFlash drafter as a plain ``nn.Module``: N Qwen3-style decoder layers whose attention
sees the target's projected hidden states as a context, followed by the block; each layer
bidirectional or causal by :attr:`~dflash_ext.model.config.DFlashConfig.layer_causal`.

Here: its weights (building, loading, saving, the draft vocabulary, DFlash2 conversion, new
layers) and the differentiable forward over many blocks of a sequence (training). Drafting
at inference is :class:`~dflash_ext.draft.runtime.DraftRuntime`'s, which reads these
parameters and keeps no state here. Its parts: the layers (:mod:`.layers`), the masks
(:mod:`.masks`), the config (:mod:`.config`), the checkpoint files (:mod:`.checkpoint`).

DeepSpec's format (``config.is_deepspec``: DSpark, or DeepSpec's DFlash) adds its own
``embed_tokens`` and ``lm_head``, and DSpark's Markov and confidence heads (:mod:`.dspark`,
which also drafts its block).

DFlash2 (``config.is_dflash2``) adds to each layer a block convolution on both sides of its
attention and its MLP (:class:`~.layers.BlockConv`) and, after the LM head, a candidate
selector that re-ranks each slot's top-K tokens along a path from the anchor
(:class:`~.layers.CandidateSelector`); :meth:`DFlashDrafter.dflash2_from` starts one from a v1
drafter, drafting as it does.
"""
import copy
import os
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from ..ops import reference
from .checkpoint import DRAFT_VOCAB_NAME, read_checkpoint, torch_dtype, write_checkpoint
from .config import DFlashConfig, target_text_config
from .dspark import ConfidenceHead, MarkovHead
from .layers import CandidateSelector, DecoderLayer, RMSNorm, init_weights, rope_tables
from .masks import block_mask, context_mask

__all__ = ["DFlashDrafter"]


class DFlashDrafter(nn.Module):
    """The drafter's weights (``layers``, ``fc``, ``hidden_norm``, ``norm``; DFlash2's
    ``candidate_selector``), its ``config``, the optional ``draft_vocab`` (sorted target token
    ids the LM head is restricted to), ``acceptance_profile`` (the held-out accepted-prefix
    profile training writes) and ``walked_tau`` (where measured: held-out tokens per step as the
    decoding loop walks, at verify B = 2..block_size), and the training forward."""

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
        if c.is_deepspec:  # DeepSpec's drafters hold their own embedding and LM head, and DSpark's heads
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            if c.markov_rank > 0:
                self.markov_head = MarkovHead(c)
            if c.enable_confidence_head:
                self.confidence_head = ConfidenceHead(c)
        self.acceptance_profile: Optional[List[float]] = None
        self.walked_tau: Optional[List[float]] = None
        self.draft_vocab: Optional[torch.Tensor] = None  # sorted token ids (int64, CPU): checkpoint.DRAFT_VOCAB_NAME

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                    mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                    seed: Optional[int] = 0, tokenizer=None, **overrides) -> "DFlashDrafter":
        """A fresh, randomly initialised drafter that fits a Hugging Face target config
        (:meth:`~.config.DFlashConfig.for_target`; `tokenizer`, when given, picks the mask token)."""
        config = DFlashConfig.for_target(target_config, num_layers, block_size, mask_token_id, target_layer_ids,
                                         tokenizer, **overrides)
        if seed is not None:
            torch.manual_seed(seed)
        drafter = cls(config)
        drafter.apply(init_weights)
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
        new.acceptance_profile, new.walked_tau = drafter.acceptance_profile, drafter.walked_tau
        return new

    @classmethod
    def from_pretrained(cls, path: str, device=None, dtype=None, cache_dir: Optional[str] = None,
                        local_files_only: Optional[bool] = None, revision: Optional[str] = None) -> "DFlashDrafter":
        """Load a reference-format checkpoint from a local folder or a Hugging Face repo id
        (:func:`~.checkpoint.read_checkpoint`). `dtype` is a torch dtype, its
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
        drafter.acceptance_profile, drafter.walked_tau = ckpt.acceptance_profile, ckpt.walked_tau
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
        folder is replaced as a whole, atomically (:func:`~.checkpoint.write_checkpoint`:
        `extra_files` go into it too); a `path` holding anything but a drafter checkpoint is
        refused unless `overwrite`."""
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        write_checkpoint(path, self.config, state, self.acceptance_profile,
                         None if self.draft_vocab is None else self.draft_vocab.tolist(),
                         walked_tau=self.walked_tau, extra_files=extra_files, overwrite=overwrite)

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
            layer.apply(init_weights)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
            self.layers.append(layer.to(device=p.device, dtype=p.dtype))

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

    def __getstate__(self):
        # What drafting keeps on the drafter (draft.proposer.kept_proposer: a cache, the target's
        # head rows) is not copied or pickled with it.
        state = self.__dict__.copy()
        state.pop("_kept_proposer", None)
        return state

    def _rope_tables(self, positions: int):
        """The RoPE tables of the training forward, on the drafter's device and dtype: computed
        for a power of two of positions and kept on the drafter (one computation per growth,
        not per sequence), again when the drafter moved or was cast."""
        w, held = self.fc.weight, self.__dict__.get("_rope")
        if held is None or held[0].shape[0] < positions or held[0].device != w.device or held[0].dtype != w.dtype:
            limit = self.config.rope_position_limit
            computed = max(64, 1 << (positions - 1).bit_length())
            held = self.__dict__["_rope"] = rope_tables(self.config, computed if limit is None else
                                                        max(positions, min(computed, limit)), w.device, w.dtype)
        return held[0][:positions], held[1][:positions]

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
        cos, sin = self._rope_tables(S + B)
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
