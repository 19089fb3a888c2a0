"""Qwen3 / Qwen2 / Llama decoder, HF checkpoint load/save, KV cache, logical sharding, LoRA adapters, FP8
weights for decoding (``quantization``)."""

from rstar2jax.models import (  # the modules: LoRA math, PEFT folders and their config, FP8 weights
    attention,  # the module: attention.attention, .resolve_attention, .auto_choice
    exact,  # the module: exact numerics (ModelConfig.numerics="exact")
    exact_kernels,  # the module: exact numerics' Pallas kernels and their choice (ModelConfig.exact_kernels)
    lora,
    peft_adapter,
    peft_config,
    quantization,
    segments,  # the module: segment_starts, segment_ends of packed rows
)
from rstar2jax.models.config import (
    ATTENTION_IMPLEMENTATIONS,
    REMAT_POLICIES,
    ModelConfig,
    RolloutPrecision,
    config_from_hf,
    config_to_hf,
)
from rstar2jax.models.hf_checkpoint import load_pretrained, save_pretrained
from rstar2jax.models.kv_cache import KVCache, init_cache
from rstar2jax.models.logprobs import token_logprobs_and_entropy
from rstar2jax.models.lora import LORA_TARGETS, LoraConfig
from rstar2jax.models.params import ParamSpec, param_logical_axes, param_specs
from rstar2jax.models.presets import HF_CONFIGS_DIR, PRESETS, QWEN3_TOKENIZER_DIR, TINY, preset
from rstar2jax.models.sharding import (
    CACHE_LOGICAL_AXES,
    CACHE_VALUE_LOGICAL_AXES,
    LOGICAL_RULES,
    MESH_AXES,
    batch_sharding,
    cache_shapes,
    cache_sharding,
    constrain,
    logical_sharding,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_params,
)
from rstar2jax.models.transformer import (
    forward,
    forward_hidden,
    hidden_states,
    init_params,
    layers_are_unstacked,
    output_head,
    rope_inverse_frequencies,
    sequence_logprobs,
    token_logprobs,
    unstack_layers,
)

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "LORA_TARGETS",
    "LoraConfig",
    "lora",
    "peft_adapter",
    "peft_config",
    "quantization",
    "REMAT_POLICIES",
    "attention",
    "segments",
    "exact",
    "exact_kernels",
    "hidden_states",
    "output_head",
    "sequence_logprobs",
    "token_logprobs_and_entropy",
    "CACHE_LOGICAL_AXES",
    "HF_CONFIGS_DIR",
    "PRESETS",
    "QWEN3_TOKENIZER_DIR",
    "TINY",
    "preset",
    "CACHE_VALUE_LOGICAL_AXES",
    "LOGICAL_RULES",
    "MESH_AXES",
    "KVCache",
    "ModelConfig",
    "RolloutPrecision",
    "ParamSpec",
    "batch_sharding",
    "cache_shapes",
    "cache_sharding",
    "config_from_hf",
    "config_to_hf",
    "constrain",
    "forward",
    "forward_hidden",
    "init_cache",
    "init_params",
    "layers_are_unstacked",
    "load_pretrained",
    "logical_sharding",
    "logical_to_spec",
    "make_mesh",
    "param_logical_axes",
    "param_shardings",
    "param_specs",
    "rope_inverse_frequencies",
    "save_pretrained",
    "shard_params",
    "token_logprobs",
    "unstack_layers",
]
