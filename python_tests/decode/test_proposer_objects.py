"""What spec_generate takes as its drafter, checked at the way in (issue 67): a DFlashDrafter,
a proposer object (dflash_ext.draft.proposer.Proposer) for one prompt, a list of them for a
batch; a DFlashProposer given again is reset for the new generation (it drafts from the new
prompt, or says it is too small); what a proposer returns is checked once per generation
(its q's width and values) with an error naming the drafter, not a torch error in the verify."""
import pytest
import torch

from dflash_ext import DFlashDrafter, DFlashProposer, spec_generate, target_generate
from dflash_ext.draft.proposer import Proposer
from dflash_ext.testing.oracle import DistributionProposer, OracleProposer
from dflash_ext.testing.targets import tiny_target


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = tiny_target("qwen3")
    return target, DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)


def _refuse_forward(monkeypatch, target):
    monkeypatch.setattr(target, "forward", lambda *a, **k: 1 / 0)  # refused before the prefill


BAD_DRAFTERS = [
    (None, None, "drafter must be a DFlashDrafter or a proposer object .* got NoneType"),
    ("a drafter", None, "drafter must be a DFlashDrafter or a proposer object .* got str"),
    ("pair", None, "drafter: a list of proposers goes with a list of prompts"),
    ("pair", 2, r"drafter\[0\] is a DFlashDrafter: a batch of prompts takes one DFlashDrafter"),
    (None, 2, "drafter: a batch of prompts takes a DFlashDrafter or a list of proposer objects"),
    ("oracles", 3, r"drafter: a list of proposers needs one per prompt \(3\), got 2"),
    ("mixed", 2, r"drafter\[1\] must be a proposer object .* got int"),
]


@pytest.mark.parametrize("which,batch,match", BAD_DRAFTERS, ids=[m[:40] for *_, m in BAD_DRAFTERS])
def test_a_drafter_of_the_wrong_kind_is_an_error_naming_it(models, which, batch, match, monkeypatch):
    target, drafter = models
    _refuse_forward(monkeypatch, target)
    oracle = OracleProposer([1] * 8, 3, target.config.vocab_size)
    value = {"pair": [drafter, drafter], "oracles": [oracle, oracle], "mixed": [oracle, 5]}.get(which, which)
    ids = [1, 2, 3] if batch is None else [[1, 2, 3]] * batch
    with pytest.raises(ValueError, match=match):
        spec_generate(target, value, ids, 4, block_size=4)


def test_proposers_are_proposers():
    assert isinstance(OracleProposer([1], 1, 8), Proposer) and isinstance(DistributionProposer([1.0]), Proposer)
    assert not isinstance(DFlashDrafter, Proposer) and not isinstance(None, Proposer)


@pytest.mark.parametrize("block_size", [None, True, 0, "auto"])
def test_a_proposer_needs_an_int_block_size(models, block_size):
    target, _ = models
    oracle = OracleProposer([1] * 8, 3, target.config.vocab_size)
    with pytest.raises(ValueError, match="block_size must be an int >= 1 with proposer objects"):
        spec_generate(target, oracle, [1, 2, 3], 4, block_size=block_size)


def test_a_dflash_proposer_given_again_drafts_from_the_new_prompt(models):
    """Before: the second generation drafted from the first prompt's context (still lossless,
    but the drafts were another prompt's) or failed with "drafter context cache is full"."""
    target, drafter = models
    prompts, new = [[5, 6, 7, 8, 9], [11, 3, 2]], 12
    proposer = DFlashProposer(drafter, target, capacity=64)
    fresh = [spec_generate(target, drafter, p, new, block_size=4) for p in prompts]
    for p, want in zip(prompts, fresh):  # the same proposer each time: as if made anew
        res = spec_generate(target, proposer, p, new, block_size=4)
        assert res.tokens == want.tokens and res.acceptance_lengths == want.acceptance_lengths
    assert proposer.runtime.cache.lengths[0] <= len(prompts[-1]) + new  # only the last generation's context
    with pytest.raises(ValueError, match=r"drafter: this DFlashProposer holds 64 positions .* need 104"):
        spec_generate(target, proposer, list(range(1, 91)), 10, block_size=4)


def test_dflash_proposers_given_again_in_a_batch_are_reset(models):
    target, drafter = models
    prompts = [[5, 6, 7, 8, 9], [11, 3, 2]]
    proposers = [DFlashProposer(drafter, target, capacity=64) for _ in prompts]
    want = [r.tokens for r in spec_generate(target, drafter, prompts, 10, block_size=4)]
    for _ in range(2):
        assert [r.tokens for r in spec_generate(target, proposers, prompts, 10, block_size=4)] == want


class _Returns:
    """A proposer whose propose(last_token, position, n) returns `value(n)`."""

    def __init__(self, value):
        self.value = value

    def accept(self, hidden_states, rows, positions):
        pass

    def propose(self, last_token, position, n):
        return self.value(n)


def _sampled_with(q):
    """A proposer of drafts "sampled" with the distribution `q` [8, V] (the first n rows)."""
    return _Returns(lambda n: (torch.zeros(n, dtype=torch.long), q[:n]))


def _q(V, n=8, how="ok"):
    q = torch.full((n, V), 1.0 / V)
    if how == "negative":
        q[:, 0], q[:, 1] = -0.5 / V, 2.5 / V
    if how == "nan":
        q[1, 3] = float("nan")
    if how == "half":
        q = q / 2
    return q


@pytest.mark.parametrize("how,match", [
    ("wide", r"q \(the Draft's probs\) must be \[n, V\] = \[3, V\]"),
    ("negative", "q must be a distribution per draft .* values in \\[-"),
    ("nan", "q must be a distribution per draft"),
    ("half", "q must be a distribution per draft .* sums in \\[0.5, 0.5\\]"),
])
@pytest.mark.parametrize("batch", [False, True])
def test_a_proposers_bad_q_is_an_error_naming_the_drafter(models, how, match, batch):
    target, _ = models
    V = target.config.vocab_size
    q = _q(V + 5) if how == "wide" else _q(V, how=how)
    ids, drafter = ([[1, 2, 3], [4, 5]], [_sampled_with(q)] * 2) if batch else ([1, 2, 3], _sampled_with(q))
    # each proposer's q is checked as it returns it ([n, V]), in a batch too (before the rows are stacked)
    with pytest.raises(ValueError, match="drafter: a proposer's " + match.replace("= \\[3, V\\]", f"= \\[3, {V}\\]")):
        spec_generate(target, drafter, ids, 8, block_size=4, temperature=1.0, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("value,match", [
    (lambda n: [1] * n, "must return a tensor of n token ids or a Draft of them, got list"),
    (lambda n: torch.ones(n + 1, dtype=torch.long), r"got shape \[4\]"),
    (lambda n: torch.ones(n), "must be integer token ids, got torch.float32"),
    (lambda n: torch.full((n,), 10 ** 6), "drafted a token id outside the target's vocabulary"),
])
def test_a_proposers_bad_draft_is_an_error_naming_the_drafter(models, value, match):
    target, _ = models
    with pytest.raises(ValueError, match="drafter: a proposer.* " + match):
        spec_generate(target, _Returns(value), [1, 2, 3], 8, block_size=4)


def test_a_good_q_passes_and_stays_lossless_in_law(models):
    """The check reads q's values once per generation and lets a proper one through (the
    rejection rule's own law tests are test_rejection's)."""
    target, _ = models
    V = target.config.vocab_size
    res = spec_generate(target, DistributionProposer(torch.full((V,), 1.0 / V), torch.Generator().manual_seed(1)),
                        [1, 2, 3], 12, block_size=4, temperature=1.0, generator=torch.Generator().manual_seed(2))
    assert len(res.tokens) == 12
    greedy = target_generate(target, [1, 2, 3], 12).tokens
    oracle = OracleProposer(greedy, 3, V)
    assert spec_generate(target, oracle, [1, 2, 3], 12, block_size=4).tokens == greedy
