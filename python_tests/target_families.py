"""Tiny random targets of every model family a published DFlash drafter serves, as
transformers 5.x implements them: fp32, seeded, hidden 64, a few layers, a small vocab.

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

Composite configs (qwen3_5, gemma4 and their vision/audio parts) are built from their text
config, whose causal-LM class is the text-only model a drafter's target runs as.
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

_SHARED = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
# The hybrids: small Gated DeltaNet heads and a full-attention layer among linear ones.
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
_HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def target_config(family: str, num_hidden_layers: int = None, vocab_size: int = VOCAB):
    """The tiny config of one family (see the module table)."""
    import transformers as tf

    common = dict(_SHARED, vocab_size=vocab_size)

    if family == "llama":
        return tf.LlamaConfig(**common, intermediate_size=128, num_hidden_layers=num_hidden_layers or 4,
                              head_dim=16)
    if family == "qwen3":
        return tf.Qwen3Config(**common, intermediate_size=128, num_hidden_layers=num_hidden_layers or 4,
                              head_dim=16)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=128, num_hidden_layers=num_hidden_layers or 4,
                                 head_dim=16, **_SMALL_MOE)
    if family == "deepseek_v3":
        mla = dict(common, num_key_value_heads=4)  # MLA: one K/V head per query head
        return tf.DeepseekV3Config(**mla, intermediate_size=128, num_hidden_layers=num_hidden_layers or 4,
                                   moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                                   kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=16)
    if family == "gpt_oss":
        n = num_hidden_layers or 4
        return tf.GptOssConfig(**common, intermediate_size=64, num_hidden_layers=n, head_dim=16,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                                    beta_slow=1.0, truncate=False,
                                                    original_max_position_embeddings=64),
                               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(n)])
    if family == "gemma4":
        n = num_hidden_layers or 4
        return tf.Gemma4TextConfig(**common, intermediate_size=128, num_hidden_layers=n, head_dim=16,
                                   global_head_dim=32, sliding_window=SLIDING_WINDOW,
                                   vocab_size_per_layer_input=vocab_size, hidden_size_per_layer_input=8,
                                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(n)])
    if family in HYBRID:
        layers = _HYBRID_LAYERS[:num_hidden_layers] if num_hidden_layers else _HYBRID_LAYERS
        cls = {"qwen3_next": tf.Qwen3NextConfig, "qwen3_5": tf.Qwen3_5TextConfig,
               "qwen3_5_moe": tf.Qwen3_5MoeTextConfig}[family]
        extra = dict(intermediate_size=128) if family == "qwen3_5" else \
            dict(_SMALL_MOE, shared_expert_intermediate_size=32)
        if family == "qwen3_next":
            extra["intermediate_size"] = 128
        return cls(**common, num_hidden_layers=len(layers), head_dim=16, layer_types=list(layers),
                   **_LINEAR, **extra)
    raise ValueError(f"no tiny config for family {family!r}; known: {', '.join(FAMILIES)}")


def tiny_family_target(family: str, seed: int = 0, num_hidden_layers: int = None, vocab_size: int = VOCAB,
                       sharpen: float = 20.0):
    """A ready causal LM of `family` (random weights, fp32, eval mode). `sharpen` scales the
    LM head: sharper logits than the default init, so that greedy decoding does not hinge on
    near ties that differ between a one-token pass and a block pass."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(family, num_hidden_layers, vocab_size), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model.eval()
