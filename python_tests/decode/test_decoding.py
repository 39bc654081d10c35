"""spec_generate is lossless: greedy output equals the target's own greedy output, and
at T > 0 the output follows the target's distribution."""
import math

import pytest
import torch
import torch.nn.functional as F

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.sampling import sample_token
from dflash_ext.testing.oracle import OracleProposer
from dflash_ext.testing.targets import tiny_target

PROMPTS = [[5, 17, 33, 2, 9], [100, 3], list(range(40, 61))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_lossless_random_drafter(target, block_size):
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=block_size)
    for prompt in PROMPTS:
        base = target_generate(target, prompt, 24)
        spec = spec_generate(target, drafter, prompt, 24)
        assert spec.tokens == base.tokens
        assert sum(spec.acceptance_lengths) + 1 == len(spec.tokens)  # +1: the prefill's token


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_greedy_lossless_oracle_drafter(target, block_size, wrong_every):
    for prompt in PROMPTS:
        base = target_generate(target, prompt, 40)
        oracle = OracleProposer(base.tokens, len(prompt), target.config.vocab_size, wrong_every)
        spec = spec_generate(target, oracle, prompt, 40, block_size=block_size)
        assert spec.tokens == base.tokens
        if wrong_every == 0:  # whole blocks accepted, except the budget-limited last one
            assert all(n == block_size for n in spec.acceptance_lengths[:-1])
            assert spec.tau > block_size - 1 if block_size < 8 else spec.tau > 0.8 * block_size


@pytest.mark.parametrize("drafter_dtype", [torch.bfloat16, torch.float16])
def test_a_drafter_in_another_dtype_than_the_target_is_lossless(target, drafter_dtype):
    """The drafter may draft in its own dtype beside a float32 target (what bench.e2e --drafter-dtype
    runs): the features reach it cast to its dtype, and the verify is the target's, so the output is
    the target's own, greedy, batched and sampled alike."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4).to(drafter_dtype)
    bases = [target_generate(target, prompt, 20).tokens for prompt in PROMPTS]
    assert [spec_generate(target, drafter, prompt, 20).tokens for prompt in PROMPTS] == bases
    assert [r.tokens for r in spec_generate(target, drafter, PROMPTS, 20)] == bases
    g = lambda: torch.Generator().manual_seed(7)
    sampled = spec_generate(target, drafter, PROMPTS[0], 20, temperature=1.0, generator=g())
    assert len(sampled.tokens) == 20 and all(0 <= t < target.config.vocab_size for t in sampled.tokens)
    assert next(drafter.parameters()).dtype == drafter_dtype  # the loop casts nothing of the drafter's


def test_stop_tokens_and_budget_edges(target):
    prompt = PROMPTS[0]
    base = target_generate(target, prompt, 30)
    oracle = lambda: OracleProposer(base.tokens, len(prompt), target.config.vocab_size)
    for budget in (1, 3, 7):  # 1 = prefill only; smaller than a block
        assert spec_generate(target, oracle(), prompt, budget, block_size=8).tokens == base.tokens[:budget]
        drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=8)
        assert spec_generate(target, drafter, prompt, budget).tokens == base.tokens[:budget]
    stop = base.tokens[12]
    first = base.tokens.index(stop)
    out = spec_generate(target, oracle(), prompt, 30, block_size=8, stop_token_ids=[stop])
    assert out.tokens == base.tokens[:first + 1]
    assert target_generate(target, prompt, 30, stop_token_ids=[stop]).tokens == out.tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec_generate(target, oracle(), prompt, 0, block_size=8)


def test_statistics_add_up(target):
    prompt = PROMPTS[1]
    base = target_generate(target, prompt, 33)
    res = spec_generate(target, OracleProposer(base.tokens, len(prompt), target.config.vocab_size, 2),
                        prompt, 33, block_size=4)
    s = res.summary()
    assert s["steps"] == sum(s["histogram"]) and len(s["histogram"]) == 4
    assert math.isclose(s["tau"], (len(res.tokens) - 1) / s["steps"])
    assert s["draft_s"] >= 0 and s["verify_s"] > 0 and s["other_s"] >= 0
    assert s["time_to_first_token_s"] <= s["total_s"]


def _chi2_two_sample(a: torch.Tensor, b: torch.Tensor, bins: int):
    """Chi-square test of homogeneity of two samples of categories; returns the p-value."""
    ca = torch.bincount(a, minlength=bins).double()
    cb = torch.bincount(b, minlength=bins).double()
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = (((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def _first_tokens(gen_fn, n_samples, n_tokens, vocab):
    g = torch.Generator().manual_seed(1234)
    seqs = [gen_fn(g) for _ in range(n_samples)]
    # Joint category of the first n_tokens tokens.
    return torch.tensor([sum(t * vocab ** i for i, t in enumerate(s[:n_tokens])) for s in seqs])


def test_sampling_follows_the_target_distribution():
    vocab = 6
    target = tiny_target("llama", seed=3, vocab_size=vocab, hidden_size=32, num_hidden_layers=2)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.05)  # a spread-out distribution
    prompt = [1, 4, 2]
    greedy = target_generate(target, prompt, 6).tokens
    # The oracle proposes the greedy path: often right, often wrong at T=1.
    oracle = lambda: OracleProposer(greedy, len(prompt), vocab)
    n, k = 1500, 3
    ref = _first_tokens(lambda g: target_generate(target, prompt, k, temperature=1.0, generator=g).tokens, n, k, vocab)
    spec = _first_tokens(lambda g: spec_generate(target, oracle(), prompt, k, temperature=1.0,
                                                 block_size=4, generator=g).tokens, n, k, vocab)
    assert _chi2_two_sample(ref, spec, vocab ** k) > 1e-3
    # The test has power: the greedy path is over-represented by an accept-the-draft rule.
    biased = spec.clone()
    greedy_code = sum(t * vocab ** i for i, t in enumerate(greedy[:k]))
    biased[: n // 10] = greedy_code
    assert _chi2_two_sample(ref, biased, vocab ** k) < 1e-3


def test_top_k_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    ks = {int(sample_token(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert ks == {0, 1}
    ps = {int(sample_token(logits, 1.0, top_p=0.5, generator=g)) for _ in range(200)}
    assert ps == {0}  # p(0) = 0.64 >= 0.5 alone
    assert int(sample_token(logits, 0.0)) == 0


def test_near_the_budget_the_full_trained_block_is_drafted_and_cut(target, monkeypatch):
    """Verifying fewer tokens near the token budget (or at a smaller block size) still
    drafts the block the drafter was trained on, then cuts it: same cost, trained problem."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=8)
    widths = []
    real = DraftRuntime.draft_tokens

    def spy(self, ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(DraftRuntime, "draft_tokens", spy)
    for budget, B in ((3, None), (11, None), (9, 4)):
        widths.clear()
        out = spec_generate(target, drafter, PROMPTS[0], budget, block_size=B)
        assert out.tokens == target_generate(target, PROMPTS[0], budget).tokens
        assert widths and set(widths) == {8}, widths
        assert all(n <= (B or 8) for n in out.acceptance_lengths)


def test_interleaved_timing_takes_one_call_of_each_a_round(monkeypatch):
    """A machine that slows down while the block sizes are timed slows them alike: the calls
    run in rounds, one of each per round, after the warm-up rounds."""
    from dflash_ext.decode import autotune

    now, calls = [0.0], []

    def call(key, cost):  # the k-th call overall takes cost * (1 + 0.1 k): a steady drift
        calls.append(key)
        now[0] += cost * (1 + 0.1 * len(calls))

    monkeypatch.setattr(autotune.time, "perf_counter", lambda: now[0])
    medians = autotune.interleaved_median_seconds({"a": lambda: call("a", 1.0), "b": lambda: call("b", 2.0)},
                                                  reps=3, warmup=1)
    assert calls == ["a", "b"] * 4
    # a's timed calls are the 3rd, 5th and 7th (median: the 5th), b's the 4th, 6th and 8th
    assert medians["a"] == pytest.approx(1.5) and medians["b"] == pytest.approx(2 * 1.6)
    assert autotune.median_seconds(lambda: call("c", 1.0), reps=1) == pytest.approx(1.9)


def test_block_sizes_of_several_pairs_are_timed_in_the_same_rounds(target, monkeypatch):
    """choose_block_sizes (the demo's dtype race): one timing over every (pair, B), each step in
    its own pair's linear-layer setting; each pair's choice is its own fastest expected B."""
    import copy

    from dflash_ext.decode import autotune

    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    pairs = {"fp32": (target, drafter),
             "bf16": (copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(drafter).to(torch.bfloat16))}
    timings = []

    def timing(fns, reps=5, warmup=0, around=None):
        timings.append(sorted(fns))
        patched = {}
        for key, fn in fns.items():
            with around[key]():
                fn()
                patched[key] = {name for name, (t, _) in pairs.items()
                                if "forward" in t.lm_head.__dict__}  # streamed_linears patches a linear's forward
        assert all(patched[key] == {key[0] or "fp32"} for key in fns), patched  # None: choose_block_size's one
        return {key: {"fp32": 1.0, "bf16": 2.0, None: 1.0}[key[0]] * (1 + 0.1 * key[1]) for key in fns}

    monkeypatch.setattr(autotune, "interleaved_median_seconds", timing)
    choices = autotune.choose_block_sizes(pairs, 12)
    assert timings == [sorted((name, b) for name in pairs for b in (1, 2, 3, 4))]  # one timing of all
    for name, scale in (("fp32", 1.0), ("bf16", 2.0)):
        c = choices[name]
        assert c.step_seconds == {b: pytest.approx(scale * (1 + 0.1 * b)) for b in (1, 2, 3, 4)}
        assert c.block_size == max(c.tokens_per_second, key=c.tokens_per_second.get) == 4
    assert choices["fp32"].best_tokens_per_second == pytest.approx(2 * choices["bf16"].best_tokens_per_second)
    assert autotune.choose_block_size(target, drafter, 12).step_seconds == choices["fp32"].step_seconds


def test_auto_block_size_maximises_expected_tokens_per_second(target, monkeypatch):
    from dflash_ext import choose_block_size
    from dflash_ext.decode import autotune, loop
    from dflash_ext.decode.runner import TargetRunner

    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=8)
    none = choose_block_size(target, drafter, 12)
    assert none.block_size == 8 and not none.tokens_per_second  # no profile: the trained block
    assert none.best_tokens_per_second is None
    drafter.acceptance_profile = [0.9 ** j for j in range(1, 8)]
    choice = choose_block_size(target, drafter, 12)
    assert set(choice.tokens_per_second) == {1, 2, 3, 4, 6, 8}
    assert choice.expected_tokens[1] == 1
    assert choice.block_size == max(choice.tokens_per_second, key=choice.tokens_per_second.get)
    assert choice.best_tokens_per_second == max(choice.tokens_per_second.values())
    assert choice.expected_tokens[8] == pytest.approx(1 + sum(0.9 ** j for j in range(1, 8)))
    for b, v in choice.tokens_per_second.items():
        assert v == pytest.approx(choice.expected_tokens[b] / choice.step_seconds[b])
    out = spec_generate(target, drafter, PROMPTS[2], 20, block_size="auto")
    assert out.tokens == target_generate(target, PROMPTS[2], 20).tokens
    drafter.acceptance_profile = [0.0] * 7  # drafts never accepted: the target alone is fastest
    monkeypatch.setattr(autotune, "interleaved_median_seconds",  # timing noise out
                        lambda fns, reps=3, warmup=0, around=None: {b: (fn(), 1e-3)[1] for b, fn in fns.items()})
    assert choose_block_size(target, drafter, 12).block_size == 1
    drafter.acceptance_profile = [0.95 ** j for j in range(1, 8)]  # with flat costs: the longest block
    assert choose_block_size(target, drafter, 12).block_size == 8
    # The loop's walk, where measured, is E(B): here it gains nothing past B = 3 (flat costs: B = 3 wins)
    drafter.walked_tau = [1.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5]
    walked = choose_block_size(target, drafter, 12)
    assert walked.expected_tokens == {1: 1, 2: 1.5, 3: 2.5, 4: 2.5, 6: 2.5, 8: 2.5} and walked.block_size == 3
    assert "as the loop walks" in walked.profile_source
    drafter.walked_tau = [1.5, 2.5]
    with pytest.raises(ValueError, match=r"walked_tau must hold block_size - 1 = 7"):
        choose_block_size(target, drafter, 12)
    drafter.walked_tau = None
    monkeypatch.undo()
    calls = []
    real_call = TargetRunner.__call__
    monkeypatch.setattr(TargetRunner, "__call__", lambda self, ids, cache, hidden_states=True, **kw: (
        calls.append((ids.shape[1], hidden_states)), real_call(self, ids, cache, hidden_states, **kw))[1])
    choose_block_size(target, drafter, 12)
    assert (1, False) in calls and (1, True) not in calls  # B = 1 timed as the target alone runs
    calls.clear()
    monkeypatch.setattr(loop, "DFlashProposer", None)  # B = 1 never builds a proposer
    alone = spec_generate(target, drafter, PROMPTS[2], 20, block_size=1)
    monkeypatch.undo()
    assert alone.tokens == target_generate(target, PROMPTS[2], 20).tokens
    assert alone.acceptance_lengths == [1] * 20 and alone.draft_time == 0 and alone.block_size == 1
    assert not any(h for _, h in calls)  # no pass asked for hidden states
    with pytest.raises(ValueError, match="block_size"):
        spec_generate(target, drafter, PROMPTS[2], 20, block_size="big")


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_sampling_parameters_are_validated(target, kw, match):
    args = dict(max_new_tokens=8)
    args.update(kw)
    oracle = OracleProposer([], len(PROMPTS[0]), 128)
    with pytest.raises(ValueError, match=match):
        spec_generate(target, oracle, PROMPTS[0], block_size=4, **args)
    with pytest.raises(ValueError, match=match):
        target_generate(target, PROMPTS[0], **args)


class RecordingStreamer:
    """The Hugging Face streamer protocol (put / end), as TextStreamer implements it."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_a_hugging_face_streamer_sees_the_prompt_then_every_token(target):
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    for run in (lambda s: spec_generate(target, drafter, PROMPTS[2], 17, streamer=s),
                lambda s: target_generate(target, PROMPTS[2], 17, streamer=s)):
        s = RecordingStreamer()
        out = run(s)
        assert s.puts[0] == PROMPTS[2] and s.ended == 1  # skip_prompt=True drops the first put
        assert sum(s.puts[1:], []) == out.tokens


def test_the_target_pass_asks_only_for_the_drafter_layers(target, monkeypatch):
    from dflash_ext.decode.runner import TargetRunner

    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    asked = []
    real = type(target).forward

    def spy(self, *a, **kw):
        asked.append(kw.get("output_hidden_states"))
        return real(self, *a, **kw)

    monkeypatch.setattr(type(target), "forward", spy)
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    out = spec_generate(target, drafter, PROMPTS[0], 12)
    monkeypatch.undo()
    wanted = [l + 1 for l in drafter.config.target_layer_ids]
    assert runner.select == wanted  # transformers 5.x selects hidden states by index
    assert all(a == wanted for a in asked)
    assert out.tokens == target_generate(target, PROMPTS[0], 12).tokens


def test_a_prefill_computes_the_last_logits_only(target):
    from dflash_ext.decode.runner import TargetRunner

    runner = TargetRunner(target, [1, 3])
    ids = torch.tensor([PROMPTS[1]])
    full, hs_full, _ = runner(ids, None)
    last, hs_last, _ = runner(ids, None, last_logits_only=True)
    assert runner.can_keep_last and last.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
    for i in (2, 4):  # the drafter still gets every position's hidden states
        assert torch.equal(hs_last[i], hs_full[i])


def test_fewer_drafts_are_the_first_of_the_full_block(target):
    from dflash_ext import DFlashProposer
    from dflash_ext.decode.runner import TargetRunner

    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=8, seed=1)
    with torch.no_grad():
        drafter.fc.weight.mul_(4)  # sharper drafts than the init: no argmax ties
    ids = torch.tensor([PROMPTS[1]])
    _, hidden, _ = TargetRunner(target, drafter.config.target_layer_ids)(ids, None)
    proposer = DFlashProposer(drafter, target, capacity=64)
    proposer.accept(hidden, slice(0, ids.shape[1]), torch.arange(ids.shape[1]))
    full = proposer.propose(5, ids.shape[1], 7)
    assert full.shape == (7,)
    for n in (1, 3, 6):
        assert torch.equal(proposer.propose(5, ids.shape[1], n), full[:n])
    assert proposer.propose(5, ids.shape[1], 10).shape == (10,)  # wider than trained: the block grows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_padding_is_measured_and_changes_no_token(dtype, monkeypatch):
    from dflash_ext.draft.head import greedy_draft
    from dflash_ext.ops import linear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=g).to(dtype)
    hidden = torch.randn(1, 8, 64, generator=g).to(dtype)
    for n in (3, 7):
        assert linear.lm_head_padding(n, weight, None) in (0, 16 - n)
        picks = []
        for pad in (0, 16 - n):
            monkeypatch.setitem(linear._PADDING, (n, (1000, 64), dtype, False), pad)
            picks.append(greedy_draft(hidden, weight, n=n))
        assert torch.equal(picks[0], picks[1]) and picks[0].shape == (1, n)
        want = F.linear(hidden[0, 1:n + 1].float(), weight.float()).argmax(-1)
        assert (picks[0][0] == want).float().mean() >= 0.8  # bf16 rounding may flip a near tie
