"""DeepSpec's format (issue 64): DSpark and DeepSpec-DFlash checkpoints load, save back
exactly, name their bad config values, and draft the blocks an independent reference
(dspark_reference.py, from DeepSpec's description) drafts from the same weights: greedy at
confidence threshold 0 and above it, and sampled with the same generator."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dflash_ext import DFlashConfig, DFlashDrafter
from dflash_ext.draft.dspark import dspark_draft
from python_tests.model.dspark_reference import (BLOCK, VARIANTS, context_features, deepspec_config, random_tensors,
                                                 reference_block, write_deepspec_checkpoint)

WITH_CONFIDENCE = [v for v, (_, _, conf) in VARIANTS.items() if conf is not None]


def checkpoint(tmp_path, variant, dtype=torch.float32, seed=0, edit=None):
    """A DeepSpec checkpoint of `variant` with random weights, its config.json edited by `edit`
    (after the tensors are made: an edited value does not reshape them)."""
    d = deepspec_config(variant, dtype=str(dtype).replace("torch.", ""))
    tensors = random_tensors(d, seed, dtype)
    if edit is not None:
        edit(d)
    return write_deepspec_checkpoint(str(tmp_path / variant), d, tensors), d, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_writes_back_the_checkpoint_it_loaded(tmp_path, variant, dtype):
    path, d, tensors = checkpoint(tmp_path, variant, dtype)
    drafter = DFlashDrafter.from_pretrained(path)
    assert drafter.config.is_deepspec and drafter.fc.weight.dtype == dtype
    assert hasattr(drafter, "markov_head") == (d["markov_rank"] > 0)
    assert hasattr(drafter, "confidence_head") == d["enable_confidence_head"]
    out = str(tmp_path / "saved")
    drafter.save_pretrained(out)
    assert json.load(open(os.path.join(out, "config.json"))) == d
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert set(saved) == set(tensors)
    for name, t in tensors.items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_transformers_5_config_keeps_its_dtype_key(tmp_path):
    def five(d):
        d["dtype"] = d.pop("torch_dtype")
        d["transformers_version"] = "5.25.0"

    path, d, _ = checkpoint(tmp_path, "gated", edit=five)
    DFlashDrafter.from_pretrained(path).save_pretrained(str(tmp_path / "saved"))
    assert json.load(open(tmp_path / "saved" / "config.json")) == d


def test_a_config_as_transformers_saves_deepspecs_draft_config_loads_and_round_trips(tmp_path):
    # DeepSpec builds its draft config as the target's config object with the drafter fields set
    # on it and saves it with save_pretrained: here with the installed transformers
    from transformers import Qwen3Config

    from python_tests.model.dspark_reference import D, H, HKV, HQ, INTERMEDIATE, LAYER_IDS, MASK, RANK, V

    c = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=INTERMEDIATE, num_hidden_layers=6,
                    num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512,
                    rope_theta=1e6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    for key, value in dict(architectures=["Qwen3DSparkModel"], num_target_layers=6, num_hidden_layers=2,
                           block_size=BLOCK, layer_types=["full_attention"] * 2, mask_token_id=MASK,
                           target_layer_ids=LAYER_IDS, num_anchors=512, markov_rank=RANK, markov_head_type="rnn",
                           enable_confidence_head=True, confidence_head_with_markov=True).items():
        setattr(c, key, value)
    path = str(tmp_path / "hf")
    c.save_pretrained(path)
    d = json.load(open(os.path.join(path, "config.json")))
    write_deepspec_checkpoint(path, d, random_tensors(d))
    drafter = DFlashDrafter.from_pretrained(path)
    assert (drafter.config.markov_head_type, drafter.config.block_size, drafter.config.rope_theta) == ("rnn", 7, 1e6)
    drafter.save_pretrained(str(tmp_path / "saved"))
    saved = json.load(open(tmp_path / "saved" / "config.json"))
    assert saved == d  # no dtype key added where the file had none


def test_a_missing_head_tensor_is_named(tmp_path):
    path, d, tensors = checkpoint(tmp_path, "rnn")
    del tensors["markov_head.joint_proj.bias"]
    write_deepspec_checkpoint(path, d, tensors)
    with pytest.raises(ValueError, match=r"markov_head\.joint_proj\.bias"):
        DFlashDrafter.from_pretrained(path)


def test_a_wrongly_shaped_confidence_head_is_named(tmp_path):
    # confidence_head_with_markov false: the head reads h_k alone, a [1, H + r] weight is not it
    path, d, tensors = checkpoint(tmp_path, "vanilla")
    d["confidence_head_with_markov"] = False
    write_deepspec_checkpoint(path, d, tensors)
    with pytest.raises(ValueError, match=r"confidence_head\.proj\.weight"):
        DFlashDrafter.from_pretrained(path)


def _set(**fields):
    return lambda d: d.update(fields)


def _drop(key):
    return lambda d: d.pop(key)


BAD = [
    ("markov_rank", _set(markov_rank=-1)),
    ("markov_rank", _set(markov_rank="8")),
    ("markov_rank", _set(markov_rank=8.0)),
    ("markov_head_type", _set(markov_head_type="lstm")),
    ("markov_head_type", _drop("markov_head_type")),
    ("enable_confidence_head", _set(enable_confidence_head="yes")),
    ("confidence_head_with_markov", _drop("confidence_head_with_markov")),
    ("confidence_head_with_markov", _set(confidence_head_with_markov=1)),
    ("num_anchors", _set(num_anchors=0)),
    ("num_anchors", _drop("num_anchors")),
    ("tie_word_embeddings", _set(tie_word_embeddings=True)),
    ("target_layer_ids", _set(target_layer_ids=[-1, 4])),
    ("target_layer_ids", _set(target_layer_ids=[1, 6])),
    ("target_layer_ids", _set(target_layer_ids=[4, 4])),
    ("mask_token_id", _set(mask_token_id=100)),
    ("block_size", _set(block_size=1)),
    ("block_size", _drop("block_size")),
    ("layer_types", _set(layer_types=["sliding_attention", "full_attention"])),
    ("hidden_act", _set(hidden_act="gelu")),
    ("attention_bias", _set(attention_bias=True)),
    ("rope_theta", _set(rope_theta=-1.0)),
    ("unsupported fields", _set(logit_bias_table=[1])),
    ("dflash_config", _set(dflash_config={"target_layer_ids": [1, 4], "mask_token_id": 99})),
    ("is_causal", _set(is_causal=True)),
    ("Gemma4DSparkModel", _set(architectures=["Gemma4DSparkModel"])),
]


@pytest.mark.parametrize("field,edit", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_config_value_is_an_error_naming_the_field(tmp_path, field, edit):
    path, _, _ = checkpoint(tmp_path, "vanilla", edit=edit)
    with pytest.raises(ValueError, match=field):
        DFlashDrafter.from_pretrained(path)


def test_a_confidence_head_over_the_markov_input_needs_a_markov_head(tmp_path):
    path, _, _ = checkpoint(tmp_path, "confidence_only", edit=_set(confidence_head_with_markov=True))
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        DFlashDrafter.from_pretrained(path)


def test_dspark_fields_need_deepspecs_format():
    d = DFlashConfig.from_json_dict(deepspec_config("vanilla"))
    with pytest.raises(ValueError, match="markov_rank"):
        DFlashConfig(**{**{f: getattr(d, f) for f in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "intermediate_size",
                                                      "vocab_size", "num_target_layers", "target_layer_ids",
                                                      "mask_token_id")}, "markov_rank": 8,
                        "markov_head_type": "vanilla"})


def _compare(ours, ref, temperature=0.0):
    tokens, logits, confidence, q = ref
    assert ours.tokens.tolist() == tokens
    assert ours.logits.shape == (BLOCK, logits.shape[1])
    torch.testing.assert_close(ours.logits.double(), logits, atol=1e-4, rtol=1e-4)
    if confidence is None:
        assert ours.confidence is None
    else:
        torch.testing.assert_close(ours.confidence.double(), confidence, atol=1e-5, rtol=1e-5)
    if temperature == 0:
        assert ours.q is None
    else:
        torch.testing.assert_close(ours.q.double(), q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_drafts_equal_the_reference_block_for_block(tmp_path, variant):
    path, d, tensors = checkpoint(tmp_path, variant)
    drafter = DFlashDrafter.from_pretrained(path).eval()
    feats = context_features()
    for S, anchor in ((3, 5), (7, 42), (11, 99)):  # 99: the mask token, a valid anchor all the same
        ours = dspark_draft(drafter, feats[:S], anchor)
        assert ours.tokens.shape == (BLOCK,)  # every slot drafts at threshold 0
        _compare(ours, reference_block(drafter, d, tensors, feats[:S], anchor))


@pytest.mark.parametrize("variant", WITH_CONFIDENCE)
def test_a_positive_threshold_cuts_the_block_where_the_reference_does(tmp_path, variant):
    path, d, tensors = checkpoint(tmp_path, variant)
    drafter = DFlashDrafter.from_pretrained(path).eval()
    feats = context_features(seed=2)
    kept = set()
    for S, anchor in ((4, 7), (9, 31), (6, 0), (11, 64)):
        # thresholds between the block's own confidences (the reference's): every cut it has
        c = sorted(reference_block(drafter, d, tensors, feats[:S], anchor)[2].tolist())
        for threshold in [c[0] / 2] + [(a + b) / 2 for a, b in zip(c, c[1:])] + [(c[-1] + 1) / 2]:
            ref = reference_block(drafter, d, tensors, feats[:S], anchor, threshold=threshold)
            _compare(dspark_draft(drafter, feats[:S], anchor, confidence_threshold=threshold), ref)
            kept.add(len(ref[0]))
    # the thresholds cut these random blocks somewhere inside, not only whole or empty
    assert kept & set(range(1, BLOCK)), kept


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampled_drafts_equal_the_reference_with_the_same_generator(tmp_path, variant):
    path, d, tensors = checkpoint(tmp_path, variant)
    drafter = DFlashDrafter.from_pretrained(path).eval()
    feats = context_features(seed=3)
    threshold = 0.5 if d["enable_confidence_head"] else 0.0
    for seed in range(3):
        ours = dspark_draft(drafter, feats[:6], 12, temperature=0.8, confidence_threshold=threshold,
                            generator=torch.Generator().manual_seed(seed))
        ref = reference_block(drafter, d, tensors, feats[:6], 12, temperature=0.8, threshold=threshold,
                              generator=torch.Generator().manual_seed(seed))
        _compare(ours, ref, temperature=0.8)


def test_the_markov_head_changes_the_drafts(tmp_path):
    # the same weights without the head: the corrected logits are not the LM head's alone
    path, _, _ = checkpoint(tmp_path, "vanilla")
    drafter = DFlashDrafter.from_pretrained(path).eval()
    feats = context_features()
    draft = dspark_draft(drafter, feats[:5], 3)
    assert not torch.allclose(draft.logits, drafter.lm_head(draft.hidden), atol=1e-3)


def test_drafting_arguments_are_checked(tmp_path):
    path, _, _ = checkpoint(tmp_path, "vanilla")
    drafter = DFlashDrafter.from_pretrained(path)
    feats = context_features()[:4]
    with pytest.raises(ValueError, match="confidence_threshold"):
        dspark_draft(drafter, feats, 1, confidence_threshold=1.5)
    with pytest.raises(ValueError, match="temperature"):
        dspark_draft(drafter, feats, 1, temperature=-1.0)


def test_a_dflash_drafter_is_not_drafted_as_dspark():
    from python_tests.model.plain_reference import config_json, random_drafter

    with pytest.raises(ValueError, match="DeepSpec"):
        dspark_draft(random_drafter(config_json()), torch.zeros(2, 128), 1)

