"""spec_generate is lossless on every target family a published drafter serves, whatever
its cache holds (dflash_ext/testing_targets.py): full attention, sliding windows passed
during generation, linear-attention conv and recurrent states; and the rollback after a
rejection at any position of the block leaves the cache a fresh prefill would build."""
import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.decode.rollback import CacheRollback
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.decode.batch import RowProposers
from dflash_ext.decode.step import DecodeState, OneRow, speculative_step
from dflash_ext.sampling import Sampling, process_logits
from dflash_ext.testing.oracle import OracleProposer
from dflash_ext.testing.targets import CROPPABLE, FAMILIES, HYBRID, SLIDING, SLIDING_WINDOW, tiny_family_target

PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 52))]  # the second is longer than the window
NEW_TOKENS = 3 * SLIDING_WINDOW


@pytest.fixture(scope="module", params=FAMILIES)
def family_target(request):
    return request.param, tiny_family_target(request.param)


def hf_greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_greedy_lossless(target, prompts=PROMPTS):
    """Greedy spec_generate, with a random drafter and with an oracle that has long accepted runs
    and rejections in the middle of the block, past the window, equals the target alone."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    for prompt in prompts:
        base = target_generate(target, prompt, NEW_TOKENS).tokens
        assert hf_greedy(target, prompt, NEW_TOKENS) == base
        assert spec_generate(target, drafter, prompt, NEW_TOKENS).tokens == base
        oracle = OracleProposer(base, len(prompt), target.config.get_text_config().vocab_size, wrong_every=2)
        spec = spec_generate(target, oracle, prompt, NEW_TOKENS, block_size=5)
        assert spec.tokens == base and max(spec.acceptance_lengths) == 5


def test_greedy_spec_generate_is_the_target_alone(family_target):
    assert_greedy_lossless(family_target[1])


@pytest.mark.parametrize("family", ["gemma4-composite", "glm4_moe", "minimax_m2", "kimi_linear"])
def test_greedy_on_other_published_targets(family):
    """Gemma 4 as its checkpoints ship it (Gemma4ForConditionalGeneration), GLM-4.5's and
    MiniMax-M2's MoE, Kimi-Linear's Delta Attention hybrid."""
    name, _, composite = family.partition("-")
    assert_greedy_lossless(tiny_family_target(name, composite=bool(composite)), PROMPTS[1:])


def test_minimax_lightning_attention_is_a_clear_error():
    """MiniMax-01 keeps its lightning-attention states in a cache of its own whose `crop` raises:
    nothing can roll it back, so spec_generate says so instead of decoding."""
    target = tiny_family_target("minimax")
    oracle = OracleProposer([0] * 8, len(PROMPTS[0]), target.config.vocab_size)
    with pytest.raises(NotImplementedError, match="MiniMaxCache"):
        spec_generate(target, oracle, PROMPTS[0], 8, block_size=4)


def test_deepseek_v32_is_lossless_while_its_indexer_keeps_every_key():
    """DeepSeek-V3.2's indexer keeps the index_topk best-scored keys per query; its scores pass
    a ReLU, so keys tie at exactly 0, and torch.topk breaks those ties differently for a block of
    queries than for one (measured on this tiny target: a 5-token pass picks another key than a
    1-token pass): past index_topk keys of context a multi-token verify pass is not one-token
    decoding, whoever rolls back. The rollback itself (indexer keys included) is exact: with
    every key kept, spec_generate is lossless."""
    target = tiny_family_target("deepseek_v32")
    for module in target.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = 64  # more than the context: every key kept
    assert_greedy_lossless(target, PROMPTS[1:])


def test_the_rollback_is_off_the_path_where_every_layer_crops(family_target):
    family, target = family_target
    _, _, cache = TargetRunner(target)(torch.tensor([PROMPTS[1]]), None, hidden_states=False)
    rollback = CacheRollback(cache, 4)
    assert rollback.records == (family not in CROPPABLE)
    assert any(getattr(layer, "record_past", False) for layer in cache.layers) == rollback.records


class WrongAt:
    """Proposes the known continuation with draft `wrong` replaced (none when >= n): the
    target rejects the block exactly there."""

    def __init__(self, continuation, n_prompt, vocab_size, wrong):
        self.cont, self.n_prompt, self.V, self.wrong = continuation, n_prompt, vocab_size, wrong

    def accept(self, hidden_states, rows, positions):
        pass

    def propose(self, last_token, position, n):
        start = position + 1 - self.n_prompt
        toks = list(self.cont[start:start + n])
        if self.wrong < n:
            toks[self.wrong] = (toks[self.wrong] + 1) % self.V
        return torch.tensor(toks, dtype=torch.long)


def next_logits(runner, cache, token, rollback=None):
    logits, _, _ = runner(torch.tensor([[token]]), cache, hidden_states=False, rollback=rollback)
    return logits[0, -1]


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4"])
def test_a_rejection_at_every_block_position_rolls_back_to_a_fresh_prefill(family):
    """For each position j of a block of B (j = B - 1: every draft accepted), steps that reject
    draft j, run past the sliding window; after each, the cache continues exactly as the
    cache of a fresh prefill of the accepted tokens (next logits), and holds no more than its
    working size (the recorded past is trimmed every step)."""
    target = tiny_family_target(family, num_hidden_layers=2)
    B, prompt, steps = 4, PROMPTS[0], 4
    base = target_generate(target, prompt, 1 + steps * B).tokens
    runner = TargetRunner(target)
    sampling = Sampling()  # greedy
    for wrong in range(B):
        logits, _, cache = runner(torch.tensor([prompt]), None, hidden_states=False, last_logits_only=True)
        rollback = CacheRollback(cache, B)
        state = DecodeState(OneRow(cache, rollback), [0], [int(logits[0, -1].argmax())], [len(prompt)])
        emitted = list(state.lasts)
        V = target.config.vocab_size
        proposer = RowProposers([WrongAt(base, len(prompt), V, wrong)], "cpu", V)
        for _ in range(steps):
            [new] = speculative_step(runner, proposer, state, B, sampling)
            assert len(new) == min(wrong, B - 1) + 1
            emitted += new
            pos, last = state.positions[0], state.lasts[0]
            assert emitted == base[:len(emitted)] and pos == len(prompt) + len(emitted) - 1
            assert all(int(layer.get_seq_length()) == pos for layer in cache.layers)
            _, _, fresh = runner(torch.tensor([prompt + emitted[:-1]]), None, hidden_states=False)
            torch.testing.assert_close(next_logits(runner, cache, last, rollback),
                                       next_logits(runner, fresh, last), rtol=1e-4, atol=1e-4)
            rollback(1)  # undo the probe token: the cache is back where the step left it
        for layer in cache.layers:
            if getattr(layer, "sliding_window", None):
                assert layer.keys.shape[-2] == SLIDING_WINDOW - 1
            if getattr(layer, "conv_states", None):
                assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]
                assert not layer.recurrent_states_history[0]


def test_a_cache_that_cannot_roll_back_is_an_error_naming_it():
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticSlidingWindowLayer

    class ModelOwnLayer(DynamicLayer):  # a model's own layer class may keep anything
        pass

    # A static window that can fill rolls its buffer and keeps no record of what it dropped.
    for odd in (ModelOwnLayer(), StaticSlidingWindowLayer(max_cache_len=16, sliding_window=8)):
        with pytest.raises(NotImplementedError, match=type(odd).__name__):
            CacheRollback(Cache(layers=[DynamicLayer(), odd]), 4)

    class OwnCache(DynamicCache):  # as MiniMaxCache: its linear states live outside the layers
        def crop(self, tokens_to_remove):
            raise RuntimeError("no crop")

    with pytest.raises(NotImplementedError, match="OwnCache"):
        CacheRollback(OwnCache(), 4)


@torch.no_grad()
def exact_first_tokens(target, prompt, k, vocab, temperature=1.0, top_k=0, top_p=1.0):
    """P(the first k generated tokens = each sequence) of the target sampled at `temperature`
    (and top-k, top-p: its processed law), by enumeration; a sequence's index is sum_i t_i vocab^i."""
    probs = torch.zeros(vocab ** k, dtype=torch.float64)
    runner = TargetRunner(target)

    def walk(prefix, p, code):
        if len(prefix) == k:
            probs[code] = p
            return
        logits, _, _ = runner(torch.tensor([prompt + prefix]), None, hidden_states=False, last_logits_only=True)
        q = process_logits(logits[0, -1:], temperature, top_k, top_p)[0].double().softmax(-1)
        for t in range(vocab):
            walk(prefix + [t], p * q[t], code + t * vocab ** len(prefix))

    walk([], 1.0, 0)
    return probs


def chi2_goodness_of_fit(codes: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that `codes` are draws from `probs` (the cells expected
    fewer than `min_expected` times pooled into one)."""
    observed = torch.bincount(codes, minlength=probs.numel()).double()
    expected = probs * codes.numel()
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_sampling_on_a_hybrid_target_follows_its_distribution():
    """At T = 1 on a Gated DeltaNet hybrid, with blocks of 2 so that most steps reject and roll
    the linear-attention states back, the first k tokens follow the target's exact joint law.
    (The rolled-back state itself is checked exactly, by logits, in the test above: one wrong
    token folded into a tiny random recurrent state moves these probabilities by ~1 %.)"""
    vocab, k, n = 3, 3, 200
    target = tiny_family_target("qwen3_5", seed=3, num_hidden_layers=2, vocab_size=vocab,
                                sharpen=5.0)  # spread-out logits: most drafts are rejected
    prompt = [1, 2, 0]
    greedy = target_generate(target, prompt, k).tokens
    probs = exact_first_tokens(target, prompt, k, vocab)
    g = torch.Generator().manual_seed(1234)
    runs = [spec_generate(target, OracleProposer(greedy, len(prompt), vocab), prompt, k, temperature=1.0,
                          block_size=2, generator=g) for _ in range(n)]
    assert sum(a == 1 for r in runs for a in r.acceptance_lengths) > n  # rollbacks happened
    codes = torch.tensor([sum(t * vocab ** i for i, t in enumerate(r.tokens)) for r in runs])
    assert chi2_goodness_of_fit(codes, probs) > 1e-3
    # The test has power: the greedy path over-represented by an accept-the-draft rule fails it.
    biased = codes.clone()
    biased[: n // 6] = sum(t * vocab ** i for i, t in enumerate(greedy))
    assert chi2_goodness_of_fit(biased, probs) < 1e-3


@pytest.mark.parametrize("family", SLIDING + HYBRID[1:2])
def test_auto_block_size_times_verify_with_the_rollback(family):
    target = tiny_family_target(family)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    prompt = PROMPTS[1]
    out = spec_generate(target, drafter, prompt, NEW_TOKENS, block_size="auto")
    assert out.tokens == target_generate(target, prompt, NEW_TOKENS).tokens


def test_a_pass_longer_than_the_recording_is_an_error():
    """The recording keeps the states after the last max_tokens tokens: a longer pass could
    not be undone exactly, so it is refused before it runs (not rolled back to a wrong state)."""
    target = tiny_family_target("qwen3_5")
    runner = TargetRunner(target)
    _, _, cache = runner(torch.arange(5, 15)[None], None, hidden_states=False)
    rollback = CacheRollback(cache, 2)
    with pytest.raises(ValueError, match="a pass of 3 tokens cannot be rolled back"):
        runner(torch.arange(20, 23)[None], cache, hidden_states=False, rollback=rollback)
    runner(torch.arange(20, 22)[None], cache, hidden_states=False, rollback=rollback)  # fits
    rollback(2)
