"""Qwen3 / Qwen2 / Llama decoder, HF checkpoint load/save, KV cache, logical sharding."""

from rstar2jax.models.config import ModelConfig, config_from_hf, config_to_hf
from rstar2jax.models.hf_checkpoint import load_pretrained, save_pretrained
from rstar2jax.models.params import ParamSpec, param_logical_axes, param_specs
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
    KVCache,
    forward,
    init_cache,
    init_params,
    layers_are_unstacked,
    rope_inverse_frequencies,
    token_logprobs,
    unstack_layers,
)

__all__ = [
    "CACHE_LOGICAL_AXES",
    "CACHE_VALUE_LOGICAL_AXES",
    "LOGICAL_RULES",
    "MESH_AXES",
    "KVCache",
    "ModelConfig",
    "ParamSpec",
    "batch_sharding",
    "cache_shapes",
    "cache_sharding",
    "config_from_hf",
    "config_to_hf",
    "constrain",
    "forward",
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
