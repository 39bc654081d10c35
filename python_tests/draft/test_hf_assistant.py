"""DFlash through Hugging Face generate(assistant_model=DFlashAssistant(drafter),
speculation_type="dflash"): lossless, the same drafts as spec_generate, sampling runs,
and bad use is a clear error."""
from types import SimpleNamespace

import pytest
import torch

from dflash_ext import DFlashAssistant, DFlashDrafter, DFlashProposer, spec_generate, target_generate
from dflash_ext.testing.targets import FAMILIES, tiny_family_target, tiny_target

PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 61))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)


def hf_generate(target, assistant, prompt, n, **kw):
    ids = torch.tensor([prompt])
    out = target.generate(ids, assistant_model=assistant, speculation_type="dflash", max_new_tokens=n,
                          pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_through_hf_generate_equals_the_target_and_spec_generate(target, block_size):
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=block_size)
    assistant = DFlashAssistant(drafter, target)
    for prompt in PROMPTS:
        for n in (1, 7, 30):
            hf = hf_generate(target, assistant, prompt, n, do_sample=False)
            assert hf == target_generate(target, prompt, n).tokens
            assert hf == spec_generate(target, drafter, prompt, n).tokens


@pytest.mark.parametrize("drafter_dtype", [torch.bfloat16, torch.float16])
def test_a_drafter_in_another_dtype_through_hf_generate(target, drafter_dtype):
    """A drafter in bf16 or fp16 beside the float32 target (what the CLI's --drafter-dtype runs):
    transformers puts the target's LM head over the drafter's hidden states, so they come back in
    the target's dtype, and the output is the target's (greedy) or a sample (T > 0)."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4).to(drafter_dtype)
    assistant = DFlashAssistant(drafter, target)
    for prompt in PROMPTS:
        assert hf_generate(target, assistant, prompt, 20, do_sample=False) == target_generate(target, prompt, 20).tokens
    torch.manual_seed(0)
    sampled = hf_generate(target, assistant, PROMPTS[0], 12, do_sample=True)
    assert len(sampled) == 12 and all(0 <= t < target.config.vocab_size for t in sampled)


@pytest.mark.parametrize("family", FAMILIES + ("gemma4-composite",))
def test_every_family_through_hf_generate_is_lossless(family):
    """The drafter from_target makes runs in transformers' DFlash loop on every family a
    published drafter serves (hybrid, sliding-window, MoE, MLA targets; Gemma 4 also as
    the multimodal model its checkpoints load as) and leaves the target's greedy output unchanged."""
    target = tiny_family_target(family.split("-")[0], composite=family.endswith("-composite"))
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    assistant = DFlashAssistant(drafter, target)
    prompt = PROMPTS[1]  # longer than the tiny targets' sliding window
    alone = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert hf_generate(target, assistant, prompt, 16, do_sample=False) == alone[0, len(prompt):].tolist()
    assert assistant.calls > 0


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_accepted_drafts_through_hf_generate_stay_lossless(family, monkeypatch):
    """Drafts that are accepted (whole blocks and prefixes) on a hybrid and a sliding-window
    target: the drafter runs as always (its context cache takes every accepted row), then its
    hidden states are replaced by ones the LM head reads as the target's own continuation,
    one slot wrong every third round."""
    target = tiny_family_target(family)
    prompt = PROMPTS[1]
    alone = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    cont = alone[0, len(prompt):].tolist() + [0] * 8
    head = target.get_output_embeddings().weight
    assistant = DFlashAssistant(DFlashDrafter.from_target(target.config, num_layers=1, block_size=4), target)
    real_call = type(assistant).__call__

    def oracle(self, noise_embeds, context_hidden_states, position_ids, **kw):
        out = real_call(self, noise_embeds, context_hidden_states, position_ids, **kw)
        start = int(position_ids[0, context_hidden_states.shape[1]]) + 1 - len(prompt)  # slot 1's token
        tokens = cont[start:start + out.last_hidden_state.shape[1] - 1]
        if self.calls % 3 == 0:
            tokens[1] = (tokens[1] + 1) % head.shape[0]
        wanted = head[tokens].detach()  # a row is read as its own token (checked below)
        assert head.mm(wanted.T).argmax(0).tolist() == tokens
        out.last_hidden_state = torch.cat([out.last_hidden_state[:, :1], wanted[None]], 1)
        return out

    monkeypatch.setattr(type(assistant), "__call__", oracle)
    assert hf_generate(target, assistant, prompt, 24, do_sample=False) == alone[0, len(prompt):].tolist()
    assert max(assistant.acceptance_lengths) == 4 and 2 in assistant.acceptance_lengths


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_through_hf_generate_on_a_static_cache_equals_the_target(target, block_size, monkeypatch):
    """cache_implementation="static" (issue 49 item 5): transformers sizes the target's cache to
    max_length - 1 rows but verifies a whole block near the end (an IndexError in StaticLayer.update
    before); the adapter drafts only the slots that fit. Lossless from a fresh target (no cache size
    remembered from an earlier call) at every budget, with random drafts and with accepted ones."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=block_size)
    for prompt in PROMPTS:
        for n in (1, 2, 3, 5, 9, 30):
            monkeypatch.delattr(target, "_previous_max_cache_length", raising=False)
            hf = hf_generate(target, DFlashAssistant(drafter, target), prompt, n, do_sample=False,
                             cache_implementation="static")
            assert hf == target_generate(target, prompt, n).tokens, (prompt, n)
    prompt = PROMPTS[1]
    alone = target_generate(target, prompt, 30).tokens
    cont = alone + [0] * block_size
    head = target.get_output_embeddings().weight
    assistant = DFlashAssistant(drafter, target)
    real_call = type(assistant).__call__

    def oracle(self, noise_embeds, context_hidden_states, position_ids, **kw):  # drafts the target's own tokens
        out = real_call(self, noise_embeds, context_hidden_states, position_ids, **kw)
        start = int(position_ids[0, context_hidden_states.shape[1]]) + 1 - len(prompt)
        tokens = cont[start:start + out.last_hidden_state.shape[1] - 1]
        if self.calls % 3 == 0 and len(tokens) > 1:
            tokens[1] = (tokens[1] + 1) % head.shape[0]
        out.last_hidden_state = torch.cat([out.last_hidden_state[:, :1], head[tokens].detach()[None]], 1)
        return out

    monkeypatch.setattr(type(assistant), "__call__", oracle)
    for n in (7, 30):
        monkeypatch.delattr(target, "_previous_max_cache_length", raising=False)
        assert hf_generate(target, assistant, prompt, n, do_sample=False, cache_implementation="static") == alone[:n]
    assert max(assistant.acceptance_lengths) == block_size
    monkeypatch.setattr(DFlashAssistant, "__call__", real_call)
    # A dynamic generate past the size the target remembers from the static one: blocks shortened just
    # before it, full ones after it; the target's tokens, and sampling runs (0 candidates would break it).
    assert target._previous_max_cache_length == len(prompt) + 30 - 1
    assistant = DFlashAssistant(drafter, target)
    assert hf_generate(target, assistant, prompt, 60, do_sample=False) == target_generate(target, prompt, 60).tokens
    torch.manual_seed(0)
    assert len(hf_generate(target, assistant, prompt, 60, do_sample=True, temperature=1.0)) == 60


def test_hf_path_drafts_the_blocks_spec_generate_drafts(target, monkeypatch):
    """Same drafter, same context: the two loops propose identical blocks, step by step."""
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, seed=3)
    lm_head = target.get_output_embeddings()
    ours, theirs = [], []
    real_propose = DFlashProposer.propose

    def spy(self, last, pos, n):
        out = real_propose(self, last, pos, n)
        ours.append(out.tolist())
        return out

    monkeypatch.setattr(DFlashProposer, "propose", spy)
    spec = spec_generate(target, drafter, PROMPTS[1], 24)
    assistant = DFlashAssistant(drafter)
    real_call = type(assistant).__call__

    def record(self, *a, **kw):
        out = real_call(self, *a, **kw)
        theirs.append(lm_head(out.last_hidden_state[:, 1:]).argmax(-1)[0].tolist())
        return out

    monkeypatch.setattr(type(assistant), "__call__", record)
    hf = hf_generate(target, assistant, PROMPTS[1], 24, do_sample=False)
    assert hf == spec.tokens
    k = min(len(ours), len(theirs))
    # near the token budget our loop asks for fewer drafts of the same block
    assert k >= 3 and [t[:len(o)] for o, t in zip(ours[:k], theirs[:k])] == ours[:k]
    assert all(len(o) == len(t) for o, t in zip(ours[:k - 1], theirs[:k - 1]))
    assert assistant.acceptance_lengths == spec.acceptance_lengths[:len(assistant.acceptance_lengths)]


def test_sampling_runs_and_reports_acceptance(target):
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    assistant = DFlashAssistant(drafter, target)
    torch.manual_seed(0)
    out = hf_generate(target, assistant, PROMPTS[0], 20, do_sample=True, temperature=1.0)
    assert 1 <= len(out) <= 20 and all(0 <= t < target.config.vocab_size for t in out)
    assert assistant.acceptance_lengths and all(1 <= n <= 4 for n in assistant.acceptance_lengths)
    assert 1 <= assistant.tau <= 4


def test_sampling_through_hf_generate_follows_the_target_law(monkeypatch):
    """do_sample=True with the assistant: transformers samples the candidates from the target's
    LM head over the returned hidden states, processed as the target's logits, hands their
    logits to its own speculative sampling (verified here by a spy), and the first tokens
    follow the target's exact processed law."""
    import transformers.generation.utils as hf_utils
    from python_tests.decode.test_rejection import P_VALUE, VOCAB, _codes, _spread_target
    from python_tests.decode.test_target_families import chi2_goodness_of_fit, exact_first_tokens

    target = _spread_target("llama")
    target.generation_config.eos_token_id = None  # token 2 of 3 is the config's eos: every token counts here
    assistant = DFlashAssistant(DFlashDrafter.from_target(target.config, num_layers=1, block_size=4, seed=1), target)
    calls = []
    real = hf_utils._speculative_sampling
    monkeypatch.setattr(hf_utils, "_speculative_sampling", lambda *a, **k: calls.append(1) or real(*a, **k))
    k, runs, sampling = 3, 240, dict(temperature=0.7, top_k=2)
    prompt = [1, 2, 1]  # no token 0: generate reads it as padding (hf_generate's pad_token_id) and masks it
    probs = exact_first_tokens(target, prompt, k, VOCAB, **sampling)
    torch.manual_seed(1234)
    outs = [SimpleNamespace(tokens=hf_generate(target, assistant, prompt, k, do_sample=True, **sampling))
            for _ in range(runs)]
    assert len(calls) >= runs  # every run verified candidates by speculative sampling
    assert chi2_goodness_of_fit(_codes(outs), probs) > P_VALUE


def test_bad_use_is_a_clear_error(target):
    other = tiny_target("llama", hidden_size=96)
    drafter = DFlashDrafter.from_target(other.config, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="hidden size"):
        DFlashAssistant(drafter, target)
    with pytest.raises(ValueError, match="hidden size"):
        hf_generate(target, DFlashAssistant(drafter), PROMPTS[0], 8, do_sample=False)
    fits = DFlashAssistant(DFlashDrafter.from_target(target.config, num_layers=1, block_size=4), target)
    with pytest.raises(ValueError, match="batch"):
        target.generate(torch.tensor([PROMPTS[0], PROMPTS[0]]), assistant_model=fits, speculation_type="dflash",
                        max_new_tokens=4, pad_token_id=0, do_sample=False)


def test_transformers_outside_the_supported_range_is_refused(monkeypatch):
    drafter = DFlashDrafter.from_target(tiny_target().config, num_layers=1, block_size=4)
    import transformers  # after the model import: transformers' lazy module may replace itself in sys.modules

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(RuntimeError, match="supports transformers >= 5.24"):
        DFlashAssistant(drafter)
