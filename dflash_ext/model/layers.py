"""The drafter's modules: Qwen3-style decoder layers (RMSNorm, Attention, MLP, DecoderLayer)
and DFlash2's parts (BlockConv, CandidateSelector), with their initialisation
(:func:`init_weights`), and the RoPE tables they rotate by (:func:`rope_tables`). The
drafter that holds them is :class:`~dflash_ext.model.drafter.DFlashDrafter`."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import reference
from .config import DFlashConfig


def rope_tables(config: DFlashConfig, positions: int, device=None, dtype=None):
    """cos, sin ``[positions, D]`` of the positions ``0 .. positions - 1``, computed by
    transformers' own Qwen3 rotary embedding from the config (every rope type it implements,
    with the attention scaling YaRN and longrope apply to cos and sin), on `device` in
    `dtype`. A rope type that recomputes its frequencies from the sequence length past a limit
    (:attr:`DFlashConfig.rope_position_limit`) is a ValueError past it: an incremental context
    cache cannot follow that. Below the limit a position's row does not depend on how many are
    computed, so a caller may keep a table and take its first rows (the draft runtime and the
    drafter's training forward keep their own; nothing is kept here)."""
    limit = config.rope_position_limit
    if limit is not None and positions > limit:
        raise ValueError(f"rope_type {config.rope_parameters['rope_type']!r} recomputes every frequency from the "
                         f"whole sequence length past {limit} positions; drafting at {positions} positions is not "
                         "supported")
    cos, sin = _qwen3_rope(config, positions)
    return cos.to(device, dtype), sin.to(device, dtype)


def _qwen3_rope(config: DFlashConfig, positions: int):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = Qwen3RotaryEmbedding(config.hf_config())
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    return cos[0], sin[0]


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
        when `vocab` maps its rows to token ids) and the anchor tokens [Bsz]: the greedy walk.
        Plain torch ops, no host reads: a CUDA graph captures it."""
        return self.walk(hidden, logits, anchor, vocab, lambda score: score.argmax(-1))[0]

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             vocab: Optional[torch.Tensor], choose) -> tuple:
        """(path [Bsz, n], candidates [Bsz, n, K]): the walk from the anchor tokens, slot j
        taking the candidate ``choose(scores [Bsz, K])`` (an index [Bsz]) picks among its
        candidates' scores after the token taken at slot j - 1 (greedy: the argmax; at T > 0
        a sample, :func:`~dflash_ext.sampling.sample_draft`)."""
        unary, candidates = self.top_candidates(self.unary(logits), vocab)  # [Bsz, n, K]
        gate = self.gate(hidden)  # [Bsz, n, R]
        previous, path = anchor, []
        for j in range(candidates.shape[1]):
            score = self.scores(gate[:, j], unary[:, j], candidates[:, j], previous)
            previous = candidates[:, j].gather(-1, choose(score)[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, 1), candidates


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


def init_weights(module: nn.Module) -> None:
    """Linear layers random; DFlash2's parts at their identity (Module.apply visits a module
    after its children, so this overrides their projections' random init)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, (BlockConv, CandidateSelector)):
        module.reset_identity()
