"""DeepSpec's drafters through spec_generate (issue 64, item 2): DSparkProposer drafts what
dspark_draft drafts from the same context (greedy, and sampled with the same generator, q the
Sampling-processed distribution of the Markov-corrected logits), and decoding with it is
lossless for every variant (DeepSpec-DFlash without heads; vanilla, gated, rnn Markov heads)
on every target family we decode: fp32 greedy equals the target alone, and at T > 0 the first
tokens follow the target's exact law (chi-square), one prompt and a batch."""
import pytest
import torch

from dflash_ext import DFlashConfig, DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode.batch import batch_generate
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.draft.dspark import DSparkProposer, context_features, dspark_draft
from dflash_ext.draft.proposer import DFlashProposer, proposer_for
from dflash_ext.sampling import Draft, Sampling
from dflash_ext.testing.targets import FAMILIES, tiny_family_target
from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens
from python_tests.model.dspark_reference import deepspec_config

VARIANTS = ["deepspec_dflash", "vanilla", "gated", "rnn"]  # no head; the three Markov heads (and a confidence head)
BLOCK = 7  # the drafters' block_size: 7 draft slots, verify blocks of up to 8
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 52))]  # the second longer than the sliding families' window
NEW_TOKENS = 18
P_VALUE = 1e-3


def dspark_for(target, variant: str, seed: int = 0, layer_ids=(1, 2)) -> DFlashDrafter:
    """A random DeepSpec drafter of `variant` that fits `target` (its hidden size, vocabulary and
    layers; the last token id as the mask), every weight non-zero (norms near 1, embeddings of
    unit scale, heads large enough to move the drafts)."""
    t = target.config.get_text_config()
    d = deepspec_config(variant)
    d.update(vocab_size=t.vocab_size, mask_token_id=t.vocab_size - 1, num_target_layers=t.num_hidden_layers,
             target_layer_ids=list(layer_ids))
    assert d["hidden_size"] == t.hidden_size
    drafter = DFlashDrafter(DFlashConfig.from_json_dict(d))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            x = torch.randn(p.shape, generator=g)
            if "norm" in name:
                x = 1 + 0.2 * x
            elif name not in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
                x = (0.4 if name.startswith(("markov_head", "confidence_head")) else 0.15) * x
            p.copy_(x)
    return drafter.eval()


def proposer(drafter, target, sampling=None, batch_size=1):
    return DSparkProposer(drafter, target, capacity=256, sampling=sampling, batch_size=batch_size)


# ------------------------------------------------------------------ the drafts are dspark_draft's

def _prefill(target, drafter, prompt):
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    _, hidden, _ = runner(torch.tensor([prompt]), None)
    return hidden, context_features(hidden, drafter.config.target_layer_ids, 0, slice(0, len(prompt)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_sampled_drafts_are_dspark_drafts(variant):
    target = tiny_family_target("llama", num_hidden_layers=4)
    drafter = dspark_for(target, variant)
    prompt = list(range(3, 14))
    hidden, feats = _prefill(target, drafter, prompt)
    greedy = proposer(drafter, target)
    # the context given in two parts (a prefill, then an accepted run) is the same context
    greedy.accept(hidden, slice(0, 6), torch.arange(6))
    greedy.accept(hidden, slice(6, 11), torch.arange(6, 11))
    for S, anchor in ((11, 7), (11, 255)):
        ref = dspark_draft(drafter, feats[:S], anchor)
        assert ref.tokens.shape == (BLOCK,)
        assert greedy.propose(anchor, S, BLOCK).tolist() == ref.tokens.tolist()
        assert greedy.propose(anchor, S, 3).tolist() == ref.tokens[:3].tolist()  # the first n slots
    for setting in (dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=0.8, top_p=0.6)):
        sampling = Sampling(**setting, generator=torch.Generator().manual_seed(3))
        sampled = proposer(drafter, target, sampling)
        sampled.accept(hidden, slice(0, 11), torch.arange(11))
        for _ in range(3):
            seed = int(torch.randint(1 << 30, ()))
            sampling.generator.manual_seed(seed)
            out = sampled.propose(42, 11, BLOCK)
            assert isinstance(out, Draft) and out.probs.shape == (BLOCK, 256) and out.probs.dtype == torch.float32
            ref = dspark_draft(drafter, feats, 42, generator=torch.Generator().manual_seed(seed), **setting)
            assert out.tokens.tolist() == ref.tokens.tolist()
            torch.testing.assert_close(out.probs, ref.q)
            # q is the processed distribution of each slot's corrected logits, as the target's p is processed
            torch.testing.assert_close(out.probs, sampling.probs(ref.logits))
            if setting.get("top_k"):
                assert ((out.probs > 0).sum(-1) <= setting["top_k"]).all()
            assert (out.probs.gather(-1, out.tokens[:, None]) > 0).all()


def test_rows_drafted_together_are_each_rows_own_draft():
    target = tiny_family_target("llama", num_hidden_layers=4)
    drafter = dspark_for(target, "rnn")
    both = proposer(drafter, target, batch_size=2)
    contexts = []
    for seq, prompt in enumerate((list(range(3, 14)), [9, 8, 7, 6])):
        hidden, feats = _prefill(target, drafter, prompt)
        both.accept(hidden, slice(0, len(prompt)), torch.arange(len(prompt)), seq=seq)
        contexts.append(feats)
    rows = both.propose_rows([1, 0], [5, 77], [4, 11], BLOCK)
    assert rows.tolist() == [dspark_draft(drafter, contexts[1], 5).tokens.tolist(),
                             dspark_draft(drafter, contexts[0], 77).tokens.tolist()]


def test_layer_minus_one_reads_the_embedding_output():
    hidden = tuple(torch.full((2, 5, 3), float(i)) for i in range(4))  # hidden_states[i] holds i
    feats = context_features(hidden, [-1, 2], 1, slice(1, 4))
    assert feats.shape == (3, 6) and feats[:, :3].eq(0).all() and feats[:, 3:].eq(3).all()


# ------------------------------------------------------------------ lossless: greedy

def _variant_of(family: str) -> str:  # every family with one variant, every variant on two or more families
    return VARIANTS[FAMILIES.index(family) % len(VARIANTS)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_the_target_alone_on_every_family(family):
    target = tiny_family_target(family)
    drafter = dspark_for(target, _variant_of(family))
    p = proposer(drafter, target)  # one proposer for every generation: reset by the loop each time
    for prompt in PROMPTS:
        base = target_generate(target, prompt, NEW_TOKENS).tokens
        for block_size in (BLOCK + 1, 4):  # every slot of the block; the first 3
            assert spec_generate(target, p, prompt, NEW_TOKENS, block_size=block_size).tokens == base


def _bigram_drafter(target, continuation, anchor):
    """A vanilla DSpark drafter whose Markov head holds the target's greedy bigrams (the token it
    emitted after each token of `continuation`, which follows `anchor`) and whose LM head is zero:
    its drafts are the bigram walk, often accepted, with rejections where the target's greedy
    path is not a bigram chain."""
    vocab = target.config.vocab_size
    d = deepspec_config("vanilla")
    d.update(vocab_size=vocab, mask_token_id=vocab - 1, num_target_layers=target.config.num_hidden_layers,
             target_layer_ids=[1, 2], markov_rank=vocab, enable_confidence_head=False)
    d.pop("confidence_head_with_markov")
    drafter = DFlashDrafter(DFlashConfig.from_json_dict(d)).eval()
    nxt = {}
    for a, b in zip([anchor] + continuation, continuation):
        nxt.setdefault(a, b)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        w2 = torch.zeros(vocab, vocab)
        for a, b in nxt.items():
            w2[b, a] = 10.0
        drafter.markov_head.markov_w2.weight.copy_(w2)
    return drafter


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_accepted_runs_stay_lossless(family):
    """A drafter that is often right (the Markov walk carrying each drafted token into the next
    slot): long accepted runs, rejections mid-block, the output still the target's."""
    target = tiny_family_target(family, vocab_size=32)
    prompt = [5, 17, 3, 2, 9]
    first = target_generate(target, prompt, 1).tokens[0]
    base = target_generate(target, prompt, 40).tokens
    drafter = _bigram_drafter(target, base[1:], first)
    out = spec_generate(target, proposer(drafter, target), prompt, 40, block_size=BLOCK + 1)
    assert out.tokens == base
    assert max(out.acceptance_lengths) > 3


def test_a_batch_is_decoded_as_its_prompts_alone():
    """The loop's batch path for a DeepSpec DFlashDrafter (proposer_for with batch_size rows,
    batch_generate), and a list of DSparkProposers (one per prompt)."""
    target = tiny_family_target("qwen3")
    drafter = dspark_for(target, "gated")
    prompts = [PROMPTS[0], PROMPTS[1], [7, 7, 1]]
    alone = [target_generate(target, p, NEW_TOKENS).tokens for p in prompts]
    batched = proposer_for(drafter, target, 256, batch_size=len(prompts), sampling=Sampling())
    assert isinstance(batched, DSparkProposer)
    rows = [torch.tensor([p]) for p in prompts]
    out = batch_generate(target, batched, rows, NEW_TOKENS, BLOCK + 1, Sampling(), layer_ids=batched.layer_ids)
    assert [r.tokens for r in out] == alone
    listed = spec_generate(target, [proposer(drafter, target) for _ in prompts], prompts, NEW_TOKENS, block_size=5)
    assert [r.tokens for r in listed] == alone


def test_spec_generate_takes_a_deepspec_drafter():
    """spec_generate(target, <DeepSpec DFlashDrafter>): the loop's own proposer for it, one prompt and a batch."""
    target = tiny_family_target("qwen3")
    drafter = dspark_for(target, "rnn")
    prompts = [PROMPTS[0], PROMPTS[1]]
    alone = [target_generate(target, p, NEW_TOKENS).tokens for p in prompts]
    assert spec_generate(target, drafter, prompts[0], NEW_TOKENS).tokens == alone[0]
    assert spec_generate(target, drafter, prompts[0], NEW_TOKENS, block_size=BLOCK + 1).tokens == alone[0]
    assert [r.tokens for r in spec_generate(target, drafter, prompts, NEW_TOKENS)] == alone
    sampled = spec_generate(target, drafter, prompts[0], NEW_TOKENS, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == NEW_TOKENS


def test_spec_generate_drafts_every_slot_of_a_deepspec_block_by_default(monkeypatch):
    """Every slot of a DeepSpec block drafts: the default verify block is block_size + 1 (its
    BLOCK drafts and the target's token), not block_size as for a z-lab drafter (slot 0 the
    last token)."""
    target = tiny_family_target("qwen3")
    asked, real = [], DSparkProposer.propose_rows

    def spy(self, seqs, last_tokens, positions, n):
        asked.append(n)
        return real(self, seqs, last_tokens, positions, n)
    monkeypatch.setattr(DSparkProposer, "propose_rows", spy)
    out = spec_generate(target, dspark_for(target, "vanilla"), PROMPTS[0], 40)
    assert asked and asked[0] == BLOCK and max(out.acceptance_lengths) <= BLOCK + 1


# ------------------------------------------------------------------ lossless: T > 0

VOCAB, K = 3, 3
PROMPT = [1, 2, 0]


def _spread_target(family, seed=0):
    """A tiny target over a vocabulary of 3 with spread-out logits (drafts accepted and rejected)."""
    target = tiny_family_target(family, seed, num_hidden_layers=4, vocab_size=VOCAB, intermediate_size=64,
                                sharpen=3.0)
    return target


def _law_check(codes, probs, runs, least_likely=True):
    assert chi2_goodness_of_fit(codes, probs) > P_VALUE
    # the test has power: a fifth of the runs moved to the least likely sequence fails it (with few runs,
    # where that one is pooled with the other rare ones, a third of them moved to the most likely one)
    biased = codes.clone()
    if least_likely:
        biased[: runs // 5] = int(torch.where(probs > 0, probs, 2.0).argmin())
    else:
        biased[: runs // 3] = int(probs.argmax())
    assert chi2_goodness_of_fit(biased, probs) < P_VALUE


def _codes(token_lists):
    return torch.tensor([sum(t * VOCAB ** i for i, t in enumerate(tokens)) for tokens in token_lists])


SETTINGS = {"T=1": dict(temperature=1.0), "T=0.7 top-p 0.8": dict(temperature=0.7, top_p=0.8),
            "T=1 match": dict(temperature=1.0, verify="match")}
# every variant on a full-attention target; a Gated DeltaNet hybrid (its recurrent states rolled back after
# rejections); top-p processing of q and p; greedy drafts under the match rule
CASES = [("llama", v, "T=1") for v in VARIANTS] + [("qwen3", "rnn", "T=0.7 top-p 0.8"),
                                                  ("qwen3_5", "gated", "T=1"), ("llama", "vanilla", "T=1 match")]


@pytest.mark.parametrize("family,variant,setting", CASES, ids=["-".join(c) for c in CASES])
def test_sampling_follows_the_target_law(family, variant, setting, runs=200):
    """The first K tokens at T > 0, drafts sampled from the Markov-corrected q under the
    rejection rule (or greedy under "match"), follow the target's exact joint law."""
    target = _spread_target(family)
    drafter = dspark_for(target, variant, seed=1)
    sampling = SETTINGS[setting]
    law = {k: v for k, v in sampling.items() if k != "verify"}
    probs = exact_first_tokens(target, PROMPT, K, VOCAB, **law)
    g = torch.Generator().manual_seed(1234)
    p = proposer(drafter, target, Sampling(**sampling, generator=g))
    outs = [spec_generate(target, p, PROMPT, K, generator=g, block_size=4, **sampling) for _ in range(runs)]
    _law_check(_codes([r.tokens for r in outs]), probs, runs)
    lengths = [a for r in outs for a in r.acceptance_lengths]
    assert any(a > 1 for a in lengths) and any(a == 1 for a in lengths)  # drafts accepted and rejected


def test_sampling_in_a_batch_follows_the_target_law_in_every_row(runs=160):
    """A batch through the loop's DFlashDrafter path (proposer_for, batch_generate): each row
    verified under its own q from propose_rows, each row's first K tokens the target's law."""
    target = _spread_target("llama", seed=2)
    drafter = dspark_for(target, "rnn", seed=1)
    prompts = [[1, 2, 0], [2], [0, 0, 1, 2, 1]]
    g = torch.Generator().manual_seed(99)
    sampling = Sampling(temperature=1.0, generator=g)
    outs = []
    for _ in range(runs):
        batched = proposer_for(drafter, target, 64, batch_size=len(prompts), sampling=sampling)
        outs.append(batch_generate(target, batched, [torch.tensor([p]) for p in prompts], K, 4, sampling,
                                   layer_ids=batched.layer_ids))
    for row, prompt in enumerate(prompts):
        _law_check(_codes([o[row].tokens for o in outs]), exact_first_tokens(target, prompt, K, VOCAB), runs,
                   least_likely=False)
    assert any(a > 1 for o in outs for r in o for a in r.acceptance_lengths)


# ------------------------------------------------------------------ what is refused, by name

def test_what_is_not_supported_is_named():
    target = tiny_family_target("llama", num_hidden_layers=4)
    drafter = dspark_for(target, "vanilla")
    p = proposer(drafter, target)
    with pytest.raises(ValueError, match="block_size=7"):
        p.propose(1, 0, BLOCK + 1)
    with pytest.raises(RuntimeError, match="accept"):  # no context yet for a block at position 3
        p.propose(1, 3, 2)
    with pytest.raises(ValueError, match="capacity"):
        p.reset(1000)
    with pytest.raises(NotImplementedError, match="draft_window"):
        proposer_for(drafter, target, 64, draft_window=8)
    plain = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    assert isinstance(proposer_for(plain, target, 64), DFlashProposer)
    with pytest.raises(ValueError, match="DeepSpec"):
        DSparkProposer(plain, target, 64)
    other = tiny_family_target("llama", num_hidden_layers=4, vocab_size=64)
    with pytest.raises(ValueError, match="vocab size"):
        DSparkProposer(drafter, other, 64)
    # under the match rule at T > 0 the drafts are greedy (no q)
    match = proposer(drafter, target, Sampling(temperature=1.0, verify="match"))
    hidden, _ = _prefill(target, drafter, [3, 4])
    match.accept(hidden, slice(0, 2), torch.arange(2))
    assert isinstance(match.propose(5, 2, 3), torch.Tensor)
