"""The rejection verify rule (dflash_ext/decode/verify.py) at T > 0: its law, by exact
enumeration on small p and q; spec_generate's first tokens against the target's exact processed
law (chi-square) with sampled drafts of v1 and DFlash2 drafters, and with deliberately bad
proposals; T = 0 unchanged whatever the rule; a seeded run reproducible; the budget and stop
tokens inside an accepted block."""
import itertools

import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode.verify import rejection_law, rejection_sample, verify
from dflash_ext.sampling import Sampling, process_logits
from dflash_ext.testing.oracle import DistributionProposer, OracleProposer
from dflash_ext.testing.targets import tiny_family_target, tiny_target
from python_tests.decode.test_dflash2_decoding import random_dflash2
from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens

# A false failure of a chi-square test below is rarer than this (each runs with a fixed seed).
P_VALUE = 1e-4


# ------------------------------------------------------------------ the rule's law, exactly

def _random_law(g, V, zeros=0):
    """A random distribution over V tokens with `zeros` of them at probability 0."""
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 3 + 1e-3
    p[torch.randperm(V, generator=g)[:zeros]] = 0
    return p / p.sum()


def _emitted_law(p_of, q_of, n, V):
    """The law of the first n + 1 tokens a step of the rule emits, then (after a rejection) the
    target's own chain: P(sequence) for every sequence of V^(n+1), enumerated over every draft
    (weighted by q) with the rule's own acceptance and residual (:func:`rejection_law`).
    `p_of(prefix)`, `q_of(prefix)`: the target's and the drafter's law after a prefix."""
    law = torch.zeros((V,) * (n + 1), dtype=torch.float64)

    def chain(prefix, weight):  # the target's own tokens after the step
        if len(prefix) == n + 1:
            law[tuple(prefix)] += weight
            return
        for t, pt in enumerate(p_of(prefix).tolist()):
            if pt:
                chain(prefix + [t], weight * pt)

    for draft in itertools.product(range(V), repeat=n):
        q = torch.stack([q_of(list(draft[:k])) for k in range(n)])
        weight = float(torch.prod(q[torch.arange(n), list(draft)]))
        if weight == 0:
            continue
        p = torch.stack([p_of(list(draft[:k])) for k in range(n + 1)])
        accept, residual = rejection_law(torch.tensor(draft), q.float(), p.float())
        accept, residual = accept.double(), residual.double()
        reach = weight
        for k in range(n + 1):
            stop = 1 - float(accept[k]) if k < n else 1.0
            r = residual[k] / residual[k].sum()
            for t in range(V):
                if r[t]:
                    chain(list(draft[:k]) + [t], reach * stop * float(r[t]))
            if k < n:
                reach *= float(accept[k])
    return law


def _target_law(p_of, n, V):
    law = torch.zeros((V,) * (n + 1), dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=n + 1):
        law[seq] = float(torch.prod(torch.stack([p_of(list(seq[:k]))[seq[k]] for k in range(n + 1)])))
    return law


def _laws(seed, V, p_zeros=0, q_kind="random"):
    """(p_of, q_of): random target and drafter laws per prefix; q: random, one-hot, uniform,
    equal to p (an all-zero residual) or a point mass on a token p gives 0."""
    g = torch.Generator().manual_seed(seed)
    table = {}

    def p_of(prefix):
        key = ("p", tuple(prefix))
        if key not in table:
            table[key] = _random_law(g, V, p_zeros)
        return table[key]

    def q_of(prefix):
        key = ("q", tuple(prefix))
        if key not in table:
            if q_kind == "one-hot":
                table[key] = torch.nn.functional.one_hot(torch.randint(V, (), generator=g), V).double()
            elif q_kind == "uniform":
                table[key] = torch.full((V,), 1.0 / V, dtype=torch.float64)
            elif q_kind == "p":
                table[key] = p_of(prefix).clone()
            elif q_kind == "outside p":
                table[key] = torch.nn.functional.one_hot((p_of(prefix) == 0).nonzero()[0, 0], V).double()
            else:
                table[key] = _random_law(g, V, zeros=1)
        return table[key]

    return p_of, q_of


@pytest.mark.parametrize("q_kind,p_zeros", [("random", 0), ("random", 1), ("one-hot", 0), ("one-hot", 2),
                                            ("uniform", 1), ("p", 0), ("p", 1), ("outside p", 2)])
@pytest.mark.parametrize("n", [1, 2])
def test_the_rule_emits_exactly_the_target_law(q_kind, p_zeros, n):
    """Enumerated over every draft: what a step emits, continued by the target's own chain,
    is the target's law (p with zeros: drafts outside its top-k / top-p, always rejected)."""
    V = 4
    for seed in range(3):
        p_of, q_of = _laws(seed, V, p_zeros, q_kind)
        torch.testing.assert_close(_emitted_law(p_of, q_of, n, V), _target_law(p_of, n, V), atol=1e-6, rtol=0)


def test_acceptance_and_residual_on_edge_cases():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.2, 0.7]])
    # q = p: always accepted, the residual zero everywhere -> p
    accept, residual = rejection_law(torch.tensor([1, 0]), p[:2].clone(), p)
    assert accept.tolist() == [1.0, 1.0]
    torch.testing.assert_close(residual[:2], p[:2])  # all-zero residual: p itself
    torch.testing.assert_close(residual[2], p[2])  # the bonus position: p
    accept, residual = rejection_law(torch.tensor([2, 2]), None, p)  # certain drafts (one-hot q)
    assert accept.tolist() == [0.0, 0.5]  # p(x) = 0: never accepted; else p(x)
    torch.testing.assert_close(residual[1], torch.tensor([0.2, 0.3, 0.0]))  # max(0, p - one-hot)
    q = torch.tensor([[0.0, 0.0, 1.0], [0.25, 0.25, 0.5]])
    accept, _ = rejection_law(torch.tensor([2, 1]), q, p)
    torch.testing.assert_close(accept, torch.tensor([0.0, 1.0]))


def test_the_sampler_draws_the_rule_law():
    """rejection_sample's (accepted count, token), drawn batched in one call, follow the law of
    rejection_law (chi-square over the (a, token) cells)."""
    V, n, rows = 4, 2, 40000
    p_of, q_of = _laws(5, V)
    draft = torch.tensor([1, 3])
    q = torch.stack([q_of([]), q_of([1])]).float()
    p = torch.stack([p_of([]), p_of([1]), p_of([1, 3])]).float()
    accept, residual = (t.double() for t in rejection_law(draft, q, p))
    probs = torch.zeros(n + 1, V, dtype=torch.float64)
    reach = 1.0
    for a in range(n + 1):
        stop = 1 - accept[a] if a < n else 1.0
        probs[a] = reach * stop * residual[a] / residual[a].sum()
        if a < n:
            reach *= float(accept[a])
    g = torch.Generator().manual_seed(0)
    accepted, token = rejection_sample(draft.expand(rows, n), q.expand(rows, n, V), p.expand(rows, n + 1, V), g)
    assert chi2_goodness_of_fit(accepted * V + token, probs.flatten()) > P_VALUE


# ------------------------------------------------------------------ spec_generate against the target's law

VOCAB, K, RUNS = 3, 3, 300
PROMPT = [1, 2, 0]


def _spread_target(family, seed=0, layers=2):
    """A tiny target over a vocabulary of 3 with spread-out logits (drafts accepted and rejected)."""
    target = tiny_family_target(family, seed, num_hidden_layers=layers, vocab_size=VOCAB, intermediate_size=64,
                                sharpen=1.0)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    return target


def _codes(runs):
    return torch.tensor([sum(t * VOCAB ** i for i, t in enumerate(r.tokens)) for r in runs])


def _check_law(target, make_drafter, sampling, runs=RUNS, block_size=None):
    probs = exact_first_tokens(target, PROMPT, K, VOCAB, **sampling)
    g = torch.Generator().manual_seed(1234)
    outs = [spec_generate(target, make_drafter(g), PROMPT, K, generator=g, block_size=block_size, **sampling)
            for _ in range(runs)]
    codes = _codes(outs)
    assert chi2_goodness_of_fit(codes, probs) > P_VALUE
    # the test has power: a fifth of the runs moved to the least likely possible sequence fails it
    biased = codes.clone()
    biased[: runs // 5] = int(torch.where(probs > 0, probs, 2.0).argmin())
    assert chi2_goodness_of_fit(biased, probs) < P_VALUE
    return outs


SAMPLING = {"T=1": dict(temperature=1.0), "T=0.7 top-k 2": dict(temperature=0.7, top_k=2),
            "T=0.7 top-p 0.8": dict(temperature=0.7, top_p=0.8)}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampled_drafts_follow_the_target_law(family, sampling):
    target = _spread_target(family)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    outs = _check_law(target, lambda g: drafter, SAMPLING[sampling])
    assert any(a > 1 for r in outs for a in r.acceptance_lengths)  # drafts were accepted
    assert any(a == 1 for r in outs for a in r.acceptance_lengths)  # and rejected


@pytest.mark.parametrize("sampling", ["T=1", "T=0.7 top-p 0.8"])
def test_dflash2_sampled_walk_follows_the_target_law(sampling):
    target = _spread_target("llama", layers=4)  # the drafter reads 2 of its layers
    drafter = random_dflash2(target, selector_top_k=2)
    outs = _check_law(target, lambda g: drafter, SAMPLING[sampling])
    assert any(a > 1 for r in outs for a in r.acceptance_lengths)


@pytest.mark.parametrize("proposal", ["uniform", "point mass off the support", "oracle (one-hot q)"])
def test_bad_proposals_still_follow_the_target_law(proposal):
    """Uniform q (at T = 1 with top-k 2: a third of the drafts outside the target's support);
    q a point mass on a token the target gives probability 0 everywhere (always rejected); a
    proposer handing plain tokens (q one-hot)."""
    target = _spread_target("llama")
    sampling = dict(temperature=1.0, top_k=2)
    if proposal == "uniform":
        make = lambda g: DistributionProposer(torch.full((VOCAB,), 1.0 / VOCAB), generator=g)
    elif proposal == "oracle (one-hot q)":
        make = lambda g: OracleProposer([0, 1, 2, 1, 0, 2], len(PROMPT), VOCAB)
    else:
        sampling = dict(temperature=1.0)
        head = target.get_output_embeddings()
        biased = torch.nn.Linear(head.in_features, VOCAB, bias=True)
        with torch.no_grad():  # the last token's logit far below: probability 0 in float32
            biased.weight.copy_(head.weight)
            biased.bias.copy_(torch.tensor([0.0] * (VOCAB - 1) + [-1e4]))
        target.set_output_embeddings(biased)
        make = lambda g: DistributionProposer(torch.nn.functional.one_hot(torch.tensor(VOCAB - 1), VOCAB), generator=g)
    outs = _check_law(target, make, sampling, block_size=3)
    if proposal == "point mass off the support":
        assert all(a == 1 for r in outs for a in r.acceptance_lengths)


# ------------------------------------------------------------------ T = 0, seeds, the emitter

def test_the_rule_has_no_effect_at_temperature_zero():
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    prompt = [5, 17, 33, 2, 9]
    base = target_generate(target, prompt, 24).tokens
    a, b = (spec_generate(target, drafter, prompt, 24, verify=rule) for rule in ("rejection", "match"))
    assert a.tokens == b.tokens == base
    assert a.acceptance_lengths == b.acceptance_lengths


def test_a_seeded_run_is_reproducible():
    target = _spread_target("qwen3")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    for rule in ("rejection", "match"):
        runs = [spec_generate(target, drafter, PROMPT, 40, temperature=0.8, top_k=2, verify=rule,
                              generator=torch.Generator().manual_seed(7)) for _ in range(2)]
        assert runs[0].tokens == runs[1].tokens and runs[0].acceptance_lengths == runs[1].acceptance_lengths


def test_the_budget_and_a_stop_token_cut_an_accepted_block():
    """A proposer that drafts the target's greedy continuation with certainty at a sharp target:
    whole blocks are accepted, and the budget or a stop token inside one ends the output there."""
    target = tiny_target("llama")
    prompt = [5, 17, 33, 2, 9]
    greedy = target_generate(target, prompt, 30).tokens
    sampling = dict(temperature=1e-3)  # sampled, but nearly greedy: the drafts are accepted
    out = spec_generate(target, OracleProposer(greedy, len(prompt), 128), prompt, 10, block_size=8, **sampling)
    assert out.tokens == greedy[:10] and max(out.acceptance_lengths) > 2
    stop = greedy[12]
    out = spec_generate(target, OracleProposer(greedy, len(prompt), 128), prompt, 30, block_size=8,
                        stop_token_ids=[stop], **sampling)
    assert out.tokens == greedy[:greedy.index(stop) + 1]


def test_verify_names_a_bad_rule():
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="verify must be one of 'rejection', 'match'"):
        spec_generate(target, drafter, [1, 2], 4, temperature=1.0, verify="accept-all")
    with pytest.raises(ValueError, match="verify must be one of"):
        verify(torch.tensor([1]), torch.zeros(2, 4), Sampling(temperature=1.0, verify="typo"))


def test_sampled_drafts_come_from_the_processed_distribution():
    """The drafter's q is its LM head's logits processed as the target's (temperature, top-k):
    zero outside its top-k and outside the draft vocabulary, summing to 1."""
    from dflash_ext import DFlashProposer
    from dflash_ext.decode.runner import TargetRunner

    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.set_draft_vocab(list(range(0, 128, 2)))
    prompt = [5, 17, 33, 2, 9]
    _, hidden, _ = TargetRunner(target, drafter.config.target_layer_ids)(torch.tensor([prompt]), None)
    g = torch.Generator().manual_seed(0)
    proposer = DFlashProposer(drafter, target, capacity=64, sampling=Sampling(0.7, top_k=5, generator=g))
    proposer.accept(hidden, slice(0, len(prompt)), torch.arange(len(prompt)))
    tokens, q = proposer.propose(3, len(prompt), 3)
    assert q.shape == (3, 128)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert ((q > 0).sum(-1) <= 5).all() and (q[:, 1::2] == 0).all()
    assert (q[torch.arange(3), tokens] > 0).all()
    greedy = DFlashProposer(drafter, target, capacity=64)
    greedy.accept(hidden, slice(0, len(prompt)), torch.arange(len(prompt)))
    assert torch.equal(q.argmax(-1), greedy.propose(3, len(prompt), 3))  # the same logits, processed
    logits = process_logits(torch.randn(2, 9), 0.7, top_k=5)
    assert ((logits > float("-inf")).sum(-1) == 5).all()
