"""Tiny random targets of every model family a published DFlash drafter serves, as
transformers 5.x implements them: fp32, seeded, hidden 64, 4 layers, a vocab of 256
(bench.rollback builds larger ones of the same families).

Sliding windows are small (`SLIDING_WINDOW` tokens) so that a short generation runs past
them, and the hybrids mix linear-attention and full-attention layers. What each family puts
in its cache (the layer kinds a rollback must handle), as transformers 5.25 builds it:

| family       | causal-LM class          | cache layer kinds                                        |
|--------------|--------------------------|----------------------------------------------------------|
| llama        | LlamaForCausalLM         | full attention                                           |
| qwen3        | Qwen3ForCausalLM         | full attention                                           |
| qwen3_moe    | Qwen3MoeForCausalLM      | full attention                                           |
| deepseek_v3  | DeepseekV3ForCausalLM    | full attention (MLA: K and V of different widths)        |
| gpt_oss      | GptOssForCausalLM        | sliding window + full attention                          |
| gemma4       | Gemma4ForCausalLM (text) | sliding window + full attention                          |
| qwen3_next   | Qwen3NextForCausalLM     | linear attention (conv + recurrent state) + full         |
| qwen3_5      | Qwen3_5ForCausalLM (text)| linear attention (conv + recurrent state) + full         |
| qwen3_5_moe  | Qwen3_5MoeForCausalLM    | linear attention (conv + recurrent state) + full         |

In transformers' DynamicCache: full = DynamicLayer, sliding window = DynamicSlidingWindowLayer,
linear attention = LinearAttentionLayer. Composite configs (qwen3_5, gemma4 and their
vision/audio parts) are built from their text config, whose causal-LM class is the text-only
model a drafter's target runs as.
"""
import torch

SLIDING_WINDOW = 6
HIDDEN = 64
VOCAB = 256

# Families whose cache holds only layers that crop (no rollback beyond `crop`).
CROPPABLE = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")
SLIDING = ("gpt_oss", "gemma4")
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
FAMILIES = CROPPABLE + SLIDING + HYBRID
# Families of other published checkpoints (GLM-4.5/4.6, MiniMax-M2, Kimi-Linear, MiniMax-01,
# DeepSeek-V3.2): what spec_generate makes of them (python_tests/decode/test_target_families.py).
OTHER_FAMILIES = ("glm4_moe", "minimax_m2", "kimi_linear", "minimax", "deepseek_v32")

_SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2)


def target_config(family: str, num_hidden_layers: int = None, vocab_size: int = VOCAB, hidden_size: int = HIDDEN,
                  sliding_window: int = SLIDING_WINDOW, full_attention_interval: int = 2,
                  max_position_embeddings: int = 512, **fields):
    """The config of one family (see the module table): tiny by default; every width follows
    `hidden_size` (4 query heads of hidden/4, 2 K/V heads; the benchmarks scale it up).
    Sliding families alternate sliding and full layers; the hybrids put a full-attention layer
    every `full_attention_interval` layers (Qwen3.5 and Qwen3-Next: 4), the rest Gated DeltaNet.
    `fields`: other fields of the family's config, set on it (e.g. intermediate_size); one it
    does not have is an error."""
    config = _family_config(family, num_hidden_layers, vocab_size, hidden_size, sliding_window,
                            full_attention_interval, max_position_embeddings)
    for key, value in fields.items():
        if not hasattr(config, key):
            raise ValueError(f"{type(config).__name__} has no field {key!r}")
        setattr(config, key, value)
    return config


def _family_config(family, num_hidden_layers, vocab_size, hidden_size, sliding_window, full_attention_interval,
                   max_position_embeddings):
    import transformers as tf

    n = num_hidden_layers or 4
    d = hidden_size // 4  # head width
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=n, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    moe = dict(_SMALL_MOE, moe_intermediate_size=hidden_size // 2)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if family == "llama":
        return tf.LlamaConfig(**common, intermediate_size=2 * hidden_size, head_dim=d)
    if family == "qwen3":
        return tf.Qwen3Config(**common, intermediate_size=2 * hidden_size, head_dim=d)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=2 * hidden_size, head_dim=d, **moe)
    if family == "deepseek_v3":
        mla = dict(common, num_key_value_heads=4)  # MLA: one K/V head per query head
        return tf.DeepseekV3Config(**mla, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                                   topk_group=1, first_k_dense_replace=1, kv_lora_rank=hidden_size // 2,
                                   q_lora_rank=hidden_size // 2, qk_rope_head_dim=d // 2, qk_nope_head_dim=d,
                                   v_head_dim=d)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=hidden_size, head_dim=d, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=sliding_window, layer_types=alternating,
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                                    beta_slow=1.0, truncate=False,
                                                    original_max_position_embeddings=max_position_embeddings // 8))
    if family == "gemma4":
        return tf.Gemma4TextConfig(**common, intermediate_size=2 * hidden_size, head_dim=d, global_head_dim=2 * d,
                                   sliding_window=sliding_window, vocab_size_per_layer_input=vocab_size,
                                   hidden_size_per_layer_input=d // 2, layer_types=alternating)
    if family in HYBRID:
        cls = {"qwen3_next": tf.Qwen3NextConfig, "qwen3_5": tf.Qwen3_5TextConfig,
               "qwen3_5_moe": tf.Qwen3_5MoeTextConfig}[family]
        extra = dict(moe, shared_expert_intermediate_size=hidden_size // 2) if family != "qwen3_5" else {}
        if family != "qwen3_5_moe":
            extra["intermediate_size"] = 2 * hidden_size
        layers = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(n)]
        return cls(**common, head_dim=d, layer_types=layers, linear_conv_kernel_dim=4, linear_key_head_dim=d,
                   linear_value_head_dim=d, linear_num_key_heads=2, linear_num_value_heads=4, **extra)
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**common, intermediate_size=2 * hidden_size, head_dim=d, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=hidden_size // 2)
    if family == "minimax_m2":
        return tf.MiniMaxM2Config(**common, intermediate_size=hidden_size, head_dim=d, num_local_experts=4,
                                  num_experts_per_tok=2)
    if family == "minimax":  # lightning (linear) attention layers among full ones
        return tf.MiniMaxConfig(**common, intermediate_size=2 * hidden_size, head_dim=d, num_local_experts=4,
                                num_experts_per_tok=2, block_size=4, layer_types=[
                                    "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                                    for i in range(n)])
    mla = dict(common, num_key_value_heads=4, kv_lora_rank=hidden_size // 2, qk_rope_head_dim=d // 2,
               qk_nope_head_dim=d, v_head_dim=d, n_routed_experts=4, num_experts_per_tok=2)
    if family == "kimi_linear":  # Kimi Delta Attention (conv + recurrent state) among MLA layers
        mla.pop("n_routed_experts")  # its experts are num_local_experts; its token ids are past a tiny vocab
        mla.update(num_local_experts=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return tf.KimiLinearConfig(**mla, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                                   q_lora_rank=None, linear_head_dim=d, linear_num_heads=4, layer_types=[
                                       "full_attention" if (i + 1) % full_attention_interval == 0
                                       else "linear_attention" for i in range(n)])
    if family == "deepseek_v32":  # DSA: an indexer keeps the top index_topk keys per query
        return tf.DeepseekV32Config(**mla, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                                    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=hidden_size // 2,
                                    index_topk=8, index_head_dim=d, index_n_heads=2)
    raise ValueError(f"no tiny config for family {family!r}; known: {', '.join(FAMILIES + OTHER_FAMILIES)}")


# The families whose checkpoints ship a composite (multimodal) config around the text one.
COMPOSITE = ("gemma4", "qwen3_5", "qwen3_5_moe")


def composite_config(family: str, **config):
    """The composite config a checkpoint of `family` ships, around ``target_config(family,
    **config)`` (see COMPOSITE): AutoModelForCausalLM builds Gemma4ForConditionalGeneration
    from it (a target whose own config has no text fields), the Qwen3.5 text model from Qwen3.5's."""
    import transformers as tf

    text = target_config(family, **config).to_dict()
    if family == "gemma4":
        return tf.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    if family in ("qwen3_5", "qwen3_5_moe"):
        cls = tf.Qwen3_5Config if family == "qwen3_5" else tf.Qwen3_5MoeConfig
        return cls(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                        out_hidden_size=text["hidden_size"]))
    raise ValueError(f"family {family!r} has no composite config; those that do: {', '.join(COMPOSITE)}")


def tiny_family_target(family: str, seed: int = 0, sharpen: float = 20.0, dtype=torch.float32, composite: bool = False,
                       **config):
    """A ready causal LM of `family` (random weights, eval mode) of ``target_config(family,
    **config)`` (`composite`: of :func:`composite_config`). `sharpen` scales the LM head:
    sharper logits than the default init, so that greedy decoding does not hinge on near ties
    that differ between a one-token pass and a block pass."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config((composite_config if composite else target_config)(family, **config),
                                             dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model.eval()


# The decoding tests' target (a llama or qwen3 one, mostly): 6 layers, a vocabulary of 128 and an
# MLP of 128 whatever the width.
DECODING_TEST_SIZE = dict(num_hidden_layers=6, vocab_size=128, intermediate_size=128)


def tiny_target_config(family: str = "llama", **config):
    """``target_config(family)`` at :data:`DECODING_TEST_SIZE`, `config` overriding it."""
    return target_config(family, **{**DECODING_TEST_SIZE, **config})


def tiny_target(family: str = "llama", seed: int = 0, **config):
    """``tiny_family_target(family, seed)`` at :data:`DECODING_TEST_SIZE`, `config` overriding it."""
    return tiny_family_target(family, seed, **{**DECODING_TEST_SIZE, **config})
