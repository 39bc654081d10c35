"""Which keys each drafter layer's block queries see, as SGLang (PR 34524), vLLM
(`_dflash_layer_causal`), TensorRT-LLM and the authors' code resolve it: a top-level
`is_causal`, else `dflash_config.is_causal`, else `dflash_config.causal` sets every layer;
otherwise a sliding_attention layer is causal and a full_attention layer bidirectional.

Causal layer (window W, 0 = none): the query at position p sees the keys at positions
p - W < k <= p over [context ; block]. Bidirectional: the last W context rows (all if 0) and
the whole block. A tiny 4-layer drafter alternating sliding (W = 3) and full layers, a
context longer than the window, fp32, random weights: the inference step (reference and
fused attention) and the training forward at every anchor equal a plain per-layer attention
under masks written out here from positions alone."""
import json

import pytest
import torch

from dflash_ext import DFlashAssistant, DFlashConfig, DFlashDrafter
from dflash_ext.testing.targets import tiny_target, tiny_target_config
from python_tests.model.plain_reference import (H, K_FEATS, authors_visible, config_json, our_draft_step,
                                                  plain_draft_step, random_drafter)

LAYER_TYPES = ["sliding_attention", "full_attention"] * 2
WINDOW, BLOCK, CONTEXT = 3, 4, 12
INNER = {"target_layer_ids": [1, 4], "mask_token_id": 99}

# Bidirectional sliding layers with a window have a symmetric window per query
# (test_a_bidirectional_window_is_symmetric_per_query): the bidirectional cases here keep the
# sliding layer types without their window.
NO_WINDOW = {"use_sliding_window": False}
# name -> (extra config.json fields, the causality of each layer they mean, each layer's window)
CASES = {
    "default rule": ({}, [True, False, True, False], [WINDOW, 0] * 2),
    "is_causal true": ({"is_causal": True}, [True] * 4, [WINDOW, 0] * 2),
    "is_causal false": ({"is_causal": False, **NO_WINDOW}, [False] * 4, [0] * 4),
    "dflash_config.causal true": ({"dflash_config": dict(INNER, causal=True)}, [True] * 4, [WINDOW, 0] * 2),
    "dflash_config.is_causal false": ({"dflash_config": dict(INNER, is_causal=False), **NO_WINDOW}, [False] * 4,
                                      [0] * 4),
}


def mixed_config(extra):
    return config_json(None, LAYER_TYPES, WINDOW, num_layers=4, **extra)


def visible_keys(causal, windows, n_ctx):
    """The mask of each layer from positions alone: context rows 0..n_ctx-1, block from n_ctx."""
    def visible(layer, query_pos, key_pos):
        w = windows[layer]
        if causal[layer]:
            mask = key_pos <= query_pos
            return mask & (query_pos - key_pos < w) if w else mask
        if not w:
            return torch.ones(query_pos.shape[0], key_pos.shape[1], dtype=torch.bool)
        return (key_pos >= n_ctx - w).expand(query_pos.shape[0], -1)  # the last w context rows + the block

    return visible


def inputs(seed=1, n=CONTEXT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, K_FEATS * H, generator=g), torch.randn(BLOCK, H, generator=g)


@pytest.mark.parametrize("name", CASES)
def test_layer_causality_follows_the_engines_rule(name):
    extra, causal, windows = CASES[name]
    assert DFlashConfig.from_json_dict(mixed_config(extra)).layer_causal == causal


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_draft_step_equals_explicit_masks(name, fused):
    extra, causal, windows = CASES[name]
    d = mixed_config(extra)
    drafter = random_drafter(d)
    feats, block = inputs()
    with torch.no_grad():
        ours = our_draft_step(drafter, feats, block, CONTEXT, fused)
        ref = plain_draft_step(drafter, d, feats, block, CONTEXT, visible_keys(causal, windows, CONTEXT))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_draft_window_caps_causal_layers_per_query(fused):
    """draft_window=2 caps every layer: causal ones to p - 2 < k <= p, bidirectional ones to
    the last 2 context rows (and the whole block)."""
    extra, causal, _ = CASES["default rule"]
    d = mixed_config(extra)
    drafter = random_drafter(d)
    feats, block = inputs()
    with torch.no_grad():
        ours = our_draft_step(drafter, feats, block, CONTEXT, fused, draft_window=2)
        ref = plain_draft_step(drafter, d, feats, block, CONTEXT, visible_keys(causal, [2] * 4, CONTEXT))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_training_forward_equals_explicit_masks_and_inference_at_every_anchor(name):
    extra, causal, windows = CASES[name]
    d = mixed_config(extra)
    drafter = random_drafter(d)
    feats, _ = inputs(n=CONTEXT + BLOCK)
    anchors = torch.tensor([1, 2, 5, 9, CONTEXT])  # inside and past the window
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(len(anchors), BLOCK, H, generator=g)
    with torch.no_grad():
        hidden = drafter(feats, embeds, anchors)
        for a, p in enumerate(anchors.tolist()):
            ref = plain_draft_step(drafter, d, feats[:p], embeds[a], p, visible_keys(causal, windows, p))
            torch.testing.assert_close(hidden[a], ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden[a], our_draft_step(drafter, feats[:p], embeds[a], p, fused=False),
                                       rtol=1e-4, atol=1e-5)


def test_the_masks_change_the_function():
    """The cases above could pass vacuously if causality did not matter for these inputs."""
    d = mixed_config({})
    drafter = random_drafter(d)
    feats, block = inputs()
    with torch.no_grad():
        default = plain_draft_step(drafter, d, feats, block, CONTEXT,
                                   visible_keys(CASES["default rule"][1], [WINDOW, 0] * 2, CONTEXT))
        bidirectional = plain_draft_step(drafter, d, feats, block, CONTEXT, visible_keys([False] * 4, [WINDOW, 0] * 2,
                                                                                         CONTEXT))
    assert (default - bidirectional).abs().max() > 1e-2


@pytest.mark.parametrize("top,inner,want", [
    (False, {"is_causal": True, "causal": True}, False),  # top-level is_causal first
    (None, {"is_causal": True, "causal": False}, True),   # then dflash_config.is_causal
    (None, {"causal": False}, False),                     # then dflash_config.causal
    (None, {"is_causal": None, "causal": None}, None),    # else by layer type
])
def test_the_first_explicit_field_wins(top, inner, want):
    c = DFlashConfig.from_json_dict(mixed_config({"is_causal": top, "dflash_config": dict(INNER, **inner),
                                                  **(NO_WINDOW if want is False else {})}))
    assert c.causal is want
    assert c.layer_causal == ([want] * 4 if want is not None else CASES["default rule"][1])


SYMMETRIC = {"is_causal false": {"is_causal": False}, "dflash_config.causal false": {"dflash_config": dict(INNER, causal=False)}}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", SYMMETRIC)
def test_a_bidirectional_window_is_symmetric_per_query(name, fused):
    """The engines (and the authors' code: authors_visible) give a bidirectional sliding layer
    a symmetric per-query window, |p - k| < W, as DFlash2's published configs have on every
    layer: the inference step (the fused path runs those layers unfused) and the training
    forward at every anchor follow it, a context longer than the window."""
    d = mixed_config(SYMMETRIC[name])
    symmetric = authors_visible(mixed_config(SYMMETRIC["is_causal false"]))  # the authors read the top level
    c = DFlashConfig.from_json_dict(d)
    assert c.layer_symmetric_window == [True, False] * 2
    drafter = random_drafter(d)
    feats, block = inputs()
    with torch.no_grad():
        ours = our_draft_step(drafter, feats, block, CONTEXT, fused)
        torch.testing.assert_close(ours, plain_draft_step(drafter, d, feats, block, CONTEXT, symmetric),
                                   rtol=1e-4, atol=1e-4)
        # the window matters: the last-W-context-rows rule of the other bidirectional layers differs
        last_rows = plain_draft_step(drafter, d, feats, block, CONTEXT, visible_keys([False] * 4, [WINDOW, 0] * 2,
                                                                                     CONTEXT))
        assert (ours - last_rows).abs().max() > 1e-2
        feats, _ = inputs(n=CONTEXT + BLOCK)
        anchors = torch.tensor([1, 2, 5, 9, CONTEXT])
        embeds = torch.randn(len(anchors), BLOCK, H, generator=torch.Generator().manual_seed(2))
        hidden = drafter(feats, embeds, anchors)
        for a, p in enumerate(anchors.tolist()):
            torch.testing.assert_close(hidden[a], plain_draft_step(drafter, d, feats[:p], embeds[a], p, symmetric),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_causality_round_trips_through_a_checkpoint(name, tmp_path):
    """Saved as the top-level is_causal every engine reads first (nothing for the default rule)."""
    extra, causal, windows = CASES[name]
    drafter = random_drafter(mixed_config(extra))
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("is_causal") == (None if name == "default rule" else causal[0])
    assert "causal" not in saved["dflash_config"] and "is_causal" not in saved["dflash_config"]
    again = DFlashDrafter.from_pretrained(str(tmp_path))
    assert again.config == drafter.config and again.config.layer_causal == causal


def test_engine_fields_at_their_neutral_values_load():
    d = mixed_config({"add_swa_attention_sink_bias": False, "is_neox_style": True, "use_aux_hidden_state": True,
                      "logit_scale": 1.0, "rope_is_neox_style": True,
                      "dflash_config": dict(INNER, attention_sink_bias=False, use_swa=False, swa_window_size=None)})
    assert DFlashConfig.from_json_dict(d).layer_causal == CASES["default rule"][1]


def test_a_fresh_drafter_can_be_made_causal():
    c = DFlashConfig.for_target(tiny_target_config(), num_layers=2, block_size=4, causal=True)
    assert c.layer_causal == [True, True] and c.to_json_dict()["is_causal"] is True
    with pytest.raises(ValueError, match="causal must be true, false or None"):
        DFlashConfig.for_target(tiny_target_config(), num_layers=2, block_size=4, causal="yes")


@pytest.mark.parametrize("fused", [False, True])
def test_hf_generate_with_a_mixed_causal_drafter_is_lossless(fused):
    """transformers builds its DFlashCache from the assistant's config (sliding layer types
    included); drafting goes through draft_hidden, so the per-layer causality follows."""
    from dflash_ext import target_generate

    target = tiny_target()
    drafter = DFlashDrafter.from_target(target.config, num_layers=4, block_size=BLOCK, sliding_window=WINDOW,
                                        layer_types=LAYER_TYPES)
    assert drafter.config.layer_causal == CASES["default rule"][1]
    prompt = list(range(40, 61))
    out = target.generate(torch.tensor([prompt]), assistant_model=DFlashAssistant(drafter, target, fused=fused),
                          speculation_type="dflash", max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == target_generate(target, prompt, 20).tokens
