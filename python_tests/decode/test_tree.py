"""Tree verification (dflash_ext/decode/tree*.py, issue 66): the tree build against a plain
best-first reference (a heap), ties included; the tree's structure; the verify pass's inputs;
the cache after a step equal to the target's own over the accepted tokens; greedy tree
decoding equal to the target's greedy output on every family that takes a 4-D mask, with a
random drafter and with an oracle whose right token is often not its first choice; the
refusal of the others; at T > 0 the first tokens' law against the target's (chi-square)."""
import heapq

import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode.rollback import CacheRollback
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.decode.step import DecodeState, OneRow
from dflash_ext.decode.tree import tree_step
from dflash_ext.decode.tree_build import build_tree, tree_size
from dflash_ext.decode.tree_verify import check_tree_target, tree_inputs, verify_tree
from dflash_ext.draft.proposer import DFlashProposer
from dflash_ext.sampling import DraftDistribution, Sampling
from dflash_ext.testing.targets import CROPPABLE, HYBRID, SLIDING, tiny_family_target, tiny_target
from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens


def tree_generate(target, drafter, prompt, max_new_tokens, depth=None, budget=32, **kwargs):
    """spec_generate with trees of `depth` slots (None: the drafter's block - 1) and `budget` nodes."""
    return spec_generate(target, drafter, prompt, max_new_tokens, block_size=None if depth is None else depth + 1,
                         tree_budget=budget, **kwargs)


# ------------------------------------------------------------------ the build against a reference

def reference_tree(logprobs, budget):
    """The best-first tree by the definition (tree_build's module notes), with a heap: each
    slot's candidates sorted by (log-prob desc, column asc), the first min(budget, V); pop the
    best node by (score desc, depth asc, ranks lexicographically asc), push its children.
    Returns (tokens, parents, depths, scores) as lists, in pop order."""
    S, V = logprobs.shape
    lp = logprobs.tolist()
    K = min(budget, V)
    cands = [sorted(range(V), key=lambda c: (-lp[s][c], c))[:K] for s in range(S)]
    heap = [(-lp[0][cands[0][r]], 1, (r,), -1) for r in range(K)] if S else []
    heapq.heapify(heap)
    tokens, parents, depths, scores = [], [], [], []
    while heap and len(tokens) < budget:
        neg, d, ranks, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(cands[d - 1][ranks[-1]]), parents.append(parent), depths.append(d), scores.append(-neg)
        if d < S:
            for r in range(K):
                heapq.heappush(heap, (neg - lp[d][cands[d][r]], d + 1, ranks + (r,), node))
    return tokens, parents, depths, scores


def _random_logprobs(g, S, V, kind):
    x = torch.randn(S, V, generator=g)
    if kind == "ties":  # coarse values: equal log-probs, equal path scores across depths and parents
        return ((x * 2).round() / 2 - 3).clamp_max(0)
    if kind == "zeros":  # a drafter's draft vocabulary: most columns at probability 0
        x[torch.rand(S, V, generator=g) < 0.5] = float("-inf")
        x[:, 0] = 0.0
    return x.log_softmax(-1)


@pytest.mark.parametrize("kind", ["random", "ties", "zeros"])
def test_build_equals_the_reference(kind):
    g = torch.Generator().manual_seed({"random": 0, "ties": 1, "zeros": 2}[kind])
    for _ in range(150):
        S, V, N = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 7), (1, 10), (1, 48)))
        lp = _random_logprobs(g, S, V, kind)
        tree = build_tree(lp, N)
        want = reference_tree(lp, N)
        assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), tree.scores.tolist()) == want, \
            (S, V, N)
        assert len(want[0]) == tree_size(S, V, N)


def test_build_at_decoding_sizes_and_a_draft_vocabulary():
    g = torch.Generator().manual_seed(3)
    for S, V, N in ((15, 500, 64), (7, 300, 100), (3, 2, 64)):
        lp = (torch.randn(S, V, generator=g) * 3).log_softmax(-1)
        vocab = torch.randperm(4 * V, generator=g)[:V].sort().values  # sorted target ids, as a draft vocabulary
        tree = build_tree(lp, N, vocab)
        tokens, parents, depths, scores = reference_tree(lp, N)
        assert tree.tokens.tolist() == vocab[tokens].tolist()
        assert (tree.parents.tolist(), tree.depths.tolist(), tree.scores.tolist()) == (parents, depths, scores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device build")
def test_the_device_build_reads_nothing_on_the_host():
    """On CUDA the build syncs nothing (torch's sync debug mode raises on a host read) and
    equals the CPU build."""
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(15, 4000, generator=g) * 3).log_softmax(-1)
    vocab = torch.arange(4000) * 3
    want = build_tree(lp, 64, vocab)
    lp_cuda, vocab_cuda = lp.cuda(), vocab.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = build_tree(lp_cuda, 64, vocab_cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def test_tree_structure():
    g = torch.Generator().manual_seed(4)
    for S, V, N in ((5, 7, 40), (4, 3, 30), (6, 50, 64), (1, 9, 5)):
        lp = _random_logprobs(g, S, V, "random")
        t = build_tree(lp, N)
        n = t.tokens.shape[0]
        parents, depths, anc = t.parents.tolist(), t.depths.tolist(), t.ancestors
        for i in range(n):
            p = parents[i]
            assert p < i  # topological: a parent first
            assert depths[i] == (1 if p < 0 else depths[p] + 1)
            # the score is the path's log-prob; the mask row is the node and its ancestors
            path, at = [], i
            while at >= 0:
                path.append(at)
                at = parents[at]
            assert anc[i].nonzero().flatten().tolist() == sorted(path)
            want = sum(float(lp[depths[j] - 1, t.tokens[j]]) for j in reversed(path))
            assert abs(float(t.scores[i]) - want) < 1e-9
        siblings = {}
        for i in range(n):  # distinct tokens among siblings: the rule descends into one child
            assert (parents[i], int(t.tokens[i])) not in siblings
            siblings[(parents[i], int(t.tokens[i]))] = i
        assert t.scores.tolist() == sorted(t.scores.tolist(), reverse=True)  # best first


def test_verify_inputs():
    lp = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.7, -3.0]]).log_softmax(-1)
    tree = build_tree(lp, 4)
    ids, positions, mask = tree_inputs(tree, last=7, pos=10, cached=10, dtype=torch.float32)
    n = tree.tokens.shape[0]
    assert ids.tolist() == [[7] + tree.tokens.tolist()]
    assert positions.tolist() == [[10] + (10 + tree.depths).tolist()]
    assert mask.shape == (1, 1, n + 1, 10 + n + 1)
    seen = (mask[0, 0] == 0)
    assert seen[:, :11].all()  # the cache and the root: seen by every row
    assert not seen[0, 11:].any()
    assert torch.equal(seen[1:, 11:], tree.ancestors)


def test_the_rule_walks_the_target_tokens():
    """Root's children: tokens 5 and 6; node 0 (token 5) has child token 8. The target's argmax
    per row (root, nodes...) decides the path."""
    from dflash_ext.decode.tree_build import DraftTree, ancestor_mask

    parents = torch.tensor([-1, -1, 0])
    tree = DraftTree(torch.tensor([5, 6, 8]), parents, torch.tensor([1, 1, 2]), ancestor_mask(parents, 2),
                     torch.zeros(3, dtype=torch.float64))

    def logits(*argmax):
        return torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()

    greedy = Sampling()
    assert verify_tree(tree, logits(6, 0, 3, 0), greedy) == ([1], [6, 3])
    assert verify_tree(tree, logits(5, 8, 0, 4), greedy) == ([0, 2], [5, 8, 4])
    assert verify_tree(tree, logits(5, 9, 0, 0), greedy) == ([0], [5, 9])
    assert verify_tree(tree, logits(2, 8, 6, 1), greedy) == ([], [2])


# ------------------------------------------------------------------ decoding

PROMPT = [5, 17, 42, 9, 3, 11]
NEW = 24


class OracleDistribution:
    """A tree proposer that knows the continuation: each slot's logits are noise with the right
    token raised, to first place or (every `second_every`-th slot) second place behind a wrong
    token: a chain of first choices fails there, a tree with two children there does not."""

    def __init__(self, continuation, n_prompt, vocab_size, second_every=3, seed=0):
        self.cont, self.n_prompt, self.V, self.second_every = list(continuation), n_prompt, vocab_size, second_every
        self.g = torch.Generator().manual_seed(seed)
        self.slots = 0

    def accept(self, hidden_states, rows, positions):
        pass

    def propose_distribution(self, last_token, position, n):
        logits = torch.randn(n, self.V, generator=self.g)
        start = position + 1 - self.n_prompt
        for s in range(n):
            if start + s < len(self.cont):
                right = self.cont[start + s]
                self.slots += 1
                second = self.second_every and self.slots % self.second_every == 0
                logits[s, right] = 8.0
                if second:
                    logits[s, (right + 1) % self.V] = 9.0
        return DraftDistribution(logits)


@pytest.mark.parametrize("family", CROPPABLE + ("glm4_moe", "minimax_m2", "llama eager"))
def test_greedy_tree_decoding_is_the_target_greedy_output(family):
    target = tiny_target(family.split()[0])
    if family.endswith("eager"):  # eager attention adds the mask as SDPA does
        target.set_attn_implementation("eager")
    want = target_generate(target, PROMPT, NEW).tokens
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    assert tree_generate(target, drafter, PROMPT, NEW, budget=8).tokens == want
    oracle = OracleDistribution(want, len(PROMPT), target.config.vocab_size)
    out = tree_generate(target, oracle, PROMPT, NEW, depth=5, budget=12)
    assert out.tokens == want
    assert max(out.acceptance_lengths) > 3  # deep paths through second choices were accepted


def test_a_chain_budget_and_stop_tokens():
    """budget 1: a chain of one draft; depth > budget; a stop token inside an accepted path."""
    target = tiny_target("llama")
    want = target_generate(target, PROMPT, NEW).tokens
    for depth, budget in ((3, 1), (6, 4), (1, 16)):
        oracle = OracleDistribution(want, len(PROMPT), target.config.vocab_size, second_every=0)
        assert tree_generate(target, oracle, PROMPT, NEW, depth=depth, budget=budget).tokens == want
    stop = want[7]
    oracle = OracleDistribution(want, len(PROMPT), target.config.vocab_size)
    out = tree_generate(target, oracle, PROMPT, NEW, depth=5, budget=12, stop_token_ids=[stop])
    assert out.tokens == want[:want.index(stop) + 1]


@torch.no_grad()
def test_the_cache_after_a_step_is_the_target_own():
    """After tree steps whose paths go through second choices (the path's K/V moved), the
    cache equals a prefill of the accepted tokens, and the drafter got the path's rows."""
    target = tiny_target("qwen3")
    want = target_generate(target, PROMPT, NEW).tokens
    oracle = OracleDistribution(want, len(PROMPT), target.config.vocab_size, second_every=2)
    got_rows = []
    oracle.accept = lambda hidden, rows, positions: got_rows.append((rows.tolist(), positions.tolist()))
    runner = TargetRunner(target)
    logits, _, cache = runner(torch.tensor([PROMPT]), None, last_logits_only=True)
    state = DecodeState(OneRow(cache, CacheRollback(cache, 32)), [0], [int(logits[0, -1].argmax())], [len(PROMPT)])
    tokens = list(state.lasts)
    for _ in range(3):
        tokens += tree_step(runner, oracle, state, 4, 10, Sampling())
    assert tokens == want[:len(tokens)]
    assert any(rows != list(range(len(rows))) for rows, _ in got_rows)  # a path not in the first columns
    pos = state.positions[0]
    assert [p for _, positions in got_rows for p in positions] == list(range(len(PROMPT), pos))
    _, _, fresh = runner(torch.tensor([PROMPT + tokens[:-1]]), None, hidden_states=False)
    assert cache.get_seq_length() == fresh.get_seq_length() == pos
    for mine, theirs in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_the_proposer_distribution_is_its_draft_pass():
    """DFlashProposer.propose_distribution's slots are its own draft pass: their argmax is its greedy draft."""
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    _, hidden, _ = runner(torch.tensor([PROMPT]), None)
    proposer = DFlashProposer(drafter, target, capacity=64)
    proposer.accept(hidden, slice(0, len(PROMPT)), torch.arange(len(PROMPT)))
    dist = proposer.propose_distribution(7, len(PROMPT), 3)
    assert dist.logits.shape[0] == 3
    assert dist.logits.argmax(-1).tolist() == proposer.propose(7, len(PROMPT), 3).tolist()


@pytest.mark.parametrize("family", SLIDING + HYBRID + ("deepseek_v32", "kimi_linear", "minimax"))
def test_families_without_a_tree_mask_are_refused(family):
    target = tiny_family_target(family, num_hidden_layers=2)
    with pytest.raises(NotImplementedError, match=family):
        check_tree_target(target)
    if family in SLIDING + HYBRID:
        drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
        with pytest.raises(NotImplementedError, match=family):
            tree_generate(target, drafter, PROMPT, 4)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(tree_budget=-1), ValueError, "tree_budget must be an int >= 1"),
    (dict(tree_budget=True), ValueError, "tree_budget must be an int >= 1"),
    (dict(tree_budget=2.0), ValueError, "tree_budget must be an int >= 1"),
    (dict(tree_budget=4, verify="rejection", temperature=1.0), ValueError, "verify='rejection' with tree_budget"),
    (dict(tree_budget=4, static_cache=True), ValueError, "static_cache=True with tree_budget"),
    (dict(tree_budget=4, block_size="auto"), ValueError, "block_size='auto' with tree_budget"),
])
def test_spec_generate_names_what_a_tree_excludes(kwargs, error, match):
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    with pytest.raises(error, match=match):
        spec_generate(target, drafter, PROMPT, 4, **kwargs)


def test_spec_generate_tree_refuses_a_batch_and_walking_drafters():
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    with pytest.raises(ValueError, match="tree_budget: one prompt"):
        spec_generate(target, drafter, [PROMPT, PROMPT[:3]], 4, tree_budget=4)
    assert spec_generate(target, drafter, [PROMPT], 6, tree_budget=4)[0].tokens == \
        target_generate(target, PROMPT, 6).tokens  # a list of one is one prompt
    dflash2 = DFlashDrafter.dflash2_from(drafter, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                         selector_top_k=4)
    with pytest.raises(NotImplementedError, match="DFlash2"):
        spec_generate(target, dflash2, PROMPT, 4, tree_budget=4)
    with pytest.raises(ValueError, match="tree proposer object"):
        spec_generate(target, object(), PROMPT, 4, block_size=3, tree_budget=4)
    assert spec_generate(target, drafter, PROMPT, 6, tree_budget=0).tokens == target_generate(target, PROMPT, 6).tokens


def test_an_attention_without_a_custom_mask_is_refused():
    target = tiny_target("llama")
    target.config._attn_implementation = "flex_attention"  # takes a BlockMask, not a tensor
    with pytest.raises(NotImplementedError, match="flex_attention"):
        check_tree_target(target)


# ------------------------------------------------------------------ the law at T > 0

VOCAB, K, RUNS = 3, 4, 400
SMALL_PROMPT = [1, 2, 0]
P_VALUE = 1e-4
SAMPLING = {"T=1": dict(temperature=1.0), "T=0.7 top-k 2": dict(temperature=0.7, top_k=2)}


@pytest.mark.parametrize("sampling", SAMPLING)
def test_sampled_tree_decoding_follows_the_target_law(sampling):
    target = tiny_family_target("llama", 0, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=64, sharpen=3.0)
    args = SAMPLING[sampling]
    probs = exact_first_tokens(target, SMALL_PROMPT, K, VOCAB, **args)
    greedy = target_generate(target, SMALL_PROMPT, K).tokens
    g = torch.Generator().manual_seed(1234)
    outs = []
    for i in range(RUNS):
        oracle = OracleDistribution(greedy, len(SMALL_PROMPT), VOCAB, seed=i)
        outs.append(tree_generate(target, oracle, SMALL_PROMPT, K, depth=2, budget=2, generator=g, **args))
    assert any(a > 1 for r in outs for a in r.acceptance_lengths)  # paths accepted
    assert any(a == 1 for r in outs for a in r.acceptance_lengths)  # and not
    codes = torch.tensor([sum(t * VOCAB ** i for i, t in enumerate(r.tokens)) for r in outs])
    assert chi2_goodness_of_fit(codes, probs) > P_VALUE
    biased = codes.clone()  # the test has power: a fifth moved to the most likely sequence fails it
    biased[: RUNS // 5] = int(probs.argmax())
    assert chi2_goodness_of_fit(biased, probs) < P_VALUE


def test_a_seeded_sampled_run_is_reproducible():
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1)
    runs = [tree_generate(target, drafter, PROMPT, 12, budget=6, temperature=0.8, top_p=0.9,
                          generator=torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]
