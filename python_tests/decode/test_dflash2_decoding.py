"""spec_generate with DFlash2 drafters: lossless (greedy output equals the target alone; at
T > 0 the first tokens follow the target's exact law), whatever the selector drafts; a
DFlash2 drafter made from a v1 one decodes exactly as it; transformers' DFlash generate
cannot carry the selector, and says so."""
import pytest
import torch

from dflash_ext import DFlashAssistant, DFlashDrafter, spec_generate, target_generate
from dflash_ext.testing.targets import SLIDING_WINDOW, tiny_family_target, tiny_target
from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens

PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 52))]  # the second is longer than the sliding window
NEW_TOKENS = 3 * SLIDING_WINDOW
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def random_dflash2(target, seed=0, scale=0.3, **overrides):
    """A DFlash2 drafter for `target` whose convolutions and selector are random (not the
    identity it starts from): its drafts are the selector's path, not the argmax."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, seed=seed,
                                        **{**DFLASH2, **overrides})
    assert drafter.config.is_dflash2 and drafter.candidate_selector is not None
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.normal_(std=scale, generator=torch.Generator().manual_seed(seed + len(name)))
    return drafter


# (target, extra drafter config): a llama-like target; a sliding-window target; the published
# DFlash2 layout (every layer a bidirectional sliding layer: the symmetric window, unfused).
CASES = {
    "llama": (lambda: tiny_target("llama"), {}),
    "gpt_oss sliding": (lambda: tiny_family_target("gpt_oss"), {}),
    "qwen3_5 hybrid, bidirectional sliding drafter": (
        lambda: tiny_family_target("qwen3_5"),
        dict(layer_types=["sliding_attention"] * 2, sliding_window=3, causal=False)),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_greedy_spec_generate_with_dflash2_is_the_target_alone(name, fused):
    make_target, extra = CASES[name]
    target = make_target()
    drafter = random_dflash2(target, **extra)
    assert drafter.config.layer_symmetric_window == [bool(extra)] * 2
    for prompt in PROMPTS:
        base = target_generate(target, prompt, NEW_TOKENS).tokens
        out = spec_generate(target, drafter, prompt, NEW_TOKENS, fused=fused)
        assert out.tokens == base


def test_a_draft_vocabulary_gives_the_candidates():
    target = tiny_target("llama")
    drafter = random_dflash2(target)
    drafter.set_draft_vocab(list(range(0, 128, 2)))
    for prompt in PROMPTS:
        assert spec_generate(target, drafter, prompt, NEW_TOKENS).tokens == \
            target_generate(target, prompt, NEW_TOKENS).tokens


def test_dflash2_from_v1_decodes_as_the_v1_drafter():
    """Same tokens and the same accepted lengths, step by step (the drafts themselves are
    compared in python_tests/model/test_dflash2.py)."""
    target = tiny_target("llama")
    v1 = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    v2 = DFlashDrafter.dflash2_from(v1, **DFLASH2)
    accepted = []
    for prompt in PROMPTS:
        a, b = (spec_generate(target, d, prompt, NEW_TOKENS) for d in (v1, v2))
        assert a.tokens == b.tokens == target_generate(target, prompt, NEW_TOKENS).tokens
        assert a.acceptance_lengths == b.acceptance_lengths
        accepted += a.acceptance_lengths
    assert max(accepted) > 1  # drafts were accepted, not only rejected


def test_sampling_with_dflash2_follows_the_target_distribution():
    """At T = 1 the first k tokens follow the target's exact joint law: the sample-and-match
    verify is lossless for any proposal, the selector's included."""
    vocab, k, n = 3, 3, 200
    target = tiny_target("llama", vocab_size=vocab)
    with torch.no_grad():
        target.get_output_embeddings().weight.div_(8)  # spread-out logits: drafts accepted and rejected
    drafter = random_dflash2(target, selector_top_k=2)
    prompt = [1, 2, 0]
    probs = exact_first_tokens(target, prompt, k, vocab)
    g = torch.Generator().manual_seed(1234)
    runs = [spec_generate(target, drafter, prompt, k, temperature=1.0, generator=g) for _ in range(n)]
    assert any(a > 1 for r in runs for a in r.acceptance_lengths)  # drafts were accepted
    codes = torch.tensor([sum(t * vocab ** i for i, t in enumerate(r.tokens)) for r in runs])
    assert chi2_goodness_of_fit(codes, probs) > 1e-3


def test_the_assistant_refuses_dflash2():
    target = tiny_target("llama")
    with pytest.raises(NotImplementedError, match="DFlash2.*candidate selector"):
        DFlashAssistant(random_dflash2(target), target)


def test_the_proposer_drafts_the_plain_reference_path_from_the_anchor():
    """DFlashProposer's step on a real target (its features, embedding and LM head) equals the
    plain reference's forward and selector walk started at the block's anchor token."""
    from dflash_ext import DFlashProposer
    from dflash_ext.decode.runner import TargetRunner
    from python_tests.model.plain_reference import plain_draft_step, plain_select

    target = tiny_target("llama")
    drafter = random_dflash2(target, scale=0.5)
    drafter.config.output_multiplier = 0.02  # this target's logits are sharp: transitions count too
    prompt = PROMPTS[1]
    _, hidden, _ = TargetRunner(target, drafter.config.target_layer_ids)(torch.tensor([prompt]), None)
    proposer = DFlashProposer(drafter, target, capacity=64, fused=False)
    proposer.accept(hidden, slice(0, len(prompt)), torch.arange(len(prompt)))
    feats = torch.cat([hidden[l + 1][0] for l in drafter.config.target_layer_ids], -1)
    head = target.get_output_embeddings().weight
    for anchor in (3, 77):
        got = proposer.propose(anchor, len(prompt), 3).tolist()
        ids = torch.tensor([anchor] + [drafter.config.mask_token_id] * 3)
        with torch.no_grad():
            ref = plain_draft_step(drafter, drafter.config.to_json_dict(), feats, target.get_input_embeddings()(ids),
                                   len(prompt))
            assert got == plain_select(drafter, ref[1:], ref[1:] @ head.T, anchor)
            # the walk does start from the anchor: other first predecessors draft otherwise here
            assert any(got != plain_select(drafter, ref[1:], ref[1:] @ head.T, other) for other in range(0, 128, 16))
