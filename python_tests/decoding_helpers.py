"""Small random Hugging Face targets and proposers for the decoding tests."""
import torch

from dflash_ext.testing import OracleProposer  # noqa: F401  (shared with bench/gpu_e2e.py)


def tiny_target_config(kind="llama", vocab_size=128, hidden_size=64, num_hidden_layers=6):
    from transformers import LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind]
    return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
               num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
               head_dim=hidden_size // 4, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=False)


def tiny_target(kind="llama", seed=0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_target_config(kind, **kw), dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the default init: less tie-breaking noise
        model.get_output_embeddings().weight.mul_(20)
    return model.eval()
