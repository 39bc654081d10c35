"""A drafter fits every target family a published drafter serves: ``from_target`` shapes it
as the authors' drafters are (Qwen3 layers, full rotary at the target's theta, the text
config of composite configs, the published head shapes), the target features are the
decoder layers' outputs whichever path reads them, and the block embedding is the one
transformers' DFlash path uses (no ``embed_norm``, any scale kept)."""
from types import SimpleNamespace

import pytest
import torch

from dflash_ext import DFlashConfig, DFlashDrafter, DFlashProposer, choose_block_size, spec_generate, target_generate
from dflash_ext.decode.runner import TargetRunner
from dflash_ext.draft.head import block_embedding
from dflash_ext.model.config import target_text_config
from dflash_ext.testing.targets import COMPOSITE, FAMILIES, composite_config, target_config, tiny_family_target
from dflash_ext.training.data import target_features
from dflash_ext.training.loss import FrozenTargetParts


@pytest.mark.parametrize("family", FAMILIES)
def test_from_target_config_fits_each_family(family, tmp_path):
    config = target_config(family)
    c = DFlashConfig.for_target(config, num_layers=2, block_size=4)
    DFlashDrafter(c).save_pretrained(str(tmp_path))  # the reference format holds it
    assert DFlashDrafter.from_pretrained(str(tmp_path)).config == c
    rope = c.rope_parameters
    # full rotary whatever the target's partial rotary; Qwen3 text rope fields only
    assert not {"partial_rotary_factor", "mrope_section", "mrope_interleaved"} & set(rope)
    target_rope = config.rope_parameters
    if family == "gemma4":  # rope per layer type: the full-attention layers' theta, proportional -> default
        target_rope = target_rope["full_attention"]
        assert rope["rope_type"] == "default"
    else:
        assert rope["rope_type"] == target_rope["rope_type"]
    assert rope["rope_theta"] == target_rope["rope_theta"]
    if family == "gpt_oss":
        assert rope["factor"] == target_rope["factor"]  # scaling (yarn) kept
    # the tiny targets' heads (4 of 16, 2 KV) are under the caps: kept; MLA reads v_head_dim (16 here too)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2 if family != "deepseek_v3" else 4, 16)
    assert (c.hidden_size, c.vocab_size, c.num_target_layers) == (config.hidden_size, config.vocab_size,
                                                                 config.num_hidden_layers)
    if family in COMPOSITE:  # a composite config gives the drafter of its text config
        composite = composite_config(family)
        assert DFlashConfig.for_target(composite, num_layers=2, block_size=4) == c
        DFlashDrafter(c).check_fits(composite)


def test_check_fits_reads_the_text_config_of_a_composite_config():
    composite = composite_config("gemma4")
    other = DFlashDrafter.from_target(target_config("gemma4", num_hidden_layers=2), num_layers=1, block_size=4)
    other.config.hidden_size = 96
    with pytest.raises(ValueError, match="hidden size 96 != target's 64"):
        other.check_fits(composite)
    assert target_text_config(composite) is composite.text_config


def test_published_drafter_shapes():
    """Real-size configs (no weights): the drafter's heads are the published drafters'."""
    import transformers as tf

    gemma = tf.Gemma4TextConfig(hidden_size=5376, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
                                head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
                                attention_k_eq_v=True, intermediate_size=21504, vocab_size=262144,
                                hidden_size_per_layer_input=0)
    c = DFlashConfig.for_target(gemma)  # z-lab/gemma-4-31B-it-DFlash: 64 heads of 128, 8 KV heads, theta 1e6
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta) == (64, 8, 128, 1e6)
    qwen35 = tf.Qwen3_5TextConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                                  head_dim=256, intermediate_size=12288, vocab_size=248320,
                                  rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                                       mrope_section=[11, 11, 10], mrope_interleaved=True))
    c = DFlashConfig.for_target(qwen35)  # z-lab/Qwen3.5-9B-DFlash: 32 heads (of 128), target layers 1..29
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    assert c.target_layer_ids == [1, 8, 15, 22, 29]
    qwen3 = tf.Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, vocab_size=151936)
    c = DFlashConfig.for_target(qwen3)  # z-lab/Qwen3-8B-DFlash-b16: the target's own attention shape
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (32, 8, 128, 12288)


@pytest.mark.parametrize("family", FAMILIES + ("gemma4-composite",))
def test_features_are_the_decoder_layer_outputs(family):
    """HF hidden_states[l + 1] is decoder layer l's output for every family, composite
    models included (the last entry is final-normed: the default layers stop at L - 3), and
    the loop (TargetRunner, which selects the layers) and training (target_features, the
    decoder alone) read the same."""
    target = tiny_family_target(family.split("-")[0], composite=family.endswith("-composite"))
    layers = target.get_decoder().layers
    L = len(layers)
    assert L == target_text_config(target.config).num_hidden_layers
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(layers)]
    ids = torch.tensor([5, 17, 33, 2, 9, 11, 40, 3])
    ids_layers = list(range(L - 1))
    try:
        _, hs, _ = TargetRunner(target, ids_layers)(ids[None], None)
    finally:
        for h in hooks:
            h.remove()
    for l in ids_layers:
        assert torch.equal(hs[l + 1], outs[l]), l
    feats = target_features(target, ids, ids_layers)
    assert torch.equal(feats, torch.cat([outs[l][0] for l in ids_layers], -1))


def test_a_composite_target_runs_through_spec_generate_and_choose_block_size():
    """Gemma4ForConditionalGeneration (its config has no text fields of its own): the loop,
    the block-size choice (which times verify passes) and the proposer all see through it."""
    target = tiny_family_target("gemma4", composite=True, num_hidden_layers=2)
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    drafter.acceptance_profile = [0.9, 0.8, 0.7]
    choice = choose_block_size(target, drafter, context_len=8, candidates=(1, 4), stream_linears=False)
    assert set(choice.tokens_per_second) == {1, 4}
    prompt = list(range(40, 52))
    assert spec_generate(target, drafter, prompt, 10, block_size=4).tokens == target_generate(target, prompt, 10).tokens


class _NormedEmbedding(torch.nn.Embedding):
    """An embedding with a normaliser after the lookup, as some transformers models have."""

    def __init__(self, base: torch.nn.Embedding):
        super().__init__(base.num_embeddings, base.embedding_dim)
        self.weight = base.weight
        self.embed_norm = torch.nn.RMSNorm(base.embedding_dim, eps=1e-6)
        torch.nn.init.normal_(self.embed_norm.weight)

    def forward(self, ids):
        return self.embed_norm(super().forward(ids))


def test_block_embedding_is_the_one_transformers_dflash_path_uses():
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    ids = torch.tensor([[3, 7, 7, 250]])
    gemma = tiny_family_target("gemma4", num_hidden_layers=2)
    scaled = gemma.get_input_embeddings()  # Gemma's sqrt(H) scale stays: transformers keeps it too
    assert block_embedding(gemma) is scaled
    target = tiny_family_target("llama", num_hidden_layers=2)
    target.model.embed_tokens = normed = _NormedEmbedding(target.model.embed_tokens)
    theirs = DFlashTokenCandidateGenerator._get_noise_embeds(SimpleNamespace(main_model_input_embeddings=normed), ids)
    view = block_embedding(target)
    assert torch.equal(view(ids), theirs) and torch.equal(view(ids), torch.nn.functional.embedding(ids, normed.weight))
    assert not torch.equal(normed(ids), theirs)  # the target's own embedding keeps its norm
    assert view.weight is normed.weight
    drafter = DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    assert torch.equal(DFlashProposer(drafter, target, capacity=32).runtime.embed(ids), theirs)
    assert torch.equal(FrozenTargetParts(target).embed(ids), theirs)
