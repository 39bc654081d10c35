"""The loop over transformers' StaticCache (spec_generate / target_generate / choose_block_size
with static_cache=True): lossless on every family whose static cache rolls back (full
attention, MLA, the Gated DeltaNet hybrids), greedy and at T = 1; a clear error where it
cannot (a static sliding window that fills); the compiled passes (CUDA graphs) are a no-op
off CUDA, taken only by the fixed-size passes over a compileable cache, and on CUDA give
the target's own greedy tokens (skipped without a GPU; not yet run on one)."""
import pytest
import torch

from dflash_ext import DFlashDrafter, choose_block_size, spec_generate, target_generate
from dflash_ext.decode import runner as target_module
from dflash_ext.decode.rollback import CacheRollback
from dflash_ext.decode.runner import TargetRunner, cache_kwarg, compiled_call, make_static_cache
from python_tests.decode.test_target_families import (NEW_TOKENS, PROMPTS, chi2_goodness_of_fit,
                                                         exact_first_tokens, hf_greedy)
from dflash_ext.testing.oracle import OracleProposer
from dflash_ext.testing.targets import CROPPABLE, HYBRID, SLIDING, tiny_family_target, tiny_target

STATIC_FAMILIES = CROPPABLE + HYBRID


@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_greedy_over_a_static_cache_is_the_target_alone(family):
    """A random drafter (most drafts rejected: the rollback lowers the length every step) and an
    oracle with long accepted runs and rejections in the middle of the block, on a static cache,
    equal the target's own greedy generate (on its dynamic cache)."""
    target = tiny_family_target(family)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    vocab = target.config.get_text_config().vocab_size
    for prompt in PROMPTS:
        base = hf_greedy(target, prompt, NEW_TOKENS)
        assert target_generate(target, prompt, NEW_TOKENS, static_cache=True).tokens == base
        assert spec_generate(target, drafter, prompt, NEW_TOKENS, static_cache=True).tokens == base
        oracle = OracleProposer(base, len(prompt), vocab, wrong_every=2)
        spec = spec_generate(target, oracle, prompt, NEW_TOKENS, block_size=5, static_cache=True)
        assert spec.tokens == base and max(spec.acceptance_lengths) == 5


def test_the_static_rollback_lowers_the_length_and_the_next_pass_overwrites():
    """After a rejection the rejected rows stay in the buffer, the length goes back, and the
    next pass at the same positions writes over them: its logits are a fresh prefill's."""
    target = tiny_target("qwen3")
    runner = TargetRunner(target)
    prompt = torch.tensor([PROMPTS[1]])
    _, _, cache = runner(prompt, make_static_cache(target, 32), hidden_states=False)
    rollback = CacheRollback(cache, 4)
    assert not rollback.records and int(cache.get_seq_length()) == prompt.shape[1]
    runner(torch.tensor([[7, 8, 9, 10]]), cache, hidden_states=False, rollback=rollback)
    rollback(3)  # keep 7
    assert int(cache.get_seq_length()) == prompt.shape[1] + 1
    keys = cache.layers[0].keys
    assert keys[0, :, prompt.shape[1] + 1:prompt.shape[1] + 4].abs().sum() > 0  # the stale rows are still there
    logits, _, _ = runner(torch.tensor([[11, 12]]), cache, hidden_states=False, rollback=rollback)
    rollback(0)
    fresh, _, _ = runner(torch.cat([prompt, torch.tensor([[7, 11, 12]])], 1), None, hidden_states=False)
    torch.testing.assert_close(logits[0], fresh[0, -2:], rtol=1e-4, atol=1e-4)


def test_sampling_over_a_static_cache_follows_the_target():
    """T = 1, blocks of 2 (most steps reject and roll back), on a static cache: the first k
    tokens follow the target's exact joint law (chi-square), as target_generate's do. (A wrong
    rollback is caught exactly by the greedy tests above: on this tiny random target one stale
    token moves these probabilities too little for 200 samples to see.)"""
    vocab, k, n = 3, 3, 200
    target = tiny_target("llama", seed=3, vocab_size=vocab, hidden_size=32, num_hidden_layers=2)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.25)  # a spread-out distribution
    prompt = [1, 2, 0]
    greedy = target_generate(target, prompt, k).tokens
    probs = exact_first_tokens(target, prompt, k, vocab)
    g = torch.Generator().manual_seed(1234)
    runs = [spec_generate(target, OracleProposer(greedy, len(prompt), vocab), prompt, k, temperature=1.0,
                          block_size=2, generator=g, static_cache=True) for _ in range(n)]
    assert sum(a == 1 for r in runs for a in r.acceptance_lengths) > n // 2  # rollbacks happened
    codes = torch.tensor([sum(t * vocab ** i for i, t in enumerate(r.tokens)) for r in runs])
    assert chi2_goodness_of_fit(codes, probs) > 1e-3
    biased = codes.clone()  # the test has power: an accept-the-draft rule's excess of the greedy path fails it
    biased[: n // 6] = sum(t * vocab ** i for i, t in enumerate(greedy))
    assert chi2_goodness_of_fit(biased, probs) < 1e-3
    alone = [target_generate(target, prompt, k, temperature=1.0, generator=g, static_cache=True).tokens
             for _ in range(n)]
    assert chi2_goodness_of_fit(torch.tensor([sum(t * vocab ** i for i, t in enumerate(a)) for a in alone]),
                                probs) > 1e-3


@pytest.mark.parametrize("family", SLIDING)
def test_a_static_sliding_window_is_a_clear_error(family):
    target = tiny_family_target(family)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    with pytest.raises(NotImplementedError, match="StaticSlidingWindowLayer.*dynamic cache"):
        spec_generate(target, drafter, PROMPTS[1], NEW_TOKENS, static_cache=True)


@pytest.mark.parametrize("family", STATIC_FAMILIES + SLIDING)
def test_a_static_cache_is_refused_with_the_bytes_it_would_allocate(family, monkeypatch):
    """transformers allocates a static cache whole on its first update: one larger than the memory
    available is refused before that, naming the exact bytes it would have taken (every layer kind:
    sliding windows, MLA's latent, linear attention's state counts nothing)."""
    import dflash_ext.ops.hardware

    target = tiny_family_target(family)
    cache = make_static_cache(target, 40)
    with torch.no_grad():
        target(input_ids=torch.tensor([PROMPTS[0]]), use_cache=True, **{cache_kwarg(target): cache})
    allocated = sum(getattr(layer, name).nbytes for layer in cache.layers for name in ("keys", "values")
                    if isinstance(getattr(layer, name, None), torch.Tensor))
    monkeypatch.setattr(dflash_ext.ops.hardware, "available_memory", lambda device: allocated - 1)
    with pytest.raises(ValueError, match=rf"static cache of 40 tokens .* would take {allocated} bytes .*"
                                         rf"{allocated - 1} bytes .* available .*max_new_tokens"):
        make_static_cache(target, 40)
    monkeypatch.setattr(dflash_ext.ops.hardware, "available_memory", lambda device: allocated)
    make_static_cache(target, 40)


def test_a_static_cache_past_the_memory_is_refused_before_allocating():
    """A huge budget (issue 49 item 3) on a target that positions 64 tokens: a ValueError naming the
    bytes and max_new_tokens, where it was the allocator's error; the dynamic cache runs."""
    target = tiny_target("llama", max_position_embeddings=64)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    huge = 10 ** 12
    words = r"static cache of \d+ tokens .* would take \d+ bytes .* 64 tokens: max_position_embeddings.*max_new_tokens"
    for run in (lambda: spec_generate(target, drafter, PROMPTS[0], huge, static_cache=True),
                lambda: spec_generate(target, drafter, PROMPTS[0], huge, block_size="auto", static_cache=True),
                lambda: target_generate(target, PROMPTS[0], huge, static_cache=True),
                lambda: choose_block_size(target, drafter, 5, static_cache=True, static_cache_len=huge)):
        with pytest.raises(ValueError, match=words):
            run()
    assert len(spec_generate(target, drafter, PROMPTS[0], 20, static_cache=True).tokens) == 20
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="max_cache_len must be an int >= 1"):
            make_static_cache(target, bad)


def test_auto_block_size_on_a_static_cache():
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    choice = choose_block_size(target, drafter, 12, static_cache=True)
    assert set(choice.step_seconds) == {1, 2, 3, 4}
    out = spec_generate(target, drafter, PROMPTS[2 % len(PROMPTS)], 20, block_size="auto", static_cache=True)
    assert out.tokens == target_generate(target, PROMPTS[2 % len(PROMPTS)], 20).tokens


def test_choose_block_size_range_checks_its_static_cache_and_context():
    """static_cache_len below the context and a trained block, zero or negative (issue 49 item 4):
    a ValueError naming it, where it was an IndexError / RuntimeError inside transformers."""
    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    for bad in (15, 1, 0, -5, 16.0, True):
        with pytest.raises(ValueError, match=r"static_cache_len must be an int >= .*\(12 \+ 4 = 16 rows"):
            choose_block_size(target, drafter, 12, static_cache=True, static_cache_len=bad)
    for bad in (-1, 2.5, None):
        with pytest.raises(ValueError, match="context_len must be an int >= 0"):
            choose_block_size(target, drafter, bad, static_cache=True)
    for bad in ((0, 2), (2, -1), (2.0,)):
        with pytest.raises(ValueError, match="candidates must be block sizes"):
            choose_block_size(target, drafter, 12, candidates=bad)
    with pytest.raises(ValueError, match="static_cache_len sizes the static cache: it needs static_cache=True"):
        choose_block_size(target, drafter, 12, static_cache_len=16)  # was silently ignored
    assert choose_block_size(target, drafter, 12, static_cache=True, static_cache_len=16).block_size in (1, 2, 3, 4)


def test_compiling_is_a_no_op_off_cuda():
    target = tiny_target("llama")
    assert compiled_call(target) is target
    runner = TargetRunner(target, compiled_sizes=(4,))
    assert not runner.compiles and runner._forward(4, make_static_cache(target, 16)) is target


class CountingCall:
    """Stands for the compiled call: counts the passes that would run compiled."""

    def __init__(self, target):
        self.target, self.sizes = target, []

    def __call__(self, input_ids, **kw):
        self.sizes.append(input_ids.shape[1])
        return self.target(input_ids=input_ids, **kw)


def test_only_fixed_size_passes_over_a_compileable_cache_run_compiled(monkeypatch):
    """With compiling on (as on CUDA), spec_generate sends the verify passes of B tokens, and
    target_generate the one-token passes, through the compiled call; the prefill, the shorter
    verify passes near the budget and any pass over a dynamic cache run eagerly."""
    target = tiny_target("llama")
    counting = CountingCall(target)
    monkeypatch.setattr(target_module, "compiled_call", lambda model: counting)
    prompt, B = PROMPTS[0], 4
    base = target_generate(target, prompt, 21).tokens
    oracle = OracleProposer(base, len(prompt), target.config.vocab_size)
    assert spec_generate(target, oracle, prompt, 21, block_size=B, static_cache=True).tokens == base
    assert counting.sizes == [B] * 5  # 1 + 5 x 4 tokens = 21: the last step verifies the full block
    counting.sizes.clear()
    assert spec_generate(target, oracle, prompt, 19, block_size=B, static_cache=True).tokens == base[:19]
    assert counting.sizes == [B] * 4  # then a pass of 3 near the budget: eager
    counting.sizes.clear()
    assert target_generate(target, prompt, 6, static_cache=True).tokens == base[:6]
    assert counting.sizes == [1] * 5
    counting.sizes.clear()
    spec_generate(target, oracle, prompt, 9, block_size=B)  # a dynamic cache: never compiled
    target_generate(target, prompt, 4)
    assert counting.sizes == []
    hybrid = tiny_family_target("qwen3_5")  # a recording linear-attention layer is not compileable
    counting.target = hybrid
    spec_generate(hybrid, OracleProposer([0] * 9, len(prompt), 256), prompt, 9, block_size=B, static_cache=True)
    assert counting.sizes == []


def test_compiled_auto_block_size_times_powers_of_two_on_the_generation_s_cache(monkeypatch):
    """Where the passes compile (one CUDA graph per size), choose_block_size times the powers
    of two and the trained block only, on a static cache as long as the generation's (the
    graphs are shaped by it: spec_generate then reuses them)."""
    from dflash_ext.decode import autotune

    target = tiny_target("llama")
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=8)
    drafter.acceptance_profile = [0.9] * 7
    monkeypatch.setattr(target_module, "compiled_call", lambda model: CountingCall(model))
    monkeypatch.setattr(autotune, "interleaved_median_seconds",  # B = 8: no noise
                        lambda fns, reps=5, warmup=0, around=None: {b: (fn(), 1e-3)[1] for b, fn in fns.items()})
    lengths, real = [], target_module.make_static_cache
    monkeypatch.setattr(target_module, "make_static_cache",
                        lambda model, rows: (lengths.append(rows), real(model, rows))[1])
    assert set(choose_block_size(target, drafter, 12, static_cache=True).step_seconds) == {1, 2, 4, 8}
    prompt = PROMPTS[1]
    out = spec_generate(target, drafter, prompt, 20, block_size="auto", static_cache=True)
    assert lengths[-2:] == [len(prompt) + 20 + 8] * 2
    assert out.tokens == target_generate(target, prompt, 20).tokens


def test_the_compiled_passes_trace_in_one_graph_per_size(monkeypatch):
    """What compiles on CUDA traces on the CPU: with the compiled call replaced by
    torch.compile(fullgraph=True) over a backend that runs the captured graph eagerly, the
    one-token pass and the verify pass of each B are one graph each, with no graph break (it
    would raise), across generations and their new static caches, and the tokens are the
    target's. (Linear layers off the CPU are not streamed: a CPU target here streams none.)"""
    target = tiny_target("qwen3")
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(target_module, "compiled_call", lambda model: torch.compile(
        model.__call__, backend=counting_backend, fullgraph=True, dynamic=False))
    prompt = PROMPTS[1]
    base = target_generate(target, prompt, 12).tokens
    assert target_generate(target, prompt, 12, static_cache=True).tokens == base
    assert len(graphs) == 1
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    oracle = OracleProposer(base, len(prompt), target.config.vocab_size, wrong_every=2)
    for proposer, B in ((drafter, None), (drafter, None), (oracle, 5)):
        out = spec_generate(target, proposer, prompt, 12, block_size=B, static_cache=True, stream_linears=False)
        assert out.tokens == base
    assert len(graphs) == 3  # the drafter's B = 4 (twice: a new cache compiles nothing), the oracle's B = 5
    torch._dynamo.reset()


def test_linear_layers_off_the_cpu_are_not_streamed():
    from dflash_ext import streamed_linears

    with torch.device("meta"):
        layer = torch.nn.Linear(8, 8)
    with streamed_linears(layer):
        assert "forward" not in layer.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_compiled_verify_is_the_target_alone(family):
    """On CUDA the verify passes and the one-token passes run compiled (CUDA graphs) and give
    the target's own greedy tokens (fp32: no rounding differences between pass sizes)."""
    target = tiny_family_target(family).cuda()
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4).cuda()
    prompt = PROMPTS[1]
    out = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False)
    base = out[0, len(prompt):].tolist()
    assert TargetRunner(target, compiled_sizes=(1,)).compiles
    assert target_generate(target, prompt, NEW_TOKENS, static_cache=True).tokens == base
    oracle = OracleProposer(base, len(prompt), target.config.vocab_size, wrong_every=2)
    for proposer, B in ((drafter, None), (oracle, 5)):
        assert spec_generate(target, proposer, prompt, NEW_TOKENS, block_size=B, static_cache=True).tokens == base
    assert hasattr(target, "_compiled_call")  # transformers' get_compiled_call was taken
