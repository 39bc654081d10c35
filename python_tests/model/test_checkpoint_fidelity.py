"""Every config the authors' Qwen3-based drafter honours computes the same function here:
rope of every type transformers implements (its own rotary embedding is the reference),
per-layer sliding/full attention with the authors' causality (sliding layers causal unless
is_causal says otherwise), and a clear error for fields we do not implement.

The reference (plain_reference.py) is written independently of dflash_ext's drafter:
transformers' Qwen3RotaryEmbedding and apply_rotary_pos_emb, and plain softmax attention
over [context K/V ; block K/V] under the mask the authors' model.py builds."""
import json
import math

import pytest
import torch

from dflash_ext import DFlashConfig, DFlashDrafter, default_drafter_path
from dflash_ext.model.layers import rope_tables

from python_tests.model.plain_reference import (D, H, K_FEATS, config_json, our_draft_step, plain_draft_step,
                                                  random_drafter)

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
                 "long_factor": [2.0 + 0.3 * i for i in range(D // 2)], "factor": 4.0},
}


CASES = [(name, rope, None, None, {}) for name, rope in ROPES.items()] + [
    # sliding layers causal over a window of 5 / 7, full layers bidirectional
    ("mixed sliding/full", ROPES["yarn"], ["sliding_attention", "full_attention"], 5, {}),
    ("sliding/sliding", None, ["sliding_attention", "sliding_attention"], 7, {}),
    ("is_causal true", None, ["sliding_attention", "full_attention"], 5, {"is_causal": True}),
    # transformers drops the window without use_sliding_window: causal over the whole context
    ("sliding, no window", None, ["sliding_attention", "full_attention"], 5, {"use_sliding_window": False}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name,rope,layer_types,window,extra", CASES, ids=[c[0] for c in CASES])
def test_draft_step_equals_an_independent_transformers_reference(name, rope, layer_types, window, extra, fused,
                                                                  dtype):
    d = config_json(rope, layer_types, window, **extra)
    drafter = random_drafter(d, dtype)
    T = 100 if name == "longrope" else 200  # past yarn/llama3's original 128 positions; longrope stays inside
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(T, K_FEATS * H, generator=g).to(dtype)
    block = torch.randn(4, H, generator=g).to(dtype)
    with torch.no_grad():
        ours = our_draft_step(drafter, feats, block, T, fused)
        ref = plain_draft_step(drafter, d, feats, block, T)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)


def test_rope_really_changes_the_function():
    """The cases above would pass vacuously if scaling were ignored on both sides."""
    g = torch.Generator().manual_seed(1)
    feats, block = torch.randn(200, K_FEATS * H, generator=g), torch.randn(4, H, generator=g)
    with torch.no_grad():
        plain = our_draft_step(random_drafter(config_json()), feats, block, 200)
        for name in ("linear", "yarn", "llama3", "dynamic"):
            scaled_d = config_json(ROPES[name])
            scaled = our_draft_step(random_drafter(scaled_d), feats, block, 200)
            if name != "dynamic":  # dynamic equals default below max_position_embeddings
                assert (plain - scaled).abs().max() > 1e-3, name
            else:
                torch.testing.assert_close(plain, scaled)


def test_yarn_scales_cos_and_sin_as_transformers_does():
    drafter = random_drafter(config_json(ROPES["yarn"]))
    cos, _ = rope_tables(drafter.config, 10)
    # position 0: cos = 1 times YaRN's attention factor 0.1 ln(factor) + 1
    assert cos[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-6)


def test_dynamic_and_longrope_past_their_static_range_are_errors():
    for name, limit in (("dynamic", 512), ("longrope", 128)):
        drafter = random_drafter(config_json(ROPES[name]))
        rope_tables(drafter.config, limit)
        with pytest.raises(ValueError, match="recomputes every frequency"):
            rope_tables(drafter.config, limit + 1)


def test_config_round_trip_keeps_rope_and_layer_types(tmp_path):
    d = config_json(ROPES["llama3"], ["sliding_attention", "full_attention"], 9)
    drafter = random_drafter(d)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_scaling"]["rope_type"] == "llama3" and saved["layer_types"] == d["layer_types"]
    again = DFlashDrafter.from_pretrained(str(tmp_path))
    assert again.config.rope_parameters == drafter.config.rope_parameters
    assert again.config.layer_windows == [9, 0]


@pytest.mark.parametrize("fmt", ["rope_parameters", "rope_scaling"])
def test_both_rope_formats_read_alike(fmt):
    d = config_json()
    rope = dict(ROPES["yarn"], rope_theta=50000.0)
    d.pop("rope_theta")
    d[fmt] = rope if fmt == "rope_parameters" else {k: v for k, v in rope.items() if k != "rope_theta"}
    if fmt == "rope_scaling":
        d["rope_theta"] = 50000.0
    c = DFlashConfig.from_json_dict(d)
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_theta == 50000.0


def test_rope_theta_default_is_transformers_default():
    from transformers import Qwen3Config

    d = config_json()
    d.pop("rope_theta")
    assert DFlashConfig.from_json_dict(d).rope_theta == Qwen3Config().rope_parameters["rope_theta"]


def test_sliding_window_needs_use_sliding_window_as_in_transformers():
    d = config_json(None, ["sliding_attention", "full_attention"], 5)
    d["use_sliding_window"] = False
    assert DFlashConfig.from_json_dict(d).layer_windows == [0, 0]


def test_draft_window_override_caps_every_layer():
    from dflash_ext.draft.cache import effective_windows

    c = DFlashConfig.from_json_dict(config_json(None, ["sliding_attention", "full_attention"], 5))
    assert effective_windows(c) == [5, 0]
    assert effective_windows(c, 3) == [3, 3] and effective_windows(c, 64) == [5, 64]
    with pytest.raises(ValueError, match="draft_window"):
        effective_windows(c, 0)


@pytest.mark.parametrize("extra,match", [
    ({"mystery_scale": 2.0}, r"unsupported fields \['mystery_scale'\]"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"is_causal": "yes"}, "is_causal must be true, false or None \\(null\\), got 'yes'"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "causal": 1}},
     "dflash_config.causal must be .*, got 1"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "attention_sink_bias": True}},
     "dflash_config.attention_sink_bias=True"),
    ({"add_swa_attention_sink_bias": True}, "add_swa_attention_sink_bias=True"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "use_swa": True}},
     "dflash_config.use_swa=True"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "swa_window_size": 64}},
     "dflash_config.swa_window_size=64"),
    ({"is_neox_style": False}, "is_neox_style=False"),
    ({"rope_is_neox_style": False}, "rope_is_neox_style=False"),
    ({"use_aux_hidden_state": False}, "use_aux_hidden_state=False"),
    ({"logit_scale": 2.0}, "logit_scale=2.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "conv_kernel_size": 4}},
     r"unsupported dflash_config fields \['conv_kernel_size'\]"),
    ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 99, "input_embedding_scale": 2.0}},
     "dflash_config.input_embedding_scale=2.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                       "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_unsupported_fields_are_rejected_at_load(tmp_path, extra, match):
    d = config_json(**extra)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_json_dict(d)


def test_the_shipped_drafter_computes_the_reference_draft_step():
    """The shipped drafter (dflash_ext/drafters/smollm2-135m), its own weights in fp32: the
    same hidden states as the authors' computation written from transformers' parts."""
    import os

    path = default_drafter_path()
    d = json.load(open(os.path.join(path, "config.json")))
    drafter = DFlashDrafter.from_pretrained(path, dtype=torch.float32).eval()
    c = drafter.config
    assert c.rope_theta == 100000.0 and c.layer_windows == [0] * c.num_hidden_layers
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(300, len(c.target_layer_ids) * c.hidden_size, generator=g)
    block = torch.randn(c.block_size, c.hidden_size, generator=g) * 0.1
    with torch.no_grad():
        torch.testing.assert_close(our_draft_step(drafter, feats, block, 300),
                                   plain_draft_step(drafter, d, feats, block, 300), rtol=1e-4, atol=1e-4)
