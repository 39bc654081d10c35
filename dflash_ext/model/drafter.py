"""The DFlash drafter: N Qwen3-style decoder layers whose attention sees the target's
projected hidden states as a per-layer context KV cache, followed by the block; each layer
bidirectional or causal by :attr:`~dflash_ext.config.DFlashConfig.layer_causal`.

Here: DFlashDrafter (building, loading, saving, the draft vocabulary, DFlash2 conversion,
the context cache it makes). Its parts live in their own rooms: the layers
(:mod:`dflash_ext.drafter_layers`), the context cache (:class:`DraftCache`,
:mod:`dflash_ext.draft_cache`), the masks (:mod:`dflash_ext.drafter_masks`), the draft step
over the fused ops (inference, :mod:`dflash_ext.draft_step`) and the differentiable forward
over many blocks (training, :mod:`dflash_ext.drafter_training`); every name stays importable
from here. The config is :mod:`dflash_ext.config`; checkpoint files are :mod:`dflash_ext.checkpoint`.

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

from .checkpoint import DRAFT_VOCAB_NAME, read_checkpoint, torch_dtype, write_checkpoint
from .config import DFlashConfig, target_text_config
from .draft_cache import CACHE_ROW_ALIGN, DraftCache, effective_windows  # noqa: F401 (re-exported)
from .draft_step import DraftStep
from .drafter_layers import (MLP, Attention, BlockConv, CandidateSelector, DecoderLayer,  # noqa: F401 (re-exported)
                             RMSNorm, _init_weights)
from .drafter_masks import block_mask, context_mask, windowed_bidirectional_attention  # noqa: F401 (re-exported)
from .drafter_training import TrainingForward

__all__ = ["DFlashDrafter", "DFlashConfig", "DraftCache", "BlockConv", "CandidateSelector", "effective_windows",
           "context_mask", "block_mask", "windowed_bidirectional_attention"]


class DFlashDrafter(DraftStep, TrainingForward, nn.Module):
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
        self._layer_weights = None
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
