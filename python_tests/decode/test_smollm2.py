"""Losslessness on the real embedded default target (SmolLM2-135M-Instruct, float32)."""
import pytest
import torch

from dflash_ext import DFlashAssistant, DFlashDrafter, default_drafter_path, spec_generate, target_generate
from dflash_ext.testing.oracle import OracleProposer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2():
    from dflash_ext import load_default_target

    model, tok = load_default_target()
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
               for text in ("Write a Python function that reverses a string.", "What is the capital of France?")]
    return model, tok, prompts


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_lossless_on_smollm2(smollm2, block_size):
    model, tok, prompts = smollm2
    drafter = DFlashDrafter.from_target(model.config, num_layers=2, block_size=block_size)
    for prompt in prompts:
        base = target_generate(model, prompt, 20, stop_token_ids=[tok.eos_token_id])
        assert spec_generate(model, drafter, prompt, 20, stop_token_ids=[tok.eos_token_id]).tokens == base.tokens
        oracle = OracleProposer(base.tokens, len(prompt), model.config.vocab_size, wrong_every=2)
        spec = spec_generate(model, oracle, prompt, 20, block_size=block_size, stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == base.tokens
        assert spec.tau > 1.5


@pytest.mark.slow
def test_shipped_drafter_through_hf_generate_reproduces_the_target(smollm2):
    """The issue's call: target.generate(ids, assistant_model=DFlashAssistant(DFlashDrafter.from_pretrained(path)),
    speculation_type="dflash", do_sample=False) on the embedded target (fp32)."""
    model, tok, prompts = smollm2
    path = default_drafter_path()
    assistant = DFlashAssistant(DFlashDrafter.from_pretrained(path, dtype=torch.float32))
    for prompt in prompts:
        base = target_generate(model, prompt, 24, stop_token_ids=[tok.eos_token_id])
        out = model.generate(torch.tensor([prompt]), assistant_model=assistant, speculation_type="dflash",
                             do_sample=False, max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == base.tokens


@pytest.mark.slow
@pytest.mark.parametrize("drafter_dtype", [torch.float32, torch.bfloat16])
def test_shipped_drafter_with_its_draft_vocabulary_reproduces_the_target(smollm2, drafter_dtype):
    """The shipped drafter in our loop (its 16,384-token draft vocabulary, B = 3 and its trained
    block size), in fp32 or in bf16 beside the fp32 target: greedy output equals the target
    alone's, one prompt and the batch of both, and the drafter drafts well in either dtype."""
    model, tok, prompts = smollm2
    path = default_drafter_path()
    drafter = DFlashDrafter.from_pretrained(path, dtype=drafter_dtype)
    assert drafter.draft_vocab is not None and drafter.draft_vocab.numel() == 16384
    stops = [tok.eos_token_id]
    bases = [target_generate(model, prompt, 24, stop_token_ids=stops).tokens for prompt in prompts]
    for prompt, base in zip(prompts, bases):
        for block_size in (3, drafter.config.block_size):
            spec = spec_generate(model, drafter, prompt, 24, block_size=block_size, stop_token_ids=stops)
            assert spec.tokens == base
        assert spec.tau > 1.3  # a trained drafter's acceptance, not a random one's (tau ~ 1)
    assert [r.tokens for r in spec_generate(model, drafter, prompts, 24, stop_token_ids=stops)] == bases
