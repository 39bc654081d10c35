"""Many prompts in one batch (dflash_ext/decode/batch.py): every row is its own single-prompt
output (greedy, fp32) whatever the other rows are, follows the target's law at T > 0 (a
chi-square per row), rows leave as they finish, a batch of one is today's loop, and the
families whose cache cannot hold a batch's holes are a clear error."""
import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode import batch as batch_module
from dflash_ext.decode import step as step_module
from dflash_ext.decode.batch import RaggedCache
from dflash_ext.testing.oracle import OracleProposer
from dflash_ext.testing.targets import CROPPABLE, HYBRID, SLIDING, tiny_family_target
from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens

NEW = 24
# 1 to a few hundred tokens: the longest is padded for, the shortest holds one token.
PROMPTS = [[7], [5, 17, 33, 2, 9], list(range(40, 80)), [(3 * i + 1) % 250 for i in range(300)]]


@pytest.fixture(scope="module", params=CROPPABLE)
def family_target(request):
    return request.param, tiny_family_target(request.param)


def singles(target, prompts, n=NEW, **kw):
    return [target_generate(target, p, n, **kw).tokens for p in prompts]


def test_each_row_is_its_single_prompt_greedy_output(family_target):
    """A random drafter (ragged, mostly short acceptance) and oracles with long runs and
    rejections mid-block (ragged the other way): every row equals target_generate alone."""
    _, target = family_target
    base = singles(target, PROMPTS)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    assert [r.tokens for r in spec_generate(target, drafter, PROMPTS, NEW)] == base
    oracles = [OracleProposer(b, len(p), target.config.vocab_size, wrong_every=w)
               for b, p, w in zip(base, PROMPTS, (0, 2, 3, 5))]
    out = spec_generate(target, oracles, PROMPTS, NEW, block_size=6)
    assert [r.tokens for r in out] == base
    assert len({tuple(r.acceptance_lengths) for r in out}) > 1  # the rows accepted differently
    assert [r.tokens for r in target_generate(target, PROMPTS, NEW)] == base  # the target alone, batched


def test_rows_end_at_different_steps_by_stop_token_and_budget():
    target = tiny_family_target("qwen3")
    base = singles(target, PROMPTS, 40)
    stop = base[1][6]  # row 1 stops early; the others run to where they meet it, or to the budget
    want = [b[:b.index(stop) + 1] if stop in b else b for b in base]
    assert len({len(w) for w in want}) > 1
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    calls = []
    handle = target.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]),
                                              with_kwargs=True)
    try:
        out = spec_generate(target, drafter, PROMPTS, 40, stop_token_ids=[stop])
    finally:
        handle.remove()
    assert [r.tokens for r in out] == want
    assert calls[len(PROMPTS):] == sorted(calls[len(PROMPTS):], reverse=True) and calls[-1] < len(PROMPTS)  # rows left
    assert [r.tokens for r in spec_generate(target, drafter, PROMPTS, 3)] == [b[:3] for b in base]  # budget < block
    one_token = spec_generate(target, drafter, PROMPTS, 1)  # the prefill's token ends every row
    assert [r.tokens for r in one_token] == [b[:1] for b in base] and not one_token[0].acceptance_lengths


def test_a_row_does_not_change_with_the_other_rows():
    target = tiny_family_target("llama", seed=1)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    row = PROMPTS[2]
    alone = spec_generate(target, drafter, row, NEW).tokens
    for others in ([PROMPTS[0]], [PROMPTS[3], PROMPTS[1]], [[9] * 120, [1, 2], [200] * 7]):
        for where in (0, len(others)):
            prompts = others[:where] + [row] + others[where:]
            assert spec_generate(target, drafter, prompts, NEW)[where].tokens == alone


@pytest.mark.parametrize("compact_at", [0.0, 2.0])  # after every step / never
def test_compaction_does_not_change_the_output(monkeypatch, compact_at):
    target = tiny_family_target("qwen3", seed=2)
    base = singles(target, PROMPTS)
    oracles = [OracleProposer(b, len(p), target.config.vocab_size, wrong_every=w)
               for b, p, w in zip(base, PROMPTS, (1, 2, 3, 0))]
    monkeypatch.setattr(batch_module, "COMPACT_AT", compact_at)
    assert [r.tokens for r in spec_generate(target, oracles, PROMPTS, NEW, block_size=5)] == base


def test_the_ragged_cache_keeps_each_rows_tokens_in_order():
    from transformers import DynamicCache

    caches = []
    for n in (3, 6, 1):
        c = DynamicCache()
        c.update(torch.arange(n, dtype=torch.float)[None, None, :, None].expand(1, 2, n, 4) + 100 * n,
                 torch.zeros(1, 2, n, 3), 0)
        caches.append(c)
    ragged = RaggedCache(caches)
    assert ragged.mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6, [0] * 5 + [1]]
    keys_new = torch.full((3, 2, 4, 4), -1.0)
    ragged.cache.update(keys_new, torch.zeros(3, 2, 4, 3), 0)
    ragged.keep([1, 3, 2], 4)  # 1 column cropped: no row kept the 4th
    assert ragged.mask.shape[1] == 9 and ragged.mask[:, 6:].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    ragged.compact()
    expect = [[300, 301, 302, -1], [600 + i for i in range(6)] + [-1] * 3, [100, -1, -1]]
    for row, want in enumerate(expect):
        got = ragged.cache.layers[0].keys[row, 0, :, 0][ragged.mask[row].bool()].tolist()
        assert got == want
    assert ragged.mask.shape[1] == 9 and ragged.mask.sum(1).tolist() == [4, 9, 3]
    ragged.select([0, 2])  # row 1 leaves: the columns only it used go
    assert ragged.mask.shape[1] == 4 and ragged.cache.layers[0].keys.shape[0] == 2
    assert ragged.cache.layers[0].keys[1, 0, :, 0][ragged.mask[1].bool()].tolist() == [100, -1, -1]


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_a_batch_of_one_is_todays_loop(rule):
    target = tiny_family_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    prompt = PROMPTS[1]
    kw = dict(temperature=0.8, verify=rule)
    single = spec_generate(target, drafter, prompt, NEW, generator=torch.Generator().manual_seed(3), **kw)
    one = spec_generate(target, drafter, [prompt], NEW, generator=torch.Generator().manual_seed(3), **kw)
    assert type(single).__name__ == "GenerationResult" and isinstance(one, list) and len(one) == 1
    assert one[0].tokens == single.tokens and one[0].acceptance_lengths == single.acceptance_lengths
    assert type(spec_generate(target, drafter, torch.tensor([prompt]), 4)).__name__ == "GenerationResult"
    assert isinstance(target_generate(target, [prompt], 4), list)


def test_callbacks_and_streamers_are_per_row():
    target = tiny_family_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    seen = {}

    class Streamer:
        def __init__(self):
            self.put_calls, self.ended = [], False

        def put(self, t):
            self.put_calls.append(t.flatten().tolist())

        def end(self):
            self.ended = True

    streamers = [Streamer() for _ in PROMPTS[:3]]
    out = spec_generate(target, drafter, PROMPTS[:3], NEW, streamer=streamers,
                        on_tokens=lambda row, toks: seen.setdefault(row, []).extend(toks))
    for row, (res, s) in enumerate(zip(out, streamers)):
        assert seen[row] == res.tokens
        assert s.ended and s.put_calls[0] == PROMPTS[row] and sum(s.put_calls[1:], []) == res.tokens
    with pytest.raises(ValueError, match="streamer: a batch of 3 prompts takes a list of 3"):
        spec_generate(target, drafter, PROMPTS[:3], 4, streamer=Streamer())
    with pytest.raises(ValueError, match="static_cache=True decodes one prompt"):
        spec_generate(target, drafter, PROMPTS[:2], 4, static_cache=True)
    with pytest.raises(ValueError, match="one per prompt"):
        spec_generate(target, [OracleProposer([1], 1, 8)], PROMPTS[:2], 4, block_size=2)


@pytest.mark.parametrize("family", SLIDING + HYBRID)
def test_families_a_batch_cannot_roll_back_are_an_error_naming_them(family):
    target = tiny_family_target(family, num_hidden_layers=2)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    name = target.config.get_text_config().model_type
    for run in (lambda: spec_generate(target, drafter, PROMPTS[:2], 4),
                lambda: target_generate(target, PROMPTS[:2], 4)):
        with pytest.raises(NotImplementedError, match=f"a batch of prompts on a {name} target"):
            run()
    assert len(spec_generate(target, drafter, PROMPTS[1:2], 4)[0].tokens) == 4  # a batch of one still runs


def test_auto_block_size_times_the_batch():
    target = tiny_family_target("qwen3")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    from dflash_ext.decode.autotune import choose_block_size

    choice = choose_block_size(target, drafter, 40, batch_size=3)
    assert choice.expected_tokens[4] == pytest.approx(3 * (1 + 0.9 + 0.8 + 0.7))
    out = spec_generate(target, drafter, PROMPTS[:3], NEW, block_size="auto")
    assert [r.tokens for r in out] == singles(target, PROMPTS[:3])


@pytest.mark.parametrize("rule", ["rejection", "match"])
@pytest.mark.parametrize("proposer", ["oracle", "drafter"])
def test_sampling_follows_the_target_distribution_in_every_row(rule, proposer):
    """At T = 1 under each verify rule, with oracles proposing each row's greedy path (most
    drafts rejected: ragged rollbacks; under rejection a one-hot q) or a random drafter (under
    rejection its drafts sampled, each row verified against its own q from propose_rows), each
    row's first k tokens follow the target's exact joint law for its prompt."""
    vocab, k, n = 3, 3, 240
    target = tiny_family_target("llama", seed=3, num_hidden_layers=2, vocab_size=vocab, sharpen=5.0)
    prompts = [[1, 2, 0], [2], [0, 0, 1, 2, 1, 1]]
    greedy = singles(target, prompts, k)
    g = torch.Generator().manual_seed(1234)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=3, seed=5)

    def draft():  # fresh oracles per run (they count their calls)
        if proposer == "drafter":
            return drafter
        return [OracleProposer(gr, len(p), vocab) for gr, p in zip(greedy, prompts)]

    runs = [spec_generate(target, draft(), prompts, k, temperature=1.0, block_size=2 if proposer == "oracle" else 3,
                          generator=g, verify=rule) for _ in range(n)]
    for row, prompt in enumerate(prompts):
        codes = torch.tensor([sum(t * vocab ** i for i, t in enumerate(r[row].tokens)) for r in runs])
        probs = exact_first_tokens(target, prompt, k, vocab)
        assert chi2_goodness_of_fit(codes, probs) > 1e-3, row
        biased = codes.clone()  # the test has power: the greedy path over-represented fails it
        biased[: n // 3] = sum(t * vocab ** i for i, t in enumerate(greedy[row]))
        assert chi2_goodness_of_fit(biased, probs) < 1e-3, row
    assert sum(a == 1 for r in runs for row in r for a in row.acceptance_lengths) > n  # rejections happened


def test_the_target_alone_batched_reports_as_target_generate():
    target = tiny_family_target("llama")
    batched = target_generate(target, PROMPTS[:3], 5, stop_token_ids=[singles(target, PROMPTS[:1], 5)[0][2]])
    alone = [target_generate(target, p, 5, stop_token_ids=batched[0].tokens[-1:]) for p in PROMPTS[:3]]
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.acceptance_lengths for r in batched] == [r.acceptance_lengths for r in alone]
    assert all(r.verify_time > 0 and r.total_time >= r.time_to_first_token for r in batched)


def test_propose_rows_returns_each_rows_q_as_propose_does():
    """At T > 0 (the rejection rule's proposer) the batched draft pass returns a Draft whose row
    i is sequence i's: its q equal to a single-sequence proposer's over the same context, its
    tokens drawn where that q is positive; greedy, plain tokens equal to each row's own."""
    from dflash_ext.decode.runner import TargetRunner
    from dflash_ext.draft.proposer import DFlashProposer
    from dflash_ext.sampling import Draft, Sampling

    target = tiny_family_target("qwen3", seed=4)
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    prompts = [torch.tensor([p]) for p in PROMPTS[:3]]
    for sampling in (Sampling(temperature=1.0, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(0)), None):
        batch = DFlashProposer(drafter, target, capacity=64, batch_size=len(prompts), sampling=sampling)
        singles_ = [DFlashProposer(drafter, target, capacity=64, sampling=sampling) for _ in prompts]
        lasts = []
        for i, ids in enumerate(prompts):
            logits, hidden, _ = runner(ids, None)
            n = ids.shape[1]
            batch.accept(hidden, slice(0, n), torch.arange(n), seq=i)
            singles_[i].accept(hidden, slice(0, n), torch.arange(n))
            lasts.append(int(logits[0, -1].argmax()))
        seqs, pos = [2, 0], [prompts[2].shape[1], prompts[0].shape[1]]  # a subset, out of order
        rows = batch.propose_rows(seqs, [lasts[s] for s in seqs], pos, 3)
        for i, s in enumerate(seqs):
            one = singles_[s].propose(lasts[s], pos[i], 3)
            if sampling is None:
                assert not isinstance(rows, tuple) and rows[i].tolist() == one.tolist()
                continue
            assert isinstance(rows, Draft) and rows.probs.shape == (2, 3, target.config.vocab_size)
            torch.testing.assert_close(rows.probs[i], one.probs, atol=1e-5, rtol=1e-4)
            assert bool((rows.probs[i].gather(-1, rows.tokens[i][:, None]) > 0).all())
            assert (rows.probs[i] > 0).sum(-1).max() <= 5  # top-k 5 applied to q


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_the_batch_hands_each_rows_q_to_the_rule(monkeypatch, rule):
    """Under rejection at T > 0 the verify rule gets the drafts' q [rows, n, V] beside them
    (the law alone cannot tell: one-hot q is exact too, only accepts less); under match none."""
    target = tiny_family_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    seen, real = [], step_module.verify_rows

    def spy(drafts, logits, sampling, probs):
        seen.append((tuple(drafts.shape), None if probs is None else tuple(probs.shape), sampling.verify))
        if probs is not None:  # each row's drafts drawn where its own q is positive
            assert bool((probs.gather(-1, drafts[..., None]) > 0).all())
        return real(drafts, logits, sampling, probs)

    monkeypatch.setattr(step_module, "verify_rows", spy)
    spec_generate(target, drafter, PROMPTS[:3], 8, temperature=1.0, verify=rule,
                  generator=torch.Generator().manual_seed(0))
    assert seen and all(r == rule for *_, r in seen)
    V = target.config.vocab_size
    assert all((q == d + (V,)) if rule == "rejection" else q is None for d, q, _ in seen)
