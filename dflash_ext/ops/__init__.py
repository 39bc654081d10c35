"""The op layer's public API: the fused ops of the draft step (their full contract: docs/ops.md).

Importing this package loads the compiled extension (:func:`.hardware.load_extension`),
which registers ``torch.ops.dflash_ext.<name>``. Each function here calls that op, and the
fake (meta) kernel registered beside it gives output shapes to ``torch.compile`` and
FakeTensor tracing. Input checks live in the compiled op (csrc/checks.cpp) and name the
argument; the scalar arguments' kinds are checked here (:func:`_int`, :func:`_float`,
:func:`_flag`). The rooms beside it: :mod:`.reference` (the plain-PyTorch specification of
every op, differentiable), :mod:`.linear` (which kernel runs each linear layer) and
:mod:`.hardware` (what this machine is).

The ops are inference only: they have no backward, so each raises when called with
gradients wanted (grad mode on and a tensor input that requires grad) rather than return
an output whose inputs would silently get no gradient.
"""
import numbers
import operator
from typing import Optional, Sequence

import torch

from . import hardware

hardware.load_extension()  # before the fakes below register against the ops it defines

__all__ = ["project_features", "inject_context_kv", "block_attention", "skinny_linear", "block_conv", "rms_norm",
           "qk_norm_rope", "wants_grad"]

_ops = torch.ops.dflash_ext


def wants_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors: grad mode is on and one of
    them requires grad (other arguments, None or a bad input the op then names, count as
    not). A host-side check (no device work), traced by torch.compile as a guard."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _inference_only(name: str, *tensors) -> None:
    if wants_grad(*tensors):
        raise RuntimeError(f"dflash_ext.ops.{name} has no backward (inference only): call it under torch.no_grad() / "
                           f"torch.inference_mode(), or use dflash_ext.ops.reference.{name} for gradients")


def _check_one_device(**tensors):
    """Fake kernels also run when only some inputs are on the meta device; the compiled
    checks never see that case, so the device rule is enforced here too."""
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise RuntimeError(f"{name} is on {t.device} but {first_name} is on {first.device}: "
                               "all tensors must be on one device")


def _int(name: str, value) -> int:
    """An int argument of an op's schema, checked where the dispatcher would convert: it
    refuses a float or a string itself (a RuntimeError naming the argument) but takes a bool
    as 0 / 1, and a cast here would truncate 2.9 to 2. Ints, numpy's and 0-dim integer
    tensors pass; symbolic ints (torch.compile's) as they are."""
    if isinstance(value, torch.SymInt):
        return value
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RuntimeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _float(name: str, value) -> float:
    """A float argument: a real number (an int too; a 0-dim tensor of one), never a bool, a
    string or None. Symbolic floats (torch.compile's) pass as they are."""
    if isinstance(value, torch.SymFloat):
        return value
    real = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                               and not value.dtype.is_complex)
    if real and not _is_bool(value):
        return float(value)
    raise RuntimeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")


def _flag(name: str, value) -> bool:
    """A bool argument: True or False (numpy's too); the dispatcher would take 1 or None."""
    if _is_bool(value) and not isinstance(value, torch.Tensor):
        return bool(value)
    raise RuntimeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _is_bool(value) -> bool:
    """A bool, numpy's (np.bool_) or a bool tensor."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_") or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def project_features(features: Sequence[torch.Tensor], fc_weight: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rms_norm(cat(features, -1) @ fc_weight.T, eps) * norm_weight`` without the concat.

    features: k tensors ``[T, H]`` (row-strided views allowed); fc_weight ``[H_out, k*H]``;
    norm_weight ``[H_out]``. Returns ``[T, H_out]`` in the input dtype (fp32 accumulation).
    """
    features = list(features)
    _inference_only("project_features", fc_weight, norm_weight, *features)
    return _ops.project_features(features, fc_weight, norm_weight, _float("eps", eps))


@torch.library.register_fake("dflash_ext::project_features")
def _project_features_fake(features, fc_weight, norm_weight, eps):
    torch._check(len(features) > 0, lambda: "features must hold at least one tensor (k >= 1)")
    _check_one_device(**{f"features[{j}]": f for j, f in enumerate(features)},
                      fc_weight=fc_weight, norm_weight=norm_weight)
    return features[0].new_empty((features[0].shape[0], fc_weight.shape[0]))


def inject_context_kv(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                      k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, eps: float = 1e-6, validate: bool = True) -> None:
    """Write the context K/V of every drafter layer into the caches, in place.

    For each layer i and token t with ``slots[t] >= 0``:
    ``k_cache[i, slots[t]] = RoPE(rms_norm((ctx[t] @ k_weight[i].T).view(Hkv, D)) * k_norm_weight[i])``
    at ``positions[t]`` and ``v_cache[i, slots[t]] = (ctx[t] @ v_weight[i].T).view(Hkv, D)``.

    ``validate=True`` checks the index values (slots in [-1, S) and unique, positions in
    [0, P)) and raises on a bad one. On CUDA that reads them on the host (a sync);
    ``validate=False`` reads nothing there (what a CUDA graph needs), and a token whose
    slot is outside [0, S) or whose position is outside [0, P) is then skipped, nothing
    written; repeated slots leave a mix of those tokens' rows there. The CPU always validates.
    """
    _inference_only("inject_context_kv", ctx, k_weight, v_weight, k_norm_weight, cos, sin, k_cache, v_cache)
    _ops.inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots,
                           k_cache, v_cache, _float("eps", eps), _flag("validate", validate))


@torch.library.register_fake("dflash_ext::inject_context_kv")
def _inject_context_kv_fake(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots,
                            k_cache, v_cache, eps, validate=True):
    _check_one_device(ctx=ctx, k_weight=k_weight, v_weight=v_weight, k_norm_weight=k_norm_weight,
                      cos=cos, sin=sin, positions=positions, slots=slots, k_cache=k_cache,
                      v_cache=v_cache)
    return None


def block_attention(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_offsets: torch.Tensor,
                    cache_lens: torch.Tensor, scale: float, window: int = 0, max_context: int = -1,
                    validate: bool = True, causal: bool = False, symmetric: bool = False) -> torch.Tensor:
    """Attention of each sequence's Bq block queries over its cached context rows
    ``cache_offsets[b] .. cache_offsets[b] + cache_lens[b] - 1`` followed by its own Bq block
    rows. GQA: query head h uses KV head ``h // (Hq // Hkv)``. Returns ``[Bsz, Bq, Hq, D]``.

    Positions: with ``n = cache_lens[b]``, context row r (0-based within the sequence's
    range) is at position r, block key j at ``n + j`` and block query i at ``n + i``.
    ``causal=False``: every query sees the last ``window`` context rows (all when
    ``window == 0``) and all Bq block rows. ``causal=True``: the query at position p sees
    the key at position k iff ``k <= p`` and (``window == 0`` or ``p - k < window``), the
    causal sliding window over the context followed by the block. A query may then see no
    context row (and, with ``window < Bq``, not every earlier block key), never no key: it
    always sees itself. ``symmetric=True`` (a bidirectional window, the sliding layers of
    DFlash2's published configs): the query at position p sees the key at position k iff
    ``window == 0`` or ``|p - k| < window``, i.e. the context rows within the window behind
    it and the block keys within the window on both sides (``window == 0``: the same as
    neither flag). Causal and symmetric exclude each other.

    ``max_context`` (>= 0) promises that no sequence sees more context rows than that,
    counting the rows its queries see together: the last ``min(n, window)``, or causal and
    symmetric the first query's, the last ``min(n, window - 1)`` (all n when ``window == 0``).
    Neither counts more than non-causal, so a bound planned for non-causal attention holds. On CUDA
    the split-KV plan is sized from it instead of from the lens, so a captured graph stays
    valid as contexts grow (-1: no bound). ``validate=True`` checks the ranges (offsets
    >= 0, lens >= 0, offset + len <= S, those visible rows <= max_context) and raises; on
    CUDA that reads them on the host (a sync). ``validate=False`` reads nothing there: a
    range is then clamped to the cache (offset to [0, S], len to [0, S - offset]) and a
    sequence sees at most ``max_context`` (else S) of its last rows (causal, symmetric: the
    rule above within them). The CPU always validates.
    """
    _inference_only("block_attention", q, k_block, v_block, k_cache, v_cache)
    return _ops.block_attention(q, k_block, v_block, k_cache, v_cache, cache_offsets, cache_lens,
                                _float("scale", scale), _int("window", window), _int("max_context", max_context),
                                _flag("validate", validate), _flag("causal", causal), _flag("symmetric", symmetric))


@torch.library.register_fake("dflash_ext::block_attention")
def _block_attention_fake(q, k_block, v_block, k_cache, v_cache, cache_offsets, cache_lens, scale,
                          window=0, max_context=-1, validate=True, causal=False, symmetric=False):
    _check_one_device(q=q, k_block=k_block, v_block=v_block, k_cache=k_cache, v_cache=v_cache,
                      cache_offsets=cache_offsets, cache_lens=cache_lens)
    torch._check(not (causal and symmetric), lambda: "causal and symmetric exclude each other; got both True")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for inputs of few rows (a verify pass of B tokens).

    x ``[..., K]``; weight ``[N, K]``; bias ``[N]`` or None. Returns ``[..., N]`` in x's dtype.
    On the CPU, up to 8 rows (all leading dims together) stream the weight once with the
    dot products of every row in fp32, where the library GEMM costs about twice its
    one-row GEMV; more rows, bf16 rows that oneDNN takes (CPUs with bf16 units) and
    other devices run ``F.linear`` itself.
    """
    _inference_only("skinny_linear", x, weight, bias)
    if x.dim() == 0:  # the op names the problem
        return _ops.skinny_linear(x, weight, bias)
    out = _ops.skinny_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.library.register_fake("dflash_ext::skinny_linear")
def _skinny_linear_fake(x, weight, bias=None):
    _check_one_device(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    return x.new_empty((x.shape[0], weight.shape[0]))


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """DFlash2's block convolution: a dynamic depthwise convolution along each block that
    looks back only and never across a block boundary.

    x ``[M, B, H]`` (M blocks of B slots); base ``[T, H]`` (a static coefficient per tap and
    channel); delta ``[M, B, T, G]`` (a coefficient per slot, tap and channel group; G divides
    H, channel c is in group ``c // (H // G)``). Returns ``[M, B, H]`` in x's dtype:
    ``out[m, i, c] = sum_t (base[t, c] + delta[m, i, t, c // (H // G)]) * x[m, i - t, c]``
    over the taps ``t <= i``, accumulated in fp32. One fused pass over x on the CPU and on
    CUDA.
    """
    _inference_only("block_conv", x, base, delta)
    return _ops.block_conv(x, base, delta)


@torch.library.register_fake("dflash_ext::block_conv")
def _block_conv_fake(x, base, delta):
    _check_one_device(x=x, base=base, delta=delta)
    return x.new_empty(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last dim H of ``x [..., H]``
    (weight ``[H]``), in fp32, cast to x's dtype once.

    With ``residual`` (x's shape): the add + norm of a pre-norm residual stream in one pass,
    ``s = x + residual`` rounded to the dtype (as a separate add), returns ``(s, rms_norm(s))``.
    Spec: dflash_ext.ops.reference.rms_norm with ``compute_dtype=torch.float32``.
    """
    _inference_only("rms_norm", x, weight, residual)
    if residual is None:
        return _ops.rms_norm(x, weight, _float("eps", eps))
    return _ops.add_rms_norm(x, residual, weight, _float("eps", eps))


@torch.library.register_fake("dflash_ext::rms_norm")
def _rms_norm_fake(x, weight, eps):
    _check_one_device(x=x, weight=weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("dflash_ext::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    _check_one_device(x=x, residual=residual, weight=weight)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def qk_norm_rope(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float = 1e-6):
    """q and k of a decoder layer from its stacked projection ``qkv [M, (Hq + 2 Hkv) * D]``
    (q heads, k heads, v heads; rows may be strided): each head RMS-normed over D (norm weights
    ``[D]``), then rotated (rotate_half RoPE) at ``cos, sin [M, D]``, the table rows of each
    token's position. Returns ``(q [M, Hq, D], k [M, Hkv, D])`` in qkv's dtype (fp32 math);
    v is the view ``qkv[:, (Hq + Hkv) * D:]``. Spec: dflash_ext.ops.reference.qk_norm_rope.
    """
    _inference_only("qk_norm_rope", qkv, q_norm_weight, k_norm_weight, cos, sin)
    return _ops.qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, _int("num_q_heads", num_q_heads),
                             _int("num_kv_heads", num_kv_heads), _float("eps", eps))


@torch.library.register_fake("dflash_ext::qk_norm_rope")
def _qk_norm_rope_fake(qkv, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads, eps):
    _check_one_device(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos=cos, sin=sin)
    M, D = qkv.shape[0], q_norm_weight.shape[0]
    return qkv.new_empty((M, num_q_heads, D)), qkv.new_empty((M, num_kv_heads, D))
