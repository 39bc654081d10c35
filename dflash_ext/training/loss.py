"""The training loss of one sequence (:func:`sequence_loss`: weighted cross-entropy of its
blocks, DFlash2's selector term), its parts (the frozen target's embedding and LM head, the
label weights, the loss vocabulary) and the acceptance it implies (:func:`tau_of`; at the
loop's anchors :func:`walked_acceptance`; under rejection sampling :func:`sampled_acceptance`)."""
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..draft.head import block_embedding
from .recipe import IGNORE, block_labels, loss_weights


class FrozenTargetParts(torch.nn.Module):
    """The target's embedding and LM head (no gradients, not part of the drafter)."""

    def __init__(self, target):
        super().__init__()
        self.embed = block_embedding(target)  # as inference embeds a block
        self.lm_head = target.get_output_embeddings()
        for p in self.parameters():
            p.requires_grad_(False)


def output_rows(frozen: FrozenTargetParts, vocab: Optional["LossVocab"]) -> torch.Tensor:
    """The LM head rows the loss's softmax runs over: `vocab`'s, or the whole head."""
    return frozen.lm_head.weight if vocab is None else vocab.lm_head_rows


class BlockLogits(NamedTuple):
    """The drafter's pass over all blocks of one sequence (:func:`block_logits`)."""
    hidden: torch.Tensor     # [nb, B-1, H] final-normed hidden states of slots 1..B-1
    logits: torch.Tensor     # [nb, B-1, V] over the loss rows (`vocab`'s, or the whole head)
    block_ids: torch.Tensor  # [nb, B] the blocks' inputs: [anchor token, MASK x (B-1)]
    labels: torch.Tensor     # [nb, B-1] token ids (IGNORE past the end)


def block_logits(drafter, frozen: FrozenTargetParts, input_ids: torch.Tensor, features: torch.Tensor,
                 anchors: torch.Tensor, block_size: int, vocab: Optional["LossVocab"] = None) -> BlockLogits:
    """The drafter's logits for every slot of the blocks of one sequence (the training forward,
    :class:`~dflash_ext.model.drafter.DFlashDrafter`'s ``forward``, then the frozen LM head)."""
    core = getattr(drafter, "module", drafter)  # unwrap DDP
    block_ids = torch.full((anchors.numel(), block_size), core.config.mask_token_id, dtype=torch.long,
                           device=input_ids.device)
    block_ids[:, 0] = input_ids[anchors]
    with torch.no_grad():
        embeds = frozen.embed(block_ids).to(features.dtype)
    hidden = drafter(features, embeds, anchors)[:, 1:]
    labels = block_labels(input_ids, anchors, block_size)
    # flattened first: on a strided 3-D input that needs grad, F.linear runs a bmm against the weight
    # expanded per block (measured: over a quarter of a CPU training step, bench/results/history/notebook-2026.md §5)
    logits = F.linear(hidden.flatten(0, 1), output_rows(frozen, vocab))
    return BlockLogits(hidden, logits.view(*labels.shape, -1), block_ids, labels)


@torch.no_grad()
def drafted_tokens(drafter, out: BlockLogits, vocab: Optional["LossVocab"] = None) -> torch.Tensor:
    """[nb, B-1] the tokens inference drafts from `out`: the argmax over the draft vocabulary,
    or a DFlash2 drafter's selector path."""
    core = getattr(drafter, "module", drafter)
    if core.config.is_dflash2:
        return core.candidate_selector(out.hidden, out.logits, out.block_ids[:, 0], None if vocab is None else vocab.ids)
    best = out.logits.argmax(-1)
    return best if vocab is None else vocab.ids[best]


def sequence_loss(drafter, frozen: FrozenTargetParts, input_ids: torch.Tensor, features: torch.Tensor,
                  anchors: torch.Tensor, block_size: int, gamma: float, vocab: Optional["LossVocab"] = None,
                  need_correct: bool = True, selector_alpha: float = 1.0,
                  teacher_logits: Optional[torch.Tensor] = None, distill: float = 0.0):
    """Weighted cross-entropy of all blocks of one sequence: slot j predicts
    input_ids[anchor + j] with weight exp(-(j-1)/gamma); slot 0 and slots past the end
    have no loss. With `vocab`, the softmax runs over that token subset only (labels
    outside it get no loss). Returns (weighted loss sum, weight sum, correct [nb, B-1]
    bool: the block inference would draft matches the labels there; None without
    `need_correct`): the caller normalises by the weight sum of its whole batch.

    Distillation: with `teacher_logits [S, V]` (the target's logits at every position of
    the sequence, over the same rows as the drafter's: `vocab`'s or the whole vocabulary)
    each slot's loss is ``(1 - distill) * CE(label) + distill * CE(p_target)``, the second
    the cross-entropy to the target's whole next-token distribution there (softmax over
    those rows; its KL up to the target's entropy, a constant), with the same weights.

    DFlash2 (as SpecForge defines its loss): the cross-entropy runs on the selector's
    transformed logits, plus `selector_alpha` times the selector's: at each slot whose label
    is among the top-K candidates, a K-way cross-entropy of the candidates' scores after the
    label of the slot before (teacher-forced; the anchor token at slot 1), with the same
    weights, over the same denominator. Its drafts are the selector's greedy path."""
    core = getattr(drafter, "module", drafter)  # unwrap DDP
    out = block_logits(drafter, frozen, input_ids, features, anchors, block_size, vocab)
    hidden, logits, block_ids, token_labels = out
    selector = core.candidate_selector if core.config.is_dflash2 else None
    vocab_ids = None if vocab is None else vocab.ids
    correct = drafted_tokens(drafter, out, vocab) == token_labels if need_correct else None
    labels = token_labels if vocab is None else vocab.remap(token_labels)
    w = label_weights(labels, gamma)
    unary = logits.float() if selector is None else selector.unary(logits)
    ce = F.cross_entropy(unary.reshape(-1, unary.shape[-1]), labels.reshape(-1), reduction="none",
                         ignore_index=IGNORE)
    if distill:
        if teacher_logits is None:
            raise ValueError("distill > 0 needs teacher_logits (the target's logits of the sequence)")
        soft = target_distribution(teacher_logits, anchors, block_size)
        ce = (1 - distill) * ce + distill * F.cross_entropy(unary.reshape(-1, unary.shape[-1]),
                                                            soft.reshape(-1, soft.shape[-1]), reduction="none")
    loss = (ce * w.reshape(-1)).sum()
    if selector is not None and selector_alpha:
        top, candidates = selector.top_candidates(unary, vocab_ids)  # [nb, B-1, K]
        previous = torch.cat([block_ids[:, :1], token_labels[:, :-1].clamp(min=0)], 1)  # a past-end label has weight 0
        scores = selector.scores(selector.gate(hidden), top, candidates, previous)
        is_label = candidates == token_labels[..., None]
        covered = is_label.any(-1)
        ce_sel = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), is_label.float().argmax(-1).reshape(-1),
                                 reduction="none")
        loss = loss + selector_alpha * (ce_sel * (w * covered).reshape(-1)).sum()
    return loss, w.sum(), correct


@torch.no_grad()
def sampled_acceptance(out: BlockLogits, target_log_probs: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[nb, B-1] the probability that rejection sampling at temperature 1 accepts each slot's
    draft: sum_x min(p(x), q(x)), q the drafter's softmax over its rows (the draft
    vocabulary), p the target's next-token distribution at the slot's position, given as
    ``target_log_probs [S, V]``: log-softmax over the WHOLE vocabulary, read at the same rows.
    Teacher-forced (p follows the data's prefix, not the drafts'): a block-parallel drafter's
    q does not depend on the drafts before it, p does."""
    p = target_log_probs[(anchors[:, None] + torch.arange(out.labels.shape[1], device=anchors.device))
                         .clamp(max=target_log_probs.shape[0] - 1)].float().exp()
    return torch.minimum(p, out.logits.float().softmax(-1)).sum(-1) * (out.labels != IGNORE)


def target_distribution(teacher_logits: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[nb, B-1, V] float32: the target's next-token distribution for slot j = 1..B-1 of the
    block at each anchor, read at position anchor + j - 1 of ``teacher_logits [S, V]`` (the
    logits there predict the token at anchor + j, the slot's label). Positions past the end
    repeat the last row: those slots have no label and weight 0."""
    pos = anchors[:, None] + torch.arange(block_size - 1, device=anchors.device)
    return teacher_logits[pos.clamp(max=teacher_logits.shape[0] - 1)].float().softmax(-1)


def most_frequent_tokens(records, vocab_size: int, k: int):
    """(sorted ids of the k most frequent response tokens of `records`, their share of all
    response tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts += torch.bincount(torch.tensor(r["input_ids"][r["response_start"]:]), minlength=vocab_size)
    ids = counts.topk(min(k, vocab_size)).indices.sort().values
    return ids, counts[ids].sum().item() / max(1, counts.sum().item())


class LossVocab:
    """A token subset of the vocabulary: the softmax of the loss runs over it instead of the
    whole vocabulary (the frozen LM head's rows are most of the FLOPs per slot), and the
    drafter trained so drafts from it (its draft vocabulary, saved with the checkpoint).
    The held-out tau drafts from it too, as inference does."""

    def __init__(self, ids: torch.Tensor, lm_head_weight: torch.Tensor):
        self.ids = ids.to(lm_head_weight.device)
        self.lm_head_rows = lm_head_weight.detach()[self.ids].contiguous()
        self._map = torch.full((lm_head_weight.shape[0],), IGNORE, dtype=torch.long, device=self.ids.device)
        self._map[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)

    def remap(self, labels: torch.Tensor) -> torch.Tensor:
        return torch.where(labels == IGNORE, IGNORE, self._map[labels.clamp(min=0)])


def label_weights(labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """[nb, B-1] loss weights of the labelled slots (0 past the end)."""
    w = loss_weights(labels.shape[1] + 1, gamma, device=labels.device)
    return w[None, :] * (labels != IGNORE)


def tau_of(correct: torch.Tensor) -> float:
    """Expected tokens per draft step from a per-block correctness matrix [nb, B-1]: the
    accepted prefix of each block (drafts right up to the first miss) plus the target's
    own token."""
    return 1 + torch.cumprod(correct.float(), -1).sum(-1).mean().item()


def walked_acceptance(correct: torch.Tensor) -> List[int]:
    """The drafts each step of the decoding loop accepts over one sequence, from its
    correctness matrix [n, B-1] at every anchor (row p: the block anchored p tokens into the
    response): a step at anchor p accepts its prefix k and the loop's next anchor is p + k + 1.
    The loop drafts at those anchors only, where misses are more common than at an anchor
    taken at random (a stretch of misses is walked token by token, an easy one skipped
    through), so tokens per step fall below :func:`tau_of` over every anchor."""
    accepted = torch.cumprod(correct.int(), -1).sum(-1).tolist()
    steps, p = [], 0
    while p < len(accepted):
        steps.append(accepted[p])
        p += accepted[p] + 1
    return steps
