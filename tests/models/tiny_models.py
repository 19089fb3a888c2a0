"""Tiny random Qwen3 / Qwen2 / Llama models built offline with transformers, saved as HF checkpoints."""

import numpy as np
import torch
import transformers

# Each family exercises its own features: Qwen3 q/k norms with head_dim * heads != hidden and tied embeddings,
# Qwen2 q/k/v biases, Llama untied embeddings, multi-query attention and llama3 RoPE scaling (the original
# context of 64 makes the scaling act on the low frequencies of head_dim 16).
_SHARED = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
# fmt: off
TINY_HF_CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(
        **_SHARED, intermediate_size=128, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **_SHARED, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "llama": lambda: transformers.LlamaConfig(
        **_SHARED, intermediate_size=96, num_key_value_heads=1, tie_word_embeddings=False,
        max_position_embeddings=512, rope_scaling=_LLAMA3_ROPE,
    ),
}
# fmt: on
FAMILIES = tuple(TINY_HF_CONFIGS)


def build_tiny_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eager-attention model with every weight random (biases and norms too, so they matter)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        TINY_HF_CONFIGS[family](), attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model.eval()


class TinyModel:
    """A tiny HF model, its checkpoint directory and a reference-logits helper."""

    def __init__(self, family: str, path):
        self.family = family
        self.torch_model = build_tiny_hf_model(family)
        self.path = path
        self.torch_model.save_pretrained(path)

    def reference_logits(self, tokens) -> np.ndarray:
        """transformers' float32 logits ``[T, vocab]`` of one unpadded sequence ``[T]``."""
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        with torch.no_grad():
            return self.torch_model(tokens[None]).logits[0].numpy()
